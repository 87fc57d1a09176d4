use core::ffi::c_void;
use core::ptr::NonNull;

use flashattn_sys as sys;

use crate::Error;

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

/// Options of forward and backward. The backward must get the same options as its forward.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Options {
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
}

impl Options {
    pub(crate) fn raw(&self) -> Result<sys::flashattn_options, Error> {
        let num_threads = i32::try_from(self.num_threads).map_err(|_| {
            Error::invalid(format!(
                "options.num_threads = {} does not fit in int32",
                self.num_threads
            ))
        })?;
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
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // The flag leaves no trace in CPU results (always deterministic there), so check here that it
    // reaches the C struct, and that the struct tells the library it has the field.
    #[test]
    fn raw_carries_every_field() {
        let d = Options::default().raw().unwrap();
        assert_eq!(d.deterministic, 0);
        assert_eq!(d.struct_size as usize, core::mem::size_of::<sys::flashattn_options>());
        assert!(
            d.struct_size as usize
                >= core::mem::offset_of!(sys::flashattn_options, deterministic)
                    + core::mem::size_of::<i32>()
        );
        let o = Options {
            softmax_scale: Some(0.5),
            mask: Mask::CausalBottomRight,
            num_threads: 3,
            precision: Precision::Tf32,
            stream: None,
            deterministic: true,
        }
        .raw()
        .unwrap();
        assert_eq!(o.deterministic, 1);
        assert_eq!(o.softmax_scale, 0.5);
        assert_eq!(o.mask, sys::FLASHATTN_MASK_CAUSAL_BOTTOM_RIGHT);
        assert_eq!(o.num_threads, 3);
        assert_eq!(o.precision, sys::FLASHATTN_PRECISION_TF32);
        assert!(o.stream.is_null());
    }
}
