//! Writers of captured states. Every file is written under a temporary name,
//! fsynced and renamed, so a final name never holds a partial file.

use crate::shape::{DType, Dim, StatesView};
use std::io::Write;
use std::path::{Path, PathBuf};

/// Why output cannot be written.
#[derive(Debug, thiserror::Error)]
#[error("cannot write {path}: {source}")]
pub struct SinkError {
    /// The file.
    pub path: String,
    /// The OS error.
    pub source: std::io::Error,
}

/// A destination for per-sample captured states.
pub trait Sink<L: Dim, H: Dim> {
    /// Writes one sample's token ids and `[L, T, H]` states.
    fn write_sample(&mut self, index: usize, token_ids: &[u32], states: StatesView<'_, L, H>) -> Result<(), SinkError>;
    /// Makes everything written durable.
    fn finish(&mut self) -> Result<(), SinkError>;
}

/// The speculators per-sample format: `hs_{i}.safetensors` holding
/// `token_ids` (I64 `[T]`) and `hidden_states` (`[T, L, H]`).
pub struct SpeculatorsSink {
    dir: PathBuf,
    dtype: DType,
    buf: Vec<u8>,
    ids: Vec<u8>,
    /// Bytes written so far.
    pub bytes_written: u64,
}

impl SpeculatorsSink {
    /// Writes into `dir` (which must exist), storing states as `dtype`.
    pub fn new(dir: &Path, dtype: DType) -> Self {
        SpeculatorsSink { dir: dir.to_path_buf(), dtype, buf: Vec::new(), ids: Vec::new(), bytes_written: 0 }
    }

    /// The final file name of sample `i`.
    pub fn file_name(i: usize) -> String {
        format!("hs_{i}.safetensors")
    }
}

/// Writes `bytes` to `path` atomically: temp file in the same directory, fsync, rename.
pub fn write_atomic(
    path: &Path,
    write: impl FnOnce(&mut std::fs::File) -> std::io::Result<()>,
) -> Result<(), SinkError> {
    let err = |source| SinkError { path: path.display().to_string(), source };
    let tmp = path.with_file_name(format!(".{}.tmp", path.file_name().and_then(|n| n.to_str()).unwrap_or("out")));
    let result = (|| {
        let mut f = std::fs::File::create(&tmp)?;
        write(&mut f)?;
        f.flush()?;
        f.sync_all()?;
        std::fs::rename(&tmp, path)
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result.map_err(err)
}

impl<L: Dim, H: Dim> Sink<L, H> for SpeculatorsSink {
    fn write_sample(&mut self, index: usize, token_ids: &[u32], states: StatesView<'_, L, H>) -> Result<(), SinkError> {
        let _span = tracing::debug_span!("write", index).entered();
        let [l, t, h] = states.shape();
        debug_assert_eq!(t, token_ids.len());
        self.buf.clear();
        states.encode_tlh(self.dtype, &mut self.buf);
        self.ids.clear();
        self.ids.extend(token_ids.iter().flat_map(|&v| (v as i64).to_le_bytes()));
        let path = self.dir.join(Self::file_name(index));
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
        // fsync the directory so the renames themselves are durable.
        let d = std::fs::File::open(&self.dir)
            .and_then(|d| d.sync_all())
            .map_err(|source| SinkError { path: self.dir.display().to_string(), source });
        // Some filesystems refuse fsync on a directory; the files are synced already.
        if let Err(e) = &d {
            tracing::debug!("directory fsync: {e}");
        }
        Ok(())
    }
}
