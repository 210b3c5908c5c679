//! Jobs: the stages composed into what the CLI runs. `extract` streams an
//! input through the model into files, `serve` answers requests with the
//! same files, and `verify --recompute` runs a dataset's model again. What
//! they share lives here, once:
//!
//! - [`ModelSource`] + [`ModelRequest::open`]: a model opened once, with
//!   `--compute auto` resolved in one place ([`resolve_compute`]);
//! - [`layout`]: the capture set and the manifest an output is described by;
//! - [`Pipeline`] (the builder): `Source → Schedule → Model → Capture →
//!   Gather → Sink`, generic over each stage;
//! - [`recompute`]: a dataset's samples through the model again, compared
//!   with the stored states (`strata verify --recompute`).
//!
//! This folder sits above `pipeline/`, `model/` and `sink/`: it imports them,
//! and none of them imports it.

pub mod builder;
pub mod extract;
pub mod generate;
pub mod launch;
pub mod recompute;
pub mod verify;

pub use builder::{Pipeline, PipelineError, Progress, Report};

use crate::backend::Compute;
use crate::format::manifest::{Manifest, ModelInfo, RunInfo};
use crate::hf::checkpoint::{Checkpoint, CheckpointError};
use crate::hf::ArchInfo;
use crate::model::{AnyConfig, AnyModel, BackendKind, ComputeChoice, LoadOptions, Model, ModelError, OptionsError};
use crate::pipeline::capture::{CaptureError, CapturePoint, CaptureSet};
use crate::shape::DType;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Where a model's config and weights come from.
#[derive(Clone, Debug)]
pub enum ModelSource {
    /// A Hugging Face checkpoint directory (`config.json` + safetensors).
    Dir(PathBuf),
    /// A hub id (`org/name`) found in the local Hugging Face cache: named by
    /// the id as given, read from its snapshot directory.
    Hub {
        /// The id as given.
        id: String,
        /// `snapshots/<commit>/` of the revision asked for.
        snapshot: PathBuf,
    },
    /// A model compiled into the program (a demo, a test): its name in
    /// messages and manifests, its `config.json` text and its one safetensors file.
    Static {
        /// How messages and manifests name it.
        name: &'static str,
        /// `config.json`.
        config_json: &'static str,
        /// `model.safetensors`.
        weights: &'static [u8],
    },
}

impl ModelSource {
    /// `--model` as given, with `--revision`: a directory, or a hub id found
    /// in the local Hugging Face cache (see [`crate::hf::hub`]); with a note
    /// when a directory of an id's name wins over the cached id.
    pub fn locate(model: &str, revision: Option<&str>) -> Result<(Self, Option<String>), crate::hf::hub::HubError> {
        use crate::hf::hub::{locate, HubEnv, Located};
        let (found, note) = locate(model, revision, &HubEnv::from_process())?;
        let source = match found {
            Located::Dir(d) => ModelSource::Dir(d),
            Located::Hub { id, revision, commit, snapshot } => {
                tracing::info!(
                    "--model {id}: revision {revision} is commit {commit}, read from {}",
                    snapshot.display()
                );
                ModelSource::Hub { id, snapshot }
            }
        };
        Ok((source, note))
    }

    /// How messages and the manifest name the model: the directory or hub id as given, or the static name.
    pub fn name(&self) -> String {
        match self {
            ModelSource::Dir(d) => d.display().to_string(),
            ModelSource::Hub { id, .. } => id.clone(),
            ModelSource::Static { name, .. } => name.to_string(),
        }
    }

    /// The checkpoint directory, when there is one (tokenizer, chat template).
    pub fn dir(&self) -> Option<&std::path::Path> {
        match self {
            ModelSource::Dir(d) | ModelSource::Hub { snapshot: d, .. } => Some(d),
            ModelSource::Static { .. } => None,
        }
    }

    /// The text of `config.json` (a regular file of bounded size).
    pub fn config_text(&self) -> Result<String, ModelError> {
        match self {
            ModelSource::Dir(d) | ModelSource::Hub { snapshot: d, .. } => Ok(AnyConfig::read_text(d)?),
            ModelSource::Static { config_json, .. } => Ok(config_json.to_string()),
        }
    }

    /// Opens the weights under `prefix` (the text model's tensors); called once per rank.
    pub fn opener(
        &self,
        prefix: &str,
    ) -> impl Fn() -> Result<Checkpoint, CheckpointError> + Send + Sync + Clone + 'static {
        let source = self.clone();
        let prefix = prefix.to_string();
        move || match &source {
            ModelSource::Dir(d) | ModelSource::Hub { snapshot: d, .. } => Checkpoint::open_scoped(d, &prefix),
            ModelSource::Static { name, weights, .. } => Checkpoint::from_static(name, weights),
        }
    }
}

/// `--compute auto` and its kin, decided here and nowhere else (extract,
/// serve and verify's recompute all open models through [`ModelRequest`]):
/// bf16 when the device has bf16 arithmetic and the weights carry no more
/// than bf16's bits (stored in bf16, or quantised: FP8 blocks, INT4 groups),
/// f32 otherwise. `weights` is the model's config and checkpoint; without
/// them (a check before any weight is read) `auto` is f32, which every
/// backend takes. A fixed choice is returned as is.
pub fn resolve_compute(
    choice: ComputeChoice,
    backend: BackendKind,
    weights: Option<(&AnyConfig, &Checkpoint)>,
) -> Compute {
    if let ComputeChoice::Fixed(c) = choice {
        return c;
    }
    let native = backend.native_bf16();
    // The embedding table's dtype is the checkpoint's (`ckpt` is scoped to the text model).
    let low_precision = weights.is_some_and(|(config, ckpt)| {
        config.quantization().is_some() || ckpt.dtype("model.embed_tokens.weight") == Some(DType::BF16)
    });
    if native && low_precision {
        Compute::Bf16
    } else {
        Compute::F32
    }
}

/// What to open a model with: where it is, on which backend, in which
/// compute dtype, over how many ranks and devices.
#[derive(Clone, Debug)]
pub struct ModelRequest {
    /// The config and weights.
    pub source: ModelSource,
    /// The backend.
    pub backend: BackendKind,
    /// `--compute`.
    pub compute: ComputeChoice,
    /// Tensor-parallel ranks.
    pub tp: usize,
    /// GPU indices, one per rank (`--devices`); empty: the first `tp`.
    pub devices: Vec<usize>,
    /// Load the LM head too (generation).
    pub lm_head: bool,
}

/// A model's config, read and checked against the request, before any weight is read.
#[derive(Clone, Debug)]
pub struct CheckedConfig {
    /// `config.json` as read (its hash goes into the manifest).
    pub text: String,
    /// Parsed.
    pub config: AnyConfig,
}

impl CheckedConfig {
    /// The outer shape.
    pub fn info(&self) -> ArchInfo {
        self.config.info()
    }
}

/// A model opened once: the weights loaded, and what the manifest records of them.
pub struct OpenedModel {
    /// The loaded model.
    pub model: AnyModel,
    /// `config.json` as read.
    pub config_text: String,
    /// Parsed.
    pub config: AnyConfig,
    /// How messages and manifests name the model.
    pub name: String,
    /// The weights' digest (file names, sizes and headers).
    pub weights_digest: String,
    /// How the checkpoint stores its weights (quantisation scheme, else the dtype).
    pub storage: String,
    /// Time to load.
    pub load_time: Duration,
    /// The request it was opened with (`compute` as asked, before resolving).
    pub request: ModelRequest,
}

impl ModelRequest {
    /// Reads `config.json` and checks the request against it (ranks, devices,
    /// backend) and the environment (`STRATA_BF16_KERNEL`): cheap, so a job
    /// checks this before reading its input.
    pub fn check(&self) -> Result<CheckedConfig, ModelError> {
        // Whatever the backend: a misspelt kernel fails here, not as a warning when a bf16 run falls back.
        crate::backend::cpu::bf16::kernel_override().map_err(OptionsError::from)?;
        let text = self.source.config_text()?;
        let config = AnyConfig::parse(&text)?;
        // The dtype `auto` resolves to is not known before the weights are
        // opened; f32 is what every backend takes, so it checks the rest.
        config.check(&self.load_options(resolve_compute(self.compute, self.backend, None)))?;
        Ok(CheckedConfig { text, config })
    }

    fn load_options(&self, compute: Compute) -> LoadOptions {
        LoadOptions {
            backend: self.backend,
            compute,
            tp: self.tp,
            devices: self.devices.clone(),
            lm_head: self.lm_head,
        }
    }

    /// Loads the weights: the compute dtype resolved from the checkpoint
    /// ([`resolve_compute`]), each rank opening its own view of the files.
    pub fn open(&self, checked: CheckedConfig) -> Result<OpenedModel, ModelError> {
        let _span = tracing::info_span!("open_model", model = %self.source.name()).entered();
        let t = Instant::now();
        let CheckedConfig { text, config } = checked;
        let open = self.source.opener(&config.tensor_prefix());
        let ckpt = open()?;
        let weights_digest = ckpt.digest();
        let compute = resolve_compute(self.compute, self.backend, Some((&config, &ckpt)));
        drop(ckpt);
        let quantization = config.quantization();
        let model = config.clone().load(self.load_options(compute), open)?;
        let storage = quantization.unwrap_or_else(|| model.dtype().to_string());
        Ok(OpenedModel {
            model,
            config_text: text,
            config,
            name: self.source.name(),
            weights_digest,
            storage,
            load_time: t.elapsed(),
            request: self.clone(),
        })
    }
}

impl OpenedModel {
    /// The outer shape.
    pub fn info(&self) -> &ArchInfo {
        self.model.info()
    }

    /// The kernel path its GEMMs take (recorded: a resume must not mix them).
    pub fn kernel(&self) -> &'static str {
        self.model.kernel()
    }
}

/// The capture points of a `--capture` list, and the set the model fills.
pub fn captures(list: &str, num_layers: usize) -> Result<(Vec<CapturePoint>, CaptureSet<usize>), CaptureError> {
    let points = CapturePoint::parse_list(list, num_layers)?;
    let set = CaptureSet::<usize>::try_new(points.clone())?;
    Ok((points, set))
}

/// The manifest an output of `model`'s states at `points`, stored as
/// `dtype`, starts from: the model (path, config hash, weights digest), the
/// capture points, the storage dtype, and how the states were computed.
/// `max_batch_tokens` is recorded only where the states depend on it (a GPU's GEMMs).
pub fn layout(
    model: &OpenedModel,
    points: &[CapturePoint],
    dtype: DType,
    shard_size: u64,
    max_batch_tokens: usize,
) -> Manifest {
    let info = model.info();
    let mut job = Manifest::new(ModelInfo::new(&model.name, info, &model.config_text), points, dtype, shard_size);
    job.model.weights_digest = model.weights_digest.clone();
    let backend = model.request.backend;
    job.run = Some(RunInfo {
        backend: backend.name().into(),
        tp: model.request.tp,
        compute: model.model.compute().to_string(),
        kernel: model.kernel().into(),
        max_batch_tokens: (backend == BackendKind::Cuda).then_some(max_batch_tokens),
    });
    job
}

/// The layer ids the speculators trainer's `--target-layer-ids` must name
/// for `points`, in order: `input:K` (the residual entering layer K, HF's
/// `hidden_states[K]`) is id K, and `final` (the last layer's pre-norm
/// output) is id N. `None` for a point the trainer has no id for.
pub fn speculators_layer_ids(points: &[CapturePoint], num_layers: usize) -> Vec<Option<usize>> {
    points.iter().map(|p| p.speculators_id(num_layers)).collect()
}

/// A shared handle on an opened model: the server's scheduler and its
/// status pages hold it together.
pub type SharedModel = Arc<OpenedModel>;
