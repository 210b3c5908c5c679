//! CPU compute: a packed f32 GEMM (over f32 or quantised weight panels) and the small kernels around it.

pub mod attention;
pub mod gemm;
pub mod ops;
pub mod quant_panels;

pub use gemm::{gemm_packed, pack_b, Init, PackedLinear, MR, NR};

/// A raw pointer into an output buffer shared by parallel tasks that write
/// disjoint parts of it (GEMM tiles, attention heads).
#[derive(Clone, Copy)]
pub(crate) struct SharedMut(*mut f32);

// SAFETY: every user hands each task a disjoint region of the buffer.
unsafe impl Send for SharedMut {}
unsafe impl Sync for SharedMut {}

impl SharedMut {
    pub(crate) fn new(p: *mut f32) -> Self {
        SharedMut(p)
    }
    // A method, so closures capture the Sync wrapper rather than the raw field.
    pub(crate) fn get(self) -> *mut f32 {
        self.0
    }
}
