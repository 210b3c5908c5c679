//! f32 GEMM `C = A · Bᵀ` with B packed once (weights are packed at load time).
//!
//! Goto/BLIS blocking: B in `NR`-wide column panels laid out `[k][NR]`, A
//! packed per `MC × KC` block into `MR`-row strips, an `MR × NR` register
//! tile per micro-kernel call. The micro-kernel uses AVX-512 when the CPU has
//! it (checked at run time) and a portable one otherwise.
//!
//! Every element of C is reduced in the same order (KC blocks in sequence,
//! k in sequence inside a block) wherever its row sits in the batch and
//! however the work is split across threads, so results do not depend on
//! how samples were packed together.

use super::panels::{pack_b, F32Panels, PanelSource, KC, MR, NR};
use super::quant_panels::QuantPanels;
use super::SharedMut;
use crate::hf::quant::{LinearWeight, QuantKind};
use rayon::prelude::*;

/// How a GEMM call starts its accumulators.
#[derive(Clone, Copy, Debug)]
pub enum Init<'a> {
    /// `C = A·Bᵀ`.
    Zero,
    /// `C = A·Bᵀ + bias` (bias per column).
    Bias(&'a [f32]),
    /// `C += A·Bᵀ`.
    Accumulate,
}

/// Packs rows `[i0, i0+rows)` × cols `[p0, p0+kc)` of A (row stride `lda`) into
/// `MR`-row strips `[strip][kc][MR]`, zero-padding the last strip.
fn pack_a(a: &[f32], lda: usize, i0: usize, rows: usize, p0: usize, kc: usize, out: &mut Vec<f32>) {
    let strips = rows.div_ceil(MR);
    out.clear();
    out.resize(strips * kc * MR, 0.0);
    for (s, strip) in out.chunks_exact_mut(kc * MR).enumerate() {
        let r0 = s * MR;
        for r in 0..MR.min(rows - r0) {
            let row = &a[(i0 + r0 + r) * lda + p0..(i0 + r0 + r) * lda + p0 + kc];
            for (p, v) in row.iter().enumerate() {
                strip[p * MR + r] = *v;
            }
        }
    }
}

/// Single-threaded GEMM on packed B: rows `[0, m)` of A (`m × k`, stride `lda`)
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
    unsafe { gemm_raw(a, lda, m, k, b.as_ptr(), n, panels, c.as_mut_ptr(), ldc, init, apack) }
}

/// [`gemm_packed`] writing through a raw pointer, for callers whose tasks
/// write disjoint tiles of one output buffer.
///
/// # Safety
/// `c` must be valid for writes at `i * ldc + j` for `i < m` and the columns
/// `j < n` of `panels`; `b` must hold `ceil(n/NR) * k * NR` floats; no other
/// thread may touch those elements during the call.
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn gemm_raw(
    a: &[f32],
    lda: usize,
    m: usize,
    k: usize,
    b: *const f32,
    n: usize,
    panels: std::ops::Range<usize>,
    c: *mut f32,
    ldc: usize,
    init: Init,
    apack: &mut Vec<f32>,
) {
    gemm_tiles(a, lda, m, k, &F32Panels(b), n, panels, c, ldc, init, apack, &mut Vec::new())
}

/// The blocked GEMM loop over any panel source (see [`gemm_raw`] for the contract).
#[allow(clippy::too_many_arguments)]
unsafe fn gemm_tiles<B: PanelSource>(
    a: &[f32],
    lda: usize,
    m: usize,
    k: usize,
    b: &B,
    n: usize,
    panels: std::ops::Range<usize>,
    c: *mut f32,
    ldc: usize,
    init: Init,
    apack: &mut Vec<f32>,
    bbuf: &mut Vec<f32>,
) {
    let kern = kernel();
    if k == 0 {
        // Degenerate: C is just its initial value.
        for i in 0..m {
            for j in panels.start * NR..(panels.end * NR).min(n) {
                let dst = c.add(i * ldc + j);
                match init {
                    Init::Zero => *dst = 0.0,
                    Init::Bias(bias) => *dst = bias[j],
                    Init::Accumulate => {}
                }
            }
        }
        return;
    }
    let mut i0 = 0;
    while i0 < m {
        let mc = B::MC.min(m - i0);
        let mut p0 = 0;
        while p0 < k {
            let kc = KC.min(k - p0);
            pack_a(a, lda, i0, mc, p0, kc, apack);
            let first = p0 == 0;
            for pi in panels.clone() {
                let j0 = pi * NR;
                let cols = NR.min(n - j0);
                let bp = b.tile(pi, p0, kc, k, bbuf);
                let tile_init = match (first, init) {
                    (true, Init::Zero) => TileInit::Zero,
                    (true, Init::Bias(bias)) => TileInit::Bias(bias.as_ptr().add(j0)),
                    _ => TileInit::Load,
                };
                for s in 0..mc.div_ceil(MR) {
                    let rows = MR.min(mc - s * MR);
                    let ap = apack.as_ptr().add(s * kc * MR);
                    let cp = c.add((i0 + s * MR) * ldc + j0);
                    kern(kc, ap, bp, cp, ldc, rows, cols, tile_init);
                }
            }
            p0 += kc;
        }
        i0 += mc;
    }
}

#[derive(Clone, Copy)]
enum TileInit {
    Zero,
    Bias(*const f32),
    Load,
}

type Kernel = unsafe fn(usize, *const f32, *const f32, *mut f32, usize, usize, usize, TileInit);

fn kernel() -> Kernel {
    #[cfg(target_arch = "x86_64")]
    {
        if std::is_x86_feature_detected!("avx512f") {
            return avx512::kernel;
        }
        if std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma") {
            return portable::kernel_avx2;
        }
    }
    portable::kernel
}

/// Name of the micro-kernel this CPU runs (for logs and bench reports).
pub fn kernel_name() -> &'static str {
    #[cfg(target_arch = "x86_64")]
    {
        if std::is_x86_feature_detected!("avx512f") {
            return "avx512";
        }
        if std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma") {
            return "avx2";
        }
    }
    "portable"
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
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
                    acc[r][j] += av[r] * bv[j];
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

    #[cfg(target_arch = "x86_64")]
    #[allow(clippy::too_many_arguments)]
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn kernel_avx2(
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

/// A linear layer's packed weight: f32 panels, or quantised ones decoded per tile.
enum Panels {
    F32(Vec<f32>),
    Quant(QuantPanels),
}

/// A linear layer `y = x · Wᵀ (+ b)` with `W: [out, in]` packed at load time.
/// Quantised weights stay quantised and are decoded tile by tile in the GEMM.
pub struct PackedLinear {
    out_features: usize,
    in_features: usize,
    panels: Panels,
    bias: Option<Vec<f32>>,
}

impl PackedLinear {
    /// Packs `W` (`[out, in]`, row-major) and an optional bias `[out]`.
    pub fn new(w: &[f32], out_features: usize, in_features: usize, bias: Option<Vec<f32>>) -> Self {
        assert_eq!(w.len(), out_features * in_features, "PackedLinear: weight size");
        let mut panels = Vec::new();
        pack_b(w, out_features, in_features, in_features, 1, &mut panels);
        Self::with_panels(Panels::F32(panels), out_features, in_features, bias)
    }

    /// Packs a weight as read from a checkpoint, keeping quantised codes.
    pub fn from_weight(w: LinearWeight, bias: Option<Vec<f32>>) -> Self {
        match w {
            LinearWeight::Dense { rows, cols, w } => Self::new(&w, rows, cols, bias),
            LinearWeight::Quant(q) => Self::with_panels(Panels::Quant(QuantPanels::pack(&q)), q.rows, q.cols, bias),
        }
    }

    fn with_panels(panels: Panels, out_features: usize, in_features: usize, bias: Option<Vec<f32>>) -> Self {
        if let Some(b) = &bias {
            assert_eq!(b.len(), out_features, "PackedLinear: bias size");
        }
        PackedLinear { out_features, in_features, panels, bias }
    }

    /// Output width.
    pub fn out_features(&self) -> usize {
        self.out_features
    }
    /// Input width.
    pub fn in_features(&self) -> usize {
        self.in_features
    }
    /// Whether the weight is held as codes (FP8, INT4 or bf16) rather than f32.
    pub fn is_quantized(&self) -> bool {
        matches!(self.panels, Panels::Quant(_))
    }
    /// The kind of codes the weight is held as; `None` for f32.
    pub fn held_as(&self) -> Option<QuantKind> {
        match &self.panels {
            Panels::F32(_) => None,
            Panels::Quant(q) => Some(q.kind()),
        }
    }
    /// Bytes of memory the weight and bias hold.
    pub fn resident_bytes(&self) -> usize {
        let w = match &self.panels {
            Panels::F32(p) => p.len() * 4,
            Panels::Quant(q) => q.bytes(),
        };
        w + self.bias.as_ref().map_or(0, |b| b.len() * 4)
    }

    /// `y[m, out] = x[m, in] · Wᵀ + b`, or `y += x · Wᵀ` when `accumulate`
    /// (then the bias is added too). Split over rayon by row blocks and column groups.
    pub fn forward(&self, x: &[f32], m: usize, y: &mut [f32], accumulate: bool) {
        match &self.panels {
            Panels::F32(p) => self.run(&F32Panels(p.as_ptr()), x, m, y, accumulate),
            Panels::Quant(q) => self.run(q, x, m, y, accumulate),
        }
    }

    fn run<B: PanelSource + Sync>(&self, b: &B, x: &[f32], m: usize, y: &mut [f32], accumulate: bool) {
        let (n, k) = (self.out_features, self.in_features);
        assert_eq!(x.len(), m * k, "PackedLinear: input size");
        assert_eq!(y.len(), m * n, "PackedLinear: output size");
        let panels = n.div_ceil(NR);
        let row_blocks = m.div_ceil(B::MC).max(1);
        let threads = rayon::current_num_threads();
        // Enough tasks to keep every thread busy, but panels large enough to amortise A packing.
        let col_groups = (2 * threads).div_ceil(row_blocks).clamp(1, panels.max(1));
        let per_group = panels.div_ceil(col_groups);
        let tasks = row_blocks * col_groups;
        let yp = SharedMut::new(y.as_mut_ptr());
        let work = |t: usize, (apack, bbuf): &mut (Vec<f32>, Vec<f32>)| {
            let (rb, cg) = (t / col_groups, t % col_groups);
            let i0 = rb * B::MC;
            let rows = B::MC.min(m - i0);
            let p0 = cg * per_group;
            let p1 = (p0 + per_group).min(panels);
            if rows == 0 || p0 >= p1 {
                return;
            }
            let init = match (&self.bias, accumulate) {
                (_, true) => Init::Accumulate,
                (Some(b), false) => Init::Bias(b),
                (None, false) => Init::Zero,
            };
            // SAFETY: this task owns rows [i0, i0+rows) × panel columns [p0, p1) of y,
            // which the asserts above put inside `y`; no other task writes them.
            unsafe {
                let c = yp.get().add(i0 * n);
                gemm_tiles(&x[i0 * k..], k, rows, k, b, n, p0..p1, c, n, init, apack, bbuf);
                if let (true, Some(b)) = (accumulate, &self.bias) {
                    let (j0, j1) = (p0 * NR, (p1 * NR).min(n));
                    for r in 0..rows {
                        for (j, bj) in b.iter().enumerate().take(j1).skip(j0) {
                            *c.add(r * n + j) += bj;
                        }
                    }
                }
            }
        };
        if tasks == 1 || m * n * k < 1 << 16 {
            let mut scratch = Default::default();
            (0..tasks).for_each(|t| work(t, &mut scratch));
        } else {
            (0..tasks).into_par_iter().for_each_init(Default::default, |scratch, t| work(t, scratch));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn naive(x: &[f32], w: &[f32], b: Option<&[f32]>, m: usize, n: usize, k: usize) -> Vec<f32> {
        let mut y = vec![0f32; m * n];
        for i in 0..m {
            for j in 0..n {
                let mut s = 0f64;
                for p in 0..k {
                    s += x[i * k + p] as f64 * w[j * k + p] as f64;
                }
                y[i * n + j] = s as f32 + b.map_or(0.0, |b| b[j]);
            }
        }
        y
    }

    fn rand(n: usize, seed: u64) -> Vec<f32> {
        let mut s = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        (0..n)
            .map(|_| {
                s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                ((s >> 40) as f32 / (1u64 << 24) as f32) - 0.5
            })
            .collect()
    }

    #[test]
    fn matches_naive_on_ragged_sizes() {
        for &(m, n, k) in &[(1, 1, 1), (13, 33, 7), (121, 70, 300), (5, 96, 24), (260, 40, 513), (3, 0, 4)] {
            let x = rand(m * k, 1);
            let w = rand(n * k, 2);
            let b = rand(n, 3);
            let lin = PackedLinear::new(&w, n, k, Some(b.clone()));
            let mut y = vec![f32::NAN; m * n];
            lin.forward(&x, m, &mut y, false);
            let want = naive(&x, &w, Some(&b), m, n, k);
            for (i, (a, e)) in y.iter().zip(&want).enumerate() {
                assert!((a - e).abs() <= 1e-4 * (1.0 + e.abs()), "m{m} n{n} k{k} at {i}: {a} vs {e}");
            }
            // Accumulate mode adds onto what is there.
            lin.forward(&x, m, &mut y, true);
            for (a, e) in y.iter().zip(&want) {
                assert!((a - 2.0 * e).abs() <= 2e-4 * (1.0 + e.abs()));
            }
        }
    }

    #[test]
    fn rows_do_not_depend_on_batch() {
        let (n, k) = (70, 300);
        let w = rand(n * k, 5);
        let lin = PackedLinear::new(&w, n, k, None);
        let x = rand(200 * k, 6);
        let mut full = vec![0f32; 200 * n];
        lin.forward(&x, 200, &mut full, false);
        for (start, len) in [(0, 1), (17, 5), (130, 70)] {
            let mut part = vec![0f32; len * n];
            lin.forward(&x[start * k..(start + len) * k], len, &mut part, false);
            assert_eq!(part, full[start * n..(start + len) * n], "rows {start}..{}", start + len);
        }
    }

    #[test]
    fn quantized_weights_give_the_dequantized_product_bitwise() {
        use crate::hf::quant::QuantRows;
        for kind in [QuantKind::Fp8, QuantKind::Int4, QuantKind::Bf16] {
            for &(m, n, k, c0, block) in &[(7, 70, 300, 0, 128), (500, 45, 1100, 3, 32), (1, 33, 64, 0, 32)] {
                let (seg, codes, scales) = if kind == QuantKind::Bf16 {
                    let codes = rand(n * k, 8).iter().flat_map(|v| half::bf16::from_f32(*v).to_le_bytes()).collect();
                    (vec![0, k], codes, vec![1.0; n])
                } else {
                    let seg = QuantRows::segments(c0, k, block);
                    let mask = if kind == QuantKind::Int4 { 0x0f } else { 0x77 }; // no FP8 NaN codes
                    let codes = rand(n * k, 8).iter().map(|v| ((v + 0.5) * 255.9) as u8 & mask).collect();
                    let scales = rand(n * (seg.len() - 1), 9).iter().map(|v| v + 0.75).collect();
                    (seg, codes, scales)
                };
                let q = QuantRows { kind, rows: n, cols: k, codes, seg, scales };
                let dense = PackedLinear::new(&q.dequantize(), n, k, None);
                let quant = PackedLinear::from_weight(LinearWeight::Quant(q), None);
                assert!(quant.is_quantized() && quant.resident_bytes() <= dense.resident_bytes() / 2 + 64 * n);
                let x = rand(m * k, 10);
                let (mut a, mut b) = (vec![0f32; m * n], vec![0f32; m * n]);
                dense.forward(&x, m, &mut a, false);
                quant.forward(&x, m, &mut b, false);
                assert!(a.iter().zip(&b).all(|(p, q)| p.to_bits() == q.to_bits()), "{kind:?} m{m} n{n} k{k}");
            }
        }
    }
}
