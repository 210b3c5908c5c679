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

use super::{ModelRequest, OpenedModel};
use crate::format::manifest::{GenerationInfo, InputInfo, Manifest};
use crate::generate::{
    CacheCost, Decode, DecodeOptions, DecodeStats, DrawKey, Finish, Generated, GenerationDefaults, SamplingParams,
    Sequence,
};
use crate::model::{AnyCache, Model, ModelError};
use crate::pipeline::capture::{CaptureError, CapturePoint};
use crate::pipeline::source::{Checked, Expected, JsonlSource, Limits, Sample, Source, SourceError};
use crate::shape::{CapturedStates, DType};
use crate::sink::output::OutLoc;
use crate::sink::{FiniteCheck, OnNonFinite, OpenMode, Sink, SinkError, SpeculatorsSink};
use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::time::{Duration, Instant};

/// Sampling as asked for; a `None` takes `generation_config.json`'s value
/// (unless `generation_config` is off), then vLLM's default.
#[derive(Clone, Debug, Default)]
pub struct SamplingArgs {
    /// `--temperature`.
    pub temperature: Option<f32>,
    /// `--top-k` (0 or -1: off).
    pub top_k: Option<i64>,
    /// `--top-p`.
    pub top_p: Option<f32>,
    /// `--min-p`.
    pub min_p: Option<f32>,
    /// `--repetition-penalty`.
    pub repetition_penalty: Option<f32>,
    /// `--presence-penalty`.
    pub presence_penalty: Option<f32>,
    /// `--frequency-penalty`.
    pub frequency_penalty: Option<f32>,
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
    /// Prompts: JSON Lines of `{"input_ids": [...]}` with an optional `"id"`.
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

/// Rows finished out of input order wait in memory for those before them;
/// past this many bytes of their states no new record is started.
const READY_BYTES: usize = 1 << 30;

/// A sequence in flight: its input sample and the states of the tokens fed so far.
struct Pending {
    sample: Sample,
    /// Per capture point, `[tokens so far, H]`.
    layers: Vec<Vec<f32>>,
}

/// A row ready to be written, or a record refused, in input order.
enum Done {
    Row(Sample, CapturedStates<usize, usize>),
    Skip(Sample, String),
}

impl GenerateJob {
    /// Runs the job, calling `progress` after every step.
    pub fn run(&self, mut progress: impl FnMut(&GenerateProgress)) -> Result<GenerateSummary, GenerateError> {
        let _span = tracing::info_span!("generate", out = %self.out.display()).entered();
        // A resumed run draws with the seed the output recorded (unless --seed says otherwise,
        // which the output's manifest then refuses as another job).
        let existing = match self.mode {
            OpenMode::Resume if crate::files::is_regular(&self.out.join("manifest.json")).unwrap_or(false) => {
                Some(Manifest::read(&self.out)?)
            }
            _ => None,
        };
        let mut summary = GenerateSummary::default();
        let checked = self.model.check()?;
        let info = checked.info();
        let (points, captures) = super::captures(&self.capture, info.num_layers)?;
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
        let asked = SamplingParams {
            temperature: s.temperature.or(defaults.temperature).unwrap_or(1.0),
            top_k: None,
            top_p: s.top_p.or(defaults.top_p).unwrap_or(1.0),
            min_p: s.min_p.or(defaults.min_p).unwrap_or(0.0),
            repetition_penalty: s.repetition_penalty.or(defaults.repetition_penalty).unwrap_or(1.0),
            presence_penalty: s.presence_penalty.unwrap_or(0.0),
            frequency_penalty: s.frequency_penalty.unwrap_or(0.0),
        };
        let (params, raised) = asked.checked(s.top_k.or(defaults.top_k).unwrap_or(0))?;
        if raised {
            tracing::warn!("temperature {} is below 0.01: raised to 0.01, as vLLM does", asked.temperature);
        }
        let max_tokens = s.max_tokens.or(defaults.max_tokens);
        if max_tokens == Some(0) {
            return Err(GenerateError::Usage("--max-tokens must be at least 1, got 0".into()));
        }
        // Loaded once: its EOS is a stop id, and it decodes regenerated.jsonl's text.
        let tokenizer = self.model.source.dir().and_then(|dir| match load_tokenizer(dir) {
            Ok(t) => t,
            Err(e) => {
                tracing::warn!(
                    "the model's tokenizer cannot be loaded (no EOS from it, regenerated.jsonl without text): {e}"
                );
                None
            }
        });
        let mut stop = s.stop_token_ids.clone();
        if !s.ignore_eos {
            let tokenizer_eos = tokenizer.as_ref().and_then(|(t, config)| tokenizer_eos(t, config));
            for id in defaults.eos_token_ids.iter().copied().chain(tokenizer_eos) {
                if !stop.contains(&id) {
                    stop.push(id);
                }
            }
        }
        let recorded = existing.as_ref().and_then(|m| m.generation.as_ref()).map(|g| g.seed);
        let (seed, seed_drawn) = match (s.seed, recorded) {
            (Some(seed), _) | (None, Some(seed)) => (seed, false),
            (None, None) => (draw_seed(), true),
        };
        if seed_drawn {
            tracing::info!("--seed {seed} (drawn; recorded in the manifest)");
        }
        summary.seed = seed;
        summary.seed_drawn = seed_drawn;
        summary.params = Some(params);
        summary.stop_token_ids = stop.clone();

        let mut request = self.model.clone();
        request.lm_head = true;
        let opened = request.open(checked)?;
        summary.load_time = opened.load_time;
        let model = &opened.model;
        let dtype = self.dtype.unwrap_or(model.dtype());
        let manifest = self.manifest(&opened, &points, dtype, seed, &params, max_tokens, &stop, s.ignore_eos);
        let sink = SpeculatorsSink::open(OutLoc { root: self.out.clone(), part: None }, manifest, self.mode)?;
        let names: Vec<String> = points.iter().map(|p| p.to_string()).collect();
        let mut sink = FiniteCheck::new(sink, OnNonFinite::Fail, names, dtype);

        let max_pos = info.max_position_embeddings;
        // A prompt past the model's positions, or with ids outside its vocabulary, is left
        // out by name below, alone: the source checks only what makes a record unreadable.
        let limits =
            Limits { vocab_size: u32::MAX as usize + 1, max_tokens: usize::MAX, max_tokens_from: String::new() };
        let vocab = info.vocab_size;
        let name = self.data.display().to_string();
        // A complete output's input must be the whole input again (Checked checks its end).
        let whole = existing.as_ref().filter(|m| m.complete).and_then(|m| m.input.as_ref()).map(|i| i.whole.clone());
        let expect = Expected { whole, ..Default::default() };
        let mut source = Checked::new(JsonlSource::open(&self.data)?, name.clone(), limits, expect);
        // The records an earlier run wrote or left out: read again, not run, and checked
        // to be the same input (the bytes and digest of the prefix they came from).
        let resumed = Sink::<usize, usize>::resume_from(&sink);
        let prefix = existing
            .as_ref()
            .and_then(|m| m.shards.last().and_then(|s| s.input.clone()))
            .filter(|p| p.samples == resumed);
        for read in 1..=resumed {
            let s = source.next().transpose()?.ok_or(SourceError::Ended { samples: read - 1, expected: resumed })?;
            if let Some(p) = prefix.as_ref().filter(|_| read == resumed) {
                if (p.bytes, &p.digest) != (s.end.bytes, &s.end.digest) {
                    return Err(GenerateError::Usage(format!(
                        "{name} is not the input the output in {} was made from: its first {resumed} records are {} \
                         bytes with digest {}, the output's came from {} bytes with digest {}",
                        self.out.display(),
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
        let mut decode = Decode::new(model, &mut cache, captures.clone(), opts, max_pos)?;
        summary.cache_cost = decode.cost();
        if let (Some(cost), Some(limit), None) = (decode.cost(), self.kv_cache_memory, max_tokens) {
            if cost.of(max_pos) as u64 > limit {
                return Err(GenerateError::Usage(format!(
                    "without --max-tokens (and with no max_new_tokens in generation_config.json) a response may \
                     run to the model's last position, and a sequence of {max_pos} positions needs {} bytes of \
                     cache, more than --kv-cache-memory ({limit} bytes): give --max-tokens",
                    cost.of(max_pos)
                )));
            }
        }
        let width = self.max_num_seqs.max(1);
        let hidden = info.hidden_size;
        let layers = points.len();

        let start = Instant::now();
        let mut pending: HashMap<usize, Pending> = HashMap::new();
        // Finished rows and refused records waiting for the ones before them.
        let mut ready: BTreeMap<usize, Done> = BTreeMap::new();
        let mut ready_bytes = 0usize;
        let (mut next, mut read, mut exhausted) = (resumed, resumed, false);
        loop {
            // Keep the queue one step deep, and the rows held for order bounded.
            while !exhausted
                && decode.waiting() < width
                && ready.len() + pending.len() < width.saturating_mul(4)
                && ready_bytes < READY_BYTES
            {
                let Some(sample) = source.next().transpose()? else {
                    exhausted = true;
                    break;
                };
                read += 1;
                let index = sample.index;
                let room = max_pos.saturating_sub(sample.len());
                // An explicit --max-tokens is kept (a response that would pass the model's
                // positions is refused); generation_config.json's max_new_tokens is cut to the
                // room left, as vLLM's server cuts its default.
                let n = match (s.max_tokens, max_tokens) {
                    (Some(n), _) => n,
                    (None, Some(d)) => d.min(room),
                    (None, None) => room,
                };
                let seq = Sequence {
                    prompt: sample.input_ids.clone(),
                    max_tokens: n,
                    params,
                    stop: stop.clone(),
                    key: DrawKey { seed, record: record_key(&sample), generation: 0, position: 0 },
                };
                let bad_id = sample.input_ids.iter().enumerate().find(|(_, &t)| t as usize >= vocab);
                let refused = if let Some((pos, t)) = bad_id {
                    Some(format!("input_ids[{pos}] = {t} is out of range (vocab_size {vocab})"))
                } else if room == 0 {
                    Some(format!("a prompt of {} tokens leaves none of the model's {max_pos} positions", sample.len()))
                } else if n > room {
                    Some(format!(
                        "a prompt of {} tokens and max_tokens {n} pass the model's {max_pos} positions",
                        sample.len()
                    ))
                } else {
                    decode.refuse(&seq)
                };
                match refused {
                    Some(why) => {
                        ready.insert(index, Done::Skip(sample, why));
                    }
                    None => {
                        decode.add(index, seq)?;
                        pending.insert(index, Pending { sample, layers: vec![Vec::new(); layers] });
                    }
                }
            }
            self.flush(&mut ready, &mut next, &mut sink, &mut summary, &mut ready_bytes)?;
            if decode.is_idle() {
                if exhausted {
                    break;
                }
                continue;
            }
            let finished = decode.step(&mut cache, |segments, states: CapturedStates<usize, usize>| {
                let mut row = 0;
                for seg in segments {
                    let p = pending.get_mut(&seg.index).expect("a sequence in flight");
                    for (l, buf) in p.layers.iter_mut().enumerate() {
                        buf.extend_from_slice(&states.layer(l)[row * hidden..(row + seg.len) * hidden]);
                    }
                    row += seg.len;
                }
                Ok::<_, GenerateError>(())
            })?;
            for (index, g) in finished {
                let p = pending.remove(&index).expect("a sequence in flight");
                let row = finish_row(p, g, layers, hidden, &mut summary)?;
                if let Done::Row(_, states) = &row {
                    ready_bytes += states.as_slice().len() * 4;
                }
                ready.insert(index, row);
            }
            self.flush(&mut ready, &mut next, &mut sink, &mut summary, &mut ready_bytes)?;
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
        summary.regenerated = write_regenerated(&self.out, tokenizer.as_ref().map(|(t, _)| t))?;
        summary.decode = decode.stats().clone();
        summary.elapsed = start.elapsed();
        summary.points = points;
        Ok(summary)
    }

    /// Writes the rows and refusals that are next in input order.
    fn flush<K: Sink<usize, usize>>(
        &self,
        ready: &mut BTreeMap<usize, Done>,
        next: &mut usize,
        sink: &mut K,
        summary: &mut GenerateSummary,
        ready_bytes: &mut usize,
    ) -> Result<(), GenerateError> {
        while let Some(done) = ready.remove(next) {
            match done {
                Done::Row(sample, states) => {
                    *ready_bytes -= states.as_slice().len() * 4;
                    sink.write_sample(&sample, states.view())?;
                    summary.rows += 1;
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
        ignore_eos: bool,
    ) -> Manifest {
        let mut job = super::layout(opened, points, dtype, crate::sink::DEFAULT_SHARD_SIZE, self.max_batch_tokens);
        job.input = Some(InputInfo { path: self.data.display().to_string(), whole: Default::default() });
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
            ignore_eos,
        });
        job
    }
}

/// The row of a finished generation: the prompt and the tokens drawn, the
/// loss on the latter, and the states of every token `[L, T, H]`.
fn finish_row(
    p: Pending,
    g: Generated,
    layers: usize,
    hidden: usize,
    summary: &mut GenerateSummary,
) -> Result<Done, GenerateError> {
    let Pending { mut sample, layers: states } = p;
    let n = g.output.len();
    match g.finish {
        Finish::Stop => summary.stopped += 1,
        Finish::Length => summary.cut += 1,
    }
    summary.generated += n;
    summary.max_response = summary.max_response.max(n);
    let prompt = sample.input_ids.len();
    sample.input_ids.extend_from_slice(&g.output);
    let mut mask = vec![0u8; prompt];
    mask.resize(prompt + n, 1);
    sample.loss_mask = Some(mask);
    let t = sample.input_ids.len();
    let values: Vec<f32> = states.into_iter().flatten().collect();
    let states = CapturedStates::try_from_vec(values, layers, t, hidden).map_err(SinkError::from)?;
    Ok(Done::Row(sample, states))
}

/// What a record's draws are keyed by: a digest of its id (the line's
/// `"id"`, else its index in the input) and its prompt tokens, as read.
fn record_key(s: &Sample) -> u128 {
    let mut h = xxhash_rust::xxh3::Xxh3::new();
    h.update(s.id.as_bytes());
    h.update(&[0xff]);
    h.update(bytemuck::cast_slice(&s.input_ids));
    h.digest128()
}

/// The file beside the dataset that holds one line per generation, in the
/// layout `speculators regenerate-responses` (0.9) writes, so its downstream
/// steps (`speculators prepare-data`) read it.
pub const REGENERATED: &str = "regenerated.jsonl";

/// Writes `OUT/regenerated.jsonl` from the finished dataset in `out`, its rows
/// read back in order (so a resumed run writes what an uninterrupted one
/// does): per row `id` (`{primary_id}_gen0`), `primary_id` (the record's
/// `"id"`, else its index in the input), `input_ids`, `loss_mask`, `text`
/// (the row decoded with special tokens kept; absent without a tokenizer) and
/// `metadata` (`idx`, `finish_reason`, `is_tool_call`, `usage`, `endpoint`,
/// `sampling_params` with the seed). Written under a temporary name and renamed.
fn write_regenerated(
    out: &std::path::Path,
    tokenizer: Option<&crate::chat::Tokenizer>,
) -> Result<usize, GenerateError> {
    use std::io::Write;
    let m = Manifest::read(out)?;
    let g = m.generation.clone().unwrap_or_default();
    let sampling = serde_json::json!({
        "temperature": g.temperature, "top_p": g.top_p, "top_k": g.top_k, "min_p": g.min_p,
        "repetition_penalty": g.repetition_penalty, "presence_penalty": g.presence_penalty,
        "frequency_penalty": g.frequency_penalty, "max_tokens": g.max_tokens, "seed": g.seed,
        "stop_token_ids": g.stop_token_ids, "ignore_eos": g.ignore_eos,
    });
    let io = |p: &std::path::Path| {
        let path = p.display().to_string();
        move |cause| GenerateError::Sink(SinkError::Io { path, cause })
    };
    let dir = crate::files::Dir::open(out).map_err(io(out))?;
    let tmp = format!(".{REGENERATED}.{}.tmp", std::process::id());
    // A killed run's temporary file of the same name (PIDs repeat in containers).
    let _ = dir.remove(&tmp);
    let file = dir.create_new(&tmp).map_err(io(&dir.join(&tmp)))?;
    let mut w = std::io::BufWriter::with_capacity(1 << 20, file);
    let write = |w: &mut std::io::BufWriter<std::fs::File>| -> Result<usize, GenerateError> {
        for (i, s) in m.samples.iter().enumerate() {
            let shard = m.shards.get(s.shard).ok_or_else(|| {
                SinkError::Directory(format!(
                    "{}: sample {i} names file {} of {}",
                    out.display(),
                    s.shard,
                    m.shards.len()
                ))
            })?;
            let path = out.join(&shard.file);
            let f = crate::format::MappedFile::open(&path).map_err(SinkError::from)?;
            let tensor = |name: &str| {
                f.tensors.get(name).map(|e| f.bytes(e)).ok_or_else(|| {
                    GenerateError::Sink(SinkError::Directory(format!("{}: no tensor {name}", path.display())))
                })
            };
            let ids: Vec<u32> = tensor("token_ids")?
                .chunks_exact(8)
                .map(|c| i64::from_le_bytes(c.try_into().expect("8")) as u32)
                .collect();
            let mask: Vec<u8> = tensor("loss_mask")?.to_vec();
            let completion = mask.iter().filter(|&&m| m == 1).count();
            let prompt = ids.len() - completion;
            let stopped = completion > 0 && ids.last().is_some_and(|t| g.stop_token_ids.contains(t));
            let mut line = serde_json::Map::new();
            line.insert("id".into(), format!("{}_gen0", s.id).into());
            line.insert("primary_id".into(), s.id.clone().into());
            line.insert("input_ids".into(), ids.clone().into());
            line.insert("loss_mask".into(), mask.into());
            match tokenizer.map(|t| t.decode(&ids)) {
                Some(Ok(text)) => {
                    line.insert("text".into(), text.into());
                }
                Some(Err(e)) => tracing::warn!("regenerated.jsonl line {i}: no text ({e})"),
                None => {}
            }
            line.insert(
                "metadata".into(),
                serde_json::json!({
                    "idx": s.index.unwrap_or(i),
                    "finish_reason": if stopped { "stop" } else { "length" },
                    "is_tool_call": false,
                    "usage": {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": ids.len()},
                    "endpoint": "strata generate",
                    "sampling_params": sampling,
                }),
            );
            serde_json::to_writer(&mut *w, &line).map_err(|e| io(&dir.join(&tmp))(e.into()))?;
            w.write_all(b"\n").map_err(io(&dir.join(&tmp)))?;
        }
        w.flush().map_err(io(&dir.join(&tmp)))?;
        w.get_ref().sync_all().map_err(io(&dir.join(&tmp)))?;
        Ok(m.samples.len())
    };
    let n = match write(&mut w) {
        Ok(n) => n,
        Err(e) => {
            let _ = dir.remove(&tmp);
            return Err(e);
        }
    };
    dir.rename(&tmp, &dir, REGENERATED).map_err(io(&dir.join(REGENERATED)))?;
    dir.sync();
    Ok(n)
}

/// The model directory's tokenizer, if it has one (`tokenizer.json`, or a
/// tiktoken model), with its `tokenizer_config.json` (`null` without one).
fn load_tokenizer(
    dir: &std::path::Path,
) -> Result<Option<(crate::chat::Tokenizer, serde_json::Value)>, crate::chat::ChatError> {
    let has = ["tokenizer.json", "tiktoken.model"].iter().any(|f| dir.join(f).is_file());
    if !has {
        return Ok(None);
    }
    let text = crate::files::read_text(&dir.join("tokenizer_config.json"), 256 << 20).unwrap_or_default();
    let config = serde_json::from_str(&text).unwrap_or(serde_json::Value::Null);
    Ok(Some((crate::chat::Tokenizer::load(dir, &config)?, config)))
}

/// A seed from the operating system's generator.
fn draw_seed() -> u64 {
    let mut b = [0u8; 8];
    match rustix::rand::getrandom(&mut b, rustix::rand::GetRandomFlags::empty()) {
        Ok(8) => u64::from_le_bytes(b),
        // Never expected on Linux; the time still differs run to run.
        _ => std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos() as u64),
    }
}

/// The tokenizer's EOS id (`tokenizer_config.json`'s `eos_token`), when it
/// is one token of `tokenizer`.
fn tokenizer_eos(tokenizer: &crate::chat::Tokenizer, config: &serde_json::Value) -> Option<u32> {
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
