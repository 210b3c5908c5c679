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

/// Why the CUDA backend cannot run.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CudaError {
    /// No CUDA driver library (`libcuda.so`) could be loaded.
    #[error("no CUDA driver found (libcuda.so could not be loaded): --backend cuda needs an NVIDIA GPU and its driver; use --backend cpu on this machine")]
    NoDriver,
    /// The driver is there but reports no device.
    #[error(
        "the CUDA driver reports no GPU{0}: --backend cuda needs an NVIDIA GPU; use --backend cpu on this machine"
    )]
    NoDevice(String),
    /// A device index that is not there.
    #[error("--devices names GPU {asked}, but this machine has {count} (indices 0..{count})")]
    BadDevice {
        /// The index asked for.
        asked: usize,
        /// Devices present.
        count: usize,
    },
    /// NVRTC could not be loaded.
    #[error("NVRTC (libnvrtc.so) could not be loaded: the CUDA backend compiles its kernels at run time; install the CUDA runtime libraries or the PyPI package nvidia-cuda-nvrtc and put its lib directory on LD_LIBRARY_PATH")]
    NoNvrtc,
    /// A kernel that did not compile or load.
    #[error("kernel {name}: {log}")]
    Kernel {
        /// The kernel file or function.
        name: String,
        /// NVRTC's log, or the driver's error.
        log: String,
    },
    /// A buffer that does not hold what a copy or launch touches.
    #[error(transparent)]
    Shape(#[from] crate::shape::ShapeError),
    /// A driver, cuBLAS or NCCL call that failed.
    #[error("{call}: {error}")]
    Driver {
        /// What was called.
        call: String,
        /// What it returned.
        error: String,
    },
}
