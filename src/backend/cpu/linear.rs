//! A linear layer's weight as the GEMM reads it ([`PackedLinear`]): f32
//! panels, f32 rows in place in the mapped checkpoint, FP8/INT4 codes, or
//! bf16 pair panels; and the choice of GEMM path a forward runs, by the
//! compute dtype and what this CPU has ([`super::gemm`]'s f32 or bf16 paths).

use super::gemm::bf16::{self, with_bf16_path, Bf16Panels, QuantAsBf16};
use super::gemm::f32::F32Path;
use super::gemm::{block_rows, gemm_tiles, ARows, Init, Path};
use super::panels::{pack_b, InPlace, PanelSource, NR};
use super::quant_panels::QuantPanels;
use super::SharedMut;
use crate::backend::Compute;
use crate::hf::quant::{LinearWeight, MappedRows, QuantKind};
use rayon::prelude::*;

/// Name of the f32 micro-kernel this CPU runs.
pub fn kernel_name() -> &'static str {
    F32Path::detect().name()
}

/// Name of the micro-kernel this CPU runs for `compute` (the manifest's `run.kernel`).
pub fn kernel_name_for(compute: Compute) -> &'static str {
    match compute {
        Compute::F32 => F32Path::detect().name(),
        Compute::Bf16 => bf16::detect().name(),
    }
}

/// A linear layer's packed weight: f32 panels, quantised ones decoded per
/// tile, or (for bf16 compute) bf16 pair panels and quantised ones decoded to bf16.
enum Panels {
    F32(Vec<f32>),
    Mapped(MappedRows<f32>),
    Quant(QuantPanels),
    Bf16(Bf16Panels),
    QuantBf16(QuantPanels),
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
    /// Packs `W` (`[out, in]`, row-major) and an optional bias `[out]` for f32 compute.
    pub fn new(w: &[f32], out_features: usize, in_features: usize, bias: Option<Vec<f32>>) -> Self {
        Self::new_for(w, out_features, in_features, bias, Compute::F32)
    }

    /// Packs `W` for GEMMs in `compute` (bf16: the weight rounded to bf16 once, here).
    pub fn new_for(
        w: &[f32],
        out_features: usize,
        in_features: usize,
        bias: Option<Vec<f32>>,
        compute: Compute,
    ) -> Self {
        assert_eq!(w.len(), out_features * in_features, "PackedLinear: weight size");
        let panels = match compute {
            Compute::F32 => {
                let mut panels = Vec::new();
                pack_b(w, out_features, in_features, in_features, 1, &mut panels);
                Panels::F32(panels)
            }
            Compute::Bf16 => Panels::Bf16(Bf16Panels::from_f32(w, out_features, in_features)),
        };
        Self::with_panels(panels, out_features, in_features, bias)
    }

    /// Packs a weight as read from a checkpoint for f32 compute, keeping quantised codes.
    pub fn from_weight(w: LinearWeight, bias: Option<Vec<f32>>) -> Self {
        Self::from_weight_for(w, bias, Compute::F32)
    }

    /// Packs a weight as read from a checkpoint for GEMMs in `compute`.
    /// FP8 and INT4 codes stay as they are and are decoded per tile (to f32,
    /// or to bf16 for bf16 compute); bf16 weights under bf16 compute are
    /// repacked into pair panels, bit for bit.
    pub fn from_weight_for(w: LinearWeight, bias: Option<Vec<f32>>, compute: Compute) -> Self {
        match (w, compute) {
            (LinearWeight::Dense { rows, cols, w }, _) => Self::new_for(&w, rows, cols, bias, compute),
            // In place: tiles are transposed from the mapped rows as the GEMM reaches them.
            (LinearWeight::Mapped(m), Compute::F32) => {
                let (rows, cols) = (m.rows, m.cols);
                Self::with_panels(Panels::Mapped(m), rows, cols, bias)
            }
            (LinearWeight::Mapped(m), Compute::Bf16) => Self::new_for(&m.to_vec(), m.rows, m.cols, bias, compute),
            (LinearWeight::MappedBf16(m), Compute::F32) => {
                Self::from_weight_for(LinearWeight::Quant(m.to_quant_rows()), bias, compute)
            }
            (LinearWeight::MappedBf16(m), Compute::Bf16) => {
                Self::with_panels(Panels::Bf16(Bf16Panels::from_mapped(&m)), m.rows, m.cols, bias)
            }
            (LinearWeight::Quant(q), Compute::F32) => {
                Self::with_panels(Panels::Quant(QuantPanels::pack(&q)), q.rows, q.cols, bias)
            }
            (LinearWeight::Quant(q), Compute::Bf16) if q.kind == QuantKind::Bf16 => {
                Self::with_panels(Panels::Bf16(Bf16Panels::from_bf16_rows(&q)), q.rows, q.cols, bias)
            }
            (LinearWeight::Quant(q), Compute::Bf16) => {
                Self::with_panels(Panels::QuantBf16(QuantPanels::pack(&q)), q.rows, q.cols, bias)
            }
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
        !matches!(self.panels, Panels::F32(_) | Panels::Mapped(_))
    }
    /// The kind of codes the weight is held as; `None` for f32.
    pub fn held_as(&self) -> Option<QuantKind> {
        match &self.panels {
            Panels::F32(_) | Panels::Mapped(_) => None,
            Panels::Bf16(_) => Some(QuantKind::Bf16),
            Panels::Quant(q) | Panels::QuantBf16(q) => Some(q.kind()),
        }
    }
    /// The compute dtype its GEMMs run in.
    pub fn compute(&self) -> Compute {
        match &self.panels {
            Panels::F32(_) | Panels::Mapped(_) | Panels::Quant(_) => Compute::F32,
            Panels::Bf16(_) | Panels::QuantBf16(_) => Compute::Bf16,
        }
    }
    /// The micro-kernel its GEMMs run on this CPU.
    pub fn kernel(&self) -> &'static str {
        kernel_name_for(self.compute())
    }
    /// Bytes of memory the weight and bias hold.
    pub fn resident_bytes(&self) -> usize {
        let w = match &self.panels {
            Panels::F32(p) => p.len() * 4,
            Panels::Mapped(m) => m.rows * m.cols * 4,
            Panels::Bf16(p) => p.bytes(),
            Panels::Quant(q) | Panels::QuantBf16(q) => q.bytes(),
        };
        w + self.bias.as_ref().map_or(0, |b| b.len() * 4)
    }

    /// `y[m, out] = x[m, in] · Wᵀ + b`, or `y += x · Wᵀ` when `accumulate`
    /// (then the bias is added too). Split over rayon by row blocks and column groups.
    pub fn forward(&self, x: &[f32], m: usize, y: &mut [f32], accumulate: bool) {
        self.forward_split(x, m, y, accumulate, true)
    }

    /// [`Self::forward`], split over the threads only with `split`: callers
    /// that are already one of many parallel tasks (a MoE expert) run it on
    /// their own thread, where splitting the columns would pack the same A
    /// block once per column group. The same bits either way.
    pub fn forward_split(&self, x: &[f32], m: usize, y: &mut [f32], accumulate: bool, split: bool) {
        assert_eq!(x.len(), m * self.in_features, "PackedLinear: input size");
        self.forward_rows(ARows::Plain(x, self.in_features), m, y, accumulate, split)
    }

    /// `y (+)= swiglu(gate_up)·Wᵀ + b` for `m` rows of `gate_up = [gate | up]`
    /// (`in_features` wide each): the SwiGLU is computed as the GEMM packs its
    /// input, with the bits of [`super::ops::swiglu`] then [`Self::forward`].
    /// (When few rows split into column groups, each group computes its
    /// rows' SwiGLU again: `inter` exps per row against `inter · n / groups` MACs.)
    pub fn forward_swiglu(&self, gate_up: &[f32], m: usize, y: &mut [f32], accumulate: bool) {
        assert_eq!(gate_up.len(), m * 2 * self.in_features, "PackedLinear: gate/up size");
        self.forward_rows(ARows::SwiGlu(gate_up, self.in_features), m, y, accumulate, true)
    }

    /// `y (+)= rms_norm(x)·Wᵀ + b` for `m` rows of `x` (`in_features` wide),
    /// normalised by `weight` as the GEMM packs its input: the bits of
    /// [`super::ops::rms_norm`] then [`Self::forward`].
    pub fn forward_norm(&self, x: &[f32], m: usize, weight: &[f32], eps: f32, y: &mut [f32], accumulate: bool) {
        assert_eq!(weight.len(), self.in_features, "PackedLinear: norm weight size");
        assert_eq!(x.len(), m * self.in_features, "PackedLinear: input size");
        self.forward_rows(ARows::Norm { x, weight, eps }, m, y, accumulate, true)
    }

    fn forward_rows(&self, x: ARows, m: usize, y: &mut [f32], accumulate: bool, split: bool) {
        match &self.panels {
            Panels::F32(p) => {
                let src = InPlace { ptr: p.as_ptr(), kpad: self.in_features };
                self.run(F32Path::detect(), &src, x, m, y, accumulate, split)
            }
            Panels::Quant(q) => self.run(F32Path::detect(), q, x, m, y, accumulate, split),
            Panels::Mapped(rows) => self.run(F32Path::detect(), rows, x, m, y, accumulate, split),
            Panels::Bf16(p) => {
                with_bf16_path!(bf16::detect(), path => self.run(path, &p.source(), x, m, y, accumulate, split))
            }
            Panels::QuantBf16(q) => {
                with_bf16_path!(bf16::detect(), path => self.run(path, &QuantAsBf16(q), x, m, y, accumulate, split))
            }
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn run<P: Path, S: PanelSource<Elem = P::B> + Sync>(
        &self,
        path: P,
        b: &S,
        x: ARows,
        m: usize,
        y: &mut [f32],
        accumulate: bool,
        split: bool,
    ) {
        let (n, k) = (self.out_features, self.in_features);
        assert_eq!(y.len(), m * n, "PackedLinear: output size");
        let panels = n.div_ceil(NR);
        let threads = if split { rayon::current_num_threads() } else { 1 };
        // Row blocks of at most MC rows, as many as a multiple of the threads
        // and of near-equal size (whole strips): 11 blocks on 2 threads would
        // leave one thread idle for a twelfth of the time.
        // In whole kernel calls (`STRIPS` strips): a block of 21 two-strip
        // rows would end in a call with one strip's rows and half its work.
        let unit = P::MR * P::STRIPS;
        let units = m.div_ceil(unit);
        // Units per row block: `MC` rows, or fewer to keep A under the path's budget.
        let mut row_blocks = units.div_ceil((block_rows::<P, S>(k) / unit).max(1)).max(1);
        if row_blocks >= threads {
            row_blocks = row_blocks.next_multiple_of(threads);
        }
        let block_rows = |rb: usize| {
            let (s0, s1) = (rb * units / row_blocks, (rb + 1) * units / row_blocks);
            (s0 * unit, (s1 * unit).min(m))
        };
        // Fewer row blocks than threads: split the columns too, in groups large enough to amortise A packing.
        let col_groups = if split { (2 * threads).div_ceil(row_blocks).clamp(1, panels.max(1)) } else { 1 };
        let per_group = panels.div_ceil(col_groups);
        let tasks = row_blocks * col_groups;
        let yp = SharedMut::new(y.as_mut_ptr());
        let work = |t: usize, (apack, bbuf): &mut (Vec<P::A>, Vec<P::B>)| {
            let (rb, cg) = (t / col_groups, t % col_groups);
            let (i0, i1) = block_rows(rb);
            let rows = i1.saturating_sub(i0);
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
                gemm_tiles(path, x.skip_rows(i0), rows, k, b, n, p0..p1, c, n, init, apack, bbuf);
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
        if !split || tasks == 1 || m * n * k < 1 << 16 {
            let mut scratch = Default::default();
            (0..tasks).for_each(|t| work(t, &mut scratch));
        } else {
            (0..tasks).into_par_iter().for_each_init(Default::default, |scratch, t| work(t, scratch));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::gemm::rand;
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
    #[test]
    fn weights_in_place_give_the_bits_of_packed_panels() {
        use std::sync::Arc;
        // A [70, 300] f32 tensor as a checkpoint holds it; a block of its rows
        // and columns (as a tensor-parallel rank reads), stacked with another
        // block (a fused gate/up), against the same values packed.
        let (rows, width) = (70, 300);
        let t: Arc<Vec<f32>> = Arc::new(rand(rows * width, 9));
        let bytes: &[u8] = bytemuck::cast_slice(&t[..]);
        let keep = || Some(Arc::clone(&t) as Arc<dyn Send + Sync>);
        // SAFETY: `keep` holds the tensor the bytes view.
        let a = unsafe { MappedRows::new(bytes, width, 3..40, 11..272, keep()) }.unwrap();
        let b = unsafe { MappedRows::new(bytes, width, 50..70, 11..272, keep()) }.unwrap();
        let stacked = LinearWeight::stack(vec![LinearWeight::Mapped(a), LinearWeight::Mapped(b)]);
        let LinearWeight::Mapped(m) = &stacked else { panic!("mapped blocks must stack in place") };
        let dense = m.to_vec();
        let (n, k) = (m.rows, m.cols);
        let bias = rand(n, 4);
        let mapped = PackedLinear::from_weight(stacked.clone(), Some(bias.clone()));
        let packed = PackedLinear::new(&dense, n, k, Some(bias));
        for m in [1, 13, 400, 800] {
            let x = rand(m * k, m as u64);
            for accumulate in [false, true] {
                let (mut y1, mut y2) = (rand(m * n, 5), rand(m * n, 5));
                mapped.forward(&x, m, &mut y1, accumulate);
                packed.forward(&x, m, &mut y2, accumulate);
                assert!(y1.iter().zip(&y2).all(|(a, b)| a.to_bits() == b.to_bits()), "m {m}, accumulate {accumulate}");
            }
        }
        // Unaligned bytes are refused (the checkpoint then copies).
        assert!(unsafe { MappedRows::<f32>::new(&bytes[1..], width, 0..1, 0..4, None) }.is_none());
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
    /// The SwiGLU fused into A's packing gives the bits of the SwiGLU
    /// written out and then multiplied, in f32 and bf16 compute, with and
    /// without the residual add, on ragged sizes.
    #[test]
    fn fused_swiglu_gives_the_bits_of_the_two_steps() {
        for &(m, n, inter) in &[(1, 16, 5), (37, 70, 300), (130, 33, 64)] {
            let w = rand(n * inter, 3);
            let gu: Vec<f32> = rand(m * 2 * inter, 4).iter().map(|v| v * 8.0).collect();
            let mut act = vec![0f32; m * inter];
            super::super::ops::swiglu(&gu, inter, &mut act);
            for compute in [Compute::F32, Compute::Bf16] {
                let l = PackedLinear::from_weight_for(
                    LinearWeight::Dense { rows: n, cols: inter, w: w.clone() },
                    Some(rand(n, 5)),
                    compute,
                );
                for accumulate in [false, true] {
                    let (mut want, mut got) = (rand(m * n, 6), rand(m * n, 6));
                    l.forward(&act, m, &mut want, accumulate);
                    l.forward_swiglu(&gu, m, &mut got, accumulate);
                    let same = got.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits());
                    assert!(same, "m {m} n {n} inter {inter} {compute:?} accumulate {accumulate}");
                }
            }
        }
    }

    #[test]
    fn fused_norm_gives_the_bits_of_the_two_steps() {
        // Depths past one f32 k-block (300, 2900) exercise the per-row scale
        // kept across k-blocks; 2900 also shortens the AMX row blocks.
        for &(m, n, k) in &[(1, 16, 5), (37, 70, 300), (400, 33, 2900)] {
            let w = rand(n * k, 3);
            let x: Vec<f32> = rand(m * k, 4).iter().map(|v| v * 8.0).collect();
            let norm = rand(k, 7);
            let mut normed = vec![0f32; m * k];
            super::super::ops::rms_norm(&x, &norm, 1e-6, &mut normed);
            for compute in [Compute::F32, Compute::Bf16] {
                let l = PackedLinear::from_weight_for(
                    LinearWeight::Dense { rows: n, cols: k, w: w.clone() },
                    Some(rand(n, 5)),
                    compute,
                );
                for accumulate in [false, true] {
                    let (mut want, mut got) = (rand(m * n, 6), rand(m * n, 6));
                    l.forward(&normed, m, &mut want, accumulate);
                    l.forward_norm(&x, m, &norm, 1e-6, &mut got, accumulate);
                    let same = got.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits());
                    assert!(same, "m {m} n {n} k {k} {compute:?} accumulate {accumulate}");
                }
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
        for kind in [QuantKind::Fp8, QuantKind::Int4, QuantKind::Bf16, QuantKind::Mxfp4] {
            for &(m, n, k, c0, block) in &[(7, 70, 300, 0, 128), (500, 45, 1100, 3, 32), (1, 33, 64, 0, 32)] {
                let (seg, codes, scales) = if kind == QuantKind::Bf16 {
                    let codes = rand(n * k, 8).iter().flat_map(|v| half::bf16::from_f32(*v).to_le_bytes()).collect();
                    (vec![0, k], codes, vec![1.0; n])
                } else {
                    let seg = QuantRows::segments(c0, k, block);
                    let mask = if kind == QuantKind::Fp8 { 0x77 } else { 0x0f }; // no FP8 NaN codes
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
