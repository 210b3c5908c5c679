//! Element-wise and row-wise kernels of the decoder: RMSNorm, RoPE, SwiGLU,
//! and the `exp` of SwiGLU and the softmax.

use crate::backend::Glu;
use rayon::prelude::*;

/// `e^x` within 2 ulp of the true value, NaN kept: a branch-free polynomial
/// (Cody–Waite reduction to `r ∈ [-ln2/2, ln2/2]`, degree-7 Taylor series in
/// fused multiply-adds, the exponent set through the bits), so loops of it
/// vectorise where libm's `expf` is a call per element. Below -87 it gives
/// about 2^-126 rather than 0; above 88.73 it overflows to infinity as `expf` does.
///
/// `mul_add` is one rounding on every CPU (an instruction where the code is
/// compiled for FMA, libm's `fmaf` elsewhere), so every path gives the same
/// bits; hot loops of it are compiled for AVX-512 or FMA.
#[inline(always)]
pub fn exp(x: f32) -> f32 {
    const LN2_HI: f32 = f32::from_bits(0x3f31_7200); // ln 2 with 16 trailing zero bits: n·LN2_HI is exact
    const LN2_LO: f32 = f32::from_bits(0x35bf_be8e);
    // Adding 1.5·2^23 rounds to an integer, which lands in the low mantissa bits.
    const SHIFTER: f32 = 12_582_912.0;
    let xc = x.clamp(-87.0, 88.0);
    let t = xc.mul_add(std::f32::consts::LOG2_E, SHIFTER);
    let n = t - SHIFTER;
    let r = (-n).mul_add(LN2_LO, (-n).mul_add(LN2_HI, xc));
    let mut p: f32 = 1.0 / 5040.0;
    for c in [1.0 / 720.0, 1.0 / 120.0, 1.0 / 24.0, 1.0 / 6.0, 0.5, 1.0, 1.0] {
        p = p.mul_add(r, c);
    }
    let scale = f32::from_bits(((t.to_bits() as i32 - 0x4b40_0000 + 127) << 23) as u32);
    if x.is_nan() {
        x
    } else if x > 88.73 {
        f32::INFINITY
    } else {
        p * scale
    }
}

/// [`exp`] of 16 lanes with AVX-512: the same operations in the same
/// order, so every lane has the bits [`exp`] gives it.
///
/// # Safety
/// The CPU must have AVX-512F (the caller is compiled for it).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(crate) unsafe fn exp16(x: std::arch::x86_64::__m512) -> std::arch::x86_64::__m512 {
    use std::arch::x86_64::*;
    const LN2_HI: f32 = f32::from_bits(0x3f31_7200);
    const LN2_LO: f32 = f32::from_bits(0x35bf_be8e);
    const SHIFTER: f32 = 12_582_912.0;
    // `clamp` (a NaN lane is replaced at the end, as in `exp`).
    let xc = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0)), _mm512_set1_ps(88.0));
    let t = _mm512_fmadd_ps(xc, _mm512_set1_ps(std::f32::consts::LOG2_E), _mm512_set1_ps(SHIFTER));
    let n = _mm512_sub_ps(t, _mm512_set1_ps(SHIFTER));
    // `-n`: the sign bit flipped, as the scalar negation does.
    let neg_n = _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(n), _mm512_set1_epi32(i32::MIN)));
    let r = _mm512_fmadd_ps(neg_n, _mm512_set1_ps(LN2_LO), _mm512_fmadd_ps(neg_n, _mm512_set1_ps(LN2_HI), xc));
    let mut p = _mm512_set1_ps(1.0 / 5040.0);
    for c in [1.0 / 720.0, 1.0 / 120.0, 1.0 / 24.0, 1.0 / 6.0, 0.5, 1.0, 1.0] {
        p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
    }
    let bits = _mm512_add_epi32(_mm512_castps_si512(t), _mm512_set1_epi32(127 - 0x4b40_0000));
    let scale = _mm512_castsi512_ps(_mm512_slli_epi32::<23>(bits));
    let y = _mm512_mul_ps(p, scale);
    let big = _mm512_cmp_ps_mask::<_CMP_GT_OQ>(x, _mm512_set1_ps(88.73));
    let y = _mm512_mask_mov_ps(y, big, _mm512_set1_ps(f32::INFINITY));
    let nan = _mm512_cmp_ps_mask::<_CMP_UNORD_Q>(x, x);
    _mm512_mask_mov_ps(y, nan, x)
}

/// Rows per rayon task for row-wise kernels; small batches stay on one thread.
const ROWS_PER_TASK: usize = 32;

/// `out[t] = x[t] / rms(x[t]) * weight`, row by row (HF's RMSNorm, in f32).
pub fn rms_norm(x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) {
    let h = weight.len();
    debug_assert_eq!(x.len(), out.len());
    let row = |(xr, or): (&[f32], &mut [f32])| norm_into(xr, rms_inverse(xr, eps), weight, or);
    if x.len() / h > ROWS_PER_TASK {
        x.par_chunks(h * ROWS_PER_TASK).zip(out.par_chunks_mut(h * ROWS_PER_TASK)).for_each(|(xs, os)| {
            xs.chunks_exact(h).zip(os.chunks_exact_mut(h)).for_each(row);
        });
    } else {
        x.chunks_exact(h).zip(out.chunks_exact_mut(h)).for_each(row);
    }
}

/// `1 / rms(row)` as [`rms_norm`] scales the row by it.
pub(crate) fn rms_inverse(row: &[f32], eps: f32) -> f32 {
    let ss = sum_squares(row) / row.len() as f32;
    1.0 / (ss + eps).sqrt()
}

/// `out = weight · (x · inv)`: [`rms_norm`]'s scaling of (a slice of) a row.
pub(crate) fn norm_into(x: &[f32], inv: f32, weight: &[f32], out: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if std::is_x86_feature_detected!("avx512f") {
        // SAFETY: the CPU has AVX-512F, checked just above.
        return unsafe { norm_into_avx512(x, inv, weight, out) };
    }
    norm_into_body(x, inv, weight, out)
}

/// [`norm_into`] compiled for AVX-512: the same products, 16 to a register.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn norm_into_avx512(x: &[f32], inv: f32, weight: &[f32], out: &mut [f32]) {
    norm_into_body(x, inv, weight, out)
}

#[inline(always)]
fn norm_into_body(x: &[f32], inv: f32, weight: &[f32], out: &mut [f32]) {
    for ((o, v), w) in out.iter_mut().zip(x).zip(weight) {
        *o = w * (v * inv);
    }
}

/// Lanes of [`sum_squares`] and the softmax: fixed, so the bits do not depend on the ISA.
pub(crate) const LANES: usize = 16;

/// `Σ x²` in a fixed order: value `i` into lane `i mod 16`, then the lanes
/// halving (`i + half` into `i`). A plain serial sum was a 4-cycle chain per
/// value, a few percent of a bf16 run.
pub fn sum_squares(x: &[f32]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if x.len() >= LANES && std::is_x86_feature_detected!("avx512f") {
        // SAFETY: the CPU has AVX-512F, checked just above.
        return unsafe { sum_squares_avx512(x) };
    }
    sum_squares_body(x)
}

/// [`sum_squares`] compiled for AVX-512: the same operations in the same
/// order, sixteen lanes to a register.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn sum_squares_avx512(x: &[f32]) -> f32 {
    sum_squares_body(x)
}

#[inline(always)]
pub(crate) fn sum_squares_body(x: &[f32]) -> f32 {
    let mut lanes = [0f32; LANES];
    let mut chunks = x.chunks_exact(LANES);
    for c in &mut chunks {
        for (l, v) in lanes.iter_mut().zip(c) {
            *l += v * v;
        }
    }
    for (l, v) in lanes.iter_mut().zip(chunks.remainder()) {
        *l += v * v;
    }
    lanes_sum(lanes)
}

/// The sum of 16 lanes in a fixed tree: lane `i + half` into lane `i`,
/// halving, so the bits never depend on the ISA.
#[inline(always)]
pub(crate) fn lanes_sum(mut lanes: [f32; LANES]) -> f32 {
    let mut half = LANES / 2;
    while half > 0 {
        for i in 0..half {
            lanes[i] += lanes[i + half];
        }
        half /= 2;
    }
    lanes[0]
}

/// In place: RMSNorm over each `dim`-wide head of each row (Qwen3's q/k norm).
pub fn rms_norm_heads_inplace(x: &mut [f32], weight: &[f32], eps: f32) {
    let d = weight.len();
    for head in x.chunks_exact_mut(d) {
        let ss = sum_squares(head) / d as f32;
        let inv = 1.0 / (ss + eps).sqrt();
        for (v, w) in head.iter_mut().zip(weight) {
            *v = w * (*v * inv);
        }
    }
}

/// Rotates one head in place, HF's `rotate_half` convention: pairs `(i, i + d/2)`.
#[inline]
pub fn rope_head(head: &mut [f32], cos: &[f32], sin: &[f32]) {
    let half = cos.len();
    let (a, b) = head.split_at_mut(half);
    for (((x1, x2), c), s) in a.iter_mut().zip(b.iter_mut()).zip(cos).zip(&sin[..half]) {
        (*x1, *x2) = (*x1 * c - *x2 * s, *x2 * c + *x1 * s);
    }
}

/// Rotates an interleaved rotary block: pairs `(2i, 2i+1)`, written back as
/// `[evens', odds']` as HF's DeepSeek does. `tmp` holds at least `x.len()` values.
#[inline]
pub fn rope_interleaved(x: &mut [f32], cos: &[f32], sin: &[f32], tmp: &mut [f32]) {
    let half = cos.len();
    for i in 0..half {
        let (a, b) = (x[2 * i], x[2 * i + 1]);
        tmp[i] = a * cos[i] - b * sin[i];
        tmp[half + i] = b * cos[i] + a * sin[i];
    }
    x.copy_from_slice(&tmp[..2 * half]);
}

/// `gu[t] = [gate | up]` → `out[t] = silu(gate) * up`.
pub fn swiglu(gu: &[f32], inter: usize, out: &mut [f32]) {
    glu_rows(gu, inter, out, swiglu_into)
}

/// `gu[t] = [gate | up]` → `out[t] = act(gate, up)`.
pub fn glu(act: Glu, gu: &[f32], inter: usize, out: &mut [f32]) {
    match act {
        Glu::Silu => glu_rows(gu, inter, out, swiglu_into),
        Glu::GeluTanh => glu_rows(gu, inter, out, gelu_tanh_glu_into),
        Glu::Clamped { alpha, limit } => {
            // Rare (gpt-oss's experts, a few hundred rows each) and not fused: a plain loop.
            for (g, o) in gu.chunks_exact(2 * inter).zip(out.chunks_exact_mut(inter)) {
                let (gate, up) = g.split_at(inter);
                for ((o, &g), &u) in o.iter_mut().zip(gate).zip(up) {
                    let (g, u) = (g.min(limit), u.clamp(-limit, limit));
                    *o = (u + 1.0) * (g / (1.0 + exp(-alpha * g)));
                }
            }
        }
    }
}

/// `out[t] = f(gate, up)` of each row `gu[t] = [gate | up]`, rows in parallel when there are many.
fn glu_rows(gu: &[f32], inter: usize, out: &mut [f32], f: fn(&[f32], &[f32], &mut [f32])) {
    let row = |(g, o): (&[f32], &mut [f32])| {
        let (gate, up) = g.split_at(inter);
        f(gate, up, o)
    };
    if out.len() / inter > ROWS_PER_TASK {
        gu.par_chunks(2 * inter * ROWS_PER_TASK)
            .zip(out.par_chunks_mut(inter * ROWS_PER_TASK))
            .for_each(|(g, o)| g.chunks_exact(2 * inter).zip(o.chunks_exact_mut(inter)).for_each(row));
    } else {
        gu.chunks_exact(2 * inter).zip(out.chunks_exact_mut(inter)).for_each(row);
    }
}

/// `out = silu(gate) · up`, element by element: any part of a row gives
/// the bits [`swiglu`] gives it.
pub fn swiglu_into(gate: &[f32], up: &[f32], out: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    {
        if std::is_x86_feature_detected!("avx512f") {
            // SAFETY: the CPU has AVX-512F, checked just above.
            return unsafe { swiglu_row_avx512(gate, up, out) };
        }
        if std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma") {
            // SAFETY: the CPU has AVX2 and FMA, checked just above.
            return unsafe { swiglu_row_avx2(gate, up, out) };
        }
    }
    swiglu_row(gate, up, out)
}

/// One row of [`swiglu`]: element by element, so every ISA gives the same bits.
#[inline(always)]
fn swiglu_row(gate: &[f32], up: &[f32], out: &mut [f32]) {
    for ((o, g), u) in out.iter_mut().zip(gate).zip(up) {
        *o = g / (1.0 + exp(-g)) * u;
    }
}

/// [`swiglu_row`] compiled for AVX-512 (sixteen lanes; the same bits).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn swiglu_row_avx512(gate: &[f32], up: &[f32], out: &mut [f32]) {
    swiglu_row(gate, up, out)
}

/// [`swiglu_row`] compiled for AVX2 and FMA (eight lanes; the same bits).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn swiglu_row_avx2(gate: &[f32], up: &[f32], out: &mut [f32]) {
    swiglu_row(gate, up, out)
}

/// `out = gelu_tanh(gate) · up`, element by element (the same bits on every
/// ISA, any part of a row as the whole). `g/2 · (1 + tanh(u))` is computed as
/// `g · σ(2u)`, the same function, through the [`exp`] SwiGLU uses.
pub fn gelu_tanh_glu_into(gate: &[f32], up: &[f32], out: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    {
        if std::is_x86_feature_detected!("avx512f") {
            // SAFETY: the CPU has AVX-512F, checked just above.
            return unsafe { gelu_tanh_glu_row_avx512(gate, up, out) };
        }
        if std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma") {
            // SAFETY: the CPU has AVX2 and FMA, checked just above.
            return unsafe { gelu_tanh_glu_row_avx2(gate, up, out) };
        }
    }
    gelu_tanh_glu_row(gate, up, out)
}

/// √(2/π), GELU's tanh approximation's factor.
const SQRT_2_OVER_PI: f32 = 0.797_884_6;

/// One row of [`gelu_tanh_glu_into`].
#[inline(always)]
fn gelu_tanh_glu_row(gate: &[f32], up: &[f32], out: &mut [f32]) {
    for ((o, &g), u) in out.iter_mut().zip(gate).zip(up) {
        let inner = SQRT_2_OVER_PI * (g + 0.044715 * g * g * g);
        *o = g / (1.0 + exp(-2.0 * inner)) * u;
    }
}

/// [`gelu_tanh_glu_row`] compiled for AVX-512 (the same bits).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn gelu_tanh_glu_row_avx512(gate: &[f32], up: &[f32], out: &mut [f32]) {
    gelu_tanh_glu_row(gate, up, out)
}

/// [`gelu_tanh_glu_row`] compiled for AVX2 and FMA (the same bits).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn gelu_tanh_glu_row_avx2(gate: &[f32], up: &[f32], out: &mut [f32]) {
    gelu_tanh_glu_row(gate, up, out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_glu_matches_its_definition() {
        let gu: Vec<f32> = (0..64).map(|i| (i as f32 - 32.0) * 0.4).collect(); // gate | up, ±12.8
        for act in [Glu::Silu, Glu::GeluTanh, Glu::Clamped { alpha: 1.702, limit: 7.0 }] {
            let mut out = vec![0f32; 32];
            glu(act, &gu, 32, &mut out);
            for (i, o) in out.iter().enumerate() {
                let want = act.apply(gu[i], gu[32 + i]);
                assert!((o - want).abs() <= 1e-5 * want.abs().max(1.0), "{act:?}[{i}]: {o} vs {want}");
            }
        }
        // The clamps: gate from above only, up on both sides.
        let c = Glu::Clamped { alpha: 1.702, limit: 7.0 };
        assert_eq!(c.apply(9.0, 9.0), c.apply(7.0, 7.0));
        assert_eq!(c.apply(1.0, -9.0), c.apply(1.0, -7.0));
        assert!(c.apply(-9.0, 0.0) != c.apply(-7.0, 0.0));
    }

    #[test]
    fn gelu_tanh_matches_the_tanh_form() {
        // PyTorch's formula, in f64, against the sigmoid form in f32.
        let gate: Vec<f32> = (-40..=40).map(|i| i as f32 * 0.25).collect();
        let up = vec![1.5f32; gate.len()];
        let mut out = vec![0f32; gate.len()];
        gelu_tanh_glu_into(&gate, &up, &mut out);
        for (&g, &o) in gate.iter().zip(&out) {
            let g64 = g as f64;
            let want =
                0.5 * g64 * (1.0 + ((2.0 / std::f64::consts::PI).sqrt() * (g64 + 0.044715 * g64.powi(3))).tanh());
            assert!(
                (o as f64 - 1.5 * want).abs() <= 1e-6 * (1.0 + want.abs()),
                "gelu_tanh({g}) = {o}, want {}",
                1.5 * want
            );
        }
    }

    #[test]
    fn rms_norm_unit_rows() {
        let x = [3.0f32, 4.0, 0.0, 0.0];
        let mut out = [0f32; 4];
        rms_norm(&x, &[1.0, 2.0], 0.0, &mut out);
        let r = (12.5f32).sqrt();
        assert!((out[0] - 3.0 / r).abs() < 1e-6 && (out[1] - 8.0 / r).abs() < 1e-6);
        assert!(out[2] == 0.0 || out[2].is_nan()); // 0/0 with eps 0; real eps avoids it
    }

    #[test]
    fn sum_squares_is_fixed_order_on_every_isa() {
        for len in [1, 15, 16, 17, 100, 1024] {
            let x: Vec<f32> = (0..len).map(|i| ((i * 37 % 23) as f32 - 11.0) * 0.37).collect();
            let got = sum_squares(&x);
            assert_eq!(got.to_bits(), sum_squares_body(&x).to_bits(), "len {len}");
            let mut lanes = [0f32; LANES];
            for (i, v) in x.iter().enumerate() {
                lanes[i % LANES] += v * v;
            }
            let mut tree = lanes.to_vec();
            while tree.len() > 1 {
                let half = tree.len() / 2;
                tree = (0..half).map(|i| tree[i] + tree[i + half]).collect();
            }
            assert_eq!(got.to_bits(), tree[0].to_bits(), "len {len}");
            let exact: f64 = x.iter().map(|&v| v as f64 * v as f64).sum();
            assert!((got as f64 - exact).abs() <= 1e-6 * exact, "len {len}");
        }
    }

    #[test]
    fn rope_is_rotation() {
        let mut h = [1.0f32, 0.0, 0.0, 1.0];
        let (c, s) = ([0.0f32, 1.0], [1.0f32, 0.0]);
        rope_head(&mut h, &c, &s);
        assert_eq!(h, [0.0, 0.0, 1.0, 1.0]);
    }

    #[test]
    fn exp_is_within_two_ulp() {
        let mut worst = 0f64;
        for i in 0..=2_000_000 {
            let x = -87.0 + 175.0 * i as f32 / 2_000_000.0;
            let (got, want) = (exp(x) as f64, (x as f64).exp());
            worst = worst.max((got - want).abs() / want);
        }
        assert!(worst < 2.0 * f32::EPSILON as f64, "worst relative error {worst:e}");
        assert_eq!(exp(0.0), 1.0);
        assert!(exp(f32::NAN).is_nan());
        assert_eq!(exp(f32::NEG_INFINITY), exp(-87.0));
        assert!(exp(-87.0) < 1e-37 && exp(f32::INFINITY) == f32::INFINITY && exp(88.7).is_finite());
    }

    #[test]
    #[cfg(target_arch = "x86_64")]
    fn exp16_has_the_bits_of_exp_in_every_lane() {
        if !std::is_x86_feature_detected!("avx512f") {
            eprintln!("skipped: this CPU has no AVX-512F");
            return;
        }
        let mut xs: Vec<f32> = (0..=200_000).map(|i| -100.0 + 200.0 * i as f32 / 200_000.0).collect();
        xs.extend([
            0.0,
            -0.0,
            88.72,
            88.73,
            88.74,
            -87.0,
            -87.5,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::NAN,
            1e-40,
            -1e-40,
        ]);
        xs.resize(xs.len().next_multiple_of(16), 1.0);
        for chunk in xs.chunks_exact(16) {
            let mut got = [0f32; 16];
            // SAFETY: AVX-512F checked above.
            unsafe {
                use std::arch::x86_64::*;
                #[target_feature(enable = "avx512f")]
                unsafe fn run(x: &[f32], out: &mut [f32; 16]) {
                    _mm512_storeu_ps(out.as_mut_ptr(), exp16(_mm512_loadu_ps(x.as_ptr())));
                }
                run(chunk, &mut got);
            }
            for (x, g) in chunk.iter().zip(got) {
                assert_eq!(g.to_bits(), exp(*x).to_bits(), "exp({x:e}): {g:e} vs {:e}", exp(*x));
            }
        }
    }

    #[test]
    fn swiglu_rows_agree_bitwise_across_isas() {
        let gate: Vec<f32> = (0..100).map(|i| (i as f32 - 50.0) * 0.37).collect();
        let up: Vec<f32> = (0..100).map(|i| (i as f32) * 0.11 - 4.0).collect();
        let (mut a, mut b) = (vec![0f32; 100], vec![0f32; 100]);
        swiglu_row(&gate, &up, &mut a);
        #[cfg(target_arch = "x86_64")]
        if std::is_x86_feature_detected!("avx512f") {
            unsafe { swiglu_row_avx512(&gate, &up, &mut b) };
            assert!(a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits()));
        }
    }

    #[test]
    fn swiglu_values() {
        let gu = [0.0f32, 1.0, 2.0, 3.0];
        let mut out = [0f32; 2];
        swiglu(&gu, 2, &mut out);
        assert_eq!(out[0], 0.0);
        assert!((out[1] - 1.0 / (1.0 + (-1f32).exp()) * 3.0).abs() < 1e-6);
    }
}
