//! The CUDA backend (`--features cuda`): cudarc with dynamic loading (no CUDA
//! toolkit at build time), kernels from `kernels/` compiled at run time with
//! NVRTC, cuBLAS for GEMMs, NCCL for tensor parallelism.

pub mod backend;
pub mod device;
pub mod driver;
pub mod kernels;
pub mod nvrtc;
pub mod probe;

pub use backend::Cuda;
pub use device::{Device, StagedCopies};
pub use driver::Driver;

/// Why the CUDA backend cannot run: the backend-wide [`DeviceError`], which
/// carries it whole through [`crate::backend::BackendError`] and the model.
pub use crate::backend::DeviceError as CudaError;
