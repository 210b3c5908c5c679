//! The speculators per-sample format: `hs_{i}.safetensors` holding
//! `token_ids` (I64 `[T]`) and `hidden_states` (`[T, L, H]`), where `i` is
//! the sample's row in the input (a skipped sample leaves its number unused),
//! plus the same `manifest.json` as the native format, which lists each file
//! as a one-sample shard so that resume and verify work alike.

use super::output::Output;
use super::{io_err, OpenMode, Sink, SinkError};
use crate::dataset::manifest::{hash_hex, InputInfo, Manifest, SampleInfo, ShardInfo};
use crate::pipeline::source::{InputPos, Sample};
use crate::shape::{DType, Dim, StatesView};
use std::io::Write;
use std::path::Path;

/// Writes one file per sample, named by the sample's index.
pub struct SpeculatorsSink {
    out: Output,
    dtype: DType,
    input_path: String,
    // The sample's hidden states `[T, L, H]` and token ids, encoded.
    buf: Vec<u8>,
    ids: Vec<u8>,
    done: usize,
    bytes_written: u64,
}

impl SpeculatorsSink {
    /// Opens `dir` for the run `manifest` describes (its dtype is the stored one).
    pub fn open(dir: &Path, manifest: Manifest, mode: OpenMode) -> Result<Self, SinkError> {
        let dtype: DType = manifest.dtype.parse().map_err(SinkError::Directory)?;
        let input_path = manifest.input.as_ref().map_or_else(String::new, |i| i.path.clone());
        let job = Manifest { format: "speculators".into(), layout: "TLH".into(), shard_size: 0, ..manifest };
        let out = Output::new(dir, mode, job)?;
        let done = out.manifest().consumed();
        Ok(SpeculatorsSink { out, dtype, input_path, buf: Vec::new(), ids: Vec::new(), done, bytes_written: 0 })
    }

    /// The file name of sample `i`.
    pub fn file_name(i: usize) -> String {
        format!("hs_{i}.safetensors")
    }

    /// The manifest as written so far.
    pub fn manifest(&self) -> &Manifest {
        self.out.manifest()
    }
}

impl<L: Dim, H: Dim> Sink<L, H> for SpeculatorsSink {
    fn write_sample(&mut self, sample: &Sample, states: StatesView<'_, L, H>) -> Result<(), SinkError> {
        let _span = tracing::debug_span!("write", index = sample.index).entered();
        let [l, t, h] = states.shape();
        self.buf.clear();
        states.encode_tlh(self.dtype, &mut self.buf);
        self.ids.clear();
        self.ids.extend(sample.input_ids.iter().flat_map(|&v| (v as i64).to_le_bytes()));
        let name = Self::file_name(sample.index);
        let (n_ids, n_hs) = (self.ids.len(), self.buf.len());
        let header = serde_json::json!({
            "token_ids": {"dtype": "I64", "shape": [t], "data_offsets": [0, n_ids]},
            "hidden_states": {"dtype": self.dtype.to_safetensors().to_string(), "shape": [t, l, h],
                              "data_offsets": [n_ids, n_ids + n_hs]},
        });
        let mut header = header.to_string().into_bytes();
        // The safetensors header is padded with spaces so the data starts 8-byte aligned.
        header.resize(header.len().next_multiple_of(8), b' ');
        let out = self.out.get()?;
        let (tmp, f) = out.create_temp(&name)?;
        let r = (|| {
            let mut w = std::io::BufWriter::with_capacity(1 << 20, f);
            w.write_all(&(header.len() as u64).to_le_bytes())?;
            w.write_all(&header)?;
            w.write_all(&self.ids)?;
            w.write_all(&self.buf)?;
            w.into_inner().map_err(|e| std::io::Error::other(e.to_string()))?.sync_all()
        })();
        if let Err(e) = r {
            let _ = std::fs::remove_file(&tmp);
            return Err(io_err(&tmp)(e));
        }
        let bytes = (8 + header.len() + n_ids + n_hs) as u64;
        let mut hasher = xxhash_rust::xxh3::Xxh3::new();
        hasher.update(&self.ids);
        hasher.update(&self.buf);
        let index = out.manifest().shards.len();
        let info = SampleInfo {
            id: sample.id.clone(),
            shard: index,
            tokens: t,
            checksum: hash_hex(hasher.digest()),
            index: Some(sample.index),
        };
        let shard = ShardInfo { file: name, samples: 1, bytes, input: None };
        out.commit(&tmp, shard, vec![info], sample.end.clone())?;
        self.bytes_written += bytes;
        Ok(())
    }

    fn skip_sample(&mut self, sample: &Sample, reason: String) -> Result<(), SinkError> {
        self.out.skip_sample(sample, reason)
    }

    fn finish(&mut self, input: InputPos) -> Result<(), SinkError> {
        self.out.get()?.finish(InputInfo { path: self.input_path.clone(), whole: input })
    }

    fn resume_from(&self) -> usize {
        self.done
    }

    fn bytes_written(&self) -> u64 {
        self.bytes_written
    }
}
