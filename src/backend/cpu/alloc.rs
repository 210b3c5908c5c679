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
/// 64 bytes, and blocks of 4 MiB or more (on Linux) mapped straight from the
/// kernel, page-aligned, so a zeroed one costs nothing until it is touched.
pub struct CacheAligned;

/// Blocks from this size on are aligned to a cache line.
const ALIGNED_FROM: usize = 4096;
/// Alignment of those blocks.
const LINE: usize = 64;
/// Blocks from this size on are anonymous mappings (Linux).
const MAPPED_FROM: usize = 4 << 20;

/// The layout the system allocator is asked for.
fn aligned(l: Layout) -> Layout {
    if l.size() >= ALIGNED_FROM && l.align() < LINE {
        // SAFETY: LINE is a power of two and the size did fit the smaller alignment.
        unsafe { Layout::from_size_align_unchecked(l.size(), LINE) }
    } else {
        l
    }
}

/// Whether a block of layout `l` is a mapping of its own.
fn mapped(l: Layout) -> bool {
    cfg!(target_os = "linux") && l.size() >= MAPPED_FROM && l.align() <= 4096
}

/// Transparent huge page size (x86-64 and most aarch64 kernels).
const HUGE: usize = 2 << 20;

/// A fresh mapping of `size` bytes, starting on a huge page boundary and
/// advised to be backed by huge pages: one fault then clears 2 MiB instead
/// of 4 KiB (the activations of a batch are mapped anew every step).
#[cfg(target_os = "linux")]
unsafe fn map(size: usize) -> *mut u8 {
    let len = size.next_multiple_of(4096);
    let p = libc::mmap(
        std::ptr::null_mut(),
        len + HUGE,
        libc::PROT_READ | libc::PROT_WRITE,
        libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
        -1,
        0,
    );
    if p == libc::MAP_FAILED {
        return std::ptr::null_mut();
    }
    // Keep the aligned `len` bytes; give back the pages before and after.
    let base = p as usize;
    let start = base.next_multiple_of(HUGE);
    if start > base {
        libc::munmap(p, start - base);
    }
    let tail = base + len + HUGE - (start + len);
    if tail > 0 {
        libc::munmap((start + len) as *mut libc::c_void, tail);
    }
    // A refused advice only costs speed.
    libc::madvise(start as *mut libc::c_void, len, libc::MADV_HUGEPAGE);
    start as *mut u8
}

#[cfg(target_os = "linux")]
unsafe fn unmap(p: *mut u8, size: usize) {
    libc::munmap(p.cast(), size);
}

#[cfg(not(target_os = "linux"))]
unsafe fn map(_: usize) -> *mut u8 {
    unreachable!("mapped blocks are Linux only")
}

#[cfg(not(target_os = "linux"))]
unsafe fn unmap(_: *mut u8, _: usize) {
    unreachable!("mapped blocks are Linux only")
}

// SAFETY: each block is allocated and freed by one scheme, chosen by its
// layout alone (`mapped`, then `aligned`), which the caller passes back
// unchanged; a mapping is page-aligned, so any alignment up to 4096 holds;
// fresh anonymous pages read as zero.
unsafe impl GlobalAlloc for CacheAligned {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        if mapped(l) {
            map(l.size())
        } else {
            System.alloc(aligned(l))
        }
    }

    unsafe fn alloc_zeroed(&self, l: Layout) -> *mut u8 {
        if mapped(l) {
            map(l.size())
        } else {
            System.alloc_zeroed(aligned(l))
        }
    }

    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        if mapped(l) {
            unmap(p, l.size())
        } else {
            System.dealloc(p, aligned(l))
        }
    }

    unsafe fn realloc(&self, p: *mut u8, l: Layout, new_size: usize) -> *mut u8 {
        let nl = Layout::from_size_align_unchecked(new_size, l.align());
        #[cfg(target_os = "linux")]
        if mapped(l) && mapped(nl) {
            let q = libc::mremap(p.cast(), l.size(), new_size, libc::MREMAP_MAYMOVE);
            return if q == libc::MAP_FAILED { std::ptr::null_mut() } else { q.cast() };
        }
        if !mapped(l) && !mapped(nl) && aligned(l).align() == aligned(nl).align() {
            return System.realloc(p, aligned(l), new_size);
        }
        // The block changes scheme: a new one, the bytes copied over.
        let q = self.alloc(nl);
        if !q.is_null() {
            std::ptr::copy_nonoverlapping(p, q, l.size().min(new_size));
            self.dealloc(p, l);
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
        let sizes = [100, 4095, 4096, 5000, MAPPED_FROM - 8, MAPPED_FROM, 3 * MAPPED_FROM + 5, 70_000, 24];
        unsafe {
            let l = Layout::from_size_align(sizes[0], 4).unwrap();
            let mut p = a.alloc_zeroed(l);
            assert!(!p.is_null());
            assert!((0..sizes[0]).all(|i| *p.add(i) == 0));
            let mut old = sizes[0];
            for (step, &size) in sizes.iter().enumerate().skip(1) {
                for i in 0..old {
                    *p.add(i) = (i * 7 + step) as u8;
                }
                p = a.realloc(p, Layout::from_size_align(old, 4).unwrap(), size);
                assert!(!p.is_null(), "realloc to {size}");
                if size >= ALIGNED_FROM {
                    assert_eq!(p as usize % LINE, 0, "a block of {size} bytes at {p:p}");
                }
                assert!((0..old.min(size)).all(|i| *p.add(i) == (i * 7 + step) as u8), "bytes kept {old} -> {size}");
                old = size;
            }
            a.dealloc(p, Layout::from_size_align(old, 4).unwrap());
            for size in [ALIGNED_FROM, MAPPED_FROM, 2 * MAPPED_FROM + 1] {
                let l = Layout::from_size_align(size, 2).unwrap();
                let z = a.alloc_zeroed(l);
                assert_eq!(z as usize % LINE, 0);
                assert!((0..size).step_by(997).all(|i| *z.add(i) == 0), "zeroed block of {size}");
                a.dealloc(z, l);
            }
        }
    }
}
