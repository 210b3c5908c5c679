//! Decoder models, written once over [`crate::backend::Backend`]:
//!
//! - [`decoder`]: the skeleton every architecture shares ([`Decoder`]) and
//!   what an architecture provides ([`decoder::Block`]);
//! - [`llama`], [`deepseek`], ...: one file per architecture family (a row
//!   of the family table, `crate::families`, declares it), blocks named like
//!   the checkpoint's tensors, with its aliases ([`Llama`], [`TpLlama`], ...);
//! - [`shard`]: how a layer's weights split over tensor-parallel ranks;
//! - [`tp_model`]: any decoder run as tensor-parallel ranks;
//! - [`any`]: the registry, the one file that names every family and every
//!   backend: [`load`] turns a checkpoint directory into a ready [`AnyModel`].

pub mod any;
pub mod decoder;
mod kit;
pub mod logits;
pub mod moe;
pub mod shard;
pub mod tp_model;

/// From the family table: each family's model module (its aliases are the
/// registry's, which alone names the backends they default to).
macro_rules! model_modules {
    ([] $($(#[$attr:meta])* $variant:ident $module:ident $config:ident $tp:ident $doc:literal [$($model_type:literal),+]
        $(in ($hf_path:literal, $model_path:literal))?;)+) => {
        $(
            $(#[$attr])*
            $(#[path = $model_path])?
            pub mod $module;
        )+
    };
}
crate::families::families!(model_modules);

pub use any::*;
pub use decoder::{Decoder, RankStep};
pub use logits::{LogitShard, Logits};
pub use tp_model::{RankModel, RankWorker, TpModel};

/// The device failure [`ModelError::Device`] carries.
pub use crate::backend::DeviceError;
pub use shard::SplitError;

use crate::backend::{Backend, BackendError, PendingCopies, SeqState};
use crate::hf::checkpoint::CheckpointError;
use crate::hf::ConfigError;
use crate::parallel::RpcError;
use crate::pipeline::batch::PackedBatch;
use crate::pipeline::capture::{CaptureError, CaptureSet};
use crate::shape::{CapturedStates, DType, Dim, ShapeError};

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
    /// A tensor-parallel split that does not fit the model.
    #[error(transparent)]
    Split(#[from] SplitError),
    /// Load options that do not fit each other or this build (`--tp`, `--devices`, `--compute`).
    #[error(transparent)]
    Options(#[from] OptionsError),
    /// A tensor-parallel rank that stopped.
    #[error(transparent)]
    Rank(#[from] RpcError),
    /// Something the chosen backend does not do.
    #[error("{0}")]
    Unsupported(String),
    /// Logits asked of a model without its LM head.
    #[error("no LM head: {0}")]
    NoLmHead(String),
    /// The device failed, its error kept whole.
    #[error("{0}")]
    Device(DeviceError),
    /// Input the model cannot take.
    #[error("sample {sample}: {problem}")]
    Input {
        /// Sample index in the batch.
        sample: usize,
        /// What is wrong.
        problem: String,
    },
}

impl From<BackendError> for ModelError {
    fn from(e: BackendError) -> Self {
        match e {
            BackendError::Input { sample, problem } => ModelError::Input { sample, problem },
            BackendError::Unsupported(s) => ModelError::Unsupported(s),
            BackendError::Shape(s) => ModelError::Shape(s),
            BackendError::Device(e) => ModelError::Device(e),
        }
    }
}

/// A step's captured states, whose values a device may still be copying
/// to the host: [`PendingStates::wait`] completes them (on the pipeline's
/// writer thread, while the next step runs).
pub struct PendingStates<L: Dim, H: Dim> {
    /// `[L, T, H]`: the slots a host backend filled, and room for the rest.
    states: CapturedStates<L, H>,
    /// The device's copies into the other slots, if any.
    copies: Option<PendingCopies>,
}

impl<L: Dim, H: Dim> PendingStates<L, H> {
    /// `states`, of which `copies` (if any) fills the rest.
    pub fn new(states: CapturedStates<L, H>, copies: Option<PendingCopies>) -> Self {
        PendingStates { states, copies }
    }

    /// Whether values are still to be copied.
    pub fn is_pending(&self) -> bool {
        self.copies.is_some()
    }

    /// The states, complete.
    pub fn wait(mut self) -> Result<CapturedStates<L, H>, ModelError> {
        if let Some(copies) = self.copies.take() {
            copies(self.states.as_mut_slice())?;
        }
        Ok(self.states)
    }

    /// The same pending values under other dims (the layout is kept: `f` may
    /// only retype the `[L, T, H]` buffer).
    pub fn retype<L2: Dim, H2: Dim>(
        self,
        f: impl FnOnce(CapturedStates<L, H>) -> Result<CapturedStates<L2, H2>, ShapeError>,
    ) -> Result<PendingStates<L2, H2>, ShapeError> {
        Ok(PendingStates { states: f(self.states)?, copies: self.copies })
    }
}

/// What the pipeline needs of a model: its hidden dim and a forward step that
/// fills the requested capture points for a packed batch (with chunked prefill).
pub trait Model {
    /// The hidden dim: `Hidden<N>` in a static job, `usize` otherwise.
    type Hidden: Dim;
    /// What the caller keeps between steps for chunked samples (the backend's KV cache).
    type Cache: Default;
    /// The hidden dim's value.
    fn hidden(&self) -> Self::Hidden;
    /// Decoder layers (for resolving capture points).
    fn num_layers(&self) -> usize;
    /// The dtype the checkpoint stores its weights in (the default output dtype).
    fn dtype(&self) -> DType;
    /// Bytes of memory the weights hold, over all ranks.
    fn weight_bytes(&self) -> usize;
    /// Bytes `cache` holds (keys, values, recurrent state; every rank's):
    /// what a generation's `--kv-cache-memory` bounds.
    fn cache_bytes(&self, cache: &Self::Cache) -> Result<usize, ModelError>;

    /// Runs one step, leaving the device's last copies pending; a
    /// generation step (`sample` is `Some(rows)`) runs every layer and
    /// returns the logits of the batch rows `rows`; see [`Decoder::step_rank`].
    fn forward_sample_pending<L: Dim>(
        &self,
        batch: &PackedBatch,
        captures: &CaptureSet<L>,
        cache: &mut Self::Cache,
        sample: Option<&[usize]>,
    ) -> Result<Sampled<L, Self::Hidden>, ModelError>;

    /// Runs one step, leaving the device's last copies pending; see
    /// [`Decoder::forward_step_pending`].
    fn forward_step_pending<L: Dim>(
        &self,
        batch: &PackedBatch,
        captures: &CaptureSet<L>,
        cache: &mut Self::Cache,
    ) -> Result<PendingStates<L, Self::Hidden>, ModelError> {
        Ok(self.forward_sample_pending(batch, captures, cache, None)?.states)
    }

    /// Runs one step; see [`Decoder::forward_step`].
    fn forward_step<L: Dim>(
        &self,
        batch: &PackedBatch,
        captures: &CaptureSet<L>,
        cache: &mut Self::Cache,
    ) -> Result<CapturedStates<L, Self::Hidden>, ModelError> {
        self.forward_step_pending(batch, captures, cache)?.wait()
    }
}

/// A step's states and the logits of the rows it samples.
pub struct Sampled<L: Dim, H: Dim> {
    /// `[L, T, H]`, copies pending.
    pub states: PendingStates<L, H>,
    /// `[S, V]` over the whole vocabulary; `None` outside generation.
    pub logits: Option<Logits>,
}

impl<B: Backend, L: decoder::Block<B>, H: Dim> Model for Decoder<B, L, H> {
    type Hidden = H;
    type Cache = SeqState<B>;
    fn hidden(&self) -> H {
        Decoder::hidden(self)
    }
    fn num_layers(&self) -> usize {
        self.info().num_layers
    }
    fn dtype(&self) -> DType {
        Decoder::dtype(self)
    }
    fn weight_bytes(&self) -> usize {
        self.resident_bytes()
    }
    fn cache_bytes(&self, cache: &SeqState<B>) -> Result<usize, ModelError> {
        use crate::backend::KvStore;
        Ok(cache.held_bytes())
    }
    fn forward_sample_pending<LD: Dim>(
        &self,
        batch: &PackedBatch,
        captures: &CaptureSet<LD>,
        cache: &mut SeqState<B>,
        sample: Option<&[usize]>,
    ) -> Result<Sampled<LD, H>, ModelError> {
        let step = self.step_rank(batch, captures, cache, true, sample)?;
        let logits = step.logits.map(LogitShard::whole).transpose()?;
        Ok(Sampled { states: step.states.expect("a capturing forward returns states"), logits })
    }
}
