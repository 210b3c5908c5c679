//! Element types of host storage: f32, bf16, f16 (dfdx has no bf16).

use half::{bf16, f16};

/// A storage dtype, as written in safetensors headers and on the CLI.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "cli", derive(clap::ValueEnum))]
pub enum DType {
    /// 32-bit IEEE float.
    #[cfg_attr(feature = "cli", value(name = "f32", help = "4 bytes per value: exact"))]
    F32,
    /// bfloat16.
    #[cfg_attr(feature = "cli", value(name = "bf16", help = "2 bytes: the checkpoint's dtype for most models"))]
    BF16,
    /// IEEE half.
    #[cfg_attr(feature = "cli", value(name = "f16", help = "2 bytes, more mantissa and less range than bf16"))]
    F16,
    /// FP8 e4m3 (`float8_e4m3fn`). Stored hidden states carry an f32 scale
    /// per token and capture point (see [`crate::shape::fp8`]); this dtype's
    /// own conversions here are unscaled (scale 1, saturating at ±448).
    #[cfg_attr(
        feature = "cli",
        value(
            name = "fp8",
            help = "1 byte: e4m3 codes with an f32 scale per token and capture point (hidden_states_scales). The speculators trainer must read it with its FP8 hidden-states backend (--hidden-states-backend fp8): its default reader fails on FP8"
        )
    )]
    F8E4M3,
}

impl DType {
    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::BF16 | DType::F16 => 2,
            DType::F8E4M3 => 1,
        }
    }

    /// The safetensors dtype.
    pub fn to_safetensors(self) -> safetensors::Dtype {
        match self {
            DType::F32 => safetensors::Dtype::F32,
            DType::BF16 => safetensors::Dtype::BF16,
            DType::F16 => safetensors::Dtype::F16,
            DType::F8E4M3 => safetensors::Dtype::F8_E4M3,
        }
    }

    /// From the safetensors dtype of stored hidden states (FP8 included).
    pub fn from_stored(d: safetensors::Dtype) -> Option<Self> {
        match d {
            safetensors::Dtype::F8_E4M3 => Some(DType::F8E4M3),
            d => Self::from_safetensors(d),
        }
    }

    /// Whether stored states of this dtype carry a scale tensor.
    pub fn scaled(self) -> bool {
        self == DType::F8E4M3
    }

    /// From a safetensors dtype of a plain float tensor (a weight); `None` for
    /// dtypes Strata does not read unscaled (FP8 weights need their block scales).
    pub fn from_safetensors(d: safetensors::Dtype) -> Option<Self> {
        match d {
            safetensors::Dtype::F32 => Some(DType::F32),
            safetensors::Dtype::BF16 => Some(DType::BF16),
            safetensors::Dtype::F16 => Some(DType::F16),
            _ => None,
        }
    }

    /// Converts f32 values into this dtype's little-endian bytes, appending to `out`.
    pub fn encode_into(self, src: &[f32], out: &mut Vec<u8>) {
        let n = src.len() * self.size();
        out.reserve(n);
        // Written straight into the spare capacity: no clearing pass first.
        let dst = &mut out.spare_capacity_mut()[..n];
        // Fixed-size chunks so the loops vectorise.
        match self {
            DType::F32 => {
                write_bytes(dst, bytemuck::cast_slice(src));
            }
            DType::BF16 => {
                #[cfg(target_arch = "x86_64")]
                if std::is_x86_feature_detected!("avx512bw") {
                    // SAFETY: the CPU has AVX-512BW (and so F), checked just above.
                    unsafe { encode_bf16_avx512(src, dst) }
                } else {
                    encode_bf16(src, dst)
                }
                #[cfg(not(target_arch = "x86_64"))]
                encode_bf16(src, dst)
            }
            DType::F16 => {
                dst.chunks_exact_mut(2).zip(src).for_each(|(d, v)| write_bytes(d, &f16::from_f32(*v).to_le_bytes()))
            }
            DType::F8E4M3 => {
                for (d, v) in dst.iter_mut().zip(src) {
                    d.write(super::fp8::e4m3_from_f32(*v));
                }
            }
        }
        // SAFETY: every one of the `n` bytes after the old length was written above.
        unsafe { out.set_len(out.len() + n) };
    }

    /// `v` rounded to this dtype (as storing it would), back as f32.
    pub fn round(self, v: f32) -> f32 {
        match self {
            DType::F32 => v,
            DType::BF16 => bf16::from_f32(v).to_f32(),
            DType::F16 => f16::from_f32(v).to_f32(),
            DType::F8E4M3 => super::fp8::e4m3_to_f32(super::fp8::e4m3_from_f32(v)),
        }
    }

    /// One unit in the last place, relative: the largest `ulp(v) / |v|` of a
    /// normal value (2^-23 for f32, 2^-7 for bf16, 2^-10 for f16).
    pub fn ulp(self) -> f32 {
        match self {
            DType::F32 => f32::EPSILON,
            DType::BF16 => 2f32.powi(-7),
            DType::F16 => 2f32.powi(-10),
            DType::F8E4M3 => 2f32.powi(-3),
        }
    }

    /// Decodes little-endian bytes of this dtype, appending the f32 values to `out`.
    pub fn decode_append(self, bytes: &[u8], out: &mut Vec<f32>) {
        // Appended rather than written over zeros: a weight read at load is
        // touched once, not cleared first.
        match self {
            DType::F32 => out.extend(bytes.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))),
            DType::BF16 => out.extend(bytes.chunks_exact(2).map(|c| bf16::from_le_bytes([c[0], c[1]]).to_f32())),
            DType::F16 => out.extend(bytes.chunks_exact(2).map(|c| f16::from_le_bytes([c[0], c[1]]).to_f32())),
            DType::F8E4M3 => out.extend(bytes.iter().map(|&c| super::fp8::e4m3_to_f32(c))),
        }
    }

    /// Decodes little-endian bytes of this dtype into f32 values.
    pub fn decode_into(self, bytes: &[u8], out: &mut [f32]) {
        debug_assert_eq!(bytes.len(), out.len() * self.size());
        match self {
            DType::F32 => {
                for (o, c) in out.iter_mut().zip(bytes.chunks_exact(4)) {
                    *o = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
                }
            }
            DType::BF16 => {
                for (o, c) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                    *o = bf16::from_le_bytes([c[0], c[1]]).to_f32();
                }
            }
            DType::F16 => {
                for (o, c) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                    *o = f16::from_le_bytes([c[0], c[1]]).to_f32();
                }
            }
            DType::F8E4M3 => {
                for (o, &c) in out.iter_mut().zip(bytes) {
                    *o = super::fp8::e4m3_to_f32(c);
                }
            }
        }
    }
}

/// [`encode_bf16`] compiled for AVX-512: 16 values to a register, the same bits.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn encode_bf16_avx512(src: &[f32], dst: &mut [std::mem::MaybeUninit<u8>]) {
    encode_bf16(src, dst)
}

/// `src` rounded to bf16, as little-endian bytes into `dst` (twice as long).
#[inline(always)]
fn encode_bf16(src: &[f32], dst: &mut [std::mem::MaybeUninit<u8>]) {
    // Sixteen values at a time through a u16 array, so the rounding and the
    // byte order compile to vector code (the output may start at an odd
    // byte, so it cannot be viewed as u16).
    let mut chunks = dst.chunks_exact_mut(32);
    for (d, s) in (&mut chunks).zip(src.chunks_exact(16)) {
        // A plain loop: an `array::from_fn` closure would not inherit the
        // caller's AVX-512, and stayed a call.
        let mut bytes = [[0u8; 2]; 16];
        for (b, v) in bytes.iter_mut().zip(s) {
            *b = bf16_bits(*v).to_le_bytes();
        }
        write_bytes(d, bytes.as_flattened());
    }
    let rest = src.len() / 16 * 16;
    for (d, v) in chunks.into_remainder().chunks_exact_mut(2).zip(&src[rest..]) {
        write_bytes(d, &bf16_bits(*v).to_le_bytes());
    }
}

impl std::fmt::Display for DType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            DType::F32 => "f32",
            DType::BF16 => "bf16",
            DType::F16 => "f16",
            DType::F8E4M3 => "fp8",
        })
    }
}

impl std::str::FromStr for DType {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s.to_ascii_lowercase().as_str() {
            "f32" | "float32" => Ok(DType::F32),
            "bf16" | "bfloat16" => Ok(DType::BF16),
            "f16" | "float16" | "half" => Ok(DType::F16),
            "fp8" | "f8" | "f8_e4m3" | "float8_e4m3fn" => Ok(DType::F8E4M3),
            other => Err(format!("unknown dtype {other:?} (expected f32, bf16, f16 or fp8)")),
        }
    }
}

/// An element type of typed host storage.
pub trait Element: Copy + Send + Sync + Default + std::fmt::Debug + 'static {
    /// Its dtype tag.
    const DTYPE: DType;
    /// Rounds an f32 into this type.
    fn from_f32(v: f32) -> Self;
    /// Widens to f32.
    fn to_f32(self) -> f32;
}

impl Element for f32 {
    const DTYPE: DType = DType::F32;
    #[inline(always)]
    fn from_f32(v: f32) -> Self {
        v
    }
    #[inline(always)]
    fn to_f32(self) -> f32 {
        self
    }
}

impl Element for bf16 {
    const DTYPE: DType = DType::BF16;
    #[inline(always)]
    fn from_f32(v: f32) -> Self {
        bf16::from_f32(v)
    }
    #[inline(always)]
    fn to_f32(self) -> f32 {
        bf16::to_f32(self)
    }
}

impl Element for f16 {
    const DTYPE: DType = DType::F16;
    #[inline(always)]
    fn from_f32(v: f32) -> Self {
        f16::from_f32(v)
    }
    #[inline(always)]
    fn to_f32(self) -> f32 {
        f16::to_f32(self)
    }
}

/// Copies `src` into uninitialised bytes of the same length (MSRV 1.89 has no
/// `write_copy_of_slice`).
#[inline(always)]
fn write_bytes(dst: &mut [std::mem::MaybeUninit<u8>], src: &[u8]) {
    assert_eq!(dst.len(), src.len());
    // SAFETY: equal lengths, checked above; a `MaybeUninit<u8>` has the layout of a `u8`.
    unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), dst.as_mut_ptr().cast::<u8>(), src.len()) };
}

/// `x` rounded to bf16 (nearest, ties to even; NaN stays NaN), as bits: the
/// rounding of `half::bf16::from_f32`, written without branches so loops vectorise.
#[inline(always)]
pub fn bf16_bits(x: f32) -> u16 {
    let b = x.to_bits();
    let rounded = (b.wrapping_add(0x7fff + ((b >> 16) & 1)) >> 16) as u16;
    let nan = ((b >> 16) | 0x40) as u16;
    if b & 0x7fff_ffff > 0x7f80_0000 {
        nan
    } else {
        rounded
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bf16_bits_is_halfs_rounding_bit_for_bit() {
        let specials =
            [0u32, 0x8000_0000, 0x7f80_0000, 0xff80_0000, 0x7fc0_0000, 0x7f80_0001, 0xffff_ffff, 0x7f7f_ffff];
        // Every 251st bit pattern (about 17 million), which walks every exponent,
        // every rounding case and NaN payloads, plus the specials.
        for b in (0..=u32::MAX).step_by(251).chain(specials) {
            let x = f32::from_bits(b);
            assert_eq!(bf16_bits(x), half::bf16::from_f32(x).to_bits(), "bits {b:#010x}");
        }
    }

    #[test]
    fn bf16_encoding_matches_half_at_every_length() {
        // Vector body (16 at a time, AVX-512 where the CPU has it) and scalar
        // tail, at offsets that leave the output unaligned; NaN, infinities,
        // subnormals and ties among the values.
        let mut src: Vec<f32> = (0..203).map(|i| (i as f32 * 0.37).sin() * 1e3 + i as f32 * 1e-3).collect();
        let odd = [f32::NAN, f32::INFINITY, -f32::INFINITY, 1e-40, -0.0, f32::from_bits(0x3f80_8000), f32::MAX];
        src.iter_mut().step_by(13).zip(odd.iter().cycle()).for_each(|(v, o)| *v = *o);
        for n in [0, 1, 7, 8, 9, 15, 16, 17, 64, 203] {
            let mut out = vec![0xaa];
            DType::BF16.encode_into(&src[..n], &mut out);
            let want: Vec<u8> = src[..n].iter().flat_map(|v| half::bf16::from_f32(*v).to_le_bytes()).collect();
            assert_eq!(out[1..], want[..], "{n} values");
        }
    }

    #[test]
    fn encode_decode_round_trip() {
        let src = [1.0f32, -2.5, 0.15625, 3.0e4];
        for dt in [DType::F32, DType::BF16, DType::F16] {
            let mut bytes = Vec::new();
            dt.encode_into(&src, &mut bytes);
            assert_eq!(bytes.len(), src.len() * dt.size());
            let mut back = [0f32; 4];
            dt.decode_into(&bytes, &mut back);
            for (a, b) in src.iter().zip(back) {
                assert!((a - b).abs() <= a.abs() * 1e-2, "{dt}: {a} vs {b}");
            }
        }
        assert_eq!("bfloat16".parse::<DType>().unwrap(), DType::BF16);
        assert!("int8".parse::<DType>().is_err());
    }
}
