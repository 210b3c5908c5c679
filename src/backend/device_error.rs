//! A device's failure, typed, so that callers tell it from input they
//! refuse and from ops a backend does not do.

/// A device's failure, kept whole from the call that failed to the model's
/// caller (today the CUDA backend is the one device backend; its messages
/// say so).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DeviceError {
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
    /// Captured states the device staged that did not arrive.
    #[error("capture: {what}")]
    Capture {
        /// What was lost.
        what: String,
    },
}
