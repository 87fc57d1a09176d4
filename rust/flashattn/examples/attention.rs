//! Attention forward and backward on a random problem through the safe API, checked against the
//! crate's float64 reference.
//!
//!     cargo run --example attention -- --seq-q 300 --seq-kv 200 --mask causal-bottom-right
//!
//! Exits with status 1 when an error exceeds the bound for the dtype.
use std::process::ExitCode;
use std::time::Instant;

use flashattn::reference::{self, Rng, Shape};
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
    let mut rng = Rng::new(a.seed);
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
    let scale = s.default_scale();
    let (r_out, r_lse) = reference::forward(&s, &q, &k, &v, scale, a.mask);
    let (r_dq, r_dk, r_dv) = reference::backward(&s, &q, &k, &v, &dout, scale, a.mask);
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
        "library: forward {:.2} ms, backward {:.2} ms; float64 reference: {:.1} ms",
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
