//! The regeneration job behind `strata generate`: the target model writes
//! its own responses to the input's prompts, and the hidden states of every
//! token of each row (prompt and response) are captured in the same pass,
//! into the speculators dataset directory `extract --format speculators`
//! writes.
//!
//! Rows are token-exact: `input_ids` is the prompt's tokens and the tokens
//! drawn, `loss_mask` 0 on the prompt and 1 on the response. A row's states
//! are the bytes `extract` writes for the same ids (the CPU and reference
//! backends are batch-invariant), and its tokens depend only on the input,
//! the sampling options and the seed, never on the batching.

pub mod prompts;
pub mod regenerated;

use super::{ModelRequest, OpenedModel};
use crate::chat::template::json_value;
use crate::chat::{Chat, ChatOptions, RowMode};
use crate::format::manifest::{Entry, FinishReason, GenerationInfo, InputInfo, Manifest, PrepareInfo};
use crate::format::parts::PartInfo;
use crate::generate::conversation::{ReasoningParser, Regeneration, Reply, ToolParser};
use crate::generate::{
    CacheCost, Decode, DecodeOptions, DecodeStats, DrawKey, Finish, Generated, GenerationDefaults, SamplingParams,
    Sequence,
};
use crate::input::parts::PartSpec;
use crate::model::{AnyCache, Model, ModelError, PendingStates};
use crate::pipeline::capture::{CaptureError, CapturePoint};
use crate::pipeline::source::{Checked, Expected, InputPos, JsonlSource, Limits, Sample, Source, SourceError};
use crate::shape::{CapturedStates, DType};
use crate::sink::output::OutLoc;
use crate::sink::{FiniteCheck, OnNonFinite, OpenMode, Sink, SinkError, SpeculatorsSink};
use prompts::{Prompt, Prompts};
pub use regenerated::REGENERATED;
use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::time::{Duration, Instant};

/// Sampling as asked for; a `None` takes `generation_config.json`'s value
/// (unless `generation_config` is off), then vLLM's default.
#[derive(Clone, Debug, Default)]
pub struct SamplingArgs {
    /// `--temperature`, `--top-k`, `--top-p`, `--min-p` and the three penalties.
    pub asked: crate::generate::AskedSampling,
    /// `--max-tokens`; with no `max_new_tokens` either, each prompt may run
    /// to the model's last position (vLLM's server default).
    pub max_tokens: Option<usize>,
    /// `--seed`; `None`: drawn once and recorded in the manifest.
    pub seed: Option<u64>,
    /// `--stop-token-ids`: stop ids besides EOS.
    pub stop_token_ids: Vec<u32>,
    /// `--ignore-eos`: EOS is an ordinary token (never a stop).
    pub ignore_eos: bool,
    /// Take the sampling defaults of `generation_config.json` (on by default;
    /// `--no-generation-config` turns them off; its EOS ids stop either way).
    pub generation_config: bool,
}

/// Everything `strata generate` needs to run.
#[derive(Clone, Debug)]
pub struct GenerateJob {
    /// The model (its LM head is loaded whatever `model.lm_head` says).
    pub model: ModelRequest,
    /// JSON Lines of token-id prompts (`{"input_ids": [...]}`), text prompts
    /// (`{"text": ...}`) or conversations (`messages`, `conversations`, or a
    /// `prompt` string, as speculators' regeneration reads them).
    pub data: PathBuf,
    /// Capture list as on the CLI (`eagle3`, `input:2,final`, ...).
    pub capture: String,
    /// Output directory.
    pub out: PathBuf,
    /// Storage dtype; `None` keeps the checkpoint's.
    pub dtype: Option<DType>,
    /// What to do with an output directory that has content.
    pub mode: OpenMode,
    /// How tokens are drawn.
    pub sampling: SamplingArgs,
    /// Most tokens a forward step holds.
    pub max_batch_tokens: usize,
    /// Most sequences in flight.
    pub max_num_seqs: usize,
    /// `--kv-cache-memory`: most bytes of cache the sequences in flight hold.
    pub kv_cache_memory: Option<u64>,
    /// The chat template and its variables (`--chat-template-kwargs`, e.g. `enable_thinking`).
    pub chat: ChatOptions,
    /// `--tool-call-parser`: how a reply's tool calls are read (rows with `tools` need one).
    pub tool_call_parser: Option<ToolParser>,
    /// `--reasoning-parser`: the reasoning split off a reply's content, as vLLM does.
    pub reasoning_parser: Option<ReasoningParser>,
    /// `--rows`: `PerTurn` (a row per generation, as speculators writes) or
    /// `Auto` (a conversation's rows merged where one is a token prefix of the next).
    pub rows: RowMode,
    /// `--draft-vocab-size`: the trainer's d2t/t2d files for each size,
    /// counted from the rows' loss-masked tokens (the generated ones).
    pub draft_vocab_sizes: Vec<usize>,
    /// Capture and write the states (`--no-states`: rows only, for online
    /// training, each row's file holding zero capture points).
    pub states: bool,
    /// The part of the input this process handles (`None`: all of it): it
    /// writes `OUT/part-IIII-of-NNNN/`, which `strata merge` joins.
    pub part: Option<PartSpec>,
}

/// Why a generation run stopped.
#[derive(Debug, thiserror::Error)]
pub enum GenerateError {
    /// Options that do not fit each other or the model.
    #[error("{0}")]
    Usage(String),
    /// The model cannot be loaded or run.
    #[error(transparent)]
    Model(#[from] ModelError),
    /// The capture list.
    #[error(transparent)]
    Capture(#[from] CaptureError),
    /// The input.
    #[error(transparent)]
    Source(#[from] SourceError),
    /// The output.
    #[error(transparent)]
    Sink(#[from] SinkError),
    /// `generation_config.json`.
    #[error(transparent)]
    GenerationConfig(#[from] crate::generate::config::GenerationConfigError),
    /// A sampling value out of range.
    #[error(transparent)]
    Sampling(#[from] crate::generate::SamplingError),
    /// The existing output's manifest (`--resume`).
    #[error(transparent)]
    Manifest(#[from] crate::format::manifest::ManifestError),
}

/// A manifest read whose visitor never fails: only the manifest's own errors.
impl From<crate::format::manifest::ReadEachError<std::convert::Infallible>> for GenerateError {
    fn from(e: crate::format::manifest::ReadEachError<std::convert::Infallible>) -> Self {
        match e {
            crate::format::manifest::ReadEachError::Manifest(e) => GenerateError::Manifest(e),
            crate::format::manifest::ReadEachError::Each(never) => match never {},
        }
    }
}

/// What a run did.
#[derive(Clone, Debug, Default)]
pub struct GenerateSummary {
    /// Rows written by this run.
    pub rows: usize,
    /// Records an earlier run had written or left out (`--resume`).
    pub resumed: usize,
    /// Records refused (each with its reason in the manifest).
    pub skipped: usize,
    /// Generations ended by a stop token.
    pub stopped: usize,
    /// Generations cut by `max_tokens`.
    pub cut: usize,
    /// Generations that were tool calls.
    pub tool_calls: usize,
    /// Conversations stopped early (prompt and completion past `max_tokens`,
    /// a parallel call, a call no cached result answers), their rows kept.
    pub truncated: usize,
    /// Conversations read (records of messages or a prompt).
    pub conversations: usize,
    /// Tokens generated, over all rows.
    pub generated: usize,
    /// The longest response.
    pub max_response: usize,
    /// The seed the draws were keyed by.
    pub seed: u64,
    /// Whether the seed was drawn by this run.
    pub seed_drawn: bool,
    /// The sampling parameters, as resolved.
    pub params: Option<SamplingParams>,
    /// The stop ids.
    pub stop_token_ids: Vec<u32>,
    /// The capture points.
    pub points: Vec<CapturePoint>,
    /// The decode loop's account: steps, in flight, cache high-water marks.
    pub decode: DecodeStats,
    /// A sequence's measured cache cost, with a budget.
    pub cache_cost: Option<CacheCost>,
    /// Time to load the model.
    pub load_time: Duration,
    /// Time from the first step to the last row written.
    pub elapsed: Duration,
    /// Bytes written.
    pub bytes_written: u64,
    /// Lines of `regenerated.jsonl`.
    pub regenerated: usize,
}

/// Progress after each step.
#[derive(Clone, Debug, Default)]
pub struct GenerateProgress {
    /// Rows written so far.
    pub rows: usize,
    /// Tokens generated so far.
    pub generated: usize,
    /// Sequences in flight.
    pub in_flight: usize,
    /// Bytes the sequences in flight reserved, and the budget.
    pub cache: (usize, Option<u64>),
    /// Time since the first step.
    pub elapsed: Duration,
}

/// Rows finished out of input order wait in memory for those before them,
/// and a conversation's rows for its last; past this many bytes of their
/// states no new record is started.
const READY_BYTES: usize = 1 << 30;

/// One generation's row: the prompt and the tokens drawn, the loss on the
/// latter, why each generation in it ended, and the states of every token.
struct Row {
    ids: Vec<u32>,
    mask: Vec<u8>,
    finish: Vec<FinishReason>,
    /// The conversation's generation index of its last generation.
    generation: usize,
    /// `[L, T, H]`.
    states: CapturedStates<usize, usize>,
}

/// A record being regenerated: its finished rows wait here until the last.
struct Record {
    /// The record (index, line, primary id, input position; a token prompt's ids).
    sample: Sample,
    /// The input consumed before it: the position a row that does not end it records.
    start: InputPos,
    /// What its draws are keyed by.
    key: u128,
    /// A conversation's state; `None` for a single prompt.
    regen: Option<Box<Regeneration>>,
    rows: Vec<Row>,
    /// The flight of its last generation: a conversation's next turn continues its cache.
    last_flight: Option<usize>,
    /// The files of its rows an interrupted run already wrote (`--resume`):
    /// regenerated, they must be those rows again.
    written: Vec<PathBuf>,
}

/// A generation in flight.
struct Flight {
    /// Its record's index.
    record: usize,
    /// The prompt's tokens, and the request's `max_tokens`.
    prompt: Vec<u32>,
    max_tokens: usize,
    /// Per capture point, `[tokens so far, H]`.
    layers: Vec<Vec<f32>>,
}

/// A record ready to be written, or refused, in input order.
enum Done {
    Rows(Record),
    Skip(Sample, String),
}

impl Record {
    /// Bytes of its finished rows' states.
    fn bytes(&self) -> usize {
        self.rows.iter().map(|row| row.states.as_slice().len() * 4).sum()
    }
}

impl Done {
    fn bytes(&self) -> usize {
        match self {
            Done::Rows(r) => r.bytes(),
            Done::Skip(..) => 0,
        }
    }
}

/// What a run resolved once, which every generation uses.
struct Plan<'a> {
    params: SamplingParams,
    stop: Vec<u32>,
    seed: u64,
    /// `--max-tokens` as given, and the value used (given, or generation_config.json's).
    explicit: Option<usize>,
    max_tokens: Option<usize>,
    max_pos: usize,
    vocab: usize,
    hidden: usize,
    /// The model keeps a recurrent state, which a continued cache cannot cut back.
    recurrent: bool,
    chat: Option<&'a Chat>,
    /// Why there is no chat (for a text or conversation record's refusal).
    no_chat: String,
}

impl GenerateJob {
    /// Runs the job, calling `progress` after every step.
    pub fn run(&self, mut progress: impl FnMut(&GenerateProgress)) -> Result<GenerateSummary, GenerateError> {
        let out = self.out_loc().path();
        let _span = tracing::info_span!("generate", out = %out.display()).entered();
        if self.data.is_dir() {
            return Err(GenerateError::Usage(format!(
                "{} is a directory (a datasets directory of token rows?): regeneration needs conversations or \
                 prompts, as JSON Lines of `messages`, `conversations`, `prompt`, `text` or `input_ids` records",
                self.data.display()
            )));
        }
        if self.rows == RowMode::PerConversation {
            return Err(GenerateError::Usage(
                "--rows per-conversation: strata generate writes a row per generation (per-turn) or merges them \
                 where one is a token prefix of the next (auto)"
                    .into(),
            ));
        }
        // A resumed run draws with the seed the output recorded (unless --seed says otherwise,
        // which the output's manifest then refuses as another job).
        let existing = match self.mode {
            OpenMode::Resume if crate::files::is_regular(&out.join("manifest.json")).unwrap_or(false) => {
                let dir = crate::files::Dir::open(&out)
                    .map_err(|cause| SinkError::Io { path: out.display().to_string(), cause })?;
                Some(Manifest::read_each(&dir, &mut |_| Ok::<(), std::convert::Infallible>(()))?)
            }
            _ => None,
        };
        let mut summary = GenerateSummary::default();
        let checked = self.model.check()?;
        let info = checked.info();
        let (points, captures) = if self.states {
            super::captures(&self.capture, info.num_layers)?
        } else {
            // The forward step takes a capture point; its states are dropped at once, and
            // the rows are written with none (zero capture points).
            (vec![], super::captures("final", info.num_layers)?.1)
        };
        if let Some(&n) = self.draft_vocab_sizes.iter().find(|&&n| n == 0 || n > info.vocab_size) {
            return Err(GenerateError::Usage(format!(
                "--draft-vocab-size {n} must be between 1 and the model's vocabulary size {}",
                info.vocab_size
            )));
        }
        let s = &self.sampling;
        let read = match self.model.source.dir() {
            Some(dir) => GenerationDefaults::read(dir, &checked.text)?,
            None => GenerationDefaults::from_model_config(&checked.text).map_err(GenerateError::Usage)?,
        };
        // --no-generation-config turns the sampling defaults off; the EOS ids stay stop ids.
        let defaults = if s.generation_config {
            read
        } else {
            GenerationDefaults { eos_token_ids: read.eos_token_ids, ..Default::default() }
        };
        let (params, raised) = defaults.params(&s.asked)?;
        if raised {
            tracing::warn!("a temperature below 0.01 was raised to 0.01, as vLLM does");
        }
        let max_tokens = s.max_tokens.or(defaults.max_tokens);
        if max_tokens == Some(0) {
            return Err(GenerateError::Usage("--max-tokens must be at least 1, got 0".into()));
        }
        // Loaded once: the chat template renders conversations, the tokenizer's EOS is a stop
        // id, and it decodes replies and regenerated.jsonl's text.
        let (chat, no_chat) = self.load_chat()?;
        let mut stop = s.stop_token_ids.clone();
        if !s.ignore_eos {
            let tokenizer_eos = chat.as_ref().and_then(|(c, config)| tokenizer_eos(&c.tokenizer, config));
            for id in defaults.eos_token_ids.iter().copied().chain(tokenizer_eos) {
                if !stop.contains(&id) {
                    stop.push(id);
                }
            }
        }
        let recorded = existing.as_ref().and_then(|m| m.generation.as_ref()).map(|g| g.seed);
        let (seed, seed_drawn) = match (s.seed, recorded) {
            (Some(seed), _) | (None, Some(seed)) => (seed, false),
            (None, None) => (crate::generate::draw_seed(), true),
        };
        if seed_drawn {
            tracing::info!("--seed {seed} (drawn; recorded in the manifest)");
        }
        summary.seed = seed;
        summary.seed_drawn = seed_drawn;
        summary.params = Some(params);
        summary.stop_token_ids = stop.clone();

        let part_info = self.part.as_ref().map(|spec| self.locate(spec)).transpose()?;
        let mut request = self.model.clone();
        request.lm_head = true;
        let opened = request.open(checked)?;
        summary.load_time = opened.load_time;
        let model = &opened.model;
        let dtype = self.dtype.unwrap_or(model.dtype());
        let chat_ref = chat.as_ref().map(|(c, _)| c);
        let mut manifest = self.manifest(&opened, &points, dtype, seed, &params, max_tokens, &stop, chat_ref);
        manifest.part = part_info.clone();
        let sink = SpeculatorsSink::open(self.out_loc(), manifest, self.mode)?;
        let kept = sink.listed_shards()?;
        let names: Vec<String> = points.iter().map(|p| p.to_string()).collect();
        let mut sink = FiniteCheck::new(sink, OnNonFinite::Fail, names, dtype);

        let plan = Plan {
            params,
            stop: stop.clone(),
            seed,
            explicit: s.max_tokens,
            max_tokens,
            max_pos: info.max_position_embeddings,
            vocab: info.vocab_size,
            hidden: info.hidden_size,
            recurrent: info.recurrent,
            chat: chat_ref,
            no_chat,
        };
        // A prompt past the model's positions, or with ids outside its vocabulary, is left
        // out by name below, alone: the source checks only what makes a record unreadable.
        let limits =
            Limits { vocab_size: u32::MAX as usize + 1, max_tokens: usize::MAX, max_tokens_from: String::new() };
        let name = self.data.display().to_string();
        // A complete output's input must be the whole input again (Checked checks its end).
        let whole = existing.as_ref().filter(|m| m.complete).and_then(|m| m.input.as_ref()).map(|i| i.whole.clone());
        let expect = Expected { whole, ..Default::default() };
        let lines = match &part_info {
            None => {
                let f =
                    std::fs::File::open(&self.data).map_err(|cause| SourceError::Io { path: name.clone(), cause })?;
                let reader: Box<dyn std::io::BufRead + Send> = Box::new(std::io::BufReader::with_capacity(1 << 20, f));
                JsonlSource::new(name.clone(), reader)
            }
            Some(info) => {
                let io = |cause| SourceError::Io { path: name.clone(), cause };
                let mut f = std::fs::File::open(&self.data).map_err(io)?;
                std::io::Seek::seek(&mut f, std::io::SeekFrom::Start(info.start)).map_err(io)?;
                let body = std::io::Read::take(f, info.end - info.start);
                let reader: Box<dyn std::io::BufRead + Send> =
                    Box::new(std::io::BufReader::with_capacity(1 << 20, body));
                JsonlSource::new(name.clone(), reader).origin(info.first_line, info.first_record)
            }
        };
        let mut source = Checked::new(Prompts::new(lines), name.clone(), limits, expect);
        // The records an earlier run wrote or left out: read again, not run, and checked
        // to be the same input (the bytes and digest of the prefix they came from).
        let resumed = Sink::<usize, usize>::resume_from(&sink);
        let (prefix, mut written) = self.resumed_rows(resumed, kept)?;
        // The record an interrupted run wrote some rows of, if any.
        let partial = (!written.is_empty()).then_some(resumed);
        for read in 1..=resumed {
            let s = source.next().transpose()?.ok_or(SourceError::Ended { samples: read - 1, expected: resumed })?;
            if let Some(p) = prefix.as_ref().filter(|_| read == resumed) {
                if (p.bytes, &p.digest) != (s.end.bytes, &s.end.digest) {
                    return Err(GenerateError::Usage(format!(
                        "{name} is not the input the output in {} was made from: its first {resumed} records are {} \
                         bytes with digest {}, the output's came from {} bytes with digest {}",
                        out.display(),
                        s.end.bytes,
                        s.end.digest,
                        p.bytes,
                        p.digest
                    )));
                }
            }
        }
        summary.resumed = resumed;
        let mut cache = AnyCache::default();
        let opts = DecodeOptions {
            max_batch_tokens: self.max_batch_tokens,
            max_num_seqs: self.max_num_seqs,
            kv_cache_bytes: self.kv_cache_memory.map(|b| b as usize),
        };
        let mut decode = Decode::new(model, &mut cache, captures.clone(), opts, plan.max_pos)?;
        summary.cache_cost = decode.cost();
        if let (Some(cost), Some(limit), None) = (decode.cost(), self.kv_cache_memory, max_tokens) {
            if cost.of(plan.max_pos) as u64 > limit {
                return Err(GenerateError::Usage(format!(
                    "without --max-tokens (and with no max_new_tokens in generation_config.json) a response may \
                     run to the model's last position, and a sequence of {} positions needs {} bytes of \
                     cache, more than --kv-cache-memory ({limit} bytes): give --max-tokens",
                    plan.max_pos,
                    cost.of(plan.max_pos)
                )));
            }
        }
        let width = self.max_num_seqs.max(1);
        let hidden = info.hidden_size;
        let layers = points.len();

        let start = Instant::now();
        let mut records: HashMap<usize, Record> = HashMap::new();
        let mut flights: HashMap<usize, Flight> = HashMap::new();
        let mut next_flight = 0usize;
        // Finished records and refused ones waiting for those before them.
        let mut ready: BTreeMap<usize, Done> = BTreeMap::new();
        let mut ready_bytes = 0usize;
        let mut before = prefix.clone().unwrap_or_default();
        let (mut next, mut read, mut exhausted) = (resumed, resumed, false);
        loop {
            // Keep the queue one step deep, and the rows held for order bounded.
            while !exhausted
                && decode.waiting() < width
                && ready.len() + records.len() < width.saturating_mul(4)
                // Conversations in flight hold their finished rows' states too.
                && ready_bytes + records.values().map(Record::bytes).sum::<usize>() < READY_BYTES
            {
                let Some(sample) = source.next().transpose()? else {
                    exhausted = true;
                    break;
                };
                let prompt = source.inner_mut().take_prompt().expect("a record read is a prompt");
                read += 1;
                let index = sample.index;
                let start = std::mem::replace(&mut before, sample.end.clone());
                let key = record_key(&sample);
                let mut record = Record {
                    sample,
                    start,
                    key,
                    regen: None,
                    rows: vec![],
                    last_flight: None,
                    written: if index == resumed { std::mem::take(&mut written) } else { vec![] },
                };
                let first = match prompt {
                    Prompt::Tokens => Ok(record.sample.input_ids.clone()),
                    Prompt::Text(text) => self.tokenize(&plan, &text),
                    Prompt::Chat(mut regen) => {
                        summary.conversations += 1;
                        let ids = self.render(&plan, &mut regen);
                        record.regen = Some(regen);
                        ids
                    }
                    Prompt::Bad(why) => Err(why),
                };
                let started = first.and_then(|ids| {
                    self.start(&plan, &mut decode, &mut flights, &mut next_flight, &mut record, ids, layers)
                });
                match started {
                    Ok(()) => {
                        records.insert(index, record);
                    }
                    Err(why) => {
                        ready.insert(index, Done::Skip(record.sample, why));
                    }
                }
            }
            self.flush(&mut ready, &mut next, &mut sink, &mut summary, &mut ready_bytes, partial)?;
            if decode.is_idle() {
                if exhausted {
                    break;
                }
                continue;
            }
            let finished = decode.step(&mut cache, |segments, states: PendingStates<usize, usize>| {
                let states = states.wait()?;
                let mut row = 0;
                for seg in segments {
                    let f = flights.get_mut(&seg.index).expect("a generation in flight");
                    for (l, buf) in f.layers.iter_mut().enumerate() {
                        debug_assert_eq!(buf.len(), seg.pos0 * hidden, "a flight's states come in order");
                        buf.extend_from_slice(&states.layer(l)[row * hidden..(row + seg.len) * hidden]);
                    }
                    row += seg.len;
                }
                Ok::<_, GenerateError>(())
            })?;
            for (flight, g) in finished {
                let f = flights.remove(&flight).expect("a generation in flight");
                let index = f.record;
                let mut record = records.remove(&index).expect("a record in flight");
                match self.finished(&plan, &mut record, f, g, layers, hidden, &mut summary)? {
                    Err(why) => {
                        ready.insert(index, Done::Skip(record.sample, why));
                    }
                    Ok(Some(ids)) => {
                        match self.start(&plan, &mut decode, &mut flights, &mut next_flight, &mut record, ids, layers) {
                            Ok(()) => {
                                records.insert(index, record);
                            }
                            Err(why) => {
                                ready.insert(index, Done::Skip(record.sample, why));
                            }
                        }
                    }
                    Ok(None) => {
                        if self.rows == RowMode::Auto {
                            record.rows = merge(std::mem::take(&mut record.rows));
                        }
                        let done = Done::Rows(record);
                        ready_bytes += done.bytes();
                        ready.insert(index, done);
                    }
                }
            }
            self.flush(&mut ready, &mut next, &mut sink, &mut summary, &mut ready_bytes, partial)?;
            progress(&GenerateProgress {
                rows: summary.rows,
                generated: summary.generated,
                in_flight: decode.in_flight(),
                cache: (decode.reserved(), self.kv_cache_memory),
                elapsed: start.elapsed(),
            });
        }
        debug_assert_eq!(next, read);
        Sink::<usize, usize>::finish(&mut sink, source.consumed())?;
        summary.skipped += sink.skipped();
        summary.bytes_written = Sink::<usize, usize>::bytes_written(&sink);
        drop(sink);
        summary.regenerated = regenerated::write(&out, chat_ref.map(|c| &c.tokenizer))?;
        summary.decode = decode.stats().clone();
        summary.elapsed = start.elapsed();
        summary.points = points;
        Ok(summary)
    }

    /// Where this run writes: `--out`, or its part's directory inside it.
    fn out_loc(&self) -> OutLoc {
        OutLoc { root: self.out.clone(), part: self.part.as_ref().map(PartSpec::dir_name) }
    }

    /// This process's part of the input file: where it lies, and its first line and record.
    fn locate(&self, spec: &PartSpec) -> Result<PartInfo, GenerateError> {
        let name = self.data.display().to_string();
        let io = |cause| SourceError::Io { path: name.clone(), cause };
        let meta = std::fs::metadata(&self.data).map_err(io)?;
        if !meta.is_file() {
            return Err(GenerateError::Usage(format!(
                "{name} is not a regular file: a split into parts ({} of {}, from {}) seeks to its part, which a \
                 pipe cannot; write the input to a file first",
                spec.index, spec.count, spec.source
            )));
        }
        let mut f = std::fs::File::open(&self.data).map_err(io)?;
        Ok(crate::input::parts::locate(&mut f, meta.len(), spec).map_err(io)?)
    }

    /// The model's tokenizer and chat template, with its `tokenizer_config.json`;
    /// `None` (and why, for the records that need one) when it has no tokenizer.
    fn load_chat(&self) -> Result<(Option<(Chat, serde_json::Value)>, String), GenerateError> {
        let Some(dir) = self.model.source.dir() else {
            return Ok((None, "the embedded demo model has no tokenizer; pass --model DIR".into()));
        };
        let has = crate::chat::tokenizer::FILES.iter().any(|f| dir.join(f).is_file());
        if !has {
            let why = format!("{} has neither tokenizer.json nor tiktoken.model", dir.display());
            return Ok((None, why));
        }
        let text = crate::files::read_text(&dir.join("tokenizer_config.json"), 256 << 20).unwrap_or_default();
        let config = serde_json::from_str(&text).unwrap_or(serde_json::Value::Null);
        match Chat::load(dir, &self.chat) {
            Ok(c) => Ok((Some((c, config)), String::new())),
            // A chosen template that does not load is the run's error; the model's own is
            // the error of the records that need it (token ids do not).
            Err(e) if self.chat.template_file.is_some() => Err(GenerateError::Usage(e.to_string())),
            Err(e) => {
                tracing::warn!("the model's tokenizer or chat template cannot be loaded: {e}");
                Ok((None, e.to_string()))
            }
        }
    }

    /// A text prompt's tokens, as vLLM's completions endpoint makes them.
    fn tokenize(&self, plan: &Plan<'_>, text: &str) -> Result<Vec<u32>, String> {
        let chat = plan.chat.ok_or_else(|| format!("a text prompt needs the model's tokenizer: {}", plan.no_chat))?;
        let mut enc = crate::chat::Encoded::default();
        chat.tokenizer.encode(text, true, &mut enc).map_err(|e| e.to_string())?;
        if enc.ids.is_empty() {
            return Err("the text gives no tokens".into());
        }
        Ok(enc.ids)
    }

    /// The next request of a conversation, rendered with the generation
    /// prompt and tokenized as vLLM's chat endpoint does (no special tokens
    /// added: the template writes its own). `Ok(None)`-free: the caller
    /// asks only when [`Regeneration::next_request`] has one.
    fn render(&self, plan: &Plan<'_>, regen: &mut Regeneration) -> Result<Vec<u32>, String> {
        let messages = regen.next_request().ok_or("no user turn")?;
        self.render_messages(plan, regen, &messages)
    }

    fn render_messages(
        &self,
        plan: &Plan<'_>,
        regen: &Regeneration,
        messages: &serde_json::Value,
    ) -> Result<Vec<u32>, String> {
        let chat = plan.chat.ok_or_else(|| format!("a conversation needs the model's tokenizer: {}", plan.no_chat))?;
        if regen.tools.is_some() && self.tool_call_parser.is_none() {
            // vLLM answers such a request 400, and the tool fails the conversation.
            return Err("the record has `tools`, and \"auto\" tool choice needs --tool-call-parser".into());
        }
        let template = chat.template.as_ref().ok_or(
            "the model has no chat template (no chat_template.jinja, none in tokenizer_config.json): pass \
             --chat-template FILE",
        )?;
        let r = template
            .render(&json_value(messages), regen.tools.as_ref().map(json_value).as_ref(), true)
            .map_err(|e| format!("the chat template cannot render this conversation's generation prompt: {e}"))?;
        let mut enc = crate::chat::Encoded::default();
        chat.tokenizer.encode(&r.text, false, &mut enc).map_err(|e| e.to_string())?;
        if enc.ids.is_empty() {
            return Err("the rendered prompt gives no tokens".into());
        }
        Ok(enc.ids)
    }

    /// Admits a generation of `ids` for `record`, or says why it cannot run
    /// (the record is then refused whole, as vLLM's 400 fails the tool's conversation).
    /// A conversation's turn continues the cache of its last one where
    /// their tokens begin alike, and takes that row's states for them.
    #[allow(clippy::too_many_arguments)]
    fn start<M: Model>(
        &self,
        plan: &Plan<'_>,
        decode: &mut Decode<'_, M, usize>,
        flights: &mut HashMap<usize, Flight>,
        next_flight: &mut usize,
        record: &mut Record,
        ids: Vec<u32>,
        layers: usize,
    ) -> Result<(), String> {
        let max_pos = plan.max_pos;
        let room = max_pos.saturating_sub(ids.len());
        // An explicit --max-tokens is kept (a response that would pass the model's
        // positions is refused); generation_config.json's max_new_tokens is cut to the
        // room left, as vLLM's server cuts its default.
        let n = match (plan.explicit, plan.max_tokens) {
            (Some(n), _) => n,
            (None, Some(d)) => d.min(room),
            (None, None) => room,
        };
        if let Some((pos, t)) = ids.iter().enumerate().find(|(_, &t)| t as usize >= plan.vocab) {
            return Err(format!("input_ids[{pos}] = {t} is out of range (vocab_size {})", plan.vocab));
        }
        if room == 0 {
            return Err(format!("a prompt of {} tokens leaves none of the model's {max_pos} positions", ids.len()));
        }
        if n > room {
            return Err(format!(
                "a prompt of {} tokens and max_tokens {n} pass the model's {max_pos} positions",
                ids.len()
            ));
        }
        let generation = record.rows.len();
        // The tokens this prompt shares with the last row, whose cache that turn parked.
        let last = record.last_flight.zip(record.rows.last());
        let shared = last.map_or(0, |(_, row)| common_prefix(&row.ids, &ids));
        // A recurrent state holds every position it has seen: only a whole row continues it.
        let shared = if plan.recurrent && last.is_some_and(|(_, row)| shared < row.ids.len()) { 0 } else { shared };
        let seq = Sequence {
            prompt: ids,
            max_tokens: n,
            params: plan.params,
            stop: plan.stop.clone(),
            key: DrawKey { seed: plan.seed, record: record.key, generation: generation as u32, position: 0 },
            park: record.regen.is_some(),
            continues: last.filter(|_| shared > 0).map(|(flight, _)| (flight, shared)),
        };
        if let Some(why) = decode.refuse(&seq) {
            return Err(why);
        }
        let prompt = seq.prompt.clone();
        let f = *next_flight;
        *next_flight += 1;
        let reused = decode.add(f, seq).map_err(|e| e.to_string())?;
        // The states of the tokens not fed again: the last row's, the same bytes a feed gives.
        let states = match last.filter(|_| reused > 0) {
            Some((_, row)) => (0..layers).map(|l| row.states.layer(l)[..reused * plan.hidden].to_vec()).collect(),
            None => vec![Vec::new(); layers],
        };
        flights.insert(f, Flight { record: record.sample.index, prompt, max_tokens: n, layers: states });
        record.last_flight = Some(f);
        Ok(())
    }

    /// Takes a finished generation into its record's rows. `Ok(Ok(Some(ids)))`:
    /// the conversation's next prompt; `Ok(Ok(None))`: the record is done;
    /// `Ok(Err(why))`: the record is refused.
    #[allow(clippy::too_many_arguments)]
    fn finished(
        &self,
        plan: &Plan<'_>,
        record: &mut Record,
        f: Flight,
        g: Generated,
        layers: usize,
        hidden: usize,
        summary: &mut GenerateSummary,
    ) -> Result<Result<Option<Vec<u32>>, String>, GenerateError> {
        let n = g.output.len();
        let generation = record.rows.len();
        // The reply as vLLM returns it: its text without the stop token, the reasoning
        // split off, the tool calls read.
        let reply = match (&mut record.regen, plan.chat) {
            (Some(regen), Some(chat)) => {
                let body = match g.finish {
                    Finish::Stop => &g.output[..n - 1],
                    Finish::Length => &g.output[..],
                };
                let parser = self.tool_call_parser.filter(|_| regen.tools.is_some());
                // vLLM's hermes parser keeps special tokens when the request has tools.
                let text = match chat.tokenizer.decode_content(&f.prompt, body, parser.is_none()) {
                    Ok(t) => t,
                    Err(e) => return Ok(Err(e.to_string())),
                };
                let thinking = self.chat.kwargs.get("enable_thinking").and_then(|v| v.as_bool()).unwrap_or(true);
                let content = match self.reasoning_parser {
                    Some(p) => p.split(&text, thinking).1,
                    None => Some(text),
                };
                let key = (plan.seed, record.key, generation);
                Some(match parser {
                    Some(p) => {
                        let (content, tool_calls) = p.extract(content.as_deref().unwrap_or(""), |i| {
                            let mut h = xxhash_rust::xxh3::Xxh3::new();
                            h.update(&key.0.to_le_bytes());
                            h.update(&key.1.to_le_bytes());
                            h.update(&(key.2 as u64).to_le_bytes());
                            h.update(&(i as u64).to_le_bytes());
                            format!("chatcmpl-tool-{:032x}", h.digest128())
                        });
                        Reply { content, tool_calls }
                    }
                    None => Reply { content, tool_calls: vec![] },
                })
            }
            _ => None,
        };
        let calls = reply.as_ref().is_some_and(|r| !r.tool_calls.is_empty());
        let finish = match (calls, g.finish) {
            (true, _) => FinishReason::ToolCalls,
            (false, Finish::Stop) => FinishReason::Stop,
            (false, Finish::Length) => FinishReason::Length,
        };
        match finish {
            FinishReason::Stop => summary.stopped += 1,
            FinishReason::Length => summary.cut += 1,
            FinishReason::ToolCalls => summary.tool_calls += 1,
        }
        summary.generated += n;
        summary.max_response = summary.max_response.max(n);
        let Flight { prompt: mut ids, max_tokens, layers: states, .. } = f;
        let prompt_len = ids.len();
        let total = prompt_len + n;
        let values: Vec<f32> = states.into_iter().flatten().collect();
        let states = CapturedStates::try_from_vec(values, layers, total, hidden).map_err(SinkError::from)?;
        ids.extend_from_slice(&g.output);
        let mut mask = vec![0u8; prompt_len];
        mask.resize(total, 1);
        record.rows.push(Row { ids, mask, finish: vec![finish], generation, states });
        let Some(regen) = record.regen.as_mut() else { return Ok(Ok(None)) };
        if let Err(why) = regen.answer(reply.unwrap_or_default(), total, max_tokens) {
            return Ok(Err(why));
        }
        match regen.next_request() {
            None => {
                summary.truncated += regen.truncated as usize;
                Ok(Ok(None))
            }
            Some(messages) => Ok(self.render_messages(plan, regen, &messages).map(Some)),
        }
    }

    /// The input prefix the kept output came from, and how many rows of
    /// the record after it an interrupted run already wrote (a
    /// conversation's rows are written one file each; its last one ends it).
    fn resumed_rows(&self, resumed: usize, kept: usize) -> Result<(Option<InputPos>, Vec<PathBuf>), GenerateError> {
        if self.mode != OpenMode::Resume {
            return Ok((None, vec![]));
        }
        let out = self.out_loc().path();
        let dir =
            crate::files::Dir::open(&out).map_err(|cause| SinkError::Io { path: out.display().to_string(), cause })?;
        // The listing as the sink kept it: its first `kept` files (a file journaled
        // but not renamed in before the run stopped is written again).
        let (mut last, mut written, mut shards) = (None, Vec::new(), 0);
        Manifest::read_each(&dir, &mut |e| {
            match e {
                Entry::Shard(s) if shards < kept => {
                    shards += 1;
                    last = s.input;
                }
                Entry::Sample(s) if s.index == Some(resumed) && s.shard < kept => {
                    written.push(out.join(SpeculatorsSink::file_name(s.shard)))
                }
                _ => {}
            }
            Ok::<(), std::convert::Infallible>(())
        })?;
        Ok((last.filter(|p: &InputPos| p.samples == resumed), written))
    }

    /// Writes the records that are next in input order.
    fn flush<K: Sink<usize, usize>>(
        &self,
        ready: &mut BTreeMap<usize, Done>,
        next: &mut usize,
        sink: &mut K,
        summary: &mut GenerateSummary,
        ready_bytes: &mut usize,
        partial: Option<usize>,
    ) -> Result<(), GenerateError> {
        while let Some(done) = ready.remove(next) {
            *ready_bytes -= done.bytes();
            match done {
                Done::Rows(record) => {
                    let Record { sample, start, rows, written, .. } = record;
                    // A resumed conversation's rows, regenerated, must be the ones kept.
                    for (j, file) in written.iter().enumerate() {
                        let f = crate::format::MappedFile::open(file).map_err(SinkError::from)?;
                        let ids: Option<Vec<u32>> = f.tensors.get("token_ids").map(|e| {
                            f.bytes(e)
                                .chunks_exact(8)
                                .map(|c| i64::from_le_bytes(c.try_into().expect("8")) as u32)
                                .collect()
                        });
                        if rows.get(j).map(|r| &r.ids) != ids.as_ref() {
                            return Err(resumed_differs(&sample, file));
                        }
                    }
                    let last = rows.len() - 1;
                    for (j, row) in rows.into_iter().enumerate().skip(written.len()) {
                        let row_sample = Sample {
                            index: sample.index,
                            line: sample.line,
                            id: format!("{}_gen{}", sample.id, row.generation),
                            input_ids: row.ids,
                            loss_mask: Some(row.mask),
                            // Only the record's last row says it is done: a resume regenerates
                            // a record whose rows were not all written, and writes the rest.
                            end: if j == last { sample.end.clone() } else { start.clone() },
                            finish: row.finish,
                        };
                        sink.write_sample(&row_sample, row.states.view())?;
                        summary.rows += 1;
                    }
                }
                Done::Skip(sample, why) if partial == Some(sample.index) => {
                    return Err(resumed_differs(&sample, std::path::Path::new(&format!("(refused this time: {why})"))));
                }
                Done::Skip(sample, why) => {
                    tracing::warn!("record {} (line {}): {why}; left out", crate::clip(&sample.id, 80), sample.line);
                    sink.skip_sample(&sample, why)?;
                    summary.skipped += 1;
                }
            }
            *next += 1;
        }
        Ok(())
    }

    #[allow(clippy::too_many_arguments)]
    fn manifest(
        &self,
        opened: &OpenedModel,
        points: &[CapturePoint],
        dtype: DType,
        seed: u64,
        p: &SamplingParams,
        max_tokens: Option<usize>,
        stop: &[u32],
        chat: Option<&Chat>,
    ) -> Manifest {
        let mut job = super::layout(opened, points, dtype, crate::sink::DEFAULT_SHARD_SIZE, self.max_batch_tokens);
        job.input = Some(InputInfo { path: self.data.display().to_string(), whole: Default::default() });
        job.draft_vocab_sizes = self.draft_vocab_sizes.clone();
        // What renders conversations: a resume must render the same prompts.
        job.prepare = chat.map(|c| PrepareInfo {
            input_format: "generate".into(),
            tokenizer: Some(c.digest.clone()),
            chat_template: c.template_digest.clone(),
            chat_template_kwargs: if self.chat.kwargs.is_empty() {
                String::new()
            } else {
                serde_json::Value::Object(self.chat.kwargs.clone()).to_string()
            },
            chat_date: if c.template.as_ref().is_some_and(|t| t.renders_date()) {
                self.chat.date.format("%Y-%m-%d").to_string()
            } else {
                String::new()
            },
            ..Default::default()
        });
        job.generation = Some(GenerationInfo {
            seed,
            temperature: p.temperature,
            top_k: p.top_k.unwrap_or(0),
            top_p: p.top_p,
            min_p: p.min_p,
            repetition_penalty: p.repetition_penalty,
            presence_penalty: p.presence_penalty,
            frequency_penalty: p.frequency_penalty,
            max_tokens,
            stop_token_ids: stop.to_vec(),
            ignore_eos: self.sampling.ignore_eos,
            tool_call_parser: self.tool_call_parser.map(|p| p.name().to_string()),
            reasoning_parser: self.reasoning_parser.map(|p| p.name().to_string()),
            rows: match self.rows {
                RowMode::Auto => "auto".into(),
                _ => "per-turn".into(),
            },
            no_states: !self.states,
        });
        job
    }
}

/// A resumed conversation that does not regenerate the rows an interrupted
/// run kept (other flags, another backend's bits): refused, not mixed.
fn resumed_differs(sample: &Sample, file: &std::path::Path) -> GenerateError {
    GenerateError::Usage(format!(
        "cannot resume: record {} (line {}) had rows written by the interrupted run, and regenerating it now \
         gives other rows ({}); resume with the flags and backend it ran with, or start over with --overwrite",
        crate::clip(&sample.id, 80),
        sample.line,
        file.display()
    ))
}

/// `--rows auto`: a row that is a token prefix of the next one's prompt
/// (with a prompt token between, so that the spans stay apart) is merged
/// into it, as `extract` merges a conversation's turns: one row, a loss
/// span per generation. The longer row's states cover the shorter's
/// tokens (the same tokens, computed the same on the batch-invariant backends).
fn merge(rows: Vec<Row>) -> Vec<Row> {
    let mut out: Vec<Row> = Vec::with_capacity(rows.len());
    for mut r in rows {
        if let Some(prev) = out.last() {
            let n = prev.ids.len();
            let prompt = r.mask.iter().position(|&m| m == 1).unwrap_or(r.mask.len());
            if prompt > n && r.ids[..n] == prev.ids[..] {
                let prev = out.pop().expect("checked above");
                r.mask[..n].copy_from_slice(&prev.mask);
                let mut finish = prev.finish;
                finish.append(&mut r.finish);
                r.finish = finish;
            }
        }
        out.push(r);
    }
    out
}

/// How many tokens `a` and `b` begin with alike.
fn common_prefix(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

/// What a record's draws are keyed by: a digest of its id (the line's
/// `"id"`, else its index in the input; a conversation's primary id) and
/// its prompt tokens, as read.
fn record_key(s: &Sample) -> u128 {
    let mut h = xxhash_rust::xxh3::Xxh3::new();
    h.update(s.id.as_bytes());
    h.update(&[0xff]);
    h.update(bytemuck::cast_slice(&s.input_ids));
    h.digest128()
}

/// The tokenizer's EOS id (`tokenizer_config.json`'s `eos_token`), when it
/// is one token of `tokenizer`.
pub fn tokenizer_eos(tokenizer: &crate::chat::Tokenizer, config: &serde_json::Value) -> Option<u32> {
    let eos = match config.get("eos_token")? {
        serde_json::Value::String(s) => s.clone(),
        v => v.get("content")?.as_str()?.to_string(),
    };
    let mut enc = crate::chat::Encoded::default();
    tokenizer.encode(&eos, false, &mut enc).ok()?;
    match enc.ids.as_slice() {
        [id] => Some(*id),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(ids: &[u32], prompt: usize, generation: usize) -> Row {
        let mut mask = vec![0u8; prompt];
        mask.resize(ids.len(), 1);
        let states = CapturedStates::try_from_vec(vec![generation as f32; ids.len()], 1, ids.len(), 1).unwrap();
        Row { ids: ids.to_vec(), mask, finish: vec![FinishReason::Stop], generation, states }
    }

    #[test]
    fn auto_rows_merge_where_one_is_the_next_ones_prefix() {
        // Turn 1 is turn 0's row and more; turn 2 rewrote the history (no prefix).
        let rows = vec![row(&[1, 2, 3, 4], 2, 0), row(&[1, 2, 3, 4, 5, 6, 7], 6, 1), row(&[1, 9, 6, 7, 8], 4, 2)];
        let merged = merge(rows);
        assert_eq!(merged.len(), 2);
        assert_eq!(merged[0].ids, vec![1, 2, 3, 4, 5, 6, 7]);
        assert_eq!(merged[0].mask, vec![0, 0, 1, 1, 0, 0, 1]);
        assert_eq!(merged[0].finish.len(), 2);
        assert_eq!((merged[0].generation, merged[0].states.as_slice()[0]), (1, 1.0), "the longer row's states");
        assert_eq!(merged[1].generation, 2);
        // No prompt token between two spans: kept apart, or the spans would run together.
        let merged = merge(vec![row(&[1, 2, 3], 1, 0), row(&[1, 2, 3, 4], 3, 1)]);
        assert_eq!(merged.len(), 2);
    }
}
