//! What the files say: the layer both the writers (`sink`) and the readers
//! (`dataset`, `input`'s parts) stand on, so neither reaches into the other.
//!
//! - [`manifest`]: `manifest.json` and `journal.jsonl`, what a dataset holds
//!   and what made it (docs/FORMAT.md);
//! - [`parts`]: a part of a split input as its manifest records it, and the
//!   name of its directory (`part-IIII-of-NNNN`);
//! - [`MappedFile`]: a safetensors file read back, memory-mapped, its header
//!   checked.

pub mod manifest;
mod mapped;
pub mod parts;

pub use mapped::{DatasetError, MappedFile, TensorEntry};
