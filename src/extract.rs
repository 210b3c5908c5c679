//! The extraction job behind `strata extract`: source → batches → model → per-sample sink.

use crate::batch::PackedBatch;
use crate::capture::{CaptureError, CapturePoint, CaptureSet};
use crate::checkpoint::Checkpoint;
use crate::config::LlamaConfig;
use crate::embedded;
use crate::model::{Llama, ModelError};
use crate::shape::DType;
use crate::sink::{Sink, SinkError, SpeculatorsSink};
use crate::source::{JsonlSource, Sample, SourceError};
use std::io::BufRead;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};
use tracing::info;

/// Output formats.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Format {
    /// `hs_{i}.safetensors` with `token_ids [T]` and `hidden_states [T, L, H]`.
    Speculators,
}

/// Everything `strata extract` needs to run.
#[derive(Clone, Debug)]
pub struct ExtractJob {
    /// Checkpoint directory; `None` runs the embedded default model.
    pub model: Option<PathBuf>,
    /// JSON Lines input; `None` uses the embedded sample data.
    pub data: Option<PathBuf>,
    /// Capture list as on the CLI (`eagle3`, `input:2,final`, ...).
    pub capture: String,
    /// Output directory.
    pub out: PathBuf,
    /// Storage dtype; `None` keeps the checkpoint's.
    pub dtype: Option<DType>,
    /// Output format.
    pub format: Format,
    /// Token budget of one forward step (a longer sample runs alone).
    pub max_batch_tokens: usize,
    /// Replace earlier `hs_*.safetensors` in a non-empty output directory.
    pub overwrite: bool,
}

/// Why an extraction stopped. Nothing is written before the input is fully validated.
#[derive(Debug, thiserror::Error)]
pub enum ExtractError {
    /// Model config, weights or capture points.
    #[error(transparent)]
    Model(#[from] ModelError),
    /// Input data.
    #[error(transparent)]
    Source(#[from] SourceError),
    /// Output.
    #[error(transparent)]
    Sink(#[from] SinkError),
    /// A sample the model cannot take.
    #[error("{path}:{line}: {problem}")]
    Input {
        /// The data file.
        path: String,
        /// 1-based line.
        line: usize,
        /// What is wrong.
        problem: String,
    },
    /// A checkpoint without data: the embedded samples fit only the embedded model.
    #[error("--model needs --data FILE.jsonl (the embedded demo data is made for the embedded model)")]
    DataRequired,
    /// Refusing to mix a new run with an old one.
    #[error("output directory {0} is not empty; pass --overwrite to replace its hs_*.safetensors files")]
    OutputNotEmpty(String),
    /// Output directory problems.
    #[error("cannot prepare output directory {path}: {source}")]
    OutputDir {
        /// The directory.
        path: String,
        /// The OS error.
        source: std::io::Error,
    },
}

impl From<CaptureError> for ExtractError {
    fn from(e: CaptureError) -> Self {
        ExtractError::Model(ModelError::Capture(e))
    }
}

/// What a finished run did.
#[derive(Clone, Debug, Default)]
pub struct Summary {
    /// Samples written.
    pub samples: usize,
    /// Tokens processed.
    pub tokens: usize,
    /// Forward steps.
    pub batches: usize,
    /// Bytes written.
    pub bytes: u64,
    /// The capture points, in output order.
    pub points: Vec<CapturePoint>,
    /// Storage dtype.
    pub dtype: Option<DType>,
    /// Time loading the model.
    pub load_time: Duration,
    /// Time in the forward.
    pub forward_time: Duration,
    /// Time writing.
    pub write_time: Duration,
}

fn source(job: &ExtractJob) -> Result<(String, JsonlSource<Box<dyn BufRead>>), ExtractError> {
    Ok(match &job.data {
        Some(p) => {
            let f =
                std::fs::File::open(p).map_err(|source| SourceError::Io { path: p.display().to_string(), source })?;
            let name = p.display().to_string();
            (name.clone(), JsonlSource::new(name, Box::new(std::io::BufReader::new(f))))
        }
        None => {
            let name = "<embedded data>".to_string();
            (name.clone(), JsonlSource::new(name, Box::new(embedded::DATA_JSONL.as_bytes())))
        }
    })
}

fn check_sample(config: &LlamaConfig, path: &str, s: &Sample) -> Result<(), ExtractError> {
    let err = |problem: String| ExtractError::Input { path: path.to_string(), line: s.line, problem };
    if s.input_ids.len() > config.max_position_embeddings {
        return Err(err(format!(
            "sample has {} tokens, more than max_position_embeddings {}",
            s.input_ids.len(),
            config.max_position_embeddings
        )));
    }
    if let Some((pos, t)) = s.input_ids.iter().enumerate().find(|(_, &t)| t as usize >= config.vocab_size) {
        return Err(err(format!("input_ids[{pos}] = {t} is out of range (vocab_size {})", config.vocab_size)));
    }
    Ok(())
}

fn prepare_out(dir: &Path, overwrite: bool) -> Result<(), ExtractError> {
    let err = |source| ExtractError::OutputDir { path: dir.display().to_string(), source };
    std::fs::create_dir_all(dir).map_err(err)?;
    let entries: Vec<_> = std::fs::read_dir(dir).map_err(err)?.collect::<Result<_, _>>().map_err(err)?;
    if entries.is_empty() {
        return Ok(());
    }
    if !overwrite {
        return Err(ExtractError::OutputNotEmpty(dir.display().to_string()));
    }
    for e in entries {
        let name = e.file_name();
        let name = name.to_string_lossy();
        if name.starts_with("hs_") && name.ends_with(".safetensors") {
            std::fs::remove_file(e.path()).map_err(err)?;
        }
    }
    Ok(())
}

impl ExtractJob {
    /// Runs the job: validate all input, load the model, then stream batches to the sink.
    pub fn run(&self) -> Result<Summary, ExtractError> {
        if self.model.is_some() && self.data.is_none() {
            return Err(ExtractError::DataRequired);
        }
        let _span = tracing::info_span!("extract", out = %self.out.display()).entered();
        let mut summary = Summary::default();
        let t0 = Instant::now();
        let config = match &self.model {
            Some(dir) => LlamaConfig::from_file(&dir.join("config.json")).map_err(ModelError::from)?,
            None => LlamaConfig::from_json(embedded::CONFIG_JSON).map_err(ModelError::from)?,
        };
        let points = CapturePoint::parse_list(&self.capture, config.num_layers)?;
        let captures = CaptureSet::<usize>::try_new(points.clone())?;

        // Validate every line before anything is written: a bad line fails the run with no output.
        {
            let _s = tracing::info_span!("validate").entered();
            let (path, src) = source(self)?;
            let mut n = 0;
            for s in src {
                check_sample(&config, &path, &s?)?;
                n += 1;
            }
            info!(samples = n, "input validated");
        }

        let model: Llama<usize> = match &self.model {
            Some(dir) => Llama::from_checkpoint(config, &Checkpoint::open(dir).map_err(ModelError::from)?)?,
            None => Llama::from_checkpoint(
                config,
                &Checkpoint::from_static(embedded::NAME, embedded::MODEL_SAFETENSORS).map_err(ModelError::from)?,
            )?,
        };
        summary.load_time = t0.elapsed();
        let dtype = self.dtype.unwrap_or(model.dtype());
        summary.dtype = Some(dtype);
        summary.points = points;

        prepare_out(&self.out, self.overwrite)?;
        let mut sink = match self.format {
            Format::Speculators => SpeculatorsSink::new(&self.out, dtype),
        };
        let (_, src) = source(self)?;
        let mut pending: Vec<Sample> = Vec::new();
        let mut pending_tokens = 0;
        let mut flush = |pending: &mut Vec<Sample>, summary: &mut Summary| -> Result<(), ExtractError> {
            if pending.is_empty() {
                return Ok(());
            }
            let batch = PackedBatch::from_samples(pending.iter().map(|s| s.input_ids.as_slice()));
            let t = Instant::now();
            let states = model.forward(&batch, &captures)?;
            summary.forward_time += t.elapsed();
            let t = Instant::now();
            for (i, s) in pending.iter().enumerate() {
                let one = states.view_tokens(batch.range(i)).map_err(ModelError::from)?;
                sink.write_sample(s.index, &s.input_ids, one)?;
            }
            summary.write_time += t.elapsed();
            summary.samples += pending.len();
            summary.tokens += batch.num_tokens();
            summary.batches += 1;
            info!(samples = summary.samples, tokens = summary.tokens, "batch written");
            pending.clear();
            Ok(())
        };
        for s in src {
            let s = s?;
            if pending_tokens + s.input_ids.len() > self.max_batch_tokens && !pending.is_empty() {
                flush(&mut pending, &mut summary)?;
                pending_tokens = 0;
            }
            pending_tokens += s.input_ids.len();
            pending.push(s);
        }
        flush(&mut pending, &mut summary)?;
        Sink::<usize, usize>::finish(&mut sink)?;
        summary.bytes = sink.bytes_written;
        Ok(summary)
    }
}
