//! Datasets once written: a native output directory and its shards read
//! back ([`Dataset`], every size checked), and the tools over them:
//! [`verify`] (against the manifest), [`inspect`] and [`stats`]. What the
//! files say, the [`manifest`] and a mapped safetensors file
//! ([`MappedFile`]), is [`crate::format`]'s, re-exported here. This folder
//! only reads: running the model again over a dataset is a job
//! ([`crate::job::recompute`]).

pub mod inspect;
pub mod stats;
pub mod verify;

use crate::files;
use crate::shape::DType;
use manifest::{Manifest, MANIFEST};
use std::path::{Path, PathBuf};
use verify::{quote, scrub};

pub use crate::format::manifest;
pub use crate::format::{DatasetError, MappedFile, TensorEntry};

/// A shape as `{:?}` prints it, cut after 8 dims: a header may claim thousands.
fn dims(shape: &[usize]) -> String {
    const MAX: usize = 8;
    if shape.len() <= MAX {
        return format!("{shape:?}");
    }
    let head: Vec<String> = shape[..MAX].iter().map(usize::to_string).collect();
    format!("[{}, …] ({} dims)", head.join(", "), shape.len())
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
    /// `hidden_states` bytes, `[L, T, H]` in `dtype` (a speculators file's
    /// `[T, L, H]` is transposed into an owned copy; FP8 is dequantised into
    /// an owned f32 copy).
    pub hidden: std::borrow::Cow<'a, [u8]>,
    /// The dtype of `hidden`: the stored one, or f32 for FP8.
    pub dtype: DType,
    /// The dtype on disk.
    pub stored: DType,
    /// `[L, T, H]`.
    pub shape: [usize; 3],
}

impl SampleRef<'_> {
    /// The `[T, H]` bytes of layer `l`; empty past the last layer or when a dim is 0.
    pub fn layer(&self, l: usize) -> &[u8] {
        let per = self.hidden.len() / self.shape[0].max(1);
        let start = l.saturating_mul(per);
        self.hidden.get(start..start.saturating_add(per)).unwrap_or(&[])
    }
}

impl Dataset {
    /// Opens `DIR/manifest.json`; a manifest that is not a regular file (a
    /// FIFO, a device) is refused before anything reads it.
    pub fn open(dir: &Path) -> Result<Self, DatasetError> {
        let path = dir.join(MANIFEST);
        let none = || {
            DatasetError::Manifest(format!(
                "{} has no {MANIFEST}: not a Strata output (or one written before schema 2 in the speculators format)",
                dir.display()
            ))
        };
        match files::is_regular(&path) {
            Ok(true) => {}
            Ok(false) => return Err(none()),
            // `dir` is a file, not a directory: no dataset either.
            Err(_) if !dir.is_dir() => return Err(none()),
            Err(cause) => return Err(DatasetError::Io { path: path.display().to_string(), cause }),
        }
        // A parse error may quote a field's value, of any length.
        let manifest = Manifest::read(dir).map_err(DatasetError::Unreadable)?;
        Ok(Dataset { dir: dir.to_path_buf(), manifest })
    }

    /// Maps shard `i`; its file must lie inside the dataset directory (no
    /// absolute path, no `..`, no link leading out).
    pub fn shard(&self, i: usize) -> Result<MappedFile, DatasetError> {
        let shards = &self.manifest.shards;
        let name = &shards
            .get(i)
            .ok_or_else(|| {
                DatasetError::Manifest(format!(
                    "{}: no shard {i} (the manifest lists {})",
                    self.dir.join(MANIFEST).display(),
                    shards.len()
                ))
            })?
            .file;
        let path = files::inside(&self.dir, name).map_err(|e| {
            DatasetError::Manifest(format!("{}: shard {i}: {}", self.dir.join(MANIFEST).display(), scrub(e, name)))
        })?;
        MappedFile::open(&path)
    }

    /// Whether the dataset is in the speculators layout (one `hs_{i}` file per sample).
    pub fn is_speculators(&self) -> bool {
        self.manifest.format == "speculators"
    }

    /// The tensors sample `id` is stored as, in checksum order: `{id}.input_ids`,
    /// `{id}.loss_mask`, `{id}.hidden_states`; or a speculators file's `token_ids`,
    /// `loss_mask` (schema 3 on), `hidden_states`.
    /// FP8 states add their scales, `hidden_states_scales`, last.
    pub fn tensor_names(&self, id: &str) -> Vec<String> {
        let mut names: Vec<String> = if self.is_speculators() && self.manifest.schema_version >= 3 {
            vec!["token_ids".into(), "loss_mask".into(), "hidden_states".into()]
        } else if self.is_speculators() {
            vec!["token_ids".into(), "hidden_states".into()]
        } else {
            ["input_ids", "loss_mask", "hidden_states"].iter().map(|e| format!("{id}.{e}")).collect()
        };
        if self.dtype().is_ok_and(DType::scaled) {
            let scales = if self.is_speculators() { SCALES.to_string() } else { format!("{id}.{SCALES}") };
            names.push(scales);
        }
        names
    }

    /// The storage dtype the manifest records.
    pub fn dtype(&self) -> Result<DType, String> {
        let d = &self.manifest.dtype;
        d.parse().map_err(|_| format!("dtype {} is not f32, bf16, f16 or fp8", quote(d)))
    }

    /// Reads sample `id` from a mapped shard, checking names, dtypes and shapes.
    pub fn sample<'a>(&self, shard: &'a MappedFile, id: &str, tokens: usize) -> Result<SampleRef<'a>, String> {
        if self.is_speculators() {
            return self.speculators_sample(shard, tokens);
        }
        let m = &self.manifest;
        let dtype = self.dtype()?;
        let (l, h) = (m.capture.len(), m.model.hidden_size);
        let get = |suffix: &str, dt: safetensors::Dtype, shape: &[usize]| -> Result<&'a TensorEntry, String> {
            let name = format!("{id}.{suffix}");
            let e = shard.tensors.get(&name).ok_or_else(|| format!("tensor {} is missing", quote(&name)))?;
            if e.dtype != dt {
                return Err(format!("tensor {} has dtype {}, expected {dt}", quote(&name), e.dtype));
            }
            if e.shape != shape {
                return Err(format!("tensor {} has shape {}, expected {shape:?}", quote(&name), dims(&e.shape)));
            }
            Ok(e)
        };
        let ids = get("input_ids", safetensors::Dtype::I64, &[tokens])?;
        let mask = get("loss_mask", safetensors::Dtype::U8, &[tokens])?;
        let hs = shard.bytes(get("hidden_states", dtype.to_safetensors(), &[l, tokens, h])?);
        let hidden = match dtype.scaled() {
            true => dequantize(hs, shard.bytes(get(SCALES, safetensors::Dtype::F32, &[l, tokens, 1])?), h)?.into(),
            false => hs.into(),
        };
        Ok(SampleRef {
            input_ids: shard.bytes(ids).chunks_exact(8).map(|c| i64::from_le_bytes(c.try_into().unwrap())).collect(),
            loss_mask: shard.bytes(mask),
            hidden,
            dtype: if dtype.scaled() { DType::F32 } else { dtype },
            stored: dtype,
            shape: [l, tokens, h],
        })
    }

    /// A speculators file: `token_ids [T]`, `loss_mask [T]` (schema 3 on), `hidden_states [T, L, H]`.
    fn speculators_sample<'a>(&self, f: &'a MappedFile, tokens: usize) -> Result<SampleRef<'a>, String> {
        let m = &self.manifest;
        let stored = self.dtype()?;
        let (l, h) = (m.capture.len(), m.model.hidden_size);
        let get = |name: &str, dt: safetensors::Dtype, shape: &[usize]| -> Result<&'a TensorEntry, String> {
            let e = f.tensors.get(name).ok_or_else(|| format!("tensor {} is missing", quote(name)))?;
            if e.dtype != dt || e.shape != shape {
                return Err(format!(
                    "tensor {} is {} {}, expected {dt} {shape:?}",
                    quote(name),
                    e.dtype,
                    dims(&e.shape)
                ));
            }
            Ok(e)
        };
        let ids = get("token_ids", safetensors::Dtype::I64, &[tokens])?;
        // Schema 3 files carry the row's loss mask too (the dataset table is rebuilt from them).
        let mask = match self.manifest.schema_version >= 3 {
            true => f.bytes(get("loss_mask", safetensors::Dtype::U8, &[tokens])?),
            false => &[],
        };
        let hs = f.bytes(get("hidden_states", stored.to_safetensors(), &[tokens, l, h])?);
        let deq;
        let (hs, dtype) = match stored.scaled() {
            true => {
                deq = dequantize(hs, f.bytes(get(SCALES, safetensors::Dtype::F32, &[tokens, l, 1])?), h)?;
                (&deq[..], DType::F32)
            }
            false => (hs, stored),
        };
        // [T, L, H] -> [L, T, H], row by row of H values.
        let row = h * dtype.size();
        let mut lth = vec![0u8; hs.len()];
        for (i, src) in hs.chunks_exact(row.max(1)).enumerate() {
            let (t, layer) = (i / l.max(1), i % l.max(1));
            let at = (layer * tokens + t) * row;
            lth[at..at + row].copy_from_slice(src);
        }
        Ok(SampleRef {
            input_ids: f.bytes(ids).chunks_exact(8).map(|c| i64::from_le_bytes(c.try_into().unwrap())).collect(),
            loss_mask: mask,
            hidden: lth.into(),
            dtype,
            stored,
            shape: [l, tokens, h],
        })
    }
}

/// The name of FP8 states' scale tensor (`{id}.hidden_states_scales` in the native format).
pub const SCALES: &str = "hidden_states_scales";

/// FP8 codes times their row scales (one per `h` codes), as f32 bytes. A
/// scale that is not finite and positive is refused: Strata never writes one.
pub fn dequantize(codes: &[u8], scales: &[u8], h: usize) -> Result<Vec<u8>, String> {
    let mut out = vec![0u8; codes.len() * 4];
    let rows = codes.chunks_exact(h.max(1)).zip(scales.chunks_exact(4)).zip(out.chunks_exact_mut(h.max(1) * 4));
    let mut row = vec![0f32; h];
    for (i, ((c, s), o)) in rows.enumerate() {
        let s = f32::from_le_bytes(s.try_into().expect("4 bytes"));
        if !(s.is_finite() && s > 0.0) {
            return Err(format!("FP8 row {i} has scale {s}: scales must be finite and positive"));
        }
        crate::shape::fp8::dequantize_row(c, s, &mut row);
        o.copy_from_slice(bytemuck::cast_slice(&row));
    }
    Ok(out)
}
