use core::marker::PhantomData;

use flashattn_sys as sys;

use crate::tensor::index_raw;
use crate::{Device, Element, Error, Tensor, TensorMut};

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

/// The rotary tables and the pairing.
#[derive(Clone, Copy, Debug)]
struct Rotary {
    cos: sys::flashattn_tensor,
    sin: sys::flashattn_tensor,
    interleaved: bool,
}

/// The key/value cache of a [`forward_kvcache`] call (FlashAttention 2's
/// `flash_attn_with_kvcache`): the caches, the optional new keys and values to append, and the
/// index vectors and rotary tables that say where each sequence's rows are.
///
/// # Layouts
///
/// Unlike [`forward`](crate::forward), this call uses FlashAttention's `[batch, seq, heads,
/// head_dim]` order as its *logical* shape (any strides, unit head_dim stride), so contiguous
/// `[B, S, H, D]` memory is viewed with [`Tensor::contiguous`] (`&[b, s, h, d]`), not with
/// [`Tensor::bshd`] (which makes the logical `[B, H, S, D]` of `forward`):
///
/// - q, out: `[B, Sq, Hq, D]`; lse: f32 `[B, Hq, Sq]`.
/// - k_cache, v_cache: `[B_cache, S_cache, Hkv, D]` with `B_cache >= B`, or, paged (with
///   [`KvCache::with_block_table`]), `[num_blocks, block_size, Hkv, D]` with `block_size` a
///   multiple of 16.
/// - k_new, v_new: `[B, S_new, Hkv, D]`.
/// - rotary cos / sin: `[S_ro, rotary_dim / 2]` in q's element type (unit last stride),
///   `rotary_dim <= D`.
///
/// # What a call does
///
/// Cache rows are absolute positions `0..capacity` of a sequence's cache (`capacity` = S_cache,
/// or `max_blocks * block_size` when paged: row r lives in page `block_table[b][r / block_size]`
/// at row `r % block_size`). Sequence b uses cache batch row `cache_batch_idx[b]` (default b) and
///
/// 1. when appending ([`KvCache::append`]), **writes k_new and v_new into the caches in place**,
///    at rows `cache_seqlens[b]..cache_seqlens[b] + S_new` (k_new rotated when rotary tables are
///    given); this is why the appending constructor takes the caches as [`TensorMut`];
/// 2. attends, with q (rotated when rotary tables are given), the rows
///    `cache_leftpad[b]..cache_seqlens[b] + S_new`: `Sk_b` keys. Without `cache_seqlens` the whole
///    cache is valid (capacity rows, no append possible); without `cache_leftpad` every sequence
///    starts at row 0. The mask, window, softcap and ALiBi options apply as in `forward` with
///    `Skv = Sk_b` ([`Mask::CausalBottomRight`](crate::Mask::CausalBottomRight) is
///    FlashAttention's `causal=True`).
///
/// Rotary (RoPE): new key j sits at position `cache_seqlens[b] + j`; query row i at
/// `cache_seqlens[b] + i` when the mask is causal or a window is set, else every query row at
/// `cache_seqlens[b]` (FlashAttention's rule). The tables need an append (the cache holds rotated
/// keys, so q alone is never rotated).
///
/// The library checks everything before anything is written (it reads the index vectors on the
/// host): shapes, dtypes, `0 <= cache_leftpad[b] <= cache_seqlens[b]`,
/// `cache_seqlens[b] + S_new <= capacity`, `cache_batch_idx` in range and without repeats when
/// appending, the block table's used entries in `0..num_blocks`; `block_table` does not combine
/// with `cache_batch_idx` or `cache_leftpad`. Its message names the offending argument. Two
/// sequences whose block tables share a page are not detected: appending through both writes
/// that page twice.
///
/// ```
/// use flashattn::{forward_kvcache, KvCache, Mask, Options, Tensor, TensorMut};
/// // Decoding one token for 2 sequences holding 3 and 5 cached tokens; 4 query heads over 2 kv
/// // heads; a cache of 8 rows per sequence.
/// let (b, hq, hkv, d, cap) = (2, 4, 2, 8, 8);
/// let mut k_cache = vec![0.2f32; b * cap * hkv * d];
/// let mut v_cache = vec![0.3f32; b * cap * hkv * d];
/// let (k_new, v_new) = (vec![0.2f32; b * hkv * d], vec![0.3f32; b * hkv * d]);
/// let q = vec![0.1f32; b * hq * d];
/// let (mut out, mut lse) = (vec![f32::NAN; q.len()], vec![f32::NAN; b * hq]);
/// let seqlens = [3i32, 5];
/// let mut kc = TensorMut::contiguous(&mut k_cache, &[b, cap, hkv, d])?;
/// let mut vc = TensorMut::contiguous(&mut v_cache, &[b, cap, hkv, d])?;
/// let kn = Tensor::contiguous(&k_new, &[b, 1, hkv, d])?;
/// let vn = Tensor::contiguous(&v_new, &[b, 1, hkv, d])?;
/// let mut cache = KvCache::append(&mut kc, &mut vc, &kn, &vn).with_cache_seqlens(&seqlens);
/// forward_kvcache(
///     &Tensor::contiguous(&q, &[b, 1, hq, d])?,
///     &mut cache,
///     &mut TensorMut::contiguous(&mut out, &[b, 1, hq, d])?,
///     &mut TensorMut::contiguous(&mut lse, &[b, hq, 1])?,
///     &Options { mask: Mask::CausalBottomRight, ..Options::default() },
/// )?;
/// // Uniform values: out averages v; sequence 1 attends 5 + 1 keys (lse = ln 6 + 0.02 * 8 / √8).
/// assert!(out.iter().all(|&x| (x - 0.3).abs() < 1e-6));
/// let want = 6f32.ln() + 0.02 * 8.0 / 8f32.sqrt();
/// assert!(lse[hq..].iter().all(|&l| (l - want).abs() < 1e-5));
/// # Ok::<(), flashattn::Error>(())
/// ```
///
/// [`forward_kvcache`]: crate::forward_kvcache
#[derive(Debug)]
pub struct KvCache<'a, T: Element> {
    k_cache: sys::flashattn_tensor,
    v_cache: sys::flashattn_tensor,
    /// (k_new, v_new) when appending.
    new: Option<(sys::flashattn_tensor, sys::flashattn_tensor)>,
    cache_seqlens: Option<Index>,
    cache_batch_idx: Option<Index>,
    cache_leftpad: Option<Index>,
    /// (table, max_blocks): the table is `[len / max_blocks, max_blocks]`.
    block_table: Option<(Index, usize)>,
    rotary: Option<Rotary>,
    /// The caches may be exclusive borrows (appending), the rest shared ones.
    _borrow: PhantomData<&'a mut [T]>,
}

// SAFETY: a KvCache holds shared borrows of its inputs and, when appending, exclusive borrows of
// the caches (taken from TensorMut views held mutably for 'a); forward_kvcache writes through it
// only from `&mut KvCache`. It behaves like a struct of &[T] / &mut [T] fields.
unsafe impl<T: Element> Send for KvCache<'_, T> {}
unsafe impl<T: Element> Sync for KvCache<'_, T> {}

impl<'a, T: Element> KvCache<'a, T> {
    fn with_caches(k_cache: sys::flashattn_tensor, v_cache: sys::flashattn_tensor) -> Self {
        KvCache {
            k_cache,
            v_cache,
            new: None,
            cache_seqlens: None,
            cache_batch_idx: None,
            cache_leftpad: None,
            block_table: None,
            rotary: None,
            _borrow: PhantomData,
        }
    }

    /// A read-only cache: the call attends the caches without writing them (no append, so no
    /// rotary tables either).
    pub fn new(k_cache: &Tensor<'a, T>, v_cache: &Tensor<'a, T>) -> Self {
        Self::with_caches(k_cache.raw(), v_cache.raw())
    }

    /// A cache that the call extends in place: `k_new` / `v_new` (`[B, S_new, Hkv, D]`) are
    /// written into rows `cache_seqlens[b]..cache_seqlens[b] + S_new` of sequence b's cache
    /// before it is attended. Needs [`KvCache::with_cache_seqlens`]. The caches must not overlap
    /// each other or any other argument. On an error nothing is written.
    pub fn append(
        k_cache: &'a mut TensorMut<'_, T>,
        v_cache: &'a mut TensorMut<'_, T>,
        k_new: &Tensor<'a, T>,
        v_new: &Tensor<'a, T>,
    ) -> Self {
        let mut c = Self::with_caches(k_cache.raw(), v_cache.raw());
        c.new = Some((k_new.raw(), v_new.raw()));
        c
    }

    /// Valid rows of each sequence's cache before the append (`B` entries). Without it the whole
    /// cache is valid and nothing can be appended.
    pub fn with_cache_seqlens(mut self, cache_seqlens: &'a [i32]) -> Self {
        self.cache_seqlens = Some(Index::of(cache_seqlens));
        self
    }

    /// The cache batch row of each sequence (`B` entries, in `0..B_cache`; without repeats when
    /// appending). Default: sequence b uses row b. Contiguous caches only.
    pub fn with_cache_batch_idx(mut self, cache_batch_idx: &'a [i32]) -> Self {
        self.cache_batch_idx = Some(Index::of(cache_batch_idx));
        self
    }

    /// The first valid row of each sequence's cache (`B` entries): keys before it are not
    /// attended. Default 0. Contiguous caches only.
    pub fn with_cache_leftpad(mut self, cache_leftpad: &'a [i32]) -> Self {
        self.cache_leftpad = Some(Index::of(cache_leftpad));
        self
    }

    /// A paged cache: `block_table` is row-major `[B, max_blocks]` (so its length must be a
    /// multiple of `max_blocks`), and sequence b's cache row r lives in page
    /// `block_table[b * max_blocks + r / block_size]` of the caches, which are then
    /// `[num_blocks, block_size, Hkv, D]`. Entries past the rows a sequence uses are not read.
    pub fn with_block_table(mut self, block_table: &'a [i32], max_blocks: usize) -> Self {
        self.block_table = Some((Index::of(block_table), max_blocks));
        self
    }

    /// Rotary embedding (RoPE) of q and k_new: `cos` and `sin` are `[S_ro, rotary_dim / 2]` in
    /// q's element type, with `S_ro` above every position used. `interleaved`: GPT-J pairs
    /// `(x[2i], x[2i + 1])` (FlashAttention's default); otherwise GPT-NeoX halves
    /// `(x[i], x[i + rotary_dim / 2])`. Only with [`KvCache::append`].
    pub fn with_rotary(
        mut self,
        cos: &Tensor<'a, T>,
        sin: &Tensor<'a, T>,
        interleaved: bool,
    ) -> Self {
        self.rotary = Some(Rotary { cos: cos.raw(), sin: sin.raw(), interleaved });
        self
    }

    /// Whether the call writes k_new / v_new into the caches.
    pub fn is_append(&self) -> bool {
        self.new.is_some()
    }
    pub fn is_paged(&self) -> bool {
        self.block_table.is_some()
    }

    /// The C views, which the caller keeps alive while the struct from [`RawKvCache::raw`]
    /// points at them.
    pub(crate) fn raw_parts(&self) -> Result<RawKvCache, Error> {
        let t = |i: &Index, name: &str| index_raw(i.data, i.len, i.device, name);
        let block_table = match &self.block_table {
            None => None,
            Some((idx, max_blocks)) => {
                if *max_blocks == 0 || idx.len % max_blocks != 0 {
                    return Err(Error::invalid(format!(
                        "block_table: {} entries do not make rows of max_blocks = {max_blocks} \
                         (a row-major [B, max_blocks] table, max_blocks >= 1)",
                        idx.len
                    )));
                }
                let mut r = t(idx, "block_table")?;
                let cols = i64::try_from(*max_blocks).map_err(|_| {
                    Error::invalid(format!(
                        "block_table: max_blocks = {max_blocks} does not fit in int64"
                    ))
                })?;
                r.ndim = 2;
                r.shape = [r.shape[0] / cols, cols, 0, 0];
                r.stride = [cols, 1, 0, 0];
                Some(r)
            }
        };
        Ok(RawKvCache {
            new: self.new,
            cache_seqlens: self
                .cache_seqlens
                .as_ref()
                .map(|i| t(i, "cache_seqlens"))
                .transpose()?,
            cache_batch_idx: self
                .cache_batch_idx
                .as_ref()
                .map(|i| t(i, "cache_batch_idx"))
                .transpose()?,
            cache_leftpad: self
                .cache_leftpad
                .as_ref()
                .map(|i| t(i, "cache_leftpad"))
                .transpose()?,
            block_table,
            rotary: self.rotary,
        })
    }

    pub(crate) fn caches(&self) -> (sys::flashattn_tensor, sys::flashattn_tensor) {
        (self.k_cache, self.v_cache)
    }
}

pub(crate) struct RawKvCache {
    new: Option<(sys::flashattn_tensor, sys::flashattn_tensor)>,
    cache_seqlens: Option<sys::flashattn_tensor>,
    cache_batch_idx: Option<sys::flashattn_tensor>,
    cache_leftpad: Option<sys::flashattn_tensor>,
    block_table: Option<sys::flashattn_tensor>,
    rotary: Option<Rotary>,
}

fn ptr(t: Option<&sys::flashattn_tensor>) -> *const sys::flashattn_tensor {
    t.map_or(core::ptr::null(), |t| t as *const _)
}

impl RawKvCache {
    /// The C struct, pointing into `self`.
    pub(crate) fn raw(&self) -> sys::flashattn_kvcache {
        sys::flashattn_kvcache {
            // The size this crate was written against (see Options::raw).
            struct_size: core::mem::size_of::<sys::flashattn_kvcache>() as u32,
            k_new: ptr(self.new.as_ref().map(|n| &n.0)),
            v_new: ptr(self.new.as_ref().map(|n| &n.1)),
            cache_seqlens: ptr(self.cache_seqlens.as_ref()),
            cache_batch_idx: ptr(self.cache_batch_idx.as_ref()),
            cache_leftpad: ptr(self.cache_leftpad.as_ref()),
            block_table: ptr(self.block_table.as_ref()),
            rotary_cos: ptr(self.rotary.as_ref().map(|r| &r.cos)),
            rotary_sin: ptr(self.rotary.as_ref().map(|r| &r.sin)),
            // flashattn_kvcache_init's default is 1 (interleaved); without tables it is unread.
            rotary_interleaved: i32::from(self.rotary.map_or(true, |r| r.interleaved)),
            // The library's split-KV choice (the CPU backend, this crate's, has none).
            num_splits: 0,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn raw_carries_every_field() {
        let (kc, vc) = (vec![0f32; 2 * 16 * 8], vec![0f32; 2 * 16 * 8]);
        let (kt, vt) = (
            Tensor::contiguous(&kc, &[2, 16, 1, 8]).unwrap(),
            Tensor::contiguous(&vc, &[2, 16, 1, 8]).unwrap(),
        );
        let c = KvCache::new(&kt, &vt);
        assert!(!c.is_append() && !c.is_paged());
        let parts = c.raw_parts().unwrap();
        let r = parts.raw();
        assert_eq!(r.struct_size as usize, core::mem::size_of::<sys::flashattn_kvcache>());
        for p in [
            r.k_new,
            r.v_new,
            r.cache_seqlens,
            r.cache_batch_idx,
            r.cache_leftpad,
            r.block_table,
            r.rotary_cos,
            r.rotary_sin,
        ] {
            assert!(p.is_null());
        }
        assert_eq!((r.rotary_interleaved, r.num_splits), (1, 0));
        let (ck, cv) = c.caches();
        assert_eq!(ck.data as *const f32, kc.as_ptr());
        assert_eq!(cv.data as *const f32, vc.as_ptr());

        let (lens, idx, pad) = ([3i32, 4], [1i32, 0], [0i32, 1]);
        let table = [0i32, 1, 2, 3, 4, 5];
        let cos = [1f32; 4];
        let ct = Tensor::contiguous(&cos, &[2, 2]).unwrap();
        let c = KvCache::new(&kt, &vt)
            .with_cache_seqlens(&lens)
            .with_cache_batch_idx(&idx)
            .with_cache_leftpad(&pad)
            .with_block_table(&table, 3)
            .with_rotary(&ct, &ct, false);
        assert!(c.is_paged());
        let parts = c.raw_parts().unwrap();
        let r = parts.raw();
        assert_eq!(r.rotary_interleaved, 0);
        // SAFETY: r points into parts, alive here.
        let (tl, ti, tp, tb, tc) = unsafe {
            (
                &*r.cache_seqlens,
                &*r.cache_batch_idx,
                &*r.cache_leftpad,
                &*r.block_table,
                &*r.rotary_cos,
            )
        };
        for (t, s) in [(tl, &lens), (ti, &idx), (tp, &pad)] {
            assert_eq!(t.data as *const i32, s.as_ptr());
            assert_eq!((t.dtype, t.device, t.ndim), (sys::FLASHATTN_INT32, sys::FLASHATTN_CPU, 1));
            assert_eq!((t.shape[0], t.stride[0]), (2, 1));
        }
        assert_eq!(tb.data as *const i32, table.as_ptr());
        assert_eq!((tb.dtype, tb.ndim), (sys::FLASHATTN_INT32, 2));
        assert_eq!((tb.shape[0], tb.shape[1], tb.stride[0], tb.stride[1]), (2, 3, 3, 1));
        assert_eq!(
            (tc.data as *const f32, tc.dtype, tc.ndim),
            (cos.as_ptr(), sys::FLASHATTN_FLOAT32, 2)
        );
    }

    #[test]
    fn block_table_rows_must_be_whole() {
        let kc = vec![0f32; 16 * 8];
        let kt = Tensor::contiguous(&kc, &[1, 16, 1, 8]).unwrap();
        let table = [0i32; 5];
        for max_blocks in [0, 2] {
            let e = KvCache::new(&kt, &kt).with_block_table(&table, max_blocks).raw_parts().err();
            let e = e.unwrap();
            assert_eq!(e.kind(), crate::ErrorKind::InvalidArgument);
            assert!(e.message().contains("block_table"), "{e}");
        }
    }
}
