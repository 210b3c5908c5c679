//! The extraction job behind `strata extract`: load the model, open the
//! output, then stream the input once through the checks, the model and
//! the chosen format.

use super::{ModelRequest, Pipeline, PipelineError, Progress, Report};
use crate::chat::{Chat, ChatOptions, LongRows, MaskSource, RowMode, RowOptions};
use crate::format::manifest::{InputInfo, Manifest, PrepareInfo};
use crate::format::parts::PartInfo;
use crate::input::arrow::DatasetRecords;
use crate::input::jsonl::JsonlRecords;
use crate::input::parts::{self, PartSpec};
use crate::input::prepare::{PrepareOptions, PrepareStats, Prepared};
use crate::input::{InputFormat, Records};
use crate::model::{AnyModel, Model, ModelError};
use crate::pipeline::capture::{CaptureError, CapturePoint, CaptureSet};
use crate::pipeline::source::{Checked, Expected, InputPos, JsonlSource, Limits, SourceError};
use crate::shape::DType;
use crate::sink::output::OutLoc;
use crate::sink::{FiniteCheck, OnNonFinite, OpenMode, Sink, SinkError, SpeculatorsSink, StrataSink};
use std::io::BufRead;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// Where the input records come from.
#[derive(Clone, Debug)]
pub enum DataSource {
    /// A JSON Lines file, a pipe or FIFO, `-` (stdin), or a `datasets` directory.
    File(PathBuf),
    /// JSON Lines compiled into the program (a demo), with its name in messages.
    Static {
        /// How messages and the manifest name it.
        name: &'static str,
        /// The records.
        text: &'static str,
    },
}

impl DataSource {
    /// How messages and the manifest name the input.
    pub fn name(&self) -> String {
        match self {
            DataSource::File(p) => p.display().to_string(),
            DataSource::Static { name, .. } => name.to_string(),
        }
    }

    /// The path, for a file or directory.
    pub fn path(&self) -> Option<&std::path::Path> {
        match self {
            DataSource::File(p) => Some(p),
            DataSource::Static { .. } => None,
        }
    }
}

/// Output formats.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[cfg_attr(feature = "cli", derive(clap::ValueEnum))]
pub enum Format {
    /// Sharded safetensors with `{id}.hidden_states [L, T, H]` and a manifest (docs/FORMAT.md).
    #[cfg_attr(
        feature = "cli",
        value(help = "Sharded safetensors with {id}.hidden_states [L, T, H] and manifest.json")
    )]
    Strata,
    /// `hs_{i}.safetensors` with `token_ids [T]` and `hidden_states [T, L, H]`.
    #[cfg_attr(
        feature = "cli",
        value(
            help = "The speculators trainer's dataset directory: a datasets table and hidden_states/hs_{i}.safetensors"
        )
    )]
    Speculators,
}

/// Everything `strata extract` needs to run.
#[derive(Clone, Debug)]
pub struct ExtractJob {
    /// The model, and where and how it runs.
    pub model: ModelRequest,
    /// The input.
    pub data: DataSource,
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
    /// What to do with a sample whose states hold NaN or Inf.
    pub on_nonfinite: OnNonFinite,
    /// How records become token rows.
    pub prepare: PrepareArgs,
    /// The part of the input this process handles (`None`: all of it).
    pub part: Option<PartSpec>,
    /// `--draft-vocab-size` (speculators format): the sizes of the trainer's
    /// draft-vocabulary files to write at the end, with `token_freq.pt`.
    pub draft_vocab_sizes: Vec<usize>,
}

/// How input records become token rows: formats, chat template, masks, limits.
#[derive(Clone, Debug, Default)]
pub struct PrepareArgs {
    /// `--input-format`.
    pub input_format: InputFormat,
    /// `--chat-template FILE`.
    pub chat_template: Option<PathBuf>,
    /// `--chat-template-kwargs`: extra template variables.
    pub kwargs: serde_json::Map<String, serde_json::Value>,
    /// `--chat-date`; default: the date a resumed run recorded, else today.
    pub date: Option<chrono::NaiveDate>,
    /// `--loss-mask`.
    pub mask: MaskSource,
    /// `--rows`.
    pub rows: RowMode,
    /// `--max-seq-len`.
    pub max_seq_len: Option<usize>,
    /// `--skip-long`.
    pub skip_long: bool,
    /// `--template-memory`: the bytes one render may make.
    pub template_memory: u64,
    /// `--max-template-failures` (0: never stop).
    pub max_template_failures: usize,
    /// Where renders run: a child process (the binary's `__render`), or this one.
    pub isolation: Option<crate::chat::isolate::Isolation>,
}

impl PrepareArgs {
    fn mask_name(&self) -> &'static str {
        match self.mask {
            MaskSource::Boundary => "boundary",
            MaskSource::Generation => "generation",
        }
    }

    fn rows_name(&self) -> &'static str {
        match self.rows {
            RowMode::Auto => "auto",
            RowMode::PerTurn => "per-turn",
            RowMode::PerConversation => "per-conversation",
        }
    }
}
/// Why an extraction stopped. A run whose input fails before its first sample
/// is written leaves nothing; later, the output stays resumable.
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
    /// The tokenizer or chat template.
    #[error(transparent)]
    Chat(#[from] crate::chat::ChatError),
    /// Options that do not go together.
    #[error("{0}")]
    Usage(String),
    /// Every input record was refused or skipped: an empty dataset is not a
    /// result ([`Summary::check_samples`]; the run's summary says more).
    #[error(
        "none of the {records} input records gave a sample ({why}); the output in {} holds none. See the summary \
         above for the first errors",
        out.display()
    )]
    NoSample {
        /// Records read.
        records: usize,
        /// What became of them (`3 could not be rendered or tokenized, ...`).
        why: String,
        /// The output directory.
        out: PathBuf,
    },
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
    /// The capture points, in output order.
    pub points: Vec<CapturePoint>,
    /// Storage dtype.
    pub dtype: Option<DType>,
    /// Time loading the model.
    pub load_time: Duration,
    /// Bytes the loaded weights hold in memory (all ranks).
    pub weight_bytes: usize,
    /// Bytes of sequence state each sample split across steps holds (Gated DeltaNet layers).
    pub state_bytes: usize,
    /// How the checkpoint stores its weights (quantisation scheme or dtype).
    pub weight_storage: String,
    /// Samples left out for non-finite states (`--on-nonfinite skip`).
    pub skipped: usize,
    /// The input's format, as detected.
    pub input_format: InputFormat,
    /// What preparing the input did (rows, skips, errors).
    pub prepare: PrepareStats,
    /// The compute dtype the model ran in.
    pub compute: Option<crate::backend::Compute>,
    /// The chat template used, when the model has one.
    pub chat_template: Option<String>,
    /// The date `strftime_now` rendered.
    pub chat_date: Option<chrono::NaiveDate>,
    /// The part of the input this run handled, and who chose it.
    pub part: Option<PartInfo>,
    /// Speculators format: the trainer's `--target-layer-ids` for this
    /// capture, or why the trainer cannot read it.
    pub target_layer_ids: Option<Result<Vec<usize>, crate::format::manifest::TrainerIdsError>>,
    /// The `--draft-vocab-size` files written (speculators format).
    pub draft_vocab_sizes: Vec<usize>,
}

impl Summary {
    /// Samples written, resumed or left out for non-finite states.
    pub fn produced(&self) -> usize {
        self.report.progress.samples + self.report.progress.resumed + self.skipped
    }

    /// [`ExtractError::NoSample`] when the input had records and none gave
    /// a sample; `out` is the run's output directory.
    pub fn check_samples(&self, out: &std::path::Path) -> Result<(), ExtractError> {
        let p = &self.prepare;
        if self.produced() > 0 || p.records == 0 {
            return Ok(());
        }
        let mut why = Vec::new();
        for (n, what) in [
            (p.errors, "could not be rendered or tokenized"),
            (p.skipped_empty, "were empty conversations"),
            (p.skipped_no_assistant, "had no assistant turn after the first message"),
            (p.skipped_long, "were longer than the limit (--skip-long)"),
        ] {
            if n > 0 {
                why.push(format!("{n} {what}"));
            }
        }
        if p.long_prompts > 0 {
            why.push(format!("{} assistant turns had a prompt that alone fills the limit", p.long_prompts));
        }
        let why = if why.is_empty() { "see above".to_string() } else { why.join(", ") };
        Err(ExtractError::NoSample { records: p.records, why, out: out.to_path_buf() })
    }
}

/// How far through the input a run is, for progress.
#[derive(Clone, Debug, Default)]
pub struct InputProgress {
    /// Bytes read.
    pub read: u64,
    /// The input's length, when it is a file (a pipe's is unknown).
    pub total: Option<u64>,
}

impl ExtractJob {
    fn data_name(&self) -> String {
        self.data.name()
    }

    /// Where this run writes: `--out`, or its part's directory inside it.
    pub fn out_dir(&self) -> PathBuf {
        self.out_loc().path()
    }

    /// [`ExtractJob::out_dir`] as the sinks open it: `--out` (which may be a
    /// link) and the part directory inside it (which may not).
    fn out_loc(&self) -> OutLoc {
        OutLoc { root: self.out.clone(), part: self.part.as_ref().map(PartSpec::dir_name) }
    }

    /// This process's part of the input: a regular file (or the embedded
    /// data) read from the part's first line to its last, and where it lies.
    /// With `--input-format auto`, also the format the input's first record
    /// says: every part reads its records as that (as one process would).
    fn open_part(&self, spec: &PartSpec) -> Result<(Box<dyn BufRead + Send>, PartInfo, InputFormat), ExtractError> {
        let name = self.data_name();
        let io = |cause| SourceError::Io { path: name.clone(), cause };
        let part_of = |mut r: Box<dyn ReadSeek>, len: u64| {
            let info = parts::locate(&mut r, len, spec).map_err(io)?;
            let mut format = self.prepare.input_format;
            if format == InputFormat::Auto {
                r.seek(std::io::SeekFrom::Start(0)).map_err(io)?;
                let head = std::io::BufReader::new(&mut r);
                let first = crate::input::jsonl::detect_first(head, crate::pipeline::source::DEFAULT_MAX_LINE)
                    .map_err(|problem| SourceError::Input { path: name.clone(), problem })?;
                format = first.unwrap_or(InputFormat::Auto);
            }
            r.seek(std::io::SeekFrom::Start(info.start)).map_err(io)?;
            let body = std::io::Read::take(r, info.end - info.start);
            let reader: Box<dyn BufRead + Send> = Box::new(std::io::BufReader::with_capacity(1 << 20, body));
            Ok::<_, ExtractError>((reader, info, format))
        };
        match &self.data {
            DataSource::Static { text, .. } => {
                part_of(Box::new(std::io::Cursor::new(text.as_bytes())), text.len() as u64)
            }
            DataSource::File(p) => {
                // The type first: opening a FIFO would wait for its writer.
                let regular = p.as_os_str() != "-" && std::fs::metadata(p).map_err(io)?.is_file();
                let f = regular.then(|| std::fs::File::open(p)).transpose().map_err(io)?;
                let meta = f.as_ref().map(|f| f.metadata()).transpose().map_err(io)?;
                let (Some(f), Some(meta)) = (f, meta.filter(|m| m.is_file())) else {
                    return Err(ExtractError::Usage(format!(
                        "{} is not a regular file: a split into parts ({} of {}, from {}) seeks to its part, which a \
                            pipe or stdin cannot; write the input to a file first",
                        p.display(),
                        spec.index,
                        spec.count,
                        spec.source
                    )));
                };
                part_of(Box::new(f), meta.len())
            }
        }
    }

    /// The input, opened once: a file, a pipe or a FIFO (`-` is stdin).
    fn open_input(&self) -> Result<(Box<dyn BufRead + Send>, Option<u64>), ExtractError> {
        Ok(match &self.data {
            DataSource::File(p) => {
                let (r, len) = crate::files::open_stream(p)
                    .map_err(|cause| SourceError::Io { path: p.display().to_string(), cause })?;
                (Box::new(std::io::BufReader::with_capacity(1 << 20, r)), len)
            }
            DataSource::Static { text, .. } => (Box::new(text.as_bytes()), Some(text.len() as u64)),
        })
    }

    /// Runs the job, calling `progress` after every forward step with how far through the input it is.
    pub fn run(&self, mut progress: impl FnMut(&Progress, &InputProgress)) -> Result<Summary, ExtractError> {
        let _span = tracing::info_span!("extract", out = %self.out_dir().display()).entered();
        let mut summary = Summary::default();
        // Checked before the input is read or any weight is touched.
        let checked = self.model.check()?;
        let info = checked.info();
        let (points, captures) = super::captures(&self.capture, info.num_layers)?;
        if !self.draft_vocab_sizes.is_empty() && self.format != Format::Speculators {
            return Err(ExtractError::Usage(
                "--draft-vocab-size writes the speculators trainer's d2t/t2d files: it needs --format speculators"
                    .into(),
            ));
        }
        if let Some(&n) = self.draft_vocab_sizes.iter().find(|&&n| n == 0 || n > info.vocab_size) {
            return Err(ExtractError::Usage(format!(
                "--draft-vocab-size {n} must be between 1 and the model's vocabulary size {}",
                info.vocab_size
            )));
        }
        let data = self.data.path();
        let dataset_dir = data.filter(|d| crate::input::arrow::is_dataset_dir(d)).map(|d| d.to_path_buf());
        if self.prepare.input_format == InputFormat::HfDataset && dataset_dir.is_none() {
            return Err(ExtractError::Usage(format!(
                "--input-format hf-dataset needs a directory written by datasets' save_to_disk (with state.json), \
                 and {} is not one",
                self.data_name()
            )));
        }
        if let Some(d) = &dataset_dir {
            if !matches!(self.prepare.input_format, InputFormat::Auto | InputFormat::HfDataset) {
                return Err(ExtractError::Usage(format!(
                    "--input-format {} does not apply to {}: it is a datasets directory (save_to_disk), whose \
                     rows are token ids (input_ids, loss_mask); drop --input-format, or give a JSON Lines file",
                    self.prepare.input_format.name(),
                    d.display()
                )));
            }
        }
        if let Some(d) = data.filter(|d| dataset_dir.is_none() && d.is_dir()) {
            return Err(ExtractError::Usage(crate::input::arrow::not_a_dataset(d)));
        }
        let mut part_info = None;
        let mut part_format = self.prepare.input_format;
        let (reader, input_len) = match (&dataset_dir, &self.part) {
            (Some(d), Some(spec)) => {
                return Err(ExtractError::Usage(format!(
                    "{} is a datasets directory, which cannot be split into parts yet ({} of {}, from {}); \
                        export it to JSON Lines (Dataset.to_json) or run one process",
                    d.display(),
                    spec.index,
                    spec.count,
                    spec.source
                )))
            }
            (Some(_), None) => (None, None),
            (None, Some(spec)) => {
                let (r, info, format) = self.open_part(spec)?;
                let len = info.end - info.start;
                part_info = Some(info);
                part_format = format;
                (Some(r), Some(len))
            }
            (None, None) => {
                let (r, len) = self.open_input()?;
                (Some(r), len)
            }
        };

        let opened = self.model.open(checked)?;
        summary.load_time = opened.load_time;
        summary.weight_bytes = opened.model.weight_bytes();
        summary.state_bytes = opened.config.sequence_state_bytes();
        summary.weight_storage = opened.storage.clone();
        summary.compute = Some(opened.model.compute());
        let model = &opened.model;
        let dtype = self.dtype.unwrap_or(model.dtype());
        summary.dtype = Some(dtype);

        let (chat, prepare_info) = self.load_chat(&mut summary)?;

        let mut job = super::layout(&opened, &points, dtype, self.shard_size, self.max_batch_tokens);
        job.on_nonfinite = self.on_nonfinite.as_str().into();
        job.prepare = Some(prepare_info);
        job.input = Some(InputInfo { path: self.data_name(), whole: InputPos::default() });
        job.part = part_info.clone();
        job.draft_vocab_sizes = self.draft_vocab_sizes.clone();
        if self.format == Format::Speculators {
            let ids = job.target_layer_ids();
            if let Err(why) = &ids {
                tracing::warn!("the speculators trainer cannot read this capture as it is: {why}");
            }
            summary.target_layer_ids = Some(ids);
            summary.draft_vocab_sizes = self.draft_vocab_sizes.clone();
        }

        let max = info.max_position_embeddings;
        let from = if info.max_position_default {
            format!("max_position_embeddings {max} (HF's default for {}: config.json has none)", info.architecture)
        } else {
            format!("max_position_embeddings {max}")
        };
        // A token takes at most 11 bytes as `4294967295,` and 2 in a loss mask; allow spaces too.
        // Never more than DEFAULT_MAX_LINE, whatever the config claims.
        // Conversation and text lines are not token lists: the whole default bound.
        let max_line = match chat {
            Ok(_) => crate::pipeline::source::DEFAULT_MAX_LINE,
            Err(_) => max.saturating_mul(32).clamp(1 << 20, crate::pipeline::source::DEFAULT_MAX_LINE),
        };
        let p = &self.prepare;
        if let Some(n) = p.max_seq_len.filter(|&n| n > max) {
            return Err(ExtractError::Usage(format!("--max-seq-len {n} is more than the model takes: {from}")));
        }
        let limit = p.max_seq_len.unwrap_or(max);
        let from = match p.max_seq_len {
            Some(n) => format!("--max-seq-len {n}"),
            None => from,
        };
        let records: Box<dyn Records> = match (reader, &dataset_dir) {
            (Some(reader), _) => {
                let mut lines = JsonlSource::new(self.data_name(), reader).max_line(max_line);
                if let Some(p) = &part_info {
                    lines = lines.origin(p.first_line, p.first_record);
                }
                if p.max_seq_len.is_none() {
                    lines = lines.max_tokens(max, from.clone());
                }
                Box::new(JsonlRecords::new(lines, part_format))
            }
            (None, Some(dir)) => {
                let most = if p.max_seq_len.is_none() { max } else { usize::MAX };
                Box::new(DatasetRecords::open(dir, most)?)
            }
            (None, None) => unreachable!("an input is opened above"),
        };
        let long = if p.skip_long { LongRows::Skip } else { LongRows::Truncate };
        let opts = PrepareOptions {
            rows: RowOptions { mask: p.mask, rows: p.rows, max_len: limit, long },
            limit_all: p.max_seq_len.is_some(),
            limit_from: from.clone(),
            isolation: p.isolation.clone(),
            max_template_failures: p.max_template_failures,
            after_start: part_info.as_ref().is_some_and(|i| i.first_record > 0),
        };
        let source = Prepared::spawn(records, chat, opts, self.data_name())?;
        let stats = source.stats();
        let limits = Limits { vocab_size: info.vocab_size, max_tokens: limit, max_tokens_from: from };
        let names: Vec<String> = points.iter().map(|p| p.to_string()).collect();
        let input = Input { source, limits, len: input_len };
        let mut report_progress = |p: &Progress, i: &InputProgress| progress(p, i);
        let (report, skipped, format) = match self.format {
            Format::Strata => {
                let sink = StrataSink::open(self.out_loc(), job, points.len(), info.hidden_size, self.mode)?;
                let expect = expected(sink.manifest())?;
                let sink = FiniteCheck::new(sink, self.on_nonfinite, names, dtype);
                self.drive(model, captures, input, expect, sink, &mut report_progress)?
            }
            Format::Speculators => {
                let sink = SpeculatorsSink::open(self.out_loc(), job, self.mode)?;
                let expect = expected(&sink.manifest())?;
                let sink = FiniteCheck::new(sink, self.on_nonfinite, names, dtype);
                self.drive(model, captures, input, expect, sink, &mut report_progress)?
            }
        };
        summary.report = report;
        summary.skipped = skipped;
        summary.points = points;
        summary.input_format = format;
        summary.prepare = stats.lock().unwrap_or_else(|e| e.into_inner()).clone();
        summary.part = part_info;
        Ok(summary)
    }

    fn drive<K: Sink<usize, usize> + Send>(
        &self,
        model: &AnyModel,
        captures: CaptureSet<usize>,
        input: Input,
        expect: Expected,
        sink: FiniteCheck<K>,
        progress: &mut dyn FnMut(&Progress, &InputProgress),
    ) -> Result<(Report, usize, InputFormat), ExtractError> {
        let format = input.source.format_handle();
        let source = Checked::new(input.source, self.data_name(), input.limits, expect);
        let read: Arc<AtomicU64> = source.bytes_read();
        let total = input.len;
        let (report, sink) = Pipeline::new(source)
            .max_batch_tokens(self.max_batch_tokens)
            .model(model)
            .capture(captures)
            .sink(sink)
            .on_progress(move |p| progress(p, &InputProgress { read: read.load(Ordering::Relaxed), total }))
            .run()?;
        let format = *format.lock().unwrap_or_else(|e| e.into_inner());
        Ok((report, sink.skipped(), format))
    }
}

impl ExtractJob {
    /// The model's tokenizer and chat template, when the input may need them,
    /// and what the manifest records of how rows are made.
    fn load_chat(&self, summary: &mut Summary) -> Result<(Result<Arc<Chat>, String>, PrepareInfo), ExtractError> {
        let p = &self.prepare;
        if p.input_format == InputFormat::Tokens && (p.chat_template.is_some() || !p.kwargs.is_empty()) {
            return Err(ExtractError::Usage(
                "--chat-template and its options need conversations, not --input-format tokens".into(),
            ));
        }
        if p.mask == MaskSource::Generation && p.rows == RowMode::PerTurn {
            return Err(ExtractError::Usage(
                "--loss-mask generation masks a whole conversation at once: it gives one row per conversation, \
                 not --rows per-turn"
                    .into(),
            ));
        }
        // A resumed run renders the date the run it continues rendered.
        let recorded = match self.mode {
            // Read through the directory's handle: a link planted at the part directory is not followed.
            crate::sink::OpenMode::Resume => (self.out_loc().open(false).ok().flatten())
                .and_then(|d| Manifest::read_in(&d).ok())
                .and_then(|m| m.prepare)
                .and_then(|p| chrono::NaiveDate::parse_from_str(&p.chat_date, "%Y-%m-%d").ok()),
            _ => None,
        };
        let date = p.date.or(recorded).unwrap_or_else(|| chrono::Local::now().date_naive());
        let mut info = PrepareInfo {
            input_format: p.input_format.name().into(),
            chat_template_kwargs: if p.kwargs.is_empty() {
                String::new()
            } else {
                serde_json::Value::Object(p.kwargs.clone()).to_string()
            },
            // Recorded only where the template renders it (below): elsewhere it changes nothing.
            chat_date: String::new(),
            loss_mask: p.mask_name().into(),
            rows: p.rows_name().into(),
            max_seq_len: p.max_seq_len,
            skip_long: p.skip_long,
            ..Default::default()
        };
        let dir = match self.model.source.dir() {
            Some(dir) if !matches!(p.input_format, InputFormat::Tokens | InputFormat::HfDataset) => dir,
            Some(_) => return Ok((Err("the input format is token ids".into()), info)),
            None => {
                if p.input_format.needs_tokenizer() {
                    return Err(ExtractError::Usage(format!(
                        "--input-format {} needs the model's tokenizer: pass --model DIR",
                        p.input_format.name()
                    )));
                }
                return Ok((Err("the embedded demo model has none; pass --model DIR".into()), info));
            }
        };
        let has_tokenizer = crate::chat::tokenizer::FILES.iter().any(|f| dir.join(f).is_file());
        if !has_tokenizer && !p.input_format.needs_tokenizer() && p.chat_template.is_none() {
            // Token ids need no tokenizer; text and conversations say so when they come.
            let why = format!("{} has neither tokenizer.json nor tiktoken.model", dir.display());
            return Ok((Err(why), info));
        }
        let opts = ChatOptions {
            template_file: p.chat_template.clone(),
            date,
            kwargs: p.kwargs.clone(),
            template_memory: p.template_memory,
        };
        let chat = match Chat::load(dir, &opts) {
            Ok(c) => c,
            // Token ids need no tokenizer: a broken one matters only if text or conversations come.
            Err(e) if p.input_format == InputFormat::Auto && p.chat_template.is_none() => {
                tracing::warn!("the model's tokenizer or chat template cannot be loaded ({e}); token ids still work");
                return Ok((Err(e.to_string()), info));
            }
            Err(e) => return Err(e.into()),
        };
        info.tokenizer = Some(tokenizer_digest(dir));
        // The digest says what renders; where the file lies may differ on a resume.
        info.chat_template = chat.template_digest.clone();
        summary.chat_template = chat.template_origin.clone();
        if chat.template.as_ref().is_some_and(|t| t.renders_date()) {
            if self.part.is_some() && p.date.is_none() && recorded.is_none() {
                return Err(ExtractError::Usage(format!(
                    "the chat template renders the date (strftime_now) and this is one part of a split input: \
                     pass --chat-date YYYY-MM-DD (e.g. --chat-date {}) so that every part renders the same date",
                    date.format("%Y-%m-%d")
                )));
            }
            info.chat_date = date.format("%Y-%m-%d").to_string();
            summary.chat_date = Some(date);
        }
        Ok((Ok(Arc::new(chat)), info))
    }
}

/// The tokenizer file's name and `xxh3:` digest, with `tokenizer_config.json`'s
/// (special tokens, a tiktoken pattern): what decides the tokens.
fn tokenizer_digest(dir: &std::path::Path) -> String {
    let digest =
        |f: &str| std::fs::read(dir.join(f)).ok().map(|b| format!("{f} xxh3:{:016x}", xxhash_rust::xxh3::xxh3_64(&b)));
    let file = crate::chat::tokenizer::FILES.iter().find_map(|f| digest(f)).unwrap_or_default();
    match digest("tokenizer_config.json") {
        Some(c) => format!("{file}, {c}"),
        None => file,
    }
}

/// A file or an in-memory input: what a part is read from.
trait ReadSeek: std::io::Read + std::io::Seek + Send {}
impl<T: std::io::Read + std::io::Seek + Send> ReadSeek for T {}

/// The input stream with its limits.
struct Input {
    source: Prepared,
    limits: Limits,
    len: Option<u64>,
}

/// What the head of the input must be for the output in a resumed directory.
fn expected(m: &Manifest) -> Result<Expected, ExtractError> {
    let n = m.consumed();
    let mut samples: Vec<Option<(String, usize)>> = vec![None; n];
    let listed = m.samples.iter().enumerate().map(|(i, s)| (s.index.unwrap_or(i), &s.id, s.tokens));
    for (index, id, tokens) in listed.chain(m.skipped.iter().map(|s| (s.index, &s.id, s.tokens))) {
        match samples.get_mut(index) {
            Some(slot @ None) => *slot = Some((id.clone(), tokens)),
            _ => {
                return Err(SinkError::Directory(format!(
                    "the existing manifest is inconsistent: input sample {index} is listed twice or past the \
                     {n} it accounts for; use --overwrite to start over"
                ))
                .into())
            }
        }
    }
    let samples = samples.into_iter().enumerate().map(|(i, s)| {
        s.ok_or_else(|| {
            SinkError::Directory(format!(
                "the existing manifest is inconsistent: it accounts for {n} input samples but does not list \
                 sample {i}; use --overwrite to start over"
            ))
        })
    });
    let samples = samples.collect::<Result<_, _>>()?;
    let whole = m.input.as_ref().filter(|_| m.complete).map(|i| i.whole.clone());
    let prefix = if whole.is_some() { None } else { m.shards.last().and_then(|s| s.input.clone()) };
    Ok(Expected { samples, prefix, whole })
}
