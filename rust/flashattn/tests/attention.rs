//! The library through the safe API, forward and backward, against the float64 reference.
mod common;

use common::*;
use flashattn::{forward, Bf16, Element, Mask, Options, Tensor, TensorMut, F16};

// Bounds on |got - ref| / (1 + |ref|). A wrong mask, scale or GQA mapping gives errors of order
// 0.1 to 1. Measured worst values on this grid (x86-64, AVX-512 kernels) were: float32 1.5e-6
// (all outputs); float64 out 1.4e-15, lse 4.8e-8, gradients 2.0e-7; float16 out 2.4e-4,
// gradients 5.0e-4; bfloat16 out 2.2e-3, gradients 4.3e-3. The bounds leave 7x to 20x of room.
// lse is float32 for every dtype, and the backward recomputes P from it, so float64 gradients
// carry float32-level relative error (about |lse| * 2^-24), far above float64 rounding.
const TOL_F32: Tol = Tol { out: 2e-5, lse: 1e-5, grad: 3e-5 };
const TOL_F64: Tol = Tol { out: 1e-12, lse: 2.4e-7, grad: 4e-6 };
const TOL_F16: Tol = Tol { out: 5e-3, lse: 1e-5, grad: 1e-2 };
const TOL_BF16: Tol = Tol { out: 2e-2, lse: 1e-5, grad: 3e-2 };

fn grid<T: Element>(layout: Layout, tol: Tol) {
    let mut worst: f64 = 0.0;
    for (n, s) in SHAPES.iter().enumerate() {
        for (m, mask) in MASKS.iter().enumerate() {
            let case = Case::new(*s, *mask, layout);
            worst = worst.max(check_case::<T>(&case, (100 * n + m) as u64, tol));
        }
    }
    println!("{:?} {layout:?}: worst error {worst:.2e} (tolerance {tol:?})", T::DTYPE);
}

#[test]
fn f32_bhsd() {
    grid::<f32>(Layout::Bhsd, TOL_F32);
}
#[test]
fn f32_bshd() {
    grid::<f32>(Layout::Bshd, TOL_F32);
}
#[test]
fn f32_padded_strides() {
    grid::<f32>(Layout::Padded, TOL_F32);
}
#[test]
fn f64_bhsd() {
    grid::<f64>(Layout::Bhsd, TOL_F64);
}
#[test]
fn f64_bshd() {
    grid::<f64>(Layout::Bshd, TOL_F64);
}
#[test]
fn f64_padded_strides() {
    grid::<f64>(Layout::Padded, TOL_F64);
}

#[test]
fn f16_and_bf16() {
    for layout in [Layout::Bhsd, Layout::Bshd] {
        for mask in MASKS {
            let case = Case::new([1, 4, 2, 17, 33, 32], mask, layout);
            check_case::<F16>(&case, 11, TOL_F16);
            check_case::<Bf16>(&case, 12, TOL_BF16);
        }
    }
}

#[test]
fn bottom_right_causal_with_more_queries_than_keys() {
    // Sq = 33 > Skv = 17: the first 16 query rows of every head see no key.
    for layout in LAYOUTS {
        let case = Case::new([2, 2, 1, 33, 17, 16], Mask::CausalBottomRight, layout);
        check_case::<f32>(&case, 5, TOL_F32);
        check_case::<f64>(&case, 6, TOL_F64);
        let x = Inputs::random::<f32>(&case, 5);
        let r = run_library::<f32>(&case, &x).unwrap();
        assert_eq!(check_masked_exactly(&case, &r), 2 * 2 * 16, "masked rows counted");
    }
}

#[test]
fn head_dims_of_the_fast_paths_and_odd_ones() {
    for (n, d) in [2usize, 32, 40, 64, 80, 96, 111, 128, 256].into_iter().enumerate() {
        let mask = MASKS[n % 3];
        check_case::<f32>(&Case::new([1, 2, 1, 9, 13, d], mask, Layout::Bhsd), n as u64, TOL_F32);
        check_case::<f64>(&Case::new([1, 2, 2, 13, 9, d], mask, Layout::Bshd), n as u64, TOL_F64);
    }
}

#[test]
fn explicit_softmax_scale() {
    let mut case = Case::new([1, 2, 2, 17, 17, 16], Mask::CausalTopLeft, Layout::Bhsd);
    case.scale = Some(0.3);
    check_case::<f32>(&case, 21, TOL_F32);
    check_case::<f64>(&case, 22, TOL_F64);
    // Some(0.0) is the library's "default" (1/sqrt(D)), like None.
    let x = Inputs::random::<f64>(&case, 23);
    let scaled = bits(&run_library::<f64>(&case, &x).unwrap());
    case.scale = Some(0.0);
    let explicit_zero = bits(&run_library::<f64>(&case, &x).unwrap());
    case.scale = None;
    assert!(
        bits(&run_library::<f64>(&case, &x).unwrap()) == explicit_zero,
        "Some(0.0) differs from None"
    );
    assert!(scaled != explicit_zero, "the scale is not passed through");
}

fn bits(r: &Results) -> Vec<u64> {
    [&r.out, &r.lse, &r.dq, &r.dk, &r.dv]
        .iter()
        .flat_map(|v| v.iter().map(|x| x.to_bits()))
        .collect()
}

#[test]
fn results_do_not_depend_on_thread_count() {
    let mut case = Case::new([2, 4, 2, 65, 47, 40], Mask::CausalBottomRight, Layout::Bshd);
    let x = Inputs::random::<f32>(&case, 31);
    case.threads = 1;
    let one = bits(&run_library::<f32>(&case, &x).unwrap());
    for threads in [1, 2, 3, 0] {
        case.threads = threads;
        assert_eq!(bits(&run_library::<f32>(&case, &x).unwrap()), one, "num_threads = {threads}");
    }
}

/// `deterministic` is accepted for every dtype; the CPU backward is deterministic either way, so
/// the results are bitwise those without it (and the runs compared are not trivially equal: each
/// starts from NaN-poisoned outputs).
fn deterministic_changes_nothing_on_the_cpu<T: Element>(seed: u64) {
    let mut case = Case::new([2, 4, 2, 33, 17, 24], Mask::CausalTopLeft, Layout::Bhsd);
    let x = Inputs::random::<T>(&case, seed);
    let plain = run_library::<T>(&case, &x).unwrap();
    case.deterministic = true;
    for threads in [1, 3] {
        case.threads = threads;
        let det = run_library::<T>(&case, &x).unwrap();
        assert_eq!(bits(&det), bits(&plain), "{:?} num_threads = {threads}", T::DTYPE);
    }
    assert!(plain.dq.iter().all(|v| v.is_finite()), "{:?}: dq not finite", T::DTYPE);
}

#[test]
fn deterministic_option_on_the_cpu() {
    deterministic_changes_nothing_on_the_cpu::<f32>(51);
    deterministic_changes_nothing_on_the_cpu::<f64>(52);
    deterministic_changes_nothing_on_the_cpu::<F16>(53);
    deterministic_changes_nothing_on_the_cpu::<Bf16>(54);
}

#[test]
fn packed_qkv_views_of_one_buffer() {
    // One [B, S, 3, H, D] buffer, as a fused QKV projection writes it: q, k and v are strided
    // views of the same slice, which shared borrows allow.
    let (b, s, h, d) = (2, 17, 3, 8);
    let shape = Shape { batch: b, heads_q: h, heads_kv: h, seq_q: s, seq_kv: s, head_dim: d };
    let mut rng = Rng::new(41);
    let packed: Vec<f32> = (0..b * s * 3 * h * d).map(|_| rng.normal() as f32).collect();
    let strides = [s * 3 * h * d, d, 3 * h * d, 1];
    let view =
        |which: usize| Tensor::new(&packed[which * h * d..], &[b, h, s, d], &strides).unwrap();
    let (q, k, v) = (view(0), view(1), view(2));
    let logical = |which: usize| -> Vec<f64> {
        let mut x = Vec::new();
        for bb in 0..b {
            for hh in 0..h {
                for ss in 0..s {
                    for dd in 0..d {
                        x.push(
                            packed[bb * strides[0]
                                + hh * strides[1]
                                + ss * strides[2]
                                + which * h * d
                                + dd] as f64,
                        );
                    }
                }
            }
        }
        x
    };
    let mut out = vec![f32::NAN; b * h * s * d];
    let mut lse = vec![f32::NAN; b * h * s];
    let opts = Options { mask: Mask::CausalTopLeft, ..Options::default() };
    forward(
        &q,
        &k,
        &v,
        &mut TensorMut::bshd(&mut out, [b, s, h, d]).unwrap(),
        &mut TensorMut::contiguous(&mut lse, &[b, h, s]).unwrap(),
        &opts,
    )
    .unwrap();
    let (want, want_lse) = reference::forward(
        &shape,
        &logical(0),
        &logical(1),
        &logical(2),
        shape.default_scale(),
        opts.mask,
    );
    let got = gather(&out, [b, h, s, d], Layout::Bshd);
    let lse64: Vec<f64> = lse.iter().map(|&x| x as f64).collect();
    assert!(max_error(&got, &want).0 <= TOL_F32.out, "out: {:?}", max_error(&got, &want));
    assert!(max_error(&lse64, &want_lse).0 <= TOL_F32.lse);
}
