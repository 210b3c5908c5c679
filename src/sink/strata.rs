//! The native format: samples packed into `shard-NNNNN.safetensors` files of
//! about `shard_size` bytes, indexed by `manifest.json` (docs/FORMAT.md).
//!
//! A shard is streamed to a temp file whose header region is reserved up
//! front (safetensors allows a space-padded header), so its data never sits
//! in memory; on close the header is filled in, the file fsynced and renamed,
//! and only then does the manifest (rewritten atomically) list its samples.

use super::{io_err, prepare_dir, remove_temps, sync_dir, temp_path, write_atomic, OpenMode, Sink, SinkError};
use crate::dataset::manifest::{hash_hex, Manifest, SampleInfo, ShardInfo, MANIFEST};
use crate::pipeline::source::Sample;
use crate::shape::{check_dim, DType, Dim, StatesView};
use std::collections::BTreeMap;
use std::io::{Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
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
    format!(
        "{}:{{\"dtype\":\"{}\",\"shape\":{:?},\"data_offsets\":[{},{}]}}",
        serde_json::Value::String(name.to_string()),
        e.dtype,
        e.shape,
        e.start,
        e.end
    )
    .replace(", ", ",")
}

const SHARD_METADATA: &str = "\"__metadata__\":{\"format\":\"strata\",\"schema_version\":\"1\"}";

struct ShardWriter {
    index: usize,
    path: PathBuf,
    tmp: PathBuf,
    file: std::io::BufWriter<std::fs::File>,
    reserve: usize,
    header_len: usize,
    data_len: u64,
    entries: BTreeMap<String, Entry>,
    samples: Vec<SampleInfo>,
}

impl ShardWriter {
    fn create(dir: &Path, index: usize, reserve: usize) -> Result<Self, SinkError> {
        let path = dir.join(StrataSink::<usize, usize>::shard_name(index));
        let tmp = temp_path(&path);
        // Read back when the shard is compacted on close.
        let f = std::fs::OpenOptions::new().read(true).write(true).create(true).truncate(true).open(&tmp);
        let mut file = std::io::BufWriter::with_capacity(4 << 20, f.map_err(io_err(&tmp))?);
        // Header region, filled in on close.
        file.write_all(&vec![b' '; 8 + reserve]).map_err(io_err(&tmp))?;
        Ok(ShardWriter {
            index,
            path,
            tmp,
            file,
            reserve,
            header_len: 2 + SHARD_METADATA.len(),
            data_len: 0,
            entries: BTreeMap::new(),
            samples: Vec::new(),
        })
    }

    fn add(&mut self, name: String, dtype: &'static str, shape: Vec<usize>, bytes: u64) {
        let e = Entry { dtype, shape, start: self.data_len, end: self.data_len + bytes };
        self.header_len += entry_json(&name, &e).len() + 1;
        self.data_len += bytes;
        self.entries.insert(name, e);
    }

    fn write(&mut self, bytes: &[u8], hasher: &mut Xxh3) -> Result<(), SinkError> {
        hasher.update(bytes);
        self.file.write_all(bytes).map_err(io_err(&self.tmp))
    }

    /// Fills in the header, fsyncs and renames. When the unused part of the
    /// reserved header region would be more than 1/16 of the data (small
    /// shards), the data is copied behind a tight header instead.
    fn close(self) -> Result<(ShardInfo, Vec<SampleInfo>), SinkError> {
        let mut header = String::with_capacity(self.reserve);
        header.push('{');
        header.push_str(SHARD_METADATA);
        for (name, e) in &self.entries {
            header.push(',');
            header.push_str(&entry_json(name, e));
        }
        header.push('}');
        debug_assert!(header.len() <= self.reserve, "header outgrew its reserve");
        let mut header = header.into_bytes();
        let tight = header.len().next_multiple_of(8);
        let compact = (self.reserve - tight) as u64 > self.data_len / 16;
        header.resize(if compact { tight } else { self.reserve }, b' ');
        let tmp = self.tmp.clone();
        let mut f = self.file.into_inner().map_err(|e| SinkError::Io {
            path: tmp.display().to_string(),
            cause: std::io::Error::other(e.to_string()),
        })?;
        let reserve = self.reserve as u64;
        let path = self.path.clone();
        (|| -> std::io::Result<()> {
            if compact {
                let tight_tmp = temp_path(&path.with_extension("compact"));
                let mut out = std::io::BufWriter::new(std::fs::File::create(&tight_tmp)?);
                out.write_all(&(header.len() as u64).to_le_bytes())?;
                out.write_all(&header)?;
                f.seek(SeekFrom::Start(8 + reserve))?;
                std::io::copy(&mut f, &mut out)?;
                let out = out.into_inner().map_err(|e| std::io::Error::other(e.to_string()))?;
                out.sync_all()?;
                drop(f);
                std::fs::remove_file(&tmp)?;
                std::fs::rename(&tight_tmp, &path)
            } else {
                f.seek(SeekFrom::Start(0))?;
                f.write_all(&reserve.to_le_bytes())?;
                f.write_all(&header)?;
                f.sync_all()?;
                std::fs::rename(&tmp, &path)
            }
        })()
        .map_err(io_err(&tmp))?;
        let bytes = 8 + header.len() as u64 + self.data_len;
        let file = self.path.file_name().unwrap().to_string_lossy().to_string();
        Ok((ShardInfo { file, samples: self.samples.len(), bytes }, self.samples))
    }
}

/// Writes the native sharded format with a manifest.
pub struct StrataSink<L: Dim, H: Dim> {
    dir: PathBuf,
    layers: L,
    hidden: H,
    dtype: DType,
    manifest: Manifest,
    shard: Option<ShardWriter>,
    reserve: usize,
    buf: Vec<u8>,
    resumed: usize,
    bytes_written: u64,
}

fn ours(name: &str) -> bool {
    (name.starts_with("shard-") && name.ends_with(".safetensors"))
        || name == MANIFEST
        || (name.starts_with('.') && name.ends_with(".tmp"))
}

impl<L: Dim, H: Dim> StrataSink<L, H> {
    /// The file name of shard `i`.
    pub fn shard_name(i: usize) -> String {
        format!("shard-{i:05}.safetensors")
    }

    /// Opens `dir` for a run described by `manifest` (its `shards` and
    /// `samples` empty). With [`OpenMode::Resume`] an existing manifest must
    /// describe the same job; its finished shards are kept and their samples skipped.
    pub fn open(dir: &Path, manifest: Manifest, layers: L, hidden: H, mode: OpenMode) -> Result<Self, SinkError> {
        check_dim("manifest capture list", "layers", layers, manifest.capture.len())?;
        check_dim("manifest hidden_size", "hidden", hidden, manifest.model.hidden_size)?;
        let dtype: DType = manifest.dtype.parse().map_err(SinkError::Directory)?;
        prepare_dir(dir, mode, ours)?;
        let mut manifest = manifest;
        if mode == OpenMode::Resume && dir.join(MANIFEST).exists() {
            let old = Manifest::read(dir).map_err(SinkError::Directory)?;
            old.same_job(&manifest).map_err(|e| {
                SinkError::Directory(format!("cannot resume in {}: {e}; use --overwrite to start over", dir.display()))
            })?;
            // Shards renamed after the last manifest update are unlisted: they
            // are written again, identically, under the same names.
            for e in std::fs::read_dir(dir).map_err(io_err(dir))? {
                let name = e.map_err(io_err(dir))?.file_name().to_string_lossy().to_string();
                if name.starts_with("shard-") && !old.shards.iter().any(|s| s.file == name) {
                    std::fs::remove_file(dir.join(&name)).map_err(io_err(&dir.join(&name)))?;
                }
            }
            manifest = Manifest { complete: false, ..old };
        }
        remove_temps(dir)?;
        // Room for ~3 header entries per sample; at least 4 KiB, at most 1 MiB.
        let reserve = ((manifest.shard_size / 256) as usize).clamp(4096, 1 << 20).next_multiple_of(8);
        let resumed = manifest.samples.len();
        let sink = StrataSink {
            dir: dir.to_path_buf(),
            layers,
            hidden,
            dtype,
            manifest,
            shard: None,
            reserve,
            buf: Vec::new(),
            resumed,
            bytes_written: 0,
        };
        sink.write_manifest()?;
        Ok(sink)
    }

    /// The manifest as written so far.
    pub fn manifest(&self) -> &Manifest {
        &self.manifest
    }

    fn write_manifest(&self) -> Result<(), SinkError> {
        let text = serde_json::to_string_pretty(&self.manifest).expect("manifest serialises");
        write_atomic(&self.dir.join(MANIFEST), |f| f.write_all(text.as_bytes()))?;
        sync_dir(&self.dir);
        Ok(())
    }

    fn close_shard(&mut self) -> Result<(), SinkError> {
        if let Some(shard) = self.shard.take() {
            let (info, samples) = shard.close()?;
            sync_dir(&self.dir);
            self.bytes_written += info.bytes;
            self.manifest.shards.push(info);
            self.manifest.samples.extend(samples);
            self.write_manifest()?;
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
        let names = [
            format!("{}.input_ids", sample.id),
            format!("{}.loss_mask", sample.id),
            format!("{}.hidden_states", sample.id),
        ];
        // Bound on one entry: quoted name plus at most 150 bytes of dtype, shape and offsets.
        let header_growth: usize = names.iter().map(|n| n.len() + 2 + 150).sum();
        if let Some(s) = &self.shard {
            if s.data_len + sample_bytes > self.manifest.shard_size || s.header_len + header_growth > self.reserve {
                self.close_shard()?;
            }
        }
        if self.shard.is_none() {
            let index = self.manifest.shards.len();
            self.shard = Some(ShardWriter::create(&self.dir, index, self.reserve)?);
        }
        let shard = self.shard.as_mut().expect("opened above");
        let mut hasher = Xxh3::new();

        self.buf.clear();
        self.buf.extend(sample.input_ids.iter().flat_map(|&v| (v as i64).to_le_bytes()));
        shard.write(&self.buf, &mut hasher)?;
        self.buf.clear();
        match &sample.loss_mask {
            Some(m) => self.buf.extend_from_slice(m),
            None => self.buf.resize(t, 1),
        }
        shard.write(&self.buf, &mut hasher)?;
        for layer in 0..l {
            let src = states.layer(layer);
            if self.dtype == DType::F32 {
                shard.write(bytemuck::cast_slice(src), &mut hasher)?;
            } else {
                self.buf.clear();
                self.dtype.encode_into(src, &mut self.buf);
                shard.write(&self.buf, &mut hasher)?;
            }
        }
        let [ids_name, mask_name, hs_name] = names;
        shard.add(ids_name, "I64", vec![t], (t * 8) as u64);
        shard.add(mask_name, "U8", vec![t], t as u64);
        let st_dtype = match self.dtype {
            DType::F32 => "F32",
            DType::BF16 => "BF16",
            DType::F16 => "F16",
        };
        shard.add(hs_name, st_dtype, vec![l, t, h], hs_bytes);
        shard.samples.push(SampleInfo {
            id: sample.id.clone(),
            shard: shard.index,
            tokens: t,
            checksum: hash_hex(hasher.digest()),
        });
        Ok(())
    }

    fn finish(&mut self) -> Result<(), SinkError> {
        self.close_shard()?;
        self.manifest.complete = true;
        self.write_manifest()
    }

    fn resume_from(&self) -> usize {
        self.resumed
    }

    fn bytes_written(&self) -> u64 {
        self.bytes_written
    }
}
