//! The speculators per-sample format: `hs_{i}.safetensors` holding
//! `token_ids` (I64 `[T]`) and `hidden_states` (`[T, L, H]`).

use super::{io_err, prepare_dir, remove_temps, sync_dir, write_atomic, OpenMode, Sink, SinkError};
use crate::pipeline::source::Sample;
use crate::shape::{DType, Dim, StatesView};
use std::io::Write;
use std::path::{Path, PathBuf};

/// Writes one file per sample, named by the sample's index.
pub struct SpeculatorsSink {
    dir: PathBuf,
    dtype: DType,
    buf: Vec<u8>,
    ids: Vec<u8>,
    done: usize,
    bytes_written: u64,
}

fn ours(name: &str) -> bool {
    (name.starts_with("hs_") && name.ends_with(".safetensors")) || (name.starts_with(".hs_") && name.ends_with(".tmp"))
}

impl SpeculatorsSink {
    /// Opens `dir` for writing states as `dtype`.
    pub fn open(dir: &Path, dtype: DType, mode: OpenMode) -> Result<Self, SinkError> {
        prepare_dir(dir, mode, ours)?;
        remove_temps(dir)?;
        // Samples finish in input order and each file appears atomically, so
        // the finished ones are the prefix hs_0, hs_1, ... that exists.
        let done = if mode == OpenMode::Resume {
            (0..).take_while(|i| dir.join(Self::file_name(*i)).exists()).count()
        } else {
            0
        };
        Ok(SpeculatorsSink { dir: dir.to_path_buf(), dtype, buf: Vec::new(), ids: Vec::new(), done, bytes_written: 0 })
    }

    /// The file name of sample `i`.
    pub fn file_name(i: usize) -> String {
        format!("hs_{i}.safetensors")
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
        let path = self.dir.join(Self::file_name(sample.index));
        let (n_ids, n_hs) = (self.ids.len(), self.buf.len());
        let header = serde_json::json!({
            "token_ids": {"dtype": "I64", "shape": [t], "data_offsets": [0, n_ids]},
            "hidden_states": {"dtype": self.dtype.to_safetensors().to_string(), "shape": [t, l, h],
                              "data_offsets": [n_ids, n_ids + n_hs]},
        });
        let mut header = header.to_string().into_bytes();
        // The safetensors header is padded with spaces so the data starts 8-byte aligned.
        header.resize(header.len().next_multiple_of(8), b' ');
        write_atomic(&path, |f| {
            let mut w = std::io::BufWriter::with_capacity(1 << 20, f);
            w.write_all(&(header.len() as u64).to_le_bytes())?;
            w.write_all(&header)?;
            w.write_all(&self.ids)?;
            w.write_all(&self.buf)?;
            w.flush()
        })?;
        self.bytes_written += (8 + header.len() + n_ids + n_hs) as u64;
        Ok(())
    }

    fn finish(&mut self) -> Result<(), SinkError> {
        sync_dir(&self.dir);
        std::fs::metadata(&self.dir).map(|_| ()).map_err(io_err(&self.dir))
    }

    fn resume_from(&self) -> usize {
        self.done
    }

    fn bytes_written(&self) -> u64 {
        self.bytes_written
    }
}
