//! Bad inputs come back as Err with the library's message (or, for a slice too short for its
//! view, this crate's), and leave the outputs untouched.
use flashattn::{backward, forward, Device, Error, ErrorKind, Mask, Options, Tensor, TensorMut};

/// Runs a forward on NaN-poisoned outputs; returns the error and checks that nothing was written.
fn forward_err(q: [usize; 4], k: [usize; 4], v: [usize; 4], opts: Options) -> Error {
    let qb = vec![0.5f32; q.iter().product()];
    let kb = vec![0.5f32; k.iter().product()];
    let vb = vec![0.5f32; v.iter().product()];
    let mut out = vec![f32::NAN; q.iter().product()];
    let mut lse = vec![f32::NAN; q[0] * q[1] * q[2]];
    let err = forward(
        &Tensor::bhsd(&qb, q).unwrap(),
        &Tensor::bhsd(&kb, k).unwrap(),
        &Tensor::bhsd(&vb, v).unwrap(),
        &mut TensorMut::bhsd(&mut out, q).unwrap(),
        &mut TensorMut::contiguous(&mut lse, &[q[0], q[1], q[2]]).unwrap(),
        &opts,
    )
    .expect_err("the call must fail");
    assert!(out.iter().all(|x| x.is_nan()), "out was written by a failed call");
    assert!(lse.iter().all(|x| x.is_nan()), "lse was written by a failed call");
    err
}

fn assert_err(e: &Error, kind: ErrorKind, needles: &[&str]) {
    assert_eq!(e.kind(), kind, "{e}");
    for n in needles {
        assert!(e.message().contains(n), "message {:?} lacks {n:?}", e.message());
    }
}

#[test]
fn mismatched_head_dim() {
    let e = forward_err([1, 2, 5, 8], [1, 2, 5, 7], [1, 2, 5, 7], Options::default());
    assert_err(&e, ErrorKind::InvalidArgument, &["k.shape[3] (head_dim) = 7", "q.shape[3] = 8"]);
}

#[test]
fn kv_heads_must_divide_query_heads() {
    let e = forward_err([1, 3, 5, 8], [1, 2, 5, 8], [1, 2, 5, 8], Options::default());
    assert_err(&e, ErrorKind::InvalidArgument, &["does not divide", "= 3"]);
}

#[test]
fn k_and_v_shapes_differ() {
    let e = forward_err([1, 2, 5, 8], [1, 2, 5, 8], [1, 2, 6, 8], Options::default());
    assert_err(&e, ErrorKind::InvalidArgument, &["v.shape[2]"]);
}

#[test]
fn head_dim_too_large_is_unsupported() {
    let e = forward_err([1, 1, 2, 300], [1, 1, 2, 300], [1, 1, 2, 300], Options::default());
    assert_err(&e, ErrorKind::Unsupported, &["head_dim", "300"]);
}

#[test]
fn non_finite_softmax_scale() {
    let opts = Options { softmax_scale: Some(f32::NAN), ..Options::default() };
    let e = forward_err([1, 1, 2, 4], [1, 1, 2, 4], [1, 1, 2, 4], opts);
    assert_err(&e, ErrorKind::InvalidArgument, &["softmax_scale", "not finite"]);
}

#[test]
fn num_threads_beyond_int32() {
    let opts = Options { num_threads: u32::MAX, mask: Mask::CausalTopLeft, ..Options::default() };
    let e = forward_err([1, 1, 2, 4], [1, 1, 2, 4], [1, 1, 2, 4], opts);
    assert_err(&e, ErrorKind::InvalidArgument, &["num_threads"]);
}

#[test]
fn slice_too_short_is_caught_before_the_call() {
    let q = vec![0f32; 39];
    let e = Tensor::bshd(&q, [1, 5, 1, 8]).unwrap_err();
    assert_err(&e, ErrorKind::InvalidArgument, &["39 elements is too short", "needs 40"]);
    let mut o = vec![0f64; 7];
    assert!(TensorMut::new(&mut o, &[2, 4], &[4, 1]).is_err());
}

#[test]
fn wrong_ndim_and_strides_reach_the_library() {
    let buf = vec![0.5f32; 64];
    let mut out = vec![f32::NAN; 64];
    let mut lse = vec![f32::NAN; 8];
    let k = Tensor::bhsd(&buf, [1, 2, 4, 8]).unwrap();
    let opts = Options::default();
    // q given as 3-d.
    let q3 = Tensor::contiguous(&buf, &[2, 4, 8]).unwrap();
    let e = forward(
        &q3,
        &k,
        &k,
        &mut TensorMut::bhsd(&mut out, [1, 2, 4, 8]).unwrap(),
        &mut TensorMut::contiguous(&mut lse, &[1, 2, 4]).unwrap(),
        &opts,
    )
    .unwrap_err();
    assert_err(&e, ErrorKind::InvalidArgument, &["q.ndim = 3"]);
    // A head_dim stride of 2.
    let q = Tensor::new(&buf, &[1, 2, 4, 4], &[32, 16, 4, 2]).unwrap();
    let k4 = Tensor::bhsd(&buf[..32], [1, 2, 4, 4]).unwrap();
    let e = forward(
        &q,
        &k4,
        &k4,
        &mut TensorMut::bhsd(&mut out[..32], [1, 2, 4, 4]).unwrap(),
        &mut TensorMut::contiguous(&mut lse, &[1, 2, 4]).unwrap(),
        &opts,
    )
    .unwrap_err();
    assert_err(&e, ErrorKind::InvalidArgument, &["q.stride[3] (head_dim) = 2", "must be 1"]);
    // lse of the wrong length.
    let mut lse5 = vec![f32::NAN; 10];
    let e = forward(
        &k,
        &k,
        &k,
        &mut TensorMut::bhsd(&mut out, [1, 2, 4, 8]).unwrap(),
        &mut TensorMut::contiguous(&mut lse5, &[1, 2, 5]).unwrap(),
        &opts,
    )
    .unwrap_err();
    assert_err(&e, ErrorKind::InvalidArgument, &["lse.shape[2] (seq_q) = 5"]);
    assert!(out.iter().all(|x| x.is_nan()) && lse.iter().all(|x| x.is_nan()));
}

#[test]
fn backward_names_the_bad_gradient() {
    let dims = [1, 2, 4, 8];
    let buf = vec![0.5f64; 64];
    let lse = vec![0f32; 8];
    let t = Tensor::bhsd(&buf, dims).unwrap();
    let l = Tensor::contiguous(&lse, &[1, 2, 4]).unwrap();
    let (mut dq, mut dk, mut dv) = (vec![f64::NAN; 64], vec![f64::NAN; 64], vec![f64::NAN; 56]);
    let e = backward(
        &t,
        &t,
        &t,
        &t,
        &t,
        &l,
        &mut TensorMut::bhsd(&mut dq, dims).unwrap(),
        &mut TensorMut::bhsd(&mut dk, dims).unwrap(),
        &mut TensorMut::bhsd(&mut dv, [1, 2, 4, 7]).unwrap(),
        &Options::default(),
    )
    .unwrap_err();
    assert_err(&e, ErrorKind::InvalidArgument, &["dv.shape[3] (head_dim) = 7"]);
    assert!(dq.iter().chain(&dk).chain(&dv).all(|x| x.is_nan()), "a failed backward wrote");
}

#[test]
fn mixed_devices_and_cuda_pointers() {
    let dims = [1, 1, 2, 4];
    let buf = vec![0.5f32; 8];
    let mut out = vec![f32::NAN; 8];
    let mut lse = vec![f32::NAN; 2];
    let cpu = Tensor::bhsd(&buf, dims).unwrap();
    // SAFETY: never dereferenced by the library: it rejects the call first (tested here).
    let cuda =
        unsafe { Tensor::from_raw_parts(buf.as_ptr(), Device::Cuda(0), &dims, &[8, 8, 4, 1]) }
            .unwrap();
    assert_eq!(cuda.device(), Device::Cuda(0));
    let e = forward(
        &cuda,
        &cpu,
        &cpu,
        &mut TensorMut::bhsd(&mut out, dims).unwrap(),
        &mut TensorMut::contiguous(&mut lse, &[1, 1, 2]).unwrap(),
        &Options::default(),
    )
    .unwrap_err();
    assert_err(&e, ErrorKind::InvalidArgument, &["different devices", "cuda:0"]);
    if !flashattn::cuda_available() {
        // Every tensor claims CUDA device 0, which this machine does not have (or this build
        // does not support).
        let mut o2 = vec![f32::NAN; 8];
        let mut l2 = vec![f32::NAN; 2];
        let (ot, lt) = unsafe {
            (
                TensorMut::from_raw_parts(o2.as_mut_ptr(), Device::Cuda(0), &dims, &[8, 8, 4, 1])
                    .unwrap(),
                TensorMut::from_raw_parts(l2.as_mut_ptr(), Device::Cuda(0), &[1, 1, 2], &[2, 2, 1])
                    .unwrap(),
            )
        };
        let (mut ot, mut lt) = (ot, lt);
        let e = forward(&cuda, &cuda, &cuda, &mut ot, &mut lt, &Options::default()).unwrap_err();
        assert!(
            matches!(
                e.kind(),
                ErrorKind::Unsupported | ErrorKind::InvalidArgument | ErrorKind::Backend
            ),
            "{e}"
        );
        assert!(!e.message().is_empty());
        assert!(o2.iter().all(|x| x.is_nan()));
    }
}

#[test]
fn aliasing_made_through_unsafe_views_is_still_refused() {
    // Safe code cannot alias an output with an input; raw views can, and the library says no.
    let dims = [1, 1, 4, 4];
    let mut buf = vec![0.5f32; 16];
    let mut lse = vec![f32::NAN; 4];
    let p = buf.as_mut_ptr();
    // SAFETY: the library refuses the call before touching memory (what this test checks).
    let (q, mut out) = unsafe {
        (
            Tensor::from_raw_parts(p as *const f32, Device::Cpu, &dims, &[16, 16, 4, 1]).unwrap(),
            TensorMut::from_raw_parts(p, Device::Cpu, &dims, &[16, 16, 4, 1]).unwrap(),
        )
    };
    let e = forward(
        &q,
        &q,
        &q,
        &mut out,
        &mut TensorMut::contiguous(&mut lse, &[1, 1, 4]).unwrap(),
        &Options::default(),
    )
    .unwrap_err();
    assert_err(&e, ErrorKind::InvalidArgument, &["aliases input"]);
}

#[test]
fn error_display_has_the_status_and_message() {
    let e = forward_err([1, 3, 5, 8], [1, 2, 5, 8], [1, 2, 5, 8], Options::default());
    let shown = e.to_string();
    assert!(shown.starts_with("flashattn: invalid argument: "), "{shown}");
    assert!(shown.ends_with(e.message()));
    assert_eq!(e.kind().status(), flashattn::sys::FLASHATTN_ERROR_INVALID_ARGUMENT);
    let boxed: Box<dyn std::error::Error> = Box::new(e);
    assert!(boxed.to_string().contains("does not divide"));
}

#[test]
fn check_failures_count_needs_a_device() {
    let e = flashattn::cuda_take_check_failures(-1).expect_err("device -1");
    assert_err(&e, ErrorKind::InvalidArgument, &["device = -1"]);
    match flashattn::cuda_take_check_failures(0) {
        Ok(n) => assert!(flashattn::cuda_available() && n >= 0, "{n}"),
        Err(e) => assert!(!flashattn::cuda_available(), "{e}"),
    }
}
