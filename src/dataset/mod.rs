//! Datasets once written: the native format's [`manifest`], reading shards
//! and single safetensors files back (memory-mapped, every size checked),
//! and the tools over them: [`verify`] (against the manifest),
//! [`recompute`] (against a fresh forward), [`inspect`] and [`stats`].

pub mod inspect;
pub mod manifest;
pub mod recompute;
pub mod stats;
pub mod verify;

use crate::shape::DType;
use manifest::{Manifest, MANIFEST};
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
    /// Unusable manifest.
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
    /// Maps and parses a file; a truncated or corrupt file is an error.
    pub fn open(path: &Path) -> Result<Self, DatasetError> {
        let io = |cause| DatasetError::Io { path: path.display().to_string(), cause };
        let f = std::fs::File::open(path).map_err(io)?;
        // SAFETY: read-only map of a file this process does not modify.
        let map = unsafe { Mmap::map(&f) }.map_err(io)?;
        let (n, meta) = SafeTensors::read_metadata(&map)
            .map_err(|e| DatasetError::BadFile { path: path.display().to_string(), problem: e.to_string() })?;
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

    /// The checksum the manifest records for sample `id`: `xxh3:` of its
    /// `input_ids`, `loss_mask` and `hidden_states` bytes as stored.
    pub fn sample_checksum(&self, id: &str) -> Result<String, String> {
        let mut h = xxhash_rust::xxh3::Xxh3::new();
        for e in ["input_ids", "loss_mask", "hidden_states"] {
            let name = format!("{id}.{e}");
            let entry = self.tensors.get(&name).ok_or_else(|| format!("tensor {name:?} is missing"))?;
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

/// A native-format output directory.
pub struct Dataset {
    /// The directory.
    pub dir: PathBuf,
    /// Its manifest.
    pub manifest: Manifest,
}

/// One sample read back.
pub struct SampleRef<'a> {
    /// Token ids.
    pub input_ids: Vec<i64>,
    /// Loss mask.
    pub loss_mask: &'a [u8],
    /// `hidden_states` bytes, `[L, T, H]` in `dtype`.
    pub hidden: &'a [u8],
    /// Storage dtype.
    pub dtype: DType,
    /// `[L, T, H]`.
    pub shape: [usize; 3],
}

impl Dataset {
    /// Opens `DIR/manifest.json`.
    pub fn open(dir: &Path) -> Result<Self, DatasetError> {
        if !dir.join(MANIFEST).exists() {
            return Err(DatasetError::Manifest(format!(
                "{} has no {MANIFEST}: not a native-format (--format strata) output",
                dir.display()
            )));
        }
        let manifest = Manifest::read(dir).map_err(DatasetError::Manifest)?;
        Ok(Dataset { dir: dir.to_path_buf(), manifest })
    }

    /// Maps shard `i`.
    pub fn shard(&self, i: usize) -> Result<MappedFile, DatasetError> {
        let name = &self.manifest.shards.get(i).ok_or_else(|| DatasetError::Manifest(format!("no shard {i}")))?.file;
        MappedFile::open(&self.dir.join(name))
    }

    /// Reads sample `id` from a mapped shard, checking names, dtypes and shapes.
    pub fn sample<'a>(&self, shard: &'a MappedFile, id: &str, tokens: usize) -> Result<SampleRef<'a>, String> {
        let m = &self.manifest;
        let dtype: DType = m.dtype.parse()?;
        let (l, h) = (m.capture.len(), m.model.hidden_size);
        let get = |suffix: &str, dt: safetensors::Dtype, shape: &[usize]| -> Result<&'a TensorEntry, String> {
            let name = format!("{id}.{suffix}");
            let e = shard.tensors.get(&name).ok_or_else(|| format!("tensor {name:?} is missing"))?;
            if e.dtype != dt {
                return Err(format!("tensor {name:?} has dtype {}, expected {dt}", e.dtype));
            }
            if e.shape != shape {
                return Err(format!("tensor {name:?} has shape {:?}, expected {shape:?}", e.shape));
            }
            Ok(e)
        };
        let ids = get("input_ids", safetensors::Dtype::I64, &[tokens])?;
        let mask = get("loss_mask", safetensors::Dtype::U8, &[tokens])?;
        let hs = get("hidden_states", dtype.to_safetensors(), &[l, tokens, h])?;
        Ok(SampleRef {
            input_ids: shard.bytes(ids).chunks_exact(8).map(|c| i64::from_le_bytes(c.try_into().unwrap())).collect(),
            loss_mask: shard.bytes(mask),
            hidden: shard.bytes(hs),
            dtype,
            shape: [l, tokens, h],
        })
    }
}
