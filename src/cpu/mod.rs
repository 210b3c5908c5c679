//! CPU compute: a packed f32 GEMM and the small kernels around it.

pub mod attention;
pub mod gemm;
pub mod ops;

pub use gemm::{gemm_packed, pack_b, Init, PackedLinear, MR, NR};
