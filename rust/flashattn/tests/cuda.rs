//! CUDA device memory through the unsafe constructors, on a stream, against the float64
//! reference.
//!
//! Rust's test harness has no run-time skip (a test that returns early counts as passed), so these
//! tests are `#[ignore]`d with the reason: a plain `cargo test` lists each as "ignored, needs a
//! CUDA device ..." and counts them in its "N ignored" total. On a GPU machine, run them with
//! `cargo test --test cuda -- --ignored` (or `--include-ignored` for the whole suite); asked to
//! run where the library has no usable CUDA device, they fail instead of passing vacuously.
//!
//! The CUDA runtime is loaded with dlopen at run time rather than linked, so this test builds on
//! every machine and the crate keeps no CUDA dependency.
mod common;

use std::ffi::{c_char, c_int, c_void, CString};
use std::ptr::NonNull;

use common::*;
use flashattn::{
    backward, forward, CudaStream, Device, Element, ErrorKind, Mask, Options, Precision, Tensor,
    TensorMut, Window,
};

extern "C" {
    fn dlopen(filename: *const c_char, flag: c_int) -> *mut c_void;
    fn dlsym(handle: *mut c_void, symbol: *const c_char) -> *mut c_void;
}
const RTLD_NOW: c_int = 2;
const H2D: c_int = 1;
const D2H: c_int = 2;

/// The few CUDA runtime entry points the test needs.
struct Cudart {
    malloc: unsafe extern "C" fn(*mut *mut c_void, usize) -> c_int,
    free: unsafe extern "C" fn(*mut c_void) -> c_int,
    memcpy: unsafe extern "C" fn(*mut c_void, *const c_void, usize, c_int) -> c_int,
    stream_create: unsafe extern "C" fn(*mut *mut c_void) -> c_int,
    stream_sync: unsafe extern "C" fn(*mut c_void) -> c_int,
    stream_destroy: unsafe extern "C" fn(*mut c_void) -> c_int,
}

impl Cudart {
    // The transmutes turn dlsym's pointers into the CUDA runtime's C signatures, spelled out in
    // the struct's field types.
    #[allow(clippy::missing_transmute_annotations)]
    fn load() -> Option<Cudart> {
        let mut names: Vec<String> = ["libcudart.so", "libcudart.so.13", "libcudart.so.12"]
            .iter()
            .map(|s| s.to_string())
            .collect();
        for var in ["CUDA_HOME", "CUDA_PATH"] {
            if let Ok(root) = std::env::var(var) {
                names.push(format!("{root}/lib64/libcudart.so"));
            }
        }
        names.push("/usr/local/cuda/lib64/libcudart.so".into());
        for name in names {
            let c = CString::new(name).unwrap();
            // SAFETY: plain dlopen/dlsym; each symbol is cast to its documented CUDA signature.
            unsafe {
                let h = dlopen(c.as_ptr(), RTLD_NOW);
                if h.is_null() {
                    continue;
                }
                let sym = |n: &str| {
                    let p = dlsym(h, CString::new(n).unwrap().as_ptr());
                    assert!(!p.is_null(), "libcudart lacks {n}");
                    p
                };
                return Some(Cudart {
                    malloc: std::mem::transmute(sym("cudaMalloc")),
                    free: std::mem::transmute(sym("cudaFree")),
                    memcpy: std::mem::transmute(sym("cudaMemcpy")),
                    stream_create: std::mem::transmute(sym("cudaStreamCreate")),
                    stream_sync: std::mem::transmute(sym("cudaStreamSynchronize")),
                    stream_destroy: std::mem::transmute(sym("cudaStreamDestroy")),
                });
            }
        }
        None
    }

    fn upload<T: Element>(&self, host: &[T]) -> DeviceBuf<'_, T> {
        let bytes = std::mem::size_of_val(host);
        let mut p: *mut c_void = std::ptr::null_mut();
        unsafe {
            assert_eq!((self.malloc)(&mut p, bytes.max(1)), 0, "cudaMalloc");
            assert_eq!((self.memcpy)(p, host.as_ptr() as *const c_void, bytes, H2D), 0);
        }
        DeviceBuf { rt: self, ptr: p as *mut T, len: host.len() }
    }
}

struct DeviceBuf<'a, T> {
    rt: &'a Cudart,
    ptr: *mut T,
    len: usize,
}

impl<T: Element> DeviceBuf<'_, T> {
    fn download(&self) -> Vec<T> {
        let mut host = vec![T::from_f64(0.0); self.len];
        let rc = unsafe {
            (self.rt.memcpy)(
                host.as_mut_ptr() as *mut c_void,
                self.ptr as *const c_void,
                std::mem::size_of_val(host.as_slice()),
                D2H,
            )
        };
        assert_eq!(rc, 0, "cudaMemcpy device to host");
        host
    }
    /// # Safety: the buffer must outlive the view and hold what the shape reaches.
    unsafe fn view(&self, dims: [usize; 4], layout: Layout) -> Tensor<'static, T> {
        let (st, _) = strides_of(layout, dims);
        unsafe { Tensor::from_raw_parts(self.ptr, Device::Cuda(0), &dims, &st) }.unwrap()
    }
    unsafe fn view_mut(&self, dims: [usize; 4], layout: Layout) -> TensorMut<'static, T> {
        let (st, _) = strides_of(layout, dims);
        unsafe { TensorMut::from_raw_parts(self.ptr, Device::Cuda(0), &dims, &st) }.unwrap()
    }
}

impl<T> Drop for DeviceBuf<'_, T> {
    fn drop(&mut self) {
        unsafe { (self.rt.free)(self.ptr as *mut c_void) };
    }
}

fn run_cuda(rt: &Cudart, case: &Case, precision: Precision, tol: Tol) {
    let (qd, kd, layout) = (case.q_dims(), case.kv_dims(), case.layout);
    let s = &case.shape;
    let x = Inputs::random::<f32>(case, 77);
    let scale = case.scale_f64();
    let mods = case.ref_mods();
    let (r_out, r_lse) = reference::forward_ex(s, &x.q, &x.k, &x.v, scale, case.mask, &mods);
    let (r_dq, r_dk, r_dv) =
        reference::backward_ex(s, &x.q, &x.k, &x.v, &x.dout, scale, case.mask, &mods);

    let q = rt.upload(&scatter::<f32>(&x.q, qd, layout));
    let k = rt.upload(&scatter::<f32>(&x.k, kd, layout));
    let v = rt.upload(&scatter::<f32>(&x.v, kd, layout));
    let dout = rt.upload(&scatter::<f32>(&x.dout, qd, layout));
    let poison = |dims| rt.upload(&vec![f32::NAN; strides_of(layout, dims).1]);
    let (out, dq, dk, dv) = (poison(qd), poison(qd), poison(kd), poison(kd));
    let lse = rt.upload(&vec![f32::NAN; s.lse_len()]);
    let lse_dims = [s.batch, s.heads_q, s.seq_q];
    let lse_st = [s.heads_q * s.seq_q, s.seq_q, 1];
    let (slopes, slope_dims) = case.slopes();
    let dev_slopes = rt.upload(&slopes);
    let slope_strides: Vec<usize> =
        if slope_dims.len() == 2 { vec![s.heads_q, 1] } else { vec![1] };
    // SAFETY: the device buffer holds every slope and outlives the calls below.
    let slopes_view = (!slopes.is_empty()).then(|| unsafe {
        Tensor::from_raw_parts(dev_slopes.ptr, Device::Cuda(0), &slope_dims, &slope_strides)
            .unwrap()
    });

    let mut stream: *mut c_void = std::ptr::null_mut();
    assert_eq!(unsafe { (rt.stream_create)(&mut stream) }, 0);
    let opts = Options {
        // SAFETY: a stream created above, destroyed after its last use below.
        stream: Some(unsafe { CudaStream::from_raw(NonNull::new(stream).unwrap()) }),
        precision,
        ..case.options_with(slopes_view)
    };
    // SAFETY: every buffer outlives the calls, and the stream is synchronised before reading.
    unsafe {
        let (qt, kt, vt) = (q.view(qd, layout), k.view(kd, layout), v.view(kd, layout));
        let lse_in = Tensor::from_raw_parts(lse.ptr, Device::Cuda(0), &lse_dims, &lse_st).unwrap();
        let mut lse_out =
            TensorMut::from_raw_parts(lse.ptr, Device::Cuda(0), &lse_dims, &lse_st).unwrap();
        forward(&qt, &kt, &vt, &mut out.view_mut(qd, layout), &mut lse_out, &opts)
            .unwrap_or_else(|e| panic!("{case:?}: {e}"));
        backward(
            &qt,
            &kt,
            &vt,
            &out.view(qd, layout),
            &dout.view(qd, layout),
            &lse_in,
            &mut dq.view_mut(qd, layout),
            &mut dk.view_mut(kd, layout),
            &mut dv.view_mut(kd, layout),
            &opts,
        )
        .unwrap_or_else(|e| panic!("{case:?}: {e}"));
        assert_eq!((rt.stream_sync)(stream), 0);
        (rt.stream_destroy)(stream);
    }
    let lse_host: Vec<f64> = lse.download().iter().map(|&x| x as f64).collect();
    for (name, got, want, t) in [
        ("out", gather(&out.download(), qd, layout), r_out, tol.out),
        ("lse", lse_host, r_lse, tol.lse),
        ("dq", gather(&dq.download(), qd, layout), r_dq, tol.grad),
        ("dk", gather(&dk.download(), kd, layout), r_dk, tol.grad),
        ("dv", gather(&dv.download(), kd, layout), r_dv, tol.grad),
    ] {
        let (e, i) = max_error(&got, &want);
        println!("{case:?} {precision:?} {name}: {e:.2e}");
        assert!(e <= t, "{case:?} {precision:?}: {name} error {e:.3e} > {t:.0e} at {i}");
    }
}

/// The CUDA runtime, for a test that was asked to run (`--ignored`): a machine without a usable
/// device fails it, since passing would claim a GPU test that never ran.
fn cuda_runtime() -> Cudart {
    assert!(
        flashattn::cuda_available(),
        "a CUDA test was asked to run, but this flashattn build has no usable CUDA device (a \
         build without the CUDA backend, or no GPU)"
    );
    Cudart::load().expect("flashattn sees a CUDA device but libcudart cannot be loaded")
}

#[test]
#[ignore = "needs a CUDA device: cargo test --test cuda -- --ignored"]
fn cuda_device_pointers_on_a_stream() {
    let rt = cuda_runtime();
    // fp32-accurate mode is as accurate as float32 arithmetic; tf32 about 1e-3 relative. Measured
    // worst errors on an H200 (sm_90 build, 2026-12-02): fp32 3.6e-6, tf32 1.7e-3.
    let fp32 = Tol { out: 1e-4, lse: 1e-4, grad: 1e-4 };
    let tf32 = Tol { out: 2e-2, lse: 2e-2, grad: 2e-2 };
    for (n, mask) in MASKS.into_iter().enumerate() {
        for layout in [Layout::Bhsd, Layout::Bshd, Layout::Padded] {
            let shape = [[2, 4, 2, 65, 47, 64], [1, 3, 1, 33, 129, 128], [1, 2, 2, 17, 17, 40]][n];
            let case = Case::new(shape, mask, layout);
            run_cuda(&rt, &case, Precision::Fp32, fp32);
            run_cuda(&rt, &case, Precision::Tf32, tf32);
        }
    }
    // Host memory that claims to be on the device is refused by the library.
    let host = vec![0f32; 64];
    let t = unsafe {
        Tensor::from_raw_parts(host.as_ptr(), Device::Cuda(0), &[1, 1, 8, 8], &[64, 64, 8, 1])
    }
    .unwrap();
    let dev_out = rt.upload(&vec![0f32; 64]);
    let dev_lse = rt.upload(&[0f32; 8]);
    let e = unsafe {
        forward(
            &t,
            &t,
            &t,
            &mut dev_out.view_mut([1, 1, 8, 8], Layout::Bhsd),
            &mut TensorMut::from_raw_parts(dev_lse.ptr, Device::Cuda(0), &[1, 1, 8], &[8, 8, 1])
                .unwrap(),
            &Options { mask: Mask::None, ..Options::default() },
        )
    }
    .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidArgument, "{e}");
    assert!(e.message().contains("host memory"), "{e}");
}

#[test]
#[ignore = "needs a CUDA device: cargo test --test cuda -- --ignored"]
fn cuda_window_softcap_alibi() {
    let rt = cuda_runtime();
    // The fp32-accurate bound of cuda_device_pointers_on_a_stream: the per-entry softcap / bias
    // step adds float32 rounding of the same order.
    let fp32 = Tol { out: 1e-4, lse: 1e-4, grad: 1e-4 };
    let shapes = [[2, 4, 2, 65, 47, 64], [1, 3, 1, 33, 129, 128], [1, 2, 2, 17, 17, 40]];
    for (n, mask) in MASKS.into_iter().enumerate() {
        for (window, softcap, alibi) in [
            (Some(Window::new(9, 3)), None, Alibi::None),
            (None, Some(2.5), Alibi::None),
            (None, None, Alibi::Heads),
            (Some(Window::left(20)), Some(4.0), Alibi::Batch),
        ] {
            let mut case = Case::new(shapes[n], mask, Layout::Bshd);
            case.scale = Some(0.5);
            case.window = window;
            case.softcap = softcap;
            case.alibi = alibi;
            run_cuda(&rt, &case, Precision::Fp32, fp32);
        }
    }
}
