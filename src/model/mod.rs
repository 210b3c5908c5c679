//! Decoder models, one file per architecture family.

pub mod deepseek;
mod frame;
pub mod kv_cache;
pub mod llama;
pub mod tp_model;

pub use deepseek::Deepseek;
pub use kv_cache::KvCache;
pub use llama::Llama;
pub use tp_model::{RankModel, RankWorker, TpDeepseek, TpLlama, TpModel};

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
    /// A tensor-parallel split that does not fit the model, or a rank that stopped.
    #[error("{0}")]
    Parallel(String),
    /// Input the model cannot take.
    #[error("sample {sample}: {problem}")]
    Input {
        /// Sample index in the batch.
        sample: usize,
        /// What is wrong.
        problem: String,
    },
}

use crate::batch::PackedBatch;
use crate::capture::CaptureSet;
use crate::shape::{CapturedStates, Dim};

/// What the pipeline needs of a model: its hidden dim and a forward step that
/// fills the requested capture points for a packed batch (with chunked prefill).
pub trait Model {
    /// The hidden dim: `Hidden<N>` in a static job, `usize` otherwise.
    type Hidden: Dim;
    /// The hidden dim's value.
    fn hidden(&self) -> Self::Hidden;
    /// Decoder layers (for resolving capture points).
    fn num_layers(&self) -> usize;
    /// The dtype the checkpoint stores its weights in (the default output dtype).
    fn dtype(&self) -> crate::shape::DType;
    /// Bytes of memory the weights hold, over all ranks.
    fn weight_bytes(&self) -> usize;
    /// Runs one step; see [`Llama::forward_step`].
    fn forward_step<L: Dim>(
        &self,
        batch: &PackedBatch,
        captures: &CaptureSet<L>,
        cache: &mut KvCache,
    ) -> Result<CapturedStates<L, Self::Hidden>, ModelError>;
}

impl<H: Dim> Model for Llama<H> {
    type Hidden = H;
    fn hidden(&self) -> H {
        Llama::hidden(self)
    }
    fn num_layers(&self) -> usize {
        self.config().num_layers
    }
    fn dtype(&self) -> crate::shape::DType {
        Llama::dtype(self)
    }
    fn weight_bytes(&self) -> usize {
        self.resident_bytes()
    }
    fn forward_step<L: Dim>(
        &self,
        batch: &PackedBatch,
        captures: &CaptureSet<L>,
        cache: &mut KvCache,
    ) -> Result<CapturedStates<L, H>, ModelError> {
        Llama::forward_step(self, batch, captures, cache)
    }
}
