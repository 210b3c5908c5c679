//! bf16 compute: GEMM inputs rounded to bf16, every product accumulated in f32.
//!
//! Weights are packed once into pair panels, `[panel][k/2][NR][2]` bf16
//! bits: depths `2q` and `2q+1` of one column side by side, the layout
//! `VDPBF16PS` and AMX's `TDPBF16PS` read. An odd depth is padded with a zero.
//! FP8 and INT4 weights stay as codes and are decoded into such tiles as the
//! GEMM reaches them (`code · scale` in f32, then rounded to bf16).
//!
//! Paths, chosen at run time by what the CPU has:
//! - `amx`: AMX tiles (`TDPBF16PS`) on Intel Xeons that have them, A packed
//!   as rows of 32 bf16 depths, B read from the same pair panels;
//! - `avx512bf16`: `VDPBF16PS` on A packed as bf16 pairs too;
//! - `avx2`: each pair widened to f32 with two shifts, then FMAs; A is
//!   packed as f32 values already rounded to bf16;
//! - `portable`: the same arithmetic in plain Rust.
//!
//! A product of two bf16 values is exact in f32, so a multiply-then-add and
//! an FMA give the same bits: `avx2` and `portable` agree bitwise. Each pair
//! adds its odd depth first, the order Intel documents for `VDPBF16PS`.
//! `amx` and `avx512bf16` sum in the hardware's own order (and flush
//! subnormals), so each differs from the others in the last bits: the
//! manifest records the path.

use super::{kernel_from_fields, pack_strips, Path, TileInit};
use crate::backend::cpu::panels::{zeroed, InPlace, PanelSource, MR, NR};
use crate::backend::cpu::quant_panels::QuantPanels;
use crate::hf::quant::{MappedRows, QuantKind, QuantRows};
use crate::shape::bf16_bits;
use rayon::prelude::*;

/// `bits` as the f32 it encodes.
#[inline(always)]
fn widen(bits: u16) -> f32 {
    f32::from_bits((bits as u32) << 16)
}

/// A weight `[n, k]` as bf16 pair panels.
pub struct Bf16Panels {
    /// Depths per panel: `k` rounded up to even.
    kpad: usize,
    /// `[ceil(n/NR)][kpad/2][NR][2]`; padding columns and depths are 0.
    data: Vec<u16>,
}

impl Bf16Panels {
    /// Rounds an f32 `[n, k]` row-major weight to bf16 and packs it.
    pub fn from_f32(w: &[f32], n: usize, k: usize) -> Self {
        assert_eq!(w.len(), n * k, "Bf16Panels: weight size");
        let mut data = Vec::new();
        pack_b_bf16(w, n, k, k, 1, &mut data);
        Bf16Panels { kpad: k.next_multiple_of(2), data }
    }

    /// Packs bf16 codes (`[n, k]` little-endian, scale 1) without changing a bit.
    pub fn from_bf16_rows(q: &QuantRows) -> Self {
        assert_eq!(q.kind, QuantKind::Bf16, "Bf16Panels: bf16 codes");
        let (n, k) = (q.rows, q.cols);
        assert_eq!(q.codes.len(), 2 * n * k, "Bf16Panels: code bytes");
        Self::from_code_rows(n, k, |j| &q.codes[j * 2 * k..][..2 * k])
    }

    /// Packs bf16 rows in place in a mapped checkpoint without changing a
    /// bit: the checkpoint's bytes are read once, straight into the panels.
    pub fn from_mapped(m: &MappedRows<u16>) -> Self {
        Self::from_code_rows(m.rows, m.cols, |j| {
            let row = m.row(j);
            // SAFETY: the same memory viewed as bytes (u8 has no alignment).
            unsafe { std::slice::from_raw_parts(row.as_ptr().cast::<u8>(), 2 * row.len()) }
        })
    }

    /// Packs `n` rows of `k` little-endian bf16 codes, row `j`'s `2k` bytes
    /// being `row(j)`.
    fn from_code_rows<'a>(n: usize, k: usize, row: impl Fn(usize) -> &'a [u8] + Sync) -> Self {
        let kpad = k.next_multiple_of(2);
        // A pair of depths is 4 bytes in a row and one u32 in a panel: the
        // packing is a transpose of u32 words (the last, odd depth alone).
        let mut data = zeroed(n.div_ceil(NR) * kpad * NR);
        let pairs = k / 2;
        // Panels are independent: the load's largest step runs on every thread.
        data.par_chunks_exact_mut(kpad * NR).enumerate().for_each(|(pi, panel)| {
            let j0 = pi * NR;
            let w = NR.min(n - j0);
            let row = |jj: usize| row(j0 + jj);
            // 16 × 16 blocks of words transposed in registers where the CPU
            // can; `done` pairs of the first `full` columns are then in place.
            let (full, done) = transpose_blocks(&row, w, pairs, panel);
            for jj in 0..w {
                let row = row(jj);
                assert_eq!(row.len(), 2 * k, "Bf16Panels: code bytes of a row");
                let skip = if jj < full { done } else { 0 };
                for (qi, pair) in row.chunks_exact(4).enumerate().take(pairs).skip(skip) {
                    let at = qi * 2 * NR + 2 * jj;
                    panel[at] = u16::from_le_bytes([pair[0], pair[1]]);
                    panel[at + 1] = u16::from_le_bytes([pair[2], pair[3]]);
                }
                if k % 2 == 1 {
                    panel[pairs * 2 * NR + 2 * jj] = u16::from_le_bytes([row[2 * k - 2], row[2 * k - 1]]);
                }
            }
        });
        Bf16Panels { kpad, data }
    }

    /// Bytes held.
    pub fn bytes(&self) -> usize {
        self.data.len() * 2
    }

    /// The panels as the GEMM reads them.
    pub(crate) fn source(&self) -> InPlace<u16> {
        InPlace { ptr: self.data.as_ptr(), kpad: self.kpad }
    }
}

/// Packs `B` (`n × k`, element `(j, p)` at `src[j * rs + p * cs]`), rounded
/// to bf16, into pair panels `[ceil(n/NR)][ceil(k/2)][NR][2]`.
pub(crate) fn pack_b_bf16(src: &[f32], n: usize, k: usize, rs: usize, cs: usize, out: &mut Vec<u16>) {
    #[cfg(target_arch = "x86_64")]
    if (cs == 1 || rs == 1) && std::is_x86_feature_detected!("avx512f") {
        // SAFETY: the CPU has AVX-512F, checked just above.
        return unsafe { words::pack_b_bf16_avx512(src, n, k, rs, cs, out) };
    }
    pack_pairs(n, k, rs, cs, |i| bf16_bits(src[i]), out)
}

/// Transposes whole 16 × 16 blocks of 4-byte words from `w` rows (`row(j)`,
/// `pairs` words each) into `panel`'s pair words (`[pairs][NR]`). Returns
/// how many leading columns (`full`) had how many leading pairs (`done`)
/// moved; the caller moves the rest.
#[cfg_attr(not(target_arch = "x86_64"), allow(unused_variables))]
fn transpose_blocks<'a>(row: &dyn Fn(usize) -> &'a [u8], w: usize, pairs: usize, panel: &mut [u16]) -> (usize, usize) {
    #[cfg(target_arch = "x86_64")]
    if std::is_x86_feature_detected!("avx512f") {
        let (full, done) = (w / 16 * 16, pairs / 16 * 16);
        for jb in (0..full).step_by(16) {
            let mut rows = [std::ptr::null::<u8>(); 16];
            for (i, r) in rows.iter_mut().enumerate() {
                let bytes = row(jb + i);
                // In bounds: each row holds `pairs` words.
                assert!(bytes.len() >= 4 * done, "transpose_blocks: row length");
                *r = bytes.as_ptr();
            }
            for qb in (0..done).step_by(16) {
                let dst = &mut panel[(qb * NR + jb) * 2..][..(15 * NR + 16) * 2];
                // SAFETY: the CPU has AVX-512F; rows hold words `qb..qb + 16`
                // (checked above) and `dst` covers the block.
                unsafe { words::transpose16(&rows, 4 * qb, dst.as_mut_ptr().cast(), NR) };
            }
        }
        return (full, done);
    }
    (0, 0)
}

/// 16 × 16 transposes of 32-bit words in AVX-512 registers.
#[cfg(target_arch = "x86_64")]
mod words {
    use super::{bf16_bits, fill_pairs, NR};
    use crate::backend::cpu::panels::store16;
    use std::arch::x86_64::*;

    /// `dst[c · ds + r] = word c of row r` (row r's 16 words at byte `at`
    /// of `rows[r]`; `dst` in words, unaligned). Three rounds of unpacks and
    /// lane shuffles.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn transpose16(rows: &[*const u8; 16], at: usize, dst: *mut u32, ds: usize) {
        // A plain loop: an `array::from_fn` closure would not inherit AVX-512.
        let mut r = [_mm512_setzero_si512(); 16];
        for (r, src) in r.iter_mut().zip(rows) {
            *r = _mm512_loadu_si512(src.add(at).cast());
        }
        store16(r, dst, ds);
    }

    /// Pair words `bits(x[i]) | bits(y[i]) << 16` of 16 values each: the
    /// crate's one rounding rule ([`bf16_bits`]), vectorised by the compiler
    /// in this AVX-512 context.
    #[inline(always)]
    unsafe fn words16(x: *const f32, y: *const f32) -> __m512i {
        let mut w = [0u32; 16];
        for (i, w) in w.iter_mut().enumerate() {
            *w = bf16_bits(*x.add(i)) as u32 | (bf16_bits(*y.add(i)) as u32) << 16;
        }
        _mm512_loadu_si512(w.as_ptr().cast())
    }

    /// The 32 f32 at `p` rounded to bf16, as 16 words `bits(2q) | bits(2q+1) << 16`.
    #[inline(always)]
    unsafe fn pair_words(p: *const f32) -> __m512i {
        let mut w = [0u32; 16];
        for (q, w) in w.iter_mut().enumerate() {
            *w = bf16_bits(*p.add(2 * q)) as u32 | (bf16_bits(*p.add(2 * q + 1)) as u32) << 16;
        }
        _mm512_loadu_si512(w.as_ptr().cast())
    }

    /// [`super::pack_b_bf16`] for `cs == 1` (depths contiguous: 16 × 32
    /// blocks rounded, then transposed in registers) or `rs == 1` (columns
    /// contiguous: two depths' rows rounded and interleaved); the same bits
    /// as the plain loop, which fills the ragged edges.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn pack_b_bf16_avx512(src: &[f32], n: usize, k: usize, rs: usize, cs: usize, out: &mut Vec<u16>) {
        let kpad = k.next_multiple_of(2);
        out.clear();
        out.resize(n.div_ceil(NR) * kpad * NR, 0);
        if n == 0 || k == 0 {
            return;
        }
        let pairs = k / 2;
        let last = (n - 1) * rs + (k - 1) * cs;
        assert!(src.len() > last, "pack_b_bf16: source size");
        let s = src.as_ptr();
        let get = |i: usize| bf16_bits(src[i]);
        for (pi, panel) in out.chunks_exact_mut(kpad * NR).enumerate() {
            let j0 = pi * NR;
            let w = NR.min(n - j0);
            let d = panel.as_mut_ptr().cast::<u32>();
            if cs == 1 {
                for jb in (0..w / 16 * 16).step_by(16) {
                    for qb in (0..pairs / 16 * 16).step_by(16) {
                        let mut r = [_mm512_setzero_si512(); 16];
                        for (i, r) in r.iter_mut().enumerate() {
                            *r = pair_words(s.add((j0 + jb + i) * rs + 2 * qb));
                        }
                        store16(r, d.add(qb * NR + jb), NR);
                    }
                }
                fill_pairs(panel, j0, w, k, rs, cs, &get, (w / 16 * 16, pairs / 16 * 32));
            } else if w == NR {
                // Depth pair q: columns j0.. of depths 2q and 2q+1, interleaved.
                for q in 0..pairs {
                    for h in 0..2 {
                        let at = j0 + 16 * h;
                        let words = words16(s.add(2 * q * cs + at), s.add((2 * q + 1) * cs + at));
                        _mm512_storeu_si512(d.add(q * NR + 16 * h).cast(), words);
                    }
                }
                fill_pairs(panel, j0, w, k, rs, cs, &get, (w, 2 * pairs));
            } else {
                fill_pairs(panel, j0, w, k, rs, cs, &get, (0, 0));
            }
        }
    }
}

/// Pair panels of `n × k` values, value `(j, p)` being `get(j * rs + p * cs)`;
/// padding columns and the odd depth are 0.
fn pack_pairs(n: usize, k: usize, rs: usize, cs: usize, get: impl Fn(usize) -> u16, out: &mut Vec<u16>) {
    let kpad = k.next_multiple_of(2);
    out.clear();
    out.resize(n.div_ceil(NR) * kpad * NR, 0);
    for (pi, panel) in out.chunks_exact_mut(kpad * NR).enumerate() {
        let j0 = pi * NR;
        fill_pairs(panel, j0, NR.min(n - j0), k, rs, cs, &get, (0, 0));
    }
}

/// Fills the `w` columns from `j0` of one pair panel (see [`pack_pairs`]),
/// except depths `< done.1` of columns `< done.0`, which are already in place.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn fill_pairs(
    panel: &mut [u16],
    j0: usize,
    w: usize,
    k: usize,
    rs: usize,
    cs: usize,
    get: &impl Fn(usize) -> u16,
    done: (usize, usize),
) {
    if cs == 1 {
        // Depths contiguous in the source: read along each column.
        for jj in 0..w {
            let base = (j0 + jj) * rs;
            let from = if jj < done.0 { done.1 } else { 0 };
            for p in from..k {
                panel[(p / 2) * 2 * NR + 2 * jj + p % 2] = get(base + p);
            }
        }
    } else {
        // Columns contiguous in the source (V): read along each depth.
        for (q, row) in panel.chunks_exact_mut(2 * NR).enumerate() {
            for e in 0..2.min(k - 2 * q) {
                let base = (2 * q + e) * cs + j0 * rs;
                let from = if 2 * q + e < done.1 { done.0 } else { 0 };
                for jj in from..w {
                    row[2 * jj + e] = get(base + jj * rs);
                }
            }
        }
    }
}

/// FP8 or INT4 panels seen as bf16 pair tiles: each tile is decoded as the
/// f32 GEMM decodes it, then rounded to bf16.
pub(crate) struct QuantAsBf16<'a>(pub(crate) &'a QuantPanels);

impl PanelSource for QuantAsBf16<'_> {
    type Elem = u16;
    const MC: usize = <QuantPanels as PanelSource>::MC;
    const REPACKS: bool = true;
    unsafe fn tile(&self, pi: usize, p0: usize, kc: usize, _k: usize, buf: &mut Vec<u16>) -> *const u16 {
        let pairs = kc.div_ceil(2);
        buf.resize(pairs * 2 * NR, 0);
        let mut rows = [0f32; 2 * NR];
        for (q, dst) in buf.chunks_exact_mut(2 * NR).enumerate() {
            let depth = (kc - 2 * q).min(2);
            self.0.decode_tile(pi, p0 + 2 * q, depth, &mut rows[..depth * NR]);
            rows[depth * NR..].fill(0.0);
            for (jj, pair) in dst.chunks_exact_mut(2).enumerate() {
                pair[0] = bf16_bits(rows[jj]);
                pair[1] = bf16_bits(rows[NR + jj]);
            }
        }
        buf.as_ptr()
    }
}

/// A wide path's micro-kernel: A as bf16-rounded f32 `[kpad][MR]`, B as pair tiles.
type WideKernel = unsafe fn(usize, *const f32, *const u16, *mut f32, usize, usize, usize, TileInit);
/// A pair path's micro-kernel: A and B both as bf16 pairs.
type PairKernel = unsafe fn(usize, *const u16, *const u16, *mut f32, usize, usize, usize, TileInit);

/// A bf16 path that widens B's pairs to f32 and multiplies with FMAs.
#[derive(Clone, Copy)]
pub(crate) struct WidePath {
    kernel: WideKernel,
    name: &'static str,
}

/// A bf16 path with a bf16 dot-product instruction, on pairs of both A and B.
#[derive(Clone, Copy)]
pub(crate) struct PairPath {
    kernel: PairKernel,
    name: &'static str,
}

/// A bf16 path on AMX tiles: A as rows of 32 bf16 depths, B as pair tiles.
#[derive(Clone, Copy)]
pub(crate) struct TilePath;

/// The bf16 path a CPU runs.
#[derive(Clone, Copy)]
pub(crate) enum Bf16Path {
    /// `avx2` or `portable`.
    Wide(WidePath),
    /// `avx512bf16`.
    Pairs(PairPath),
    /// `amx`.
    Tiles(TilePath),
}

/// Runs `$body` with `$p` bound to the concrete path inside `$path` (a
/// [`Bf16Path`]): one generic call, monomorphised per path.
macro_rules! with_bf16_path {
    ($path:expr, $p:ident => $body:expr) => {
        match $path {
            $crate::backend::cpu::gemm::bf16::Bf16Path::Wide($p) => $body,
            $crate::backend::cpu::gemm::bf16::Bf16Path::Pairs($p) => $body,
            $crate::backend::cpu::gemm::bf16::Bf16Path::Tiles($p) => $body,
        }
    };
}
pub(crate) use with_bf16_path;

impl Bf16Path {
    /// The kernel's name, as the manifest records it.
    pub(crate) fn name(self) -> &'static str {
        with_bf16_path!(self, p => Path::name(p))
    }
}

/// Whether this CPU has bf16 hardware (AMX or `avx512_bf16`), the condition
/// under which `--compute auto` picks bf16.
pub fn has_native_bf16() -> bool {
    !matches!(available().last(), Some(Bf16Path::Wide(_)))
}

/// The bf16 kernel `STRATA_BF16_KERNEL` names, if it is set: an error
/// naming this CPU's kernels when it names none of them (the GEMM itself
/// would fall back to the fastest with a warning).
pub fn kernel_override() -> Result<Option<&'static str>, UnknownKernel> {
    let Some(v) = std::env::var_os("STRATA_BF16_KERNEL") else { return Ok(None) };
    let names: Vec<&'static str> = available().iter().map(|p| p.name()).collect();
    match names.iter().find(|n| v == **n) {
        Some(n) => Ok(Some(n)),
        None => Err(UnknownKernel { asked: v.to_string_lossy().into_owned(), have: names.join(", ") }),
    }
}

/// A `STRATA_BF16_KERNEL` that names no bf16 kernel of this CPU.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("STRATA_BF16_KERNEL={asked}: not a bf16 kernel of this CPU (it has {have})")]
pub struct UnknownKernel {
    /// The value set.
    pub asked: String,
    /// This CPU's kernels, slowest first.
    pub have: String,
}

/// The fastest bf16 path this CPU has, or the one `STRATA_BF16_KERNEL`
/// names (`portable`, `avx2`, `avx512bf16`, `amx`) if this CPU has it: how
/// `benches/gemm` times every path, and how a run reproduces the last bits
/// of files made on a CPU with fewer paths. (The manifest records the
/// kernel, so a resume under another one is refused either way.)
pub(crate) fn detect() -> Bf16Path {
    static CHOSEN: std::sync::OnceLock<Bf16Path> = std::sync::OnceLock::new();
    *CHOSEN.get_or_init(|| {
        let paths = available();
        if let Ok(name) = std::env::var("STRATA_BF16_KERNEL") {
            if let Some(p) = paths.iter().find(|p| p.name() == name) {
                return *p;
            }
            let have: Vec<_> = paths.iter().map(|p| p.name()).collect();
            tracing::warn!("STRATA_BF16_KERNEL={name}: this CPU has only {}; using the fastest", have.join(", "));
        }
        *paths.last().expect("the portable path")
    })
}

/// Every bf16 path this CPU can run, slowest first (the tests run them all).
pub(crate) fn available() -> Vec<Bf16Path> {
    let mut v = vec![Bf16Path::Wide(WidePath { kernel: portable::kernel, name: "portable" })];
    #[cfg(target_arch = "x86_64")]
    {
        if std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma") {
            v.push(Bf16Path::Wide(WidePath { kernel: avx2::kernel, name: "avx2" }));
        }
        if std::is_x86_feature_detected!("avx512f") && std::is_x86_feature_detected!("avx512bf16") {
            v.push(Bf16Path::Pairs(PairPath { kernel: avx512bf16::kernel, name: "avx512bf16" }));
        }
        #[cfg(target_os = "linux")]
        if amx::supported() {
            v.push(Bf16Path::Tiles(TilePath));
        }
    }
    v
}

impl Path for WidePath {
    type A = f32;
    type B = u16;
    const STEP: usize = 2;

    fn pack_a(self, a: &[f32], lda: usize, i0: usize, rows: usize, p0: usize, kc: usize, out: &mut Vec<f32>) {
        pack_strips(a, lda, i0, rows, p0, kc, 2, out, |p, r| p * MR + r, |v| widen(bf16_bits(v)));
    }

    fn pack_b(self, src: &[f32], n: usize, k: usize, rs: usize, cs: usize, out: &mut Vec<u16>) {
        pack_b_bf16(src, n, k, rs, cs, out)
    }

    kernel_from_fields!();
}

impl Path for PairPath {
    type A = u16;
    type B = u16;
    const STEP: usize = 2;

    fn pack_a(self, a: &[f32], lda: usize, i0: usize, rows: usize, p0: usize, kc: usize, out: &mut Vec<u16>) {
        pack_strips(a, lda, i0, rows, p0, kc, 2, out, |p, r| (p / 2) * 2 * MR + 2 * r + p % 2, bf16_bits);
    }

    fn pack_b(self, src: &[f32], n: usize, k: usize, rs: usize, cs: usize, out: &mut Vec<u16>) {
        pack_b_bf16(src, n, k, rs, cs, out)
    }

    kernel_from_fields!();
}

impl Path for TilePath {
    type A = u16;
    type B = u16;
    const STEP: usize = 2;
    const A_STEP: usize = TILE_DEPTH;
    // One k-block for any depth a model has: the C tiles stay in their
    // registers over the whole sum and leave once, instead of once per 256
    // depths (a dense bf16 run took 14% less time, although each step now
    // reads its B tile from L2 rather than L1: the kernel prefetches both).
    const KC: usize = 1 << 16;
    // Row blocks hold 1 MiB of packed A, so it stays in L2 (2 MiB on the
    // Xeons with AMX) while every panel sweeps it: 512 rows 1024 deep, 160
    // rows for the down projection (2816 deep), which at `MC` (384 rows,
    // 2.1 MiB) streamed its A tiles from L3 for every panel (`benches/gemm`,
    // down: 533 -> 643-678 GFLOP/s, medians of two interleaved runs; budgets
    // of 0.75 to 1.75 MiB measured the same within the noise).
    const A_BYTES: usize = 1 << 20;
    const MR: usize = TILE_ROWS;
    const STRIPS: usize = 2;
    // The kernel prefetches each step's B lines one step ahead; the loop's
    // prefetch of the next panel on top of that made every GEMM shape of
    // `benches/gemm` about 10% slower.
    const PREFETCH_NEXT: bool = false;

    fn pack_a(self, a: &[f32], lda: usize, i0: usize, rows: usize, p0: usize, kc: usize, out: &mut Vec<u16>) {
        #[cfg(target_arch = "x86_64")]
        if std::is_x86_feature_detected!("avx512bw") {
            // SAFETY: the CPU has AVX-512BW (and so F), checked just above.
            return unsafe { pack_tile_strips_avx512(a, lda, i0, rows, p0, kc, out) };
        }
        pack_tile_strips(a, lda, i0, rows, p0, kc, out)
    }

    fn pack_b(self, src: &[f32], n: usize, k: usize, rs: usize, cs: usize, out: &mut Vec<u16>) {
        pack_b_bf16(src, n, k, rs, cs, out)
    }

    unsafe fn kernel(
        self,
        kc: usize,
        a: *const u16,
        b: *const u16,
        c: *mut f32,
        ldc: usize,
        rows: usize,
        cols: usize,
        init: TileInit,
    ) {
        #[cfg(all(target_arch = "x86_64", target_os = "linux"))]
        amx::kernel(kc, a, b, c, ldc, rows, cols, init);
        #[cfg(not(all(target_arch = "x86_64", target_os = "linux")))]
        unreachable!("the amx path is only offered on x86-64 Linux {:?}", (kc, a, b, c, ldc, rows, cols, init));
    }

    fn name(self) -> &'static str {
        "amx"
    }
}

/// [`pack_tile_strips`] compiled for AVX-512: the rounding loop runs 16 or
/// 32 values to a register (the same bits).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn pack_tile_strips_avx512(
    a: &[f32],
    lda: usize,
    i0: usize,
    rows: usize,
    p0: usize,
    kc: usize,
    out: &mut Vec<u16>,
) {
    pack_tile_strips(a, lda, i0, rows, p0, kc, out)
}

/// The AMX path's A packing: rows `[i0, i0+rows)` × depths `[p0, p0+kc)`
/// of A appended to `out` as 16-row strips, rounded to bf16.
#[inline(always)]
fn pack_tile_strips(a: &[f32], lda: usize, i0: usize, rows: usize, p0: usize, kc: usize, out: &mut Vec<u16>) {
    // `[kc/32][16][32]`: each 32-depth slab of the strip is one A tile,
    // its rows 64 bytes apart. A slab row is 32 consecutive depths of
    // one row of A, so the packing is a row copy, rounded on the way.
    use std::mem::MaybeUninit;
    let slabs = kc.div_ceil(TILE_DEPTH);
    let len = slabs * TILE_DEPTH * TILE_ROWS;
    let base = out.len();
    let total = rows.div_ceil(TILE_ROWS) * len;
    out.reserve(total);
    // Every element, padding included, is written once below (no zero-fill
    // pass over the block first).
    for (s, strip) in out.spare_capacity_mut()[..total].chunks_exact_mut(len).enumerate() {
        for r in 0..TILE_ROWS {
            let i = s * TILE_ROWS + r;
            let row = (i < rows).then(|| &a[(i0 + i) * lda + p0..][..kc]);
            let whole = row.map_or(0, |_| kc / TILE_DEPTH);
            if let Some(row) = row {
                // Whole slabs as fixed-size arrays: straight-line vector code,
                // no per-slab tail handling (the loop's overhead had rivalled
                // the rounding itself).
                let (slabs_in, _) = row.as_chunks::<TILE_DEPTH>();
                for (t, src) in slabs_in.iter().enumerate() {
                    let dst: &mut [MaybeUninit<u16>; TILE_DEPTH] =
                        (&mut strip[(t * TILE_ROWS + r) * TILE_DEPTH..][..TILE_DEPTH]).try_into().expect("a slab row");
                    for (d, v) in dst.iter_mut().zip(src) {
                        d.write(bf16_bits(*v));
                    }
                }
            }
            for t in whole..slabs {
                let dst = &mut strip[(t * TILE_ROWS + r) * TILE_DEPTH..][..TILE_DEPTH];
                let src = row.map_or(&[][..], |row| &row[t * TILE_DEPTH..kc.min((t + 1) * TILE_DEPTH)]);
                for (d, v) in dst.iter_mut().zip(src) {
                    d.write(bf16_bits(*v));
                }
                dst[src.len()..].fill(MaybeUninit::new(0));
            }
        }
    }
    // SAFETY: the loop above initialised all `total` new elements.
    unsafe { out.set_len(base + total) };
}

/// Depths per AMX tile step: an A tile row holds 32 bf16 (64 bytes).
const TILE_DEPTH: usize = 32;
/// Rows of an AMX A or C tile, the most a tile has: the AMX path's `MR`.
/// (12-row tiles ran at half the speed of 16-row ones.)
const TILE_ROWS: usize = 16;

/// AMX (`AMX-TILE` + `AMX-BF16`). Tile registers:
/// - `tmm0`, `tmm1`: C, 16 rows × 16 f32 (columns 0–15 and 16–31) of the
///   first strip; `tmm5`, `tmm6` of the second;
/// - `tmm2`, `tmm7`: A, 16 rows × 32 bf16 of the first and second strip;
/// - `tmm3`, `tmm4`: B, 16 pair rows × 16 columns × 2 bf16, read straight
///   from a pair panel at a 128-byte row stride.
///
/// Each call sums its `kc` depths (the whole depth: `KC` is larger than any
/// model's) from zero in the C tiles and adds the sum to C as the other
/// kernels do, so a row's bits do not depend on the rows beside it.
/// A call takes two strips (`STRIPS`), so each B tile loaded is used twice.
#[cfg(all(target_arch = "x86_64", target_os = "linux"))]
mod amx {
    use super::super::f32::avx512::store;
    use super::{TileInit, NR, TILE_DEPTH, TILE_ROWS as MR};
    use std::arch::asm;
    use std::arch::x86_64::*;
    use std::cell::Cell;
    use std::sync::OnceLock;

    /// Rows of a B tile: one per depth pair.
    const PAIR_ROWS: usize = TILE_DEPTH / 2;
    /// Bytes between an A tile's rows.
    const A_STRIDE: usize = TILE_DEPTH * 2;
    /// Bytes between a pair panel's rows (`NR` columns × 2 bf16).
    const B_STRIDE: usize = NR * 2 * 2;
    /// Bytes between the rows of the stored C tile.
    const C_STRIDE: usize = NR * 4;

    /// The 64-byte `ldtilecfg` operand: palette 1, then per tile its bytes
    /// per row (`u16`, from byte 16) and its rows (`u8`, from byte 48).
    #[repr(C, align(64))]
    struct Config([u8; 64]);

    const fn config() -> Config {
        let mut c = [0u8; 64];
        c[0] = 1;
        // (tile, rows, bytes per row)
        let tiles = [
            (0, MR, 64),
            (1, MR, 64),
            (2, MR, A_STRIDE),
            (3, PAIR_ROWS, 64),
            (4, PAIR_ROWS, 64),
            (5, MR, 64),
            (6, MR, 64),
            (7, MR, A_STRIDE),
        ];
        let mut i = 0;
        while i < tiles.len() {
            let (t, rows, colsb) = tiles[i];
            c[16 + 2 * t] = colsb as u8;
            c[17 + 2 * t] = (colsb >> 8) as u8;
            c[48 + t] = rows as u8;
            i += 1;
        }
        Config(c)
    }

    static CONFIG: Config = config();

    thread_local! {
        /// Whether this thread has loaded [`CONFIG`] into its tile registers.
        static CONFIGURED: Cell<bool> = const { Cell::new(false) };
    }

    /// Whether the CPU has AMX-TILE and AMX-BF16 (and AVX-512F, which the
    /// store uses), and Linux lets this process use the tile data: asked
    /// once with `arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)`, which
    /// grants it to every thread of the process.
    pub(super) fn supported() -> bool {
        static SUPPORTED: OnceLock<bool> = OnceLock::new();
        *SUPPORTED.get_or_init(|| {
            const ARCH_REQ_XCOMP_PERM: libc::c_long = 0x1023;
            const XFEATURE_XTILEDATA: libc::c_long = 18;
            // SAFETY: CPUID leaf 7 exists on every x86-64 CPU Rust targets
            // (the intrinsic is a safe fn on newer compilers than the MSRV).
            #[allow(unused_unsafe)]
            let leaf7 = unsafe { __cpuid_count(7, 0) };
            let (amx_bf16, amx_tile) = (leaf7.edx >> 22 & 1 == 1, leaf7.edx >> 24 & 1 == 1);
            if !(amx_bf16 && amx_tile && std::is_x86_feature_detected!("avx512f")) {
                return false;
            }
            // SAFETY: a plain system call with integer arguments.
            let granted = unsafe { libc::syscall(libc::SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) };
            if granted != 0 {
                tracing::debug!("AMX present but arch_prctl(ARCH_REQ_XCOMP_PERM) refused; bf16 uses AVX-512");
            }
            granted == 0
        })
    }

    /// The finished tiles of both strips, `tmm0` and `tmm1` side by side
    /// over `tmm5` and `tmm6`.
    #[repr(C, align(64))]
    struct Out([[f32; NR]; 2 * MR]);

    /// A B tile of zeros where a k-block's depths run out before 32.
    #[repr(C, align(64))]
    struct Tail([u16; PAIR_ROWS * 2 * NR]);

    /// `C[rows, cols] (init) + A · B tile` for up to two strips (`rows ≤ 2·MR`):
    /// with two, each B tile loaded feeds two `TDPBF16PS`, and the four C
    /// tiles' dependent chains overlap. Every C tile sums its steps in
    /// order in one chain, so a row's bits do not depend on whether its
    /// strip ran alone or paired.
    #[allow(clippy::too_many_arguments)]
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn kernel(
        kc: usize,
        a: *const u16,
        b: *const u16,
        c: *mut f32,
        ldc: usize,
        rows: usize,
        cols: usize,
        init: TileInit,
    ) {
        debug_assert!(supported() && rows <= 2 * MR, "amx kernel: no AMX, or more than two strips");
        if !CONFIGURED.get() {
            // SAFETY (here and below): `supported()` granted tile use; the
            // config is a valid palette-1 layout for the tiles used.
            asm!("ldtilecfg [{}]", in(reg) CONFIG.0.as_ptr(), options(nostack, readonly));
            CONFIGURED.set(true);
        }
        asm!("tilezero tmm0", "tilezero tmm1", "tilezero tmm5", "tilezero tmm6", options(nomem, nostack));
        // The second strip follows the first in the packed A block.
        let strip = kc.div_ceil(TILE_DEPTH) * TILE_DEPTH * MR;
        let two = rows > MR;
        let full = kc / TILE_DEPTH;
        for t in 0..full {
            // C's lines are claimed for writing two rows a step, while the
            // sum runs: the stores at the end then hit the cache instead of
            // waiting on memory. (A C model of this loop ran 1.3-1.4 times
            // faster with it; in `benches/gemm`, gate/up, the shape with the
            // largest C, 1.3 times, the others within noise.)
            if t * 2 < rows {
                prefetch_c(c.add(2 * t * ldc), cols);
                if t * 2 + 1 < rows {
                    prefetch_c(c.add((2 * t + 1) * ldc), cols);
                }
            }
            let (ap, bp) = (a.add(t * MR * TILE_DEPTH), b.add(t * PAIR_ROWS * 2 * NR));
            // A and B stream from L2: ask for the next step's tiles now
            // (for A alone this tripled the tile rate). The addresses may
            // lie past the packed block: `wrapping_add`.
            prefetch_tile(ap.wrapping_add(MR * TILE_DEPTH));
            prefetch_b(bp.wrapping_add(PAIR_ROWS * 2 * NR));
            if two {
                prefetch_tile(ap.wrapping_add(strip + MR * TILE_DEPTH));
                step2(ap, ap.add(strip), bp);
            } else {
                step(ap, bp);
            }
        }
        let short = kc - full * TILE_DEPTH;
        if short > 0 {
            // The last, short step: its pairs copied into a zeroed tile, so
            // no load reads past the k-block (A's padding depths are zero).
            let mut tail = Tail([0; PAIR_ROWS * 2 * NR]);
            let pairs = short.div_ceil(2);
            std::ptr::copy_nonoverlapping(b.add(full * PAIR_ROWS * 2 * NR), tail.0.as_mut_ptr(), pairs * 2 * NR);
            let ap = a.add(full * MR * TILE_DEPTH);
            if two {
                step2(ap, ap.add(strip), tail.0.as_ptr());
            } else {
                step(ap, tail.0.as_ptr());
            }
        }
        if matches!(init, TileInit::Zero) && rows == 2 * MR && cols == NR {
            // A whole block with nothing to add: the tiles go straight to C.
            let s = ldc * 4;
            asm!(
                "tilestored [{c0} + {s}*1], tmm0",
                "tilestored [{c1} + {s}*1], tmm1",
                "tilestored [{c2} + {s}*1], tmm5",
                "tilestored [{c3} + {s}*1], tmm6",
                c0 = in(reg) c,
                c1 = in(reg) c.add(16),
                c2 = in(reg) c.add(MR * ldc),
                c3 = in(reg) c.add(MR * ldc + 16),
                s = in(reg) s,
                options(nostack),
            );
            return;
        }
        // SAFETY: every element the loop below reads is stored first by
        // `tilestored` (the second strip's rows only when there is one).
        let mut out = std::mem::MaybeUninit::<Out>::uninit();
        let o = out.as_mut_ptr() as *mut f32;
        asm!(
            "tilestored [{o} + {s}*1], tmm0",
            "tilestored [{o1} + {s}*1], tmm1",
            o = in(reg) o,
            o1 = in(reg) o.add(16),
            s = in(reg) C_STRIDE,
            options(nostack),
        );
        if two {
            asm!(
                "tilestored [{o} + {s}*1], tmm5",
                "tilestored [{o1} + {s}*1], tmm6",
                o = in(reg) o.add(MR * NR),
                o1 = in(reg) o.add(MR * NR + 16),
                s = in(reg) C_STRIDE,
                options(nostack),
            );
        }
        for h in 0..rows.div_ceil(MR) {
            let mut acc = [[_mm512_setzero_ps(); 2]; MR];
            for (r, row) in acc.iter_mut().enumerate() {
                let v = o.add((h * MR + r) * NR);
                *row = [_mm512_load_ps(v), _mm512_load_ps(v.add(16))];
            }
            let sum = acc; // a copy to `store`: `acc` stays in registers (see the f32 kernel)
            store(&sum, c.add(h * MR * ldc), ldc, (rows - h * MR).min(MR), cols, init);
        }
    }

    /// Asks for the lines of one row of C (`cols` f32 at `c`) in a state
    /// that can be written (`prefetchw`; every CPU with AMX has it).
    #[inline(always)]
    unsafe fn prefetch_c(c: *const f32, cols: usize) {
        asm!("prefetchw [{}]", in(reg) c, options(nostack, readonly, preserves_flags));
        if cols > 16 {
            asm!("prefetchw [{}]", in(reg) c.add(16), options(nostack, readonly, preserves_flags));
        }
        asm!("prefetchw [{}]", in(reg) c.add(cols - 1), options(nostack, readonly, preserves_flags));
    }

    /// Prefetches the 16 cache lines of one A tile into L1. (A prefetch of an
    /// address past the end of a buffer does not fault.)
    #[inline(always)]
    unsafe fn prefetch_tile(a: *const u16) {
        let p = a as *const i8;
        for line in 0..MR {
            _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(line * A_STRIDE));
        }
    }

    /// Prefetches the 32 cache lines of one step's two B tiles (16 pair rows
    /// of a 32-column panel) into L1.
    #[inline(always)]
    unsafe fn prefetch_b(b: *const u16) {
        let p = b as *const i8;
        for line in 0..2 * PAIR_ROWS {
            _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(line * 64));
        }
    }

    /// One strip: `tmm0`, `tmm1` += an A tile (`MR` rows × 32 depths at `a`)
    /// · two B tiles (16 pair rows at `b`, columns 0–15 and 16–31).
    #[inline(always)]
    unsafe fn step(a: *const u16, b: *const u16) {
        asm!(
            "tileloadd tmm2, [{a} + {sa}*1]",
            "tileloadd tmm3, [{b} + {sb}*1]",
            "tileloadd tmm4, [{b1} + {sb}*1]",
            "tdpbf16ps tmm0, tmm2, tmm3",
            "tdpbf16ps tmm1, tmm2, tmm4",
            a = in(reg) a,
            sa = in(reg) A_STRIDE,
            b = in(reg) b,
            b1 = in(reg) b.add(NR),
            sb = in(reg) B_STRIDE,
            options(nostack, readonly),
        );
    }

    /// Two strips: [`step`] for the first (A tile at `a0`) and the same into
    /// `tmm5`, `tmm6` for the second (A tile at `a1`, in `tmm7`).
    #[inline(always)]
    unsafe fn step2(a0: *const u16, a1: *const u16, b: *const u16) {
        asm!(
            "tileloadd tmm2, [{a0} + {sa}*1]",
            "tileloadd tmm3, [{b} + {sb}*1]",
            "tileloadd tmm7, [{a1} + {sa}*1]",
            "tdpbf16ps tmm0, tmm2, tmm3",
            "tileloadd tmm4, [{b1} + {sb}*1]",
            "tdpbf16ps tmm5, tmm7, tmm3",
            "tdpbf16ps tmm1, tmm2, tmm4",
            "tdpbf16ps tmm6, tmm7, tmm4",
            a0 = in(reg) a0,
            a1 = in(reg) a1,
            sa = in(reg) A_STRIDE,
            b = in(reg) b,
            b1 = in(reg) b.add(NR),
            sb = in(reg) B_STRIDE,
            options(nostack, readonly),
        );
    }
}

mod portable {
    use super::{widen, TileInit, MR, NR};

    /// See `f32::portable`: the tile aligned to a cache line.
    #[repr(C, align(64))]
    struct Tile([[f32; NR]; MR]);

    #[allow(clippy::too_many_arguments)]
    pub(super) unsafe fn kernel(
        kc: usize,
        a: *const f32,
        b: *const u16,
        c: *mut f32,
        ldc: usize,
        rows: usize,
        cols: usize,
        init: TileInit,
    ) {
        let mut tile = Tile([[0f32; NR]; MR]);
        let acc = &mut tile.0;
        for q in 0..kc.div_ceil(2) {
            let bv = std::slice::from_raw_parts(b.add(q * 2 * NR), 2 * NR);
            let a0 = std::slice::from_raw_parts(a.add(2 * q * MR), MR);
            let a1 = std::slice::from_raw_parts(a.add((2 * q + 1) * MR), MR);
            for r in 0..MR {
                for j in 0..NR {
                    // Exact products: the same bits as an FMA.
                    acc[r][j] += a1[r] * widen(bv[2 * j + 1]);
                    acc[r][j] += a0[r] * widen(bv[2 * j]);
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
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::super::f32::avx2::{blocks, store, Acc, SR};
    use super::{TileInit, MR, NR};
    use std::arch::x86_64::*;

    #[allow(clippy::too_many_arguments)]
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn kernel(
        kc: usize,
        a: *const f32,
        b: *const u16,
        c: *mut f32,
        ldc: usize,
        rows: usize,
        cols: usize,
        init: TileInit,
    ) {
        blocks(rows, cols, |r0, c0, r, n| {
            let acc = sub_tile(kc, a.add(r0), b.add(2 * c0));
            store(&acc, c.add(r0 * ldc + c0), ldc, r, n, init, c0);
        });
    }

    /// One 6 × 16 block: `a` at the block's first row of the strip, `b` at
    /// its first column's pair of the tile.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn sub_tile(kc: usize, a: *const f32, b: *const u16) -> Acc {
        let mut acc = [[_mm256_setzero_ps(); 2]; SR];
        let high = _mm256_set1_epi32(0xffff_0000u32 as i32);
        let (mut ap, mut bp) = (a, b);
        for _ in 0..kc.div_ceil(2) {
            // Eight columns' pairs per vector: the odd depth is the high half
            // of each 32-bit lane, the even one the low half.
            let x0 = _mm256_loadu_si256(bp as *const __m256i);
            let x1 = _mm256_loadu_si256(bp.add(16) as *const __m256i);
            let (o0, o1) =
                (_mm256_castsi256_ps(_mm256_and_si256(x0, high)), _mm256_castsi256_ps(_mm256_and_si256(x1, high)));
            for (r, row) in acc.iter_mut().enumerate() {
                let av = _mm256_broadcast_ss(&*ap.add(MR + r));
                row[0] = _mm256_fmadd_ps(av, o0, row[0]);
                row[1] = _mm256_fmadd_ps(av, o1, row[1]);
            }
            let (e0, e1) =
                (_mm256_castsi256_ps(_mm256_slli_epi32(x0, 16)), _mm256_castsi256_ps(_mm256_slli_epi32(x1, 16)));
            for (r, row) in acc.iter_mut().enumerate() {
                let av = _mm256_broadcast_ss(&*ap.add(r));
                row[0] = _mm256_fmadd_ps(av, e0, row[0]);
                row[1] = _mm256_fmadd_ps(av, e1, row[1]);
            }
            ap = ap.add(2 * MR);
            bp = bp.add(2 * NR);
        }
        acc
    }
}

#[cfg(target_arch = "x86_64")]
mod avx512bf16 {
    use super::super::f32::avx512::store;
    use super::{TileInit, MR, NR};
    use std::arch::x86_64::*;

    /// `VDPBF16PS` over the whole `MR × NR` tile: 24 accumulators, two B
    /// vectors of 16 column pairs, one broadcast A pair.
    #[allow(clippy::too_many_arguments)]
    #[target_feature(enable = "avx512f,avx512bf16")]
    pub(super) unsafe fn kernel(
        kc: usize,
        a: *const u16,
        b: *const u16,
        c: *mut f32,
        ldc: usize,
        rows: usize,
        cols: usize,
        init: TileInit,
    ) {
        let mut acc = [[_mm512_setzero_ps(); 2]; MR];
        let (mut ap, mut bp) = (a, b);
        for _ in 0..kc.div_ceil(2) {
            let b0: __m512bh = std::mem::transmute(_mm512_loadu_si512(bp as *const _));
            let b1: __m512bh = std::mem::transmute(_mm512_loadu_si512(bp.add(NR) as *const _));
            for (r, row) in acc.iter_mut().enumerate() {
                let pair = std::ptr::read_unaligned(ap.add(2 * r) as *const i32);
                let av: __m512bh = std::mem::transmute(_mm512_set1_epi32(pair));
                row[0] = _mm512_dpbf16_ps(row[0], av, b0);
                row[1] = _mm512_dpbf16_ps(row[1], av, b1);
            }
            ap = ap.add(2 * MR);
            bp = bp.add(2 * NR);
        }
        // A copy goes to `store`, so `acc` stays in registers (see the f32 kernel).
        let out = acc;
        store(&out, c, ldc, rows, cols, init)
    }
}

/// The pair path's arithmetic in plain Rust, for the tests: it checks the
/// pair packing of A and B on machines without `avx512_bf16`.
#[cfg(test)]
mod pairs_portable {
    use super::{widen, TileInit, MR, NR};

    #[allow(clippy::too_many_arguments)]
    pub(super) unsafe fn kernel(
        kc: usize,
        a: *const u16,
        b: *const u16,
        c: *mut f32,
        ldc: usize,
        rows: usize,
        cols: usize,
        init: TileInit,
    ) {
        let mut acc = [[0f32; NR]; MR];
        for q in 0..kc.div_ceil(2) {
            let (ap, bp) = (a.add(q * 2 * MR), b.add(q * 2 * NR));
            for (r, row) in acc.iter_mut().enumerate() {
                for (j, v) in row.iter_mut().enumerate() {
                    *v += widen(*ap.add(2 * r + 1)) * widen(*bp.add(2 * j + 1));
                    *v += widen(*ap.add(2 * r)) * widen(*bp.add(2 * j));
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
}

#[cfg(test)]
mod tests {
    use super::super::{gemm_tiles, rand, ARows, Init};
    use super::*;

    fn round(v: &[f32]) -> Vec<f32> {
        v.iter().map(|x| widen(bf16_bits(*x))).collect()
    }

    /// `x·wᵀ + b` of the bf16-rounded inputs, in f64.
    fn exact(x: &[f32], w: &[f32], bias: &[f32], m: usize, n: usize, k: usize) -> Vec<f64> {
        let (x, w) = (round(x), round(w));
        let mut y = vec![0f64; m * n];
        for i in 0..m {
            for j in 0..n {
                let s: f64 = (0..k).map(|p| x[i * k + p] as f64 * w[j * k + p] as f64).sum();
                y[i * n + j] = s + bias[j] as f64;
            }
        }
        y
    }

    fn run(path: Bf16Path, panels: &Bf16Panels, x: &[f32], m: usize, n: usize, k: usize, bias: &[f32]) -> Vec<f32> {
        let mut y = vec![f32::NAN; m * n];
        let src = panels.source();
        let init = Init::Bias(bias);
        // SAFETY: y holds m × n floats; the panels were packed for n × k.
        unsafe {
            with_bf16_path!(path, p => gemm_tiles(
                p,
                ARows::Plain(x, k),
                m,
                k,
                &src,
                n,
                0..n.div_ceil(NR),
                y.as_mut_ptr(),
                n,
                init,
                &mut Vec::new(),
                &mut Vec::new(),
            ))
        }
        y
    }

    /// Every path this CPU has computes the bf16-rounded product to f32
    /// accuracy, on ragged sizes, odd depths and depths past one k-block;
    /// `avx2` and `portable` agree bit for bit.
    #[test]
    fn every_path_computes_the_rounded_product() {
        let mut paths = available();
        println!("bf16 paths on this CPU: {:?}", paths.iter().map(|p| p.name()).collect::<Vec<_>>());
        paths.push(Bf16Path::Pairs(PairPath { kernel: pairs_portable::kernel, name: "pairs-portable" }));
        for &(m, n, k) in &[(1, 1, 1), (13, 33, 7), (121, 70, 300), (5, 96, 24), (30, 40, 1037), (7, 5, 2049)] {
            let (x, w, b) = (rand(m * k, 1), rand(n * k, 2), rand(n, 3));
            let panels = Bf16Panels::from_f32(&w, n, k);
            let want = exact(&x, &w, &b, m, n, k);
            let mut outs = Vec::new();
            for &path in &paths {
                let y = run(path, &panels, &x, m, n, k, &b);
                for (i, (a, e)) in y.iter().zip(&want).enumerate() {
                    let tol = 1e-5 * (k as f64).sqrt() * (1.0 + e.abs());
                    assert!((*a as f64 - e).abs() <= tol, "{} m{m} n{n} k{k} at {i}: {a} vs {e}", path.name());
                }
                outs.push((path, y));
            }
            // Exact products, the same order: the portable and avx2 paths and
            // the portable pair arithmetic give the same bits (the hardware
            // paths sum in their own order).
            let same: Vec<_> = outs.iter().filter(|(p, _)| !["avx512bf16", "amx"].contains(&p.name())).collect();
            for pair in same.windows(2) {
                let equal = pair[0].1.iter().zip(&pair[1].1).all(|(a, b)| a.to_bits() == b.to_bits());
                assert!(equal, "{} and {} differ", pair[0].0.name(), pair[1].0.name());
            }
        }
    }

    /// On every path, a row's result does not depend on which rows share its
    /// call (a short last strip, a different row block): batch invariance.
    #[test]
    fn rows_do_not_depend_on_the_batch_on_any_path() {
        let (n, k) = (70, 300);
        let (w, b) = (rand(n * k, 5), rand(n, 7));
        let panels = Bf16Panels::from_f32(&w, n, k);
        let x = rand(500 * k, 6);
        for path in available() {
            let full = run(path, &panels, &x, 500, n, k, &b);
            for (start, len) in [(0, 1), (17, 5), (130, 70), (7, 493)] {
                let part = run(path, &panels, &x[start * k..(start + len) * k], len, n, k, &b);
                let same = part.iter().zip(&full[start * n..]).all(|(p, f)| p.to_bits() == f.to_bits());
                assert!(same, "{}: rows {start}..{}", path.name(), start + len);
            }
        }
    }

    /// The vector packing of f32 into pair panels (both source layouts:
    /// K's depths contiguous, V's columns contiguous) gives the plain loop's
    /// bits, ragged edges, NaN, infinities and ties included.
    #[test]
    fn pair_packing_is_the_same_on_every_isa() {
        let special = [f32::NAN, -f32::NAN, f32::INFINITY, f32::NEG_INFINITY, f32::from_bits(0x3f80_8000), 1e-40];
        for (n, k) in [(16, 32), (45, 77), (64, 64), (33, 31), (7, 200), (96, 2)] {
            let mut src = rand(n * k + 3, (n * k) as u64);
            for (i, v) in special.iter().enumerate() {
                src[i * 7 % (n * k)] = *v;
            }
            for (rs, cs) in [(k, 1), (1, n)] {
                let mut want = Vec::new();
                pack_pairs(n, k, rs, cs, |i| bf16_bits(src[i]), &mut want);
                let mut got = vec![7u16; 3];
                pack_b_bf16(&src, n, k, rs, cs, &mut got);
                assert_eq!(got, want, "n {n} k {k} rs {rs} cs {cs}");
            }
        }
    }

    #[test]
    fn bf16_codes_pack_bit_for_bit_like_their_f32_values() {
        for (n, k) in [(45, 77), (64, 64), (16, 33)] {
            let w = round(&rand(n * k, 4));
            let codes: Vec<u8> = w.iter().flat_map(|v| bf16_bits(*v).to_le_bytes()).collect();
            let q = QuantRows { kind: QuantKind::Bf16, rows: n, cols: k, codes, seg: vec![0, k], scales: vec![1.0; n] };
            assert_eq!(Bf16Panels::from_bf16_rows(&q).data, Bf16Panels::from_f32(&w, n, k).data, "n {n} k {k}");
        }
    }

    #[test]
    fn bf16_rows_in_place_pack_like_their_copied_codes() {
        use crate::hf::quant::{LinearWeight, MappedRows};
        use std::sync::Arc;
        // A [70, 301] bf16 tensor as a checkpoint holds it; a block of its
        // rows and columns (a tensor-parallel rank's), stacked with another
        // block (a fused gate/up), against the same codes copied.
        let (rows, width) = (70, 301);
        let t: Arc<Vec<u16>> = Arc::new(rand(rows * width, 12).iter().map(|v| bf16_bits(*v)).collect());
        let bytes: &[u8] = bytemuck::cast_slice(&t[..]);
        let keep = || Some(Arc::clone(&t) as Arc<dyn Send + Sync>);
        for cols in [11..272, 0..301, 5..6] {
            // SAFETY: `keep` holds the tensor the bytes view.
            let a = unsafe { MappedRows::<u16>::new(bytes, width, 3..40, cols.clone(), keep()) }.unwrap();
            let b = unsafe { MappedRows::<u16>::new(bytes, width, 50..70, cols.clone(), keep()) }.unwrap();
            let LinearWeight::MappedBf16(m) =
                LinearWeight::stack(vec![LinearWeight::MappedBf16(a), LinearWeight::MappedBf16(b)])
            else {
                panic!("mapped bf16 blocks must stack in place")
            };
            assert_eq!(m.rows, 57);
            let q = m.to_quant_rows();
            assert_eq!(q.codes[..2], t[3 * width + cols.start].to_le_bytes(), "first code");
            assert_eq!(Bf16Panels::from_mapped(&m).data, Bf16Panels::from_bf16_rows(&q).data, "cols {cols:?}");
        }
        // A misaligned view is refused (the checkpoint then copies).
        assert!(unsafe { MappedRows::<u16>::new(&bytes[1..], width, 0..1, 0..4, None) }.is_none());
    }

    #[test]
    fn quantized_tiles_are_the_rounded_dequantized_weight() {
        for kind in [QuantKind::Fp8, QuantKind::Int4, QuantKind::Mxfp4] {
            let (n, k) = (40, 301);
            let seg = QuantRows::segments(0, k, 128);
            let mask = if kind == QuantKind::Fp8 { 0x77 } else { 0x0f };
            let codes = rand(n * k, 8).iter().map(|v| ((v + 0.5) * 255.9) as u8 & mask).collect();
            let scales = rand(n * (seg.len() - 1), 9).iter().map(|v| v + 0.75).collect();
            let q = QuantRows { kind, rows: n, cols: k, codes, seg, scales };
            let want = Bf16Panels::from_f32(&q.dequantize(), n, k);
            let panels = QuantPanels::pack(&q);
            let mut buf = Vec::new();
            for pi in 0..n.div_ceil(NR) {
                for (p0, kc) in [(0, k), (128, 173), (300, 1)] {
                    // SAFETY: the tile is read before buf changes.
                    let tile = unsafe {
                        let t = QuantAsBf16(&panels).tile(pi, p0, kc, k, &mut buf);
                        std::slice::from_raw_parts(t, kc.div_ceil(2) * 2 * NR).to_vec()
                    };
                    let off = pi * want.kpad * NR + p0 * NR;
                    let full = kc / 2 * 2 * NR;
                    assert_eq!(tile[..full], want.data[off..off + full], "{kind:?} panel {pi} depths {p0}+{kc}");
                }
            }
        }
    }
}
