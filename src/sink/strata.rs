//! The native format: samples packed into `shard-NNNNN.safetensors` files of
//! about `shard_size` bytes, indexed by `manifest.json` (docs/FORMAT.md).
//!
//! A shard is streamed to a temp file whose header region is reserved up
//! front (safetensors allows a space-padded header), so its data never sits
//! in memory; on close the header is filled in, the file fsynced, journaled
//! and renamed ([`OutputDir::commit`]).

use super::output::{OutLoc, Output, Temp};
use super::spool::Spool;
use super::{io_err, OpenMode, OutputDir, Sink, SinkError};
use crate::format::manifest::{hash_hex, InputInfo, Manifest, SampleInfo, ShardInfo};
use crate::pipeline::source::{InputPos, Sample};
use crate::shape::{check_dim, fp8, DType, Dim, StatesView};
use std::collections::BTreeMap;
use std::io::{Seek, SeekFrom, Write};
use xxhash_rust::xxh3::Xxh3;

/// Default target shard size: 1 GiB.
pub const DEFAULT_SHARD_SIZE: u64 = 1 << 30;

struct Entry {
    dtype: &'static str,
    shape: Vec<usize>,
    start: u64,
    end: u64,
}

fn entry_json(name: &str, e: &Entry) -> String {
    // The shape is joined by hand: the name (an id) must stay exactly as quoted.
    let shape: Vec<String> = e.shape.iter().map(usize::to_string).collect();
    format!(
        "{}:{{\"dtype\":\"{}\",\"shape\":[{}],\"data_offsets\":[{},{}]}}",
        serde_json::Value::String(name.to_string()),
        e.dtype,
        shape.join(","),
        e.start,
        e.end
    )
}

const SHARD_METADATA: &str = "\"__metadata__\":{\"format\":\"strata\",\"schema_version\":\"1\"}";

/// The JSON-quoted length of a tensor name (ids may need escaping).
fn quoted_len(name: &str) -> usize {
    serde_json::Value::String(name.to_string()).to_string().len()
}

struct ShardWriter {
    index: usize,
    name: String,
    tmp: Temp,
    // The data, written on its own thread.
    file: Spool,
    reserve: usize,
    header_len: usize,
    data_len: u64,
    entries: BTreeMap<String, Entry>,
    samples: Vec<SampleInfo>,
    end: InputPos,
}

impl ShardWriter {
    fn create(out: &OutputDir, index: usize, reserve: usize) -> Result<Self, SinkError> {
        let name = StrataSink::<usize, usize>::shard_name(index);
        // Opened read-write: read back when the shard is compacted on close.
        let (tmp, f) = out.create_temp(&name)?;
        let mut file = Spool::new(f);
        // Header region, filled in on close.
        file.put(|b| b.resize(b.len() + 8 + reserve, b' ')).map_err(io_err(&tmp))?;
        Ok(ShardWriter {
            index,
            name,
            tmp,
            file,
            reserve,
            header_len: 2 + SHARD_METADATA.len(),
            data_len: 0,
            entries: BTreeMap::new(),
            samples: Vec::new(),
            end: InputPos::default(),
        })
    }

    fn add(&mut self, name: String, dtype: &'static str, shape: Vec<usize>, bytes: u64) {
        let e = Entry { dtype, shape, start: self.data_len, end: self.data_len + bytes };
        self.header_len += entry_json(&name, &e).len() + 1;
        self.data_len += bytes;
        self.entries.insert(name, e);
    }

    /// Appends the bytes `fill` adds to the data and to `hasher`.
    fn put(&mut self, hasher: &mut Xxh3, fill: impl FnOnce(&mut Vec<u8>)) -> Result<(), SinkError> {
        hasher.update(self.file.put(fill).map_err(io_err(&self.tmp))?);
        Ok(())
    }

    /// Fills in the header and fsyncs; returns the temporary file to commit.
    /// When the unused part of the reserved header region would be more than
    /// 1/16 of the data (small shards), the data is copied behind a tight header instead.
    fn close(self, out: &OutputDir) -> Result<(Temp, ShardInfo, Vec<SampleInfo>, InputPos), SinkError> {
        let mut header = String::with_capacity(self.reserve);
        header.push('{');
        header.push_str(SHARD_METADATA);
        for (name, e) in &self.entries {
            header.push(',');
            header.push_str(&entry_json(name, e));
        }
        header.push('}');
        if header.len() > self.reserve {
            // `write_sample` bounds every entry, so this is a bug, reported rather than written.
            return Err(SinkError::Directory(format!(
                "shard {} header needs {} bytes, more than the {} reserved",
                self.name,
                header.len(),
                self.reserve
            )));
        }
        let mut header = header.into_bytes();
        let tight = header.len().next_multiple_of(8);
        let compact = (self.reserve.saturating_sub(tight)) as u64 > self.data_len / 16;
        header.resize(if compact { tight } else { self.reserve }, b' ');
        let tmp = self.tmp.clone();
        let mut f = self.file.finish().map_err(io_err(&tmp))?;
        let reserve = self.reserve as u64;
        let done = if compact {
            let (tight_tmp, tight) = out.create_temp(&format!("{}.compact", self.name))?;
            let r = (|| -> std::io::Result<()> {
                let mut w = std::io::BufWriter::new(tight);
                w.write_all(&(header.len() as u64).to_le_bytes())?;
                w.write_all(&header)?;
                f.seek(SeekFrom::Start(8 + reserve))?;
                std::io::copy(&mut f, &mut w)?;
                let w = w.into_inner().map_err(|e| std::io::Error::other(e.to_string()))?;
                w.sync_all()
            })();
            drop(f);
            out.discard(&tmp);
            if let Err(e) = r {
                out.discard(&tight_tmp);
                return Err(io_err(&tight_tmp)(e));
            }
            tight_tmp
        } else {
            (|| -> std::io::Result<()> {
                f.seek(SeekFrom::Start(0))?;
                f.write_all(&reserve.to_le_bytes())?;
                f.write_all(&header)?;
                f.sync_all()
            })()
            .map_err(|e| {
                out.discard(&tmp);
                io_err(&tmp)(e)
            })?;
            tmp
        };
        let bytes = 8 + header.len() as u64 + self.data_len;
        let info = ShardInfo { file: self.name, samples: self.samples.len(), bytes, input: None };
        Ok((done, info, self.samples, self.end))
    }
}

/// Writes the native sharded format with a manifest.
pub struct StrataSink<L: Dim, H: Dim> {
    out: Output,
    layers: L,
    hidden: H,
    dtype: DType,
    shard_size: u64,
    input_path: String,
    shard: Option<ShardWriter>,
    reserve: usize,
    resumed: usize,
    bytes_written: u64,
    // FP8 scales of the sample being written, `[L, T]`.
    scales: Vec<f32>,
}

impl<L: Dim, H: Dim> StrataSink<L, H> {
    /// The file name of shard `i`.
    pub fn shard_name(i: usize) -> String {
        format!("shard-{i:05}.safetensors")
    }

    /// Opens `dir` for a run described by `manifest` (its `shards` and
    /// `samples` empty). With [`OpenMode::Resume`] an existing manifest must
    /// describe the same job; its finished shards are kept and their samples skipped.
    pub fn open(
        dir: impl Into<OutLoc>,
        manifest: Manifest,
        layers: L,
        hidden: H,
        mode: OpenMode,
    ) -> Result<Self, SinkError> {
        check_dim("manifest capture list", "layers", layers, manifest.capture.len())?;
        check_dim("manifest hidden_size", "hidden", hidden, manifest.model.hidden_size)?;
        let dtype: DType = manifest.dtype.parse().map_err(SinkError::Directory)?;
        let shard_size = manifest.shard_size;
        let input_path = manifest.input.as_ref().map_or_else(String::new, |i| i.path.clone());
        let out = Output::new(dir, mode, Manifest { format: "strata".into(), layout: "LTH".into(), ..manifest })?;
        // Room for ~3 header entries per sample; at least 4 KiB, at most 1 MiB.
        let reserve = ((shard_size / 256) as usize).clamp(4096, 1 << 20).next_multiple_of(8);
        let resumed = out.manifest().consumed();
        Ok(StrataSink {
            out,
            layers,
            hidden,
            dtype,
            shard_size,
            input_path,
            shard: None,
            reserve,
            resumed,
            bytes_written: 0,
            scales: Vec::new(),
        })
    }

    /// The manifest as written so far.
    pub fn manifest(&self) -> &Manifest {
        self.out.manifest()
    }

    fn close_shard(&mut self) -> Result<(), SinkError> {
        if let Some(shard) = self.shard.take() {
            let out = self.out.get()?;
            let (tmp, info, samples, end) = shard.close(out)?;
            self.bytes_written += info.bytes;
            out.commit(tmp, info, samples, end)?;
        }
        Ok(())
    }
}

impl<L: Dim, H: Dim> Sink<L, H> for StrataSink<L, H> {
    fn write_sample(&mut self, sample: &Sample, states: StatesView<'_, L, H>) -> Result<(), SinkError> {
        let _span = tracing::debug_span!("write", index = sample.index).entered();
        let ctx = || format!("sample {:?}", sample.id);
        check_dim(&ctx(), "layers", self.layers, states.layers().size())?;
        check_dim(&ctx(), "hidden", self.hidden, states.hidden().size())?;
        check_dim(&ctx(), "tokens", sample.len(), states.tokens())?;
        let [l, t, h] = states.shape();
        let hs_bytes = (l * t * h * self.dtype.size()) as u64;
        let sample_bytes = (t * 8 + t) as u64 + hs_bytes;
        // FP8 states carry an f32 scale per token and capture point, `[L, T, 1]`.
        let scale_bytes = if self.dtype.scaled() { (l * t * 4) as u64 } else { 0 };
        let sample_bytes = sample_bytes + scale_bytes;
        let mut names = vec![
            format!("{}.input_ids", sample.id),
            format!("{}.loss_mask", sample.id),
            format!("{}.hidden_states", sample.id),
        ];
        if self.dtype.scaled() {
            names.push(format!("{}.hidden_states_scales", sample.id));
        }
        // Bound on one entry: the quoted (escaped) name plus at most 150 bytes
        // of dtype, shape and offsets, and a comma.
        let header_growth: usize = names.iter().map(|n| quoted_len(n) + 151).sum();
        if let Some(s) = &self.shard {
            if s.data_len + sample_bytes > self.shard_size || s.header_len + header_growth > self.reserve {
                self.close_shard()?;
            }
        }
        if self.shard.is_none() {
            if 2 + SHARD_METADATA.len() + header_growth > self.reserve {
                return Err(SinkError::Directory(format!(
                    "sample {}: its tensor names do not fit a shard header of {} bytes",
                    crate::clip(&sample.id, 80),
                    self.reserve
                )));
            }
            let out = self.out.get()?;
            let index = out.listed().shards;
            self.shard = Some(ShardWriter::create(out, index, self.reserve)?);
        }
        let shard = self.shard.as_mut().expect("opened above");
        let mut hasher = Xxh3::new();

        // Encoded straight into the writer's buffer, hashed there, and written
        // on the writer's thread while the next bytes are encoded.
        shard.put(&mut hasher, |b| b.extend(sample.input_ids.iter().flat_map(|&v| (v as i64).to_le_bytes())))?;
        shard.put(&mut hasher, |b| match &sample.loss_mask {
            Some(m) => b.extend_from_slice(m),
            None => b.resize(b.len() + t, 1),
        })?;
        let scales = &mut self.scales;
        scales.clear();
        for layer in 0..l {
            let src = states.layer(layer);
            let dtype = self.dtype;
            shard.put(&mut hasher, |b| match dtype {
                DType::F32 => b.extend_from_slice(bytemuck::cast_slice(src)),
                DType::F8E4M3 => {
                    b.reserve(src.len());
                    scales.extend(src.chunks_exact(h.max(1)).map(|row| fp8::quantize_row(row, b)));
                }
                _ => dtype.encode_into(src, b),
            })?;
        }
        if self.dtype.scaled() {
            shard.put(&mut hasher, |b| b.extend_from_slice(bytemuck::cast_slice(scales)))?;
        }
        let mut names = names.into_iter();
        let mut next = || names.next().expect("named above");
        shard.add(next(), "I64", vec![t], (t * 8) as u64);
        shard.add(next(), "U8", vec![t], t as u64);
        let st_dtype = match self.dtype {
            DType::F32 => "F32",
            DType::BF16 => "BF16",
            DType::F16 => "F16",
            DType::F8E4M3 => "F8_E4M3",
        };
        shard.add(next(), st_dtype, vec![l, t, h], hs_bytes);
        if self.dtype.scaled() {
            shard.add(next(), "F32", vec![l, t, 1], scale_bytes);
        }
        shard.samples.push(SampleInfo {
            id: sample.id.clone(),
            shard: shard.index,
            tokens: t,
            checksum: hash_hex(hasher.digest()),
            index: Some(sample.index),
            finish: sample.finish.clone(),
        });
        shard.end = sample.end.clone();
        Ok(())
    }

    fn skip_sample(&mut self, sample: &Sample, reason: String) -> Result<(), SinkError> {
        self.out.skip_sample(sample, reason)
    }

    fn finish(&mut self, input: InputPos) -> Result<(), SinkError> {
        self.close_shard()?;
        self.out.get()?.finish(InputInfo { path: self.input_path.clone(), whole: input })
    }

    fn resume_from(&self) -> usize {
        self.resumed
    }

    fn bytes_written(&self) -> u64 {
        self.bytes_written
    }
}
