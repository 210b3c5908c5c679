//! Writers of captured states, into an output directory ([`output`]) that
//! keeps them sound under crashes, full disks and concurrent runs: every
//! file is written under a temporary name, fsynced, journaled and renamed,
//! so a final name never holds a partial file.

pub mod draft_vocab;
mod finite;
pub mod hf_dataset;
pub mod merge;
pub mod output;
mod speculators;
mod spool;
mod strata;

pub use finite::{nonfinite, FiniteCheck, OnNonFinite};
pub use output::OutputDir;
pub use speculators::{SpeculatorsEncoder, SpeculatorsSink};
pub use strata::{StrataSink, DEFAULT_SHARD_SIZE};

use crate::pipeline::source::{InputPos, Sample};
use crate::shape::{Dim, ShapeError, StatesView};
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
    /// A file of the output that cannot be read back (a merge's part file).
    #[error(transparent)]
    Unreadable(#[from] crate::format::DatasetError),
    /// Captured states with NaN or Inf (`--on-nonfinite fail`, the default).
    #[error(
        "sample {id} (line {line}): capture point {point} holds {nan} NaN and {inf} Inf values; \
         the output stays resumable. Pass --on-nonfinite skip to leave such samples out and record them"
    )]
    NonFinite {
        /// The sample's id (clipped).
        id: String,
        /// Its input line.
        line: usize,
        /// The capture point.
        point: String,
        /// NaN count.
        nan: usize,
        /// Inf count.
        inf: usize,
    },
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
    /// Records a sample left out (its states are not written); `reason` says why.
    fn skip_sample(&mut self, sample: &Sample, reason: String) -> Result<(), SinkError>;
    /// Makes everything written durable and marks the output complete;
    /// `input` is the whole input consumed.
    fn finish(&mut self, input: InputPos) -> Result<(), SinkError>;
    /// Samples already durable from an earlier run (the source skips them).
    fn resume_from(&self) -> usize {
        0
    }
    /// Bytes written by this run.
    fn bytes_written(&self) -> u64;
}
