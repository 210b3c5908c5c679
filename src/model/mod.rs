//! Decoder models, one file per architecture family.

pub mod llama;

pub use llama::Llama;

use crate::capture::CaptureError;
use crate::checkpoint::CheckpointError;
use crate::config::ConfigError;
use crate::shape::ShapeError;

/// Why a model cannot be loaded or run.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    /// Bad `config.json`.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// Bad or missing weights.
    #[error(transparent)]
    Checkpoint(#[from] CheckpointError),
    /// A capture point the model cannot provide.
    #[error(transparent)]
    Capture(#[from] CaptureError),
    /// A size that disagrees with the job's types.
    #[error(transparent)]
    Shape(#[from] ShapeError),
    /// Input the model cannot take.
    #[error("sample {sample}: {problem}")]
    Input {
        /// Sample index in the batch.
        sample: usize,
        /// What is wrong.
        problem: String,
    },
}
