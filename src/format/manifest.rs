//! `manifest.json`: what a dataset holds, what made it, and how to check it.
//! See docs/FORMAT.md.
//!
//! While a run writes, `manifest.json` holds the job and what was compacted
//! so far, and each finished file is appended to `journal.jsonl` (one line,
//! fsynced), so closing a file costs one line, not a rewrite of every
//! earlier one. The finished run compacts the journal into the manifest.
//! [`Manifest::read`] replays the journal, so readers see one manifest.

pub use super::parts::PartInfo;
use crate::pipeline::capture::CapturePoint;
pub use crate::pipeline::source::InputPos;
use crate::shape::DType;
use serde::{Deserialize, Serialize};
use std::path::Path;

/// Version of the manifest and shard layout (2: journal, run, input and
/// weights digests, skipped samples). Version 1 is still read.
pub const SCHEMA_VERSION: u32 = 3;
/// The file name.
pub const MANIFEST: &str = "manifest.json";
/// The journal of files finished since the manifest was last written.
pub const JOURNAL: &str = "journal.jsonl";
/// The largest manifest or journal read (about 5 million samples).
const MAX_MANIFEST_BYTES: u64 = 1 << 30;

/// Why a manifest (with its journal) cannot be read.
#[derive(Debug, thiserror::Error)]
pub enum ManifestError {
    /// The file cannot be read.
    #[error("cannot read {path}: {cause}")]
    Io {
        /// The file.
        path: String,
        /// The OS error.
        cause: std::io::Error,
    },
    /// A manifest larger than any a run writes.
    #[error("{path} is {len} bytes, more than the {MAX_MANIFEST_BYTES} a manifest may have")]
    TooLarge {
        /// The file.
        path: String,
        /// Its size.
        len: u64,
    },
    /// Not the JSON a manifest holds.
    #[error("malformed {path}: {cause}")]
    Malformed {
        /// The file.
        path: String,
        /// What the parser said.
        cause: serde_json::Error,
    },
    /// A schema this strata does not read.
    #[error("{path}: schema_version {version} is not supported (this strata reads 1 to {SCHEMA_VERSION})")]
    Version {
        /// The file.
        path: String,
        /// The version found (clipped), or `(none)`.
        version: String,
    },
    /// A journal line, not the last, that does not parse.
    #[error("{path}:{line}: malformed journal line")]
    JournalLine {
        /// The journal.
        path: String,
        /// 1-based line number.
        line: usize,
    },
    /// A journal line that skips shards.
    #[error("{path}: journal entry for shard {index} follows shard {listed}")]
    JournalGap {
        /// The journal.
        path: String,
        /// The shard the line is for.
        index: usize,
        /// Shards listed before it.
        listed: usize,
    },
}

impl ManifestError {
    /// The file the error is about.
    pub fn path(&self) -> &str {
        match self {
            ManifestError::Io { path, .. }
            | ManifestError::TooLarge { path, .. }
            | ManifestError::Malformed { path, .. }
            | ManifestError::Version { path, .. }
            | ManifestError::JournalLine { path, .. }
            | ManifestError::JournalGap { path, .. } => path,
        }
    }
}

/// Why the speculators trainer cannot read a capture (see [`Manifest::target_layer_ids`]).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum TrainerIdsError {
    /// No capture point.
    #[error("nothing is captured")]
    Nothing,
    /// The last point is not `final`.
    #[error(
        "the trainer reads the last capture point as the final layer's state (before the norm), \
         but this capture ends with {last}; end --capture with final"
    )]
    NotFinal {
        /// The last point.
        last: String,
    },
    /// A layer id listed twice.
    #[error("layer id {0} is captured twice; the trainer's ids must be distinct")]
    Twice(usize),
    /// A manifest from before layer ids were recorded.
    #[error("the manifest records no layer ids (written by an older strata)")]
    NoIds,
    /// A point outside the trainer's numbering.
    #[error("{point} has no layer id in the trainer's numbering")]
    NoId {
        /// The point.
        point: String,
    },
}

/// Why [`Manifest::read_each`] stopped: the manifest could not be read, or
/// the caller's `each` refused an entry (its error, whole).
#[derive(Debug, thiserror::Error)]
pub enum ReadEachError<E> {
    /// The manifest.
    #[error(transparent)]
    Manifest(#[from] ManifestError),
    /// What `each` returned.
    #[error("{0}")]
    Each(E),
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> ManifestError + '_ {
    move |cause| ManifestError::Io { path: path.display().to_string(), cause }
}

fn malformed(path: &Path) -> impl FnOnce(serde_json::Error) -> ManifestError + '_ {
    move |cause| ManifestError::Malformed { path: path.display().to_string(), cause }
}

/// The model a dataset came from.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ModelInfo {
    /// Checkpoint directory as given, or `<embedded llama-default>`.
    pub path: String,
    /// `model_type`.
    pub architecture: String,
    /// `xxh3:` hash of the `config.json` bytes.
    pub config_hash: String,
    /// Digest of the weights: safetensors headers plus strided samples of
    /// every tensor's bytes (see `Checkpoint::digest`); empty in schema 1.
    #[serde(default)]
    pub weights_digest: String,
    /// Decoder layers.
    pub num_layers: usize,
    /// Hidden width `H`.
    pub hidden_size: usize,
    /// Vocabulary size `V` (the length of the trainer's `t2d-N.npy`); 0 in
    /// manifests written before it was recorded.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub vocab_size: usize,
}

fn is_zero(n: &usize) -> bool {
    *n == 0
}

/// One captured layer of the `L` axis.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct CaptureInfo {
    /// The point as on the CLI (`input:2`, `final`, ...).
    pub point: String,
    /// Index into HF `output_hidden_states`; `null` for `final` (not in HF's tuple).
    pub hf_index: Option<usize>,
    /// The speculators trainer's layer id of the point (`input:k` is k,
    /// `final` is N); absent where it has none, and in older manifests.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub layer_id: Option<usize>,
}

/// How the states were computed: a resume must match all of it, since each
/// changes the last bits of the output.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RunInfo {
    /// `--backend`.
    pub backend: String,
    /// `--tp`.
    pub tp: usize,
    /// Compute dtype.
    pub compute: String,
    /// The GEMM kernel path (`avx512`, `avx2`, `portable`, `reference`, `cublas`).
    pub kernel: String,
    /// `--max-batch-tokens`, where the backend's output depends on it: on
    /// `cuda`, cuBLAS picks its GEMM kernels by the number of rows, so a
    /// resume must pack the same batches to reproduce the files. Absent on the
    /// CPU backends, whose output is bitwise the same for any budget.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_batch_tokens: Option<usize>,
}

/// The input data a dataset was made from.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct InputInfo {
    /// `--data` as given (`-` for stdin, `<embedded data>`).
    pub path: String,
    /// The whole input, once the run finished.
    #[serde(flatten)]
    pub whole: InputPos,
}

/// How `strata generate` chose its tokens: what a resume or another part
/// must repeat to draw the same ones (vLLM's sampling parameters, the seed).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct GenerationInfo {
    /// The seed every draw is keyed by (drawn once, and recorded, when not given).
    pub seed: u64,
    /// `temperature` (0: greedy).
    pub temperature: f32,
    /// `top_k` (0: off).
    pub top_k: usize,
    /// `top_p`.
    pub top_p: f32,
    /// `min_p`.
    pub min_p: f32,
    /// `repetition_penalty`.
    pub repetition_penalty: f32,
    /// `presence_penalty`.
    pub presence_penalty: f32,
    /// `frequency_penalty`.
    pub frequency_penalty: f32,
    /// `max_tokens`; `None`: each prompt up to the model's positions.
    pub max_tokens: Option<usize>,
    /// The ids that end a generation.
    pub stop_token_ids: Vec<u32>,
    /// `--ignore-eos`: EOS is an ordinary token.
    pub ignore_eos: bool,
    /// `--tool-call-parser` (vLLM's name), if given.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_call_parser: Option<String>,
    /// `--reasoning-parser` (vLLM's name), if given.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reasoning_parser: Option<String>,
    /// `--rows`: `per-turn` (a row per generation) or `auto` (a conversation's
    /// rows merged where one is a token prefix of the next).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub rows: String,
    /// `--no-states`: rows only, no hidden states.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub no_states: bool,
}

// The floats are checked sampling values, never NaN: equality is total.
impl Eq for GenerationInfo {}

/// How the input became token rows: what a resume must repeat to produce the same tokens.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PrepareInfo {
    /// `--input-format` as given (`auto`, `openai`, ...).
    pub input_format: String,
    /// The tokenizer file and `tokenizer_config.json` with their `xxh3:` digests, when a tokenizer was loaded.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tokenizer: Option<String>,
    /// The chat template's `xxh3:` digest, when the model has one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub chat_template: Option<String>,
    /// `--chat-template-kwargs`, as JSON.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub chat_template_kwargs: String,
    /// The date `strftime_now` renders (`YYYY-MM-DD`).
    pub chat_date: String,
    /// `--loss-mask`: `boundary` or `generation`.
    pub loss_mask: String,
    /// `--rows`: `auto`, `per-turn` or `per-conversation`.
    pub rows: String,
    /// `--max-seq-len` (absent: conversations are cut at the model's limit, other records must fit it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_seq_len: Option<usize>,
    /// `--skip-long`.
    #[serde(default)]
    pub skip_long: bool,
}

/// One part of a merged dataset.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct MergedPart {
    /// Its directory, inside the merged one.
    pub dir: String,
    /// Where it lies in the input.
    pub part: PartInfo,
    /// Its samples (rows), in the merged order from `first_sample` on.
    pub samples: usize,
    /// The merged index of its first sample.
    pub first_sample: usize,
}

/// One shard file.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShardInfo {
    /// Path inside the dataset directory (relative; subdirectories allowed).
    pub file: String,
    /// Samples in the shard.
    pub samples: usize,
    /// File size in bytes.
    pub bytes: u64,
    /// The input prefix consumed once this shard's samples were written: what
    /// a resume after this shard must find again. Absent in schema 1.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub input: Option<InputPos>,
}

/// A sample left out because its states held NaN or Inf (`--on-nonfinite skip`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SkippedInfo {
    /// 0-based index in the input.
    pub index: usize,
    /// The sample's id.
    pub id: String,
    /// Tokens.
    pub tokens: usize,
    /// Which capture point held what.
    pub reason: String,
}

/// One line of `journal.jsonl`: a finished file and the samples it holds.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct JournalEntry {
    /// Index of the shard in `shards` (replay is idempotent).
    pub index: usize,
    /// The shard.
    pub shard: ShardInfo,
    /// Its samples.
    pub samples: Vec<SampleInfo>,
    /// Samples skipped since the previous shard.
    #[serde(default)]
    pub skipped: Vec<SkippedInfo>,
}

/// One sample.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SampleInfo {
    /// The sample's id (tensor names are `{id}.hidden_states`, ...).
    pub id: String,
    /// Index into `shards`.
    pub shard: usize,
    /// Tokens `T`.
    pub tokens: usize,
    /// `xxh3:` hash of the sample's bytes as stored: `input_ids`, `loss_mask`, `hidden_states`.
    pub checksum: String,
    /// 0-based index in the input (absent in schema 1).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub index: Option<usize>,
    /// A `strata generate` row: why each of its generations ended, in order
    /// (one per span of loss-mask ones); empty for other rows.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub finish: Vec<FinishReason>,
}

pub use crate::pipeline::source::FinishReason;

/// One entry of a manifest's listing, as [`Manifest::read_each`] gives them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Entry {
    /// A shard (file).
    Shard(ShardInfo),
    /// A sample.
    Sample(SampleInfo),
    /// A sample left out.
    Skipped(SkippedInfo),
}

/// Reads a manifest object: its listing's elements one at a time into
/// `each`, every other field into a map (the job).
struct JobSeed<'a, E> {
    each: &'a mut dyn FnMut(Entry) -> Result<(), E>,
    failed: &'a mut Option<E>,
}

impl<'de, E> serde::de::DeserializeSeed<'de> for JobSeed<'_, E> {
    type Value = serde_json::Map<String, serde_json::Value>;

    fn deserialize<D: serde::Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        d.deserialize_map(self)
    }
}

impl<'de, E> serde::de::Visitor<'de> for JobSeed<'_, E> {
    type Value = serde_json::Map<String, serde_json::Value>;

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("a manifest object")
    }

    fn visit_map<A: serde::de::MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        let mut job = serde_json::Map::new();
        let mut shards = 0usize;
        while let Some(key) = map.next_key::<String>()? {
            let kind = match key.as_str() {
                "shards" => 0,
                "samples" => 1,
                "skipped" => 2,
                _ => {
                    job.insert(key, map.next_value()?);
                    continue;
                }
            };
            let seq = ListSeed { kind, each: &mut *self.each, failed: &mut *self.failed, count: 0 };
            let n = map.next_value_seed(seq)?;
            if kind == 0 {
                shards = n;
            }
        }
        // How many shards the manifest listed (the journal's lines below that number are old).
        job.insert(COUNTED.into(), shards.into());
        Ok(job)
    }
}

/// The key under which [`JobSeed`] returns the manifest's shard count with the job.
const COUNTED: &str = "counted_shards";

/// Reads one listing array, element by element.
struct ListSeed<'a, E> {
    kind: u8,
    each: &'a mut dyn FnMut(Entry) -> Result<(), E>,
    failed: &'a mut Option<E>,
    count: usize,
}

impl<'de, E> serde::de::DeserializeSeed<'de> for ListSeed<'_, E> {
    type Value = usize;

    fn deserialize<D: serde::Deserializer<'de>>(self, d: D) -> Result<usize, D::Error> {
        d.deserialize_seq(self)
    }
}

impl<'de, E> serde::de::Visitor<'de> for ListSeed<'_, E> {
    type Value = usize;

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("a list")
    }

    fn visit_seq<A: serde::de::SeqAccess<'de>>(mut self, mut seq: A) -> Result<usize, A::Error> {
        use serde::de::Error;
        loop {
            let entry = match self.kind {
                0 => seq.next_element::<ShardInfo>()?.map(Entry::Shard),
                1 => seq.next_element::<SampleInfo>()?.map(Entry::Sample),
                _ => seq.next_element::<SkippedInfo>()?.map(Entry::Skipped),
            };
            let Some(entry) = entry else { return Ok(self.count) };
            self.count += 1;
            if let Err(e) = (self.each)(entry) {
                *self.failed = Some(e);
                return Err(A::Error::custom("the reader stopped"));
            }
        }
    }
}

/// The manifest.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Manifest {
    /// [`SCHEMA_VERSION`].
    pub schema_version: u32,
    /// Strata's version that wrote the dataset.
    pub strata_version: String,
    /// `"strata"` (shards) or `"speculators"` (one `hs_{i}.safetensors` per sample).
    pub format: String,
    /// Axis order of `hidden_states`: `"LTH"` (strata) or `"TLH"` (speculators).
    pub layout: String,
    /// The model.
    pub model: ModelInfo,
    /// How the states were computed (absent in schema 1).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub run: Option<RunInfo>,
    /// The input, once the run finished (absent in schema 1).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub input: Option<InputInfo>,
    /// How the input became token rows (absent before schema 3's conversations).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prepare: Option<PrepareInfo>,
    /// How a generated dataset's tokens were drawn (`strata generate`); `None` for extraction.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub generation: Option<GenerationInfo>,
    /// The part of the input this output holds, when the input was split
    /// across processes (`--part-index/--num-parts` or a launcher's environment).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub part: Option<PartInfo>,
    /// A merged dataset (`strata merge`): its parts' directories, in order.
    /// Its shards lie in them; nothing was copied.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub merged: Vec<MergedPart>,
    /// `--on-nonfinite`: `fail` or `skip`.
    #[serde(default = "default_on_nonfinite")]
    pub on_nonfinite: String,
    /// Nonce of the run writing the directory: its temporary files carry it.
    /// Empty once the run finished.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub nonce: String,
    /// The `L` axis, in order.
    pub capture: Vec<CaptureInfo>,
    /// Storage dtype of `hidden_states`: `f32`, `bf16` or `f16`.
    pub dtype: String,
    /// Target shard size in bytes.
    pub shard_size: u64,
    /// `--draft-vocab-size` (speculators format): the sizes whose
    /// `d2t-N.npy`/`t2d-N.npy` (and `token_freq.pt`) the run writes when it
    /// finishes. Not part of the job: a resume may change them.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub draft_vocab_sizes: Vec<usize>,
    /// False while a run is writing (or was interrupted); true once it finished.
    pub complete: bool,
    /// Shard files, in order.
    pub shards: Vec<ShardInfo>,
    /// Samples, in input order.
    pub samples: Vec<SampleInfo>,
    /// Samples left out for non-finite states (`--on-nonfinite skip`).
    #[serde(default)]
    pub skipped: Vec<SkippedInfo>,
}

fn default_on_nonfinite() -> String {
    "fail".into()
}

impl ModelInfo {
    /// Describes a model from its `config.json` text and where it was loaded from.
    pub fn new(path: &str, config: &crate::hf::ArchInfo, config_json: &str) -> Self {
        ModelInfo {
            path: path.to_string(),
            architecture: config.architecture.clone(),
            config_hash: hash_hex(xxhash_rust::xxh3::xxh3_64(config_json.as_bytes())),
            weights_digest: String::new(),
            num_layers: config.num_layers,
            hidden_size: config.hidden_size,
            vocab_size: config.vocab_size,
        }
    }
}

impl Manifest {
    /// The manifest of a new run: no shards or samples yet.
    pub fn new(model: ModelInfo, points: &[CapturePoint], dtype: DType, shard_size: u64) -> Self {
        let capture = points
            .iter()
            .map(|p| CaptureInfo {
                point: p.to_string(),
                hf_index: p.hf_index(model.num_layers),
                layer_id: p.speculators_id(model.num_layers),
            })
            .collect();
        Manifest {
            schema_version: SCHEMA_VERSION,
            strata_version: env!("CARGO_PKG_VERSION").to_string(),
            format: "strata".into(),
            layout: "LTH".into(),
            model,
            run: None,
            input: None,
            prepare: None,
            generation: None,
            part: None,
            merged: vec![],
            on_nonfinite: default_on_nonfinite(),
            nonce: String::new(),
            capture,
            dtype: dtype.to_string(),
            shard_size,
            draft_vocab_sizes: vec![],
            complete: false,
            shards: vec![],
            samples: vec![],
            skipped: vec![],
        }
    }

    /// A copy of what says what the run writes, without its listing
    /// (shards, samples, skipped, merged parts), which may be large.
    pub fn clone_job(&self) -> Manifest {
        // Named field by field, without `..`: a new field must be placed here.
        let Manifest {
            schema_version,
            strata_version,
            format,
            layout,
            model,
            run,
            input,
            prepare,
            generation,
            part,
            merged: _,
            on_nonfinite,
            nonce,
            capture,
            dtype,
            shard_size,
            draft_vocab_sizes,
            complete,
            shards: _,
            samples: _,
            skipped: _,
        } = self;
        Manifest {
            schema_version: *schema_version,
            strata_version: strata_version.clone(),
            format: format.clone(),
            layout: layout.clone(),
            model: model.clone(),
            run: run.clone(),
            input: input.clone(),
            prepare: prepare.clone(),
            generation: generation.clone(),
            part: part.clone(),
            merged: vec![],
            on_nonfinite: on_nonfinite.clone(),
            nonce: nonce.clone(),
            capture: capture.clone(),
            dtype: dtype.clone(),
            shard_size: *shard_size,
            draft_vocab_sizes: draft_vocab_sizes.clone(),
            complete: *complete,
            shards: vec![],
            samples: vec![],
            skipped: vec![],
        }
    }

    /// The speculators trainer's `--target-layer-ids` for this capture: the
    /// layer ids of every point before the last, which must be `final` (the
    /// trainer reads the last slot of `[T, L, H]` as the final layer's
    /// state), or why the trainer cannot read this capture.
    pub fn target_layer_ids(&self) -> Result<Vec<usize>, TrainerIdsError> {
        let Some((last, aux)) = self.capture.split_last() else { return Err(TrainerIdsError::Nothing) };
        if last.point != "final" {
            return Err(TrainerIdsError::NotFinal { last: last.point.clone() });
        }
        let mut ids = Vec::with_capacity(aux.len());
        for c in aux {
            match c.layer_id {
                Some(id) if !ids.contains(&id) => ids.push(id),
                Some(id) => return Err(TrainerIdsError::Twice(id)),
                None if self.capture.iter().all(|c| c.layer_id.is_none()) => return Err(TrainerIdsError::NoIds),
                None => return Err(TrainerIdsError::NoId { point: c.point.clone() }),
            }
        }
        Ok(ids)
    }

    /// Input samples (written or skipped) the listed shards account for: a resume skips them.
    pub fn consumed(&self) -> usize {
        match (&self.input, self.complete) {
            (Some(i), true) => i.whole.samples,
            _ => self.shards.last().and_then(|s| s.input.as_ref()).map_or(self.samples.len(), |p| p.samples),
        }
    }

    /// Applies one line of `journal`; a line for a shard already listed is
    /// ignored (the manifest was compacted after it was journaled).
    pub fn apply(&mut self, e: JournalEntry, journal: &Path) -> Result<(), ManifestError> {
        match e.index.cmp(&self.shards.len()) {
            std::cmp::Ordering::Less => Ok(()),
            std::cmp::Ordering::Equal => {
                self.shards.push(e.shard);
                self.samples.extend(e.samples);
                self.skipped.extend(e.skipped);
                Ok(())
            }
            std::cmp::Ordering::Greater => Err(ManifestError::JournalGap {
                path: journal.display().to_string(),
                index: e.index,
                listed: self.shards.len(),
            }),
        }
    }

    /// Reads `DIR/manifest.json` (schema 1 to 3) and replays `DIR/journal.jsonl`.
    pub fn read(dir: &Path) -> Result<Self, ManifestError> {
        let path = dir.join(MANIFEST);
        let text = crate::files::read_text(&path, MAX_MANIFEST_BYTES).map_err(io(&path))?;
        let journal = dir.join(JOURNAL);
        let journal = match crate::files::is_regular(&journal) {
            Ok(true) => Some(crate::files::read_text(&journal, MAX_MANIFEST_BYTES).map_err(io(&journal))?),
            Ok(false) => None,
            Err(e) => return Err(io(&journal)(e)),
        };
        Self::parse(&text, journal.as_deref(), dir)
    }

    /// [`Manifest::read`] through a directory handle: the manifest and the
    /// journal are opened in it without following links.
    pub fn read_in(dir: &crate::files::Dir) -> Result<Self, ManifestError> {
        let read = |name: &str| dir.read_text(name, MAX_MANIFEST_BYTES).map_err(io(&dir.join(name)));
        let text = read(MANIFEST)?;
        let journal = match dir.kind(JOURNAL).map_err(io(&dir.join(JOURNAL)))? {
            None => None,
            Some(_) => Some(read(JOURNAL)?),
        };
        Self::parse(&text, journal.as_deref(), dir.path())
    }

    /// Reads `manifest.json` and its journal in `dir` without holding the
    /// listing: returns the job (its `shards`, `samples` and `skipped`
    /// empty) and gives every listed entry to `each`, in order: the
    /// manifest's shards, samples and skipped, then each journal line's.
    /// A million samples' manifest is read in the memory of one entry.
    pub fn read_each<E>(
        dir: &crate::files::Dir,
        each: &mut dyn FnMut(Entry) -> Result<(), E>,
    ) -> Result<Self, ReadEachError<E>> {
        let path = dir.join(MANIFEST);
        let f = dir.open_file(MANIFEST).map_err(io(&path))?;
        let journal = dir.join(JOURNAL);
        let journal = match dir.kind(JOURNAL).map_err(io(&journal))? {
            None => None,
            Some(_) => Some(dir.open_file(JOURNAL).map_err(io(&journal))?),
        };
        Self::read_each_from(f, journal, dir.path(), each)
    }

    /// [`Manifest::read_each`] of a manifest and a journal already open (in
    /// `dir`, for messages): their names may be gone by now.
    pub fn read_each_from<E>(
        f: std::fs::File,
        journal_file: Option<std::fs::File>,
        dir: &Path,
        each: &mut dyn FnMut(Entry) -> Result<(), E>,
    ) -> Result<Self, ReadEachError<E>> {
        let path = dir.join(MANIFEST);
        let len = f.metadata().map_err(io(&path))?.len();
        if len > MAX_MANIFEST_BYTES {
            return Err(ManifestError::TooLarge { path: path.display().to_string(), len }.into());
        }
        let mut de = serde_json::Deserializer::from_reader(std::io::BufReader::with_capacity(1 << 20, f));
        let mut failed = None;
        let job = serde::de::DeserializeSeed::deserialize(JobSeed { each, failed: &mut failed }, &mut de)
            .and_then(|job| de.end().map(|()| job));
        let mut job = match (job, failed) {
            (_, Some(e)) => return Err(ReadEachError::Each(e)),
            (Err(e), None) => return Err(malformed(&path)(e).into()),
            (Ok(job), None) => job,
        };
        let counted = job.remove(COUNTED).and_then(|v| v.as_u64()).unwrap_or(0) as usize;
        let version = job.get("schema_version").map(|v| v.to_string());
        if !matches!(version.as_deref(), Some("1" | "2" | "3")) {
            let version = version.as_deref().map_or("(none)".to_string(), |v| crate::clip(v, 40).to_string());
            return Err(ManifestError::Version { path: path.display().to_string(), version }.into());
        }
        let mut job = serde_json::Value::Object(job);
        for k in ["shards", "samples", "skipped"] {
            job[k] = serde_json::Value::Array(vec![]);
        }
        let m: Manifest = serde_json::from_value(job).map_err(malformed(&path))?;
        // The journal: each line's entries past those the manifest lists (one line at a time).
        let journal = dir.join(JOURNAL);
        if let Some(f) = journal_file {
            use std::io::BufRead;
            let mut lines = std::io::BufReader::with_capacity(1 << 20, f).split(b'\n').enumerate().peekable();
            let mut listed = counted;
            while let Some((i, line)) = lines.next() {
                let line = line.map_err(io(&journal))?;
                let e = match serde_json::from_slice::<JournalEntry>(&line) {
                    Ok(e) => e,
                    // A torn last line was never made durable: the file it names is redone.
                    Err(_) if lines.peek().is_none() => break,
                    Err(_) => {
                        return Err(
                            ManifestError::JournalLine { path: journal.display().to_string(), line: i + 1 }.into()
                        )
                    }
                };
                match e.index.cmp(&listed) {
                    std::cmp::Ordering::Less => continue,
                    std::cmp::Ordering::Greater => {
                        let path = journal.display().to_string();
                        return Err(ManifestError::JournalGap { path, index: e.index, listed }.into());
                    }
                    std::cmp::Ordering::Equal => listed += 1,
                }
                each(Entry::Shard(e.shard)).map_err(ReadEachError::Each)?;
                e.samples.into_iter().try_for_each(|x| each(Entry::Sample(x))).map_err(ReadEachError::Each)?;
                e.skipped.into_iter().try_for_each(|x| each(Entry::Skipped(x))).map_err(ReadEachError::Each)?;
            }
        }
        Ok(m)
    }

    /// A manifest's text and its journal's, in `dir` (for messages).
    fn parse(text: &str, journal_text: Option<&str>, dir: &Path) -> Result<Self, ManifestError> {
        let path = dir.join(MANIFEST);
        // The version first, without building the document: then the manifest itself.
        #[derive(Deserialize)]
        struct Version<'a> {
            #[serde(borrow)]
            schema_version: Option<&'a serde_json::value::RawValue>,
        }
        let v: Version = serde_json::from_str(text).map_err(malformed(&path))?;
        let version = v.schema_version.map(|r| r.get().trim());
        if !matches!(version, Some("1" | "2" | "3")) {
            let version = version.map_or("(none)".into(), |v| crate::clip(v, 40)).into_owned();
            return Err(ManifestError::Version { path: path.display().to_string(), version });
        }
        let mut m: Manifest = serde_json::from_str(text).map_err(malformed(&path))?;
        let journal = dir.join(JOURNAL);
        if let Some(text) = journal_text {
            let mut lines = text.split_inclusive('\n').enumerate().peekable();
            while let Some((i, line)) = lines.next() {
                let last = lines.peek().is_none();
                match serde_json::from_str::<JournalEntry>(line) {
                    Ok(e) if line.ends_with('\n') => m.apply(e, &journal)?,
                    // A torn last line was never made durable: the file it names is redone.
                    _ if last => {}
                    Ok(_) | Err(_) => {
                        return Err(ManifestError::JournalLine { path: journal.display().to_string(), line: i + 1 })
                    }
                }
            }
        }
        Ok(m)
    }

    /// The fields that say what a run writes (everything but progress): the
    /// first that differs, with both values and how to make it agree.
    pub fn same_job(&self, other: &Manifest) -> Result<(), JobDiff> {
        let run = |m: &Manifest| {
            m.run.as_ref().map_or(String::new(), |r| {
                let budget = r.max_batch_tokens.map_or(String::new(), |n| format!(", --max-batch-tokens {n}"));
                format!("backend {}, --tp {}, compute {}, kernel {}{budget}", r.backend, r.tp, r.compute, r.kernel)
            })
        };
        let part = |m: &Manifest| m.part.as_ref().map_or("the whole input".into(), PartInfo::key);
        let capture = |m: &Manifest| m.capture.iter().map(|c| c.point.as_str()).collect::<Vec<_>>().join(",");
        let model = format!("--model {}", self.model.path);
        let mut pairs: Vec<(&str, String, String, String)> = vec![
            ("format", self.format.clone(), other.format.clone(), format!("--format {}", self.format)),
            (
                "strata_version",
                self.strata_version.clone(),
                other.strata_version.clone(),
                format!("strata {} (the version that wrote it)", self.strata_version),
            ),
            ("model.config_hash", self.model.config_hash.clone(), other.model.config_hash.clone(), model.clone()),
            (
                "model.weights_digest",
                self.model.weights_digest.clone(),
                other.model.weights_digest.clone(),
                format!("{model} with the weights it had"),
            ),
            (
                "run",
                run(self),
                run(other),
                "the same --backend, --tp and --compute, on a machine with the same kernel path \
                 (STRATA_BF16_KERNEL picks a slower one the CPU also has)"
                    .into(),
            ),
            (
                "on_nonfinite",
                self.on_nonfinite.clone(),
                other.on_nonfinite.clone(),
                format!("--on-nonfinite {}", self.on_nonfinite),
            ),
            ("capture", capture(self), capture(other), format!("--capture {}", capture(self))),
            ("dtype", self.dtype.clone(), other.dtype.clone(), format!("--dtype {}", self.dtype)),
            (
                "shard_size",
                self.shard_size.to_string(),
                other.shard_size.to_string(),
                format!("--shard-size {}", self.shard_size),
            ),
            ("layout", self.layout.clone(), other.layout.clone(), format!("--format {}", self.format)),
        ];
        let none = PrepareInfo::default();
        let (a, b) = (self.prepare.as_ref(), other.prepare.as_ref());
        if a.is_some() != b.is_some() {
            let show = |p: Option<&PrepareInfo>| p.map_or(String::new(), |p| format!("{p:?}"));
            pairs.push(("prepare", show(a), show(b), "the strata version that wrote it".into()));
        } else {
            pairs.extend(prepare_pairs(a.unwrap_or(&none), b.unwrap_or(&none)));
        }
        let generation = |m: &Manifest| m.generation.as_ref().map_or(String::new(), |g| format!("{g:?}"));
        pairs.push((
            "generation",
            generation(self),
            generation(other),
            "the same sampling options, --max-tokens, stop ids and --seed (a run without --seed records the seed it drew)"
                .into(),
        ));
        pairs.push((
            "part",
            part(self),
            part(other),
            "the same input file and --part-index/--num-parts (or launcher)".into(),
        ));
        for (field, a, b, remedy) in pairs {
            if a != b {
                return Err(JobDiff { field: field.to_string(), existing: a, this: b, remedy });
            }
        }
        Ok(())
    }
}

/// The fields of [`PrepareInfo`], each with the option that sets it.
fn prepare_pairs(a: &PrepareInfo, b: &PrepareInfo) -> Vec<(&'static str, String, String, String)> {
    let opt = |v: &Option<String>| v.clone().unwrap_or_default();
    let flag = |name: &str, v: &str| if v.is_empty() { format!("no {name}") } else { format!("{name} {v}") };
    let len = |n: Option<usize>| n.map_or(String::new(), |n| n.to_string());
    vec![
        (
            "prepare.input_format",
            a.input_format.clone(),
            b.input_format.clone(),
            flag("--input-format", &a.input_format),
        ),
        (
            "prepare.tokenizer",
            opt(&a.tokenizer),
            opt(&b.tokenizer),
            "the model's tokenizer files as they were (tokenizer.json or tiktoken.model, tokenizer_config.json)".into(),
        ),
        (
            "prepare.chat_template",
            opt(&a.chat_template),
            opt(&b.chat_template),
            "the chat template the run rendered with (its digest is recorded; --chat-template FILE)".into(),
        ),
        (
            "prepare.chat_template_kwargs",
            a.chat_template_kwargs.clone(),
            b.chat_template_kwargs.clone(),
            flag("--chat-template-kwargs", &a.chat_template_kwargs),
        ),
        ("prepare.chat_date", a.chat_date.clone(), b.chat_date.clone(), flag("--chat-date", &a.chat_date)),
        ("prepare.loss_mask", a.loss_mask.clone(), b.loss_mask.clone(), flag("--loss-mask", &a.loss_mask)),
        ("prepare.rows", a.rows.clone(), b.rows.clone(), flag("--rows", &a.rows)),
        ("prepare.max_seq_len", len(a.max_seq_len), len(b.max_seq_len), flag("--max-seq-len", &len(a.max_seq_len))),
        (
            "prepare.skip_long",
            a.skip_long.to_string(),
            b.skip_long.to_string(),
            if a.skip_long { "--skip-long".into() } else { "no --skip-long".into() },
        ),
    ]
}

/// The first field in which two runs' manifests differ.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct JobDiff {
    /// The manifest field (`dtype`, `prepare.chat_date`, ...).
    pub field: String,
    /// Its value in the existing output.
    pub existing: String,
    /// Its value for this run.
    pub this: String,
    /// What makes this run agree with the existing one (the option and its value).
    pub remedy: String,
}

impl JobDiff {
    /// "FIELD differs: A has X, B has Y", naming the two sides.
    pub fn between(&self, a: &str, b: &str) -> String {
        let show = |v: &str| if v.is_empty() { "(not recorded)".to_string() } else { crate::clip(v, 300).into_owned() };
        format!("{} differs: {a} has {}, {b} has {}", self.field, show(&self.existing), show(&self.this))
    }
}

impl std::fmt::Display for JobDiff {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.between("the existing output", "this run"))
    }
}

/// `xxh3:` + 16 hex digits.
pub fn hash_hex(h: u64) -> String {
    format!("xxh3:{h:016x}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_resume_must_pack_the_batches_a_gpu_run_recorded() {
        let arch = crate::hf::ArchInfo {
            architecture: "llama".into(),
            num_layers: 4,
            hidden_size: 8,
            vocab_size: 16,
            max_position_embeddings: 64,
            max_position_default: false,
            recurrent: false,
        };
        let job = |budget: Option<usize>| {
            let mut m = Manifest::new(ModelInfo::new("m", &arch, "{}"), &[CapturePoint::FinalPreNorm], DType::BF16, 1);
            let kernel = if budget.is_some() { "cublas" } else { "avx512" };
            let backend = if budget.is_some() { "cuda" } else { "cpu" };
            m.run = Some(RunInfo {
                backend: backend.into(),
                tp: 1,
                compute: "bf16".into(),
                kernel: kernel.into(),
                max_batch_tokens: budget,
            });
            m
        };
        assert_eq!(job(Some(8192)).same_job(&job(Some(8192))), Ok(()));
        let e = job(Some(8192)).same_job(&job(Some(4096))).unwrap_err().to_string();
        assert!(e.contains("run differs") && e.contains("--max-batch-tokens 8192"), "{e}");
        assert!(e.contains("--max-batch-tokens 4096"), "{e}");
        // CPU runs do not record it (their output does not depend on it).
        assert_eq!(job(None).same_job(&job(None)), Ok(()));
        let text = serde_json::to_string(&job(None)).unwrap();
        assert!(!text.contains("max_batch_tokens"), "{text}");
        let back: Manifest = serde_json::from_str(&serde_json::to_string(&job(Some(512))).unwrap()).unwrap();
        assert_eq!(back.run.unwrap().max_batch_tokens, Some(512));
    }
}
