//! Attention forward and backward on a random problem through the safe API, checked against
//! plain attention computed in float64 right here (`plain_attention`: what the library computes,
//! written out with the full score matrix that flashattn never stores).
//!
//!     cargo run --example attention -- --seq-q 300 --seq-kv 200 --mask causal-bottom-right
//!
//! Exits with status 1 when an error exceeds the bound for the dtype.
use std::process::ExitCode;
use std::time::Instant;

use flashattn::{backward, forward, Bf16, Element, Mask, Options, Tensor, TensorMut, F16};

const HELP: &str = "\
usage: attention [options]
  --batch N          batch size (1)
  --heads-q N        query heads (8)
  --heads-kv N       key/value heads; must divide --heads-q (2)
  --seq-q N          query length (100)
  --seq-kv N         key/value length (150)
  --head-dim N       head dimension, 1..256 (64)
  --mask M           none | causal-top-left | causal-bottom-right (causal-bottom-right)
  --dtype T          f32 | f64 | f16 | bf16 (f32)
  --layout L         bshd | bhsd: memory order of q, k, v, out and gradients (bshd)
  --threads N        CPU threads, 0 = all (0)
  --seed N           random seed (1)";

#[derive(Clone, Copy)]
struct Shape {
    batch: usize,
    heads_q: usize,
    heads_kv: usize,
    seq_q: usize,
    seq_kv: usize,
    head_dim: usize,
}

impl Shape {
    fn q_len(&self) -> usize {
        self.batch * self.heads_q * self.seq_q * self.head_dim
    }
    fn kv_len(&self) -> usize {
        self.batch * self.heads_kv * self.seq_kv * self.head_dim
    }
    fn lse_len(&self) -> usize {
        self.batch * self.heads_q * self.seq_q
    }
}

/// Normal random numbers: SplitMix64 and Box-Muller, so the example needs no crate.
struct Rng(u64);

impl Rng {
    fn uniform(&mut self) -> f64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        ((z ^ (z >> 31)) >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }
    fn normals(&mut self, n: usize) -> Vec<f64> {
        (0..n)
            .map(|_| {
                let (u1, u2) = (1.0 - self.uniform(), self.uniform());
                (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()
            })
            .collect()
    }
}

/// Plain attention in float64 on contiguous [B, H, S, D] arrays, forward and backward, with the
/// full Sq x Skv score matrix of each head: returns [out, lse, dq, dk, dv], where dq, dk, dv are
/// the gradients of sum(out * dout). Query head h reads kv head h / (Hq / Hkv).
#[allow(clippy::too_many_arguments)]
fn plain_attention(
    s: &Shape,
    q: &[f64],
    k: &[f64],
    v: &[f64],
    dout: &[f64],
    scale: f64,
    mask: Mask,
) -> [Vec<f64>; 5] {
    let (sq, skv, d) = (s.seq_q, s.seq_kv, s.head_dim);
    let visible = |i: usize, j: usize| match mask {
        Mask::None => true,
        Mask::CausalTopLeft => j <= i,
        Mask::CausalBottomRight => j + sq <= i + skv, // j <= i + Skv - Sq
    };
    let dot = |a: &[f64], b: &[f64]| a.iter().zip(b).map(|(x, y)| x * y).sum::<f64>();
    let (mut out, mut lse) = (vec![0.0; s.q_len()], vec![0.0; s.lse_len()]);
    let (mut dq, mut dk, mut dv) =
        (vec![0.0; s.q_len()], vec![0.0; s.kv_len()], vec![0.0; s.kv_len()]);
    for b in 0..s.batch {
        for h in 0..s.heads_q {
            let qo = (b * s.heads_q + h) * sq * d; // this head's rows in q, out, dout, dq
            let ko = (b * s.heads_kv + h / (s.heads_q / s.heads_kv)) * skv * d; // in k, v, dk, dv
            let qr = |i: usize| qo + i * d..qo + (i + 1) * d; // row i of q or dout
            let kr = |j: usize| ko + j * d..ko + (j + 1) * d; // row j of k or v
            for i in 0..sq {
                // P = softmax(scale q k^T) over the visible keys; a row that sees none gives 0.
                let scores: Vec<f64> = (0..skv)
                    .map(|j| {
                        if visible(i, j) {
                            scale * dot(&q[qr(i)], &k[kr(j)])
                        } else {
                            f64::NEG_INFINITY
                        }
                    })
                    .collect();
                let m = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let row_lse = if m == f64::NEG_INFINITY {
                    m
                } else {
                    m + scores.iter().map(|x| (x - m).exp()).sum::<f64>().ln()
                };
                lse[(b * s.heads_q + h) * sq + i] = row_lse;
                let p: Vec<f64> = scores
                    .iter()
                    .map(|x| if row_lse == f64::NEG_INFINITY { 0.0 } else { (x - row_lse).exp() })
                    .collect();
                // out = P v; dP = dout v^T; dS = P (dP - sum_j P dP); dq = scale dS k;
                // dk += scale dS^T q; dv += P^T dout.
                let dp: Vec<f64> = (0..skv).map(|j| dot(&dout[qr(i)], &v[kr(j)])).collect();
                let rowsum = dot(&p, &dp);
                for j in 0..skv {
                    let ds = p[j] * (dp[j] - rowsum);
                    for c in 0..d {
                        out[qo + i * d + c] += p[j] * v[ko + j * d + c];
                        dq[qo + i * d + c] += scale * ds * k[ko + j * d + c];
                        dk[ko + j * d + c] += scale * ds * q[qo + i * d + c];
                        dv[ko + j * d + c] += p[j] * dout[qo + i * d + c];
                    }
                }
            }
        }
    }
    [out, lse, dq, dk, dv]
}

struct Args {
    shape: Shape,
    mask: Mask,
    dtype: String,
    bshd: bool,
    threads: u32,
    seed: u64,
}

fn parse() -> Result<Args, String> {
    let mut a = Args {
        shape: Shape { batch: 1, heads_q: 8, heads_kv: 2, seq_q: 100, seq_kv: 150, head_dim: 64 },
        mask: Mask::CausalBottomRight,
        dtype: "f32".into(),
        bshd: true,
        threads: 0,
        seed: 1,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        if flag == "--help" || flag == "-h" {
            return Err(String::new());
        }
        let value = it.next().ok_or_else(|| format!("{flag} needs a value"))?;
        let num = || value.parse::<usize>().map_err(|_| format!("{flag} {value}: not a number"));
        match flag.as_str() {
            "--batch" => a.shape.batch = num()?,
            "--heads-q" => a.shape.heads_q = num()?,
            "--heads-kv" => a.shape.heads_kv = num()?,
            "--seq-q" => a.shape.seq_q = num()?,
            "--seq-kv" => a.shape.seq_kv = num()?,
            "--head-dim" => a.shape.head_dim = num()?,
            "--threads" => a.threads = num()? as u32,
            "--seed" => a.seed = num()? as u64,
            "--mask" => {
                a.mask = match value.as_str() {
                    "none" => Mask::None,
                    "causal-top-left" => Mask::CausalTopLeft,
                    "causal-bottom-right" => Mask::CausalBottomRight,
                    _ => return Err(format!("unknown mask {value}")),
                }
            }
            "--dtype" => a.dtype = value,
            "--layout" => {
                a.bshd = match value.as_str() {
                    "bshd" => true,
                    "bhsd" => false,
                    _ => return Err(format!("unknown layout {value}")),
                }
            }
            _ => return Err(format!("unknown option {flag}")),
        }
    }
    Ok(a)
}

/// [B, H, S, D] logical data to the chosen memory order.
fn to_layout<T: Element>(x: &[f64], [b, h, s, d]: [usize; 4], bshd: bool) -> Vec<T> {
    if !bshd {
        return x.iter().map(|&v| T::from_f64(v)).collect();
    }
    let mut out = vec![T::from_f64(0.0); x.len()];
    for bb in 0..b {
        for hh in 0..h {
            for ss in 0..s {
                let src = ((bb * h + hh) * s + ss) * d;
                let dst = ((bb * s + ss) * h + hh) * d;
                for c in 0..d {
                    out[dst + c] = T::from_f64(x[src + c]);
                }
            }
        }
    }
    out
}

fn from_layout<T: Element>(x: &[T], [b, h, s, d]: [usize; 4], bshd: bool) -> Vec<f64> {
    let mut out = vec![0.0; x.len()];
    for bb in 0..b {
        for hh in 0..h {
            for ss in 0..s {
                let dst = ((bb * h + hh) * s + ss) * d;
                let src = if bshd { ((bb * s + ss) * h + hh) * d } else { dst };
                for c in 0..d {
                    out[dst + c] = x[src + c].to_f64();
                }
            }
        }
    }
    out
}

fn view<T: Element>(x: &[T], dims: [usize; 4], bshd: bool) -> Tensor<'_, T> {
    let [b, h, s, d] = dims;
    if bshd { Tensor::bshd(x, [b, s, h, d]) } else { Tensor::bhsd(x, dims) }.unwrap()
}

fn view_mut<T: Element>(x: &mut [T], dims: [usize; 4], bshd: bool) -> TensorMut<'_, T> {
    let [b, h, s, d] = dims;
    if bshd { TensorMut::bshd(x, [b, s, h, d]) } else { TensorMut::bhsd(x, dims) }.unwrap()
}

/// (max |got - want|, that divided by max |want|); matching infinities count as exact.
fn errors(got: &[f64], want: &[f64]) -> (f64, f64) {
    let mut abs: f64 = 0.0;
    let mut scale: f64 = 0.0;
    for (&g, &w) in got.iter().zip(want) {
        if g == w {
            continue; // includes -inf == -inf for rows that see no key
        }
        let e = (g - w).abs();
        abs = if e.is_nan() { f64::INFINITY } else { abs.max(e) };
        if w.is_finite() {
            scale = scale.max(w.abs());
        }
    }
    for w in want.iter().filter(|w| w.is_finite()) {
        scale = scale.max(w.abs());
    }
    (abs, if scale > 0.0 { abs / scale } else { abs })
}

fn run<T: Element>(a: &Args, bound: f64) -> Result<bool, flashattn::Error> {
    let s = a.shape;
    let (qd, kd) =
        ([s.batch, s.heads_q, s.seq_q, s.head_dim], [s.batch, s.heads_kv, s.seq_kv, s.head_dim]);
    let mut rng = Rng(a.seed);
    // Round the inputs to T first so that the reference sees exactly what the library sees.
    let mut gen =
        |n| -> Vec<f64> { rng.normals(n).into_iter().map(|x| T::from_f64(x).to_f64()).collect() };
    let (q, k, v, dout) = (gen(s.q_len()), gen(s.kv_len()), gen(s.kv_len()), gen(s.q_len()));

    let (qb, kb, vb, dob) = (
        to_layout::<T>(&q, qd, a.bshd),
        to_layout::<T>(&k, kd, a.bshd),
        to_layout::<T>(&v, kd, a.bshd),
        to_layout::<T>(&dout, qd, a.bshd),
    );
    let nan = T::from_f64(f64::NAN);
    let mut out = vec![nan; s.q_len()];
    let mut lse = vec![f32::NAN; s.lse_len()];
    let (mut dq, mut dk, mut dv) =
        (vec![nan; s.q_len()], vec![nan; s.kv_len()], vec![nan; s.kv_len()]);
    let opts = Options { mask: a.mask, num_threads: a.threads, ..Options::default() };

    let (qt, kt, vt) = (view(&qb, qd, a.bshd), view(&kb, kd, a.bshd), view(&vb, kd, a.bshd));
    let t0 = Instant::now();
    forward(
        &qt,
        &kt,
        &vt,
        &mut view_mut(&mut out, qd, a.bshd),
        &mut TensorMut::contiguous(&mut lse, &[s.batch, s.heads_q, s.seq_q])?,
        &opts,
    )?;
    let t_fwd = t0.elapsed();
    let t0 = Instant::now();
    backward(
        &qt,
        &kt,
        &vt,
        &view(&out, qd, a.bshd),
        &view(&dob, qd, a.bshd),
        &Tensor::contiguous(&lse, &[s.batch, s.heads_q, s.seq_q])?,
        &mut view_mut(&mut dq, qd, a.bshd),
        &mut view_mut(&mut dk, kd, a.bshd),
        &mut view_mut(&mut dv, kd, a.bshd),
        &opts,
    )?;
    let t_bwd = t0.elapsed();

    let t0 = Instant::now();
    // The library's default scale, 1/sqrt(D), as the float32 it carries.
    let scale = (1.0 / (s.head_dim as f64).sqrt()) as f32 as f64;
    let [r_out, r_lse, r_dq, r_dk, r_dv] = plain_attention(&s, &q, &k, &v, &dout, scale, a.mask);
    let t_ref = t0.elapsed();

    println!(
        "flashattn {}: {:?}, B={} Hq={} Hkv={} Sq={} Skv={} D={}, {:?}, {} layout",
        flashattn::version(),
        T::DTYPE,
        s.batch,
        s.heads_q,
        s.heads_kv,
        s.seq_q,
        s.seq_kv,
        s.head_dim,
        a.mask,
        if a.bshd { "[B,S,H,D]" } else { "[B,H,S,D]" }
    );
    println!(
        "library: forward {:.2} ms, backward {:.2} ms; plain float64 attention: {:.1} ms",
        t_fwd.as_secs_f64() * 1e3,
        t_bwd.as_secs_f64() * 1e3,
        t_ref.as_secs_f64() * 1e3
    );
    println!("{:<6} {:>12} {:>12}", "output", "max abs err", "max rel err");
    let lse64: Vec<f64> = lse.iter().map(|&x| x as f64).collect();
    let mut ok = true;
    for (name, got, want) in [
        ("out", from_layout(&out, qd, a.bshd), r_out),
        ("lse", lse64, r_lse),
        ("dq", from_layout(&dq, qd, a.bshd), r_dq),
        ("dk", from_layout(&dk, kd, a.bshd), r_dk),
        ("dv", from_layout(&dv, kd, a.bshd), r_dv),
    ] {
        let (abs, rel) = errors(&got, &want);
        let pass = rel <= bound;
        ok &= pass;
        println!("{name:<6} {abs:>12.3e} {rel:>12.3e}{}", if pass { "" } else { "  FAIL" });
    }
    println!("{} (bound on max rel err: {bound:.0e})", if ok { "ok" } else { "FAILED" });
    Ok(ok)
}

fn main() -> ExitCode {
    let a = match parse() {
        Ok(a) => a,
        Err(msg) => {
            if !msg.is_empty() {
                eprintln!("attention: {msg}\n");
            }
            eprintln!("{HELP}");
            return ExitCode::from(if msg.is_empty() { 0 } else { 2 });
        }
    };
    // Relative to the largest reference value of each output; float64 gradients are limited by
    // the float32 log-sum-exp they are recomputed from.
    let result = match a.dtype.as_str() {
        "f32" => run::<f32>(&a, 1e-4),
        "f64" => run::<f64>(&a, 1e-5),
        "f16" => run::<F16>(&a, 1e-2),
        "bf16" => run::<Bf16>(&a, 5e-2),
        other => {
            eprintln!("attention: unknown dtype {other}\n\n{HELP}");
            return ExitCode::from(2);
        }
    };
    match result {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::from(1),
        Err(e) => {
            eprintln!("attention: {e}");
            ExitCode::from(1)
        }
    }
}
