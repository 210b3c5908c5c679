//! Strata: shape-verified hidden-state extraction from transformer LLMs.
//!
//! The data flows one way, and the folders say so:
//!
//! ```text
//! pipeline::source ─► pipeline::schedule ─► model (on a backend) ─► pipeline::capture ─► pipeline::gather ─► sink
//! ```
//!
//! - [`shape`]: the vocabulary: named dims, dtypes, typed `[L, T, H]` storage, [`shape::ShapeError`];
//! - [`pipeline`]: the stages' data (samples, packed batches, capture points)
//!   and the [`pipeline::Pipeline`] builder that composes them;
//! - [`hf`]: Hugging Face checkpoints: safetensors, configs, quantisation;
//! - [`model`]: the decoders, written once over a backend; tensor parallelism from outside;
//! - [`backend`]: where the arithmetic runs: `cpu` (fast) and `reference` (the oracle);
//! - [`parallel`]: ranks, collectives, the typed RPC, shard arithmetic;
//! - [`sink`]: writers of the native and speculators formats;
//! - [`dataset`]: datasets once written: manifest, reading, verify, recompute, inspect.
//! - [`files`]: opening files without trusting them (regular files only, bounded, inside a directory).
//!
//! See docs/ARCHITECTURE.md.

#![warn(missing_docs)]

pub mod backend;
pub mod dataset;
pub mod files;
pub mod hf;
pub mod model;
pub mod parallel;
pub mod pipeline;
pub mod shape;
pub mod sink;

/// Shortens a user-supplied string (an id, a path, a JSON value) for a
/// message: at most `max` characters, with the full length when clipped.
pub fn clip(s: &str, max: usize) -> String {
    match s.char_indices().nth(max) {
        None => s.to_string(),
        Some((end, _)) => format!("{}… ({} bytes)", &s[..end], s.len()),
    }
}
