//! The GEMM's view of B: `NR`-wide column panels laid out `[k][NR]`, and the
//! register-tile sizes every kernel shares. f32 panels are read in place;
//! quantised ones ([`super::quant_panels`]) decode each tile as it is reached,
//! and f32 weights still in the mapped checkpoint are transposed per tile.

use crate::hf::quant::MappedRows;

/// Rows of the register tile.
pub const MR: usize = 12;
/// Columns of the register tile (two 16-lane vectors).
pub const NR: usize = 32;
/// Depth of one k-block: sums over more than `KC` terms are split at multiples of it.
pub const KC: usize = 128;
/// Rows of A per block: each B tile is read from memory once per block, so a
/// MoE expert (a few hundred rows) streams its weights once.
pub const MC: usize = 32 * MR;

/// Packs `B` (`n × k`, element `(j, p)` at `src[j * rs + p * cs]`) into `NR`-wide
/// panels `[ceil(n/NR)][k][NR]`, zero-padding the last panel.
pub fn pack_b(src: &[f32], n: usize, k: usize, rs: usize, cs: usize, out: &mut Vec<f32>) {
    let panels = n.div_ceil(NR);
    out.clear();
    out.resize(panels * k * NR, 0.0);
    for (pi, panel) in out.chunks_exact_mut(k * NR).enumerate() {
        let j0 = pi * NR;
        let w = NR.min(n - j0);
        if cs == 1 {
            for jj in 0..w {
                let row = &src[(j0 + jj) * rs..(j0 + jj) * rs + k];
                for (p, v) in row.iter().enumerate() {
                    panel[p * NR + jj] = *v;
                }
            }
        } else {
            for p in 0..k {
                let dst = &mut panel[p * NR..p * NR + w];
                for (jj, d) in dst.iter_mut().enumerate() {
                    *d = src[(j0 + jj) * rs + p * cs];
                }
            }
        }
    }
}

/// Weights read in place from a mapped checkpoint: each `[kc][NR]` tile is
/// transposed from the weight rows when the GEMM asks for it (once per row
/// block), so an f32 checkpoint is never copied into packed panels. (Blocks
/// twice as tall halve the transposes but were slower on the dense bench
/// model: a k-block of A then no longer stays in a 512 KiB L2.)
impl PanelSource for MappedRows<f32> {
    type Elem = f32;
    const MC: usize = MC;
    const REPACKS: bool = true;

    unsafe fn tile(&self, pi: usize, p0: usize, kc: usize, _k: usize, buf: &mut Vec<f32>) -> *const f32 {
        let j0 = pi * NR;
        let n = NR.min(self.rows - j0);
        let mut starts = [std::ptr::null::<f32>(); NR];
        for (jj, s) in starts.iter_mut().enumerate().take(n) {
            *s = self.start(j0 + jj).add(p0);
        }
        buf.clear();
        buf.reserve(kc * NR);
        // SAFETY: `transpose_rows` writes all `kc * NR` values.
        transpose_rows(&starts[..n], kc, buf.spare_capacity_mut().as_mut_ptr().cast::<f32>(), simd_transpose());
        buf.set_len(kc * NR);
        buf.as_ptr()
    }

    fn prefetch(&self, pi: usize, p0: usize, kc: usize, _kpad: usize, part: usize, parts: usize) {
        // The tile's source is a segment of each of its rows: the transpose
        // then reads them from L2 rather than waiting on memory row by row.
        let j0 = pi * NR;
        let n = NR.min(self.rows - j0);
        let per_row = (kc * 4).div_ceil(64) + 1;
        for l in share(n * per_row, part, parts) {
            let at = self.start(j0 + l / per_row).wrapping_add(p0) as *const u8;
            prefetch_lines(at, l % per_row..l % per_row + 1);
        }
    }
}

/// The vector transpose this CPU has.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
enum Simd {
    None,
    Avx2,
    Avx512,
}

/// The widest vector transpose this CPU has.
fn simd_transpose() -> Simd {
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx512f") {
            return Simd::Avx512;
        }
        if std::arch::is_x86_feature_detected!("avx2") {
            return Simd::Avx2;
        }
    }
    Simd::None
}

/// Writes `out[p][jj] = rows[jj][p]` for `p < kc`, `jj < NR` (zero where
/// `jj >= rows.len()`): one `[kc][NR]` tile from up to `NR` rows; 16 (AVX-512)
/// or 8 (AVX2) rows at a time with `simd`, the rest one value at a time.
///
/// # Safety
/// Each row must be readable for `kc` values, `out` writable for `kc * NR`,
/// and `simd` only what [`simd_transpose`] says.
#[cfg_attr(not(target_arch = "x86_64"), allow(unused_mut, unused_variables))]
unsafe fn transpose_rows(rows: &[*const f32], kc: usize, out: *mut f32, simd: Simd) {
    let n = rows.len();
    let mut done = 0;
    #[cfg(target_arch = "x86_64")]
    if simd != Simd::None {
        let (width, deep) = if simd == Simd::Avx512 { (16, kc / 16 * 16) } else { (8, kc / 8 * 8) };
        done = n / width * width;
        for jb in (0..done).step_by(width) {
            if simd == Simd::Avx512 {
                transpose_avx512(&rows[jb..jb + 16], deep, out.add(jb));
            } else {
                transpose_avx2(&rows[jb..jb + 8], deep, out.add(jb));
            }
        }
        // The k tail of those rows.
        for p in deep..kc {
            for (jj, r) in rows.iter().enumerate().take(done) {
                *out.add(p * NR + jj) = *r.add(p);
            }
        }
    }
    for p in 0..kc {
        let dst = out.add(p * NR);
        for (jj, r) in rows.iter().enumerate().skip(done) {
            *dst.add(jj) = *r.add(p);
        }
        for jj in n..NR {
            *dst.add(jj) = 0.0;
        }
    }
}

/// Sixteen rows' first `kc16` (a multiple of 16) values into columns `0..16`
/// of `out` (`[kc][NR]`), a 16 × 16 register transpose at a time.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn transpose_avx512(rows: &[*const f32], kc16: usize, out: *mut f32) {
    use std::arch::x86_64::*;
    let r = &rows[..16];
    for p in (0..kc16).step_by(16) {
        // Plain loops, not `array::from_fn`: its closure does not inherit
        // this function's target features, so the intrinsics were calls.
        let mut v = [_mm512_setzero_si512(); 16];
        for (v, r) in v.iter_mut().zip(r) {
            *v = _mm512_loadu_si512(r.add(p).cast());
        }
        store16(v, out.add(p * NR).cast(), NR);
    }
}

/// Stores the transpose of the 16 rows `r` at `dst` (`ds` words apart).
///
/// # Safety
/// The CPU has AVX-512F (the caller is compiled for it), and `dst` is
/// writable for `15 · ds + 16` words.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[inline]
pub(crate) unsafe fn store16(r: [std::arch::x86_64::__m512i; 16], dst: *mut u32, ds: usize) {
    use std::arch::x86_64::*;
    // Words of rows 2i, 2i+1 interleaved; then 4 rows' words per 128-bit lane.
    // (Plain loops: an `array::from_fn` closure would not inherit AVX-512.)
    let mut t = [_mm512_setzero_si512(); 16];
    for i in (0..16).step_by(2) {
        t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    }
    // u[4g + j]: rows 4g..4g+4 of columns 4l + j in lane l.
    let mut u = [_mm512_setzero_si512(); 16];
    for g in 0..4 {
        for j in 0..4 {
            let (a, b) = (t[4 * g + j / 2], t[4 * g + 2 + j / 2]);
            u[4 * g + j] = if j % 2 == 0 { _mm512_unpacklo_epi64(a, b) } else { _mm512_unpackhi_epi64(a, b) };
        }
    }
    for j in 0..4 {
        let v = _mm512_shuffle_i32x4::<0b10_00_10_00>(u[j], u[4 + j]);
        let w = _mm512_shuffle_i32x4::<0b11_01_11_01>(u[j], u[4 + j]);
        let x = _mm512_shuffle_i32x4::<0b10_00_10_00>(u[8 + j], u[12 + j]);
        let y = _mm512_shuffle_i32x4::<0b11_01_11_01>(u[8 + j], u[12 + j]);
        _mm512_storeu_si512(dst.add(j * ds).cast(), _mm512_shuffle_i32x4::<0b10_00_10_00>(v, x));
        _mm512_storeu_si512(dst.add((4 + j) * ds).cast(), _mm512_shuffle_i32x4::<0b10_00_10_00>(w, y));
        _mm512_storeu_si512(dst.add((8 + j) * ds).cast(), _mm512_shuffle_i32x4::<0b11_01_11_01>(v, x));
        _mm512_storeu_si512(dst.add((12 + j) * ds).cast(), _mm512_shuffle_i32x4::<0b11_01_11_01>(w, y));
    }
}

/// Eight rows' first `kc8` (a multiple of 8) values into columns `0..8` of
/// `out` (`[kc][NR]`), an 8 × 8 register transpose at a time.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn transpose_avx2(rows: &[*const f32], kc8: usize, out: *mut f32) {
    use std::arch::x86_64::*;
    let r = &rows[..8];
    for p in (0..kc8).step_by(8) {
        let mut v = [_mm256_setzero_ps(); 8];
        for (v, r) in v.iter_mut().zip(r) {
            *v = _mm256_loadu_ps(r.add(p));
        }
        let t0 = _mm256_unpacklo_ps(v[0], v[1]);
        let t1 = _mm256_unpackhi_ps(v[0], v[1]);
        let t2 = _mm256_unpacklo_ps(v[2], v[3]);
        let t3 = _mm256_unpackhi_ps(v[2], v[3]);
        let t4 = _mm256_unpacklo_ps(v[4], v[5]);
        let t5 = _mm256_unpackhi_ps(v[4], v[5]);
        let t6 = _mm256_unpacklo_ps(v[6], v[7]);
        let t7 = _mm256_unpackhi_ps(v[6], v[7]);
        // Rows 0-3 (and 4-7) of columns q and q+4, one per 128-bit lane.
        let s0 = _mm256_shuffle_ps::<0x44>(t0, t2);
        let s1 = _mm256_shuffle_ps::<0xEE>(t0, t2);
        let s2 = _mm256_shuffle_ps::<0x44>(t1, t3);
        let s3 = _mm256_shuffle_ps::<0xEE>(t1, t3);
        let s4 = _mm256_shuffle_ps::<0x44>(t4, t6);
        let s5 = _mm256_shuffle_ps::<0xEE>(t4, t6);
        let s6 = _mm256_shuffle_ps::<0x44>(t5, t7);
        let s7 = _mm256_shuffle_ps::<0xEE>(t5, t7);
        let cols = [
            _mm256_permute2f128_ps::<0x20>(s0, s4),
            _mm256_permute2f128_ps::<0x20>(s1, s5),
            _mm256_permute2f128_ps::<0x20>(s2, s6),
            _mm256_permute2f128_ps::<0x20>(s3, s7),
            _mm256_permute2f128_ps::<0x31>(s0, s4),
            _mm256_permute2f128_ps::<0x31>(s1, s5),
            _mm256_permute2f128_ps::<0x31>(s2, s6),
            _mm256_permute2f128_ps::<0x31>(s3, s7),
        ];
        for (q, c) in cols.into_iter().enumerate() {
            _mm256_storeu_ps(out.add((p + q) * NR), c);
        }
    }
}

/// A zeroed buffer of `len` values (weight panels, activations). Above
/// 4 MiB, Linux is asked (`MADV_HUGEPAGE`) to back it with 2 MiB pages
/// before it is first written: a model's panels are hundreds of MB, and
/// faulting them in 4 KiB at a time cost about as much as packing them; an
/// activation's rows lie kilobytes apart, so a GEMM's C tile otherwise
/// touches a page per row.
pub(crate) fn zeroed<T: Copy + Default>(len: usize) -> Vec<T> {
    // `vec![0; n]` of a number is a zeroed allocation: under the system
    // allocator no page is touched yet; under `CacheAligned` (which zeroes
    // an aligned block itself) the allocator gave the advice before zeroing.
    let v = vec![T::default(); len];
    let bytes = std::mem::size_of_val(v.as_slice());
    #[cfg(target_os = "linux")]
    if bytes >= 4 << 20 {
        // SAFETY: advice on pages inside this allocation; it changes how
        // they are backed, never their contents.
        unsafe { super::alloc::advise_huge(v.as_ptr() as *mut u8, bytes) };
    }
    v
}

/// Prefetches cache lines `lines` (64 bytes each) from `p` into L2. A hint
/// only: the lines are never read, and a prefetch does not fault.
#[inline(always)]
pub(crate) fn prefetch_lines(p: *const u8, lines: std::ops::Range<usize>) {
    #[cfg(target_arch = "x86_64")]
    for l in lines {
        // SAFETY: a prefetch has no architectural effect and never faults.
        unsafe {
            std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T1 }>(p.wrapping_add(64 * l) as *const i8)
        };
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (p, lines);
}

/// Where the GEMM gets B's `[kc][NR]` tiles from.
pub(crate) trait PanelSource {
    /// Element of a tile (f32, or bf16 bits in depth pairs).
    type Elem;
    /// Rows of A per block: each B tile is fetched (or decoded) once per block.
    const MC: usize;
    /// Whether each tile is decoded or transposed anew per row block: such
    /// sources keep row blocks `MC` tall, which amortises that work, where
    /// a path may otherwise shorten them ([`Path::A_BYTES`]).
    const REPACKS: bool = false;
    /// The tile of panel `pi` at depths `p0..p0+kc` (`k` in all).
    ///
    /// # Safety
    /// The returned pointer is valid for reading the whole tile until `buf` changes.
    unsafe fn tile(&self, pi: usize, p0: usize, kc: usize, k: usize, buf: &mut Vec<Self::Elem>) -> *const Self::Elem;
    /// Prefetches share `part` of `parts` of the memory the tile of panel
    /// `pi` at depths `p0..p0+kc` (`kpad` with padding) is read from, into
    /// L2, so the GEMM's first strips on that tile do not wait for it. A
    /// hint only: nothing is read, and by default nothing is done.
    fn prefetch(&self, _pi: usize, _p0: usize, _kc: usize, _kpad: usize, _part: usize, _parts: usize) {}
}

/// Lines `l` of `lines` in share `part` of `parts`.
fn share(lines: usize, part: usize, parts: usize) -> std::ops::Range<usize> {
    part * lines / parts..(part + 1) * lines / parts
}

/// Panels read in place: `ceil(n/NR)` panels of `kpad` depths × `NR` elements
/// (f32 panels of [`pack_b`], or bf16 pair panels with `kpad` rounded up to even).
pub(crate) struct InPlace<T> {
    /// The first panel.
    pub(crate) ptr: *const T,
    /// Depths per panel, padding included.
    pub(crate) kpad: usize,
}

impl<T> PanelSource for InPlace<T> {
    type Elem = T;
    const MC: usize = MC;
    unsafe fn tile(&self, pi: usize, p0: usize, _kc: usize, _k: usize, _buf: &mut Vec<T>) -> *const T {
        self.ptr.add(pi * self.kpad * NR + p0 * NR)
    }

    fn prefetch(&self, pi: usize, p0: usize, _kc: usize, kpad: usize, part: usize, parts: usize) {
        // The tile is contiguous: `kpad · NR` elements.
        let t = self.ptr.wrapping_add(pi * self.kpad * NR + p0 * NR) as *const u8;
        prefetch_lines(t, share((kpad * NR * std::mem::size_of::<T>()).div_ceil(64), part, parts));
    }
}

// SAFETY: the pointer is to panels owned by a `PackedLinear` (or a caller's
// scratch) that outlives the call and is only read.
unsafe impl<T> Sync for InPlace<T> {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tiles_transposed_from_rows_equal_packed_panels() {
        // Rows of a [n, width] tensor at a column offset (a tensor-parallel
        // block), ragged in both directions, through the vector and the scalar transpose.
        let (n, width, c0, k) = (45, 300, 7, 261);
        let w: Vec<f32> = (0..n * width).map(|i| i as f32 * 0.5 - 3.0).collect();
        let mut packed = Vec::new();
        pack_b(&w[c0..], n, k, width, 1, &mut packed);
        let rows: Vec<*const f32> = (0..n).map(|j| w[j * width + c0..].as_ptr()).collect();
        let mut paths = vec![Simd::None];
        #[cfg(target_arch = "x86_64")]
        {
            if std::arch::is_x86_feature_detected!("avx2") {
                paths.push(Simd::Avx2);
            }
            if std::arch::is_x86_feature_detected!("avx512f") {
                paths.push(Simd::Avx512);
            }
        }
        for simd in paths {
            for pi in 0..n.div_ceil(NR) {
                for p0 in (0..k).step_by(KC) {
                    let kc = KC.min(k - p0);
                    let starts: Vec<*const f32> =
                        rows[pi * NR..(pi * NR + NR).min(n)].iter().map(|r| unsafe { r.add(p0) }).collect();
                    let mut out = vec![f32::NAN; kc * NR];
                    unsafe { transpose_rows(&starts, kc, out.as_mut_ptr(), simd) };
                    let want = &packed[pi * k * NR + p0 * NR..][..kc * NR];
                    assert_eq!(out, want, "panel {pi}, depth {p0}, simd {simd:?}");
                }
            }
        }
    }
}
