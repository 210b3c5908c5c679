//! Quantised GEMM panels: FP8 or INT4 codes in the GEMM's `NR`-column panel
//! order, decoded to f32 one `[kc][NR]` tile at a time as the GEMM reaches it.
//!
//! Codes stay at their checkpoint size (one byte per FP8 weight, half a byte
//! per INT4 weight) plus one f32 scale per panel column and scale segment.
//! A decoded weight is `decode(code) · scale`, one f32 rounding, the same
//! value the reference dequantisation gives, so the GEMM sees exactly the
//! dequantised matrix.

use super::panels::{PanelSource, MC, NR};
use crate::hf::quant::{QuantKind, QuantRows};

/// A quantised `[n, k]` weight packed into `ceil(n/NR)` column panels.
pub struct QuantPanels {
    kind: QuantKind,
    k: usize,
    /// FP8: `[panel][k][NR]` bytes. INT4: `[panel][k][NR/2]` bytes, byte `b`
    /// holding column `b` in its low nibble and column `b + NR/2` in its high one.
    codes: Vec<u8>,
    /// Segment starts along k, then k.
    seg: Vec<usize>,
    /// `[panel][segment][NR]` scales; padding columns are 0.
    scales: Vec<f32>,
}

impl QuantPanels {
    /// Packs row-major codes and scales.
    pub fn pack(q: &QuantRows) -> Self {
        let (n, k, ns) = (q.rows, q.cols, q.num_segments());
        let panels = n.div_ceil(NR);
        let row_bytes = row_bytes(q.kind);
        // Padding columns hold the code of 0 with scale 0.
        let zero = match q.kind {
            QuantKind::Fp8 | QuantKind::Bf16 | QuantKind::Mxfp4 => 0u8,
            QuantKind::Int4 => 0x88,
        };
        let mut codes = vec![zero; panels * k * row_bytes];
        let mut scales = vec![0f32; panels * ns * NR];
        for j in 0..n {
            let (pi, jj) = (j / NR, j % NR);
            let panel = &mut codes[pi * k * row_bytes..(pi + 1) * k * row_bytes];
            let cb = q.kind.code_bytes();
            let src = &q.codes[j * k * cb..(j + 1) * k * cb];
            match q.kind {
                QuantKind::Fp8 => src.iter().enumerate().for_each(|(p, &c)| panel[p * NR + jj] = c),
                QuantKind::Bf16 => {
                    for (p, c) in src.chunks_exact(2).enumerate() {
                        panel[p * row_bytes + 2 * jj..p * row_bytes + 2 * jj + 2].copy_from_slice(c);
                    }
                }
                QuantKind::Int4 | QuantKind::Mxfp4 => {
                    let (b, shift) = (jj % (NR / 2), if jj < NR / 2 { 0 } else { 4 });
                    for (p, &c) in src.iter().enumerate() {
                        let byte = &mut panel[p * row_bytes + b];
                        *byte = (*byte & !(0xf << shift)) | (c << shift);
                    }
                }
            }
            for s in 0..ns {
                scales[(pi * ns + s) * NR + jj] = q.scales[j * ns + s];
            }
        }
        QuantPanels { kind: q.kind, k, codes, seg: q.seg.clone(), scales }
    }

    /// The kind of codes.
    pub fn kind(&self) -> QuantKind {
        self.kind
    }

    /// Bytes held.
    pub fn bytes(&self) -> usize {
        self.codes.len() + self.scales.len() * 4 + self.seg.len() * std::mem::size_of::<usize>()
    }

    /// Decodes rows `p0..p0+kc` of panel `pi` into `out` (`[kc][NR]`).
    pub fn decode_tile(&self, pi: usize, p0: usize, kc: usize, out: &mut [f32]) {
        let ns = self.seg.len() - 1;
        let row_bytes = row_bytes(self.kind);
        let panel = &self.codes[pi * self.k * row_bytes..(pi + 1) * self.k * row_bytes];
        let decode = row_decoder(self.kind);
        // The segment holding p0, then on while segments start before p0 + kc.
        let mut s = self.seg.partition_point(|&b| b <= p0) - 1;
        let mut p = p0;
        while p < p0 + kc {
            let end = self.seg[s + 1].min(p0 + kc);
            let sv: &[f32; NR] = self.scales[(pi * ns + s) * NR..(pi * ns + s + 1) * NR].try_into().expect("NR scales");
            for q in p..end {
                let dst: &mut [f32; NR] = (&mut out[(q - p0) * NR..(q - p0 + 1) * NR]).try_into().expect("NR outputs");
                // SAFETY: `decode` was chosen for this CPU's features by `row_decoder`.
                unsafe { decode(&panel[q * row_bytes..(q + 1) * row_bytes], sv, dst) };
            }
            p = end;
            s += 1;
        }
    }
}

/// Bytes of one depth row of a panel.
fn row_bytes(kind: QuantKind) -> usize {
    match kind {
        QuantKind::Fp8 => NR,
        QuantKind::Int4 | QuantKind::Mxfp4 => NR / 2,
        QuantKind::Bf16 => 2 * NR,
    }
}

/// Decodes one panel row of codes into NR floats scaled per column.
type RowDecoder = unsafe fn(&[u8], &[f32; NR], &mut [f32; NR]);

fn row_decoder(kind: QuantKind) -> RowDecoder {
    #[cfg(target_arch = "x86_64")]
    {
        if std::is_x86_feature_detected!("avx512f") {
            return match kind {
                QuantKind::Fp8 => avx512::fp8_row,
                QuantKind::Int4 => avx512::int4_row,
                QuantKind::Bf16 => avx512::bf16_row,
                // A table lookup per nibble; no AVX-512 form yet (none could be tested here).
                QuantKind::Mxfp4 => portable::mxfp4_row,
            };
        }
    }
    match kind {
        QuantKind::Fp8 => portable::fp8_row,
        QuantKind::Int4 => portable::int4_row,
        QuantKind::Bf16 => portable::bf16_row,
        QuantKind::Mxfp4 => portable::mxfp4_row,
    }
}

mod portable {
    use super::NR;
    use crate::hf::quant::{fp8_e4m3_to_f32, FP4_VALUES};

    pub(super) unsafe fn fp8_row(codes: &[u8], scale: &[f32; NR], out: &mut [f32; NR]) {
        for ((o, &c), s) in out.iter_mut().zip(codes).zip(scale) {
            *o = fp8_e4m3_to_f32(c) * s;
        }
    }

    // Plain bf16: the scale is 1 and is not applied.
    pub(super) unsafe fn bf16_row(codes: &[u8], _scale: &[f32; NR], out: &mut [f32; NR]) {
        for (o, c) in out.iter_mut().zip(codes.chunks_exact(2)) {
            *o = f32::from_bits((u16::from_le_bytes([c[0], c[1]]) as u32) << 16);
        }
    }

    pub(super) unsafe fn int4_row(codes: &[u8], scale: &[f32; NR], out: &mut [f32; NR]) {
        let h = NR / 2;
        for (b, &byte) in codes.iter().enumerate() {
            out[b] = ((byte & 0xf) as i32 - 8) as f32 * scale[b];
            out[b + h] = ((byte >> 4) as i32 - 8) as f32 * scale[b + h];
        }
    }

    // Nibbles packed as INT4's; each is an index into the E2M1 values.
    pub(super) unsafe fn mxfp4_row(codes: &[u8], scale: &[f32; NR], out: &mut [f32; NR]) {
        let h = NR / 2;
        for (b, &byte) in codes.iter().enumerate() {
            out[b] = FP4_VALUES[(byte & 0xf) as usize] * scale[b];
            out[b + h] = FP4_VALUES[(byte >> 4) as usize] * scale[b + h];
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use super::NR;
    use std::arch::x86_64::*;

    /// Sixteen E4M3 codes (as i32 lanes) to f32, bit-exact with `fp8_e4m3_to_f32`.
    #[target_feature(enable = "avx512f")]
    unsafe fn fp8_16(x: __m512i) -> __m512 {
        let em = _mm512_and_si512(x, _mm512_set1_epi32(0x7f));
        let sign = _mm512_slli_epi32(_mm512_and_si512(x, _mm512_set1_epi32(0x80)), 24);
        // Normal: exponent rebiased from 7 to 127, mantissa moved to the top.
        let normal = _mm512_add_epi32(_mm512_slli_epi32(em, 20), _mm512_set1_epi32(120 << 23));
        // Subnormal (exponent 0): m · 2^-9, exact.
        let sub = _mm512_castps_si512(_mm512_mul_ps(_mm512_cvtepi32_ps(em), _mm512_set1_ps(1.0 / 512.0)));
        let is_sub = _mm512_cmplt_epi32_mask(em, _mm512_set1_epi32(8));
        let v = _mm512_or_si512(_mm512_mask_blend_epi32(is_sub, normal, sub), sign);
        // 0x7f and 0xff are NaN, positive like `f32::NAN`.
        let is_nan = _mm512_cmpeq_epi32_mask(em, _mm512_set1_epi32(0x7f));
        _mm512_castsi512_ps(_mm512_mask_blend_epi32(is_nan, v, _mm512_set1_epi32(0x7fc0_0000)))
    }

    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn fp8_row(codes: &[u8], scale: &[f32; NR], out: &mut [f32; NR]) {
        debug_assert_eq!(codes.len(), NR);
        let lo = _mm512_cvtepu8_epi32(_mm_loadu_si128(codes.as_ptr() as *const __m128i));
        let hi = _mm512_cvtepu8_epi32(_mm_loadu_si128(codes.as_ptr().add(16) as *const __m128i));
        let s0 = _mm512_loadu_ps(scale.as_ptr());
        let s1 = _mm512_loadu_ps(scale.as_ptr().add(16));
        _mm512_storeu_ps(out.as_mut_ptr(), _mm512_mul_ps(fp8_16(lo), s0));
        _mm512_storeu_ps(out.as_mut_ptr().add(16), _mm512_mul_ps(fp8_16(hi), s1));
    }

    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn bf16_row(codes: &[u8], _scale: &[f32; NR], out: &mut [f32; NR]) {
        debug_assert_eq!(codes.len(), 2 * NR);
        for half in 0..2 {
            let x = _mm512_cvtepu16_epi32(_mm256_loadu_si256(codes.as_ptr().add(32 * half) as *const __m256i));
            _mm512_storeu_ps(out.as_mut_ptr().add(16 * half), _mm512_castsi512_ps(_mm512_slli_epi32(x, 16)));
        }
    }

    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn int4_row(codes: &[u8], scale: &[f32; NR], out: &mut [f32; NR]) {
        debug_assert_eq!(codes.len(), NR / 2);
        let x = _mm512_cvtepu8_epi32(_mm_loadu_si128(codes.as_ptr() as *const __m128i));
        let eight = _mm512_set1_epi32(8);
        let lo = _mm512_sub_epi32(_mm512_and_si512(x, _mm512_set1_epi32(0xf)), eight);
        let hi = _mm512_sub_epi32(_mm512_srli_epi32(x, 4), eight);
        let s0 = _mm512_loadu_ps(scale.as_ptr());
        let s1 = _mm512_loadu_ps(scale.as_ptr().add(16));
        _mm512_storeu_ps(out.as_mut_ptr(), _mm512_mul_ps(_mm512_cvtepi32_ps(lo), s0));
        _mm512_storeu_ps(out.as_mut_ptr().add(16), _mm512_mul_ps(_mm512_cvtepi32_ps(hi), s1));
    }
}

impl PanelSource for QuantPanels {
    type Elem = f32;
    // Each tile is decoded once per row block of MC rows (taller blocks
    // would no longer keep a k-block of A in L2).
    const MC: usize = MC;
    const REPACKS: bool = true;
    unsafe fn tile(&self, pi: usize, p0: usize, kc: usize, _k: usize, buf: &mut Vec<f32>) -> *const f32 {
        buf.resize(kc * NR, 0.0);
        self.decode_tile(pi, p0, kc, buf);
        buf.as_ptr()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rows(kind: QuantKind, n: usize, k: usize, c0: usize, block: usize) -> QuantRows {
        let seg = QuantRows::segments(c0, k, block);
        let ns = seg.len() - 1;
        let mut x = 0x9e37_79b9u32;
        let mut next = || {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            x
        };
        let codes = (0..n * k * kind.code_bytes())
            .map(|_| match kind {
                QuantKind::Fp8 | QuantKind::Bf16 => (next() & 0xff) as u8,
                QuantKind::Int4 | QuantKind::Mxfp4 => (next() & 0xf) as u8,
            })
            .collect();
        let scales = (0..n * ns)
            .map(|_| if kind == QuantKind::Bf16 { 1.0 } else { (next() % 1000) as f32 / 997.0 + 0.01 })
            .collect();
        QuantRows { kind, rows: n, cols: k, codes, seg, scales }
    }

    /// Every decoded tile, on every path this CPU has, equals the row-major dequantisation bit for bit.
    #[test]
    fn tiles_equal_the_dequantized_matrix() {
        for kind in [QuantKind::Fp8, QuantKind::Int4, QuantKind::Bf16, QuantKind::Mxfp4] {
            for &(n, k, c0, block) in &[(70, 300, 0, 128), (33, 97, 100, 32), (5, 1030, 7, 128), (64, 64, 0, 32)] {
                let q = rows(kind, n, k, c0, block);
                let want = q.dequantize();
                let panels = QuantPanels::pack(&q);
                for (p0, kc) in [(0, k), (k / 3, k - k / 3), (k - 1, 1)] {
                    let mut tile = vec![f32::NAN; kc * NR];
                    for pi in 0..n.div_ceil(NR) {
                        panels.decode_tile(pi, p0, kc, &mut tile);
                        for p in 0..kc {
                            for jj in 0..NR {
                                let j = pi * NR + jj;
                                let got = tile[p * NR + jj];
                                if j < n {
                                    let w = want[j * k + p0 + p];
                                    assert!(
                                        got.to_bits() == w.to_bits() || (got.is_nan() && w.is_nan()),
                                        "{kind:?} n{n} k{k}: ({j},{}) {got} vs {w}",
                                        p0 + p
                                    );
                                } else {
                                    assert_eq!(got, 0.0, "padding column");
                                }
                            }
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn portable_and_native_rows_agree() {
        let scale: [f32; NR] = std::array::from_fn(|i| 0.5 + i as f32 / 7.0);
        for base in 0..8u8 {
            let codes: Vec<u8> = (0..NR as u8).map(|i| i.wrapping_mul(37).wrapping_add(base * 32)).collect();
            let (mut a, mut b) = ([0f32; NR], [0f32; NR]);
            // SAFETY: the portable decoders need no CPU feature; the native one was chosen for this CPU.
            unsafe {
                portable::fp8_row(&codes, &scale, &mut a);
                row_decoder(QuantKind::Fp8)(&codes, &scale, &mut b);
            }
            assert!(a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits()), "fp8 base {base}");
            unsafe {
                portable::int4_row(&codes[..NR / 2], &scale, &mut a);
                row_decoder(QuantKind::Int4)(&codes[..NR / 2], &scale, &mut b);
            }
            assert_eq!(a, b, "int4 base {base}");
            let codes: Vec<u8> = (0..2 * NR as u8).map(|i| i.wrapping_mul(91).wrapping_add(base * 7)).collect();
            unsafe {
                portable::bf16_row(&codes, &scale, &mut a);
                row_decoder(QuantKind::Bf16)(&codes, &scale, &mut b);
            }
            assert!(a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits()), "bf16 base {base}");
        }
    }
}
