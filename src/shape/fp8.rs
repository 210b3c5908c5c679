//! FP8 e4m3 storage (`float8_e4m3fn`: 4 exponent bits, bias 7, 3 mantissa
//! bits, no infinities, `0x7f`/`0xff` NaN, largest finite 448) with an f32
//! scale per row: each `H`-long row of one token at one capture point is
//! stored as `codes = round(x / scale)`, `scale = max|x| / 448`, and read
//! back as `codes * scale`, the broadcast the speculators stack's FP8 reader
//! does. Scaling per capture point (not one scale per token across layers)
//! keeps a large late layer from swamping an early one.

/// The largest finite e4m3 value.
pub const E4M3_MAX: f32 = 448.0;

/// `x` as the nearest e4m3 code (ties to even), saturating at ±448, so a
/// code is never the NaN encoding (NaN, which callers reject before they
/// get here, saturates too). Branch-free, so row loops vectorise.
#[inline(always)]
pub fn e4m3_from_f32(x: f32) -> u8 {
    let sign = (x.to_bits() >> 24) & 0x80;
    // `min` of NaN and 448 is 448.
    let a = x.abs().min(E4M3_MAX);
    // Normals: round the 23-bit mantissa to 3 bits, ties to even (a carry
    // moves into the exponent); the top bits are then the code plus the
    // exponent's bias difference, (127 - 7) << 3.
    let b = a.to_bits();
    let normal = ((b + 0x7_ffff + ((b >> 20) & 1)) >> 20).wrapping_sub(120 << 3);
    // Subnormals and zero, in units of 2^-9, rounded to nearest even by the
    // FPU's own rounding of adding 2^23 (8 units is the smallest normal, code 0x08).
    let sub = (a * 512.0 + 8_388_608.0).to_bits() - 0x4b00_0000;
    let code = if a < 0.015_625 { sub } else { normal };
    (sign | code) as u8
}

/// The value of an e4m3 code (`0x7f`/`0xff` are NaN).
#[inline(always)]
pub fn e4m3_to_f32(c: u8) -> f32 {
    DECODE[c as usize]
}

/// Every code's value, built at compile time.
static DECODE: [f32; 256] = {
    let mut t = [0f32; 256];
    let mut c = 0;
    while c < 256 {
        let e = (c >> 3) & 0xf;
        let m = (c & 7) as f32;
        let mag = if e == 0xf && c & 7 == 7 {
            f32::NAN
        } else if e == 0 {
            m / 512.0
        } else {
            let mut p = 1.0f32;
            let mut k = 0;
            // 2^(e-7), by repeated steps (no powi in const).
            while k < e {
                p *= 2.0;
                k += 1;
            }
            p / 128.0 * (1.0 + m / 8.0)
        };
        t[c] = if c & 0x80 != 0 { -mag } else { mag };
        c += 1;
    }
    t
};

/// The scale of one row: `max|x| / 448`, or 1 for an all-zero row (never 0, never NaN).
#[inline(always)]
pub fn row_scale(row: &[f32]) -> f32 {
    // Eight running maxima, so the loop vectorises.
    let mut m = [0f32; 8];
    let mut chunks = row.chunks_exact(8);
    for c in &mut chunks {
        for (m, x) in m.iter_mut().zip(c) {
            *m = if x.abs() > *m { x.abs() } else { *m };
        }
    }
    let amax = chunks.remainder().iter().chain(&m).fold(0f32, |m, x| m.max(x.abs()));
    let s = amax / E4M3_MAX;
    // A subnormal scale has no finite inverse: such a row is all but zero.
    if s.is_normal() {
        s
    } else {
        1.0
    }
}

/// Appends the codes of `row` scaled by `scale` to `out`.
#[inline]
pub fn encode_row(row: &[f32], scale: f32, out: &mut Vec<u8>) {
    let start = out.len();
    out.resize(start + row.len(), 0);
    codes_into(row, 1.0 / scale, &mut out[start..]);
}

/// Quantises `row`, appending its codes to `out`; returns its scale.
#[inline]
pub fn quantize_row(row: &[f32], out: &mut Vec<u8>) -> f32 {
    let start = out.len();
    out.resize(start + row.len(), 0);
    let codes = &mut out[start..];
    #[cfg(target_arch = "x86_64")]
    if std::is_x86_feature_detected!("avx512bw") {
        // SAFETY: the CPU has AVX-512BW (and so F), checked just above.
        return unsafe { quantize_into_avx512(row, codes) };
    }
    quantize_into(row, codes)
}

/// [`quantize_into`] compiled for AVX-512: the same operations 16 values
/// to a register, so the same codes and scale (a storage-bound writer
/// spent most of its time here).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn quantize_into_avx512(row: &[f32], codes: &mut [u8]) -> f32 {
    quantize_into(row, codes)
}

#[inline(always)]
fn quantize_into(row: &[f32], codes: &mut [u8]) -> f32 {
    let scale = row_scale(row);
    codes_into(row, 1.0 / scale, codes);
    scale
}

/// The codes of `row` times `inv` into `codes` (equal lengths).
#[inline(always)]
fn codes_into(row: &[f32], inv: f32, codes: &mut [u8]) {
    for (o, &x) in codes.iter_mut().zip(row) {
        *o = e4m3_from_f32(x * inv);
    }
}

/// Writes `codes * scale` into `out` (equal lengths).
#[inline]
pub fn dequantize_row(codes: &[u8], scale: f32, out: &mut [f32]) {
    for (o, &c) in out.iter_mut().zip(codes) {
        *o = e4m3_to_f32(c) * scale;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The e4m3fn value of a code, from the format's definition.
    fn reference(c: u8) -> f32 {
        let s = if c & 0x80 != 0 { -1.0 } else { 1.0 };
        let (e, m) = (((c >> 3) & 0xf) as i32, (c & 7) as f64);
        if e == 0xf && m == 7.0 {
            return f32::NAN;
        }
        let v = if e == 0 { m / 8.0 * 2f64.powi(-6) } else { (1.0 + m / 8.0) * 2f64.powi(e - 7) };
        (s * v) as f32
    }

    #[test]
    fn quantize_row_is_the_same_on_every_isa() {
        // Rows of every magnitude, ties, subnormals after scaling, zeros and both signs.
        let mut seed = 7u64;
        let mut next = || {
            seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            (seed >> 32) as u32
        };
        for len in [1, 7, 16, 33, 1024, 1031] {
            for _ in 0..20 {
                let row: Vec<f32> = (0..len)
                    .map(|_| {
                        let b = next();
                        let v = f32::from_bits((b & 0x8000_0000) | (0x3000_0000 + (b & 0x1fff_ffff)));
                        if b % 17 == 0 {
                            0.0
                        } else {
                            v
                        }
                    })
                    .collect();
                let mut got = Vec::new();
                let s = quantize_row(&row, &mut got);
                let mut want = vec![0u8; len];
                assert_eq!(s.to_bits(), quantize_into(&row, &mut want).to_bits());
                assert_eq!(got, want, "len {len}");
            }
        }
    }

    #[test]
    fn the_table_is_the_format() {
        for c in 0..=255u8 {
            let (a, b) = (e4m3_to_f32(c), reference(c));
            assert!(a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan()), "code {c:#04x}: {a} vs {b}");
        }
        assert_eq!(e4m3_to_f32(0x7e), 448.0);
        assert_eq!(e4m3_to_f32(0x01), 2f32.powi(-9));
    }

    #[test]
    fn encoding_is_round_to_nearest_even_and_saturates() {
        // Every finite code round-trips.
        for c in 0..=255u8 {
            let v = e4m3_to_f32(c);
            if !v.is_nan() {
                let back = e4m3_from_f32(v);
                assert_eq!(e4m3_to_f32(back), v, "code {c:#04x}");
            }
        }
        // Against a brute-force nearest (ties to the even code) over many values.
        let finite: Vec<(u8, f32)> = (0..=0x7eu8).map(|c| (c, e4m3_to_f32(c))).collect();
        for i in 0..200_000u32 {
            let x = (i as f32 * 0.000_31).powf(1.7) * if i % 2 == 0 { 1.0 } else { -1.0 };
            let a = x.abs().min(E4M3_MAX);
            let best = finite
                .iter()
                .min_by(|(ca, va), (cb, vb)| {
                    let (da, db) = ((va - a).abs(), (vb - a).abs());
                    da.partial_cmp(&db).unwrap().then((ca & 1).cmp(&(cb & 1)))
                })
                .unwrap();
            let got = e4m3_from_f32(x);
            assert_eq!(got & 0x7f, best.0, "x = {x}");
            assert!(got != 0x7f && got != 0xff);
        }
        assert_eq!(e4m3_from_f32(1e30), 0x7e);
        assert_eq!(e4m3_from_f32(-1e30), 0xfe);
        assert_eq!(e4m3_from_f32(f32::NAN) & 0x7f, 0x7e);
        assert_eq!(e4m3_from_f32(0.0), 0);
        assert_eq!(e4m3_from_f32(-0.0), 0x80);
    }

    #[test]
    fn a_zero_row_has_scale_one_and_rows_round_trip_within_half_a_step() {
        let mut out = Vec::new();
        assert_eq!(quantize_row(&[0.0; 5], &mut out), 1.0);
        assert_eq!(out, [0; 5]);
        out.clear();
        assert_eq!(quantize_row(&[1e-40, 0.0], &mut out), 1.0);
        assert_eq!(out, [0, 0]);
        let row: Vec<f32> = (0..1000).map(|i| ((i as f32) * 0.7).sin() * 37.0).collect();
        out.clear();
        let s = quantize_row(&row, &mut out);
        let mut back = vec![0f32; row.len()];
        dequantize_row(&out, s, &mut back);
        for (a, b) in row.iter().zip(&back) {
            // Half a step: 2^-4 relative for normals, 2^-10 * scale for subnormals.
            assert!((a - b).abs() <= a.abs() / 16.0 + s / 1024.0 + 1e-6, "{a} vs {b}");
        }
        assert!(out.iter().all(|&c| c & 0x7f != 0x7f));
    }
}
