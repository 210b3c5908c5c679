//! A safetensors file read back: memory-mapped, its header parsed, every
//! tensor's place checked against the file (what `strata verify`, `inspect`,
//! `verify --recompute` and a sink rebuilding its table on resume read).

use super::manifest;
use crate::files;
use crate::{clip, quote, QUOTE_MAX};
use memmap2::Mmap;
use safetensors::SafeTensors;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// Why a dataset or file cannot be read.
#[derive(Debug, thiserror::Error)]
pub enum DatasetError {
    /// OS error.
    #[error("cannot read {path}: {cause}")]
    Io {
        /// The file.
        path: String,
        /// The OS error.
        cause: std::io::Error,
    },
    /// A manifest that cannot be read (its message clipped: a parse error may quote a field of any length).
    #[error("{}", crate::clip(&.0.to_string(), .0.path().len() + 4 * crate::QUOTE_MAX))]
    Unreadable(super::manifest::ManifestError),
    /// A manifest whose listing is unusable (no such shard, a file outside the dataset).
    #[error("{0}")]
    Manifest(String),
    /// A safetensors file that does not parse (truncated or corrupt).
    #[error("{path}: not a valid safetensors file ({problem})")]
    BadFile {
        /// The file.
        path: String,
        /// What the parser said.
        problem: String,
    },
}

/// A tensor's place in a mapped file.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorEntry {
    /// Its dtype as in the header (`F32`, `BF16`, `I64`, `U8`, ...).
    pub dtype: safetensors::Dtype,
    /// Its shape.
    pub shape: Vec<usize>,
    /// Byte range in the file.
    pub range: std::ops::Range<usize>,
}

/// A memory-mapped safetensors file with its parsed header.
pub struct MappedFile {
    /// The path.
    pub path: PathBuf,
    map: Mmap,
    /// Tensors by name, sorted.
    pub tensors: BTreeMap<String, TensorEntry>,
}

impl MappedFile {
    /// Maps and parses a file; a truncated or corrupt file is an error, and so
    /// is anything but a regular file (a FIFO or a device is refused, not read).
    pub fn open(path: &Path) -> Result<Self, DatasetError> {
        let f =
            files::open_regular(path).map_err(|cause| DatasetError::Io { path: path.display().to_string(), cause })?;
        Self::from_file(&f, path)
    }

    /// Maps and parses an open regular file; `path` names it in messages.
    pub fn from_file(f: &std::fs::File, path: &Path) -> Result<Self, DatasetError> {
        let io = |cause| DatasetError::Io { path: path.display().to_string(), cause };
        // SAFETY: read-only map of a file this process does not modify.
        let map = unsafe { Mmap::map(f) }.map_err(io)?;
        // The parser's message may quote a tensor name or header value of any length.
        let (n, meta) = SafeTensors::read_metadata(&map).map_err(|e| DatasetError::BadFile {
            path: path.display().to_string(),
            problem: clip(&e.to_string(), 4 * QUOTE_MAX).into_owned(),
        })?;
        let tensors = meta
            .tensors()
            .into_iter()
            .map(|(name, info)| {
                let range = 8 + n + info.data_offsets.0..8 + n + info.data_offsets.1;
                (name, TensorEntry { dtype: info.dtype, shape: info.shape.clone(), range })
            })
            .collect();
        Ok(MappedFile { path: path.to_path_buf(), map, tensors })
    }

    /// The bytes of a tensor.
    pub fn bytes(&self, e: &TensorEntry) -> &[u8] {
        &self.map[e.range.clone()]
    }

    /// The checksum the manifest records for a sample: `xxh3:` of its
    /// tensors' bytes as stored, in the order `names` gives (see [`Dataset::tensor_names`]).
    pub fn sample_checksum(&self, names: &[String]) -> Result<String, String> {
        let mut h = xxhash_rust::xxh3::Xxh3::new();
        for name in names {
            let entry = self.tensors.get(name).ok_or_else(|| format!("tensor {} is missing", quote(name)))?;
            h.update(self.bytes(entry));
        }
        Ok(manifest::hash_hex(h.digest()))
    }

    /// File size.
    pub fn len(&self) -> usize {
        self.map.len()
    }

    /// Whether the file is empty.
    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }
}
