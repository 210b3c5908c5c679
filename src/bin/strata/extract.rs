//! The extraction job behind `strata extract`: validate the input, load the
//! model, then run the pipeline into the chosen format.

use crate::embedded;
use std::collections::HashSet;
use std::io::BufRead;
use std::path::PathBuf;
use std::time::{Duration, Instant};
use strata::dataset::manifest::{Manifest, ModelInfo};
use strata::hf::{ArchInfo, Checkpoint};
use strata::model::{AnyConfig, AnyModel, BackendKind, LoadOptions, Model, ModelError};
use strata::pipeline::capture::{CaptureError, CapturePoint, CaptureSet};
use strata::pipeline::source::{JsonlSource, Sample, SourceError};
use strata::pipeline::{Pipeline, PipelineError, Progress, Report};
use strata::shape::DType;
use strata::sink::{OpenMode, Sink, SinkError, SpeculatorsSink, StrataSink};
use tracing::info;

/// Output formats.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Format {
    /// Sharded safetensors with `{id}.hidden_states [L, T, H]` and a manifest (docs/FORMAT.md).
    Strata,
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
    /// Token budget of one forward step; longer samples are chunked.
    pub max_batch_tokens: usize,
    /// Target shard size of the native format, bytes.
    pub shard_size: u64,
    /// What to do with an output directory that has content.
    pub mode: OpenMode,
    /// Tensor-parallel ranks (threads); 1 runs the model whole.
    pub tp: usize,
    /// The backend the model runs on.
    pub backend: BackendKind,
}

/// What `write` needs besides the model.
struct Ctx<'a> {
    config: &'a ArchInfo,
    config_text: &'a str,
    points: &'a [CapturePoint],
    captures: CaptureSet<usize>,
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
}

impl From<CaptureError> for ExtractError {
    fn from(e: CaptureError) -> Self {
        ExtractError::Model(ModelError::Capture(e))
    }
}

impl From<PipelineError> for ExtractError {
    fn from(e: PipelineError) -> Self {
        match e {
            PipelineError::Source(e) => e.into(),
            PipelineError::Model(e) => e.into(),
            PipelineError::Sink(e) => e.into(),
        }
    }
}

/// What a finished run did.
#[derive(Clone, Debug, Default)]
pub struct Summary {
    /// The pipeline's report (samples, tokens, time per stage).
    pub report: Report,
    /// Samples in the input.
    pub total_samples: usize,
    /// Tokens in the input.
    pub total_tokens: usize,
    /// The capture points, in output order.
    pub points: Vec<CapturePoint>,
    /// Storage dtype.
    pub dtype: Option<DType>,
    /// Time validating the input.
    pub validate_time: Duration,
    /// Time loading the model.
    pub load_time: Duration,
    /// Bytes the loaded weights hold in memory (all ranks).
    pub weight_bytes: usize,
    /// How the checkpoint stores its weights (quantisation scheme or dtype).
    pub weight_storage: String,
}

/// Counts of a validated input.
#[derive(Clone, Copy, Debug, Default)]
pub struct InputStats {
    /// Samples.
    pub samples: usize,
    /// Tokens.
    pub tokens: usize,
}

impl ExtractJob {
    fn source(&self) -> Result<JsonlSource<Box<dyn BufRead>>, ExtractError> {
        Ok(match &self.data {
            Some(p) => {
                let f =
                    std::fs::File::open(p).map_err(|cause| SourceError::Io { path: p.display().to_string(), cause })?;
                JsonlSource::new(p.display().to_string(), Box::new(std::io::BufReader::new(f)))
            }
            None => JsonlSource::new("<embedded data>".into(), Box::new(embedded::DATA_JSONL.as_bytes())),
        })
    }

    fn data_name(&self) -> String {
        self.data.as_ref().map_or("<embedded data>".into(), |p| p.display().to_string())
    }

    fn config_text(&self) -> Result<String, ExtractError> {
        match &self.model {
            Some(dir) => {
                let path = dir.join("config.json");
                std::fs::read_to_string(&path).map_err(|cause| {
                    ModelError::Config(strata::hf::ConfigError::Io { path: path.display().to_string(), cause }).into()
                })
            }
            None => Ok(embedded::CONFIG_JSON.to_string()),
        }
    }

    /// Reads the whole input once: every line parses, token ids fit the
    /// vocabulary, lengths fit `max_position_embeddings`, ids are unique.
    pub fn validate(&self, config: &ArchInfo) -> Result<InputStats, ExtractError> {
        let _s = tracing::info_span!("validate").entered();
        let path = self.data_name();
        let mut stats = InputStats::default();
        let mut ids: HashSet<String> = HashSet::new();
        for s in self.source()? {
            let s: Sample = s?;
            let err = |problem: String| ExtractError::Input { path: path.clone(), line: s.line, problem };
            if s.len() > config.max_position_embeddings {
                return Err(err(format!(
                    "sample has {} tokens, more than max_position_embeddings {}",
                    s.len(),
                    config.max_position_embeddings
                )));
            }
            if let Some((pos, t)) = s.input_ids.iter().enumerate().find(|(_, &t)| t as usize >= config.vocab_size) {
                return Err(err(format!("input_ids[{pos}] = {t} is out of range (vocab_size {})", config.vocab_size)));
            }
            if !ids.insert(s.id.clone()) {
                return Err(err(format!("duplicate id {:?}", s.id)));
            }
            stats.samples += 1;
            stats.tokens += s.len();
        }
        info!(samples = stats.samples, tokens = stats.tokens, "input validated");
        Ok(stats)
    }

    /// Runs the job, calling `progress` after every forward step with the input's totals.
    pub fn run(&self, mut progress: impl FnMut(&Progress, &InputStats)) -> Result<Summary, ExtractError> {
        let _span = tracing::info_span!("extract", out = %self.out.display()).entered();
        if self.model.is_some() && self.data.is_none() {
            return Err(ExtractError::DataRequired);
        }
        let mut summary = Summary::default();
        let config_text = self.config_text()?;
        let config = AnyConfig::parse(&config_text).map_err(ModelError::from)?;
        let info = config.info();
        let points = CapturePoint::parse_list(&self.capture, info.num_layers)?;
        let captures = CaptureSet::<usize>::try_new(points.clone())?;
        let opts = LoadOptions { backend: self.backend, tp: self.tp };
        // Checked before the input is read or any weight is touched.
        config.check(opts)?;

        // Validate every line before anything is written: a bad line fails the run with no output.
        let t = Instant::now();
        let stats = self.validate(&info)?;
        summary.validate_time = t.elapsed();
        summary.total_samples = stats.samples;
        summary.total_tokens = stats.tokens;

        let t = Instant::now();
        summary.weight_storage = config.quantization().unwrap_or_default();
        let model_dir = self.model.clone();
        let prefix = config.tensor_prefix().to_string();
        let open = move || match &model_dir {
            Some(dir) => Checkpoint::open_scoped(dir, &prefix),
            None => embedded::checkpoint(),
        };
        let model = config.load(opts, open)?;
        summary.load_time = t.elapsed();
        summary.weight_bytes = model.weight_bytes();
        if summary.weight_storage.is_empty() {
            summary.weight_storage = model.dtype().to_string();
        }
        let dtype = self.dtype.unwrap_or(model.dtype());
        summary.dtype = Some(dtype);
        let ctx = Ctx { config: &info, config_text: &config_text, points: &points, captures };
        let mut progress = |p: &Progress| progress(p, &stats);
        summary.report = self.write(&model, dtype, ctx, &mut progress)?;
        summary.points = points;
        Ok(summary)
    }

    fn write(
        &self,
        model: &AnyModel,
        dtype: DType,
        ctx: Ctx<'_>,
        progress: &mut dyn FnMut(&Progress),
    ) -> Result<Report, ExtractError> {
        let Ctx { config, config_text, points, captures } = ctx;
        match self.format {
            Format::Strata => {
                let path = self.model.as_ref().map_or(embedded::NAME.into(), |p| p.display().to_string());
                let info = ModelInfo::new(&path, config, config_text);
                let manifest = Manifest::new(info, points, dtype, self.shard_size);
                let sink = StrataSink::open(&self.out, manifest, points.len(), config.hidden_size, self.mode)?;
                self.drive(model, captures, sink, progress)
            }
            Format::Speculators => {
                let sink = SpeculatorsSink::open(&self.out, dtype, self.mode)?;
                self.drive(model, captures, sink, progress)
            }
        }
    }

    fn drive<K: Sink<usize, usize>>(
        &self,
        model: &AnyModel,
        captures: CaptureSet<usize>,
        sink: K,
        progress: &mut dyn FnMut(&Progress),
    ) -> Result<Report, ExtractError> {
        let (report, _) = Pipeline::new(self.source()?)
            .max_batch_tokens(self.max_batch_tokens)
            .model(model)
            .capture(captures)
            .sink(sink)
            .on_progress(progress)
            .run()?;
        Ok(report)
    }
}
