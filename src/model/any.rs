//! The registry: the one place that names every architecture family and
//! every backend together. It parses a `config.json` of any family
//! ([`AnyConfig`]), loads it on the backend and over the ranks asked for, and
//! hands back one [`AnyModel`] the pipeline can run. Adding a family or a
//! backend adds a case here; the model files do not change.

use super::decoder::{Block, Frame};
use super::{Decoder, Model, ModelError, Sampled, TpModel};
use crate::backend::{Backend, Bf16, Compute, Cpu, DeviceOps, Reference, F32};
use crate::hf::checkpoint::{Checkpoint, CheckpointError};
use crate::hf::{ArchInfo, ConfigError};
use crate::pipeline::batch::PackedBatch;
use crate::pipeline::capture::CaptureSet;
use crate::shape::{CapturedStates, DType, Dim};
use std::any::Any;
use std::path::Path;

/// Which backend `--backend` names.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[cfg_attr(feature = "cli", derive(clap::ValueEnum))]
pub enum BackendKind {
    /// [`Cpu`]: the fast host backend.
    #[cfg_attr(feature = "cli", value(help = "The fast CPU backend (packed GEMMs, threads, tensor parallelism)"))]
    #[default]
    Cpu,
    /// [`Reference`]: plain loops in f64, one rank; the oracle.
    #[cfg_attr(feature = "cli", value(help = "Plain loops with f64 accumulation, one thread, --tp 1: the oracle"))]
    Reference,
    /// NVIDIA GPUs (`--features cuda`), one rank per device.
    #[cfg_attr(
        feature = "cli",
        value(
            help = "NVIDIA GPUs, one rank per GPU (--devices, --tp); needs a build with `--features cuda` and a CUDA driver"
        )
    )]
    Cuda,
}

impl BackendKind {
    /// The name `--backend` takes.
    pub fn name(self) -> &'static str {
        match self {
            BackendKind::Cpu => Cpu::<F32>::NAME,
            BackendKind::Reference => Reference::NAME,
            BackendKind::Cuda => "cuda",
        }
    }
}

impl BackendKind {
    /// Whether its devices have bf16 arithmetic ([`Backend::native_bf16`]),
    /// known before any is opened: what `--compute auto` asks of a backend.
    pub fn native_bf16(self) -> bool {
        match self {
            BackendKind::Cpu => Cpu::<F32>::native_bf16(),
            BackendKind::Reference => Reference::native_bf16(),
            #[cfg(feature = "cuda")]
            BackendKind::Cuda => crate::backend::cuda::Cuda::<F32>::native_bf16(),
            // A build without the backend refuses it at load; `auto` resolves as it would with it.
            #[cfg(not(feature = "cuda"))]
            BackendKind::Cuda => true,
        }
    }
}

impl std::fmt::Display for BackendKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for BackendKind {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "cpu" => Ok(BackendKind::Cpu),
            "reference" => Ok(BackendKind::Reference),
            "cuda" => Ok(BackendKind::Cuda),
            other => Err(format!("unknown backend {other:?} (expected cpu, reference or cuda)")),
        }
    }
}

/// How to load a model: on which backend, in which compute dtype, over how
/// many tensor-parallel ranks, on which devices.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LoadOptions {
    /// The backend.
    pub backend: BackendKind,
    /// The dtype of GEMM and attention inputs.
    pub compute: Compute,
    /// Tensor-parallel ranks; 1 runs the model whole.
    pub tp: usize,
    /// GPU indices, one per rank in rank order (`--devices`); empty: the
    /// first `tp`. Only the CUDA backend takes devices.
    pub devices: Vec<usize>,
    /// Load the LM head too (generation samples from it; extraction does
    /// not read it, and leaves its `V × H` weights on disk).
    pub lm_head: bool,
}

impl Default for LoadOptions {
    fn default() -> Self {
        LoadOptions { backend: BackendKind::Cpu, compute: Compute::F32, tp: 1, devices: Vec::new(), lm_head: false }
    }
}

impl LoadOptions {
    /// The GPU of each rank: `devices`, or `0..tp` when none are named.
    pub fn rank_devices(&self) -> Vec<usize> {
        if self.devices.is_empty() {
            (0..self.tp).collect()
        } else {
            self.devices.clone()
        }
    }
}

/// What `--compute` asks for: a dtype, or `auto`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum ComputeChoice {
    /// bf16 when the weights are stored in bf16, FP8 or INT4 and the device
    /// has bf16 arithmetic (a CPU with a bf16 dot-product instruction, any
    /// GPU of the CUDA backend); f32 otherwise.
    #[default]
    Auto,
    /// This dtype.
    Fixed(Compute),
}

/// `--compute`'s values: `auto` and the two dtypes.
#[cfg(feature = "cli")]
impl clap::ValueEnum for ComputeChoice {
    fn value_variants<'a>() -> &'a [Self] {
        &[ComputeChoice::Auto, ComputeChoice::Fixed(Compute::F32), ComputeChoice::Fixed(Compute::Bf16)]
    }

    fn to_possible_value(&self) -> Option<clap::builder::PossibleValue> {
        let (name, help) = match self {
            ComputeChoice::Auto => (
                "auto",
                "bf16 when the weights are stored in bf16, FP8 or INT4 and the CPU has bf16 hardware (AMX tiles or avx512_bf16); f32 otherwise",
            ),
            ComputeChoice::Fixed(Compute::F32) => ("f32", "f32 GEMM and attention inputs: the exact path, HF parity at 1e-4"),
            ComputeChoice::Fixed(Compute::Bf16) => {
                ("bf16", "bf16 GEMM and attention inputs, f32 accumulation, residual, norms and softmax")
            }
        };
        Some(clap::builder::PossibleValue::new(name).help(help))
    }
}

/// From the family table: [`AnyConfig`], one variant per row, its parsing
/// by `model_type`, and each family's aliases: one decoder (`Llama<H, B>`)
/// and over tensor-parallel ranks (`TpLlama<H, TP, B>`).
macro_rules! registry {
    ([] $($(#[$attr:meta])* $variant:ident $module:ident $config:ident $tp:ident $doc:literal [$($model_type:literal),+]
        $(in ($hf_path:literal, $model_path:literal))?;)+) => {
        $(
            $(#[$attr])*
            #[doc = concat!($doc, ", with hidden dim `H` on backend `B` (the CPU unless named).")]
            pub type $variant<H = usize, B = Cpu> = Decoder<B, super::$module::DecoderLayer<B>, H>;
            $(#[$attr])*
            #[doc = concat!($doc, ", over `TP` tensor-parallel ranks.")]
            pub type $tp<H, TP = usize, B = Cpu> = TpModel<$variant<H, B>, TP>;
        )+

        /// A parsed `config.json` of any supported family, before any weight is read.
        #[derive(Clone, Debug)]
        pub enum AnyConfig {
            $(
                $(#[$attr])*
                #[doc = concat!($doc, ".")]
                $variant(crate::hf::$config),
            )+
        }

        impl AnyConfig {
            /// The family's name, its row's variant (`Llama`, `Deepseek`, ...).
            pub fn family(&self) -> &'static str {
                match self {
                    $($(#[$attr])* AnyConfig::$variant(_) => stringify!($variant),)+
                }
            }

            /// The family whose row names `model_type`; the first row reads any other
            /// (and refuses it as its config parser does).
            fn of_model_type(model_type: &str, text: &str) -> Result<Self, ConfigError> {
                registry!(@parse model_type, text, $($(#[$attr])* $variant $config [$($model_type),+];)+)
            }
        }
    };
    (@parse $ty:ident, $text:ident,
        $(#[$first_attr:meta])* $first:ident $first_config:ident [$($first_type:literal),+];
        $($(#[$attr:meta])* $variant:ident $config:ident [$($model_type:literal),+];)*) => {
        Ok(match $ty {
            $($(#[$attr])* $($model_type)|+ => AnyConfig::$variant(crate::hf::$config::from_json($text)?),)*
            // The first row's attributes too: a build without it has no fallback, and fails here.
            $(#[$first_attr])*
            _ => AnyConfig::$first(crate::hf::$first_config::from_json($text)?),
        })
    };
}
crate::families::families!(registry);

/// Runs `$body` with `$c` bound to the config `$config` holds and `$L<B>`
/// naming its family's decoder layer over a backend `B`: one arm per row of
/// the family table.
macro_rules! dispatch {
    ($config:expr, |$c:ident, $L:ident| $body:expr) => {
        crate::families::families!(dispatch_arms, ($config, $c, $L, $body))
    };
}

/// `dispatch!`'s match, from the family table.
macro_rules! dispatch_arms {
    ([($config:expr, $c:ident, $L:ident, $body:expr)] $($(#[$attr:meta])* $variant:ident $module:ident $cfg:ident $tp:ident
        $doc:literal [$($model_type:literal),+] $(in ($hf_path:literal, $model_path:literal))?;)+) => {
        match $config {
            $(
                $(#[$attr])*
                AnyConfig::$variant($c) => {
                    type $L<B> = super::$module::DecoderLayer<B>;
                    $body
                }
            )+
        }
    };
}

impl AnyConfig {
    /// Parses `config.json` text, choosing the family by `model_type`.
    pub fn parse(text: &str) -> Result<Self, ConfigError> {
        let model_type = serde_json::from_str::<serde_json::Value>(text)
            .ok()
            .and_then(|v| v.get("model_type").and_then(|m| m.as_str()).map(str::to_string))
            .unwrap_or_default();
        Self::of_model_type(&model_type, text)
    }

    /// Reads `DIR/config.json`.
    pub fn read(dir: &Path) -> Result<Self, ConfigError> {
        Self::parse(&Self::read_text(dir)?)
    }

    /// The text of `DIR/config.json`: a regular file (a FIFO or device is
    /// refused instead of blocking) of at most [`crate::hf::MAX_JSON_BYTES`].
    pub fn read_text(dir: &Path) -> Result<String, ConfigError> {
        super::decoder::read_config_text(dir)
    }

    /// What the shared skeleton needs of the config.
    fn frame(&self) -> Frame {
        dispatch!(self, |c, L| <L<Reference> as Block<Reference>>::frame(c))
    }

    /// The outer shape.
    pub fn info(&self) -> ArchInfo {
        self.frame().info
    }

    /// Prefix of the text model's tensor names (`language_model.` in a multimodal wrapper).
    pub fn tensor_prefix(&self) -> String {
        self.frame().tensor_prefix
    }

    /// Bytes of sequence state a sample keeps between the steps it is split
    /// over, beyond its keys and values (the Gated DeltaNet layers' conv and
    /// recurrent state, all ranks together; 0 for attention-only models).
    /// A run holds it for each sample cut across steps (`serve` for each
    /// request in flight), whatever the sample's length.
    pub fn sequence_state_bytes(&self) -> usize {
        dispatch!(self, |c, L| <L<Reference> as Block<Reference>>::sequence_state_bytes(c))
    }

    /// The quantisation scheme of the weights, if any, in words.
    pub fn quantization(&self) -> Option<String> {
        dispatch!(self, |c, L| <L<Reference> as Block<Reference>>::quantization(c))
    }

    /// Checks the options against the config before any weight is read:
    /// the split over `opts.tp` ranks, and what the backend can do.
    pub fn check(&self, opts: &LoadOptions) -> Result<(), ModelError> {
        if opts.tp == 0 {
            return Err(OptionsError::NoRanks.into());
        }
        check_devices(opts)?;
        if opts.backend == BackendKind::Reference && opts.tp > 1 {
            Reference.group(opts.tp)?;
        }
        if opts.backend == BackendKind::Reference && opts.compute != Reference.compute() {
            return Err(OptionsError::ReferenceCompute { asked: opts.compute }.into());
        }
        if opts.tp > 1 {
            let splits = dispatch!(self, |c, L| <L<Reference> as Block<Reference>>::splits(c));
            super::shard::check(&splits, opts.tp)?;
        }
        Ok(())
    }

    /// Loads the weights `open` gives (called once per rank), as `opts` asks.
    pub fn load(
        self,
        opts: LoadOptions,
        open: impl Fn() -> Result<Checkpoint, CheckpointError> + Send + Sync + 'static,
    ) -> Result<AnyModel, ModelError> {
        self.check(&opts)?;
        let (tp, compute, info) = (opts.tp, opts.compute, self.info());
        let (inner, kernel) = match (opts.backend, compute) {
            (BackendKind::Cpu, Compute::F32) => self.erased_on(Cpu::<F32>::default(), tp, opts.lm_head, open)?,
            (BackendKind::Cpu, Compute::Bf16) => self.erased_on(Cpu::<Bf16>::default(), tp, opts.lm_head, open)?,
            (BackendKind::Reference, _) => self.erased_on(Reference, 1, opts.lm_head, open)?,
            (BackendKind::Cuda, compute) => self.load_cuda(compute, &opts, open)?,
        };
        Ok(AnyModel { inner, info, options: opts, compute, kernel })
    }

    /// The model on `backend`, as `tp` ranks of its group when `tp > 1`, each
    /// reading its weights from `open`: what [`load`](Self::load) does for the
    /// backends it names, for any backend (an emulated GPU in the tests).
    pub fn load_on<B: Backend>(
        self,
        backend: B,
        tp: usize,
        open: impl Fn() -> Result<Checkpoint, CheckpointError> + Send + Sync + 'static,
    ) -> Result<AnyModel, ModelError> {
        self.load_on_with(backend, tp, false, open)
    }

    /// [`load_on`](Self::load_on), with the LM head if `lm_head`.
    pub fn load_on_with<B: Backend>(
        self,
        backend: B,
        tp: usize,
        lm_head: bool,
        open: impl Fn() -> Result<Checkpoint, CheckpointError> + Send + Sync + 'static,
    ) -> Result<AnyModel, ModelError> {
        let (compute, info) = (backend.compute(), self.info());
        let kind = B::NAME.parse().map_err(ModelError::Unsupported)?;
        let (inner, kernel) = self.erased_on(backend, tp, lm_head, open)?;
        let options = LoadOptions { backend: kind, compute, tp, devices: Vec::new(), lm_head };
        Ok(AnyModel { inner, info, options, compute, kernel })
    }

    fn erased_on<B: Backend>(
        self,
        backend: B,
        tp: usize,
        lm_head: bool,
        open: impl Fn() -> Result<Checkpoint, CheckpointError> + Send + Sync + 'static,
    ) -> Result<(Box<dyn ErasedModel>, &'static str), ModelError> {
        let kernel = backend.kernel();
        let inner = dispatch!(self, |c, L| if tp == 1 {
            let ckpt = open()?;
            let model = Decoder::<B, L<B>>::from_checkpoint_on(backend, c, &ckpt)?;
            let model = if lm_head { model.with_lm_head(&ckpt)? } else { model };
            Box::new(model) as Box<dyn ErasedModel>
        } else {
            Box::new(TpModel::<Decoder<B, L<B>>, usize>::build_with(&backend, c, tp, lm_head, open)?)
        });
        Ok((inner, kernel))
    }

    #[cfg(feature = "cuda")]
    fn load_cuda(
        self,
        compute: Compute,
        opts: &LoadOptions,
        open: impl Fn() -> Result<Checkpoint, CheckpointError> + Send + Sync + 'static,
    ) -> Result<(Box<dyn ErasedModel>, &'static str), ModelError> {
        use crate::backend::cuda::{Cuda, Device, Driver};
        use crate::backend::ComputeDtype;
        fn on<C: ComputeDtype>(
            config: AnyConfig,
            opts: &LoadOptions,
            open: impl Fn() -> Result<Checkpoint, CheckpointError> + Send + Sync + 'static,
        ) -> Result<(Box<dyn ErasedModel>, &'static str), ModelError> {
            let devices = opts.rank_devices();
            let first = Driver::open(devices[0]).map_err(ModelError::Device)?;
            tracing::info!(
                kernels = first.image.name(),
                gemm = first.gemm_path().kernel(C::COMPUTE),
                "GPU {} opened",
                devices[0]
            );
            config.erased_on(Cuda::<C>::new(first, devices), opts.tp, opts.lm_head, open)
        }
        match compute {
            Compute::F32 => on::<F32>(self, opts, open),
            Compute::Bf16 => on::<Bf16>(self, opts, open),
        }
    }

    #[cfg(not(feature = "cuda"))]
    fn load_cuda(
        self,
        _compute: Compute,
        _opts: &LoadOptions,
        _open: impl Fn() -> Result<Checkpoint, CheckpointError> + Send + Sync + 'static,
    ) -> Result<(Box<dyn ErasedModel>, &'static str), ModelError> {
        // Refused by `check` already; the same error if called another way.
        probe_cuda(&[]).and(Err(OptionsError::NoCuda.into()))
    }
}

/// Load options that do not fit each other, the backend, or this build.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum OptionsError {
    /// `--tp 0`.
    #[error("--tp must be at least 1")]
    NoRanks,
    /// The reference backend asked for another compute dtype.
    #[error("the reference backend computes in {} only (asked: --compute {asked})", Reference.compute())]
    ReferenceCompute {
        /// The dtype asked for.
        asked: Compute,
    },
    /// `--devices` with a backend that has no GPUs.
    #[error("--devices names GPUs, which only --backend cuda uses (asked: --backend {backend})")]
    DevicesWithoutCuda {
        /// The backend asked for.
        backend: BackendKind,
    },
    /// `--devices` and `--tp` that disagree.
    #[error("--devices lists {devices} GPUs but --tp is {tp}: one rank runs on each GPU, so give --tp {devices}")]
    DevicesNotTp {
        /// GPUs listed.
        devices: usize,
        /// Ranks asked for.
        tp: usize,
    },
    /// A GPU listed twice.
    #[error("--devices names GPU {0} twice: NCCL runs one rank per GPU")]
    DeviceTwice(usize),
    /// `--backend cuda` in a build without it.
    #[error(
        "this strata was built without the CUDA backend: rebuild with `cargo build --release --features cuda` \
         (no CUDA toolkit needed to build), or use --backend cpu"
    )]
    NotBuilt,
    /// A `STRATA_BF16_KERNEL` this CPU does not have.
    #[error(transparent)]
    Kernel(#[from] crate::backend::cpu::bf16::UnknownKernel),
    /// The CUDA loader called in a build without it (refused by the check first).
    #[error("built without --features cuda")]
    NoCuda,
}

/// Checks `--devices` against the backend and `--tp`, and (CUDA) that the
/// driver and the named GPUs are there, before any weight is read.
fn check_devices(opts: &LoadOptions) -> Result<(), ModelError> {
    if opts.backend != BackendKind::Cuda {
        if !opts.devices.is_empty() {
            return Err(OptionsError::DevicesWithoutCuda { backend: opts.backend }.into());
        }
        return Ok(());
    }
    if !opts.devices.is_empty() && opts.devices.len() != opts.tp {
        return Err(OptionsError::DevicesNotTp { devices: opts.devices.len(), tp: opts.tp }.into());
    }
    let devices = opts.rank_devices();
    if let Some(d) = devices.iter().enumerate().find(|(i, d)| devices[..*i].contains(d)) {
        return Err(OptionsError::DeviceTwice(*d.1).into());
    }
    probe_cuda(&devices)
}

#[cfg(feature = "cuda")]
fn probe_cuda(devices: &[usize]) -> Result<(), ModelError> {
    let found = crate::backend::cuda::probe::probe(devices).map_err(ModelError::Device)?;
    tracing::info!("CUDA libraries: {}", crate::backend::cuda::probe::versions());
    for d in &found {
        tracing::info!(ordinal = d.ordinal, name = %d.name, arch = %d.arch(), memory = d.memory, "GPU");
    }
    Ok(())
}

#[cfg(not(feature = "cuda"))]
fn probe_cuda(_devices: &[usize]) -> Result<(), ModelError> {
    Err(OptionsError::NotBuilt.into())
}

/// Loads a checkpoint directory of any supported family, on the backend and
/// over the ranks `opts` names.
pub fn load(dir: &Path, opts: LoadOptions) -> Result<AnyModel, ModelError> {
    let config = AnyConfig::read(dir)?;
    let (dir, prefix) = (dir.to_path_buf(), config.tensor_prefix());
    config.load(opts, move || Checkpoint::open_scoped(&dir, &prefix))
}

/// A loaded model of any family, backend and TP size, with a run-time hidden dim.
pub struct AnyModel {
    inner: Box<dyn ErasedModel>,
    info: ArchInfo,
    options: LoadOptions,
    compute: Compute,
    /// The kernel its GEMMs take, its backend's ([`DeviceOps::kernel`](crate::backend::DeviceOps::kernel)).
    kernel: &'static str,
}

impl AnyModel {
    /// The kernel its GEMMs take, for the manifest's kernel field: the CPU
    /// path (`avx512bf16`, `portable`, ...), `reference`, or on the CUDA
    /// backend `cublas` (`cublas-grouped` where the MoE experts' GEMMs are grouped).
    pub fn kernel(&self) -> &'static str {
        self.kernel
    }
    /// The compute dtype of its GEMMs and attention.
    pub fn compute(&self) -> Compute {
        self.compute
    }
    /// The outer shape.
    pub fn info(&self) -> &ArchInfo {
        &self.info
    }
    /// The backend and TP size it runs with.
    pub fn options(&self) -> &LoadOptions {
        &self.options
    }
}

/// The KV cache of an [`AnyModel`]: whichever its backend keeps, made on first use.
#[derive(Default)]
pub struct AnyCache(Option<Box<dyn Any + Send>>);

/// [`Model`] without its generic parts, so one value can hold any of them.
trait ErasedModel: Send {
    fn dtype(&self) -> DType;
    fn weight_bytes(&self) -> usize;
    fn new_cache(&self) -> Box<dyn Any + Send>;
    fn cache_bytes(&self, cache: &(dyn Any + Send)) -> Result<usize, ModelError>;
    fn step(
        &self,
        batch: &PackedBatch,
        captures: &CaptureSet<usize>,
        cache: &mut (dyn Any + Send),
        sample: Option<&[usize]>,
    ) -> Result<Sampled<usize, usize>, ModelError>;
}

impl<M> ErasedModel for M
where
    M: Model<Hidden = usize> + Send,
    M::Cache: Send + 'static,
{
    fn dtype(&self) -> DType {
        Model::dtype(self)
    }
    fn weight_bytes(&self) -> usize {
        Model::weight_bytes(self)
    }
    fn new_cache(&self) -> Box<dyn Any + Send> {
        Box::new(M::Cache::default())
    }
    fn cache_bytes(&self, cache: &(dyn Any + Send)) -> Result<usize, ModelError> {
        Model::cache_bytes(self, cache.downcast_ref::<M::Cache>().expect("the cache this model made"))
    }
    fn step(
        &self,
        batch: &PackedBatch,
        captures: &CaptureSet<usize>,
        cache: &mut (dyn Any + Send),
        sample: Option<&[usize]>,
    ) -> Result<Sampled<usize, usize>, ModelError> {
        let cache = cache.downcast_mut::<M::Cache>().expect("the cache this model made");
        self.forward_sample_pending(batch, captures, cache, sample)
    }
}

impl Model for AnyModel {
    type Hidden = usize;
    type Cache = AnyCache;

    fn hidden(&self) -> usize {
        self.info.hidden_size
    }
    fn num_layers(&self) -> usize {
        self.info.num_layers
    }
    fn dtype(&self) -> DType {
        self.inner.dtype()
    }
    fn weight_bytes(&self) -> usize {
        self.inner.weight_bytes()
    }
    fn cache_bytes(&self, cache: &AnyCache) -> Result<usize, ModelError> {
        cache.0.as_ref().map_or(Ok(0), |c| self.inner.cache_bytes(c.as_ref()))
    }
    fn forward_sample_pending<L: Dim>(
        &self,
        batch: &PackedBatch,
        captures: &CaptureSet<L>,
        cache: &mut AnyCache,
        sample: Option<&[usize]>,
    ) -> Result<Sampled<L, usize>, ModelError> {
        let cache = cache.0.get_or_insert_with(|| self.inner.new_cache());
        let set = CaptureSet::<usize>::try_new(captures.points().to_vec())?;
        let Sampled { states, logits } = self.inner.step(batch, &set, cache.as_mut(), sample)?;
        let states = states.retype(|states| {
            let [_, t, h] = states.shape();
            CapturedStates::try_from_vec(states.into_vec(), captures.layers(), t, h)
        })?;
        Ok(Sampled { states, logits })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `(model_type, family)` of every row of the table (of this build: a
    /// row's `#[cfg]` takes its pairs out, so they are pushed, not listed).
    macro_rules! rows {
        ([] $($(#[$attr:meta])* $variant:ident $module:ident $config:ident $tp:ident $doc:literal [$($model_type:literal),+]
            $(in ($hf_path:literal, $model_path:literal))?;)+) => {{
            let mut rows = Vec::new();
            $(
                $(#[$attr])*
                rows.extend([$(($model_type, stringify!($variant))),+]);
            )+
            rows
        }};
    }

    #[test]
    fn every_model_type_of_the_table_chooses_its_row() {
        // A config of the model_type alone: the family's parser takes it
        // (its defaults) or refuses it in its own words, never as unsupported.
        let rows = crate::families::families!(rows);
        assert_eq!(rows.len(), crate::hf::model_types().len());
        for (t, family) in rows {
            match AnyConfig::parse(&format!("{{\"model_type\": \"{t}\"}}")) {
                Ok(c) => assert_eq!(c.family(), family, "{t}"),
                Err(e) => assert!(!e.to_string().starts_with("unsupported model_type"), "{t}: {e}"),
            }
        }
        let e = AnyConfig::parse(r#"{"model_type": "gpt2"}"#).unwrap_err().to_string();
        assert!(e.starts_with("unsupported model_type \"gpt2\""), "{e}");
    }

    #[test]
    fn backend_names_round_trip() {
        for kind in [BackendKind::Cpu, BackendKind::Reference] {
            assert_eq!(kind.to_string().parse::<BackendKind>(), Ok(kind));
        }
        assert_eq!("cuda".parse::<BackendKind>(), Ok(BackendKind::Cuda));
        assert_eq!(
            "tpu".parse::<BackendKind>().unwrap_err(),
            "unknown backend \"tpu\" (expected cpu, reference or cuda)"
        );
    }
}
