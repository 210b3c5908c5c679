//! Why a backend cannot do what it is asked, by kind.

use super::DeviceError;
use crate::shape::ShapeError;

/// Why a backend cannot do what it is asked.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BackendError {
    /// Input the model cannot take (a chunk that does not continue its cached positions).
    #[error("sample {sample}: {problem}")]
    Input {
        /// Sample index in the batch.
        sample: usize,
        /// What is wrong.
        problem: String,
    },
    /// Something this backend does not do (e.g. tensor parallelism on the reference backend).
    #[error("{0}")]
    Unsupported(String),
    /// A size that disagrees with a buffer's type.
    #[error(transparent)]
    Shape(#[from] ShapeError),
    /// The device failed (out of memory, a launch or driver error), its error kept whole.
    #[error("device: {0}")]
    Device(DeviceError),
}

impl From<DeviceError> for BackendError {
    fn from(e: DeviceError) -> Self {
        BackendError::Device(e)
    }
}

/// The rest of a step's captures, still on their way from a device: run on
/// the step's `[L, T, H]` values, it fills the slots the device staged.
pub type PendingCopies = Box<dyn FnOnce(&mut [f32]) -> Result<(), BackendError> + Send>;
