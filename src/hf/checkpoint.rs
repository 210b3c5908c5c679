//! Hugging Face safetensors checkpoints: one file or an index of shards, memory-mapped.
//!
//! Tensors are located by name once at open time; reading one checks its
//! shape and dtype against what the model expects. Norms and biases are
//! decoded to f32; linear weights are read as stored ([`Checkpoint::read_linear`]:
//! FP8 blocks, packed INT4 and bf16 stay codes). A multimodal wrapper's text
//! model is opened under its prefix ([`Checkpoint::open_scoped`]).

use super::quant::{LinearWeight, MappedRows, QuantKind, QuantRows, WeightFormat};
use super::MAX_JSON_BYTES;
use crate::files;
use crate::shape::DType;
use memmap2::Mmap;
use safetensors::SafeTensors;
use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;

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
    #[error("tensor {name:?} has dtype {dtype}, expected {expected}")]
    DType {
        /// Tensor name.
        name: String,
        /// Its dtype.
        dtype: String,
        /// What it may be.
        expected: &'static str,
    },
    /// One tensor stored in two files, with nothing to say which copy counts.
    #[error("tensor {name:?} is stored in both {first} and {second}, and {why}")]
    Duplicate {
        /// Tensor name.
        name: String,
        /// The file it was first found in.
        first: String,
        /// The other file.
        second: String,
        /// Why neither copy can be chosen.
        why: &'static str,
    },
    /// config.json's sizes disagree with the tensors the checkpoint holds.
    #[error("config.json does not fit the checkpoint: {0}; is config.json from another checkpoint?")]
    ConfigMismatch(String),
    /// The checkpoint was opened for another tensor prefix than the config's.
    #[error(transparent)]
    Prefix(#[from] PrefixMismatch),
    /// A weight stored in a way the config does not declare, or quantised
    /// tensors that do not fit together.
    #[error("tensor {name:?}: {problem}")]
    Quant {
        /// Tensor name.
        name: String,
        /// What is wrong.
        problem: String,
    },
}

/// [`Checkpoint::full`] of `name` under `prefix`.
fn full_name(prefix: &str, name: &str) -> String {
    match (prefix.strip_prefix("model."), name.strip_prefix("model.")) {
        (Some(_), Some(rest)) => format!("{prefix}{rest}"),
        (Some(_), None) => name.to_string(),
        _ => format!("{prefix}{name}"),
    }
}

/// Opened under another name prefix than the config's (see [`Checkpoint::open_scoped`]).
#[derive(Debug, thiserror::Error)]
#[error("the config's tensors are under {expected:?} but the checkpoint was opened under {actual:?}; open it with Checkpoint::open_scoped(dir, &config.tensor_prefix)")]
pub struct PrefixMismatch {
    /// The config's prefix.
    pub expected: String,
    /// The checkpoint's.
    pub actual: String,
}

const FLOATS: &str = "F32, BF16 or F16";

enum Bytes {
    // Shared with the weights read in place from it.
    Mapped(Arc<Mmap>),
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

/// A tensor's bytes as stored, in place in the mapped checkpoint (kept
/// mapped while this lives) or in the program.
pub enum TensorBytes {
    /// `map[start..end]`.
    Mapped {
        /// The file's mapping.
        map: Arc<Mmap>,
        /// First byte.
        start: usize,
        /// One past the last byte.
        end: usize,
    },
    /// Bytes compiled into the program (the embedded default model).
    Static(&'static [u8]),
}

impl std::ops::Deref for TensorBytes {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        match self {
            TensorBytes::Mapped { map, start, end } => &map[*start..*end],
            TensorBytes::Static(s) => s,
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
    /// Prepended to every name the model asks for (`language_model.` in a
    /// multimodal wrapper), so the decoders use the text model's own names.
    prefix: String,
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> CheckpointError + '_ {
    move |cause| CheckpointError::Io { path: path.display().to_string(), cause }
}

impl Checkpoint {
    /// Opens `model.safetensors`, or the shards listed in `model.safetensors.index.json`.
    pub fn open(dir: &Path) -> Result<Self, CheckpointError> {
        Self::open_scoped(dir, "")
    }

    /// Opens the tensors named `{prefix}*` of a checkpoint (the language model
    /// of a multimodal wrapper): names are looked up with `prefix` prepended,
    /// and shards listed in the index that hold no such tensor (a vision
    /// tower's) are not opened at all.
    pub fn open_scoped(dir: &Path, prefix: &str) -> Result<Self, CheckpointError> {
        let single = dir.join("model.safetensors");
        let index = dir.join("model.safetensors.index.json");
        // Regular files only: a FIFO in a file's place is refused, never waited on.
        let (paths, owners) = if files::is_regular(&index).map_err(io(&index))? {
            let text = files::read_text(&index, MAX_JSON_BYTES).map_err(io(&index))?;
            let bad = |problem: String| CheckpointError::BadIndex { path: index.display().to_string(), problem };
            let v: serde_json::Value = serde_json::from_str(&text).map_err(|e| bad(e.to_string()))?;
            let map =
                v.get("weight_map").and_then(|m| m.as_object()).ok_or_else(|| bad("no `weight_map` object".into()))?;
            let mut shards: Vec<&str> = Vec::new();
            // The LM head too, which a `model.`-rooted prefix leaves outside it.
            let head = full_name(prefix, "lm_head.weight");
            for (name, f) in map {
                let f = f.as_str().ok_or_else(|| bad(format!("weight_map[{name:?}] is not a string")))?;
                if f.contains('/') || f.contains("..") {
                    return Err(bad(format!("weight_map[{name:?}] = {f:?} points outside the directory")));
                }
                if (name.starts_with(prefix) || *name == head) && !shards.contains(&f) {
                    shards.push(f);
                }
            }
            shards.sort_unstable();
            // Which opened file the index says holds each tensor: it decides between copies.
            let owners: HashMap<String, usize> = map
                .iter()
                .filter_map(|(name, f)| {
                    let i = shards.binary_search(&f.as_str()?).ok()?;
                    Some((name.clone(), i))
                })
                .collect();
            (shards.into_iter().map(|f| dir.join(f)).collect(), Some(owners))
        } else if files::is_regular(&single).map_err(io(&single))? {
            (vec![single], None)
        } else {
            return Err(CheckpointError::NoWeights(dir.display().to_string()));
        };
        let mut mapped = Vec::with_capacity(paths.len());
        for p in &paths {
            let f = files::open_regular(p).map_err(io(p))?;
            // SAFETY: the map is read-only; a checkpoint modified while Strata
            // reads it is outside what any loader can guard against.
            let m = unsafe { Mmap::map(&f) }.map_err(io(p))?;
            mapped.push((p.display().to_string(), Bytes::Mapped(Arc::new(m))));
        }
        let mut ckpt = Self::index(mapped, owners.as_ref())?;
        ckpt.prefix = prefix.to_string();
        Ok(ckpt)
    }

    /// A checkpoint held in memory (the embedded default model).
    pub fn from_static(name: &str, bytes: &'static [u8]) -> Result<Self, CheckpointError> {
        Self::index(vec![(name.to_string(), Bytes::Static(bytes))], None)
    }

    /// Locates every tensor of `files`. A tensor stored in two files is
    /// taken from the one the shard index's weight map (`owners`: tensor
    /// name to file number) names; with no index, or one naming neither, it is an error.
    fn index(files: Vec<(String, Bytes)>, owners: Option<&HashMap<String, usize>>) -> Result<Self, CheckpointError> {
        let mut entries: HashMap<String, Entry> = HashMap::new();
        for (i, (path, bytes)) in files.iter().enumerate() {
            let (n, meta) = SafeTensors::read_metadata(bytes.as_slice())
                .map_err(|e| CheckpointError::BadFile { path: path.clone(), problem: e.to_string() })?;
            let base = 8 + n;
            for (name, info) in meta.tensors() {
                if let Some(old) = entries.get(&name) {
                    match owners.and_then(|o| o.get(&name)) {
                        Some(&owner) if owner == old.file => continue,
                        Some(&owner) if owner == i => {}
                        _ => {
                            return Err(CheckpointError::Duplicate {
                                first: files[old.file].0.clone(),
                                second: path.clone(),
                                name,
                                why: if owners.is_some() {
                                    "model.safetensors.index.json's weight_map names neither"
                                } else {
                                    "there is no model.safetensors.index.json to say which holds it"
                                },
                            })
                        }
                    }
                }
                let entry = Entry {
                    file: i,
                    dtype: info.dtype,
                    shape: info.shape.clone(),
                    start: base + info.data_offsets.0,
                    end: base + info.data_offsets.1,
                };
                entries.insert(name, entry);
            }
        }
        Ok(Checkpoint { files, entries, prefix: String::new() })
    }

    fn entry(&self, name: &str) -> Option<&Entry> {
        if self.prefix.is_empty() {
            self.entries.get(name)
        } else {
            self.entries.get(&self.full(name))
        }
    }

    /// The name as stored in the files. A prefix under `model.` (Qwen3.5's
    /// `model.language_model.`) takes the place of the name's own `model.`,
    /// and the wrapper's own tensors beside it (`lm_head.weight`) keep their
    /// name; any other prefix (Gemma 3's and Llama 4's `language_model.`) is
    /// prepended.
    pub fn full(&self, name: &str) -> String {
        full_name(&self.prefix, name)
    }

    /// The prefix names are looked up under (see [`open_scoped`](Self::open_scoped)).
    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    /// A tensor's stored shape, if present.
    pub fn shape(&self, name: &str) -> Option<&[usize]> {
        self.entry(name).map(|e| e.shape.as_slice())
    }

    /// Decoder layers the checkpoint holds tensors of: one past the highest
    /// `k` of a `model.layers.{k}.*` name (under the prefix); 0 if none.
    pub fn layer_count(&self) -> usize {
        let head = self.full("model.layers.");
        self.entries
            .keys()
            .filter_map(|n| n.strip_prefix(&head)?.split('.').next()?.parse::<usize>().ok())
            .map(|k| k.saturating_add(1))
            .max()
            .unwrap_or(0)
    }

    /// Whether a tensor is present.
    pub fn contains(&self, name: &str) -> bool {
        self.entry(name).is_some()
    }

    /// The stored dtype of a tensor, if present and readable.
    pub fn dtype(&self, name: &str) -> Option<DType> {
        self.entry(name).and_then(|e| DType::from_safetensors(e.dtype))
    }

    /// A tensor's bytes and stored dtype, after checking that it exists with `shape`.
    fn raw(&self, name: &str, shape: &[usize]) -> Result<(&[u8], safetensors::Dtype), CheckpointError> {
        let e = self.entry(name).ok_or_else(|| CheckpointError::Missing(self.full(name)))?;
        if e.shape != shape {
            return Err(CheckpointError::Shape {
                name: self.full(name),
                expected: shape.to_vec(),
                actual: e.shape.clone(),
            });
        }
        Ok((&self.files[e.file].1.as_slice()[e.start..e.end], e.dtype))
    }

    /// A tensor's bytes and dtype, after checking that it exists with `shape`
    /// and a float dtype Strata decodes.
    fn checked(&self, name: &str, shape: &[usize]) -> Result<(&[u8], DType), CheckpointError> {
        let (bytes, dt) = self.raw(name, shape)?;
        let dtype = DType::from_safetensors(dt).ok_or_else(|| CheckpointError::DType {
            name: self.full(name),
            dtype: format!("{dt:?}"),
            expected: if dt == safetensors::Dtype::F8_E4M3 {
                "F32, BF16 or F16 (an F8_E4M3 tensor needs `quantization_config` with quant_method fp8 in config.json)"
            } else {
                FLOATS
            },
        })?;
        Ok((bytes, dtype))
    }

    /// A copy of a float tensor's bytes in its stored dtype, checking its shape.
    pub fn read_bytes(&self, name: &str, shape: &[usize]) -> Result<(Vec<u8>, DType), CheckpointError> {
        let (bytes, dtype) = self.checked(name, shape)?;
        Ok((bytes.to_vec(), dtype))
    }

    /// A float tensor's bytes in its stored dtype, in place (no copy),
    /// checking its shape.
    pub fn tensor_bytes(&self, name: &str, shape: &[usize]) -> Result<(TensorBytes, DType), CheckpointError> {
        let (_, dtype) = self.checked(name, shape)?;
        let e = self.entry(name).expect("checked above");
        let bytes = match &self.files[e.file].1 {
            Bytes::Mapped(m) => TensorBytes::Mapped { map: Arc::clone(m), start: e.start, end: e.end },
            Bytes::Static(s) => TensorBytes::Static(&s[e.start..e.end]),
        };
        Ok((bytes, dtype))
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
        let mut out = Vec::with_capacity(rows.len() * cols.len());
        for r in rows {
            let off = (r * width + cols.start) * es;
            dtype.decode_append(&bytes[off..off + cols.len() * es], &mut out);
        }
        Ok(out)
    }

    /// Reads the block `rows × cols` of the linear layer `module` (weight
    /// `[out, inp]`), as it is stored: FP8 blocks, packed INT4 or bf16 kept
    /// as they are (codes and scales), f32 left in place in the mapping
    /// (copied only if misaligned), f16 decoded to f32. `format` is what the
    /// config declares for this module; the tensors must agree with it.
    pub fn read_linear(
        &self,
        module: &str,
        [out, inp]: [usize; 2],
        rows: std::ops::Range<usize>,
        cols: std::ops::Range<usize>,
        format: WeightFormat,
    ) -> Result<LinearWeight, CheckpointError> {
        let weight = format!("{module}.weight");
        let packed = format!("{module}.weight_packed");
        let fp8 = self.entry(&weight).is_some_and(|e| e.dtype == safetensors::Dtype::F8_E4M3);
        match format {
            WeightFormat::Int4 { group } => {
                self.read_int4(module, [out, inp], rows, cols, group).map(LinearWeight::Quant)
            }
            WeightFormat::Fp8 { block } if fp8 => {
                self.read_fp8(module, [out, inp], rows, cols, block).map(LinearWeight::Quant)
            }
            _ if self.contains(&packed) => Err(CheckpointError::Quant {
                name: self.full(&packed),
                problem: "a pack-quantized weight, but config.json's quantization_config does not select this module"
                    .into(),
            }),
            _ if self.dtype(&weight) == Some(DType::BF16) => {
                // Kept as bf16 (scale 1): in place in the mapping when aligned,
                // else copied as codes; either way packed bit for bit.
                let (bytes, _) = self.checked(&weight, &[out, inp])?;
                // SAFETY: `keep` holds the mapping `bytes` lies in (or the bytes are 'static).
                if let Some(m) = unsafe { MappedRows::new(bytes, inp, rows.clone(), cols.clone(), self.keep(&weight)) }
                {
                    return Ok(LinearWeight::MappedBf16(m));
                }
                let mut q = QuantRows::with_capacity(QuantKind::Bf16, rows.len(), cols.len(), vec![0, cols.len()]);
                for r in rows {
                    q.codes.extend_from_slice(&bytes[(r * inp + cols.start) * 2..(r * inp + cols.end) * 2]);
                    q.scales.push(1.0);
                }
                Ok(LinearWeight::Quant(q))
            }
            _ => {
                let (bytes, dtype) = self.checked(&weight, &[out, inp])?;
                if dtype == DType::F32 {
                    // f32 as stored: read in place, never copied.
                    // SAFETY: `keep` holds the mapping `bytes` lies in (or the bytes are 'static).
                    if let Some(m) =
                        unsafe { MappedRows::new(bytes, inp, rows.clone(), cols.clone(), self.keep(&weight)) }
                    {
                        return Ok(LinearWeight::Mapped(m));
                    }
                }
                let (r, c) = (rows.len(), cols.len());
                let w = self.read_f32_block(&weight, &[out, inp], rows, cols)?;
                Ok(LinearWeight::Dense { rows: r, cols: c, w })
            }
        }
    }

    /// What keeps tensor `name`'s bytes alive: its file's mapping (`None`
    /// for 'static bytes). `name` must have been found.
    fn keep(&self, name: &str) -> Option<Arc<dyn Send + Sync>> {
        match &self.files[self.entry(name).expect("a tensor found before").file].1 {
            Bytes::Mapped(m) => Some(Arc::clone(m) as Arc<dyn Send + Sync>),
            Bytes::Static(_) => None,
        }
    }

    fn read_fp8(
        &self,
        module: &str,
        [out, inp]: [usize; 2],
        rows: std::ops::Range<usize>,
        cols: std::ops::Range<usize>,
        [br, bc]: [usize; 2],
    ) -> Result<QuantRows, CheckpointError> {
        let (w, _) = self.raw(&format!("{module}.weight"), &[out, inp])?;
        let sname = format!("{module}.weight_scale_inv");
        let (sr, sc) = (out.div_ceil(br), inp.div_ceil(bc));
        let (sbytes, sdt) = self.raw(&sname, &[sr, sc])?;
        let sdt = DType::from_safetensors(sdt).ok_or_else(|| CheckpointError::DType {
            name: self.full(&sname),
            dtype: format!("{sdt:?}"),
            expected: FLOATS,
        })?;
        let mut s = vec![0f32; sr * sc];
        sdt.decode_into(sbytes, &mut s);
        let seg = QuantRows::segments(cols.start, cols.len(), bc);
        let ns = seg.len() - 1;
        let mut q = QuantRows::with_capacity(QuantKind::Fp8, rows.len(), cols.len(), seg);
        for r in rows {
            q.codes.extend_from_slice(&w[r * inp + cols.start..r * inp + cols.end]);
            for i in 0..ns {
                q.scales.push(s[(r / br) * sc + (cols.start + q.seg[i]) / bc]);
            }
        }
        // E4M3 has no infinities; 0x7f/0xff are NaN, which no quantiser writes.
        if let Some(i) = q.codes.iter().position(|&c| c & 0x7f == 0x7f) {
            return Err(CheckpointError::Quant {
                name: self.full(&format!("{module}.weight")),
                problem: format!("holds an FP8 NaN code at element {i} of the block read; corrupt checkpoint?"),
            });
        }
        if let Some(bad) = s.iter().find(|v| !v.is_finite()) {
            return Err(CheckpointError::Quant {
                name: self.full(&sname),
                problem: format!("holds a non-finite scale ({bad}); corrupt checkpoint?"),
            });
        }
        Ok(q)
    }

    fn read_int4(
        &self,
        module: &str,
        [out, inp]: [usize; 2],
        rows: std::ops::Range<usize>,
        cols: std::ops::Range<usize>,
        group: usize,
    ) -> Result<QuantRows, CheckpointError> {
        let pname = format!("{module}.weight_packed");
        if !self.contains(&pname) {
            let plain = if self.contains(&format!("{module}.weight")) { " (it has a plain `weight`)" } else { "" };
            return Err(CheckpointError::Quant {
                name: self.full(&pname),
                problem: format!(
                    "missing: config.json's quantization_config selects this module for INT4{plain}; \
                     is the config from another checkpoint?"
                ),
            });
        }
        let words = inp.div_ceil(8);
        let (packed, pdt) = self.raw(&pname, &[out, words])?;
        if pdt != safetensors::Dtype::I32 {
            return Err(CheckpointError::DType { name: self.full(&pname), dtype: format!("{pdt:?}"), expected: "I32" });
        }
        let shape_name = format!("{module}.weight_shape");
        let (sbytes, sdt) = self.raw(&shape_name, &[2])?;
        let stored: Vec<i64> = match sdt {
            safetensors::Dtype::I64 => {
                sbytes.chunks_exact(8).map(|c| i64::from_le_bytes(c.try_into().expect("8 bytes"))).collect()
            }
            safetensors::Dtype::I32 => {
                sbytes.chunks_exact(4).map(|c| i32::from_le_bytes(c.try_into().expect("4 bytes")) as i64).collect()
            }
            other => {
                return Err(CheckpointError::DType {
                    name: self.full(&shape_name),
                    dtype: format!("{other:?}"),
                    expected: "I64 or I32",
                })
            }
        };
        if stored != [out as i64, inp as i64] {
            return Err(CheckpointError::Quant {
                name: self.full(&shape_name),
                problem: format!("holds {stored:?}, but the config gives this weight [{out}, {inp}]"),
            });
        }
        let scale_name = format!("{module}.weight_scale");
        let groups = inp.div_ceil(group);
        let (scale, sdt) = self.raw(&scale_name, &[out, groups])?;
        let sdt = DType::from_safetensors(sdt).ok_or_else(|| CheckpointError::DType {
            name: self.full(&scale_name),
            dtype: format!("{sdt:?}"),
            expected: FLOATS,
        })?;
        let seg = QuantRows::segments(cols.start, cols.len(), group);
        let ns = seg.len() - 1;
        let mut q = QuantRows::with_capacity(QuantKind::Int4, rows.len(), cols.len(), seg);
        let mut srow = vec![0f32; groups];
        let es = sdt.size();
        for r in rows {
            let row = &packed[r * words * 4..(r + 1) * words * 4];
            for c in cols.clone() {
                let byte = row[(c / 8) * 4 + (c % 8) / 2]; // little-endian word: nibbles 2b, 2b+1 in byte b
                q.codes.push(if c % 2 == 0 { byte & 0xf } else { byte >> 4 });
            }
            sdt.decode_into(&scale[r * groups * es..(r + 1) * groups * es], &mut srow);
            for i in 0..ns {
                q.scales.push(srow[(cols.start + q.seg[i]) / group]);
            }
        }
        Ok(q)
    }

    /// Expert `e`'s weight from a fused expert tensor stored input-major,
    /// `name` of shape `[experts, inp, out]` (gpt-oss's `mlp.experts.gate_up_proj`
    /// and `down_proj`), as a `[rows, cols]` linear weight: output rows `rows`
    /// (in the order given, so an interleaved gate/up can be split) by input
    /// columns `cols`. bf16 stays bf16 (codes with scale 1); f32 and f16 are f32.
    pub fn read_expert_linear(
        &self,
        name: &str,
        [experts, inp, out]: [usize; 3],
        e: usize,
        rows: &[usize],
        cols: std::ops::Range<usize>,
    ) -> Result<LinearWeight, CheckpointError> {
        // Element (e, c, r) of the input-major tensor: a strided gather per output row.
        self.expert_gather(name, [experts, inp, out], [e, out, inp], rows, cols, |r, c| (e * inp + c) * out + r)
    }

    /// [`read_expert_linear`](Self::read_expert_linear) of a fused expert
    /// tensor stored output-major, `[experts, out, inp]` (Qwen3.5-MoE's
    /// `mlp.experts.gate_up_proj` and `down_proj`, as `nn.Linear` weights).
    pub fn read_expert_rows(
        &self,
        name: &str,
        [experts, out, inp]: [usize; 3],
        e: usize,
        rows: &[usize],
        cols: std::ops::Range<usize>,
    ) -> Result<LinearWeight, CheckpointError> {
        self.expert_gather(name, [experts, out, inp], [e, out, inp], rows, cols, |r, c| (e * out + r) * inp + c)
    }

    /// Gathers expert `e`'s `rows × cols` from a 3-D tensor of `shape`,
    /// element `(r, c)` at index `at(r, c)`.
    fn expert_gather(
        &self,
        name: &str,
        shape: [usize; 3],
        [e, out, inp]: [usize; 3],
        rows: &[usize],
        cols: std::ops::Range<usize>,
        at: impl Fn(usize, usize) -> usize,
    ) -> Result<LinearWeight, CheckpointError> {
        let (bytes, dtype) = self.checked(name, &shape)?;
        assert!(e < shape[0] && cols.end <= inp && rows.iter().all(|&r| r < out), "block outside tensor {name}");
        let es = dtype.size();
        // A row whose columns lie side by side (an output-major tensor) is one slice.
        let contiguous = cols.len() < 2 || at(0, cols.start + 1) == at(0, cols.start) + 1;
        let row_bytes = |r: usize| &bytes[at(r, cols.start) * es..][..cols.len() * es];
        if dtype == DType::BF16 {
            let mut q = QuantRows::with_capacity(QuantKind::Bf16, rows.len(), cols.len(), vec![0, cols.len()]);
            for &r in rows {
                if contiguous {
                    q.codes.extend_from_slice(row_bytes(r));
                } else {
                    cols.clone().for_each(|c| q.codes.extend_from_slice(&bytes[at(r, c) * es..][..2]));
                }
                q.scales.push(1.0);
            }
            return Ok(LinearWeight::Quant(q));
        }
        let mut w = Vec::with_capacity(rows.len() * cols.len());
        for &r in rows {
            if contiguous {
                dtype.decode_append(row_bytes(r), &mut w);
            } else {
                cols.clone().for_each(|c| dtype.decode_append(&bytes[at(r, c) * es..][..es], &mut w));
            }
        }
        Ok(LinearWeight::Dense { rows: rows.len(), cols: cols.len(), w })
    }

    /// Expert `e`'s MXFP4 weight from `{module}_blocks` (`U8 [experts, out,
    /// inp/32, 16]`, two E2M1 codes per byte, low nibble first) and
    /// `{module}_scales` (`U8 [experts, out, inp/32]`, E8M0 exponents with
    /// bias 127): output rows `rows` (in the order given) by input columns
    /// `cols`, kept as codes with one scale `2^(s - 127)` per row and
    /// 32-column block (a block a tensor-parallel cut shares keeps its scale
    /// on both sides). A scale byte of 0xFF (E8M0's NaN) is refused.
    pub fn read_mxfp4(
        &self,
        module: &str,
        [experts, out, inp]: [usize; 3],
        e: usize,
        rows: &[usize],
        cols: std::ops::Range<usize>,
    ) -> Result<QuantRows, CheckpointError> {
        let (bname, sname) = (format!("{module}_blocks"), format!("{module}_scales"));
        if !self.contains(&bname) {
            let plain = if self.contains(module) { " (it has the plain tensor)" } else { "" };
            return Err(CheckpointError::Quant {
                name: self.full(&bname),
                problem: format!(
                    "missing: config.json's quantization_config says mxfp4{plain}; is the config from another checkpoint?"
                ),
            });
        }
        let nb = inp.div_ceil(32);
        let (blocks, bdt) = self.raw(&bname, &[experts, out, nb, 16])?;
        let (scales, sdt) = self.raw(&sname, &[experts, out, nb])?;
        for (n, dt) in [(&bname, bdt), (&sname, sdt)] {
            if dt != safetensors::Dtype::U8 {
                return Err(CheckpointError::DType { name: self.full(n), dtype: format!("{dt:?}"), expected: "U8" });
            }
        }
        assert!(e < experts && cols.end <= inp && rows.iter().all(|&r| r < out), "block outside tensor {module}");
        let seg = QuantRows::segments(cols.start, cols.len(), 32);
        let ns = seg.len() - 1;
        let mut q = QuantRows::with_capacity(QuantKind::Mxfp4, rows.len(), cols.len(), seg);
        for &r in rows {
            let row = (e * out + r) * nb;
            let codes = &blocks[row * 16..(row + nb) * 16];
            q.codes.extend(cols.clone().map(|c| (codes[c / 2] >> (4 * (c % 2))) & 0xf));
            for i in 0..ns {
                let b = (cols.start + q.seg[i]) / 32;
                let s = scales[row + b];
                if s == 0xff {
                    return Err(CheckpointError::Quant {
                        name: self.full(&sname),
                        problem: format!(
                            "holds 0xFF (E8M0's NaN) for expert {e}, row {r}, block {b}; corrupt checkpoint?"
                        ),
                    });
                }
                q.scales.push(super::quant::e8m0_to_f32(s));
            }
        }
        Ok(q)
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

/// Tensors at most this long are hashed whole by [`Checkpoint::digest`].
const DIGEST_WHOLE: usize = 64 << 10;
/// Windows sampled from a longer tensor, and their length.
const DIGEST_WINDOWS: usize = 32;
const DIGEST_WINDOW: usize = 64;

impl Checkpoint {
    /// A digest of the weights that changes when any tensor does, without
    /// reading a terabyte: every file's safetensors header (names, dtypes,
    /// shapes, offsets, metadata), plus each tensor's bytes, whole when
    /// short and otherwise 32 windows of 64 bytes spread evenly over it
    /// (first and last included). Built from file base names and contents
    /// only, so a copy on another machine has the same digest.
    pub fn digest(&self) -> String {
        let mut h = xxhash_rust::xxh3::Xxh3::new();
        let mut order: Vec<usize> = (0..self.files.len()).collect();
        let base = |i: usize| Path::new(&self.files[i].0).file_name().map(|n| n.to_string_lossy().to_string());
        order.sort_by_key(|&i| base(i));
        for &i in &order {
            let bytes = self.files[i].1.as_slice();
            h.update(base(i).unwrap_or_default().as_bytes());
            // Parsed at open, so the length prefix is sound.
            let n = u64::from_le_bytes(bytes[..8].try_into().expect("8 bytes")) as usize;
            h.update(&bytes[..8 + n]);
        }
        let mut names: Vec<&String> = self.entries.keys().collect();
        names.sort();
        for name in names {
            let e = &self.entries[name];
            let data = &self.files[e.file].1.as_slice()[e.start..e.end];
            if data.len() <= DIGEST_WHOLE {
                h.update(data);
            } else {
                let last = data.len() - DIGEST_WINDOW;
                for w in 0..DIGEST_WINDOWS {
                    let at = last * w / (DIGEST_WINDOWS - 1);
                    h.update(&data[at..at + DIGEST_WINDOW]);
                }
            }
        }
        format!("xxh3:{:016x}", h.digest())
    }
}
