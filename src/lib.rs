//! Strata: shape-verified hidden-state extraction from transformer LLMs.
//!
//! The data flows one way, and the folders say so:
//!
//! ```text
//! input (+ chat) ─► pipeline::source ─► pipeline::schedule ─► model (on a backend) ─► pipeline::capture ─► pipeline::gather ─► sink
//! ```
//!
//! - [`input`]: records (token ids, text, conversations, `datasets` directories) made samples on their own thread;
//! - [`chat`]: tokenizers, chat templates, loss masks by render boundaries;
//! - [`shape`]: the vocabulary: named dims, dtypes, typed `[L, T, H]` storage, [`shape::ShapeError`];
//! - [`pipeline`]: the stages' data (samples, packed batches, capture points);
//! - [`hf`]: Hugging Face checkpoints: safetensors, configs, quantisation;
//! - [`model`]: the decoders, written once over a backend; tensor parallelism from outside;
//! - [`backend`]: where the arithmetic runs: `cpu` (fast) and `reference` (the oracle);
//! - [`parallel`]: ranks, collectives, the typed RPC, shard arithmetic;
//! - [`generate`]: on-policy generation: sampling as vLLM samples;
//! - [`sink`]: writers of the native and speculators formats;
//! - [`format`]: what the files say: the manifest, part info and part directory names, a mapped safetensors file;
//! - [`dataset`]: datasets once written: reading, verify, inspect (it only reads);
//! - [`job`]: what the jobs share (a model opened once, `--compute auto`, the
//!   output's layout), the [`job::Pipeline`] builder, the extraction job and
//!   `verify --recompute`;
//! - [`serve`]: `strata serve`, the hidden-states server of online training.
//! - [`files`]: opening files without trusting them (regular files only, bounded, inside a directory).
//!
//! See docs/ARCHITECTURE.md.

#![warn(missing_docs)]

// Files are written and weights read by viewing memory as little-endian
// values (f32 panels, safetensors data), so only little-endian targets build.
#[cfg(target_endian = "big")]
compile_error!("Strata supports little-endian targets only");

pub mod backend;
pub mod chat;
pub mod dataset;
mod families;
pub mod files;
pub mod format;
pub mod generate;
pub mod hf;
pub mod input;
pub mod job;
pub mod model;
pub mod parallel;
pub mod pipeline;
pub mod serve;
pub mod shape;
pub mod sink;

/// At most this many characters of a string read from a file or the input
/// (an id, a file name) are quoted in a message: hostile input must not fill the terminal.
pub const QUOTE_MAX: usize = 80;

/// `s` unquoted, cut to `max` characters with `…` and the full length.
pub fn clip(s: &str, max: usize) -> std::borrow::Cow<'_, str> {
    match s.char_indices().nth(max) {
        None => std::borrow::Cow::Borrowed(s),
        Some((cut, _)) => std::borrow::Cow::Owned(format!("{}… ({} bytes)", &s[..cut], s.len())),
    }
}

/// `s` as `{:?}` prints it; past [`QUOTE_MAX`] characters, cut there with
/// `…` and the full length: `"aaaa…" (1048576 bytes)`.
pub fn quote(s: &str) -> String {
    match s.char_indices().nth(QUOTE_MAX) {
        None => format!("{s:?}"),
        Some((cut, _)) => format!("{:?} ({} bytes)", format!("{}…", &s[..cut]), s.len()),
    }
}
