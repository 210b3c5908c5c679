//! GEMM `C = A · Bᵀ` with B packed once (weights are packed at load time),
//! in f32 or with bf16 inputs and f32 accumulation ([`super::bf16`]).
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

use super::bf16::{self, with_bf16_path, Bf16Panels, QuantAsBf16};
use super::panels::{pack_b, InPlace, PanelSource, KC, MR, NR};
use super::quant_panels::QuantPanels;
use super::SharedMut;
use crate::backend::Compute;
use crate::hf::quant::{LinearWeight, MappedRows, QuantKind};
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

/// Where a GEMM's A rows come from.
#[derive(Clone, Copy)]
pub(crate) enum ARows<'a> {
    /// Row `i` is `a[i · lda..][..k]`.
    Plain(&'a [f32], usize),
    /// Row `i` is the SwiGLU of row `i` of `gate_up = [gate | up]` (`inter`
    /// wide each): `silu(gate) · up`, computed as A is packed, so the
    /// activations never go to memory. The same bits as
    /// [`super::ops::swiglu`] followed by a `Plain` GEMM.
    SwiGlu(&'a [f32], usize),
    /// Row `i` is the RMSNorm of row `i` of `x` (`weight.len()` wide) by
    /// `weight`, computed as A is packed, so the normalised rows never go to
    /// memory. The same bits as [`super::ops::rms_norm`] then a `Plain` GEMM.
    Norm { x: &'a [f32], weight: &'a [f32], eps: f32 },
    /// Attention's queries with a kv head's query heads stacked: row `j`
    /// (counted from `first`) is row `j % per` of the head `j / per`, at
    /// `a[(j % per) · lda + (j / per) · width..]`.
    Heads { a: &'a [f32], lda: usize, width: usize, per: usize, first: usize },
}

/// Scratch of [`ARows::pack`]: one strip of computed rows, and the rows'
/// `1 / rms` of a normalised block (found at its first k-block).
#[derive(Default)]
pub(crate) struct RowScratch {
    strip: Vec<f32>,
    inv: Vec<f32>,
}

impl<'a> ARows<'a> {
    /// The same rows from row `i0` on.
    fn skip_rows(self, i0: usize) -> Self {
        match self {
            ARows::Plain(a, lda) => ARows::Plain(&a[i0 * lda..], lda),
            ARows::SwiGlu(gu, inter) => ARows::SwiGlu(&gu[i0 * 2 * inter..], inter),
            ARows::Norm { x, weight, eps } => ARows::Norm { x: &x[i0 * weight.len()..], weight, eps },
            ARows::Heads { a, lda, width, per, first } => ARows::Heads { a, lda, width, per, first: first + i0 },
        }
    }

    /// [`Path::pack_a`] of these rows. The k-blocks of a row block are
    /// packed in order from `p0 = 0`, with the same `tmp`.
    #[allow(clippy::too_many_arguments)]
    fn pack<P: Path>(
        self,
        path: P,
        i0: usize,
        rows: usize,
        p0: usize,
        kc: usize,
        out: &mut Vec<P::A>,
        tmp: &mut RowScratch,
    ) {
        // Computed rows go through `tmp.strip` one strip at a time (strips
        // are appended whole, so this is the layout of one call over all
        // rows): `[MR][kc]` f32, from 6 KiB (f32, a 128-deep k-block) to
        // about 1 MiB (AMX, the whole depth of a 14k-wide MLP), instead of
        // `[T, width]` in memory.
        let RowScratch { strip, inv } = tmp;
        let mut strips = |fill: &mut dyn FnMut(usize, &mut [f32])| {
            strip.resize(P::MR * kc, 0.0);
            for s0 in (0..rows).step_by(P::MR) {
                let r = P::MR.min(rows - s0);
                for (j, t) in strip.chunks_exact_mut(kc).take(r).enumerate() {
                    fill(i0 + s0 + j, t);
                }
                path.pack_a(strip, kc, 0, r, 0, kc, out);
            }
        };
        match self {
            ARows::Plain(a, lda) => path.pack_a(a, lda, i0, rows, p0, kc, out),
            ARows::SwiGlu(gu, inter) => strips(&mut |i, t| {
                let row = &gu[i * 2 * inter..][..2 * inter];
                super::ops::swiglu_into(&row[p0..p0 + kc], &row[inter + p0..inter + p0 + kc], t);
            }),
            ARows::Norm { x, weight, eps } => {
                let h = weight.len();
                let row = |i: usize| &x[i * h..][..h];
                if p0 == 0 {
                    inv.clear();
                    inv.extend((i0..i0 + rows).map(|i| super::ops::rms_inverse(row(i), eps)));
                }
                strips(&mut |i, t| super::ops::norm_into(&row(i)[p0..p0 + kc], inv[i - i0], &weight[p0..p0 + kc], t));
            }
            ARows::Heads { a, lda, width, per, first } => strips(&mut |i, t| {
                let j = first + i;
                t.copy_from_slice(&a[(j % per) * lda + (j / per) * width + p0..][..kc]);
            }),
        }
    }
}

/// One GEMM path: how A is packed, what B's tiles hold, and the micro-kernel
/// that multiplies an A strip with a B tile into an `MR × NR` block of C.
/// The f32 path is [`F32Path`]; the bf16 ones live in [`super::bf16`].
pub(crate) trait Path: Copy + Send + Sync {
    /// Element of packed A.
    type A: Copy + Default + Send + Sync;
    /// Element of a B tile.
    type B: Copy + Default + Send + Sync;
    /// Depths one kernel step takes (2 for bf16 pairs); B tiles are
    /// zero-padded to a multiple of it.
    const STEP: usize;
    /// The multiple A strips are zero-padded to (AMX tiles take 32 depths).
    const A_STEP: usize = Self::STEP;
    /// Depth of one k-block: sums over more depths are split at its multiples.
    const KC: usize = KC;
    /// Rows of an A strip (AMX tiles take 16).
    const MR: usize = MR;
    /// `MR`-row strips one kernel call takes (consecutive in packed A).
    const STRIPS: usize = 1;
    /// Bytes of packed A (all k-blocks of a row block) that set the height
    /// of row blocks, instead of the source's `MC`: for kernels that read A
    /// faster than L3 can feed it. `usize::MAX`: `MC` rows.
    const A_BYTES: usize = usize::MAX;
    /// Whether the loop prefetches the next B tile into L2 while the kernel
    /// works on this one (for kernels that do not prefetch B themselves).
    const PREFETCH_NEXT: bool = true;
    /// Appends rows `[i0, i0+rows)` × depths `[p0, p0+kc)` of A (f32, row
    /// stride `lda`) to `out` as `MR`-row strips of `kc.next_multiple_of(A_STEP) · MR`
    /// elements each, zero-padding the last strip.
    #[allow(clippy::too_many_arguments)]
    fn pack_a(self, a: &[f32], lda: usize, i0: usize, rows: usize, p0: usize, kc: usize, out: &mut Vec<Self::A>);
    /// Packs `B` (`n × k`, element `(j, p)` at `src[j * rs + p * cs]`) into
    /// `ceil(n/NR)` panels of `k.next_multiple_of(STEP)` depths.
    fn pack_b(self, src: &[f32], n: usize, k: usize, rs: usize, cs: usize, out: &mut Vec<Self::B>);
    /// `C[rows, cols] (init) + A strips · B tile` over `kc` depths, for
    /// `rows ≤ STRIPS · MR`.
    ///
    /// # Safety
    /// `a` and `b` hold `rows.div_ceil(MR)` packed strips and a tile of `kc`
    /// depths; `c` is valid for `rows × cols` writes at stride `ldc`.
    #[allow(clippy::too_many_arguments)]
    unsafe fn kernel(
        self,
        kc: usize,
        a: *const Self::A,
        b: *const Self::B,
        c: *mut f32,
        ldc: usize,
        rows: usize,
        cols: usize,
        init: TileInit,
    );
    /// The kernel's name, as the manifest records it.
    fn name(self) -> &'static str;
}

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

    unsafe fn kernel(
        self,
        kc: usize,
        a: *const f32,
        b: *const f32,
        c: *mut f32,
        ldc: usize,
        rows: usize,
        cols: usize,
        init: TileInit,
    ) {
        (self.kernel)(kc, a, b, c, ldc, rows, cols, init)
    }

    fn name(self) -> &'static str {
        self.name
    }
}

/// Appends rows `[i0, i0+rows)` × depths `[p0, p0+kc)` of A (row stride
/// `lda`) as `MR`-row strips of `kc.next_multiple_of(step) · MR` values,
/// value `(depth p, row r)` of a strip at `at(p, r)` converted by `conv`;
/// padding rows and depths are the default value (zero). The one A packing
/// every [`Path`] uses, with its own layout and element.
#[allow(clippy::too_many_arguments)]
#[inline]
pub(crate) fn pack_strips<T: Copy + Default>(
    a: &[f32],
    lda: usize,
    i0: usize,
    rows: usize,
    p0: usize,
    kc: usize,
    step: usize,
    out: &mut Vec<T>,
    at: impl Fn(usize, usize) -> usize,
    conv: impl Fn(f32) -> T,
) {
    let len = kc.next_multiple_of(step) * MR;
    let base = out.len();
    out.resize(base + rows.div_ceil(MR) * len, T::default());
    for (s, strip) in out[base..].chunks_exact_mut(len).enumerate() {
        let r0 = s * MR;
        for r in 0..MR.min(rows - r0) {
            let row = &a[(i0 + r0 + r) * lda + p0..][..kc];
            for (p, v) in row.iter().enumerate() {
                strip[at(p, r)] = conv(*v);
            }
        }
    }
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

/// The blocked GEMM loop of path `P` over any panel source: rows `[0, m)`
/// of A times panels `panels` of `b` into C (see [`gemm_packed`]).
///
/// # Safety
/// `c` must be valid for writes at `i * ldc + j` for `i < m` and the columns
/// `j < n` of `panels`; `b` must hold `ceil(n/NR)` panels of depth `k`; no
/// other thread may touch those elements of C during the call.
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn gemm_tiles<P: Path, S: PanelSource<Elem = P::B>>(
    path: P,
    a: ARows,
    m: usize,
    k: usize,
    b: &S,
    n: usize,
    panels: std::ops::Range<usize>,
    c: *mut f32,
    ldc: usize,
    init: Init,
    apack: &mut Vec<P::A>,
    bbuf: &mut Vec<P::B>,
) {
    if k == 0 {
        return init_only(m, n, panels, c, ldc, init);
    }
    let mut computed = RowScratch::default();
    for (i0, mc) in row_blocks::<P, S>(m, k) {
        apack.clear();
        pack_block(path, a, i0, mc, k, apack, &mut computed);
        block_product(path, apack, mc, k, b, n, panels.clone(), c.add(i0 * ldc), ldc, init, bbuf);
    }
}

/// Packs rows `[0, m)` of `a`, depth `k`, for [`gemm_prepacked`] with a B of
/// source type `S`: each row block's packing (as [`gemm_tiles`] makes it),
/// one after another. Attention packs its queries once this way for every
/// key block they meet.
pub(crate) fn pack_rows<P: Path, S: PanelSource>(path: P, a: ARows, m: usize, k: usize, out: &mut Vec<P::A>) {
    out.clear();
    let mut computed = RowScratch::default();
    for (i0, mc) in row_blocks::<P, S>(m, k) {
        pack_block(path, a, i0, mc, k, out, &mut computed);
    }
}

/// [`gemm_tiles`] with A already packed by [`pack_rows`] (the same `m`, `k`,
/// `P` and `S`): the same bits.
///
/// # Safety
/// As [`gemm_tiles`].
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn gemm_prepacked<P: Path, S: PanelSource<Elem = P::B>>(
    path: P,
    apack: &[P::A],
    m: usize,
    k: usize,
    b: &S,
    n: usize,
    panels: std::ops::Range<usize>,
    c: *mut f32,
    ldc: usize,
    init: Init,
    bbuf: &mut Vec<P::B>,
) {
    if k == 0 {
        return init_only(m, n, panels, c, ldc, init);
    }
    let block_len = |mc: usize| (0..k).step_by(P::KC).map(|p0| packed_len::<P>(mc, P::KC.min(k - p0))).sum::<usize>();
    let total: usize = row_blocks::<P, S>(m, k).map(|(_, mc)| block_len(mc)).sum();
    assert_eq!(total, apack.len(), "gemm_prepacked: A was packed for another shape");
    let mut off = 0;
    for (i0, mc) in row_blocks::<P, S>(m, k) {
        let len = block_len(mc);
        block_product(path, &apack[off..off + len], mc, k, b, n, panels.clone(), c.add(i0 * ldc), ldc, init, bbuf);
        off += len;
    }
}

/// A GEMM of depth 0: C is just its initial value.
///
/// # Safety
/// As [`gemm_tiles`].
unsafe fn init_only(m: usize, n: usize, panels: std::ops::Range<usize>, c: *mut f32, ldc: usize, init: Init) {
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
}

/// The row blocks `(i0, rows)` a GEMM of `m` rows, depth `k`, runs in.
fn row_blocks<P: Path, S: PanelSource>(m: usize, k: usize) -> impl Iterator<Item = (usize, usize)> {
    let mc = block_rows::<P, S>(k);
    (0..m).step_by(mc).map(move |i0| (i0, mc.min(m - i0)))
}

/// Elements of packed A a k-block of `kc` depths takes for `rows` rows:
/// whole strips of `MR` rows, the depth padded to the path's step.
fn packed_len<P: Path>(rows: usize, kc: usize) -> usize {
    rows.div_ceil(P::MR) * kc.next_multiple_of(P::A_STEP) * P::MR
}

/// Appends rows `[i0, i0 + mc)` of `a`, every k-block in order.
fn pack_block<P: Path>(path: P, a: ARows, i0: usize, mc: usize, k: usize, out: &mut Vec<P::A>, tmp: &mut RowScratch) {
    for p0 in (0..k).step_by(P::KC) {
        let (before, kc) = (out.len(), P::KC.min(k - p0));
        // Computed rows are packed a strip at a time: room for the whole
        // block first, so the buffer is not regrown (and copied) per strip.
        out.reserve(packed_len::<P>(mc, kc));
        a.pack(path, i0, mc, p0, kc, out, tmp);
        debug_assert_eq!(out.len() - before, packed_len::<P>(mc, kc), "pack_block: packed length");
    }
}

/// One row block: `mc` rows of packed A (every k-block, as [`pack_block`]
/// lays them out) times panels `panels` of `b` into C.
///
/// Each panel runs its k-blocks back to back: the C tile stays in L1
/// between k-blocks instead of the whole `MC × n` block of C going round
/// the caches once per k-block.
#[allow(clippy::too_many_arguments)]
unsafe fn block_product<P: Path, S: PanelSource<Elem = P::B>>(
    path: P,
    apack: &[P::A],
    mc: usize,
    k: usize,
    b: &S,
    n: usize,
    panels: std::ops::Range<usize>,
    c: *mut f32,
    ldc: usize,
    init: Init,
    bbuf: &mut Vec<P::B>,
) {
    let kblocks = k.div_ceil(P::KC);
    let strips = mc.div_ceil(P::MR);
    for pi in panels.clone() {
        let j0 = pi * NR;
        let cols = NR.min(n - j0);
        let mut off = 0;
        for kb in 0..kblocks {
            let p0 = kb * P::KC;
            let kc = P::KC.min(k - p0);
            let strip = kc.next_multiple_of(P::A_STEP) * P::MR;
            let bp = b.tile(pi, p0, kc, k, bbuf);
            let tile_init = match (kb == 0, init) {
                (true, Init::Zero) => TileInit::Zero,
                (true, Init::Bias(bias)) => TileInit::Bias(bias.as_ptr().add(j0)),
                _ => TileInit::Load,
            };
            // The next tile this loop reads: the source prefetches its
            // memory a share per kernel call, so the first strips of the
            // next k-block do not wait for it.
            let next = if !P::PREFETCH_NEXT {
                None
            } else if kb + 1 < kblocks {
                Some((pi, p0 + kc, P::KC.min(k - p0 - kc)))
            } else if pi + 1 < panels.end {
                Some((pi + 1, 0, P::KC.min(k)))
            } else {
                None
            };
            let calls = strips.div_ceil(P::STRIPS);
            for (call, s) in (0..strips).step_by(P::STRIPS).enumerate() {
                if let Some((npi, np0, nkc)) = next {
                    b.prefetch(npi, np0, nkc, nkc.next_multiple_of(P::STEP), call, calls);
                }
                let rows = (P::STRIPS * P::MR).min(mc - s * P::MR);
                let ap = apack[off + s * strip..].as_ptr();
                let cp = c.add(s * P::MR * ldc + j0);
                path.kernel(kc, ap, bp, cp, ldc, rows, cols, tile_init);
            }
            off += packed_len::<P>(mc, kc);
        }
    }
}

/// Rows of A a row block packs for a depth of `k`: the source's `MC`, or
/// as many as the path's A budget holds (whole kernel calls, at least one).
fn block_rows<P: Path, S: PanelSource>(k: usize) -> usize {
    if S::REPACKS || P::A_BYTES == usize::MAX {
        return S::MC;
    }
    let unit = P::MR * P::STRIPS;
    (P::A_BYTES / (k.max(1) * std::mem::size_of::<P::A>()) / unit).max(1) * unit
}

/// How a micro-kernel starts its tile.
#[derive(Clone, Copy)]
pub(crate) enum TileInit {
    Zero,
    Bias(*const f32),
    Load,
}

type Kernel = unsafe fn(usize, *const f32, *const f32, *mut f32, usize, usize, usize, TileInit);

/// Name of the f32 micro-kernel this CPU runs.
pub fn kernel_name() -> &'static str {
    F32Path::detect().name()
}

/// Name of the micro-kernel this CPU runs for `compute` (the manifest's `run.kernel`).
pub fn kernel_name_for(compute: Compute) -> &'static str {
    match compute {
        Compute::F32 => F32Path::detect().name(),
        Compute::Bf16 => super::bf16::detect().name(),
    }
}

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

    /// A packed once by `pack_rows` (here attention's stacked heads) and
    /// multiplied by `gemm_prepacked` gives the bits of `gemm_tiles` over the
    /// same rows copied out, on every path, over several row blocks (f32's
    /// 384 rows, AMX's 1 MiB of A) and several k-blocks (f32's 128 depths).
    #[test]
    fn prepacked_heads_give_the_bits_of_copied_rows_on_every_path() {
        fn check<P: Path>(path: P) {
            let (per, heads, width, n) = (70, 9, 1500, 45);
            let lda = heads * width + 7;
            let q = rand(per * lda, 11);
            let w = rand(n * width, 12);
            let (m, k) = (per * heads, width);
            // Row `hg · per + ri` is row `ri` of head `hg`.
            let copied: Vec<f32> =
                (0..m).flat_map(|j| q[(j % per) * lda + (j / per) * width..][..width].iter().copied()).collect();
            let mut panels = Vec::new();
            path.pack_b(&w, n, k, k, 1, &mut panels);
            let src = InPlace { ptr: panels.as_ptr(), kpad: k.next_multiple_of(P::STEP) };
            let (mut y1, mut y2) = (vec![f32::NAN; m * n], vec![f32::NAN; m * n]);
            let (mut ap, mut bb, mut qp) = (Vec::new(), Vec::new(), Vec::new());
            let heads_rows = ARows::Heads { a: &q, lda, width, per, first: 0 };
            pack_rows::<P, InPlace<P::B>>(path, heads_rows, m, k, &mut qp);
            // SAFETY: y1 and y2 hold m × n floats; the panels were packed for n × k.
            unsafe {
                let all = 0..n.div_ceil(NR);
                gemm_tiles(
                    path,
                    ARows::Plain(&copied, k),
                    m,
                    k,
                    &src,
                    n,
                    all.clone(),
                    y1.as_mut_ptr(),
                    n,
                    Init::Zero,
                    &mut ap,
                    &mut bb,
                );
                gemm_prepacked(path, &qp, m, k, &src, n, all, y2.as_mut_ptr(), n, Init::Zero, &mut bb);
            }
            assert!(y1.iter().zip(&y2).all(|(a, b)| a.to_bits() == b.to_bits()), "path {}", path.name());
            assert!(y1.iter().all(|v| v.is_finite()), "path {}: every element written", path.name());
        }
        for path in F32Path::available() {
            check(path);
        }
        for path in bf16::available() {
            with_bf16_path!(path, p => check(p));
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
