//! The float64 reference for the tests: the C++ suite's own (src/testing/reference.cpp), called
//! through its C ABI (src/testing/reference_c.h) in libflashattn_reference, a shared library
//! built with the C++ tests (`FLASHATTN_BUILD_TESTS=ON`, the default) and never installed.
//! `build.rs` links it into the tests when it finds it (`FLASHATTN_REFERENCE_LIB`, or
//! `$FLASHATTN_DIR/src/testing/` of a CMake build directory); otherwise every test that needs it
//! fails, saying what to build.
//!
//! Arrays here are logical and contiguous: q, out, dout, dq [B, Hq, Sq, D]; k, v, dk, dv
//! [B, Hkv, Skv, D]; lse [B, Hq, Sq]. Also the tests' shape, mask predicate and random numbers.
//!
//! The sliding window, softcap and ALiBi slopes go through the `_ex` functions as [`Mods`].
use std::ffi::{c_char, c_int, CStr};

use flashattn::{Mask, Window};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Shape {
    pub batch: usize,
    pub heads_q: usize,
    pub heads_kv: usize,
    pub seq_q: usize,
    pub seq_kv: usize,
    pub head_dim: usize,
}

impl Shape {
    pub fn q_len(&self) -> usize {
        self.batch * self.heads_q * self.seq_q * self.head_dim
    }
    pub fn kv_len(&self) -> usize {
        self.batch * self.heads_kv * self.seq_kv * self.head_dim
    }
    pub fn lse_len(&self) -> usize {
        self.batch * self.heads_q * self.seq_q
    }
    /// The library's default softmax scale, 1/sqrt(D), as the float32 it uses.
    pub fn default_scale(&self) -> f64 {
        (1.0 / (self.head_dim as f64).sqrt()) as f32 as f64
    }
}

/// Whether query i sees key j, written out from the mask definitions.
pub fn visible(mask: Mask, i: usize, j: usize, seq_q: usize, seq_kv: usize) -> bool {
    match mask {
        Mask::None => true,
        Mask::CausalTopLeft => j <= i,
        // j <= i + Skv - Sq, kept in unsigned arithmetic.
        Mask::CausalBottomRight => j + seq_q <= i + seq_kv,
    }
}

/// Whether query i sees key j under the mask and the window band
/// i + Skv - Sq - left <= j <= i + Skv - Sq + right, written out from the definitions.
pub fn visible_in(
    mask: Mask,
    window: Option<Window>,
    i: usize,
    j: usize,
    seq_q: usize,
    seq_kv: usize,
) -> bool {
    let w = window.unwrap_or_default();
    // The diagonal i + Skv - Sq may be negative: signed arithmetic.
    let (diag, j) = (i as i64 + seq_kv as i64 - seq_q as i64, j as i64);
    visible(mask, i, j as usize, seq_q, seq_kv)
        && w.left.map_or(true, |l| j >= diag - l as i64)
        && w.right.map_or(true, |r| j <= diag + r as i64)
}

/// The reference's window, softcap and ALiBi (flashattn_ref_mods): `alibi` holds one slope per
/// (batch, query head), at b * Hq + h, or is empty for none.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Mods {
    pub window: Option<Window>,
    pub softcap: f64,
    pub alibi: Vec<f64>,
}

/// `flashattn_ref_mods` of reference_c.h.
#[repr(C)]
struct RawMods {
    window_left: i64,
    window_right: i64,
    softcap: f64,
    alibi: *const f64,
}

fn raw_mods(m: &Mods, s: &Shape) -> RawMods {
    let side = |w: Option<usize>| w.map_or(-1, |n| n as i64);
    let w = m.window.unwrap_or_default();
    assert!(
        m.alibi.is_empty() || m.alibi.len() == s.batch * s.heads_q,
        "{} slopes for {s:?}: one per (batch, query head) expected",
        m.alibi.len()
    );
    RawMods {
        window_left: side(w.left),
        window_right: side(w.right),
        softcap: m.softcap,
        alibi: if m.alibi.is_empty() { std::ptr::null() } else { m.alibi.as_ptr() },
    }
}

/// SplitMix64: a tiny, fast, well-mixed generator, plenty for test data.
#[derive(Clone, Debug)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng(seed)
    }
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    /// Uniform in [0, 1), 53 random bits.
    pub fn uniform(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }
    /// Standard normal (Box-Muller).
    pub fn normal(&mut self) -> f64 {
        let u1 = 1.0 - self.uniform(); // (0, 1]: ln stays finite
        let u2 = self.uniform();
        (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()
    }
    pub fn normals(&mut self, n: usize) -> Vec<f64> {
        (0..n).map(|_| self.normal()).collect()
    }
}

/// `flashattn_ref_shape` of reference_c.h.
#[repr(C)]
struct RawShape {
    batch: i64,
    heads_q: i64,
    heads_kv: i64,
    seq_q: i64,
    seq_kv: i64,
    head_dim: i64,
}

#[cfg(not(flashattn_reference_missing))]
mod ffi {
    use super::*;
    // Linked by build.rs (tests only), with the library's directory in the rpath. Null strides
    // mean contiguous arrays.
    extern "C" {
        #[allow(clippy::too_many_arguments)]
        pub fn flashattn_ref_forward_ex(
            shape: *const RawShape,
            q: *const f64,
            q_strides: *const i64,
            k: *const f64,
            k_strides: *const i64,
            v: *const f64,
            v_strides: *const i64,
            softmax_scale: f64,
            mask: i32,
            mods: *const RawMods,
            out: *mut f64,
            out_strides: *const i64,
            lse: *mut f64,
            lse_strides: *const i64,
        ) -> c_int;
        #[allow(clippy::too_many_arguments)]
        pub fn flashattn_ref_backward_ex(
            shape: *const RawShape,
            q: *const f64,
            q_strides: *const i64,
            k: *const f64,
            k_strides: *const i64,
            v: *const f64,
            v_strides: *const i64,
            dout: *const f64,
            dout_strides: *const i64,
            softmax_scale: f64,
            mask: i32,
            mods: *const RawMods,
            dq: *mut f64,
            dq_strides: *const i64,
            dk: *mut f64,
            dk_strides: *const i64,
            dv: *mut f64,
            dv_strides: *const i64,
        ) -> c_int;
        pub fn flashattn_ref_last_error() -> *const c_char;
    }
}

/// Stand-ins that fail the test, saying what to build, when build.rs found no library.
#[cfg(flashattn_reference_missing)]
#[allow(clippy::too_many_arguments, clippy::missing_safety_doc)]
mod ffi {
    use super::*;
    fn missing() -> ! {
        panic!(
            "the float64 reference library libflashattn_reference was not found when the tests \
             were built: build it with the C++ tests (cmake -S . -B build \
             -DFLASHATTN_BUILD_TESTS=ON && cmake --build build --target flashattn_reference) and \
             set FLASHATTN_DIR to that build directory, or FLASHATTN_REFERENCE_LIB to the \
             library's path; then run cargo test again"
        )
    }
    pub unsafe fn flashattn_ref_forward_ex(
        _: *const RawShape,
        _: *const f64,
        _: *const i64,
        _: *const f64,
        _: *const i64,
        _: *const f64,
        _: *const i64,
        _: f64,
        _: i32,
        _: *const RawMods,
        _: *mut f64,
        _: *const i64,
        _: *mut f64,
        _: *const i64,
    ) -> c_int {
        missing()
    }
    pub unsafe fn flashattn_ref_backward_ex(
        _: *const RawShape,
        _: *const f64,
        _: *const i64,
        _: *const f64,
        _: *const i64,
        _: *const f64,
        _: *const i64,
        _: *const f64,
        _: *const i64,
        _: f64,
        _: i32,
        _: *const RawMods,
        _: *mut f64,
        _: *const i64,
        _: *mut f64,
        _: *const i64,
        _: *mut f64,
        _: *const i64,
    ) -> c_int {
        missing()
    }
    pub unsafe fn flashattn_ref_last_error() -> *const c_char {
        missing()
    }
}

fn raw(s: &Shape) -> RawShape {
    RawShape {
        batch: s.batch as i64,
        heads_q: s.heads_q as i64,
        heads_kv: s.heads_kv as i64,
        seq_q: s.seq_q as i64,
        seq_kv: s.seq_kv as i64,
        head_dim: s.head_dim as i64,
    }
}

fn mask_code(mask: Mask) -> i32 {
    match mask {
        Mask::None => 0,
        Mask::CausalTopLeft => 1,
        Mask::CausalBottomRight => 2,
    }
}

fn check(rc: c_int, what: &str, s: &Shape) {
    if rc != 0 {
        // SAFETY: a NUL-terminated string owned by the library, valid until its next call here.
        let msg = unsafe { CStr::from_ptr(ffi::flashattn_ref_last_error()) };
        panic!("float64 reference {what} {s:?}: {} (status {rc})", msg.to_string_lossy());
    }
}

/// Returns (out, lse).
pub fn forward(
    s: &Shape,
    q: &[f64],
    k: &[f64],
    v: &[f64],
    scale: f64,
    mask: Mask,
) -> (Vec<f64>, Vec<f64>) {
    forward_ex(s, q, k, v, scale, mask, &Mods::default())
}

/// Gradients of sum(out * dout) with respect to q, k and v: returns (dq, dk, dv). dk and dv sum
/// over the query heads that share a kv head.
pub fn backward(
    s: &Shape,
    q: &[f64],
    k: &[f64],
    v: &[f64],
    dout: &[f64],
    scale: f64,
    mask: Mask,
) -> (Vec<f64>, Vec<f64>, Vec<f64>) {
    backward_ex(s, q, k, v, dout, scale, mask, &Mods::default())
}

/// [`forward`] with a window, softcap and ALiBi slopes.
pub fn forward_ex(
    s: &Shape,
    q: &[f64],
    k: &[f64],
    v: &[f64],
    scale: f64,
    mask: Mask,
    mods: &Mods,
) -> (Vec<f64>, Vec<f64>) {
    assert_eq!(q.len(), s.q_len());
    assert_eq!(k.len(), s.kv_len());
    assert_eq!(v.len(), s.kv_len());
    let mut out = vec![0.0; s.q_len()];
    let mut lse = vec![0.0; s.lse_len()];
    let null = std::ptr::null::<i64>();
    let m = raw_mods(mods, s);
    // SAFETY: every array is contiguous with the length the shape implies (asserted above), and
    // the slopes (if any) hold one value per (batch, query head) (asserted in raw_mods).
    let rc = unsafe {
        ffi::flashattn_ref_forward_ex(
            &raw(s),
            q.as_ptr(),
            null,
            k.as_ptr(),
            null,
            v.as_ptr(),
            null,
            scale,
            mask_code(mask),
            &m,
            out.as_mut_ptr(),
            null,
            lse.as_mut_ptr(),
            null,
        )
    };
    check(rc, "forward", s);
    (out, lse)
}

/// [`backward`] with a window, softcap and ALiBi slopes (which get no gradient).
#[allow(clippy::too_many_arguments)]
pub fn backward_ex(
    s: &Shape,
    q: &[f64],
    k: &[f64],
    v: &[f64],
    dout: &[f64],
    scale: f64,
    mask: Mask,
    mods: &Mods,
) -> (Vec<f64>, Vec<f64>, Vec<f64>) {
    assert_eq!(q.len(), s.q_len());
    assert_eq!(dout.len(), s.q_len());
    assert_eq!(k.len(), s.kv_len());
    assert_eq!(v.len(), s.kv_len());
    let mut dq = vec![0.0; s.q_len()];
    let mut dk = vec![0.0; s.kv_len()];
    let mut dv = vec![0.0; s.kv_len()];
    let null = std::ptr::null::<i64>();
    let m = raw_mods(mods, s);
    // SAFETY: as in forward_ex.
    let rc = unsafe {
        ffi::flashattn_ref_backward_ex(
            &raw(s),
            q.as_ptr(),
            null,
            k.as_ptr(),
            null,
            v.as_ptr(),
            null,
            dout.as_ptr(),
            null,
            scale,
            mask_code(mask),
            &m,
            dq.as_mut_ptr(),
            null,
            dk.as_mut_ptr(),
            null,
            dv.as_mut_ptr(),
            null,
        )
    };
    check(rc, "backward", s);
    (dq, dk, dv)
}
