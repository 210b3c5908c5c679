//! GEMM `C = A · Bᵀ` with B packed once (weights are packed at load time):
//! the blocked driver, generic over a [`Path`] (how A is packed, what B's
//! tiles hold, the micro-kernel). The paths are [`f32`]'s and [`bf16`]'s
//! (bf16 inputs, f32 accumulation); [`super::linear`] chooses one.
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

pub mod bf16;
pub mod f32;

use super::ops;
use super::panels::{PanelSource, KC, MR, NR};

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
    /// [`ops::swiglu`] followed by a `Plain` GEMM.
    SwiGlu(&'a [f32], usize),
    /// Row `i` is the RMSNorm of row `i` of `x` (`weight.len()` wide) by
    /// `weight`, computed as A is packed, so the normalised rows never go to
    /// memory. The same bits as [`ops::rms_norm`] then a `Plain` GEMM.
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
    pub(crate) fn skip_rows(self, i0: usize) -> Self {
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
                ops::swiglu_into(&row[p0..p0 + kc], &row[inter + p0..inter + p0 + kc], t);
            }),
            ARows::Norm { x, weight, eps } => {
                let h = weight.len();
                let row = |i: usize| &x[i * h..][..h];
                if p0 == 0 {
                    inv.clear();
                    inv.extend((i0..i0 + rows).map(|i| ops::rms_inverse(row(i), eps)));
                }
                strips(&mut |i, t| ops::norm_into(&row(i)[p0..p0 + kc], inv[i - i0], &weight[p0..p0 + kc], t));
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
/// The f32 paths are [`f32::F32Path`]; the bf16 ones live in [`bf16`].
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

/// The blocked GEMM loop of path `P` over any panel source: rows `[0, m)`
/// of A times panels `panels` of `b` into C (see [`f32::gemm_packed`]).
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
pub(crate) fn block_rows<P: Path, S: PanelSource>(k: usize) -> usize {
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

/// [`Path::kernel`] and [`Path::name`] for a path that holds its
/// micro-kernel in a field `kernel` (a function pointer) and its name in a
/// field `name`, as the f32 path and the wide and pair bf16 paths do.
macro_rules! kernel_from_fields {
    () => {
        unsafe fn kernel(
            self,
            kc: usize,
            a: *const Self::A,
            b: *const Self::B,
            c: *mut f32,
            ldc: usize,
            rows: usize,
            cols: usize,
            init: $crate::backend::cpu::gemm::TileInit,
        ) {
            (self.kernel)(kc, a, b, c, ldc, rows, cols, init)
        }

        fn name(self) -> &'static str {
            self.name
        }
    };
}
pub(crate) use kernel_from_fields;

/// Values in `[-0.5, 0.5)` from a seed, the same on every run: the tests' inputs.
#[cfg(test)]
pub(crate) fn rand(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
    (0..n)
        .map(|_| {
            s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            ((s >> 40) as f32 / (1u64 << 24) as f32) - 0.5
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::bf16::{self, with_bf16_path};
    use super::f32::F32Path;
    use super::*;
    use crate::backend::cpu::panels::InPlace;

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
}
