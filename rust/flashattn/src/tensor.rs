use core::ffi::c_void;
use std::marker::PhantomData;

use flashattn_sys as sys;

use crate::half::{Bf16, F16};
use crate::Error;

/// Element types of flashattn tensors.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DType {
    Float32,
    Float16,
    Bfloat16,
    /// CPU only.
    Float64,
}

impl DType {
    pub fn code(self) -> i32 {
        match self {
            DType::Float32 => sys::FLASHATTN_FLOAT32,
            DType::Float16 => sys::FLASHATTN_FLOAT16,
            DType::Bfloat16 => sys::FLASHATTN_BFLOAT16,
            DType::Float64 => sys::FLASHATTN_FLOAT64,
        }
    }
}

mod sealed {
    pub trait Sealed {}
    impl Sealed for f32 {}
    impl Sealed for f64 {}
    impl Sealed for super::F16 {}
    impl Sealed for super::Bf16 {}
}

/// A Rust type whose memory layout is one of flashattn's dtypes. Sealed: the four types below are
/// the whole list.
pub trait Element: Copy + Send + Sync + 'static + sealed::Sealed {
    const DTYPE: DType;
    fn to_f64(self) -> f64;
    /// Rounds to nearest, ties to even.
    fn from_f64(x: f64) -> Self;
}

impl Element for f32 {
    const DTYPE: DType = DType::Float32;
    fn to_f64(self) -> f64 {
        self as f64
    }
    fn from_f64(x: f64) -> Self {
        x as f32
    }
}
impl Element for f64 {
    const DTYPE: DType = DType::Float64;
    fn to_f64(self) -> f64 {
        self
    }
    fn from_f64(x: f64) -> Self {
        x
    }
}
impl Element for F16 {
    const DTYPE: DType = DType::Float16;
    fn to_f64(self) -> f64 {
        F16::to_f64(self)
    }
    fn from_f64(x: f64) -> Self {
        F16::from_f64(x)
    }
}
impl Element for Bf16 {
    const DTYPE: DType = DType::Bfloat16;
    fn to_f64(self) -> f64 {
        Bf16::to_f64(self)
    }
    fn from_f64(x: f64) -> Self {
        Bf16::from_f64(x)
    }
}

/// Where a tensor's memory lives.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Device {
    Cpu,
    /// CUDA device n.
    Cuda(u32),
}

impl Device {
    fn code(self) -> Result<i32, Error> {
        match self {
            Device::Cpu => Ok(sys::FLASHATTN_CPU),
            Device::Cuda(n) => i32::try_from(n)
                .map_err(|_| Error::invalid(format!("CUDA device {n} does not fit in int32"))),
        }
    }
}

/// Shape and strides of a view, checked only for what the C struct can hold; every other check
/// (ndim, shapes agreeing, unit head_dim stride, ...) is the library's.
#[derive(Clone, Copy, Debug)]
struct Layout {
    ndim: usize,
    shape: [usize; 4],
    strides: [usize; 4],
}

impl Layout {
    fn new(shape: &[usize], strides: &[usize]) -> Result<Self, Error> {
        if shape.len() != strides.len() {
            return Err(Error::invalid(format!(
                "shape {shape:?} and strides {strides:?} have different lengths"
            )));
        }
        if shape.len() > 4 {
            return Err(Error::invalid(format!(
                "shape {shape:?} has {} dimensions; flashattn tensors have at most 4",
                shape.len()
            )));
        }
        for &x in shape.iter().chain(strides) {
            if i64::try_from(x).is_err() {
                return Err(Error::invalid(format!(
                    "shape {shape:?} / strides {strides:?}: {x} does not fit in int64"
                )));
            }
        }
        let mut l = Layout { ndim: shape.len(), shape: [0; 4], strides: [0; 4] };
        l.shape[..shape.len()].copy_from_slice(shape);
        l.strides[..strides.len()].copy_from_slice(strides);
        Ok(l)
    }

    fn contiguous(shape: &[usize]) -> Result<Self, Error> {
        let mut strides = [0usize; 4];
        let n = shape.len().min(4);
        let mut s = 1usize;
        for i in (0..n).rev() {
            strides[i] = s;
            s = s.saturating_mul(shape[i]);
        }
        Self::new(shape, &strides[..shape.len().min(4)])
    }

    fn shape(&self) -> &[usize] {
        &self.shape[..self.ndim]
    }
    fn strides(&self) -> &[usize] {
        &self.strides[..self.ndim]
    }

    /// Elements a buffer needs for every index of the view to land inside it: 1 + the largest
    /// offset (0 for an empty view, which reads nothing). None when that overflows.
    fn required_len(&self) -> Option<usize> {
        if self.shape().contains(&0) {
            return Some(0);
        }
        let mut max = 0usize;
        for (&n, &s) in self.shape().iter().zip(self.strides()) {
            max = max.checked_add((n - 1).checked_mul(s)?)?;
        }
        max.checked_add(1)
    }

    fn check_covered_by(&self, len: usize) -> Result<(), Error> {
        match self.required_len() {
            Some(need) if need <= len => Ok(()),
            Some(need) => Err(Error::invalid(format!(
                "a slice of {len} elements is too short for shape {:?} with strides {:?}, which \
                 needs {need}",
                self.shape(),
                self.strides()
            ))),
            None => Err(Error::invalid(format!(
                "shape {:?} with strides {:?} spans more elements than fit in usize",
                self.shape(),
                self.strides()
            ))),
        }
    }

    fn raw(&self, data: *mut c_void, dtype: DType, device: i32) -> sys::flashattn_tensor {
        let mut t = sys::flashattn_tensor {
            data,
            dtype: dtype.code(),
            device,
            ndim: self.ndim as i32,
            shape: [0; 4],
            stride: [0; 4],
        };
        for i in 0..self.ndim {
            // Checked to fit in Layout::new.
            t.shape[i] = self.shape[i] as i64;
            t.stride[i] = self.strides[i] as i64;
        }
        t
    }
}

fn bhsd_shape(dims: [usize; 4]) -> ([usize; 4], [usize; 4]) {
    let [b, h, s, d] = dims;
    let (sd, hsd) = (s.saturating_mul(d), h.saturating_mul(s).saturating_mul(d));
    ([b, h, s, d], [hsd, sd, d, 1])
}

/// [B, S, H, D] memory seen as the logical [B, H, S, D].
fn bshd_shape(dims: [usize; 4]) -> ([usize; 4], [usize; 4]) {
    let [b, s, h, d] = dims;
    let (hd, shd) = (h.saturating_mul(d), s.saturating_mul(h).saturating_mul(d));
    ([b, h, s, d], [shd, d, hd, 1])
}

macro_rules! common_methods {
    () => {
        /// Logical shape (for q/k/v-like tensors: [B, H, S, D]).
        pub fn shape(&self) -> &[usize] {
            self.layout.shape()
        }
        /// Strides in elements, one per logical dimension.
        pub fn strides(&self) -> &[usize] {
            self.layout.strides()
        }
        pub fn dtype(&self) -> DType {
            T::DTYPE
        }
        pub fn device(&self) -> Device {
            self.device
        }
    };
}

/// A borrowed, read-only tensor view: an input of forward or backward.
///
/// Views over one slice may overlap freely (e.g. q, k and v interleaved in one packed buffer).
#[derive(Clone, Copy, Debug)]
pub struct Tensor<'a, T: Element> {
    data: *const T,
    device: Device,
    layout: Layout,
    _borrow: PhantomData<&'a [T]>,
}

/// A borrowed, writable tensor view: an output of forward or backward. It holds its slice
/// mutably, so in safe code no other view of that memory can exist while it does.
#[derive(Debug)]
pub struct TensorMut<'a, T: Element> {
    data: *mut T,
    device: Device,
    layout: Layout,
    _borrow: PhantomData<&'a mut [T]>,
}

// SAFETY: a Tensor is a shared borrow of T data (T: Sync) or of device memory that the creator of
// an unsafe view vouched for; a TensorMut is an exclusive borrow. Both behave like &[T] / &mut [T].
unsafe impl<T: Element> Send for Tensor<'_, T> {}
unsafe impl<T: Element> Sync for Tensor<'_, T> {}
unsafe impl<T: Element> Send for TensorMut<'_, T> {}
unsafe impl<T: Element> Sync for TensorMut<'_, T> {}

impl<'a, T: Element> Tensor<'a, T> {
    /// A view with any shape (at most 4 dimensions) and strides (in elements). Fails when the
    /// slice is too short for the largest offset the view can reach.
    pub fn new(data: &'a [T], shape: &[usize], strides: &[usize]) -> Result<Self, Error> {
        let layout = Layout::new(shape, strides)?;
        layout.check_covered_by(data.len())?;
        Ok(Tensor { data: data.as_ptr(), device: Device::Cpu, layout, _borrow: PhantomData })
    }

    /// A row-major (C-contiguous) view, e.g. `&[B, H, Sq]` for the log-sum-exp.
    pub fn contiguous(data: &'a [T], shape: &[usize]) -> Result<Self, Error> {
        let layout = Layout::contiguous(shape)?;
        layout.check_covered_by(data.len())?;
        Ok(Tensor { data: data.as_ptr(), device: Device::Cpu, layout, _borrow: PhantomData })
    }

    /// Contiguous memory in the order `[batch, heads, seq, head_dim]`.
    pub fn bhsd(data: &'a [T], dims: [usize; 4]) -> Result<Self, Error> {
        let (shape, strides) = bhsd_shape(dims);
        Self::new(data, &shape, &strides)
    }

    /// Contiguous memory in the order `[batch, seq, heads, head_dim]` (FlashAttention's and most
    /// training code's layout), viewed without a copy as the logical [B, H, S, D].
    pub fn bshd(data: &'a [T], dims: [usize; 4]) -> Result<Self, Error> {
        let (shape, strides) = bshd_shape(dims);
        Self::new(data, &shape, &strides)
    }

    /// A view of memory this crate cannot check: CUDA device memory, or host memory not held in
    /// a slice.
    ///
    /// # Safety
    /// For the lifetime `'a`, `data` must point to memory on `device` that holds every element the
    /// shape and strides reach, is not written by anyone else while a call reads it, and (on CUDA)
    /// is valid on the stream the call runs on.
    pub unsafe fn from_raw_parts(
        data: *const T,
        device: Device,
        shape: &[usize],
        strides: &[usize],
    ) -> Result<Self, Error> {
        let layout = Layout::new(shape, strides)?;
        device.code()?;
        Ok(Tensor { data, device, layout, _borrow: PhantomData })
    }

    common_methods!();

    pub(crate) fn raw(&self) -> sys::flashattn_tensor {
        // Device codes were checked at construction.
        let device = self.device.code().unwrap_or(sys::FLASHATTN_CPU);
        self.layout.raw(self.data as *mut c_void, T::DTYPE, device)
    }
}

impl<'a, T: Element> TensorMut<'a, T> {
    /// See [`Tensor::new`].
    pub fn new(data: &'a mut [T], shape: &[usize], strides: &[usize]) -> Result<Self, Error> {
        let layout = Layout::new(shape, strides)?;
        layout.check_covered_by(data.len())?;
        Ok(TensorMut { data: data.as_mut_ptr(), device: Device::Cpu, layout, _borrow: PhantomData })
    }

    /// See [`Tensor::contiguous`].
    pub fn contiguous(data: &'a mut [T], shape: &[usize]) -> Result<Self, Error> {
        let layout = Layout::contiguous(shape)?;
        layout.check_covered_by(data.len())?;
        Ok(TensorMut { data: data.as_mut_ptr(), device: Device::Cpu, layout, _borrow: PhantomData })
    }

    /// See [`Tensor::bhsd`].
    pub fn bhsd(data: &'a mut [T], dims: [usize; 4]) -> Result<Self, Error> {
        let (shape, strides) = bhsd_shape(dims);
        Self::new(data, &shape, &strides)
    }

    /// See [`Tensor::bshd`].
    pub fn bshd(data: &'a mut [T], dims: [usize; 4]) -> Result<Self, Error> {
        let (shape, strides) = bshd_shape(dims);
        Self::new(data, &shape, &strides)
    }

    /// See [`Tensor::from_raw_parts`].
    ///
    /// # Safety
    /// As for [`Tensor::from_raw_parts`], and in addition nothing else may read or write the
    /// memory while a call writes it.
    pub unsafe fn from_raw_parts(
        data: *mut T,
        device: Device,
        shape: &[usize],
        strides: &[usize],
    ) -> Result<Self, Error> {
        let layout = Layout::new(shape, strides)?;
        device.code()?;
        Ok(TensorMut { data, device, layout, _borrow: PhantomData })
    }

    /// A read-only view of the same memory, e.g. to pass a forward's output to the backward.
    pub fn as_tensor(&self) -> Tensor<'_, T> {
        Tensor { data: self.data, device: self.device, layout: self.layout, _borrow: PhantomData }
    }

    common_methods!();

    pub(crate) fn raw(&mut self) -> sys::flashattn_tensor {
        let device = self.device.code().unwrap_or(sys::FLASHATTN_CPU);
        self.layout.raw(self.data as *mut c_void, T::DTYPE, device)
    }
}

/// The C view of an int32 index vector (the varlen `cu_seqlens` / `seqused_k`): ndim 1, shape
/// `[len]`, stride 1. Only the device code and the length are checked here.
pub(crate) fn index_raw(
    data: *const i32,
    len: usize,
    device: Device,
    name: &str,
) -> Result<sys::flashattn_tensor, Error> {
    let n = i64::try_from(len)
        .map_err(|_| Error::invalid(format!("{name} has {len} entries, more than fit in int64")))?;
    Ok(sys::flashattn_tensor {
        data: data as *mut c_void,
        dtype: sys::FLASHATTN_INT32,
        device: device.code()?,
        ndim: 1,
        shape: [n, 0, 0, 0],
        stride: [1, 0, 0, 0],
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bshd_views_the_logical_bhsd_order() {
        let buf = vec![0f32; 2 * 5 * 3 * 4];
        let t = Tensor::bshd(&buf, [2, 5, 3, 4]).unwrap();
        assert_eq!(t.shape(), &[2, 3, 5, 4]);
        assert_eq!(t.strides(), &[60, 4, 12, 1]);
        let t = Tensor::bhsd(&buf, [2, 3, 5, 4]).unwrap();
        assert_eq!(t.shape(), &[2, 3, 5, 4]);
        assert_eq!(t.strides(), &[60, 20, 4, 1]);
        let t = Tensor::contiguous(&buf[..30], &[2, 3, 5]).unwrap();
        assert_eq!(t.strides(), &[15, 5, 1]);
    }

    #[test]
    fn slice_must_cover_the_strided_extent() {
        let buf = vec![0f64; 100];
        // Largest offset 1*50 + 2*10 + 3*1 = 73, so 74 elements are needed.
        assert!(Tensor::new(&buf[..74], &[2, 3, 4], &[50, 10, 1]).is_ok());
        let e = Tensor::new(&buf[..73], &[2, 3, 4], &[50, 10, 1]).unwrap_err();
        assert_eq!(e.kind(), crate::ErrorKind::InvalidArgument);
        assert!(e.message().contains("too short") && e.message().contains("needs 74"), "{e}");
        assert!(Tensor::bhsd(&buf, [1, 2, 5, 10]).is_ok());
        assert!(Tensor::bhsd(&buf, [1, 2, 5, 11]).is_err());
        let mut m = vec![0f64; 10];
        assert!(TensorMut::bshd(&mut m, [1, 2, 1, 6]).is_err());
        // Overflowing extents are errors, not wrap-arounds.
        assert!(Tensor::new(&buf, &[3, 2], &[usize::MAX / 2, 1]).is_err());
        // Empty views read nothing: the slice check passes and the library judges the shape.
        assert!(Tensor::new(&buf[..0], &[0, 3], &[3, 1]).is_ok());
    }

    #[test]
    fn shape_and_strides_lengths() {
        let buf = vec![0f32; 64];
        assert!(Tensor::new(&buf, &[2, 2], &[2]).is_err());
        assert!(Tensor::contiguous(&buf, &[1, 2, 2, 2, 2]).is_err());
    }
}
