//! The forward every decoder shares, written once over any [`Backend`]:
//! input checks, the embedding lookup, the RoPE table of the step, the
//! layers (each architecture's [`Block`]), filling the capture points as the
//! residual stream passes, the final norm, and the KV cache bookkeeping of
//! chunked prefill.

use super::logits::LogitShard;
use super::{ModelError, PendingStates};
use crate::backend::{Backend, KvStore, Parallel, PendingCopies, SeqState, Tensor};
use crate::hf::checkpoint::{Checkpoint, CheckpointError, PrefixMismatch};
use crate::hf::quant::WeightFormat;
use crate::hf::{ArchInfo, ConfigError, RopeFreqs};
use crate::pipeline::batch::PackedBatch;
use crate::pipeline::capture::{CaptureSet, Tap};
use crate::shape::{dim_from_size, CapturedStates, DType, Dim};
use std::path::Path;
use tracing::{debug_span, info_span};

/// What the shared skeleton needs of an architecture's config.
#[derive(Clone, Debug, PartialEq)]
pub struct Frame {
    /// Outer shape: layers, hidden, vocabulary, longest sequence.
    pub info: ArchInfo,
    /// Epsilon of the final norm.
    pub rms_norm_eps: f32,
    /// The rotary embedding's frequencies.
    pub rope: RopeFreqs,
    /// Prefix of the text model's tensor names (`language_model.` in a multimodal wrapper).
    pub tensor_prefix: String,
    /// Layers the checkpoint may hold past `info.num_layers` and the model
    /// never runs (DeepSeek-V3's multi-token-prediction module).
    pub extra_layers: usize,
    /// A second rotary embedding some layers use instead of `rope` (Gemma 3's
    /// local sliding layers, with their own base and no scaling).
    pub rope_local: Option<RopeFreqs>,
    /// A factor on the embeddings (Gemma's √hidden), rounded to the compute
    /// dtype first, as HF rounds it to the dtype the model runs in.
    pub embed_scale: Option<f32>,
    /// Added to the final norm's weight at load: 1 for the `(1 + w)` RMSNorm
    /// of Gemma, whose checkpoints store `w` centred on 0; 0 otherwise.
    pub norm_offset: f32,
    /// The LM head is `model.embed_tokens.weight` (`tie_word_embeddings`),
    /// not `lm_head.weight`.
    pub tied_embeddings: bool,
    /// `cap · tanh(logits / cap)` on the LM head's output (Gemma's
    /// `final_logit_softcapping`); `None` for plain logits.
    pub logit_softcap: Option<f32>,
}

impl Frame {
    /// The frame of an architecture with one RoPE table, unscaled embeddings,
    /// a plain final norm and an LM head of its own without soft-capping.
    pub fn plain(
        info: ArchInfo,
        rms_norm_eps: f32,
        rope: RopeFreqs,
        tensor_prefix: String,
        extra_layers: usize,
    ) -> Self {
        Frame {
            info,
            rms_norm_eps,
            rope,
            tensor_prefix,
            extra_layers,
            rope_local: None,
            embed_scale: None,
            norm_offset: 0.0,
            tied_embeddings: false,
            logit_softcap: None,
        }
    }
}

/// The inputs every layer of one step shares.
pub struct Step<'a, B: Backend> {
    /// The packed tokens and where each segment sits in its sample.
    pub batch: &'a PackedBatch,
    /// cos/sin of every position the step reaches.
    pub rope: &'a B::RopeTable,
    /// The same of [`Frame::rope_local`], if the architecture has one.
    pub rope_local: Option<&'a B::RopeTable>,
}

/// What a layer's forward reads and keeps besides the residual stream.
/// What is coming goes here, not into every family's signature:
/// - the input ids are `step.batch`'s (a layer that reads them, as an
///   embedding-conditioned one would, needs nothing more);
/// - a new kind of per-layer state is a field of [`SeqState`] (and an
///   associated type of the backend concern that runs it), as the Gated
///   DeltaNet's is;
/// - outputs beyond the residual stream that later layers read (an
///   indexer's choices that the next layers reuse) go in the family's
///   scratch, which every layer of a step shares.
pub struct LayerStep<'a, B: Backend, S> {
    /// The inputs every layer of the step shares: the packed batch (token
    /// ids, positions, segments) and the RoPE tables.
    pub step: &'a Step<'a, B>,
    /// The step's working buffers, shared by every layer of the family.
    pub scratch: &'a mut S,
    /// What the backend keeps of chunked samples between steps, by layer
    /// kind: each layer takes its kind's part.
    pub state: &'a mut SeqState<B>,
    /// The layer's index.
    pub index: usize,
}

/// One decoder layer of an architecture (`model.layers.{i}.*`), over backend `B`.
/// An architecture file implements this and nothing of the skeleton.
pub trait Block<B: Backend>: Sized + Send + Sync + 'static {
    /// The architecture's normalised config.
    type Config: Clone + Send + Sync + 'static;
    /// Working buffers of one step, shared by every layer (`H`: the residual width).
    type Scratch<H: Dim>;

    /// Parses `config.json`.
    fn parse_config(text: &str) -> Result<Self::Config, ConfigError>;
    /// What the skeleton needs of the config.
    fn frame(config: &Self::Config) -> Frame;
    /// The sizes that must divide over the tensor-parallel ranks (heads, kv
    /// heads, MLP widths present), in the order they are checked: the
    /// decoder checks them once ([`super::shard::check`]) before any weight is read.
    fn splits(config: &Self::Config) -> Vec<super::shard::Split>;
    /// The quantisation scheme of the weights, if any, in words (plain weights: `None`).
    fn quantization(_config: &Self::Config) -> Option<String> {
        None
    }
    /// Loads layer `index`: this rank's share of it (`b.rank()` of `b.world_size()`).
    fn load(b: &B, config: &Self::Config, ckpt: &Checkpoint, index: usize) -> Result<Self, ModelError>;
    /// Buffers for a step of `tokens` tokens.
    fn scratch<H: Dim>(b: &B, config: &Self::Config, tokens: usize, hidden: H) -> Self::Scratch<H>;
    /// `x ← layer(x)`: the residual stream's update by layer `at.index`, which
    /// keeps what its kind needs of chunked samples in its part of `at.state`.
    fn forward<H: Dim>(&self, b: &B, x: &mut Tensor<B, H>, at: LayerStep<'_, B, Self::Scratch<H>>);
    /// Bytes the layer's weights hold.
    fn weight_bytes(&self) -> usize;
    /// Bytes of sequence state one sample keeps between steps, all layers
    /// and ranks together, beyond its keys and values (which grow with its
    /// positions): the Gated DeltaNet layers' conv and recurrent state.
    fn sequence_state_bytes(_config: &Self::Config) -> usize {
        0
    }
}

/// A decoder-only transformer: embedding, `layers` of one architecture's
/// [`Block`], final norm, on backend `B`, with hidden width `H`
/// (`Hidden<N>` in a static job, `usize` when it comes from `config.json`).
pub struct Decoder<B: Backend, L: Block<B>, H: Dim = usize> {
    backend: B,
    config: L::Config,
    frame: Frame,
    hidden: H,
    dtype: DType,
    embed_tokens: B::Embedding,
    layers: Vec<L>,
    /// `model.norm.weight`, plus [`Frame::norm_offset`].
    norm: B::Vector,
    /// The LM head, when the job samples ([`Decoder::with_lm_head`]).
    head: Option<LmHead<B>>,
}

/// This rank's block of the LM head: `lm_head.weight` (or the tied
/// embedding) rows `vocab`, column-parallel over the vocabulary.
struct LmHead<B: Backend> {
    /// `[vocab.len(), H]`.
    linear: B::Linear,
    /// The vocabulary rows this rank computes ([`LogitShard::block`]).
    vocab: std::ops::Range<usize>,
}

/// What one rank's step returns: the captured states (on a capturing rank)
/// and its block of the sampled rows' logits (when rows were asked for).
pub struct RankStep<L: Dim, H: Dim> {
    /// `[L, T, H]`, copies pending; `None` on a non-capturing rank.
    pub states: Option<PendingStates<L, H>>,
    /// `[S, V/TP]` of the rows asked for; `None` outside generation.
    pub logits: Option<LogitShard>,
}

/// Reads `DIR/config.json` (a regular file of bounded size; a FIFO is refused).
pub(crate) fn read_config_text(dir: &Path) -> Result<String, ConfigError> {
    crate::hf::read_config(&dir.join("config.json"))
}

/// Checks config.json's outer sizes against the tensors the checkpoint
/// holds, before anything sized by them is allocated: a config claiming a
/// billion layers or a huge vocabulary fails here, not in the allocator.
fn check_fits(frame: &Frame, ckpt: &Checkpoint) -> Result<(), ModelError> {
    let info = &frame.info;
    let mismatch = |problem: String| ModelError::from(CheckpointError::ConfigMismatch(problem));
    let embed = "model.embed_tokens.weight";
    let want = [info.vocab_size, info.hidden_size];
    match ckpt.shape(embed) {
        Some(shape) if shape != want => {
            return Err(mismatch(format!(
                "vocab_size {} and hidden_size {} make {embed} {want:?}, but the checkpoint's is {shape:?}",
                info.vocab_size, info.hidden_size
            )))
        }
        Some(_) => {}
        None => return Err(CheckpointError::Missing(ckpt.full(embed)).into()),
    }
    let (n, held) = (info.num_layers, ckpt.layer_count());
    if held < n {
        return Err(mismatch(format!(
            "num_hidden_layers is {n}, but the checkpoint holds tensors of {held} layers \
             (no model.layers.{}.*)",
            n - 1
        )));
    }
    if held > n.saturating_add(frame.extra_layers) {
        let extra = if frame.extra_layers > 0 {
            format!(" (plus {} multi-token-prediction layers)", frame.extra_layers)
        } else {
            String::new()
        };
        return Err(mismatch(format!(
            "num_hidden_layers is {n}{extra}, but the checkpoint also holds model.layers.{}.*",
            held - 1
        )));
    }
    Ok(())
}

impl<B: Backend, L: Block<B>, H: Dim + Default> Decoder<B, L, H> {
    /// Loads `config.json` and the safetensors weights of a checkpoint directory.
    pub fn load(dir: &Path) -> Result<Self, ModelError>
    where
        B: Default,
    {
        Self::load_on(B::default(), dir)
    }

    /// [`load`](Self::load) onto a given backend (one rank of a group, or a device).
    pub fn load_on(backend: B, dir: &Path) -> Result<Self, ModelError> {
        let config = L::parse_config(&read_config_text(dir)?)?;
        let ckpt = Checkpoint::open_scoped(dir, &L::frame(&config).tensor_prefix)?;
        Self::from_checkpoint_on(backend, config, &ckpt)
    }

    /// Builds the model from a parsed config and an opened checkpoint,
    /// checking the config's hidden size against `H`.
    pub fn from_checkpoint(config: L::Config, ckpt: &Checkpoint) -> Result<Self, ModelError>
    where
        B: Default,
    {
        Self::from_checkpoint_on(B::default(), config, ckpt)
    }

    /// [`from_checkpoint`](Self::from_checkpoint) onto a given backend: rank
    /// `backend.rank()` of a tensor-parallel group reads only its share of
    /// every split weight from the mapped checkpoint.
    pub fn from_checkpoint_on(backend: B, config: L::Config, ckpt: &Checkpoint) -> Result<Self, ModelError> {
        super::shard::check(&L::splits(&config), backend.world_size())?;
        let frame = L::frame(&config);
        let info = &frame.info;
        let _span =
            info_span!("load", arch = %info.architecture, layers = info.num_layers, rank = backend.rank()).entered();
        if ckpt.prefix() != frame.tensor_prefix {
            let (expected, actual) = (frame.tensor_prefix.clone(), ckpt.prefix().to_string());
            return Err(CheckpointError::from(PrefixMismatch { expected, actual }).into());
        }
        check_fits(&frame, ckpt)?;
        let hidden: H = dim_from_size("config.json hidden_size", "hidden", info.hidden_size)?;
        let h = info.hidden_size;
        // In place: the table stays in the mapped checkpoint.
        let (bytes, dtype) = ckpt.tensor_bytes("model.embed_tokens.weight", &[info.vocab_size, h])?;
        let embed_tokens = backend.embedding(bytes, dtype, h);
        // Layers are read and packed on the backend's threads (the CPU's
        // packing is most of a dense model's load time).
        let layers = backend.build_many(info.num_layers, |l| L::load(&backend, &config, ckpt, l))?;
        let mut norm = ckpt.read_f32("model.norm.weight", &[h])?;
        norm.iter_mut().for_each(|w| *w += frame.norm_offset);
        let norm = backend.vector(norm);
        // A device backend reports a failed upload (out of memory) here, at
        // load, before any output is opened.
        backend.end_step()?;
        Ok(Decoder { backend, config, frame, hidden, dtype, embed_tokens, layers, norm, head: None })
    }

    /// Adds the LM head from `ckpt` (what generation needs and extraction
    /// does not load): `lm_head.weight`, or `model.embed_tokens.weight`
    /// under [`Frame::tied_embeddings`], this rank's block of vocabulary rows.
    pub fn with_lm_head(mut self, ckpt: &Checkpoint) -> Result<Self, ModelError> {
        let (b, info) = (&self.backend, &self.frame.info);
        let (v, h) = (info.vocab_size, info.hidden_size);
        let module = if self.frame.tied_embeddings { "model.embed_tokens" } else { "lm_head" };
        let name = format!("{module}.weight");
        if !ckpt.contains(&name) {
            return Err(ModelError::NoLmHead(format!(
                "the checkpoint has no {} (and tie_word_embeddings is false): a model without an LM head cannot generate",
                ckpt.full(&name)
            )));
        }
        if b.world_size() > v {
            return Err(ModelError::NoLmHead(format!(
                "vocab_size {v} is smaller than the {} ranks it splits over",
                b.world_size()
            )));
        }
        let vocab = LogitShard::block(v, b.rank(), b.world_size());
        let w = ckpt.read_linear(module, [v, h], vocab.clone(), 0..h, WeightFormat::Plain)?;
        let linear = b.linear(w, None, Parallel::Column);
        b.end_step()?;
        self.head = Some(LmHead { linear, vocab });
        Ok(self)
    }
}

impl<B: Backend, L: Block<B>, H: Dim> Decoder<B, L, H> {
    /// The normalised config.
    pub fn config(&self) -> &L::Config {
        &self.config
    }
    /// The outer shape.
    pub fn info(&self) -> &ArchInfo {
        &self.frame.info
    }
    /// The hidden dim.
    pub fn hidden(&self) -> H {
        self.hidden
    }
    /// The dtype the checkpoint stores its weights in.
    pub fn dtype(&self) -> DType {
        self.dtype
    }
    /// The backend this model runs on.
    pub fn backend(&self) -> &B {
        &self.backend
    }
    /// The decoder layers.
    pub fn layers(&self) -> &[L] {
        &self.layers
    }

    /// Checks a batch against the model: no empty segment, no position past
    /// `max_position_embeddings`, token ids in the vocabulary.
    pub fn check_batch(&self, batch: &PackedBatch) -> Result<(), ModelError> {
        let info = &self.frame.info;
        for (s, seg) in batch.segments().iter().enumerate() {
            let r = batch.range(s);
            let err = |problem: String| ModelError::Input { sample: s, problem };
            if r.is_empty() {
                return Err(err("empty sample (no tokens)".into()));
            }
            let max = info.max_position_embeddings;
            if seg.pos0 + r.len() > max {
                return Err(err(format!("{} tokens exceed max_position_embeddings {max}", seg.pos0 + r.len())));
            }
            let vocab = info.vocab_size;
            if let Some((pos, &t)) = batch.token_ids()[r].iter().enumerate().find(|(_, &t)| t as usize >= vocab) {
                return Err(err(format!(
                    "token id {t} at position {} is out of range (vocab_size {vocab})",
                    seg.pos0 + pos
                )));
            }
        }
        Ok(())
    }

    /// Bytes of memory the weights hold (quantised and bf16 weights as stored).
    pub fn resident_bytes(&self) -> usize {
        use crate::backend::Resident;
        let layers: usize = self.layers.iter().map(Block::weight_bytes).sum();
        let ropes = self.frame.rope.inv_freq.len() + self.frame.rope_local.as_ref().map_or(0, |r| r.inv_freq.len());
        let head = self.head.as_ref().map_or(0, |h| h.linear.resident_bytes());
        self.embed_tokens.resident_bytes() + layers + self.norm.resident_bytes() + head + ropes * 4
    }

    /// Whether the LM head is loaded ([`with_lm_head`](Self::with_lm_head)).
    pub fn has_lm_head(&self) -> bool {
        self.head.is_some()
    }

    /// Runs the decoder over a packed batch of whole samples and returns the
    /// captured states `[L, T_total, H]`, layers in the capture set's order.
    /// Layers past the deepest capture point are not run.
    pub fn forward<LD: Dim>(
        &self,
        batch: &PackedBatch,
        captures: &CaptureSet<LD>,
    ) -> Result<CapturedStates<LD, H>, ModelError> {
        self.forward_step(batch, captures, &mut SeqState::default())
    }

    /// [`forward`](Self::forward) for batches that hold chunks of samples:
    /// a segment with `pos0 > 0` continues from what its sample's earlier
    /// chunks left in `cache` (keys/values, Gated DeltaNet state); a segment
    /// with `keep` leaves its own there for the next chunk. The states of a token do not depend on how
    /// its sample was chunked or packed (bitwise, on the CPU backend).
    pub fn forward_step<LD: Dim>(
        &self,
        batch: &PackedBatch,
        captures: &CaptureSet<LD>,
        cache: &mut SeqState<B>,
    ) -> Result<CapturedStates<LD, H>, ModelError> {
        self.forward_step_pending(batch, captures, cache)?.wait()
    }

    /// [`forward_step`](Self::forward_step), returning once the device has
    /// run the step: the copies of its captures into host memory are left
    /// to [`PendingStates::wait`], so that they overlap the next step.
    pub fn forward_step_pending<LD: Dim>(
        &self,
        batch: &PackedBatch,
        captures: &CaptureSet<LD>,
        cache: &mut SeqState<B>,
    ) -> Result<PendingStates<LD, H>, ModelError> {
        Ok(self.forward_rank(batch, captures, cache, true)?.expect("a capturing forward returns states"))
    }

    /// The forward of one tensor-parallel rank: every rank runs it in step
    /// (row-parallel layers sum over all of them); only a capturing rank
    /// fills and returns the states, the others return `None` without
    /// allocating them. The residual stream is whole on every rank, so a
    /// capture reads full `[T, H]` states, never a shard.
    pub fn forward_rank<LD: Dim>(
        &self,
        batch: &PackedBatch,
        captures: &CaptureSet<LD>,
        cache: &mut SeqState<B>,
        capture: bool,
    ) -> Result<Option<PendingStates<LD, H>>, ModelError> {
        Ok(self.step_rank(batch, captures, cache, capture, None)?.states)
    }

    /// [`forward_rank`](Self::forward_rank) as a generation step when
    /// `sample` is `Some(rows)`: every layer runs, whatever the capture
    /// points (a later step reads every layer's keys), and the logits of
    /// the batch rows `rows` (the last token of each sequence that samples)
    /// come back: the final norm of those rows through this rank's block
    /// of the LM head, soft-capped where the family does.
    pub fn step_rank<LD: Dim>(
        &self,
        batch: &PackedBatch,
        captures: &CaptureSet<LD>,
        cache: &mut SeqState<B>,
        capture: bool,
        sample: Option<&[usize]>,
    ) -> Result<RankStep<LD, H>, ModelError> {
        let (b, f) = (&self.backend, &self.frame);
        self.check_batch(batch)?;
        let t = batch.num_tokens();
        if sample.is_some() && self.head.is_none() {
            return Err(ModelError::NoLmHead("the model was loaded without its LM head".into()));
        }
        if let Some(&r) = sample.unwrap_or_default().iter().find(|&&r| r >= t) {
            return Err(ModelError::Input { sample: 0, problem: format!("sampled row {r} of a {t}-token step") });
        }
        let mut caps = Captures::new(captures, f.info.num_layers, t, self.hidden, capture, sample.is_some())?;
        cache.begin(batch)?;
        let _span = info_span!("forward", tokens = t, samples = batch.num_samples()).entered();
        let mut x = Tensor::zeros(b, t, self.hidden); // the residual stream [T, H]
        b.embed(&self.embed_tokens, batch, &mut x);
        if let Some(s) = f.embed_scale {
            b.scale(&mut x, b.compute().round(s));
        }
        let rope = b.rope_table(&f.rope, batch.max_position());
        let rope_local = f.rope_local.as_ref().map(|r| b.rope_table(r, batch.max_position()));
        let step = Step { batch, rope: &rope, rope_local: rope_local.as_ref() };
        let mut scratch = L::scratch(b, &self.config, t, self.hidden);
        for (k, layer) in self.layers.iter().enumerate().take(caps.depth) {
            if let Err(e) = caps.record(b, Tap::Residual(k), &x) {
                drop(caps.complete(b));
                return Err(e);
            }
            let _s = debug_span!("layer", k).entered();
            layer.forward(b, &mut x, LayerStep { step: &step, scratch: &mut scratch, state: &mut *cache, index: k });
        }
        cache.retire(batch);
        let states = caps.finish(b, &x, &self.norm, f.rms_norm_eps)?;
        let logits = match (&self.head, sample) {
            (Some(head), Some(rows)) => Some(self.logits(head, &x, rows)?),
            _ => None,
        };
        // The staged copies land by the end of the step; reading them is left to the caller.
        b.end_step()?;
        Ok(RankStep { states: states.map(|(states, copies)| PendingStates::new(states, copies)), logits })
    }

    /// This rank's logits `[S, V/TP]` of rows `sample` of the final residual `x`.
    fn logits(&self, head: &LmHead<B>, x: &Tensor<B, H>, sample: &[usize]) -> Result<LogitShard, ModelError> {
        let b = &self.backend;
        let _span = debug_span!("lm_head", rows = sample.len()).entered();
        let s = sample.len();
        let (vocab, of) = (head.vocab.clone(), self.frame.info.vocab_size);
        if s == 0 {
            return Ok(LogitShard::new(0, vocab, of, Vec::new())?);
        }
        let mut rows = Tensor::zeros(b, s, self.hidden); // [S, H]
        b.gather_rows(x, sample, &mut rows);
        let mut normed = Tensor::zeros(b, s, self.hidden); // [S, H]
        b.rms_norm(rows.all(), &self.norm, self.frame.rms_norm_eps, &mut normed);
        let mut out = Tensor::zeros(b, s, head.vocab.len()); // [S, V/TP]
        b.linear_forward(&head.linear, &normed, &mut out);
        let mut values = out.to_host(b);
        if let Some(cap) = self.frame.logit_softcap {
            values.iter_mut().for_each(|l| *l = cap * (*l / cap).tanh());
        }
        Ok(LogitShard::new(s, vocab, of, values)?)
    }
}

/// The capture side of one forward: which taps fill which slots, how deep the
/// forward must go, and the host `[L, T, H]` buffer (only on a capturing rank).
struct Captures<L: Dim, H: Dim> {
    taps: Vec<Tap>,
    /// Layers to run: none past the deepest capture point.
    depth: usize,
    post_norm: bool,
    out: Option<CapturedStates<L, H>>,
}

impl<L: Dim, H: Dim> Captures<L, H> {
    /// Resolves the capture points against `num_layers`; allocates the buffer
    /// if `capture`; runs every layer if `all`.
    fn new(
        captures: &CaptureSet<L>,
        num_layers: usize,
        tokens: usize,
        hidden: H,
        capture: bool,
        all: bool,
    ) -> Result<Self, ModelError> {
        let taps = captures.taps(num_layers)?;
        let post_norm = taps.contains(&Tap::PostNorm);
        let depth = if post_norm || all {
            num_layers
        } else {
            taps.iter().map(|tap| if let Tap::Residual(k) = tap { *k } else { 0 }).max().unwrap_or(0)
        };
        let out = capture.then(|| CapturedStates::zeros(captures.layers(), tokens, hidden));
        Ok(Captures { taps, depth, post_norm, out })
    }

    /// Copies the `[T, H]` states `x` into every slot that reads `tap`.
    fn record<B: Backend>(&mut self, b: &B, tap: Tap, x: &Tensor<B, H>) -> Result<(), ModelError> {
        let Some(out) = &mut self.out else { return Ok(()) };
        for (slot, _) in self.taps.iter().enumerate().filter(|(_, &t)| t == tap) {
            b.capture(x, out, slot)?;
        }
        Ok(())
    }

    /// Records the residual after the last layer run and, if asked for (on a
    /// capturing rank), the final norm of it; returns the buffer and the
    /// device's copies still to land in it (`None` on a non-capturing rank).
    #[allow(clippy::type_complexity)]
    fn finish<B: Backend>(
        mut self,
        b: &B,
        x: &Tensor<B, H>,
        norm: &B::Vector,
        eps: f32,
    ) -> Result<Option<(CapturedStates<L, H>, Option<PendingCopies>)>, ModelError> {
        let recorded = self.record(b, Tap::Residual(self.depth), x).and_then(|()| {
            if !self.post_norm || self.out.is_none() {
                return Ok(());
            }
            let mut normed = Tensor::zeros(b, x.rows(), x.width());
            b.rms_norm(x.all(), norm, eps, &mut normed);
            self.record(b, Tap::PostNorm, &normed)
        });
        let copies = self.complete(b);
        recorded?;
        Ok(self.out.map(|out| (out, copies)))
    }

    /// Takes the step's captures still in flight (see
    /// [`Buffers::capture_take`](crate::backend::Buffers::capture_take)); on an error path too, so a device backend
    /// never carries copies it staged for this step into the next.
    fn complete<B: Backend>(&mut self, b: &B) -> Option<PendingCopies> {
        self.out.as_ref().and_then(|out| b.capture_take(out))
    }
}
