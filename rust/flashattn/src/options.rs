use core::ffi::c_void;
use core::ptr::NonNull;

use flashattn_sys as sys;

use crate::{Error, Tensor};

/// Which keys each query sees.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Mask {
    #[default]
    None,
    /// Key j visible to query i when j <= i.
    CausalTopLeft,
    /// Key j visible to query i when j <= i + Skv - Sq (FlashAttention's and PyTorch's
    /// `causal_lower_right`). With Sq > Skv the first Sq - Skv rows see no key: their output is 0,
    /// their log-sum-exp -inf and their gradients 0.
    CausalBottomRight,
}

/// How float32 inputs are multiplied on CUDA (ignored on the CPU).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Precision {
    /// As accurate as plain float32 arithmetic.
    #[default]
    Fp32,
    /// TF32 tensor cores, about 1e-3 relative error.
    Tf32,
}

/// A CUDA stream (`cudaStream_t`) to run on.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct CudaStream(NonNull<c_void>);

// SAFETY: a cudaStream_t is a handle that the CUDA runtime lets any host thread use.
unsafe impl Send for CudaStream {}
unsafe impl Sync for CudaStream {}

impl CudaStream {
    /// # Safety
    /// `stream` must be a live `cudaStream_t` of the device the tensors are on, for as long as any
    /// `Options` holding it is used.
    pub unsafe fn from_raw(stream: NonNull<c_void>) -> Self {
        CudaStream(stream)
    }
    pub fn as_raw(self) -> *mut c_void {
        self.0.as_ptr()
    }
}

/// FlashAttention's sliding window `window_size = (left, right)`: key j is visible to query i
/// when `i + Skv - Sq - left <= j <= i + Skv - Sq + right`. `None` leaves that side unbounded
/// (FlashAttention's -1). Intersected with the [`Mask`]: `Mask::CausalBottomRight` with
/// `Window::left(w)` is FlashAttention's causal local attention.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Window {
    pub left: Option<usize>,
    pub right: Option<usize>,
}

impl Window {
    /// Both sides bounded: `(left, right)`.
    pub fn new(left: usize, right: usize) -> Self {
        Window { left: Some(left), right: Some(right) }
    }
    /// Only the left side (past keys) bounded.
    pub fn left(left: usize) -> Self {
        Window { left: Some(left), right: None }
    }
    /// Only the right side (future keys) bounded.
    pub fn right(right: usize) -> Self {
        Window { left: None, right: Some(right) }
    }

    /// (window_left, window_right) as the C ABI takes them, -1 for an unbounded side.
    fn raw(&self) -> Result<(i64, i64), Error> {
        let side = |name: &str, w: Option<usize>| match w {
            None => Ok(-1),
            Some(n) => i64::try_from(n).map_err(|_| {
                Error::invalid(format!("options.window.{name} = {n} does not fit in int64"))
            }),
        };
        Ok((side("left", self.left)?, side("right", self.right)?))
    }
}

/// Options of forward and backward. The backward must get the same options as its forward.
///
/// Build them with struct update syntax (`Options { mask, ..Options::default() }`) or with the
/// chained setters ([`Options::with_window`], [`Options::with_softcap`],
/// [`Options::with_alibi_slopes`], ...).
#[derive(Clone, Copy, Debug, Default)]
pub struct Options<'a> {
    /// None (or Some(0.0)) means 1/sqrt(head_dim).
    pub softmax_scale: Option<f32>,
    pub mask: Mask,
    /// CPU worker threads; 0 means all hardware threads. Results are bitwise the same for any
    /// value.
    pub num_threads: u32,
    pub precision: Precision,
    /// None: the device's default stream.
    pub stream: Option<CudaStream>,
    /// A bitwise-reproducible backward. The CPU and CUDA float32 always give one; CUDA float16
    /// and bfloat16 otherwise accumulate dQ with float atomics (faster, order not fixed) and with
    /// this set use separate dQ and dK/dV passes instead.
    pub deterministic: bool,
    /// Sliding window; None (the default) is no window, like `Window::default()` (both sides
    /// unbounded).
    pub window: Option<Window>,
    /// Logit softcap (Gemma 2): None (or Some(0.0)) for none; Some(c), c finite and > 0, turns
    /// each score s = softmax_scale * q.k into c * tanh(s / c) before the softmax.
    pub softcap: Option<f32>,
    /// ALiBi slopes: a float32 view of shape `[Hq]` or `[B, Hq]` on q's device, adding
    /// `-slope[b, h] * |i + Skv - Sq - j|` to score (i, j) of query head h (after the softcap).
    /// No output may overlap it. The slopes get no gradient.
    pub alibi_slopes: Option<Tensor<'a, f32>>,
}

impl<'a> Options<'a> {
    pub fn with_softmax_scale(mut self, scale: f32) -> Self {
        self.softmax_scale = Some(scale);
        self
    }
    pub fn with_mask(mut self, mask: Mask) -> Self {
        self.mask = mask;
        self
    }
    pub fn with_num_threads(mut self, num_threads: u32) -> Self {
        self.num_threads = num_threads;
        self
    }
    pub fn with_precision(mut self, precision: Precision) -> Self {
        self.precision = precision;
        self
    }
    pub fn with_stream(mut self, stream: CudaStream) -> Self {
        self.stream = Some(stream);
        self
    }
    pub fn with_deterministic(mut self, deterministic: bool) -> Self {
        self.deterministic = deterministic;
        self
    }
    pub fn with_window(mut self, window: Window) -> Self {
        self.window = Some(window);
        self
    }
    pub fn with_softcap(mut self, softcap: f32) -> Self {
        self.softcap = Some(softcap);
        self
    }
    pub fn with_alibi_slopes(mut self, slopes: Tensor<'a, f32>) -> Self {
        self.alibi_slopes = Some(slopes);
        self
    }

    /// The C struct. `slopes` is the C view of `self.alibi_slopes` (made by the caller, which
    /// keeps it alive for the call: the struct points at it).
    pub(crate) fn raw(
        &self,
        slopes: Option<&sys::flashattn_tensor>,
    ) -> Result<sys::flashattn_options, Error> {
        let num_threads = i32::try_from(self.num_threads).map_err(|_| {
            Error::invalid(format!(
                "options.num_threads = {} does not fit in int32",
                self.num_threads
            ))
        })?;
        let (window_left, window_right) = self.window.unwrap_or_default().raw()?;
        Ok(sys::flashattn_options {
            // The size this crate was written against, not flashattn_options_init's: a newer
            // library's struct may be larger, and it must not read past ours.
            struct_size: core::mem::size_of::<sys::flashattn_options>() as u32,
            softmax_scale: self.softmax_scale.unwrap_or(0.0),
            mask: match self.mask {
                Mask::None => sys::FLASHATTN_MASK_NONE,
                Mask::CausalTopLeft => sys::FLASHATTN_MASK_CAUSAL_TOP_LEFT,
                Mask::CausalBottomRight => sys::FLASHATTN_MASK_CAUSAL_BOTTOM_RIGHT,
            },
            stream: self.stream.map_or(core::ptr::null_mut(), CudaStream::as_raw),
            num_threads,
            precision: match self.precision {
                Precision::Fp32 => sys::FLASHATTN_PRECISION_FP32,
                Precision::Tf32 => sys::FLASHATTN_PRECISION_TF32,
            },
            deterministic: i32::from(self.deterministic),
            reserved0: 0,
            window_left,
            window_right,
            softcap: self.softcap.unwrap_or(0.0),
            sliding_window: i32::from(window_left != -1 || window_right != -1),
            alibi_slopes: slopes.map_or(core::ptr::null(), |t| t as *const _),
            max_flops: 0.0,
            cancel: None,
            cancel_arg: core::ptr::null_mut(),
            // (The library's own CUDA scratch pool: this crate serves host memory.)
            workspace: core::ptr::null_mut(),
            workspace_bytes: 0,
            workspace_query: core::ptr::null_mut(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // Flags such as deterministic leave no trace in CPU results (always deterministic there), so
    // check here that every field reaches the C struct, and that the struct tells the library it
    // has the field.
    #[test]
    fn raw_carries_every_field() {
        let d = Options::default().raw(None).unwrap();
        assert_eq!(d.deterministic, 0);
        assert_eq!(d.struct_size as usize, core::mem::size_of::<sys::flashattn_options>());
        assert!(
            d.struct_size as usize
                >= core::mem::offset_of!(sys::flashattn_options, alibi_slopes)
                    + core::mem::size_of::<*const sys::flashattn_tensor>()
        );
        assert_eq!((d.sliding_window, d.window_left, d.window_right), (0, -1, -1));
        assert_eq!(d.softcap, 0.0);
        assert!(d.alibi_slopes.is_null());
        let slopes = [0.5f32, 0.25];
        let t = Tensor::contiguous(&slopes, &[2]).unwrap();
        let opts = Options {
            softmax_scale: Some(0.5),
            mask: Mask::CausalBottomRight,
            num_threads: 3,
            precision: Precision::Tf32,
            stream: None,
            deterministic: true,
            window: Some(Window::new(4, 0)),
            softcap: Some(30.0),
            alibi_slopes: Some(t),
        };
        let raw_slopes = t.raw();
        let o = opts.raw(Some(&raw_slopes)).unwrap();
        assert_eq!(o.deterministic, 1);
        assert_eq!(o.softmax_scale, 0.5);
        assert_eq!(o.mask, sys::FLASHATTN_MASK_CAUSAL_BOTTOM_RIGHT);
        assert_eq!(o.num_threads, 3);
        assert_eq!(o.precision, sys::FLASHATTN_PRECISION_TF32);
        assert!(o.stream.is_null());
        assert_eq!((o.sliding_window, o.window_left, o.window_right), (1, 4, 0));
        assert_eq!(o.softcap, 30.0);
        assert!(core::ptr::eq(o.alibi_slopes, &raw_slopes));
        // One unbounded side is -1, and still a window.
        let o = Options::default().with_window(Window::left(7)).raw(None).unwrap();
        assert_eq!((o.sliding_window, o.window_left, o.window_right), (1, 7, -1));
        let o = Options::default().with_window(Window::right(0)).raw(None).unwrap();
        assert_eq!((o.sliding_window, o.window_left, o.window_right), (1, -1, 0));
        // Both unbounded is no window at all.
        let o = Options::default().with_window(Window::default()).raw(None).unwrap();
        assert_eq!((o.sliding_window, o.window_left, o.window_right), (0, -1, -1));
    }

    #[test]
    fn builder_sets_what_struct_syntax_sets() {
        let slopes = [1.0f32; 3];
        let t = Tensor::contiguous(&slopes, &[3]).unwrap();
        let built = Options::default()
            .with_softmax_scale(0.25)
            .with_mask(Mask::CausalTopLeft)
            .with_num_threads(2)
            .with_precision(Precision::Tf32)
            .with_deterministic(true)
            .with_window(Window::new(1, 2))
            .with_softcap(5.0)
            .with_alibi_slopes(t);
        assert_eq!(built.softmax_scale, Some(0.25));
        assert_eq!(built.mask, Mask::CausalTopLeft);
        assert_eq!(built.num_threads, 2);
        assert_eq!(built.precision, Precision::Tf32);
        assert!(built.deterministic);
        assert_eq!(built.window, Some(Window { left: Some(1), right: Some(2) }));
        assert_eq!(built.softcap, Some(5.0));
        assert_eq!(built.alibi_slopes.map(|s| s.shape().to_vec()), Some(vec![3]));
    }

    #[test]
    fn window_sides_must_fit_in_int64() {
        let e = Options::default().with_window(Window::left(usize::MAX)).raw(None).unwrap_err();
        assert_eq!(e.kind(), crate::ErrorKind::InvalidArgument);
        assert!(e.message().contains("options.window.left"), "{e}");
    }
}
