//! Hugging Face safetensors checkpoints: one file or an index of shards, memory-mapped.
//!
//! Tensors are located by name once at open time; reading one checks its
//! shape and dtype against what the model expects and decodes it to f32.

use crate::shape::DType;
use memmap2::Mmap;
use safetensors::SafeTensors;
use std::collections::HashMap;
use std::path::{Path, PathBuf};

/// Why a checkpoint's weights cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    /// A file cannot be opened or mapped.
    #[error("cannot read {path}: {cause}")]
    Io {
        /// The file.
        path: String,
        /// The OS error.
        cause: std::io::Error,
    },
    /// No weights file in the directory.
    #[error("no model.safetensors or model.safetensors.index.json in {0}")]
    NoWeights(String),
    /// The shard index is not valid JSON of the expected form.
    #[error("malformed {path}: {problem}")]
    BadIndex {
        /// The index file.
        path: String,
        /// What is wrong.
        problem: String,
    },
    /// A safetensors file whose header or length is wrong (e.g. truncated).
    #[error("{path} is not a valid safetensors file ({problem}); truncated or corrupt download?")]
    BadFile {
        /// The file.
        path: String,
        /// The parser's complaint.
        problem: String,
    },
    /// A tensor the model needs is absent.
    #[error("tensor {0:?} is missing from the checkpoint")]
    Missing(String),
    /// A tensor of the wrong shape.
    #[error("tensor {name:?}: expected shape {expected:?}, got {actual:?}")]
    Shape {
        /// Tensor name.
        name: String,
        /// Shape from the config.
        expected: Vec<usize>,
        /// Shape in the file.
        actual: Vec<usize>,
    },
    /// A tensor of a dtype Strata does not read.
    #[error("tensor {name:?} has dtype {dtype}, expected F32, BF16 or F16")]
    DType {
        /// Tensor name.
        name: String,
        /// Its dtype.
        dtype: String,
    },
}

enum Bytes {
    Mapped(Mmap),
    Static(&'static [u8]),
}

impl Bytes {
    fn as_slice(&self) -> &[u8] {
        match self {
            Bytes::Mapped(m) => m,
            Bytes::Static(s) => s,
        }
    }
}

struct Entry {
    file: usize,
    dtype: safetensors::Dtype,
    shape: Vec<usize>,
    start: usize,
    end: usize,
}

/// An opened checkpoint: mapped files and where each tensor lives.
pub struct Checkpoint {
    files: Vec<(String, Bytes)>,
    entries: HashMap<String, Entry>,
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> CheckpointError + '_ {
    move |cause| CheckpointError::Io { path: path.display().to_string(), cause }
}

impl Checkpoint {
    /// Opens `model.safetensors`, or the shards listed in `model.safetensors.index.json`.
    pub fn open(dir: &Path) -> Result<Self, CheckpointError> {
        let single = dir.join("model.safetensors");
        let index = dir.join("model.safetensors.index.json");
        let paths: Vec<PathBuf> = if index.exists() {
            let text = std::fs::read_to_string(&index).map_err(io(&index))?;
            let bad = |problem: String| CheckpointError::BadIndex { path: index.display().to_string(), problem };
            let v: serde_json::Value = serde_json::from_str(&text).map_err(|e| bad(e.to_string()))?;
            let map =
                v.get("weight_map").and_then(|m| m.as_object()).ok_or_else(|| bad("no `weight_map` object".into()))?;
            let mut files: Vec<String> = Vec::new();
            for (name, f) in map {
                let f = f.as_str().ok_or_else(|| bad(format!("weight_map[{name:?}] is not a string")))?;
                if f.contains('/') || f.contains("..") {
                    return Err(bad(format!("weight_map[{name:?}] = {f:?} points outside the directory")));
                }
                if !files.iter().any(|x| x == f) {
                    files.push(f.to_string());
                }
            }
            files.sort();
            files.into_iter().map(|f| dir.join(f)).collect()
        } else if single.exists() {
            vec![single]
        } else {
            return Err(CheckpointError::NoWeights(dir.display().to_string()));
        };
        let mut files = Vec::with_capacity(paths.len());
        for p in &paths {
            let f = std::fs::File::open(p).map_err(io(p))?;
            // SAFETY: the map is read-only; a checkpoint modified while Strata
            // reads it is outside what any loader can guard against.
            let m = unsafe { Mmap::map(&f) }.map_err(io(p))?;
            files.push((p.display().to_string(), Bytes::Mapped(m)));
        }
        Self::index(files)
    }

    /// A checkpoint held in memory (the embedded default model).
    pub fn from_static(name: &str, bytes: &'static [u8]) -> Result<Self, CheckpointError> {
        Self::index(vec![(name.to_string(), Bytes::Static(bytes))])
    }

    fn index(files: Vec<(String, Bytes)>) -> Result<Self, CheckpointError> {
        let mut entries = HashMap::new();
        for (i, (path, bytes)) in files.iter().enumerate() {
            let (n, meta) = SafeTensors::read_metadata(bytes.as_slice())
                .map_err(|e| CheckpointError::BadFile { path: path.clone(), problem: e.to_string() })?;
            let base = 8 + n;
            for (name, info) in meta.tensors() {
                entries.insert(
                    name,
                    Entry {
                        file: i,
                        dtype: info.dtype,
                        shape: info.shape.clone(),
                        start: base + info.data_offsets.0,
                        end: base + info.data_offsets.1,
                    },
                );
            }
        }
        Ok(Checkpoint { files, entries })
    }

    /// Whether a tensor is present.
    pub fn contains(&self, name: &str) -> bool {
        self.entries.contains_key(name)
    }

    /// The stored dtype of a tensor, if present and readable.
    pub fn dtype(&self, name: &str) -> Option<DType> {
        self.entries.get(name).and_then(|e| DType::from_safetensors(e.dtype))
    }

    /// A tensor's bytes and dtype, after checking that it exists with `shape`
    /// and a dtype Strata decodes.
    fn checked(&self, name: &str, shape: &[usize]) -> Result<(&[u8], DType), CheckpointError> {
        let e = self.entries.get(name).ok_or_else(|| CheckpointError::Missing(name.to_string()))?;
        if e.shape != shape {
            return Err(CheckpointError::Shape {
                name: name.to_string(),
                expected: shape.to_vec(),
                actual: e.shape.clone(),
            });
        }
        let dtype = DType::from_safetensors(e.dtype)
            .ok_or_else(|| CheckpointError::DType { name: name.to_string(), dtype: format!("{:?}", e.dtype) })?;
        Ok((&self.files[e.file].1.as_slice()[e.start..e.end], dtype))
    }

    /// Reads a tensor as f32, checking its shape.
    pub fn read_f32(&self, name: &str, shape: &[usize]) -> Result<Vec<f32>, CheckpointError> {
        let (bytes, dtype) = self.checked(name, shape)?;
        let mut out = vec![0f32; shape.iter().product()];
        dtype.decode_into(bytes, &mut out);
        Ok(out)
    }

    /// Reads the block `rows × cols` of a 2-D tensor (or `rows` of a 1-D one,
    /// with `cols = 0..1`) as f32, checking the full shape first. Only the
    /// block is decoded: a tensor-parallel rank never materialises the whole weight.
    pub fn read_f32_block(
        &self,
        name: &str,
        shape: &[usize],
        rows: std::ops::Range<usize>,
        cols: std::ops::Range<usize>,
    ) -> Result<Vec<f32>, CheckpointError> {
        let (bytes, dtype) = self.checked(name, shape)?;
        let width = if shape.len() == 2 { shape[1] } else { 1 };
        assert!(rows.end <= shape[0] && cols.end <= width, "block outside tensor {name}");
        let es = dtype.size();
        let mut out = vec![0f32; rows.len() * cols.len()];
        for (r, dst) in rows.zip(out.chunks_exact_mut(cols.len().max(1))) {
            let off = (r * width + cols.start) * es;
            dtype.decode_into(&bytes[off..off + cols.len() * es], dst);
        }
        Ok(out)
    }

    /// Reads an optional tensor (e.g. a bias): `Ok(None)` when absent.
    pub fn read_f32_opt(&self, name: &str, shape: &[usize]) -> Result<Option<Vec<f32>>, CheckpointError> {
        if self.contains(name) {
            self.read_f32(name, shape).map(Some)
        } else {
            Ok(None)
        }
    }
}
