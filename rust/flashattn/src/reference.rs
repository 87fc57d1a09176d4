//! A deliberately plain float64 attention, forward and backward, with explicit S, P, dP and dS
//! matrices (O(Sq * Skv) memory per head), plus a small deterministic random generator. It is the
//! yardstick for this crate's tests and example, independent of the C++ library's own reference;
//! its gradients are checked against finite differences of its forward in `tests/reference.rs`.
//!
//! Arrays are logical and contiguous: q, out, dout, dq [B, Hq, Sq, D]; k, v, dk, dv
//! [B, Hkv, Skv, D]; lse [B, Hq, Sq].

use crate::Mask;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Shape {
    pub batch: usize,
    pub heads_q: usize,
    pub heads_kv: usize,
    pub seq_q: usize,
    pub seq_kv: usize,
    pub head_dim: usize,
}

impl Shape {
    pub fn q_len(&self) -> usize {
        self.batch * self.heads_q * self.seq_q * self.head_dim
    }
    pub fn kv_len(&self) -> usize {
        self.batch * self.heads_kv * self.seq_kv * self.head_dim
    }
    pub fn lse_len(&self) -> usize {
        self.batch * self.heads_q * self.seq_q
    }
    /// The library's default softmax scale, 1/sqrt(D), as the float32 it uses.
    pub fn default_scale(&self) -> f64 {
        (1.0 / (self.head_dim as f64).sqrt()) as f32 as f64
    }
}

/// Whether query i sees key j, written out from the mask definitions.
pub fn visible(mask: Mask, i: usize, j: usize, seq_q: usize, seq_kv: usize) -> bool {
    match mask {
        Mask::None => true,
        Mask::CausalTopLeft => j <= i,
        // j <= i + Skv - Sq, kept in unsigned arithmetic.
        Mask::CausalBottomRight => j + seq_q <= i + seq_kv,
    }
}

fn dot(a: &[f64], b: &[f64]) -> f64 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

/// S and P of one (batch, query head): row-major [Sq][Skv]. Rows with no visible key have
/// S = -inf everywhere and P = 0.
fn scores(
    s: &Shape,
    q: &[f64],
    k: &[f64],
    scale: f64,
    mask: Mask,
) -> (Vec<f64>, Vec<f64>, Vec<f64>) {
    let (sq, skv, d) = (s.seq_q, s.seq_kv, s.head_dim);
    let mut sm = vec![f64::NEG_INFINITY; sq * skv];
    let mut p = vec![0.0; sq * skv];
    let mut lse = vec![f64::NEG_INFINITY; sq];
    for i in 0..sq {
        for j in 0..skv {
            if visible(mask, i, j, sq, skv) {
                sm[i * skv + j] = scale * dot(&q[i * d..(i + 1) * d], &k[j * d..(j + 1) * d]);
            }
        }
        let row = &sm[i * skv..(i + 1) * skv];
        let m = row.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        if m == f64::NEG_INFINITY {
            continue;
        }
        let l: f64 = row.iter().map(|&x| (x - m).exp()).sum();
        for j in 0..skv {
            p[i * skv + j] = (row[j] - m).exp() / l;
        }
        lse[i] = m + l.ln();
    }
    (sm, p, lse)
}

/// Offsets of head (b, h) in a [B, H, S, D] array.
fn head(b: usize, h: usize, heads: usize, seq: usize, d: usize) -> std::ops::Range<usize> {
    let start = (b * heads + h) * seq * d;
    start..start + seq * d
}

/// Returns (out, lse).
pub fn forward(
    s: &Shape,
    q: &[f64],
    k: &[f64],
    v: &[f64],
    scale: f64,
    mask: Mask,
) -> (Vec<f64>, Vec<f64>) {
    assert_eq!(q.len(), s.q_len());
    assert_eq!(k.len(), s.kv_len());
    assert_eq!(v.len(), s.kv_len());
    let (sq, skv, d) = (s.seq_q, s.seq_kv, s.head_dim);
    let group = s.heads_q / s.heads_kv;
    let mut out = vec![0.0; s.q_len()];
    let mut lse = vec![0.0; s.lse_len()];
    for b in 0..s.batch {
        for h in 0..s.heads_q {
            let hk = h / group;
            let qh = &q[head(b, h, s.heads_q, sq, d)];
            let kh = &k[head(b, hk, s.heads_kv, skv, d)];
            let vh = &v[head(b, hk, s.heads_kv, skv, d)];
            let (_, p, l) = scores(s, qh, kh, scale, mask);
            let o = &mut out[head(b, h, s.heads_q, sq, d)];
            for i in 0..sq {
                for j in 0..skv {
                    for c in 0..d {
                        o[i * d + c] += p[i * skv + j] * vh[j * d + c];
                    }
                }
            }
            lse[(b * s.heads_q + h) * sq..][..sq].copy_from_slice(&l);
        }
    }
    (out, lse)
}

/// Gradients of sum(out * dout) with respect to q, k and v: returns (dq, dk, dv). dk and dv sum
/// over the query heads that share a kv head.
pub fn backward(
    s: &Shape,
    q: &[f64],
    k: &[f64],
    v: &[f64],
    dout: &[f64],
    scale: f64,
    mask: Mask,
) -> (Vec<f64>, Vec<f64>, Vec<f64>) {
    assert_eq!(dout.len(), s.q_len());
    let (sq, skv, d) = (s.seq_q, s.seq_kv, s.head_dim);
    let group = s.heads_q / s.heads_kv;
    let mut dq = vec![0.0; s.q_len()];
    let mut dk = vec![0.0; s.kv_len()];
    let mut dv = vec![0.0; s.kv_len()];
    for b in 0..s.batch {
        for h in 0..s.heads_q {
            let hk = h / group;
            let qr = head(b, h, s.heads_q, sq, d);
            let kr = head(b, hk, s.heads_kv, skv, d);
            let (qh, doh) = (&q[qr.clone()], &dout[qr.clone()]);
            let (kh, vh) = (&k[kr.clone()], &v[kr.clone()]);
            let (_, p, _) = scores(s, qh, kh, scale, mask);
            // dP = dO V^T; D_i = sum_j P_ij dP_ij (= rowsum(dO * O)); dS = P * (dP - D).
            let mut dp = vec![0.0; sq * skv];
            for i in 0..sq {
                for j in 0..skv {
                    dp[i * skv + j] = dot(&doh[i * d..(i + 1) * d], &vh[j * d..(j + 1) * d]);
                }
            }
            let mut ds = vec![0.0; sq * skv];
            for i in 0..sq {
                let di: f64 = (0..skv).map(|j| p[i * skv + j] * dp[i * skv + j]).sum();
                for j in 0..skv {
                    ds[i * skv + j] = p[i * skv + j] * (dp[i * skv + j] - di);
                }
            }
            let dqh = &mut dq[qr];
            for i in 0..sq {
                for j in 0..skv {
                    for c in 0..d {
                        dqh[i * d + c] += scale * ds[i * skv + j] * kh[j * d + c];
                    }
                }
            }
            for j in 0..skv {
                for i in 0..sq {
                    for c in 0..d {
                        dk[kr.start + j * d + c] += scale * ds[i * skv + j] * qh[i * d + c];
                        dv[kr.start + j * d + c] += p[i * skv + j] * doh[i * d + c];
                    }
                }
            }
        }
    }
    (dq, dk, dv)
}

/// SplitMix64: a tiny, fast, well-mixed generator, plenty for test data.
#[derive(Clone, Debug)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng(seed)
    }
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    /// Uniform in [0, 1), 53 random bits.
    pub fn uniform(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }
    /// Standard normal (Box-Muller).
    pub fn normal(&mut self) -> f64 {
        let u1 = 1.0 - self.uniform(); // (0, 1]: ln stays finite
        let u2 = self.uniform();
        (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()
    }
    pub fn normals(&mut self, n: usize) -> Vec<f64> {
        (0..n).map(|_| self.normal()).collect()
    }
}
