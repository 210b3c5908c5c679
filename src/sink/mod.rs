//! Writers of captured states. Every file is written under a temporary name,
//! fsynced and renamed, so a final name never holds a partial file.

mod speculators;
mod strata;

pub use speculators::SpeculatorsSink;
pub use strata::{StrataSink, DEFAULT_SHARD_SIZE};

use crate::pipeline::source::Sample;
use crate::shape::{Dim, ShapeError, StatesView};
use std::io::Write;
use std::path::Path;

/// Why output cannot be written.
#[derive(Debug, thiserror::Error)]
pub enum SinkError {
    /// A file operation failed.
    #[error("cannot write {path}: {cause}")]
    Io {
        /// The file.
        path: String,
        /// The OS error.
        cause: std::io::Error,
    },
    /// States that do not fit the output's declared layout.
    #[error(transparent)]
    Shape(#[from] ShapeError),
    /// The output directory holds something else than this run would write.
    #[error("{0}")]
    Directory(String),
}

/// Shorthand for an I/O error on a path.
pub(crate) fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> SinkError + '_ {
    move |cause| SinkError::Io { path: path.display().to_string(), cause }
}

/// How to treat an output directory that already has content.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OpenMode {
    /// The directory must be empty or absent.
    Create,
    /// Delete what an earlier run of this format left, then start afresh.
    Overwrite,
    /// Continue an interrupted run: keep finished files, skip their samples.
    Resume,
}

/// A destination for per-sample captured states, fed in input order.
#[diagnostic::on_unimplemented(
    message = "`{Self}` does not take the pipeline's states `[{L}, T, {H}]`",
    label = "this writer's layers or hidden dim differs from the capture set's or the model's",
    note = "a statically typed job must write exactly the layout its model and capture points produce"
)]
pub trait Sink<L: Dim, H: Dim> {
    /// Writes one sample's tokens, loss mask and `[L, T, H]` states.
    fn write_sample(&mut self, sample: &Sample, states: StatesView<'_, L, H>) -> Result<(), SinkError>;
    /// Makes everything written durable and marks the output complete.
    fn finish(&mut self) -> Result<(), SinkError>;
    /// Samples already durable from an earlier run (the source skips them).
    fn resume_from(&self) -> usize {
        0
    }
    /// Bytes written by this run.
    fn bytes_written(&self) -> u64;
}

/// Writes a file atomically: temp file in the same directory, fsync, rename.
pub fn write_atomic(
    path: &Path,
    write: impl FnOnce(&mut std::fs::File) -> std::io::Result<()>,
) -> Result<(), SinkError> {
    let tmp = temp_path(path);
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
    result.map_err(io_err(path))
}

/// The temporary name a file is written under: `.NAME.tmp` beside it.
pub fn temp_path(path: &Path) -> std::path::PathBuf {
    path.with_file_name(format!(".{}.tmp", path.file_name().and_then(|n| n.to_str()).unwrap_or("out")))
}

/// fsyncs a directory so renames in it are durable (a no-op where the filesystem refuses).
pub(crate) fn sync_dir(dir: &Path) {
    if let Err(e) = std::fs::File::open(dir).and_then(|d| d.sync_all()) {
        tracing::debug!("fsync of directory {}: {e}", dir.display());
    }
}

/// Prepares an output directory: creates it, and checks or clears earlier content.
/// `ours` says which entries this format writes (they may be deleted by `Overwrite`).
pub(crate) fn prepare_dir(dir: &Path, mode: OpenMode, ours: impl Fn(&str) -> bool) -> Result<(), SinkError> {
    std::fs::create_dir_all(dir).map_err(io_err(dir))?;
    let mut names = Vec::new();
    for e in std::fs::read_dir(dir).map_err(io_err(dir))? {
        names.push(e.map_err(io_err(dir))?.file_name().to_string_lossy().to_string());
    }
    match mode {
        OpenMode::Create if !names.is_empty() => Err(SinkError::Directory(format!(
            "output directory {} is not empty; pass --resume to continue an interrupted run \
             or --overwrite to replace it",
            dir.display()
        ))),
        OpenMode::Overwrite => {
            for n in names.iter().filter(|n| ours(n)) {
                let p = dir.join(n);
                std::fs::remove_file(&p).map_err(io_err(&p))?;
            }
            Ok(())
        }
        _ => Ok(()),
    }
}

/// Removes leftover temp files (`.*.tmp`) of an interrupted run.
pub(crate) fn remove_temps(dir: &Path) -> Result<(), SinkError> {
    for e in std::fs::read_dir(dir).map_err(io_err(dir))? {
        let e = e.map_err(io_err(dir))?;
        let name = e.file_name().to_string_lossy().to_string();
        if name.starts_with('.') && name.ends_with(".tmp") {
            std::fs::remove_file(e.path()).map_err(io_err(&e.path()))?;
        }
    }
    Ok(())
}
