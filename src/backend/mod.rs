//! Backends: where a decoder's arithmetic runs. The decoders in
//! [`crate::model`] are written once against [`Backend`]; a backend owns its
//! buffers ([`Tensor`], typed like host storage), its weights (linear layers
//! in their [`Parallel`] kind, norms, the embedding table), its kernels, its
//! KV cache and its collective. A model file never names a concrete backend.
//!
//! - [`cpu`]: the fast host backend (packed f32 GEMM over f32 or quantised
//!   panels, rayon), the default;
//! - [`reference`]: plain loops with f64 accumulation, no threads: the oracle
//!   other backends are tested against.
//!
//! Anchors: candle's `BackendStorage` (one storage type per device, the same
//! ops on each) and burn's `Backend` (one trait per concern, associated
//! types for every device-side thing). [`Backend`] is the sum of the
//! concerns, each in its file beside its types:
//!
//! - [`Buffers`] (`buffers.rs`): activation storage, weight vectors, the
//!   embedding table, captures to the host (one implementation for both
//!   host backends, in [`host`]);
//! - [`DeviceOps`] (`device.rs`): facts, rank, group and collective, the end of a step;
//! - [`Weights`] (`weights.rs`): linear layers as the device holds them;
//! - [`RowOps`] (`rows.rs`): per-row ops and the linear layers' GEMMs;
//! - [`AttentionOps`] (`attention.rs`), [`MoeOps`] (`moe.rs`),
//!   [`RecurrentOps`] (`delta.rs`): attention, mixtures of experts, Gated DeltaNet;
//! - [`FusedOps`] (`fused.rs`): a block's ops as one call.
//!
//! Every op checks its buffers' sizes once, in the trait's provided method,
//! and calls its `_unchecked` twin, which is what a backend implements. To
//! add a backend, implement the concerns; `tests/backends.rs` then runs
//! every parity fixture through it (see docs/ARCHITECTURE.md).

mod attention;
mod buffers;
mod check;
mod compute;
pub mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;
mod delta;
mod device;
mod device_error;
mod error;
mod fused;
pub mod host;
mod kv_cache;
mod moe;
pub mod reference;
mod rows;
mod state;
mod tensor;
mod weights;

/// Llama 4's query temperature, a config value the backend ops take ([`RowOps::attn_temperature`]).
pub use crate::hf::llama4::Temperature;
pub use attention::{AttentionOps, AttnBlock, AttnShape, Gating, HeadSpan, Mask, QkNorm, Qkv};
pub use buffers::{Buffers, EmbeddingInfo, VectorInfo};
pub use compute::{Bf16, Compute, ComputeDtype, F32};
pub use cpu::Cpu;
pub use delta::{DeltaGates, DeltaRule, DeltaShape, RecurrentOps, DELTA_CHUNK};
pub use device::DeviceOps;
pub use device_error::DeviceError;
pub use error::{BackendError, PendingCopies};
pub use fused::{attention_block_ops, AttnBufs, FusedOps, MlpBufs};
pub use kv_cache::{DeltaCache, KvCache};
pub use moe::{MoeOps, Router, RoutesInfo};
pub use reference::Reference;
pub use rows::{HeadSums, RopeInfo, RowOps};
pub use state::{KvStore, LayerState, SeqState};
pub use tensor::{Cols, Tensor};
pub use weights::{GatedLinear, Glu, LinearInfo, Parallel, Resident, Weights};

/// A device a decoder runs on, every concern together: its buffers, weights,
/// kernels, KV cache and collective. One value per tensor-parallel rank.
///
/// Activations are `[rows, width]` [`Tensor`]s of f32 values as the model
/// sees them (a backend may hold them otherwise); the residual stream is a
/// `Tensor<B, H>`, typed by the model's hidden dim. Ops write into buffers
/// the caller owns, so a forward allocates once per step, not per layer.
/// Implemented for every type that implements the concerns.
pub trait Backend: FusedOps + MoeOps + RecurrentOps {}

impl<B: FusedOps + MoeOps + RecurrentOps> Backend for B {}

/// The concern traits, for code that calls ops on a concrete backend
/// (`Cpu`, `Reference`): `use strata::backend::prelude::*;`. Generic code
/// bounded by [`Backend`] reaches them without it.
pub mod prelude {
    pub use super::{
        AttentionOps, Backend, Buffers, DeviceOps, EmbeddingInfo, FusedOps, KvStore, LinearInfo, MoeOps, RecurrentOps,
        Resident, RopeInfo, RoutesInfo, RowOps, VectorInfo, Weights,
    };
}
