//! The f32 path: A packed as f32 `[strip][kc][MR]` strips, B as f32
//! panels (or tiles a panel source decodes to f32), and the micro-kernels
//! over them: AVX-512, AVX2 (with FMA) or portable, chosen at run time. All
//! three run the same k-ordered chains of fused multiply-adds: the same bits.

use super::{gemm_tiles, kernel_from_fields, pack_strips, ARows, Init, Path, TileInit};
use crate::backend::cpu::panels::{pack_b, InPlace, MR, NR};

/// The f32 path: A packed as f32 `[strip][kc][MR]`, the kernel this CPU runs best.
#[derive(Clone, Copy)]
pub(crate) struct F32Path {
    kernel: Kernel,
    name: &'static str,
}

impl F32Path {
    /// The fastest f32 kernel this CPU has.
    pub(crate) fn detect() -> Self {
        #[cfg(target_arch = "x86_64")]
        {
            if std::is_x86_feature_detected!("avx512f") {
                return F32Path { kernel: avx512::kernel, name: "avx512" };
            }
            if std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma") {
                return F32Path { kernel: avx2::kernel, name: "avx2" };
            }
        }
        F32Path { kernel: portable::kernel, name: "portable" }
    }

    /// Every f32 kernel this CPU can run (the tests compare them).
    #[cfg(test)]
    pub(crate) fn available() -> Vec<Self> {
        let mut v = vec![F32Path { kernel: portable::kernel, name: "portable" }];
        #[cfg(target_arch = "x86_64")]
        {
            if std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma") {
                v.push(F32Path { kernel: avx2::kernel, name: "avx2" });
            }
            if std::is_x86_feature_detected!("avx512f") {
                v.push(F32Path { kernel: avx512::kernel, name: "avx512" });
            }
        }
        v
    }
}

impl Path for F32Path {
    type A = f32;
    type B = f32;
    const STEP: usize = 1;

    fn pack_a(self, a: &[f32], lda: usize, i0: usize, rows: usize, p0: usize, kc: usize, out: &mut Vec<f32>) {
        #[cfg(target_arch = "x86_64")]
        if std::is_x86_feature_detected!("avx2") {
            // SAFETY: the CPU has AVX2, checked just above (the answer is cached).
            return unsafe { avx2::pack_a(a, lda, i0, rows, p0, kc, out) };
        }
        pack_strips(a, lda, i0, rows, p0, kc, 1, out, |p, r| p * MR + r, |v| v);
    }

    fn pack_b(self, src: &[f32], n: usize, k: usize, rs: usize, cs: usize, out: &mut Vec<f32>) {
        pack_b(src, n, k, rs, cs, out)
    }

    kernel_from_fields!();
}

/// Single-threaded f32 GEMM on packed B: rows `[0, m)` of A (`m × k`, stride `lda`)
/// times the panels `[panel0, panel1)` of `b` (packed by [`pack_b`] with the same `k`),
/// into C (`ldc` stride; column `j` of panel `p` is `C[.., p*NR + j]`), for `n` valid columns.
#[allow(clippy::too_many_arguments)]
pub fn gemm_packed(
    a: &[f32],
    lda: usize,
    m: usize,
    k: usize,
    b: &[f32],
    n: usize,
    panels: std::ops::Range<usize>,
    c: &mut [f32],
    ldc: usize,
    init: Init,
    apack: &mut Vec<f32>,
) {
    assert!(m == 0 || a.len() >= (m - 1) * lda + k, "gemm: A too short");
    assert!(b.len() >= n.div_ceil(NR) * k * NR, "gemm: B too short");
    let last_col = (panels.end * NR).min(n);
    assert!(m == 0 || c.len() >= (m - 1) * ldc + last_col, "gemm: C too short");
    // SAFETY: bounds of A, B and C are checked above; the kernel writes only
    // rows < m and columns < n of C.
    unsafe {
        let b = InPlace { ptr: b.as_ptr(), kpad: k };
        gemm_tiles(
            F32Path::detect(),
            ARows::Plain(a, lda),
            m,
            k,
            &b,
            n,
            panels,
            c.as_mut_ptr(),
            ldc,
            init,
            apack,
            &mut Vec::new(),
        )
    }
}

type Kernel = unsafe fn(usize, *const f32, *const f32, *mut f32, usize, usize, usize, TileInit);

#[cfg(target_arch = "x86_64")]
pub(crate) mod avx512 {
    use super::{TileInit, MR, NR};
    use std::arch::x86_64::*;

    #[allow(clippy::too_many_arguments)]
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn kernel(
        kc: usize,
        a: *const f32,
        b: *const f32,
        c: *mut f32,
        ldc: usize,
        rows: usize,
        cols: usize,
        init: TileInit,
    ) {
        let mut acc = [[_mm512_setzero_ps(); 2]; MR];
        let mut ap = a;
        let mut bp = b;
        for _ in 0..kc {
            let b0 = _mm512_loadu_ps(bp);
            let b1 = _mm512_loadu_ps(bp.add(16));
            for (r, row) in acc.iter_mut().enumerate() {
                let av = _mm512_set1_ps(*ap.add(r));
                row[0] = _mm512_fmadd_ps(av, b0, row[0]);
                row[1] = _mm512_fmadd_ps(av, b1, row[1]);
            }
            ap = ap.add(MR);
            bp = bp.add(NR);
        }
        // A copy goes to `store`, so `acc` itself never has an address and
        // stays in registers: when it did, every call began by zeroing its
        // 1.5 KiB stack image (a `memset`, 2% of a dense f32 run).
        let out = acc;
        store(&out, c, ldc, rows, cols, init)
    }

    /// Adds a finished `MR × NR` accumulator tile onto its start value and
    /// stores the valid `rows × cols` of it (shared with the bf16 kernels).
    #[inline]
    #[target_feature(enable = "avx512f")]
    pub(crate) unsafe fn store(acc: &[[__m512; 2]], c: *mut f32, ldc: usize, rows: usize, cols: usize, init: TileInit) {
        let m0: __mmask16 = if cols >= 16 { 0xffff } else { (1u32 << cols) as u16 - 1 };
        let m1: __mmask16 = if cols >= 32 {
            0xffff
        } else if cols > 16 {
            (1u32 << (cols - 16)) as u16 - 1
        } else {
            0
        };
        let (base0, base1) = match init {
            TileInit::Bias(bias) => (_mm512_maskz_loadu_ps(m0, bias), _mm512_maskz_loadu_ps(m1, bias.add(16))),
            _ => (_mm512_setzero_ps(), _mm512_setzero_ps()),
        };
        for (r, row) in acc.iter().enumerate().take(rows) {
            let cp = c.add(r * ldc);
            let (v0, v1) = match init {
                TileInit::Load => (
                    _mm512_add_ps(_mm512_maskz_loadu_ps(m0, cp), row[0]),
                    _mm512_add_ps(_mm512_maskz_loadu_ps(m1, cp.add(16)), row[1]),
                ),
                _ => (_mm512_add_ps(base0, row[0]), _mm512_add_ps(base1, row[1])),
            };
            _mm512_mask_storeu_ps(cp, m0, v0);
            _mm512_mask_storeu_ps(cp.add(16), m1, v1);
        }
    }
}

mod portable {
    use super::{TileInit, MR, NR};

    /// The register tile. Without AVX-512 it does not fit in registers and
    /// lives partly on the stack: aligned to a cache line, no vector access
    /// to it is split across two lines, whatever the caller's stack depth
    /// (unaligned, the AVX2 kernel ran ~9% slower from some call paths).
    #[repr(C, align(64))]
    struct Tile([[f32; NR]; MR]);

    #[allow(clippy::too_many_arguments)]
    #[inline(always)]
    unsafe fn body(
        kc: usize,
        a: *const f32,
        b: *const f32,
        c: *mut f32,
        ldc: usize,
        rows: usize,
        cols: usize,
        init: TileInit,
    ) {
        let mut tile = Tile([[0f32; NR]; MR]);
        let acc = &mut tile.0;
        for p in 0..kc {
            let bv = std::slice::from_raw_parts(b.add(p * NR), NR);
            let av = std::slice::from_raw_parts(a.add(p * MR), MR);
            for r in 0..MR {
                for j in 0..NR {
                    // A fused multiply-add, as the vector kernels do: every path gives the same bits.
                    acc[r][j] = av[r].mul_add(bv[j], acc[r][j]);
                }
            }
        }
        for (r, row) in acc.iter().enumerate().take(rows) {
            for (j, v) in row.iter().enumerate().take(cols) {
                let dst = c.add(r * ldc + j);
                *dst = match init {
                    TileInit::Zero => *v,
                    TileInit::Bias(bias) => *bias.add(j) + *v,
                    TileInit::Load => *dst + *v,
                };
            }
        }
    }

    #[allow(clippy::too_many_arguments)]
    pub(super) unsafe fn kernel(
        kc: usize,
        a: *const f32,
        b: *const f32,
        c: *mut f32,
        ldc: usize,
        rows: usize,
        cols: usize,
        init: TileInit,
    ) {
        body(kc, a, b, c, ldc, rows, cols, init)
    }
}

#[cfg(target_arch = "x86_64")]
pub(crate) mod avx2 {
    use super::{TileInit, MR, NR};
    use std::arch::x86_64::*;

    /// Rows and columns of one register sub-tile: 6 × 16 floats are twelve
    /// accumulators, which with two B vectors and an A broadcast fit AVX2's
    /// sixteen registers (BLIS' Haswell shape). The `MR × NR` tile is four of them.
    pub(crate) const SR: usize = 6;
    pub(crate) const SC: usize = 16;

    /// Twelve accumulators: `SR` rows of two 8-lane vectors.
    pub(crate) type Acc = [[__m256; 2]; SR];

    /// Runs `sub(r0, c0, rows, cols)` over the `SR × SC` blocks of a `rows × cols` tile.
    #[inline(always)]
    pub(crate) fn blocks(rows: usize, cols: usize, mut sub: impl FnMut(usize, usize, usize, usize)) {
        // Columns outer: both row blocks read one half of the B tile while it is in L1.
        for c0 in (0..cols).step_by(SC) {
            for r0 in (0..rows).step_by(SR) {
                sub(r0, c0, (rows - r0).min(SR), (cols - c0).min(SC));
            }
        }
    }

    #[allow(clippy::too_many_arguments)]
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn kernel(
        kc: usize,
        a: *const f32,
        b: *const f32,
        c: *mut f32,
        ldc: usize,
        rows: usize,
        cols: usize,
        init: TileInit,
    ) {
        blocks(rows, cols, |r0, c0, r, n| {
            let acc = sub_tile(kc, a.add(r0), b.add(c0));
            store(&acc, c.add(r0 * ldc + c0), ldc, r, n, init, c0);
        });
    }

    /// One `SR × SC` block at row offset `a` of the A strip (`[kc][MR]`) and
    /// column offset `b` of the B tile (`[kc][NR]`): each element is the
    /// k-ordered FMA chain the AVX-512 kernel computes, so both give the same bits.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn sub_tile(kc: usize, a: *const f32, b: *const f32) -> Acc {
        let mut acc = [[_mm256_setzero_ps(); 2]; SR];
        let (mut ap, mut bp) = (a, b);
        for _ in 0..kc {
            let b0 = _mm256_loadu_ps(bp);
            let b1 = _mm256_loadu_ps(bp.add(8));
            for (r, row) in acc.iter_mut().enumerate() {
                let av = _mm256_broadcast_ss(&*ap.add(r));
                row[0] = _mm256_fmadd_ps(av, b0, row[0]);
                row[1] = _mm256_fmadd_ps(av, b1, row[1]);
            }
            ap = ap.add(MR);
            bp = bp.add(NR);
        }
        acc
    }

    /// [`super::pack_strips`]'s f32 `[kc][MR]` strips, four rows × eight
    /// depths at a time through registers (a 4 × 8 transpose) where a strip
    /// is whole; the same values in the same places.
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn pack_a(
        a: &[f32],
        lda: usize,
        i0: usize,
        rows: usize,
        p0: usize,
        kc: usize,
        out: &mut Vec<f32>,
    ) {
        let base = out.len();
        let strips = rows.div_ceil(MR);
        let kc8 = kc / 8 * 8;
        if kc8 == 0 || rows < MR {
            return super::pack_strips(a, lda, i0, rows, p0, kc, 1, out, |p, r| p * MR + r, |v| v);
        }
        out.resize(base + strips * kc * MR, 0.0);
        for s in 0..strips {
            let r0 = s * MR;
            let n = MR.min(rows - r0);
            let strip = &mut out[base + s * kc * MR..][..kc * MR];
            // Rows as slices: the bounds are checked once here, not per load.
            let row = |r: usize| &a[(i0 + r0 + r) * lda + p0..][..kc];
            if n == MR {
                let dst = strip.as_mut_ptr();
                for g in 0..MR / 4 {
                    let rs = [row(4 * g), row(4 * g + 1), row(4 * g + 2), row(4 * g + 3)];
                    for p in (0..kc8).step_by(8) {
                        // Not `array::from_fn`/`map`: closures do not inherit AVX2.
                        let v = [
                            _mm256_loadu_ps(rs[0].as_ptr().add(p)),
                            _mm256_loadu_ps(rs[1].as_ptr().add(p)),
                            _mm256_loadu_ps(rs[2].as_ptr().add(p)),
                            _mm256_loadu_ps(rs[3].as_ptr().add(p)),
                        ];
                        let t0 = _mm256_unpacklo_ps(v[0], v[1]);
                        let t1 = _mm256_unpackhi_ps(v[0], v[1]);
                        let t2 = _mm256_unpacklo_ps(v[2], v[3]);
                        let t3 = _mm256_unpackhi_ps(v[2], v[3]);
                        // Depths q (low lane) and q + 4 (high lane) of the four rows.
                        let u = [
                            _mm256_shuffle_ps::<0x44>(t0, t2),
                            _mm256_shuffle_ps::<0xEE>(t0, t2),
                            _mm256_shuffle_ps::<0x44>(t1, t3),
                            _mm256_shuffle_ps::<0xEE>(t1, t3),
                        ];
                        for (q, u) in u.into_iter().enumerate() {
                            _mm_storeu_ps(dst.add((p + q) * MR + 4 * g), _mm256_castps256_ps128(u));
                            _mm_storeu_ps(dst.add((p + q + 4) * MR + 4 * g), _mm256_extractf128_ps::<1>(u));
                        }
                    }
                }
                for r in 0..MR {
                    for (p, v) in row(r).iter().enumerate().skip(kc8) {
                        strip[p * MR + r] = *v;
                    }
                }
            } else {
                for r in 0..n {
                    for (p, v) in row(r).iter().enumerate() {
                        strip[p * MR + r] = *v;
                    }
                }
            }
        }
    }

    /// Adds a finished sub-tile onto its start value (`c0`: its first column
    /// within the tile, for the bias) and stores its valid `rows × cols`.
    #[inline(always)]
    pub(crate) unsafe fn store(
        acc: &Acc,
        c: *mut f32,
        ldc: usize,
        rows: usize,
        cols: usize,
        init: TileInit,
        c0: usize,
    ) {
        if rows == SR && cols == SC {
            for (r, row) in acc.iter().enumerate() {
                let cp = c.add(r * ldc);
                let (v0, v1) = match init {
                    TileInit::Zero => (row[0], row[1]),
                    TileInit::Bias(bias) => (
                        _mm256_add_ps(_mm256_loadu_ps(bias.add(c0)), row[0]),
                        _mm256_add_ps(_mm256_loadu_ps(bias.add(c0 + 8)), row[1]),
                    ),
                    TileInit::Load => {
                        (_mm256_add_ps(_mm256_loadu_ps(cp), row[0]), _mm256_add_ps(_mm256_loadu_ps(cp.add(8)), row[1]))
                    }
                };
                _mm256_storeu_ps(cp, v0);
                _mm256_storeu_ps(cp.add(8), v1);
            }
            return;
        }
        // An edge block: through a buffer, only the valid part stored.
        let mut buf = [0f32; SC];
        for (r, row) in acc.iter().enumerate().take(rows) {
            _mm256_storeu_ps(buf.as_mut_ptr(), row[0]);
            _mm256_storeu_ps(buf.as_mut_ptr().add(8), row[1]);
            for (j, v) in buf.iter().enumerate().take(cols) {
                let dst = c.add(r * ldc + j);
                *dst = match init {
                    TileInit::Zero => *v,
                    TileInit::Bias(bias) => *bias.add(c0 + j) + *v,
                    TileInit::Load => *dst + *v,
                };
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::rand;
    use super::*;

    #[test]
    fn vector_a_packing_equals_the_plain_one() {
        #[cfg(target_arch = "x86_64")]
        if std::is_x86_feature_detected!("avx2") {
            let (lda, total) = (301, 60);
            let a = rand(lda * total, 7);
            for (i0, rows, p0, kc) in
                [(0, 12, 0, 128), (5, 50, 3, 128), (1, 37, 17, 101), (2, 11, 0, 64), (0, 24, 40, 7)]
            {
                let (mut want, mut got) = (vec![1.5f32], vec![1.5f32]);
                pack_strips(&a, lda, i0, rows, p0, kc, 1, &mut want, |p, r| p * MR + r, |v| v);
                unsafe { avx2::pack_a(&a, lda, i0, rows, p0, kc, &mut got) };
                assert_eq!(got, want, "rows {i0}+{rows}, depths {p0}+{kc}");
            }
        }
    }

    /// Every f32 kernel this CPU has runs the same FMA chains: the same bits.
    #[test]
    fn every_f32_path_gives_the_same_bits() {
        let paths = F32Path::available();
        println!("f32 paths on this CPU: {:?}", paths.iter().map(|p| p.name()).collect::<Vec<_>>());
        for &(m, n, k) in &[(13, 33, 7), (121, 70, 1300), (6, 16, 5)] {
            let (x, w, b) = (rand(m * k, 1), rand(n * k, 2), rand(n, 3));
            let mut panels = Vec::new();
            pack_b(&w, n, k, k, 1, &mut panels);
            let src = InPlace { ptr: panels.as_ptr(), kpad: k };
            let outs: Vec<Vec<f32>> = paths
                .iter()
                .map(|&path| {
                    let mut y = vec![f32::NAN; m * n];
                    // SAFETY: y holds m × n floats; the panels were packed for n × k.
                    unsafe {
                        let (mut ap, mut bb) = (Vec::new(), Vec::new());
                        let panels = 0..n.div_ceil(NR);
                        gemm_tiles(
                            path,
                            ARows::Plain(&x, k),
                            m,
                            k,
                            &src,
                            n,
                            panels,
                            y.as_mut_ptr(),
                            n,
                            Init::Bias(&b),
                            &mut ap,
                            &mut bb,
                        );
                    }
                    y
                })
                .collect();
            for (p, y) in paths.iter().zip(&outs).skip(1) {
                assert!(y.iter().zip(&outs[0]).all(|(a, b)| a.to_bits() == b.to_bits()), "{} m{m} n{n} k{k}", p.name());
            }
        }
    }
}
