//! The generic pipeline builder: `Source → Schedule → Model → Capture → Gather → Sink`.
//!
//! ```text
//! Pipeline::new(source).max_batch_tokens(8192).model(&model).capture(points).sink(writer).run()?
//! ```
//!
//! Each call fixes one type: `model` the hidden dim `H`, `capture` the layers
//! dim `L`, and `sink` accepts only a `Sink<L, H>`, so in a statically typed
//! job a writer for another hidden size or capture count does not compile.
//! With `usize` dims the same checks run once, at the sink's boundary.

use crate::model::{Model, ModelError, PendingStates};
use crate::pipeline::capture::CaptureSet;
use crate::pipeline::gather::Gatherer;
use crate::pipeline::schedule::{Scheduler, Step};
use crate::pipeline::source::{Source, SourceError};
use crate::shape::{Dim, ShapeError};
use crate::sink::{Sink, SinkError};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc;
use std::time::{Duration, Instant};
use tracing::info_span;

/// Why a pipeline run stopped.
#[derive(Debug, thiserror::Error)]
pub enum PipelineError {
    /// Reading input.
    #[error(transparent)]
    Source(#[from] SourceError),
    /// Running the model.
    #[error(transparent)]
    Model(#[from] ModelError),
    /// Writing output.
    #[error(transparent)]
    Sink(#[from] SinkError),
}

impl From<ShapeError> for PipelineError {
    fn from(e: ShapeError) -> Self {
        PipelineError::Model(ModelError::Shape(e))
    }
}

/// Progress after each step.
#[derive(Clone, Debug, Default)]
pub struct Progress {
    /// Samples written by this run.
    pub samples: usize,
    /// Tokens run by this run.
    pub tokens: usize,
    /// Samples skipped because an earlier run wrote them.
    pub resumed: usize,
    /// Time since the run started.
    pub elapsed: Duration,
}

/// What a run did, with time per stage.
#[derive(Clone, Debug, Default)]
pub struct Report {
    /// Final progress.
    pub progress: Progress,
    /// Forward steps.
    pub steps: usize,
    /// Bytes written.
    pub bytes: u64,
    /// Reading and scheduling input.
    pub schedule_time: Duration,
    /// The model's forward.
    pub forward_time: Duration,
    /// Reassembling chunked samples.
    pub gather_time: Duration,
    /// Writing (including fsync).
    pub write_time: Duration,
}

/// A pipeline being assembled; see the module docs.
pub struct Pipeline<S> {
    source: S,
    budget: usize,
}

/// A pipeline with its model.
pub struct WithModel<'m, S, M> {
    source: S,
    budget: usize,
    model: &'m M,
}

/// A pipeline with its model and capture points.
pub struct WithCapture<'m, S, M, L: Dim> {
    source: S,
    budget: usize,
    model: &'m M,
    captures: CaptureSet<L>,
}

/// A progress callback.
type ProgressFn<'p> = Box<dyn FnMut(&Progress) + 'p>;

/// A pipeline ready to run.
pub struct Ready<'m, 'p, S, M, L: Dim, K> {
    source: S,
    budget: usize,
    model: &'m M,
    captures: CaptureSet<L>,
    sink: K,
    progress: Option<ProgressFn<'p>>,
}

impl<S: Source> Pipeline<S> {
    /// Starts from a source of samples, in order.
    pub fn new(source: S) -> Self {
        Pipeline { source, budget: 8192 }
    }
    /// Token budget of one forward step (default 8192); longer samples are chunked.
    pub fn max_batch_tokens(mut self, n: usize) -> Self {
        self.budget = n.max(1);
        self
    }
    /// The model; fixes the hidden dim `H`.
    pub fn model<M: Model>(self, model: &M) -> WithModel<'_, S, M> {
        WithModel { source: self.source, budget: self.budget, model }
    }
}

impl<'m, S, M: Model> WithModel<'m, S, M> {
    /// The capture points; fixes the layers dim `L`.
    pub fn capture<L: Dim>(self, captures: CaptureSet<L>) -> WithCapture<'m, S, M, L> {
        WithCapture { source: self.source, budget: self.budget, model: self.model, captures }
    }
}

impl<'m, S, M: Model, L: Dim> WithCapture<'m, S, M, L> {
    /// The writer: must accept `[L, T, H]` states of this capture set and model.
    pub fn sink<'p, K: Sink<L, M::Hidden>>(self, sink: K) -> Ready<'m, 'p, S, M, L, K> {
        Ready {
            source: self.source,
            budget: self.budget,
            model: self.model,
            captures: self.captures,
            sink,
            progress: None,
        }
    }
}

impl<'p, S, M, L, K> Ready<'_, 'p, S, M, L, K>
where
    S: Source,
    M: Model,
    L: Dim,
    K: Sink<L, M::Hidden>,
{
    /// Calls `f` after every step.
    pub fn on_progress(mut self, f: impl FnMut(&Progress) + 'p) -> Self {
        self.progress = Some(Box::new(f));
        self
    }

    /// Runs to the end of the source, then finishes the sink. Samples an
    /// earlier run already wrote (the sink's `resume_from`) are read and
    /// skipped; an input that ends before them is an error.
    ///
    /// Gathering and writing run on their own thread, one step behind the
    /// model: step `k` is written while step `k + 1` runs, so a fast device
    /// does not wait for the disk. The hand-over is a rendezvous, so at most
    /// two steps' states are alive (the one being written and the one being
    /// computed). Samples reach the sink in input order, as before; when a
    /// step fails, every step before it has been written.
    pub fn run(self) -> Result<(Report, K), PipelineError>
    where
        K: Send,
    {
        let _span = info_span!("pipeline").entered();
        let Ready { mut source, budget, model, captures, mut sink, mut progress } = self;
        captures.taps(model.num_layers()).map_err(ModelError::from)?;
        let start = Instant::now();
        let mut report = Report::default();
        let resumed = sink.resume_from();
        report.progress.resumed = resumed;
        for done in 0..resumed {
            match source.next() {
                Some(Ok(_)) => {}
                Some(Err(e)) => return Err(e.into()),
                None => return Err(SourceError::Ended { samples: done, expected: resumed }.into()),
            }
        }
        let written = AtomicUsize::new(0);
        let parent = tracing::Span::current();
        // The model's states reach the writer pending: it completes the
        // device's copies into host memory while the next step runs.
        let (tx, rx) = mpsc::sync_channel::<(Step, PendingStates<L, M::Hidden>)>(0);
        let (ran, wrote) = std::thread::scope(|scope| {
            let sink = &mut sink;
            let written = &written;
            let writer = scope.spawn(move || -> Result<(Duration, Duration), PipelineError> {
                let mut gatherer = Gatherer::default();
                let (mut gather_time, mut write_time) = (Duration::ZERO, Duration::ZERO);
                for (step, pending) in rx {
                    let t = Instant::now();
                    let mut write = Duration::ZERO;
                    let _s = info_span!(parent: &parent, "gather").entered();
                    let states = pending.wait()?;
                    gatherer.gather(&step, &states, |sample, view| -> Result<(), PipelineError> {
                        let w = Instant::now();
                        let _s = info_span!("write", sample = sample.index).entered();
                        sink.write_sample(sample, view)?;
                        write += w.elapsed();
                        written.fetch_add(1, Ordering::Relaxed);
                        Ok(())
                    })?;
                    gather_time += t.elapsed() - write;
                    write_time += write;
                }
                Ok((gather_time, write_time))
            });
            let ran = (|| -> Result<(), PipelineError> {
                let mut scheduler = Scheduler::new(budget);
                let mut cache = M::Cache::default();
                loop {
                    let t = Instant::now();
                    let step = {
                        let _s = info_span!("schedule").entered();
                        scheduler.next_step(&mut source)?
                    };
                    report.schedule_time += t.elapsed();
                    let Some(step) = step else { return Ok(()) };

                    let t = Instant::now();
                    let states = model.forward_step_pending(&step.batch, &captures, &mut cache)?;
                    report.forward_time += t.elapsed();

                    report.steps += 1;
                    report.progress.tokens += step.batch.num_tokens();
                    if tx.send((step, states)).is_err() {
                        // The writer stopped on an error, which `wrote` holds.
                        return Ok(());
                    }
                    report.progress.samples = written.load(Ordering::Relaxed);
                    report.progress.elapsed = start.elapsed();
                    if let Some(f) = progress.as_mut() {
                        f(&report.progress);
                    }
                }
            })();
            drop(tx);
            let wrote = writer.join().unwrap_or_else(|panic| std::panic::resume_unwind(panic));
            (ran, wrote)
        });
        // The writer's error first: it concerns an earlier step than the model's.
        let (gather_time, write_time) = wrote?;
        ran?;
        report.gather_time = gather_time;
        report.write_time = write_time;
        report.progress.samples = written.load(Ordering::Relaxed);
        report.progress.elapsed = start.elapsed();
        if let Some(f) = progress.as_mut() {
            f(&report.progress);
        }
        let t = Instant::now();
        sink.finish(source.consumed())?;
        report.write_time += t.elapsed();
        report.bytes = sink.bytes_written();
        report.progress.elapsed = start.elapsed();
        Ok((report, sink))
    }
}
