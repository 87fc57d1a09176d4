//! KV-cache attention (`forward_kvcache`) against a float64 reference written here from the
//! header's definition: append (rotating new keys), then naive attention of each sequence's
//! (rotated) queries over its valid cache rows `leftpad..cache_seqlens + S_new`.
//!
//! Outputs are NaN-poisoned before each call and compared element by element afterwards. Cache
//! rows that no sequence may read (past `cache_seqlens`, before `cache_leftpad`, batch rows no
//! sequence uses, pages no table names, gaps of strided caches) hold NaN, so reading them shows
//! in out, and the caches are compared after the call in full: appended rows against the
//! reference's, every other element bit for bit against what it held before.
mod common;

use common::reference::{self, visible_in, Mods, Rng, Shape};
use common::{max_error, Tol};
use flashattn::{
    forward_kvcache, Bf16, DType, Element, Error, ErrorKind, KvCache, Mask, Options, Tensor,
    TensorMut, Window, F16,
};

// As in attention.rs / varlen.rs (per sequence the sizes here are no larger).
const TOL_F32: Tol = Tol { out: 2e-5, lse: 1e-5, grad: 0.0 };
const TOL_F64: Tol = Tol { out: 1e-12, lse: 2.4e-7, grad: 0.0 };
const TOL_F16: Tol = Tol { out: 5e-3, lse: 1e-5, grad: 0.0 };
const TOL_BF16: Tol = Tol { out: 2e-2, lse: 1e-5, grad: 0.0 };

const MASKS: [Mask; 3] = [Mask::None, Mask::CausalTopLeft, Mask::CausalBottomRight];

#[derive(Clone, Debug)]
struct Kc {
    batch: usize,
    /// Batch rows of a contiguous cache (>= batch).
    batch_cache: usize,
    heads_q: usize,
    heads_kv: usize,
    head_dim: usize,
    seq_q: usize,
    /// Rows appended per sequence (0: a read-only cache).
    seq_new: usize,
    /// Rows per sequence's cache (a multiple of the block size when paged).
    capacity: usize,
    /// None: the whole cache is valid (no append then).
    seqlens: Option<Vec<usize>>,
    batch_idx: Option<Vec<usize>>,
    leftpad: Option<Vec<usize>>,
    /// (rotary_dim, interleaved).
    rotary: Option<(usize, bool)>,
    /// Paged with this block size (block_table); pages are handed out in a shuffled order.
    paged: Option<usize>,
    mask: Mask,
    window: Option<Window>,
    softcap: Option<f32>,
    /// ALiBi slopes per (batch, query head).
    alibi: bool,
    /// Caches with NaN gaps between rows, heads and batch rows instead of contiguous.
    padded: bool,
}

impl Kc {
    fn new(batch: usize, hq: usize, hkv: usize, d: usize, sq: usize, s_new: usize) -> Self {
        Kc {
            batch,
            batch_cache: batch,
            heads_q: hq,
            heads_kv: hkv,
            head_dim: d,
            seq_q: sq,
            seq_new: s_new,
            capacity: 32,
            seqlens: None,
            batch_idx: None,
            leftpad: None,
            rotary: None,
            paged: None,
            mask: Mask::None,
            window: None,
            softcap: None,
            alibi: false,
            padded: false,
        }
    }
    fn seqlens(mut self, s: &[usize]) -> Self {
        self.seqlens = Some(s.to_vec());
        self
    }
    fn mask(mut self, m: Mask) -> Self {
        self.mask = m;
        self
    }
    fn seqlen(&self, b: usize) -> usize {
        self.seqlens.as_ref().map_or(self.capacity, |s| s[b])
    }
    fn leftpad(&self, b: usize) -> usize {
        self.leftpad.as_ref().map_or(0, |s| s[b])
    }
    fn cache_row(&self, b: usize) -> usize {
        self.batch_idx.as_ref().map_or(b, |s| s[b])
    }
    fn cache_dims(&self) -> [usize; 4] {
        [self.batch_cache, self.capacity, self.heads_kv, self.head_dim]
    }
    fn cache_len(&self) -> usize {
        self.cache_dims().iter().product()
    }
    fn rotary_rows(&self) -> usize {
        self.capacity + self.seq_q
    }
    fn scale(&self) -> f64 {
        (1.0 / (self.head_dim as f64).sqrt()) as f32 as f64
    }
    /// Query row i's rotary position offset rule (FlashAttention's).
    fn q_advances(&self) -> bool {
        self.mask != Mask::None || self.window.is_some()
    }
}

/// Logical float64 data, already rounded to T: q [B, Sq, Hq, D], caches [B_cache, cap, Hkv, D]
/// (NaN in every row no sequence may read), new rows [B, S_new, Hkv, D], rotary tables
/// [S_ro, rotary_dim / 2], slopes [B, Hq].
struct Data {
    q: Vec<f64>,
    k_cache: Vec<f64>,
    v_cache: Vec<f64>,
    k_new: Vec<f64>,
    v_new: Vec<f64>,
    cos: Vec<f64>,
    sin: Vec<f64>,
    slopes: Vec<f32>,
}

fn rounded<T: Element>(x: f64) -> f64 {
    T::from_f64(x).to_f64()
}

impl Data {
    fn random<T: Element>(c: &Kc, seed: u64) -> Self {
        let mut rng = Rng::new(seed);
        let mut gen = |n| -> Vec<f64> { rng.normals(n).into_iter().map(rounded::<T>).collect() };
        let q = gen(c.batch * c.seq_q * c.heads_q * c.head_dim);
        let mut k_cache = gen(c.cache_len());
        let mut v_cache = gen(c.cache_len());
        let k_new = gen(c.batch * c.seq_new * c.heads_kv * c.head_dim);
        let v_new = gen(c.batch * c.seq_new * c.heads_kv * c.head_dim);
        // Poison every row that no sequence attends before the append.
        let row_len = c.heads_kv * c.head_dim;
        for bc in 0..c.batch_cache {
            let seq = (0..c.batch).find(|&b| c.cache_row(b) == bc);
            for r in 0..c.capacity {
                let valid = seq.is_some_and(|b| r >= c.leftpad(b) && r < c.seqlen(b));
                if !valid {
                    let o = (bc * c.capacity + r) * row_len;
                    k_cache[o..o + row_len].fill(f64::NAN);
                    v_cache[o..o + row_len].fill(f64::NAN);
                }
            }
        }
        let (mut cos, mut sin) = (vec![], vec![]);
        if let Some((rd, _)) = c.rotary {
            for p in 0..c.rotary_rows() {
                for i in 0..rd / 2 {
                    let theta = p as f64 * 10000f64.powf(-2.0 * i as f64 / rd as f64);
                    cos.push(rounded::<T>(theta.cos()));
                    sin.push(rounded::<T>(theta.sin()));
                }
            }
        }
        let slopes = if c.alibi {
            (0..c.batch * c.heads_q).map(|_| (0.1 + rng.uniform()) as f32).collect()
        } else {
            vec![]
        };
        Data { q, k_cache, v_cache, k_new, v_new, cos, sin, slopes }
    }
}

/// Rotates `x` (one head's D values) at position `pos` in place, rounding to T.
fn rotate<T: Element>(c: &Kc, x: &mut [f64], pos: usize, cos: &[f64], sin: &[f64]) {
    let Some((rd, interleaved)) = c.rotary else { return };
    let half = rd / 2;
    for i in 0..half {
        let (ia, ib) = if interleaved { (2 * i, 2 * i + 1) } else { (i, i + half) };
        let (cs, sn) = (cos[pos * half + i], sin[pos * half + i]);
        let (a, b) = (x[ia], x[ib]);
        x[ia] = rounded::<T>(a * cs - b * sn);
        x[ib] = rounded::<T>(a * sn + b * cs);
    }
}

/// What the reference or the library produced, logical and in float64: out [B, Sq, Hq, D],
/// lse [B, Hq, Sq], caches [B_cache, cap, Hkv, D].
#[derive(Debug)]
struct Res {
    out: Vec<f64>,
    lse: Vec<f64>,
    k_cache: Vec<f64>,
    v_cache: Vec<f64>,
}

/// The float64 reference, straight from flashattn.h's description of the call.
fn reference<T: Element>(c: &Kc, x: &Data) -> Res {
    let (hq, hkv, d, sq, sn) = (c.heads_q, c.heads_kv, c.head_dim, c.seq_q, c.seq_new);
    let (mut k_cache, mut v_cache) = (x.k_cache.clone(), x.v_cache.clone());
    let mut out = vec![0.0; c.batch * sq * hq * d];
    let mut lse = vec![0.0; c.batch * hq * sq];
    let kv_at = |bc: usize, r: usize, h: usize| ((bc * c.capacity + r) * hkv + h) * d;
    for b in 0..c.batch {
        let (bc, pos0, lp) = (c.cache_row(b), c.seqlen(b), c.leftpad(b));
        // 1. The append.
        for j in 0..sn {
            for h in 0..hkv {
                let src = ((b * sn + j) * hkv + h) * d;
                let dst = kv_at(bc, pos0 + j, h);
                let mut kr = x.k_new[src..src + d].to_vec();
                rotate::<T>(c, &mut kr, pos0 + j, &x.cos, &x.sin);
                k_cache[dst..dst + d].copy_from_slice(&kr);
                v_cache[dst..dst + d].copy_from_slice(&x.v_new[src..src + d]);
            }
        }
        // 2. Attention over rows lp..pos0 + sn.
        let sk = pos0 + sn - lp;
        for h in 0..hq {
            let hk = h / (hq / hkv);
            for i in 0..sq {
                let qo = ((b * sq + i) * hq + h) * d;
                let mut qr = x.q[qo..qo + d].to_vec();
                if sn > 0 {
                    let pos = pos0 + if c.q_advances() { i } else { 0 };
                    rotate::<T>(c, &mut qr, pos, &x.cos, &x.sin);
                }
                let mut scores = Vec::new();
                for j in 0..sk {
                    if !visible_in(c.mask, c.window, i, j, sq, sk) {
                        continue;
                    }
                    let ko = kv_at(bc, lp + j, hk);
                    let dot: f64 = (0..d).map(|e| qr[e] * k_cache[ko + e]).sum();
                    let mut s = c.scale() * dot;
                    if let Some(cap) = c.softcap.filter(|&x| x > 0.0) {
                        s = cap as f64 * (s / cap as f64).tanh();
                    }
                    if c.alibi {
                        let dist = (i as f64 + sk as f64 - sq as f64 - j as f64).abs();
                        s -= x.slopes[b * hq + h] as f64 * dist;
                    }
                    scores.push((j, s));
                }
                let li = (b * hq + h) * sq + i;
                if scores.is_empty() {
                    lse[li] = f64::NEG_INFINITY;
                    continue; // out stays 0
                }
                let m = scores.iter().map(|s| s.1).fold(f64::NEG_INFINITY, f64::max);
                let sum: f64 = scores.iter().map(|s| (s.1 - m).exp()).sum();
                let l = m + sum.ln();
                lse[li] = l;
                for &(j, s) in &scores {
                    let p = (s - l).exp();
                    let vo = kv_at(bc, lp + j, hk);
                    for e in 0..d {
                        out[qo + e] += p * v_cache[vo + e];
                    }
                }
            }
        }
    }
    Res { out, lse, k_cache, v_cache }
}

/// Strides and buffer length of the caches: contiguous [B_cache, cap, Hkv, D], or with gaps.
fn cache_strides(c: &Kc) -> ([usize; 4], usize) {
    let [bc, cap, h, d] = c.cache_dims();
    if c.padded {
        let (row, seq) = (h * (d + 1) + 2, cap * (h * (d + 1) + 2) + 3);
        ([seq, row, d + 1, 1], bc * seq)
    } else {
        ([cap * h * d, h * d, d, 1], bc * cap * h * d)
    }
}

/// Where each logical cache element lives in the buffer: (buffer offset per logical index).
/// Paged: page `table[b][r / bs]`, row `r % bs`; contiguous: the strides.
struct CacheMap {
    offsets: Vec<usize>,
    buf_len: usize,
    /// The paged call's view: (shape, strides) of the pool, and the block table and max_blocks.
    pool_dims: [usize; 4],
    pool_strides: [usize; 4],
    table: Option<(Vec<i32>, usize)>,
}

fn cache_map(c: &Kc) -> CacheMap {
    let [bc, cap, h, d] = c.cache_dims();
    let mut offsets = Vec::with_capacity(c.cache_len());
    match c.paged {
        None => {
            let (st, len) = cache_strides(c);
            for b in 0..bc {
                for r in 0..cap {
                    for hh in 0..h {
                        for e in 0..d {
                            offsets.push(b * st[0] + r * st[1] + hh * st[2] + e);
                        }
                    }
                }
            }
            CacheMap {
                offsets,
                buf_len: len,
                pool_dims: c.cache_dims(),
                pool_strides: st,
                table: None,
            }
        }
        Some(bs) => {
            assert!(c.batch_idx.is_none() && c.leftpad.is_none() && !c.padded && bc == c.batch);
            assert_eq!(cap % bs, 0);
            let max_blocks = cap / bs;
            // Two spare pages nobody names; the rest shuffled.
            let num_blocks = bc * max_blocks + 2;
            let mut perm: Vec<usize> = (0..num_blocks).collect();
            let mut rng = Rng::new(99);
            for i in (1..num_blocks).rev() {
                perm.swap(i, (rng.next_u64() % (i as u64 + 1)) as usize);
            }
            let table: Vec<i32> = perm[..bc * max_blocks].iter().map(|&p| p as i32).collect();
            let page = bs * h * d;
            for b in 0..bc {
                for r in 0..cap {
                    let p = table[b * max_blocks + r / bs] as usize;
                    for hh in 0..h {
                        for e in 0..d {
                            offsets.push(p * page + ((r % bs) * h + hh) * d + e);
                        }
                    }
                }
            }
            CacheMap {
                offsets,
                buf_len: num_blocks * page,
                pool_dims: [num_blocks, bs, h, d],
                pool_strides: [page, h * d, d, 1],
                table: Some((table, max_blocks)),
            }
        }
    }
}

fn scatter_cache<T: Element>(logical: &[f64], map: &CacheMap) -> Vec<T> {
    let mut buf = vec![T::from_f64(f64::NAN); map.buf_len];
    for (&o, &x) in map.offsets.iter().zip(logical) {
        buf[o] = T::from_f64(x);
    }
    buf
}

fn gather_cache<T: Element>(buf: &[T], map: &CacheMap) -> Vec<f64> {
    map.offsets.iter().map(|&o| buf[o].to_f64()).collect()
}

/// Buffer elements outside every logical cache element (gaps, spare pages) still NaN.
fn outside_untouched<T: Element>(buf: &[T], map: &CacheMap) -> bool {
    let mut inside = vec![false; buf.len()];
    for &o in &map.offsets {
        inside[o] = true;
    }
    buf.iter().zip(&inside).all(|(x, &i)| i || x.to_f64().is_nan())
}

fn i32s(v: &[usize]) -> Vec<i32> {
    v.iter().map(|&x| x as i32).collect()
}

/// Runs the library through the safe API, outputs NaN-poisoned. The caches come back logical
/// whether or not the call succeeded (to check that a failed call wrote nothing).
fn run_library<T: Element>(c: &Kc, x: &Data) -> (Result<(), Error>, Res) {
    let (hq, hkv, d, sq, sn) = (c.heads_q, c.heads_kv, c.head_dim, c.seq_q, c.seq_new);
    let map = cache_map(c);
    let mut kbuf = scatter_cache::<T>(&x.k_cache, &map);
    let mut vbuf = scatter_cache::<T>(&x.v_cache, &map);
    let to_t = |v: &[f64]| -> Vec<T> { v.iter().map(|&x| T::from_f64(x)).collect() };
    let (q, k_new, v_new, cos, sin) =
        (to_t(&x.q), to_t(&x.k_new), to_t(&x.v_new), to_t(&x.cos), to_t(&x.sin));
    let mut out = vec![T::from_f64(f64::NAN); q.len()];
    let mut lse = vec![f32::NAN; c.batch * hq * sq];
    let seqlens = c.seqlens.as_deref().map(i32s);
    let batch_idx = c.batch_idx.as_deref().map(i32s);
    let leftpad = c.leftpad.as_deref().map(i32s);
    let slopes_t =
        (!x.slopes.is_empty()).then(|| Tensor::contiguous(&x.slopes, &[c.batch, hq]).unwrap());
    let opts = Options {
        mask: c.mask,
        window: c.window,
        softcap: c.softcap,
        alibi_slopes: slopes_t,
        ..Options::default()
    };

    let qt = Tensor::contiguous(&q, &[c.batch, sq, hq, d]).unwrap();
    let knt = Tensor::contiguous(&k_new, &[c.batch, sn, hkv, d]).unwrap();
    let vnt = Tensor::contiguous(&v_new, &[c.batch, sn, hkv, d]).unwrap();
    let rd2 = c.rotary.map_or(0, |r| r.0 / 2);
    let cost = Tensor::contiguous(&cos, &[c.rotary_rows(), rd2]).unwrap();
    let sint = Tensor::contiguous(&sin, &[c.rotary_rows(), rd2]).unwrap();
    let result = {
        let mut kc = TensorMut::new(&mut kbuf, &map.pool_dims, &map.pool_strides).unwrap();
        let mut vc = TensorMut::new(&mut vbuf, &map.pool_dims, &map.pool_strides).unwrap();
        let mut cache = if sn > 0 {
            KvCache::append(&mut kc, &mut vc, &knt, &vnt)
        } else {
            KvCache::new(&kc.as_tensor(), &vc.as_tensor())
        };
        if let Some(s) = &seqlens {
            cache = cache.with_cache_seqlens(s);
        }
        if let Some(s) = &batch_idx {
            cache = cache.with_cache_batch_idx(s);
        }
        if let Some(s) = &leftpad {
            cache = cache.with_cache_leftpad(s);
        }
        if let Some((t, mb)) = &map.table {
            cache = cache.with_block_table(t, *mb);
        }
        if let Some((_, interleaved)) = c.rotary {
            cache = cache.with_rotary(&cost, &sint, interleaved);
        }
        forward_kvcache(
            &qt,
            &mut cache,
            &mut TensorMut::contiguous(&mut out, &[c.batch, sq, hq, d]).unwrap(),
            &mut TensorMut::contiguous(&mut lse, &[c.batch, hq, sq]).unwrap(),
            &opts,
        )
    };
    assert!(outside_untouched(&kbuf, &map), "{c:?}: k_cache written outside its rows");
    assert!(outside_untouched(&vbuf, &map), "{c:?}: v_cache written outside its rows");
    let res = Res {
        out: out.iter().map(|x| x.to_f64()).collect(),
        lse: lse.iter().map(|&x| x as f64).collect(),
        k_cache: gather_cache(&kbuf, &map),
        v_cache: gather_cache(&vbuf, &map),
    };
    (result, res)
}

/// Bitwise equality of two logical arrays, NaN equal to NaN.
fn same(a: &[f64], b: &[f64]) -> bool {
    a.len() == b.len()
        && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits() || (x.is_nan() && y.is_nan()))
}

/// Runs a case through the library and the reference and compares everything; returns the
/// library's results.
fn check<T: Element>(c: &Kc, seed: u64, tol: Tol) -> Res {
    let x = Data::random::<T>(c, seed);
    let want = reference::<T>(c, &x);
    let (r, got) = run_library::<T>(c, &x);
    r.unwrap_or_else(|e| panic!("{c:?}: {e}"));
    for (name, g, w, t) in
        [("out", &got.out, &want.out, tol.out), ("lse", &got.lse, &want.lse, tol.lse)]
    {
        let (e, i) = max_error(g, w);
        assert!(
            e <= t,
            "{c:?} ({:?}): {name} error {e:.3e} > {t:.1e} at {i}: got {}, want {}",
            T::DTYPE,
            g[i],
            w[i]
        );
    }
    // The caches: appended rows as the reference stores them (rotated keys: the library rotates
    // in float32, the reference in float64, both rounded to T: one rounding apart at most);
    // every other element exactly as before.
    let (rows, hd) = (c.capacity, c.heads_kv * c.head_dim);
    let rot_tol = match T::DTYPE {
        DType::Float64 => 1e-14,
        DType::Float32 => 1e-6,
        DType::Float16 => 2e-3,
        DType::Bfloat16 => 1e-2,
    };
    for (name, g, w) in
        [("k_cache", &got.k_cache, &want.k_cache), ("v_cache", &got.v_cache, &want.v_cache)]
    {
        for bc in 0..c.batch_cache {
            let appended = (0..c.batch)
                .find(|&b| c.cache_row(b) == bc)
                .map_or(0..0, |b| c.seqlen(b)..c.seqlen(b) + c.seq_new);
            for r in 0..rows {
                let o = (bc * rows + r) * hd;
                let (gs, ws) = (&g[o..o + hd], &w[o..o + hd]);
                if appended.contains(&r) && name == "k_cache" && c.rotary.is_some() {
                    let (e, i) = max_error(gs, ws);
                    assert!(e <= rot_tol, "{c:?}: {name}[{bc}, {r}] error {e:.2e} at {i}");
                } else {
                    assert!(same(gs, ws), "{c:?}: {name}[{bc}, {r}]: got {gs:?}, want {ws:?}");
                }
            }
        }
    }
    got
}

#[test]
fn reference_attention_matches_the_dense_reference() {
    // Without append, leftpad or rotary, sequence b is a dense batch-1 call over its valid rows:
    // the naive reference here against the C++ suite's (which the reference tests check).
    let mut c = Kc::new(2, 4, 2, 8, 3, 0).seqlens(&[5, 11]);
    for mask in MASKS {
        c.mask = mask;
        c.window = Some(Window::new(3, 1));
        c.softcap = Some(2.0);
        c.alibi = true;
        let x = Data::random::<f64>(&c, 5);
        let mine = reference::<f64>(&c, &x);
        for b in 0..c.batch {
            let sk = c.seqlen(b);
            let s = Shape {
                batch: 1,
                heads_q: c.heads_q,
                heads_kv: c.heads_kv,
                seq_q: c.seq_q,
                seq_kv: sk,
                head_dim: c.head_dim,
            };
            // [S, H, D] -> [H, S, D]
            let bhsd = |v: &[f64], s_len: usize, h_len: usize| -> Vec<f64> {
                let mut o = vec![0.0; s_len * h_len * c.head_dim];
                for si in 0..s_len {
                    for h in 0..h_len {
                        for e in 0..c.head_dim {
                            o[(h * s_len + si) * c.head_dim + e] =
                                v[(si * h_len + h) * c.head_dim + e];
                        }
                    }
                }
                o
            };
            let qn = c.seq_q * c.heads_q * c.head_dim;
            let kn = c.capacity * c.heads_kv * c.head_dim;
            let q = bhsd(&x.q[b * qn..(b + 1) * qn], c.seq_q, c.heads_q);
            let k = bhsd(&x.k_cache[b * kn..b * kn + sk * c.heads_kv * c.head_dim], sk, c.heads_kv);
            let v = bhsd(&x.v_cache[b * kn..b * kn + sk * c.heads_kv * c.head_dim], sk, c.heads_kv);
            let mods = Mods {
                window: c.window,
                softcap: 2.0,
                alibi: x.slopes[b * c.heads_q..(b + 1) * c.heads_q]
                    .iter()
                    .map(|&s| s as f64)
                    .collect(),
            };
            let (out, lse) = reference::forward_ex(&s, &q, &k, &v, c.scale(), mask, &mods);
            let my_out = bhsd(&mine.out[b * qn..(b + 1) * qn], c.seq_q, c.heads_q);
            let my_lse = &mine.lse[b * c.heads_q * c.seq_q..(b + 1) * c.heads_q * c.seq_q];
            assert!(max_error(&my_out, &out).0 < 1e-12, "{mask:?} b={b}: out");
            assert!(max_error(my_lse, &lse).0 < 1e-12, "{mask:?} b={b}: lse");
        }
    }
}

#[test]
fn decode_appends_one_token_and_attends_the_prefix() {
    // Sq = S_new = 1, GQA, sequences of different lengths (one empty before the append).
    for mask in MASKS {
        let c = Kc::new(3, 4, 2, 16, 1, 1).seqlens(&[0, 7, 31]).mask(mask);
        check::<f32>(&c, 1, TOL_F32);
        check::<f64>(&c, 2, TOL_F64);
    }
    let c = Kc::new(2, 2, 1, 32, 1, 1).seqlens(&[4, 20]).mask(Mask::CausalBottomRight);
    check::<F16>(&c, 3, TOL_F16);
    check::<Bf16>(&c, 4, TOL_BF16);
}

#[test]
fn decode_without_append_reads_the_valid_prefix() {
    for mask in MASKS {
        // Read-only cache, with and without cache_seqlens (the whole cache).
        let c = Kc::new(2, 2, 2, 8, 1, 0).seqlens(&[3, 32]).mask(mask);
        check::<f32>(&c, 5, TOL_F32);
        let c = Kc::new(2, 2, 2, 8, 1, 0).mask(mask);
        check::<f32>(&c, 6, TOL_F32);
    }
}

#[test]
fn prefill_appends_a_chunk() {
    // Chunked prefill: Sq = S_new = 6 after cached prefixes; Sq > Sk rows under top-left causal;
    // a first chunk into an empty cache.
    for mask in MASKS {
        let c = Kc::new(2, 6, 3, 8, 6, 6).seqlens(&[0, 10]).mask(mask);
        check::<f32>(&c, 7, TOL_F32);
        check::<f64>(&c, 8, TOL_F64);
    }
    // Queries fewer than the appended rows, and a read-only prefill over a prefix.
    let c = Kc::new(1, 2, 1, 8, 2, 5).seqlens(&[9]).mask(Mask::CausalBottomRight);
    check::<f32>(&c, 9, TOL_F32);
    let c = Kc::new(2, 2, 1, 8, 4, 0).seqlens(&[2, 17]).mask(Mask::CausalBottomRight);
    check::<f32>(&c, 10, TOL_F32);
}

#[test]
fn append_with_rotary() {
    // GPT-J and GPT-NeoX pairing, full and partial rotary_dim; query positions advance under a
    // causal mask or a window, else all sit at cache_seqlens[b].
    for (rd, interleaved) in [(16, true), (16, false), (8, true), (6, false)] {
        for (mask, window) in [
            (Mask::None, None),
            (Mask::CausalBottomRight, None),
            (Mask::None, Some(Window::left(4))),
        ] {
            for (sq, sn) in [(1, 1), (4, 4), (3, 5)] {
                let mut c = Kc::new(2, 4, 2, 16, sq, sn).seqlens(&[3, 14]).mask(mask);
                c.window = window;
                c.rotary = Some((rd, interleaved));
                check::<f32>(&c, 11, TOL_F32);
                check::<f64>(&c, 12, TOL_F64);
            }
        }
    }
    // Rotation makes a difference: the same case without tables gives other keys.
    let mut c = Kc::new(1, 1, 1, 8, 1, 1).seqlens(&[5]);
    c.rotary = Some((8, true));
    let rotated = check::<f64>(&c, 13, TOL_F64);
    c.rotary = None;
    let plain = check::<f64>(&c, 13, TOL_F64);
    assert!(!same(&rotated.k_cache, &plain.k_cache) && !same(&rotated.out, &plain.out));
}

#[test]
fn paged_cache_equals_contiguous() {
    for mask in MASKS {
        for (sq, sn, rotary) in [(1, 1, None), (5, 5, Some((8, false))), (3, 0, None)] {
            let mut c = Kc::new(3, 4, 2, 16, sq, sn).seqlens(&[0, 17, 40]).mask(mask);
            c.capacity = 48;
            c.rotary = rotary;
            let contiguous = check::<f32>(&c, 14, TOL_F32);
            for bs in [16, 48] {
                c.paged = Some(bs);
                let paged = check::<f32>(&c, 14, TOL_F32);
                let ctx = format!("{c:?}");
                assert!(same(&paged.out, &contiguous.out), "{ctx}: out differs from contiguous");
                assert!(same(&paged.lse, &contiguous.lse), "{ctx}: lse differs from contiguous");
                assert!(same(&paged.k_cache, &contiguous.k_cache), "{ctx}: k_cache differs");
                assert!(same(&paged.v_cache, &contiguous.v_cache), "{ctx}: v_cache differs");
            }
        }
    }
}

#[test]
fn cache_batch_idx_and_leftpad() {
    // Sequences 0 and 1 use cache rows 3 and 0 of four; rows 1 and 2 are nobody's and must stay
    // untouched (NaN) and unread.
    for mask in MASKS {
        for sn in [0, 2] {
            let mut c = Kc::new(2, 2, 1, 8, 2, sn).seqlens(&[6, 13]).mask(mask);
            c.batch_cache = 4;
            c.batch_idx = Some(vec![3, 0]);
            check::<f32>(&c, 15, TOL_F32);
            c.leftpad = Some(vec![2, 13]);
            check::<f32>(&c, 16, TOL_F32);
            c.padded = true;
            check::<f32>(&c, 17, TOL_F32);
        }
    }
}

#[test]
fn options_apply_relative_to_each_sequence() {
    // Window, softcap and ALiBi relative to Sk_b, with leftpad and a strided cache.
    let mut c = Kc::new(2, 4, 2, 8, 3, 2).seqlens(&[5, 20]).mask(Mask::CausalBottomRight);
    c.leftpad = Some(vec![1, 4]);
    c.window = Some(Window::new(6, 0));
    c.softcap = Some(3.0);
    c.alibi = true;
    c.padded = true;
    check::<f32>(&c, 18, TOL_F32);
    check::<f64>(&c, 19, TOL_F64);
    c.rotary = Some((8, true));
    check::<f32>(&c, 20, TOL_F32);
}

/// Runs a case that must fail: InvalidArgument naming `names` (each must appear), with out, lse
/// and the caches as they were.
fn expect_invalid(c: &Kc, names: &[&str]) -> Error {
    let x = Data::random::<f32>(c, 21);
    let (r, got) = run_library::<f32>(c, &x);
    let e = r.expect_err(&format!("{c:?}: expected an error"));
    assert_eq!(e.kind(), ErrorKind::InvalidArgument, "{c:?}: {e}");
    for n in names {
        assert!(e.message().contains(n), "{c:?}: message does not name {n}: {e}");
    }
    assert!(got.out.iter().all(|x| x.is_nan()), "{c:?}: out written by a failed call");
    assert!(got.lse.iter().all(|x| x.is_nan()), "{c:?}: lse written by a failed call");
    assert!(same(&got.k_cache, &x.k_cache), "{c:?}: k_cache written by a failed call");
    assert!(same(&got.v_cache, &x.v_cache), "{c:?}: v_cache written by a failed call");
    e
}

#[test]
fn bad_inputs_are_errors_and_write_nothing() {
    let base = Kc::new(2, 2, 1, 8, 1, 2).seqlens(&[3, 5]);
    // cache_seqlens + S_new beyond the capacity (32), and the first sequence valid so that a
    // partial append would show.
    let e = expect_invalid(&base.clone().seqlens(&[3, 31]), &["cache_seqlens"]);
    assert!(e.message().contains("[1]") || e.message().contains("31"), "{e}");
    expect_invalid(&base.clone().seqlens(&[3, 33]), &["cache_seqlens"]);
    // Read-only: cache_seqlens alone beyond the capacity.
    let mut c = base.clone().seqlens(&[40, 3]);
    c.seq_new = 0;
    expect_invalid(&c, &["cache_seqlens"]);
    // Leftpad beyond cache_seqlens.
    let mut c = base.clone();
    c.leftpad = Some(vec![0, 6]);
    expect_invalid(&c, &["cache_leftpad"]);
    // cache_batch_idx out of range, and repeated while appending.
    let mut c = base.clone();
    c.batch_idx = Some(vec![0, 2]);
    expect_invalid(&c, &["cache_batch_idx"]);
    c.batch_idx = Some(vec![1, 1]);
    expect_invalid(&c, &["cache_batch_idx"]);
    // Appending without cache_seqlens.
    let mut c = base.clone();
    c.seqlens = None;
    expect_invalid(&c, &["cache_seqlens"]);
    // A block size that is not a multiple of 16.
    let mut c = base.clone();
    c.paged = Some(8);
    expect_invalid(&c, &["block"]);
}

#[test]
fn api_misuse_is_refused() {
    let (b, h, d, cap) = (1, 1, 8, 16);
    let mut kc = vec![0f32; b * cap * h * d];
    let mut vc = vec![0f32; b * cap * h * d];
    let q = vec![0f32; b * h * d];
    let new = vec![1f32; b * h * d];
    let (mut out, mut lse) = (vec![f32::NAN; q.len()], vec![f32::NAN; b * h]);
    let tables = vec![1f32; 2 * cap * 4];
    let qt = Tensor::contiguous(&q, &[b, 1, h, d]).unwrap();
    let nt = Tensor::contiguous(&new, &[b, 1, h, d]).unwrap();
    let tt = Tensor::contiguous(&tables, &[2 * cap, 4]).unwrap();
    let seqlens = [2i32];
    let mut call = |cache: &mut KvCache<'_, f32>| {
        forward_kvcache(
            &qt,
            cache,
            &mut TensorMut::contiguous(&mut out, &[b, 1, h, d]).unwrap(),
            &mut TensorMut::contiguous(&mut lse, &[b, h, 1]).unwrap(),
            &Options::default(),
        )
    };
    // Rotary tables without an append.
    let (kt, vt) = (
        Tensor::contiguous(&kc, &[b, cap, h, d]).unwrap(),
        Tensor::contiguous(&vc, &[b, cap, h, d]).unwrap(),
    );
    let e =
        call(&mut KvCache::new(&kt, &vt).with_cache_seqlens(&seqlens).with_rotary(&tt, &tt, true))
            .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidArgument);
    assert!(e.message().contains("rotary"), "{e}");
    // A block table whose length is not whole rows (this crate's check).
    let table = [0i32; 3];
    let e = call(&mut KvCache::new(&kt, &vt).with_block_table(&table, 2)).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidArgument);
    assert!(e.message().contains("block_table"), "{e}");
    // k_new of the wrong head_dim.
    let bad = vec![0f32; b * h * (d + 1)];
    let bt = Tensor::contiguous(&bad, &[b, 1, h, d + 1]).unwrap();
    {
        let mut kt = TensorMut::contiguous(&mut kc, &[b, cap, h, d]).unwrap();
        let mut vt = TensorMut::contiguous(&mut vc, &[b, cap, h, d]).unwrap();
        let e = call(&mut KvCache::append(&mut kt, &mut vt, &bt, &nt).with_cache_seqlens(&seqlens))
            .unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InvalidArgument);
        assert!(e.message().contains("k_new"), "{e}");
    }
    assert!(kc.iter().chain(&vc).all(|&x| x == 0.0), "a failed call wrote the caches");
    assert!(out.iter().chain(&lse).all(|x| x.is_nan()), "a failed call wrote out or lse");
}

#[test]
fn decode_steps_grow_the_cache() {
    // A decode loop: each step appends one token and attends everything so far; the cache the
    // steps built equals one prefill of all tokens, and the last step's output that prefill's
    // last row.
    let (hq, hkv, d, cap, steps) = (2, 1, 8, 16, 6);
    let mut rng = Rng::new(23);
    let q: Vec<f32> = rng.normals(steps * hq * d).iter().map(|&x| x as f32).collect();
    let kn: Vec<f32> = rng.normals(steps * hkv * d).iter().map(|&x| x as f32).collect();
    let vn: Vec<f32> = rng.normals(steps * hkv * d).iter().map(|&x| x as f32).collect();
    let cos: Vec<f32> = (0..cap * d / 2).map(|i| ((i / (d / 2)) as f32 * 0.3).cos()).collect();
    let sin: Vec<f32> = (0..cap * d / 2).map(|i| ((i / (d / 2)) as f32 * 0.3).sin()).collect();
    let cost = Tensor::contiguous(&cos, &[cap, d / 2]).unwrap();
    let sint = Tensor::contiguous(&sin, &[cap, d / 2]).unwrap();
    let opts = Options { mask: Mask::CausalBottomRight, ..Options::default() };
    let run = |from: usize, to: usize, kc: &mut [f32], vc: &mut [f32]| -> Vec<f32> {
        let n = to - from;
        let mut out = vec![f32::NAN; n * hq * d];
        let mut lse = vec![f32::NAN; hq * n];
        let seqlens = [from as i32];
        let mut kt = TensorMut::contiguous(kc, &[1, cap, hkv, d]).unwrap();
        let mut vt = TensorMut::contiguous(vc, &[1, cap, hkv, d]).unwrap();
        let knt = Tensor::contiguous(&kn[from * hkv * d..to * hkv * d], &[1, n, hkv, d]).unwrap();
        let vnt = Tensor::contiguous(&vn[from * hkv * d..to * hkv * d], &[1, n, hkv, d]).unwrap();
        let mut cache = KvCache::append(&mut kt, &mut vt, &knt, &vnt)
            .with_cache_seqlens(&seqlens)
            .with_rotary(&cost, &sint, false);
        assert!(cache.is_append() && !cache.is_paged());
        forward_kvcache(
            &Tensor::contiguous(&q[from * hq * d..to * hq * d], &[1, n, hq, d]).unwrap(),
            &mut cache,
            &mut TensorMut::contiguous(&mut out, &[1, n, hq, d]).unwrap(),
            &mut TensorMut::contiguous(&mut lse, &[1, hq, n]).unwrap(),
            &opts,
        )
        .unwrap();
        out
    };
    let (mut k1, mut v1) = (vec![0f32; cap * hkv * d], vec![0f32; cap * hkv * d]);
    let mut last = vec![];
    for t in 0..steps {
        last = run(t, t + 1, &mut k1, &mut v1);
    }
    let (mut k2, mut v2) = (vec![0f32; cap * hkv * d], vec![0f32; cap * hkv * d]);
    let all = run(0, steps, &mut k2, &mut v2);
    assert_eq!(k1, k2);
    assert_eq!(v1, v2);
    let tail = &all[(steps - 1) * hq * d..];
    let err = last.iter().zip(tail).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
    assert!(err < 1e-5, "last decode step vs prefill: {err}");
    assert!(k1[steps * hkv * d..].iter().all(|&x| x == 0.0));
}
