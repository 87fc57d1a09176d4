//! Sliding window, softcap and ALiBi through the safe API, forward and backward, against the
//! float64 reference (its `_ex` functions); the reference binding itself checked first against a
//! direct computation and by finite differences; bad values refused with the library's message.
//!
//! Windows are served by every backend. Softcap and ALiBi need the backend that implements them:
//! without it their tests fail (Unsupported), they are not skipped, so that a gap shows.
mod common;

use common::reference::{backward_ex, forward_ex};
use common::*;
use flashattn::{
    backward, forward, Bf16, Device, Element, ErrorKind, Mask, Options, Tensor, TensorMut, Window,
    F16,
};

// The bounds of tests/attention.rs (which explains them): |got - ref| / (1 + |ref|).
const TOL_F32: Tol = Tol { out: 2e-5, lse: 1e-5, grad: 3e-5 };
const TOL_F64: Tol = Tol { out: 1e-12, lse: 2.4e-7, grad: 4e-6 };
const TOL_F16: Tol = Tol { out: 5e-3, lse: 1e-5, grad: 1e-2 };
const TOL_BF16: Tol = Tol { out: 2e-2, lse: 1e-5, grad: 3e-2 };

/// Unbounded on one side, a band around the diagonal, the diagonal alone, wider than any
/// sequence here.
const WINDOWS: [Window; 6] = [
    Window { left: Some(4), right: None },
    Window { left: None, right: Some(3) },
    Window { left: Some(8), right: Some(0) },
    Window { left: Some(0), right: Some(0) },
    Window { left: Some(3), right: Some(5) },
    Window { left: Some(1000), right: Some(1000) },
];

fn with(case: Case, f: impl FnOnce(&mut Case)) -> Case {
    let mut c = case;
    f(&mut c);
    c
}

// ---- the reference binding --------------------------------------------------------------------

/// Attention written out from flashattn.h's semantics, forward only: (out, lse).
fn direct(
    s: &Shape,
    q: &[f64],
    k: &[f64],
    v: &[f64],
    scale: f64,
    mask: Mask,
    m: &Mods,
) -> (Vec<f64>, Vec<f64>) {
    let d = s.head_dim;
    let group = s.heads_q / s.heads_kv;
    let mut out = vec![0.0; s.q_len()];
    let mut lse = vec![f64::NEG_INFINITY; s.lse_len()];
    for b in 0..s.batch {
        for h in 0..s.heads_q {
            let kh = h / group;
            for i in 0..s.seq_q {
                let qrow = &q[((b * s.heads_q + h) * s.seq_q + i) * d..][..d];
                let mut scores = vec![];
                for j in 0..s.seq_kv {
                    if !visible_in(mask, m.window, i, j, s.seq_q, s.seq_kv) {
                        continue;
                    }
                    let krow = &k[((b * s.heads_kv + kh) * s.seq_kv + j) * d..][..d];
                    let mut x = scale * qrow.iter().zip(krow).map(|(a, b)| a * b).sum::<f64>();
                    if m.softcap > 0.0 {
                        x = m.softcap * (x / m.softcap).tanh();
                    }
                    if !m.alibi.is_empty() {
                        let dist = (i as f64 + s.seq_kv as f64 - s.seq_q as f64 - j as f64).abs();
                        x -= m.alibi[b * s.heads_q + h] * dist;
                    }
                    scores.push((j, x));
                }
                if scores.is_empty() {
                    continue;
                }
                let mx = scores.iter().map(|&(_, x)| x).fold(f64::NEG_INFINITY, f64::max);
                let den: f64 = scores.iter().map(|&(_, x)| (x - mx).exp()).sum();
                let row = ((b * s.heads_q + h) * s.seq_q + i) * d;
                for &(j, x) in &scores {
                    let p = (x - mx).exp() / den;
                    let vrow = &v[((b * s.heads_kv + kh) * s.seq_kv + j) * d..][..d];
                    for c in 0..d {
                        out[row + c] += p * vrow[c];
                    }
                }
                lse[(b * s.heads_q + h) * s.seq_q + i] = mx + den.ln();
            }
        }
    }
    (out, lse)
}

#[test]
fn reference_mods_match_a_direct_computation() {
    // Every field of flashattn_ref_mods must reach the reference: a misplaced one would give the
    // wrong window, cap or bias here.
    let shapes = [
        Shape { batch: 2, heads_q: 4, heads_kv: 2, seq_q: 7, seq_kv: 11, head_dim: 5 },
        Shape { batch: 1, heads_q: 3, heads_kv: 1, seq_q: 12, seq_kv: 5, head_dim: 4 },
    ];
    let windows = [None, Some(Window::left(2)), Some(Window::right(1)), Some(Window::new(1, 1))];
    let mut rng = Rng::new(11);
    let mut nonzero_bias = false;
    for s in shapes {
        let (q, k, v) = (rng.normals(s.q_len()), rng.normals(s.kv_len()), rng.normals(s.kv_len()));
        for mask in MASKS {
            for window in windows {
                for (softcap, alibi) in [(0.0, false), (1.5, false), (0.0, true), (0.7, true)] {
                    let alibi = if alibi {
                        (0..s.batch * s.heads_q).map(|_| 1.2 * rng.uniform() - 0.2).collect()
                    } else {
                        vec![]
                    };
                    nonzero_bias |= !alibi.is_empty();
                    let m = Mods { window, softcap, alibi };
                    let (want_out, want_lse) = direct(&s, &q, &k, &v, 0.9, mask, &m);
                    let (out, lse) = forward_ex(&s, &q, &k, &v, 0.9, mask, &m);
                    let (e, i) = max_error(&out, &want_out);
                    assert!(e < 1e-12, "{s:?} {mask:?} {m:?}: out {e:e} at {i}");
                    let (e, i) = max_error(&lse, &want_lse);
                    assert!(e < 1e-12, "{s:?} {mask:?} {m:?}: lse {e:e} at {i}");
                }
            }
        }
    }
    assert!(nonzero_bias);
    // The mods change the answer, so the agreement above is not vacuous.
    let s = shapes[0];
    let (q, k, v) = (rng.normals(s.q_len()), rng.normals(s.kv_len()), rng.normals(s.kv_len()));
    let plain = forward_ex(&s, &q, &k, &v, 0.9, Mask::None, &Mods::default()).0;
    for m in [
        Mods { softcap: 0.5, ..Mods::default() },
        Mods { alibi: vec![1.0; 8], ..Mods::default() },
        Mods { window: Some(Window::new(1, 1)), ..Mods::default() },
    ] {
        let other = forward_ex(&s, &q, &k, &v, 0.9, Mask::None, &m).0;
        assert!(max_error(&other, &plain).0 > 1e-3, "{m:?} changed nothing");
    }
}

#[test]
fn reference_mods_gradients_match_finite_differences() {
    let s = Shape { batch: 1, heads_q: 4, heads_kv: 2, seq_q: 5, seq_kv: 7, head_dim: 3 };
    let mut rng = Rng::new(12);
    let (q, k, v, dout) = (
        rng.normals(s.q_len()),
        rng.normals(s.kv_len()),
        rng.normals(s.kv_len()),
        rng.normals(s.q_len()),
    );
    let cases = [
        Mods { window: Some(Window::new(2, 1)), ..Mods::default() },
        Mods { softcap: 0.8, ..Mods::default() },
        Mods { alibi: vec![0.5, 0.1, 1.0, -0.2], ..Mods::default() },
        Mods { window: Some(Window::new(1, 0)), softcap: 1.3, alibi: vec![0.3, 0.0, 0.7, 0.2] },
    ];
    let loss = |q: &[f64], k: &[f64], v: &[f64], mask, m: &Mods| -> f64 {
        let (out, _) = forward_ex(&s, q, k, v, 0.7, mask, m);
        out.iter().zip(&dout).map(|(o, g)| o * g).sum()
    };
    for m in &cases {
        for mask in [Mask::None, Mask::CausalTopLeft] {
            let (dq, dk, dv) = backward_ex(&s, &q, &k, &v, &dout, 0.7, mask, m);
            for (which, grad) in [(0, &dq), (1, &dk), (2, &dv)] {
                for idx in 0..grad.len() {
                    let mut args = [q.clone(), k.clone(), v.clone()];
                    args[which][idx] += 1e-6;
                    let up = loss(&args[0], &args[1], &args[2], mask, m);
                    args[which][idx] -= 2e-6;
                    let down = loss(&args[0], &args[1], &args[2], mask, m);
                    let fd = (up - down) / 2e-6;
                    let err = (fd - grad[idx]).abs() / (1.0 + grad[idx].abs());
                    assert!(
                        err < 1e-7,
                        "{m:?} {mask:?} grad {which}[{idx}]: fd {fd} vs {}",
                        grad[idx]
                    );
                }
            }
        }
    }
}

#[test]
fn window_predicate_by_hand() {
    // Sq = 4, Skv = 6: the diagonal of row i is key i + 2.
    let vis = |w, i, j| visible_in(Mask::None, Some(w), i, j, 4, 6);
    assert!(vis(Window::new(1, 0), 0, 1) && vis(Window::new(1, 0), 0, 2));
    assert!(!vis(Window::new(1, 0), 0, 0) && !vis(Window::new(1, 0), 0, 3));
    assert!(vis(Window::right(1), 3, 0) && !vis(Window::left(0), 3, 4));
    // Sq = 6 > Skv = 2: the diagonal of row 0 is key -4, so (0, 0) hides every key of rows 0..3.
    assert!(!(0..2).any(|j| visible_in(Mask::None, Some(Window::new(0, 0)), 3, j, 6, 2)));
    assert!(visible_in(Mask::None, Some(Window::new(0, 0)), 4, 0, 6, 2));
    // Intersected with the mask.
    assert!(!visible_in(Mask::CausalTopLeft, Some(Window::right(5)), 0, 1, 4, 6));
}

// ---- sliding window (every backend) ---------------------------------------------------------------

fn window_grid<T: Element>(layout: Layout, tol: Tol) {
    let mut worst: f64 = 0.0;
    for (n, s) in SHAPES.iter().enumerate() {
        for (m, mask) in MASKS.iter().enumerate() {
            for (w, window) in WINDOWS.iter().enumerate() {
                let case = with(Case::new(*s, *mask, layout), |c| c.window = Some(*window));
                worst = worst.max(check_case::<T>(&case, (1000 * n + 10 * m + w) as u64, tol));
            }
        }
    }
    println!("{:?} {layout:?} windows: worst error {worst:.2e}", T::DTYPE);
}

#[test]
fn window_f32() {
    for layout in LAYOUTS {
        window_grid::<f32>(layout, TOL_F32);
    }
}

#[test]
fn window_f64() {
    window_grid::<f64>(Layout::Bshd, TOL_F64);
}

#[test]
fn window_f16_and_bf16() {
    for mask in MASKS {
        for window in [WINDOWS[2], WINDOWS[4]] {
            let case = with(Case::new([1, 4, 2, 17, 33, 32], mask, Layout::Bshd), |c| {
                c.window = Some(window)
            });
            check_case::<F16>(&case, 21, TOL_F16);
            check_case::<Bf16>(&case, 22, TOL_BF16);
        }
    }
}

#[test]
fn window_rows_and_keys_that_see_nothing() {
    // Sq = 33 > Skv = 9 with the diagonal alone: rows whose diagonal is before key 0 see no key.
    let case = with(Case::new([2, 2, 1, 33, 9, 16], Mask::None, Layout::Padded), |c| {
        c.window = Some(Window::new(0, 0))
    });
    check_case::<f32>(&case, 5, TOL_F32);
    let r = run_library::<f32>(&case, &Inputs::random::<f32>(&case, 5)).unwrap();
    assert_eq!(check_masked_exactly(&case, &r), 2 * 2 * 24, "rows without keys counted");
    // Sq = 3 < Skv = 17 with (1, 0): the first keys are seen by no query (dk = dv = 0 there,
    // checked by check_masked_exactly).
    let case = with(Case::new([1, 2, 2, 3, 17, 8], Mask::None, Layout::Bhsd), |c| {
        c.window = Some(Window::new(1, 0))
    });
    check_case::<f64>(&case, 6, TOL_F64);
}

#[test]
fn unbounded_window_is_no_window_and_causal_local_has_two_spellings() {
    let case = Case::new([2, 4, 2, 23, 41, 32], Mask::CausalBottomRight, Layout::Bshd);
    let x = Inputs::random::<f32>(&case, 9);
    let plain = run_library::<f32>(&case, &x).unwrap();
    let unbounded =
        run_library::<f32>(&with(case, |c| c.window = Some(Window::default())), &x).unwrap();
    assert_eq!(plain, unbounded);
    // FlashAttention's causal local attention: bottom-right causal with (left, unbounded) is the
    // window (left, 0) without a mask, bit for bit.
    let a = run_library::<f32>(&with(case, |c| c.window = Some(Window::left(5))), &x).unwrap();
    let b = run_library::<f32>(
        &with(case, |c| {
            c.mask = Mask::None;
            c.window = Some(Window::new(5, 0))
        }),
        &x,
    )
    .unwrap();
    assert_eq!(a, b);
    assert!(max_error(&a.out, &plain.out).0 > 1e-3);
}

// ---- softcap and ALiBi (need the backend that implements them) -----------------------------------

fn mods_grid<T: Element>(tol: Tol, set: impl Fn(&mut Case)) {
    let mut worst: f64 = 0.0;
    for (n, s) in SHAPES.iter().enumerate() {
        for (m, mask) in MASKS.iter().enumerate() {
            let case = with(Case::new(*s, *mask, Layout::Bshd), &set);
            worst = worst.max(check_case::<T>(&case, (100 * n + m) as u64, tol));
        }
    }
    println!("{:?}: worst error {worst:.2e}", T::DTYPE);
}

fn softcap(c: &mut Case) {
    // Scale 1 makes the scores O(sqrt(D)), so a cap of 3 bends most of them.
    c.scale = Some(1.0);
    c.softcap = Some(3.0);
}

#[test]
fn softcap_f32_f64() {
    mods_grid::<f32>(TOL_F32, softcap);
    mods_grid::<f64>(TOL_F64, softcap);
}

#[test]
fn softcap_f16_bf16() {
    mods_grid::<F16>(TOL_F16, softcap);
    mods_grid::<Bf16>(TOL_BF16, softcap);
}

#[test]
fn alibi_per_head_and_per_batch() {
    for alibi in [Alibi::Heads, Alibi::Batch] {
        mods_grid::<f32>(TOL_F32, |c| c.alibi = alibi);
        mods_grid::<f64>(TOL_F64, |c| c.alibi = alibi);
        mods_grid::<F16>(TOL_F16, |c| c.alibi = alibi);
    }
}

#[test]
fn window_softcap_and_alibi_together() {
    for window in [None, Some(Window::new(6, 0)), Some(Window::new(3, 4))] {
        let set = |c: &mut Case| {
            c.scale = Some(0.5);
            c.window = window;
            c.softcap = Some(2.5);
            c.alibi = Alibi::Batch;
        };
        mods_grid::<f32>(TOL_F32, set);
        mods_grid::<f64>(TOL_F64, set);
        mods_grid::<Bf16>(TOL_BF16, set);
    }
    for layout in LAYOUTS {
        let case = with(Case::new([2, 4, 2, 33, 17, 16], Mask::CausalBottomRight, layout), |c| {
            c.window = Some(Window::left(5));
            c.softcap = Some(1.5);
            c.alibi = Alibi::Heads;
        });
        check_case::<f32>(&case, 3, TOL_F32);
    }
}

#[test]
fn mods_are_deterministic_across_thread_counts() {
    let case =
        with(Case::new([2, 4, 2, 150, 131, 64], Mask::CausalBottomRight, Layout::Bshd), |c| {
            c.window = Some(Window::new(40, 7));
            c.softcap = Some(4.0);
            c.alibi = Alibi::Batch;
        });
    let x = Inputs::random::<f32>(&case, 13);
    let runs: Vec<Results> = [1, 2, 0]
        .into_iter()
        .map(|t| run_library::<f32>(&with(case, |c| c.threads = t), &x).unwrap())
        .collect();
    assert!(runs[0].out.iter().all(|x| x.is_finite()));
    assert_eq!(runs[0], runs[1]);
    assert_eq!(runs[0], runs[2]);
}

#[test]
fn strided_slopes_are_read_in_place() {
    // Every other element of a buffer as [Hq] slopes, and the same values as [B, Hq] with a row
    // stride of 9: both mean what the contiguous [Hq] slopes mean.
    let case = with(Case::new([3, 4, 2, 19, 26, 16], Mask::None, Layout::Bhsd), |c| {
        c.alibi = Alibi::Heads
    });
    let (slopes, _) = case.slopes();
    let x = Inputs::random::<f32>(&case, 14);
    let want = run_library::<f32>(&case, &x).unwrap();
    let mut spaced = vec![f32::NAN; 8];
    let mut rows = [f32::NAN; 27];
    for h in 0..4 {
        spaced[2 * h] = slopes[h];
        for b in 0..3 {
            rows[9 * b + 1 + 2 * h] = slopes[h];
        }
    }
    let views = [
        Tensor::new(&spaced, &[4], &[2]).unwrap(),
        Tensor::new(&rows[1..], &[3, 4], &[9, 2]).unwrap(),
    ];
    for t in views {
        let got = run_with_options(&case, &x, &case.options_with(Some(t)));
        assert_eq!(got.out, want.out, "{:?}", t.strides());
        assert_eq!(got.dq, want.dq);
    }
}

/// Forward and backward with explicit options (contiguous [B, H, S, D] buffers).
fn run_with_options(case: &Case, x: &Inputs, opts: &Options<'_>) -> Results {
    let (qd, kd) = (case.q_dims(), case.kv_dims());
    let s = &case.shape;
    let (q, k, v, dout) = (
        scatter::<f32>(&x.q, qd, Layout::Bhsd),
        scatter::<f32>(&x.k, kd, Layout::Bhsd),
        scatter::<f32>(&x.v, kd, Layout::Bhsd),
        scatter::<f32>(&x.dout, qd, Layout::Bhsd),
    );
    let (qt, kt, vt) = (
        Tensor::bhsd(&q, qd).unwrap(),
        Tensor::bhsd(&k, kd).unwrap(),
        Tensor::bhsd(&v, kd).unwrap(),
    );
    let mut out = vec![f32::NAN; q.len()];
    let mut lse = vec![f32::NAN; s.lse_len()];
    let lse_dims = [s.batch, s.heads_q, s.seq_q];
    forward(
        &qt,
        &kt,
        &vt,
        &mut TensorMut::bhsd(&mut out, qd).unwrap(),
        &mut TensorMut::contiguous(&mut lse, &lse_dims).unwrap(),
        opts,
    )
    .unwrap();
    let (mut dq, mut dk, mut dv) =
        (vec![f32::NAN; q.len()], vec![f32::NAN; k.len()], vec![f32::NAN; v.len()]);
    backward(
        &qt,
        &kt,
        &vt,
        &Tensor::bhsd(&out, qd).unwrap(),
        &Tensor::bhsd(&dout, qd).unwrap(),
        &Tensor::contiguous(&lse, &lse_dims).unwrap(),
        &mut TensorMut::bhsd(&mut dq, qd).unwrap(),
        &mut TensorMut::bhsd(&mut dk, kd).unwrap(),
        &mut TensorMut::bhsd(&mut dv, kd).unwrap(),
        opts,
    )
    .unwrap();
    let f = |v: &[f32]| v.iter().map(|&x| x as f64).collect::<Vec<_>>();
    Results { out: f(&out), lse: f(&lse), dq: f(&dq), dk: f(&dk), dv: f(&dv) }
}

// ---- bad values ---------------------------------------------------------------------------------

/// A forward on NaN-poisoned outputs that must fail: returns the error, checks nothing was written.
fn forward_err(opts: &Options<'_>) -> flashattn::Error {
    let dims = [2, 4, 8, 16];
    let kv = [2, 2, 8, 16];
    let (q, k) = (vec![0.5f32; 2 * 4 * 8 * 16], vec![0.25f32; 2 * 2 * 8 * 16]);
    let mut out = vec![f32::NAN; q.len()];
    let mut lse = vec![f32::NAN; 2 * 4 * 8];
    let e = forward(
        &Tensor::bhsd(&q, dims).unwrap(),
        &Tensor::bhsd(&k, kv).unwrap(),
        &Tensor::bhsd(&k, kv).unwrap(),
        &mut TensorMut::bhsd(&mut out, dims).unwrap(),
        &mut TensorMut::contiguous(&mut lse, &[2, 4, 8]).unwrap(),
        opts,
    )
    .expect_err("the call must fail");
    assert!(out.iter().chain(&lse).all(|x| x.is_nan()), "a failed call wrote an output");
    e
}

fn assert_err(e: &flashattn::Error, kind: ErrorKind, needles: &[&str]) {
    assert_eq!(e.kind(), kind, "{e}");
    for n in needles {
        assert!(e.message().contains(n), "message {:?} lacks {n:?}", e.message());
    }
}

#[test]
fn bad_softcap_values() {
    for (cap, shown) in [(-1.0f32, "-1"), (f32::NAN, "nan"), (f32::INFINITY, "inf")] {
        let e = forward_err(&Options::default().with_softcap(cap));
        assert_err(&e, ErrorKind::InvalidArgument, &["options.softcap = ", shown, "is invalid"]);
    }
}

#[test]
fn window_side_beyond_int64() {
    let e = forward_err(&Options::default().with_window(Window::new(3, usize::MAX)));
    assert_err(&e, ErrorKind::InvalidArgument, &["options.window.right", "does not fit in int64"]);
}

#[test]
fn bad_slopes() {
    let buf = vec![0.5f32; 64];
    let cases: [(&[usize], &str); 4] = [
        (&[2], "alibi_slopes.shape = [2] does not match q: expected [4] or [2, 4]"),
        (&[3, 4], "alibi_slopes.shape = [3, 4]"),
        (&[4, 2], "alibi_slopes.shape = [4, 2]"),
        (&[2, 4, 1], "alibi_slopes->ndim = 3, expected 1 ([Hq]) or 2 ([B, Hq])"),
    ];
    for (dims, needle) in cases {
        let t = Tensor::contiguous(&buf, dims).unwrap();
        let e = forward_err(&Options::default().with_alibi_slopes(t));
        assert_err(&e, ErrorKind::InvalidArgument, &[needle]);
    }
    // Slopes that claim to be on a CUDA device, with CPU inputs.
    // SAFETY: the library refuses the call before reading the slopes (what this test checks).
    let t = unsafe { Tensor::from_raw_parts(buf.as_ptr(), Device::Cuda(0), &[4], &[1]) }.unwrap();
    let e = forward_err(&Options::default().with_alibi_slopes(t));
    assert_eq!(e.kind(), ErrorKind::InvalidArgument, "{e}");
    assert!(e.message().contains("alibi_slopes"), "{e}");
}

#[test]
fn slopes_overlapping_an_output_are_refused() {
    // Safe code cannot make slopes alias an output; raw views can, and the library says no.
    let (dims, kv) = ([1, 4, 4, 4], [1, 4, 4, 4]);
    let inputs = vec![0.5f32; 64];
    let mut out = vec![f32::NAN; 64];
    let mut lse = vec![f32::NAN; 16];
    let p = out.as_mut_ptr();
    // SAFETY: the library refuses the call before touching memory (what this test checks).
    let (slopes, mut ot) = unsafe {
        (
            Tensor::from_raw_parts(p.add(8) as *const f32, Device::Cpu, &[4], &[1]).unwrap(),
            TensorMut::from_raw_parts(p, Device::Cpu, &dims, &[64, 16, 4, 1]).unwrap(),
        )
    };
    let t = Tensor::bhsd(&inputs, kv).unwrap();
    let e = forward(
        &t,
        &t,
        &t,
        &mut ot,
        &mut TensorMut::contiguous(&mut lse, &[1, 4, 4]).unwrap(),
        &Options::default().with_alibi_slopes(slopes),
    )
    .unwrap_err();
    assert_err(&e, ErrorKind::InvalidArgument, &["alibi_slopes"]);
    assert!(out.iter().all(|x| x.is_nan()));
}
