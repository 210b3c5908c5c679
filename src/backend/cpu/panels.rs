//! The GEMM's view of B: `NR`-wide column panels laid out `[k][NR]`, and the
//! register-tile sizes every kernel shares. f32 panels are read in place;
//! quantised ones ([`super::quant_panels`]) decode each tile as it is reached.

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

/// Where the GEMM gets B's `[kc][NR]` tiles from.
pub(crate) trait PanelSource {
    /// Element of a tile (f32, or bf16 bits in depth pairs).
    type Elem;
    /// Rows of A per block: each B tile is fetched (or decoded) once per block.
    const MC: usize;
    /// The tile of panel `pi` at depths `p0..p0+kc` (`k` in all).
    ///
    /// # Safety
    /// The returned pointer is valid for reading the whole tile until `buf` changes.
    unsafe fn tile(&self, pi: usize, p0: usize, kc: usize, k: usize, buf: &mut Vec<Self::Elem>) -> *const Self::Elem;
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
}

// SAFETY: the pointer is to panels owned by a `PackedLinear` (or a caller's
// scratch) that outlives the call and is only read.
unsafe impl<T> Sync for InPlace<T> {}
