//! 16-bit float storage types. flashattn reads and writes these formats; Rust has no stable
//! primitive for either, so they are plain `u16` bit patterns with exact conversions.
//!
//! Conversions round to nearest, ties to even, directly from f64 (no double rounding through
//! f32), overflow to infinity, keep signed zeros and subnormals, and map NaN to a quiet NaN.

/// IEEE 754 binary16 (`float16`), stored as its bit pattern.
#[repr(transparent)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct F16(pub u16);

/// bfloat16 (the top half of an IEEE binary32), stored as its bit pattern.
#[repr(transparent)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Bf16(pub u16);

/// A binary floating-point format with `E` exponent bits and `M` stored mantissa bits in 16 bits.
struct Format {
    exp_bits: u32,
    man_bits: u32,
    quiet_nan: u16,
}

const F16_FORMAT: Format = Format { exp_bits: 5, man_bits: 10, quiet_nan: 0x7e00 };
const BF16_FORMAT: Format = Format { exp_bits: 8, man_bits: 7, quiet_nan: 0x7fc0 };

fn pow2(e: i32) -> f64 {
    // Exact for the exponents used here (|e| well inside f64's normal range).
    2f64.powi(e)
}

impl Format {
    fn bias(&self) -> i32 {
        (1 << (self.exp_bits - 1)) - 1
    }
    fn emin(&self) -> i32 {
        1 - self.bias()
    }
    fn inf_bits(&self) -> u16 {
        (((1u32 << self.exp_bits) - 1) << self.man_bits) as u16
    }

    fn encode(&self, x: f64) -> u16 {
        let sign: u16 = if x.is_sign_negative() { 0x8000 } else { 0 };
        if x.is_nan() {
            return sign | self.quiet_nan;
        }
        let a = x.abs();
        if a == 0.0 {
            return sign;
        }
        if a.is_infinite() {
            return sign | self.inf_bits();
        }
        // Unbiased exponent of a, clamped at the smallest normal exponent so that subnormals
        // share emin's quantum. f64 subnormals (exponent field 0) are far below any emin here.
        let e = (((a.to_bits() >> 52) & 0x7ff) as i32 - 1023).max(self.emin());
        // a / quantum is exact (power-of-two scaling), so one rounding happens, here.
        let n = (a / pow2(e - self.man_bits as i32)).round_ties_even();
        // For normals n is in [2^M, 2^(M+1)]; the implicit leading bit of n adds one to the
        // exponent field, and n == 2^(M+1) (rounded up a binade) carries into it correctly too.
        // For subnormals (e == emin, n < 2^M) the formula gives exponent field 0.
        let bits = (((e - self.emin()) as u64) << self.man_bits) + n as u64;
        if bits >= self.inf_bits() as u64 {
            return sign | self.inf_bits();
        }
        sign | bits as u16
    }

    fn decode(&self, b: u16) -> f64 {
        let sign = if b & 0x8000 != 0 { -1.0 } else { 1.0 };
        let exp = ((b as u32) >> self.man_bits) & ((1 << self.exp_bits) - 1);
        let man = (b as u32) & ((1 << self.man_bits) - 1);
        let m = self.man_bits as i32;
        if exp == (1 << self.exp_bits) - 1 {
            return if man == 0 { sign * f64::INFINITY } else { f64::NAN };
        }
        if exp == 0 {
            return sign * man as f64 * pow2(self.emin() - m);
        }
        sign * (1.0 + man as f64 * pow2(-m)) * pow2(exp as i32 - self.bias())
    }
}

impl F16 {
    pub fn from_f64(x: f64) -> Self {
        F16(F16_FORMAT.encode(x))
    }
    pub fn from_f32(x: f32) -> Self {
        Self::from_f64(x as f64)
    }
    pub fn to_f64(self) -> f64 {
        F16_FORMAT.decode(self.0)
    }
    pub fn to_f32(self) -> f32 {
        self.to_f64() as f32 // exact: every binary16 value is a binary32 value
    }
}

impl Bf16 {
    pub fn from_f64(x: f64) -> Self {
        Bf16(BF16_FORMAT.encode(x))
    }
    pub fn from_f32(x: f32) -> Self {
        Self::from_f64(x as f64)
    }
    pub fn to_f64(self) -> f64 {
        BF16_FORMAT.decode(self.0)
    }
    pub fn to_f32(self) -> f32 {
        self.to_f64() as f32
    }
}

impl From<F16> for f32 {
    fn from(x: F16) -> f32 {
        x.to_f32()
    }
}
impl From<Bf16> for f32 {
    fn from(x: Bf16) -> f32 {
        x.to_f32()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check_format(fmt: &Format) {
        let inf = fmt.inf_bits();
        for b in 0..=u16::MAX {
            let x = fmt.decode(b);
            if x.is_nan() {
                assert!(b & 0x7fff > inf, "{b:#06x} decoded to NaN");
                assert!(fmt.decode(fmt.encode(x)).is_nan());
                continue;
            }
            assert_eq!(fmt.encode(x), b, "round trip of {b:#06x} ({x})");
            // Ties to even, and values just off the midpoint, between b and its successor.
            let next = b.wrapping_add(1);
            if b & 0x8000 != 0 || next >= inf {
                continue;
            }
            let y = fmt.decode(next);
            let mid = (x + y) / 2.0; // exact in f64
            let even = if b % 2 == 0 { b } else { next };
            assert_eq!(fmt.encode(mid), even, "tie between {b:#06x} and {next:#06x}");
            assert_eq!(fmt.encode(-mid), 0x8000 | even);
            let above = f64::from_bits(mid.to_bits() + 1);
            let below = f64::from_bits(mid.to_bits() - 1);
            assert_eq!(fmt.encode(above), next, "just above the midpoint of {b:#06x}");
            assert_eq!(fmt.encode(below), b, "just below the midpoint of {b:#06x}");
        }
    }

    #[test]
    fn f16_exhaustive_round_trip_and_rounding() {
        check_format(&F16_FORMAT);
        assert_eq!(F16::from_f32(1.0).0, 0x3c00);
        assert_eq!(F16::from_f32(-2.0).0, 0xc000);
        assert_eq!(F16::from_f32(65504.0).0, 0x7bff);
        assert_eq!(F16::from_f32(65520.0).0, 0x7c00); // the overflow tie rounds to infinity
        assert_eq!(F16::from_f64(5.960464477539063e-8).0, 0x0001); // smallest subnormal
        assert_eq!(F16::from_f64(2.9e-8).0, 0x0000); // below half of it
        assert_eq!(F16::from_f32(-0.0).0, 0x8000);
        assert_eq!(F16(0x3555).to_f32(), 0.333_251_95);
    }

    #[test]
    fn bf16_exhaustive_round_trip_and_rounding() {
        check_format(&BF16_FORMAT);
        assert_eq!(Bf16::from_f32(1.0).0, 0x3f80);
        assert_eq!(Bf16::from_f32(f32::MAX).0, 0x7f80); // rounds up past the largest bf16
        assert_eq!(Bf16::from_f32(f32::INFINITY).0, 0x7f80);
        assert!(Bf16::from_f32(f32::NAN).to_f32().is_nan());
    }

    #[test]
    fn bf16_matches_the_f32_bit_trick() {
        // The usual truncation-with-rounding-bias formula, as an independent check of f32 inputs.
        let mut s = 0x9e37_79b9_7f4a_7c15u64;
        for _ in 0..200_000 {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            let bits = (s >> 32) as u32;
            let x = f32::from_bits(bits);
            if x.is_nan() {
                continue;
            }
            let want = ((bits + 0x7fff + ((bits >> 16) & 1)) >> 16) as u16;
            assert_eq!(Bf16::from_f32(x).0, want, "x = {x:e} ({bits:#010x})");
        }
    }

    #[test]
    fn f16_from_f64_rounds_once() {
        // 1 + 2^-11 + 2^-40 is just above the tie between 1 and 1 + 2^-10: it must round up.
        // Rounding to f32 first would drop 2^-40 and make it a tie that rounds down to even.
        let x = 1.0 + 2f64.powi(-11) + 2f64.powi(-40);
        assert_eq!(F16::from_f64(x).0, 0x3c01);
        assert_eq!(F16::from_f32(x as f32).0, 0x3c00);
    }
}
