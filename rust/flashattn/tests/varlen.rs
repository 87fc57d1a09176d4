//! Packed variable-length batches (`forward_varlen` / `backward_varlen`) against the float64
//! reference called per sequence with batch 1, and the errors of bad index vectors.
//!
//! Every output is NaN-poisoned before a call and every element of it (every row of every
//! sequence, every key of every sequence) is compared afterwards, so an unwritten element fails.
//! A sequence with no (used) keys expects out = 0, lse = -inf and dq = 0 exactly, and keys that no
//! query reaches (zero-query sequences, keys beyond seqused_k) dk = dv = 0 exactly.
mod common;

use common::reference::{self, Rng, Shape};
use common::{max_error, Tol};
use flashattn::{
    backward_varlen, forward_varlen, Bf16, Device, Element, ErrorKind, Mask, Options, Tensor,
    TensorMut, Varlen, F16,
};

// As in attention.rs (measured errors there; per sequence the sizes here are no larger).
const TOL_F32: Tol = Tol { out: 2e-5, lse: 1e-5, grad: 3e-5 };
const TOL_F64: Tol = Tol { out: 1e-12, lse: 2.4e-7, grad: 4e-6 };
const TOL_F16: Tol = Tol { out: 5e-3, lse: 1e-5, grad: 1e-2 };
const TOL_BF16: Tol = Tol { out: 2e-2, lse: 1e-5, grad: 3e-2 };

const MASKS: [Mask; 3] = [Mask::None, Mask::CausalTopLeft, Mask::CausalBottomRight];

#[derive(Clone, Debug)]
struct VCase {
    lens_q: Vec<usize>,
    lens_k: Vec<usize>,
    used_k: Option<Vec<usize>>,
    heads_q: usize,
    heads_kv: usize,
    head_dim: usize,
    mask: Mask,
    /// Rows and heads with NaN-filled gaps between them (strides [H*(D+1)+2, D+1, 1]) instead
    /// of contiguous [total, H, D].
    padded: bool,
}

impl VCase {
    fn new(
        lens_q: &[usize],
        lens_k: &[usize],
        hq: usize,
        hkv: usize,
        d: usize,
        mask: Mask,
    ) -> Self {
        VCase {
            lens_q: lens_q.to_vec(),
            lens_k: lens_k.to_vec(),
            used_k: None,
            heads_q: hq,
            heads_kv: hkv,
            head_dim: d,
            mask,
            padded: false,
        }
    }
}

fn prefix(lens: &[usize]) -> Vec<i32> {
    let mut c = vec![0i32];
    for &l in lens {
        c.push(c.last().unwrap() + l as i32);
    }
    c
}

/// Strides and buffer length of a packed [total, h, d] tensor.
fn packed_strides(padded: bool, [t, h, d]: [usize; 3]) -> ([usize; 3], usize) {
    if padded {
        let row = h * (d + 1) + 2;
        ([row, d + 1, 1], t * row)
    } else {
        ([h * d, d, 1], t * h * d)
    }
}

fn scatter<T: Element>(logical: &[f64], dims: [usize; 3], padded: bool) -> Vec<T> {
    let (st, len) = packed_strides(padded, dims);
    let mut buf = vec![T::from_f64(f64::NAN); len];
    let mut n = 0;
    for r in 0..dims[0] {
        for h in 0..dims[1] {
            for x in 0..dims[2] {
                buf[r * st[0] + h * st[1] + x] = T::from_f64(logical[n]);
                n += 1;
            }
        }
    }
    buf
}

/// The logical values, and whether every element outside the view still holds its NaN.
fn gather<T: Element>(buf: &[T], dims: [usize; 3], padded: bool) -> (Vec<f64>, bool) {
    let (st, _) = packed_strides(padded, dims);
    let mut inside = vec![false; buf.len()];
    let mut out = Vec::with_capacity(dims.iter().product());
    for r in 0..dims[0] {
        for h in 0..dims[1] {
            for x in 0..dims[2] {
                let o = r * st[0] + h * st[1] + x;
                inside[o] = true;
                out.push(buf[o].to_f64());
            }
        }
    }
    let gaps = buf.iter().zip(&inside).all(|(x, &i)| i || x.to_f64().is_nan());
    (out, gaps)
}

/// Rows `r0..r0 + n` of a logical packed [total, h, d] array as a contiguous [1, h, n, d].
fn seq_slice(x: &[f64], r0: usize, n: usize, h: usize, d: usize) -> Vec<f64> {
    let mut out = Vec::with_capacity(h * n * d);
    for hh in 0..h {
        for r in r0..r0 + n {
            let base = (r * h + hh) * d;
            out.extend_from_slice(&x[base..base + d]);
        }
    }
    out
}

/// Random values that are exactly representable in T.
fn values<T: Element>(rng: &mut Rng, n: usize) -> Vec<f64> {
    rng.normals(n).into_iter().map(|x| T::from_f64(x).to_f64()).collect()
}

/// Runs forward and backward on the case and compares with the reference per sequence; returns
/// the worst error.
fn check<T: Element>(c: &VCase, seed: u64, tol: Tol) -> f64 {
    let (hq, hkv, d) = (c.heads_q, c.heads_kv, c.head_dim);
    let (cq, ck) = (prefix(&c.lens_q), prefix(&c.lens_k));
    let (tq, tk) = (*cq.last().unwrap() as usize, *ck.last().unwrap() as usize);
    let used: Vec<usize> = c.used_k.clone().unwrap_or_else(|| c.lens_k.clone());
    let used_i32: Vec<i32> = used.iter().map(|&u| u as i32).collect();
    let max_q = c.lens_q.iter().copied().max().unwrap().max(1);
    let max_k = c.lens_k.iter().copied().max().unwrap().max(1);
    let (qd, kd) = ([tq, hq, d], [tk, hkv, d]);

    let mut rng = Rng::new(seed);
    let q = values::<T>(&mut rng, tq * hq * d);
    let k = values::<T>(&mut rng, tk * hkv * d);
    let v = values::<T>(&mut rng, tk * hkv * d);
    let dout = values::<T>(&mut rng, tq * hq * d);
    let (qb, kb, vb, db) = (
        scatter::<T>(&q, qd, c.padded),
        scatter::<T>(&k, kd, c.padded),
        scatter::<T>(&v, kd, c.padded),
        scatter::<T>(&dout, qd, c.padded),
    );
    let nan = T::from_f64(f64::NAN);
    let (qs, qlen) = packed_strides(c.padded, qd);
    let (ks, klen) = packed_strides(c.padded, kd);
    let mut out = vec![nan; qlen];
    let mut lse = vec![f32::NAN; hq * tq];
    let (mut dq, mut dk, mut dv) = (vec![nan; qlen], vec![nan; klen], vec![nan; klen]);

    let mut vl = Varlen::new(&cq, &ck, max_q, max_k);
    if c.used_k.is_some() {
        vl = vl.with_seqused_k(&used_i32);
    }
    let opts = Options { mask: c.mask, ..Options::default() };
    let qt = Tensor::new(&qb, &qd, &qs).unwrap();
    let kt = Tensor::new(&kb, &kd, &ks).unwrap();
    let vt = Tensor::new(&vb, &kd, &ks).unwrap();
    let dt = Tensor::new(&db, &qd, &qs).unwrap();
    {
        let mut ot = TensorMut::new(&mut out, &qd, &qs).unwrap();
        let mut lt = TensorMut::contiguous(&mut lse, &[hq, tq]).unwrap();
        forward_varlen(&qt, &kt, &vt, &mut ot, &mut lt, &vl, &opts)
            .unwrap_or_else(|e| panic!("{c:?}: forward: {e}"));
    }
    {
        let ot = Tensor::new(&out, &qd, &qs).unwrap();
        let lt = Tensor::contiguous(&lse, &[hq, tq]).unwrap();
        let mut dqt = TensorMut::new(&mut dq, &qd, &qs).unwrap();
        let mut dkt = TensorMut::new(&mut dk, &kd, &ks).unwrap();
        let mut dvt = TensorMut::new(&mut dv, &kd, &ks).unwrap();
        backward_varlen(&qt, &kt, &vt, &ot, &dt, &lt, &mut dqt, &mut dkt, &mut dvt, &vl, &opts)
            .unwrap_or_else(|e| panic!("{c:?}: backward: {e}"));
    }
    let mut gaps = true;
    let mut g = |buf: &[T], dims| {
        let (x, ok) = gather(buf, dims, c.padded);
        gaps &= ok;
        x
    };
    let (out_l, dq_l, dk_l, dv_l) = (g(&out, qd), g(&dq, qd), g(&dk, kd), g(&dv, kd));
    assert!(gaps, "{c:?}: an output was written outside its view");
    // lse [Hq, total_q] as [total_q, Hq, 1] rows for seq_slice.
    let lse_rows: Vec<f64> = (0..tq)
        .flat_map(|r| (0..hq).map(move |h| (h, r)))
        .map(|(h, r)| lse[h * tq + r] as f64)
        .collect();

    let mut worst: f64 = 0.0;
    for b in 0..c.lens_q.len() {
        let (q0, sq) = (cq[b] as usize, c.lens_q[b]);
        let (k0, sk, su) = (ck[b] as usize, c.lens_k[b], used[b]);
        let what = |name: &str| format!("{c:?} seq {b} (sq {sq}, sk {sk}, used {su}) {name}");
        let got_out = seq_slice(&out_l, q0, sq, hq, d);
        let got_lse = seq_slice(&lse_rows, q0, sq, hq, 1);
        let got_dq = seq_slice(&dq_l, q0, sq, hq, d);
        let got_dk = seq_slice(&dk_l, k0, sk, hkv, d);
        let got_dv = seq_slice(&dv_l, k0, sk, hkv, d);
        // Keys beyond seqused_k: exactly zero gradients (the whole sequence when no query).
        let key_used = |i: usize| (i / d) % sk < su && sq > 0;
        for (name, x) in [("dk", &got_dk), ("dv", &got_dv)] {
            for (i, &val) in x.iter().enumerate() {
                if !key_used(i) {
                    assert!(val == 0.0, "{}: unused key element {i} = {val}", what(name));
                }
            }
        }
        if sq == 0 {
            continue;
        }
        if su == 0 {
            assert!(got_out.iter().all(|&x| x == 0.0), "{}: {got_out:?}", what("out"));
            assert!(
                got_lse.iter().all(|&x| x == f64::NEG_INFINITY),
                "{}: {got_lse:?}",
                what("lse")
            );
            assert!(got_dq.iter().all(|&x| x == 0.0), "{}: {got_dq:?}", what("dq"));
            continue;
        }
        let s = Shape { batch: 1, heads_q: hq, heads_kv: hkv, seq_q: sq, seq_kv: su, head_dim: d };
        let (qs_, ks_, vs_, ds_) = (
            seq_slice(&q, q0, sq, hq, d),
            seq_slice(&k, k0, su, hkv, d),
            seq_slice(&v, k0, su, hkv, d),
            seq_slice(&dout, q0, sq, hq, d),
        );
        let scale = s.default_scale();
        let (r_out, r_lse) = reference::forward(&s, &qs_, &ks_, &vs_, scale, c.mask);
        let (r_dq, r_dk, r_dv) = reference::backward(&s, &qs_, &ks_, &vs_, &ds_, scale, c.mask);
        // The used keys of the packed gradients, [1, hkv, su, d].
        let used_part = |x: &[f64]| -> Vec<f64> {
            (0..hkv).flat_map(|h| x[h * sk * d..(h * sk + su) * d].to_vec()).collect()
        };
        let (u_dk, u_dv) = (used_part(&got_dk), used_part(&got_dv));
        for (name, got, want, t) in [
            ("out", &got_out, &r_out, tol.out),
            ("lse", &got_lse, &r_lse, tol.lse),
            ("dq", &got_dq, &r_dq, tol.grad),
            ("dk", &u_dk, &r_dk, tol.grad),
            ("dv", &u_dv, &r_dv, tol.grad),
        ] {
            let (e, i) = max_error(got, want);
            assert!(
                e <= t,
                "{}: error {e:.3e} > {t:.1e} at {i}: got {}, want {}",
                what(name),
                got[i],
                want[i]
            );
            worst = worst.max(e);
        }
    }
    worst
}

fn lengths_cases() -> Vec<VCase> {
    let mut v = vec![];
    for mask in MASKS {
        // Lengths 0, 1, odd and one over a block; same lengths for q and k; GQA 4 over 2.
        v.push(VCase::new(&[0, 1, 5, 17, 3, 70], &[0, 1, 5, 17, 3, 70], 4, 2, 8, mask));
        // Different q and k lengths both ways: queries without keys (seq 1), keys without
        // queries (seq 3), Sq > Skv (seq 2: rows that see no key under bottom-right causal); MQA.
        v.push(VCase::new(&[3, 1, 9, 0, 6], &[7, 0, 4, 5, 6], 3, 1, 16, mask));
        // One sequence; Hq = Hkv; odd head_dim.
        v.push(VCase::new(&[13], &[21], 2, 2, 5, mask));
    }
    v
}

#[test]
fn varlen_f64_matches_reference_per_sequence() {
    let mut worst: f64 = 0.0;
    for (n, c) in lengths_cases().iter().enumerate() {
        worst = worst.max(check::<f64>(c, 100 + n as u64, TOL_F64));
    }
    println!("varlen f64 worst error {worst:.3e}");
}

#[test]
fn varlen_f32_matches_reference_per_sequence() {
    let mut worst: f64 = 0.0;
    for (n, c) in lengths_cases().iter().enumerate() {
        worst = worst.max(check::<f32>(c, 200 + n as u64, TOL_F32));
        // The same with gaps between rows and heads (NaN there).
        let p = VCase { padded: true, ..c.clone() };
        worst = worst.max(check::<f32>(&p, 300 + n as u64, TOL_F32));
    }
    println!("varlen f32 worst error {worst:.3e}");
}

#[test]
fn varlen_half_types() {
    for (n, mask) in MASKS.into_iter().enumerate() {
        let c = VCase::new(&[0, 1, 7, 33], &[2, 1, 0, 29], 4, 2, 16, mask);
        check::<F16>(&c, 400 + n as u64, TOL_F16);
        check::<Bf16>(&c, 500 + n as u64, TOL_BF16);
    }
}

#[test]
fn varlen_seqused_k() {
    for (n, mask) in MASKS.into_iter().enumerate() {
        // Fewer keys used than stored, all of them, none (with queries: out 0, lse -inf), and a
        // zero-length sequence.
        let c = VCase {
            used_k: Some(vec![3, 0, 4, 2, 0]),
            ..VCase::new(&[5, 2, 3, 0, 4], &[7, 0, 4, 5, 6], 4, 2, 8, mask)
        };
        check::<f64>(&c, 600 + n as u64, TOL_F64);
        check::<f32>(&VCase { padded: true, ..c }, 700 + n as u64, TOL_F32);
    }
}

#[test]
fn varlen_ones_is_a_batch_of_one_token_sequences() {
    // 9 sequences of one query and one key: softmax over one key, so out = v of that key and
    // lse = scale * q.k, exactly checkable without the reference.
    let (b, h, d) = (9, 2, 4);
    let mut rng = Rng::new(9);
    let q: Vec<f64> = values::<f64>(&mut rng, b * h * d);
    let k: Vec<f64> = values::<f64>(&mut rng, b * h * d);
    let v: Vec<f64> = values::<f64>(&mut rng, b * h * d);
    let cu: Vec<i32> = (0..=b as i32).collect();
    let mut out = vec![f64::NAN; b * h * d];
    let mut lse = vec![f32::NAN; h * b];
    let dims = [b, h, d];
    forward_varlen(
        &Tensor::contiguous(&q, &dims).unwrap(),
        &Tensor::contiguous(&k, &dims).unwrap(),
        &Tensor::contiguous(&v, &dims).unwrap(),
        &mut TensorMut::contiguous(&mut out, &dims).unwrap(),
        &mut TensorMut::contiguous(&mut lse, &[h, b]).unwrap(),
        &Varlen::new(&cu, &cu, 1, 1),
        &Options::default().with_softmax_scale(0.5),
    )
    .unwrap();
    for r in 0..b {
        for hh in 0..h {
            let base = (r * h + hh) * d;
            let dot: f64 = (0..d).map(|x| q[base + x] * k[base + x]).sum();
            let want = (0.5 * dot) as f32;
            let got = lse[hh * b + r];
            assert!(
                (got - want).abs() <= 1e-6 * (1.0 + want.abs()),
                "lse row {r} head {hh}: {got} vs {want}"
            );
            for x in 0..d {
                assert!((out[base + x] - v[base + x]).abs() < 1e-12, "out {r} {hh} {x}");
            }
        }
    }
}

// ----- errors -----

/// A small valid problem: two sequences of 2 and 3 queries, 3 and 2 keys; Hq 2, Hkv 1, D 4.
struct Small {
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    out: Vec<f32>,
    lse: Vec<f32>,
}

const HQ: usize = 2;
const HKV: usize = 1;
const D: usize = 4;
const TQ: usize = 5;
const TK: usize = 5;
const CQ: [i32; 3] = [0, 2, 5];
const CK: [i32; 3] = [0, 3, 5];

impl Small {
    fn new() -> Self {
        let mut rng = Rng::new(77);
        let f = |rng: &mut Rng, n| rng.normals(n).into_iter().map(|x| x as f32).collect();
        Small {
            q: f(&mut rng, TQ * HQ * D),
            k: f(&mut rng, TK * HKV * D),
            v: f(&mut rng, TK * HKV * D),
            out: vec![f32::NAN; TQ * HQ * D],
            lse: vec![f32::NAN; HQ * TQ],
        }
    }
    fn forward(&mut self, vl: &Varlen<'_>) -> Result<(), flashattn::Error> {
        forward_varlen(
            &Tensor::contiguous(&self.q, &[TQ, HQ, D]).unwrap(),
            &Tensor::contiguous(&self.k, &[TK, HKV, D]).unwrap(),
            &Tensor::contiguous(&self.v, &[TK, HKV, D]).unwrap(),
            &mut TensorMut::contiguous(&mut self.out, &[TQ, HQ, D]).unwrap(),
            &mut TensorMut::contiguous(&mut self.lse, &[HQ, TQ]).unwrap(),
            vl,
            &Options::default(),
        )
    }
    fn untouched(&self) -> bool {
        self.out.iter().chain(&self.lse).all(|x| x.is_nan())
    }
}

/// The call fails with InvalidArgument, a message containing every word of `words`, and no
/// output written.
fn expect_err(vl: &Varlen<'_>, words: &[&str]) {
    let mut s = Small::new();
    let e = s.forward(vl).expect_err("an invalid varlen call succeeded");
    assert_eq!(e.kind(), ErrorKind::InvalidArgument, "{e}");
    for w in words {
        assert!(e.message().contains(w), "message lacks {w:?}: {e}");
    }
    assert!(s.untouched(), "{e}: an output was written");
}

#[test]
fn small_problem_is_valid() {
    // The error cases below differ from this one in one thing each.
    let mut s = Small::new();
    s.forward(&Varlen::new(&CQ, &CK, 3, 3)).unwrap();
    assert!(s.out.iter().chain(&s.lse).all(|x| x.is_finite()));
}

#[test]
fn varlen_rejects_bad_prefix_sums() {
    // Not non-decreasing (ends at the right total).
    expect_err(
        &Varlen::new(&[0, 4, 2, 5], &[0, 1, 2, 5], 4, 3),
        &["cu_seqlens_q", "non-decreasing"],
    );
    expect_err(&Varlen::new(&CQ, &[0, 4, 3], 3, 4), &["cu_seqlens_k", "non-decreasing"]);
    // Not starting at 0.
    expect_err(&Varlen::new(&[1, 2, 5], &CK, 3, 3), &["cu_seqlens_q[0]"]);
    // Not ending at the packed row count.
    expect_err(&Varlen::new(&[0, 2, 4], &CK, 3, 3), &["cu_seqlens_q[2]", "5"]);
    expect_err(&Varlen::new(&CQ, &[0, 3, 6], 3, 3), &["cu_seqlens_k[2]"]);
    // Different lengths of the two vectors; too few entries.
    expect_err(&Varlen::new(&CQ, &[0, 2, 4, 5], 3, 3), &["cu_seqlens_k", "shape"]);
    expect_err(&Varlen::new(&[0], &[0], 3, 3), &["cu_seqlens_q"]);
    expect_err(&Varlen::new(&[], &[], 3, 3), &["cu_seqlens_q"]);
}

#[test]
fn varlen_rejects_bad_bounds_and_seqused() {
    // A sequence longer than max_seqlen; max_seqlen 0.
    expect_err(&Varlen::new(&CQ, &CK, 2, 3), &["max_seqlen_q"]);
    expect_err(&Varlen::new(&CQ, &CK, 3, 2), &["max_seqlen_k"]);
    expect_err(&Varlen::new(&CQ, &CK, 0, 3), &["max_seqlen_q"]);
    // seqused_k: more than the sequence's keys, negative, wrong length.
    expect_err(&Varlen::new(&CQ, &CK, 3, 3).with_seqused_k(&[3, 3]), &["seqused_k[1]"]);
    expect_err(&Varlen::new(&CQ, &CK, 3, 3).with_seqused_k(&[-1, 2]), &["seqused_k[0]"]);
    expect_err(&Varlen::new(&CQ, &CK, 3, 3).with_seqused_k(&[1, 1, 1]), &["seqused_k", "shape"]);
    // Caught in Rust before the call.
    expect_err(&Varlen::new(&CQ, &CK, usize::MAX, 3), &["varlen.max_seqlen_q"]);
}

#[test]
fn varlen_rejects_bad_tensors() {
    let vl = Varlen::new(&CQ, &CK, 3, 3);
    let s = Small::new();
    let mut out = vec![f32::NAN; TQ * HQ * D];
    let mut lse = vec![f32::NAN; HQ * TQ];
    let (q3, k3) = ([TQ, HQ, D], [TK, HKV, D]);
    let q = Tensor::contiguous(&s.q, &q3).unwrap();
    let k = Tensor::contiguous(&s.k, &k3).unwrap();
    let v = Tensor::contiguous(&s.v, &k3).unwrap();
    let opts = Options::default();
    let mut call = |q: &Tensor<f32>, lse_shape: &[usize], out_shape: &[usize]| {
        let e = forward_varlen(
            q,
            &k,
            &v,
            &mut TensorMut::contiguous(&mut out, out_shape).unwrap(),
            &mut TensorMut::contiguous(&mut lse, lse_shape).unwrap(),
            &vl,
            &opts,
        )
        .expect_err("accepted");
        assert_eq!(e.kind(), ErrorKind::InvalidArgument, "{e}");
        e
    };
    // The dense lse layout [1, Hq, total_q], and [total_q, Hq] transposed.
    let e = call(&q, &[1, HQ, TQ], &q3);
    assert!(e.message().contains("lse"), "{e}");
    let e = call(&q, &[TQ, HQ], &q3);
    assert!(e.message().contains("lse"), "{e}");
    // A 4-d (dense) q.
    let q4 = Tensor::contiguous(&s.q, &[1, TQ, HQ, D]).unwrap();
    let e = call(&q4, &[HQ, TQ], &q3);
    assert!(e.message().contains("q"), "{e}");
    // out with a different row count from q.
    let e = call(&q, &[HQ, TQ], &[TQ - 1, HQ, D]);
    assert!(e.message().contains("out"), "{e}");
    assert!(out.iter().chain(&lse).all(|x| x.is_nan()), "an output was written");
}

#[test]
fn varlen_backward_rejects_bad_prefix_sums() {
    let s = Small::new();
    let (q3, k3) = ([TQ, HQ, D], [TK, HKV, D]);
    let out = vec![0f32; TQ * HQ * D];
    let lse = vec![0f32; HQ * TQ];
    let (mut dq, mut dk, mut dv) =
        (vec![f32::NAN; TQ * HQ * D], vec![f32::NAN; TK * HKV * D], vec![f32::NAN; TK * HKV * D]);
    let e = backward_varlen(
        &Tensor::contiguous(&s.q, &q3).unwrap(),
        &Tensor::contiguous(&s.k, &k3).unwrap(),
        &Tensor::contiguous(&s.v, &k3).unwrap(),
        &Tensor::contiguous(&out, &q3).unwrap(),
        &Tensor::contiguous(&out, &q3).unwrap(),
        &Tensor::contiguous(&lse, &[HQ, TQ]).unwrap(),
        &mut TensorMut::contiguous(&mut dq, &q3).unwrap(),
        &mut TensorMut::contiguous(&mut dk, &k3).unwrap(),
        &mut TensorMut::contiguous(&mut dv, &k3).unwrap(),
        &Varlen::new(&[0, 3, 2, 5], &[0, 1, 2, 5], 3, 3),
        &Options::default(),
    )
    .expect_err("accepted");
    assert_eq!(e.kind(), ErrorKind::InvalidArgument, "{e}");
    assert!(e.message().contains("cu_seqlens_q"), "{e}");
    assert!(dq.iter().chain(&dk).chain(&dv).all(|x| x.is_nan()), "an output was written");
}

#[test]
fn varlen_indices_on_another_device_are_refused() {
    // Host memory labelled as CUDA device 0 while q is on the CPU: refused before anything reads
    // it (with or without CUDA in this build).
    let vl =
        unsafe { Varlen::from_raw_parts(Device::Cuda(0), 2, CQ.as_ptr(), CK.as_ptr(), None, 3, 3) };
    assert_eq!(vl.batch(), 2);
    let mut s = Small::new();
    let e = s.forward(&vl).expect_err("accepted");
    assert!(e.message().contains("cu_seqlens_q") || e.message().contains("device"), "{e}");
    assert!(s.untouched(), "{e}: an output was written");
}
