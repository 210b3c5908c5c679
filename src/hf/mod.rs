//! Hugging Face checkpoints: safetensors weights ([`checkpoint`]), one
//! normalised `config.json` per architecture family ([`llama`], [`deepseek`]),
//! and the quantisation schemes weights may be stored in ([`quant`]).
//!
//! Everything here is host-side parsing and checking; nothing runs a model.

pub mod checkpoint;
pub mod deepseek;
pub mod llama;
pub mod moe;
pub mod quant;

pub use checkpoint::{Checkpoint, CheckpointError};
pub use deepseek::DeepseekConfig;
pub use llama::LlamaConfig;

/// Why a `config.json` cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file cannot be read.
    #[error("cannot read {path}: {cause}")]
    Io {
        /// The file.
        path: String,
        /// The OS error.
        cause: std::io::Error,
    },
    /// Not JSON, or a field of the wrong JSON type.
    #[error("malformed config.json: {0}")]
    Json(#[from] serde_json::Error),
    /// A `model_type` Strata does not run.
    #[error(
        "unsupported model_type {0:?} (supported: llama, mistral, qwen2, qwen3, deepseek_v2, deepseek_v3, kimi_k2, kimi_k25)"
    )]
    UnsupportedModel(String),
    /// A field the architecture needs is absent.
    #[error("config.json lacks required field `{0}`")]
    Missing(&'static str),
    /// A field with a value Strata cannot run.
    #[error("config.json field `{field}`: {problem}")]
    Invalid {
        /// The field.
        field: &'static str,
        /// What is wrong with it.
        problem: String,
    },
}

/// What every architecture's config says about the model's outer shape.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ArchInfo {
    /// `model_type`.
    pub architecture: String,
    /// Decoder layers.
    pub num_layers: usize,
    /// Residual width.
    pub hidden_size: usize,
    /// Vocabulary size.
    pub vocab_size: usize,
    /// Longest sequence.
    pub max_position_embeddings: usize,
}

/// The rotary embedding of one architecture: inverse frequencies of the
/// rotated dim pairs (after linear, llama3 or YaRN scaling) and the factor
/// cos/sin are multiplied by (YaRN's `mscale`; 1 otherwise).
#[derive(Clone, Debug, PartialEq)]
pub struct RopeFreqs {
    /// One per rotated pair.
    pub inv_freq: Vec<f32>,
    /// cos/sin magnitude.
    pub scale: f32,
}
