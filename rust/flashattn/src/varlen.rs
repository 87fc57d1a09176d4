use core::marker::PhantomData;

use flashattn_sys as sys;

use crate::tensor::index_raw;
use crate::{Device, Error};

/// One int32 index vector: pointer, entries, device.
#[derive(Clone, Copy, Debug)]
struct Index {
    data: *const i32,
    len: usize,
    device: Device,
}

impl Index {
    fn of(s: &[i32]) -> Self {
        Index { data: s.as_ptr(), len: s.len(), device: Device::Cpu }
    }
}

/// How a packed variable-length batch splits into sequences (FlashAttention's `cu_seqlens_q`,
/// `cu_seqlens_k`, `seqused_k`, `max_seqlen_q`, `max_seqlen_k`), for [`forward_varlen`] and
/// [`backward_varlen`].
///
/// Sequence b's queries are rows `cu_seqlens_q[b]..cu_seqlens_q[b + 1]` of the packed q (and out,
/// dout, dq), its keys rows `cu_seqlens_k[b]..cu_seqlens_k[b + 1]` of k (and v, dk, dv). Both are
/// `[B + 1]` prefix sums starting at 0, non-decreasing and ending at the packed row counts;
/// zero-length sequences are allowed. `max_seqlen_q` / `max_seqlen_k` (>= 1) bound every
/// sequence's length. With [`Varlen::with_seqused_k`], sequence b attends only its first
/// `seqused_k[b]` keys. The library checks all of this before writing anything (on the host, or
/// for arrays in CUDA memory on the device ahead of the call's kernels) and names the offending
/// vector in its message.
///
///
/// ```
/// use flashattn::{forward_varlen, Mask, Options, Tensor, TensorMut, Varlen};
/// // Three sequences: 3, 0 and 5 queries; 4, 2 and 5 keys; 4 query heads over 2 kv heads.
/// let (hq, hkv, d) = (4, 2, 8);
/// let (cu_q, cu_k) = ([0i32, 3, 3, 8], [0i32, 4, 6, 11]);
/// let (total_q, total_k) = (8, 11);
/// let q = vec![0.1f32; total_q * hq * d];
/// let k = vec![0.2f32; total_k * hkv * d];
/// let v = vec![0.3f32; total_k * hkv * d];
/// let mut out = vec![f32::NAN; q.len()];
/// let mut lse = vec![f32::NAN; hq * total_q];
/// let vl = Varlen::new(&cu_q, &cu_k, 5, 5).with_seqused_k(&[2, 2, 5]);
/// forward_varlen(
///     &Tensor::contiguous(&q, &[total_q, hq, d])?,
///     &Tensor::contiguous(&k, &[total_k, hkv, d])?,
///     &Tensor::contiguous(&v, &[total_k, hkv, d])?,
///     &mut TensorMut::contiguous(&mut out, &[total_q, hq, d])?,
///     &mut TensorMut::contiguous(&mut lse, &[hq, total_q])?,
///     &vl,
///     &Options { mask: Mask::CausalBottomRight, ..Options::default() },
/// )?;
/// // Uniform values: a row that sees a key averages v (0.3). Row 0 (sequence 0's first query)
/// // sees none (bottom-right causal over its 2 used keys): out = 0, lse = -inf.
/// for h in 0..hq {
///     assert_eq!(lse[h * total_q], f32::NEG_INFINITY);
///     assert!(lse[h * total_q + 1..(h + 1) * total_q].iter().all(|x| x.is_finite()));
/// }
/// assert!(out[..hq * d].iter().all(|&x| x == 0.0));
/// assert!(out[hq * d..].iter().all(|&x| (x - 0.3).abs() < 1e-6));
/// # Ok::<(), flashattn::Error>(())
/// ```
///
/// [`forward_varlen`]: crate::forward_varlen
/// [`backward_varlen`]: crate::backward_varlen
#[derive(Clone, Copy, Debug)]
pub struct Varlen<'a> {
    cu_seqlens_q: Index,
    cu_seqlens_k: Index,
    seqused_k: Option<Index>,
    max_seqlen_q: usize,
    max_seqlen_k: usize,
    _borrow: PhantomData<&'a [i32]>,
}

// SAFETY: a Varlen is a shared borrow of i32 data (or of device memory that the creator of an
// unsafe one vouched for), like &[i32].
unsafe impl Send for Varlen<'_> {}
unsafe impl Sync for Varlen<'_> {}

impl<'a> Varlen<'a> {
    /// Host prefix sums: `cu_seqlens_q` and `cu_seqlens_k` of `B + 1` entries each.
    pub fn new(
        cu_seqlens_q: &'a [i32],
        cu_seqlens_k: &'a [i32],
        max_seqlen_q: usize,
        max_seqlen_k: usize,
    ) -> Self {
        Varlen {
            cu_seqlens_q: Index::of(cu_seqlens_q),
            cu_seqlens_k: Index::of(cu_seqlens_k),
            seqused_k: None,
            max_seqlen_q,
            max_seqlen_k,
            _borrow: PhantomData,
        }
    }

    /// Only the first `seqused_k[b]` keys of sequence b are attended (`B` entries, each at most
    /// that sequence's key count); the rest get dk = dv = 0.
    pub fn with_seqused_k(mut self, seqused_k: &'a [i32]) -> Self {
        self.seqused_k = Some(Index::of(seqused_k));
        self
    }

    /// Index vectors this crate cannot check: CUDA device memory (on q's device), or host memory
    /// not held in a slice. `batch` is B: the prefix sums have `B + 1` entries, `seqused_k` (if
    /// not null) `B`.
    ///
    /// # Safety
    /// For the lifetime `'a`, each non-null pointer must point to that many int32 values on
    /// `device`, not written by anyone while a call reads them, and (on CUDA) valid on the
    /// stream the call runs on.
    pub unsafe fn from_raw_parts(
        device: Device,
        batch: usize,
        cu_seqlens_q: *const i32,
        cu_seqlens_k: *const i32,
        seqused_k: Option<*const i32>,
        max_seqlen_q: usize,
        max_seqlen_k: usize,
    ) -> Self {
        let entries = batch.saturating_add(1);
        Varlen {
            cu_seqlens_q: Index { data: cu_seqlens_q, len: entries, device },
            cu_seqlens_k: Index { data: cu_seqlens_k, len: entries, device },
            seqused_k: seqused_k.map(|data| Index { data, len: batch, device }),
            max_seqlen_q,
            max_seqlen_k,
            _borrow: PhantomData,
        }
    }

    /// B, the number of sequences (0 when `cu_seqlens_q` is empty, which the library refuses).
    pub fn batch(&self) -> usize {
        self.cu_seqlens_q.len.saturating_sub(1)
    }
    pub fn max_seqlen_q(&self) -> usize {
        self.max_seqlen_q
    }
    pub fn max_seqlen_k(&self) -> usize {
        self.max_seqlen_k
    }
    pub fn has_seqused_k(&self) -> bool {
        self.seqused_k.is_some()
    }

    /// The C views of the index vectors: (cu_seqlens_q, cu_seqlens_k, seqused_k), which the
    /// caller keeps alive while the struct from [`RawIndices::raw`] points at them.
    pub(crate) fn indices(&self) -> Result<RawIndices, Error> {
        let t = |i: &Index, name: &str| index_raw(i.data, i.len, i.device, name);
        let max = |n: usize, name: &str| {
            i64::try_from(n)
                .map_err(|_| Error::invalid(format!("varlen.{name} = {n} does not fit in int64")))
        };
        Ok(RawIndices {
            cu_seqlens_q: t(&self.cu_seqlens_q, "cu_seqlens_q")?,
            cu_seqlens_k: t(&self.cu_seqlens_k, "cu_seqlens_k")?,
            seqused_k: self.seqused_k.as_ref().map(|i| t(i, "seqused_k")).transpose()?,
            max_seqlen_q: max(self.max_seqlen_q, "max_seqlen_q")?,
            max_seqlen_k: max(self.max_seqlen_k, "max_seqlen_k")?,
        })
    }
}

pub(crate) struct RawIndices {
    cu_seqlens_q: sys::flashattn_tensor,
    cu_seqlens_k: sys::flashattn_tensor,
    seqused_k: Option<sys::flashattn_tensor>,
    max_seqlen_q: i64,
    max_seqlen_k: i64,
}

impl RawIndices {
    /// The C struct, pointing into `self`.
    pub(crate) fn raw(&self) -> sys::flashattn_varlen {
        sys::flashattn_varlen {
            // The size this crate was written against (see Options::raw).
            struct_size: core::mem::size_of::<sys::flashattn_varlen>() as u32,
            cu_seqlens_q: &self.cu_seqlens_q,
            cu_seqlens_k: &self.cu_seqlens_k,
            seqused_k: self.seqused_k.as_ref().map_or(core::ptr::null(), |t| t as *const _),
            max_seqlen_q: self.max_seqlen_q,
            max_seqlen_k: self.max_seqlen_k,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn raw_carries_every_field() {
        let (cq, ck, used) = ([0i32, 3, 3, 8], [0i32, 2, 9, 9], [1i32, 7, 0]);
        let vl = Varlen::new(&cq, &ck, 5, 7);
        assert_eq!((vl.batch(), vl.max_seqlen_q(), vl.max_seqlen_k()), (3, 5, 7));
        assert!(!vl.has_seqused_k());
        let idx = vl.indices().unwrap();
        let r = idx.raw();
        assert_eq!(r.struct_size as usize, core::mem::size_of::<sys::flashattn_varlen>());
        assert!(r.seqused_k.is_null());
        assert_eq!((r.max_seqlen_q, r.max_seqlen_k), (5, 7));
        // SAFETY: r points into idx, alive here.
        let (tq, tk) = unsafe { (&*r.cu_seqlens_q, &*r.cu_seqlens_k) };
        for (t, s) in [(tq, &cq), (tk, &ck)] {
            assert_eq!(t.data as *const i32, s.as_ptr());
            assert_eq!((t.dtype, t.device, t.ndim), (sys::FLASHATTN_INT32, sys::FLASHATTN_CPU, 1));
            assert_eq!((t.shape[0], t.stride[0]), (4, 1));
        }
        let vl = vl.with_seqused_k(&used);
        assert!(vl.has_seqused_k());
        let idx = vl.indices().unwrap();
        let r = idx.raw();
        // SAFETY: as above.
        let tu = unsafe { &*r.seqused_k };
        assert_eq!(tu.data as *const i32, used.as_ptr());
        assert_eq!((tu.dtype, tu.ndim, tu.shape[0]), (sys::FLASHATTN_INT32, 1, 3));
    }

    #[test]
    fn max_seqlen_must_fit_in_int64() {
        let c = [0i32, 1];
        let e = Varlen::new(&c, &c, usize::MAX, 1).indices().err().unwrap();
        assert_eq!(e.kind(), crate::ErrorKind::InvalidArgument);
        assert!(e.message().contains("varlen.max_seqlen_q"), "{e}");
    }
}
