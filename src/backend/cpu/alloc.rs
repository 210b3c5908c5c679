//! [`CacheAligned`], the global allocator the CPU backend wants: every block
//! of 4 KiB or more starts on a 64-byte cache line.
//!
//! The GEMM's packed panels and A strips are `Vec`s, and the system
//! allocator starts a large block 16 bytes past a page boundary. Every
//! 64-byte row of an AMX tile (and every AVX-512 load of a panel) then
//! spans two cache lines, which doubles the lines each tile load moves from
//! L2: the bf16 layer GEMMs of `benches/gemm` ran 1.3–1.6 times faster on
//! aligned buffers (one thread, each configuration timed at the same moment
//! on the other core).
//!
//! Programs that run models install it once:
//!
//! ```
//! #[global_allocator]
//! static ALLOC: strata::backend::cpu::CacheAligned = strata::backend::cpu::CacheAligned;
//!
//! fn main() {
//!     let panel = vec![0u16; 1 << 16];
//!     assert_eq!(panel.as_ptr() as usize % 64, 0);
//! }
//! ```

use std::alloc::{GlobalAlloc, Layout, System};

/// A global allocator: the system's, with blocks of 4 KiB or more aligned to
/// 64 bytes. Memory still comes from (and goes back to) the system
/// allocator's heap, so a program that keeps freed memory for the next step
/// (the `strata` binary does) keeps doing so. A zeroed block of 4 MiB or more
/// is advised to be backed by huge pages before it is zeroed (Linux).
pub struct CacheAligned;

/// Blocks from this size on are aligned to a cache line.
const ALIGNED_FROM: usize = 4096;
/// Alignment of those blocks.
const LINE: usize = 64;
/// Zeroed blocks from this size on get huge-page advice first (Linux).
const HUGE_FROM: usize = 4 << 20;

/// The layout the system allocator is asked for: a function of `l` alone,
/// so a block is freed with the layout it was allocated with.
fn aligned(l: Layout) -> Layout {
    if l.size() >= ALIGNED_FROM && l.align() < LINE {
        // A size too large for the stricter alignment keeps the caller's.
        Layout::from_size_align(l.size(), LINE).unwrap_or(l)
    } else {
        l
    }
}

/// Asks Linux to back the whole 2 MiB extents of `[p, p + size)` with huge
/// pages, before they are first touched: one fault then maps 2 MiB instead
/// of 4 KiB. A refusal (THP off) only costs speed.
///
/// # Safety
/// `[p, p + size)` must lie inside one allocation.
#[cfg(target_os = "linux")]
pub(crate) unsafe fn advise_huge(p: *mut u8, size: usize) {
    const HUGE: usize = 2 << 20;
    let start = (p as usize).next_multiple_of(HUGE);
    let end = (p as usize + size) / HUGE * HUGE;
    if end > start {
        libc::madvise(start as *mut libc::c_void, end - start, libc::MADV_HUGEPAGE);
    }
}

// SAFETY: every block goes to `System` with `aligned(layout)`, a function of
// the layout the caller passes back unchanged, so alloc and free agree; the
// aligned layout's alignment is at least the caller's.
unsafe impl GlobalAlloc for CacheAligned {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        System.alloc(aligned(l))
    }

    unsafe fn alloc_zeroed(&self, l: Layout) -> *mut u8 {
        let a = aligned(l);
        #[cfg(target_os = "linux")]
        if a.size() >= HUGE_FROM && a.align() > 16 {
            // The system zeroes an over-aligned block itself after taking it;
            // advise first, so zeroing faults in huge pages.
            let p = System.alloc(a);
            if !p.is_null() {
                advise_huge(p, a.size());
                std::ptr::write_bytes(p, 0, a.size());
            }
            return p;
        }
        System.alloc_zeroed(a)
    }

    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        System.dealloc(p, aligned(l))
    }

    unsafe fn realloc(&self, p: *mut u8, l: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: the caller guarantees `new_size` fits `l.align()`.
        let nl = Layout::from_size_align_unchecked(new_size, l.align());
        let (old, new) = (aligned(l), aligned(nl));
        if old.align() == new.align() {
            return System.realloc(p, old, new_size);
        }
        // The block crosses the alignment threshold: a new one, the bytes copied over.
        let q = System.alloc(new);
        if !q.is_null() {
            std::ptr::copy_nonoverlapping(p, q, l.size().min(new_size));
            System.dealloc(p, old);
        }
        q
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocks_are_aligned_and_keep_their_bytes_across_every_resize() {
        let a = CacheAligned;
        // Sizes on both sides of each threshold, grown and shrunk across them.
        let sizes = [100, 4095, 4096, 5000, HUGE_FROM - 8, HUGE_FROM, 3 * HUGE_FROM + 5, 70_000, 24];
        for align in [4, 64, 8192] {
            unsafe {
                let l = Layout::from_size_align(sizes[0], align).unwrap();
                let mut p = a.alloc_zeroed(l);
                assert!(!p.is_null());
                assert!((0..sizes[0]).all(|i| *p.add(i) == 0));
                let mut old = sizes[0];
                for (step, &size) in sizes.iter().enumerate().skip(1) {
                    for i in 0..old {
                        *p.add(i) = (i * 7 + step) as u8;
                    }
                    p = a.realloc(p, Layout::from_size_align(old, align).unwrap(), size);
                    assert!(!p.is_null(), "realloc to {size}");
                    let want = if size >= ALIGNED_FROM { align.max(LINE) } else { align };
                    assert_eq!(p as usize % want, 0, "a block of {size} bytes (align {align}) at {p:p}");
                    assert!(
                        (0..old.min(size)).all(|i| *p.add(i) == (i * 7 + step) as u8),
                        "bytes kept {old} -> {size}"
                    );
                    old = size;
                }
                a.dealloc(p, Layout::from_size_align(old, align).unwrap());
            }
        }
        for size in [ALIGNED_FROM, HUGE_FROM, 2 * HUGE_FROM + 1] {
            let l = Layout::from_size_align(size, 2).unwrap();
            unsafe {
                // Dirty memory first, so a reused block must really be zeroed.
                let d = a.alloc(l);
                assert!(!d.is_null());
                std::ptr::write_bytes(d, 0xa5, size);
                a.dealloc(d, l);
                let z = a.alloc_zeroed(l);
                assert!(!z.is_null());
                assert_eq!(z as usize % LINE, 0);
                assert!((0..size).all(|i| *z.add(i) == 0), "zeroed block of {size}");
                a.dealloc(z, l);
            }
        }
    }
}
