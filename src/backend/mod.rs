//! Backends: where a decoder's arithmetic runs. The decoders in
//! [`crate::model`] are written once against [`Backend`]; a backend owns its
//! buffers ([`Tensor`], typed like host storage), its weights (linear layers
//! in their [`Parallel`] kind, norms, the embedding table), its kernels, its
//! KV cache and its collective. A model file never names a concrete backend.
//!
//! - [`cpu`]: the fast host backend (packed f32 GEMM over f32 or quantised
//!   panels, rayon), the default;
//! - [`reference`]: plain loops with f64 accumulation, no threads: the oracle
//!   other backends are tested against.
//!
//! Anchors: candle's `BackendStorage` (one storage type per device, the same
//! ops on each) and burn's `Backend` (associated types for every device-side
//! thing). To add a backend, implement this trait; `tests/backends.rs` then
//! runs every parity fixture through it (see docs/ARCHITECTURE.md).

mod check;
pub mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;
mod device_error;
pub mod host;
mod kv_cache;
pub mod reference;
mod tensor;

/// Llama 4's query temperature, a config value the backend ops take ([`Backend::attn_temperature`]).
pub use crate::hf::llama4::Temperature;
pub use cpu::Cpu;
pub use device_error::DeviceError;
pub use kv_cache::{DeltaCache, KvCache};
pub use reference::Reference;
pub use tensor::{Cols, Tensor};

use crate::hf::checkpoint::TensorBytes;
use crate::hf::moe::{Scoring, TopkMethod};
use crate::hf::quant::{LinearWeight, QuantKind};
use crate::hf::RopeFreqs;
use crate::pipeline::batch::PackedBatch;
use crate::shape::{CapturedStates, DType, Dim, ShapeError};

/// Why a backend cannot do what it is asked.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BackendError {
    /// Input the model cannot take (a chunk that does not continue its cached positions).
    #[error("sample {sample}: {problem}")]
    Input {
        /// Sample index in the batch.
        sample: usize,
        /// What is wrong.
        problem: String,
    },
    /// Something this backend does not do (e.g. tensor parallelism on the reference backend).
    #[error("{0}")]
    Unsupported(String),
    /// A size that disagrees with a buffer's type.
    #[error(transparent)]
    Shape(#[from] ShapeError),
    /// The device failed (out of memory, a launch or driver error), its error kept whole.
    #[error("device: {0}")]
    Device(DeviceError),
}

impl From<DeviceError> for BackendError {
    fn from(e: DeviceError) -> Self {
        BackendError::Device(e)
    }
}

/// The rest of a step's captures, still on their way from a device: run on
/// the step's `[L, T, H]` values, it fills the slots the device staged.
pub type PendingCopies = Box<dyn FnOnce(&mut [f32]) -> Result<(), BackendError> + Send>;

/// The dtype a backend feeds its GEMMs and attention (the residual stream,
/// norms, softmax and accumulations stay f32 whatever it is).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Compute {
    /// f32 inputs: the exact path.
    F32,
    /// bf16 inputs, f32 accumulation.
    Bf16,
}

impl Compute {
    /// Every compute dtype.
    pub const ALL: [Compute; 2] = [Compute::F32, Compute::Bf16];

    /// The name `--compute` takes and the manifest records.
    pub fn name(self) -> &'static str {
        match self {
            Compute::F32 => "f32",
            Compute::Bf16 => "bf16",
        }
    }

    /// `v` rounded to this dtype (to nearest even).
    pub fn round(self, v: f32) -> f32 {
        match self {
            Compute::F32 => v,
            Compute::Bf16 => half::bf16::from_f32(v).to_f32(),
        }
    }
}

impl std::fmt::Display for Compute {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.pad(self.name())
    }
}

impl std::str::FromStr for Compute {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        Compute::ALL
            .into_iter()
            .find(|c| c.name() == s)
            .ok_or_else(|| format!("unknown compute dtype {s:?} (expected f32 or bf16)"))
    }
}

/// A compute dtype as a type: the parameter a backend is instantiated with
/// (`Cpu<F32>`), so a bf16 or CUDA path is a new backend type, not a change
/// to any model file.
pub trait ComputeDtype: Copy + Default + Send + Sync + std::fmt::Debug + 'static {
    /// Its run-time value.
    const COMPUTE: Compute;
}

/// f32 compute.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct F32;

impl ComputeDtype for F32 {
    const COMPUTE: Compute = Compute::F32;
}

/// bf16 compute: GEMM and attention inputs rounded to bf16, f32 accumulation.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Bf16;

impl ComputeDtype for Bf16 {
    const COMPUTE: Compute = Compute::Bf16;
}

/// How a linear layer is split over tensor-parallel ranks (mistral.rs'
/// `DistributedKind`): a property of the layer, so a forward never mentions ranks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Parallel {
    /// Every rank holds the whole weight and computes the whole output.
    Replicated,
    /// Each rank holds a block of output rows; its output is its own columns.
    Column,
    /// Each rank holds a block of input columns; partial outputs are summed
    /// over ranks (all-reduce, in rank order) and the bias added once.
    Row,
}

/// Memory a weight holds.
pub trait Resident {
    /// Bytes held (quantised weights as codes and scales).
    fn resident_bytes(&self) -> usize;
}

/// What a backend's linear layer tells about itself.
pub trait LinearInfo: Resident + Send + Sync {
    /// Output width on this rank.
    fn out_features(&self) -> usize;
    /// Input width on this rank.
    fn in_features(&self) -> usize;
    /// The codes the weight is held as (FP8, INT4, bf16); `None` for f32.
    fn held_as(&self) -> Option<QuantKind>;
}

/// `count` heads (or column blocks) of every row: head `i` occupies columns
/// `offset + i·stride .. + width`. A stride of 0 repeats one block.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HeadSpan {
    /// First column of head 0.
    pub offset: usize,
    /// Heads.
    pub count: usize,
    /// Columns between consecutive heads.
    pub stride: usize,
    /// Columns of each head the op touches.
    pub width: usize,
}

impl HeadSpan {
    /// `count` contiguous heads of `width` columns from `offset`.
    pub fn heads(offset: usize, count: usize, width: usize) -> Self {
        HeadSpan { offset, count, stride: width, width }
    }
}

/// Head layout and masking of causal attention.
#[derive(Clone, Copy, Debug)]
pub struct AttnShape {
    /// Query heads.
    pub heads: usize,
    /// Key/value heads.
    pub kv_heads: usize,
    /// Per-head width of queries and keys.
    pub head_dim: usize,
    /// Per-head width of values (and of the output); MLA's differs from `head_dim`.
    pub v_dim: usize,
    /// Which earlier positions a query sees.
    pub mask: Mask,
    /// Score scale, `head_dim^-0.5` (times YaRN's factor).
    pub scale: f32,
}

/// Positions of a sample's Gated DeltaNet chunks: chunk `c` covers
/// positions `64c .. 64c + 63`, however the sample is split into steps
/// (transformers' `chunk_size`). Fixing the grid to positions is what keeps
/// the chunked delta rule bitwise independent of `--max-batch-tokens`.
pub const DELTA_CHUNK: usize = 64;

/// The sizes of a Gated DeltaNet layer on one rank (its share of the heads).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DeltaShape {
    /// Query/key heads.
    pub k_heads: usize,
    /// Value heads, a multiple of `k_heads`: key head `i` serves value heads
    /// `i·r .. (i + 1)·r` with `r = v_heads / k_heads`.
    pub v_heads: usize,
    /// Width of a query/key head.
    pub k_dim: usize,
    /// Width of a value head.
    pub v_dim: usize,
    /// Taps of the depthwise causal conv1d (4).
    pub conv_kernel: usize,
}

impl DeltaShape {
    /// Channels of the conv1d: `[q | k | v]`, `2·k_heads·k_dim + v_heads·v_dim`.
    pub fn channels(&self) -> usize {
        2 * self.k_heads * self.k_dim + self.v_heads * self.v_dim
    }

    /// Bytes of sequence state one sample keeps in one layer between steps,
    /// at most: the recurrent state `[v_heads, k_dim, v_dim]` (32 × 128 × 128
    /// × 4 B = 2 MiB for Qwen3-Next), the conv's last `conv_kernel - 1`
    /// inputs, and the prepared rows of a chunk a step left unfinished (up to
    /// 63; counted as `DELTA_CHUNK`), all f32. The CUDA backend keeps two
    /// buffers of those rows (one read, one written per step).
    pub fn state_bytes(&self) -> usize {
        let recurrent = self.v_heads * self.k_dim * self.v_dim;
        let conv = (self.conv_kernel - 1) * self.channels();
        let rows = DELTA_CHUNK * (self.channels() + 2 * self.v_heads);
        4 * (recurrent + conv + rows)
    }
}

/// A Gated DeltaNet layer's weights of the recurrence, as
/// [`Backend::gated_delta_rule`] takes them (this rank's heads).
pub struct DeltaRule<'a, B: Backend> {
    /// The sizes.
    pub shape: DeltaShape,
    /// `A_log`, `[v_heads]`: the decay of value head `h` at a token is
    /// `g = -exp(A_log[h]) · softplus(a + dt_bias[h])`, in log space.
    pub a_log: &'a B::Vector,
    /// `dt_bias`, `[v_heads]`.
    pub dt_bias: &'a B::Vector,
    /// The gated RMSNorm's weight, `[v_dim]` (plain: `w`, not `1 + w`).
    pub norm: &'a B::Vector,
    /// Its epsilon.
    pub eps: f32,
}

/// Which positions a causal query sees beyond itself, by absolute positions
/// within its sample (so the same however a sample is chunked or packed).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mask {
    /// Every earlier position.
    Causal,
    /// The `w - 1` positions before it (Mistral, Gemma 3's local layers, gpt-oss's sliding ones).
    Sliding(usize),
    /// The earlier positions of its chunk: keys `j` with `j / c == p / c`
    /// (Llama 4's RoPE layers, `attention_chunk_size`).
    Chunked(usize),
}

impl Mask {
    /// The first key position the query at position `p` sees (it sees every one up to `p`).
    pub fn first_key(self, p: usize) -> usize {
        match self {
            Mask::Causal => 0,
            Mask::Sliding(w) => (p + 1).saturating_sub(w),
            Mask::Chunked(c) => p - p % c.max(1),
        }
    }

    /// The sliding window `w`, 0 for none, and the chunk `c`, 0 for none:
    /// what the CUDA kernels take.
    pub fn window_and_chunk(self) -> (usize, usize) {
        match self {
            Mask::Causal => (0, 0),
            Mask::Sliding(w) => (w, 0),
            Mask::Chunked(c) => (0, c),
        }
    }
}

/// Where a routed expert's router weight applies.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Gating {
    /// `w · expert(x)`: every MoE family but Llama 4.
    Output,
    /// `expert(w · x)` (Llama 4: the sigmoid of the router logit scales the expert's input).
    Input,
}

/// A pre-norm attention block of the Llama family, as one op takes it
/// ([`Backend::norm_attention_add`]): `x += o_proj(attention(rope(q_norm(q)),
/// rope(k_norm(k)), v))` with `[q | k | v] = qkv_proj(rms_norm(x))`.
pub struct AttnBlock<'a, B: Backend> {
    /// `q_proj`, `k_proj`, `v_proj` stacked: `[(heads + 2·kv_heads) · head_dim, hidden]`, column-parallel.
    pub qkv_proj: &'a B::Linear,
    /// `[hidden, heads · head_dim]`, row-parallel.
    pub o_proj: &'a B::Linear,
    /// The input norm's weight and epsilon.
    pub norm: (&'a B::Vector, f32),
    /// The q and k norms (Qwen3's per head, MiniMax-M2's over all heads).
    pub qk_norm: Option<QkNorm<'a, B>>,
    /// Heads, widths (`v_dim == head_dim`), window and scale.
    pub shape: AttnShape,
    /// gpt-oss's attention sinks: one logit per local query head in every
    /// softmax's denominator.
    pub sinks: Option<&'a B::Vector>,
    /// Columns of each q and k head RoPE rotates, from the first: `head_dim`,
    /// or fewer under a partial rotary factor (GLM-4.5's half).
    pub rotary_dim: usize,
}

/// RMSNorms of q and k before RoPE: this rank's part of their weights.
pub struct QkNorm<'a, B: Backend> {
    /// `[head_dim]`, or `[local heads · head_dim]` with `all_heads`.
    pub q: &'a B::Vector,
    /// `[head_dim]`, or `[local kv heads · head_dim]` with `all_heads`.
    pub k: &'a B::Vector,
    /// Epsilon.
    pub eps: f32,
    /// One norm over all of q's heads (and one over k's), not one per head
    /// (MiniMax-M2): under TP each rank's sums of squares are summed over the
    /// ranks before the mean is taken.
    pub all_heads: bool,
}

impl<B: Backend> AttnBlock<'_, B> {
    /// The q and k heads RoPE rotates, `rotary_dim` columns of each.
    pub fn rope_span(&self) -> HeadSpan {
        let s = self.shape;
        HeadSpan { offset: 0, count: s.heads + s.kv_heads, stride: s.head_dim, width: self.rotary_dim }
    }
}

/// [`Backend::norm_attention_add`] as the ops it is made of, one by one
/// (the default, and a backend's fallback where it cannot fuse).
#[allow(clippy::too_many_arguments)]
pub fn attention_block_ops<B: Backend, H: Dim>(
    b: &B,
    a: &AttnBlock<'_, B>,
    x: &mut Tensor<B, H>,
    normed: &mut Tensor<B, H>,
    qkv: &mut Tensor<B>,
    out: &mut Tensor<B>,
    rope: &B::RopeTable,
    batch: &PackedBatch,
    cache: &mut B::KvCache,
    layer: usize,
) {
    let (nh, nkv, hd) = (a.shape.heads, a.shape.kv_heads, a.shape.head_dim);
    b.norm_linear_forward(a.qkv_proj, x, a.norm.0, a.norm.1, normed, qkv);
    match &a.qk_norm {
        Some(n) if n.all_heads => {
            // One vector per row over all heads: sums of squares of q's and
            // k's columns, summed over the ranks (every rank holds an equal
            // share, replicated kv heads included, so the mean divides by
            // the local width times the ranks), then scaled.
            let (q, k) = (HeadSpan::heads(0, 1, nh * hd), HeadSpan::heads(nh * hd, 1, nkv * hd));
            let mut sums = Tensor::<B>::zeros(b, qkv.rows(), 2); // [T, 2]: q's, k's
            b.sum_squares_heads(qkv, q, &mut sums, 0);
            b.sum_squares_heads(qkv, k, &mut sums, 1);
            b.all_reduce(&mut sums);
            let ranks = b.world_size();
            b.scale_heads_rms(qkv, q, &sums, 0, nh * hd * ranks, n.q, n.eps);
            b.scale_heads_rms(qkv, k, &sums, 1, nkv * hd * ranks, n.k, n.eps);
        }
        Some(n) => {
            b.rms_norm_heads(qkv, HeadSpan::heads(0, nh, hd), n.q, n.eps);
            b.rms_norm_heads(qkv, HeadSpan::heads(nh * hd, nkv, hd), n.k, n.eps);
        }
        None => {}
    }
    b.rope(qkv, a.rope_span(), false, rope, batch);
    let (q, k, v) = (qkv.cols(0, nh * hd), qkv.cols(nh * hd, nkv * hd), qkv.cols((nh + nkv) * hd, nkv * hd));
    b.attention(q, k, v, a.shape, a.sinks, batch, cache, layer, out);
    b.linear_add(a.o_proj, out, x);
}

/// How an MoE router picks each token's experts (every mode of the DeepSeek family).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Router {
    /// Softmax or sigmoid scores.
    pub scoring: Scoring,
    /// Greedy, group-limited greedy, or noaux_tc.
    pub topk_method: TopkMethod,
    /// Experts per token.
    pub top_k: usize,
    /// Expert groups.
    pub n_group: usize,
    /// Groups kept per token.
    pub topk_group: usize,
    /// Normalise the chosen weights to sum to 1.
    pub norm_topk_prob: bool,
    /// Factor on every routed weight.
    pub routed_scaling_factor: f32,
}

impl Router {
    /// Whether the top-k is taken of the logits rather than of the sigmoid
    /// scores: a sigmoid router with neither groups nor a correction (Llama
    /// 4's, which takes the top-k of its logits, then their sigmoids). The
    /// same choice, as the sigmoid is monotonic, except where f32 sigmoids
    /// round equal (to 1.0 from a logit of about 17): the logits still tell
    /// those apart. The weights are the sigmoids either way.
    pub fn ranks_by_logit(&self, corrected: bool) -> bool {
        self.scoring == Scoring::Sigmoid && self.topk_method == TopkMethod::Greedy && !corrected
    }
}

/// The gated activation of an MLP, `act(gate, up)` of `[gate | up]`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Glu {
    /// SwiGLU, `silu(gate) · up` (Llama, DeepSeek).
    Silu,
    /// `gelu_tanh(gate) · up`, GELU's tanh approximation
    /// `g/2 · (1 + tanh(√(2/π) · (g + 0.044715·g³)))` (PyTorch's
    /// `gelu(approximate="tanh")`, Gemma's MLP).
    GeluTanh,
    /// gpt-oss's clamped GLU: `g = min(gate, limit)`, `u = clamp(up, ±limit)`,
    /// `(u + 1) · g · σ(alpha · g)`.
    Clamped {
        /// `swiglu_alpha`.
        alpha: f32,
        /// `swiglu_limit`.
        limit: f32,
    },
}

impl Glu {
    /// `act(gate, up)` of one element, in f32 (the definition every backend follows).
    pub fn apply(self, g: f32, u: f32) -> f32 {
        match self {
            Glu::Silu => g / (1.0 + (-g).exp()) * u,
            Glu::GeluTanh => {
                let inner = 0.797_884_6 * (g + 0.044715 * g * g * g);
                g / (1.0 + (-2.0 * inner).exp()) * u
            }
            Glu::Clamped { alpha, limit } => {
                let (g, u) = (g.min(limit), u.clamp(-limit, limit));
                (u + 1.0) * (g / (1.0 + (-alpha * g).exp()))
            }
        }
    }
}

/// A gated MLP's weights: `down_proj(act(gate, up))` of `[gate | up] = gate_up_proj(x)`.
/// Used for routed and shared experts, whose partial outputs the MoE op sums
/// before one all-reduce.
pub struct GatedLinear<B: Backend> {
    /// `gate_proj` and `up_proj` stacked: `[2·inter, hidden]` (column-parallel).
    pub gate_up_proj: B::Linear,
    /// `down_proj`: `[hidden, inter]` (row-parallel).
    pub down_proj: B::Linear,
    /// The activation between them.
    pub act: Glu,
}

impl<B: Backend> Resident for GatedLinear<B> {
    fn resident_bytes(&self) -> usize {
        self.gate_up_proj.resident_bytes() + self.down_proj.resident_bytes()
    }
}

/// The keys and values a backend keeps between the steps of a chunked sample.
pub trait KvStore: Default + Send {
    /// Checks that every continuing segment of `batch` finds exactly its
    /// earlier positions, and notes the positions this step will add.
    fn begin(&mut self, batch: &PackedBatch) -> Result<(), BackendError>;
    /// Drops the samples whose last chunk `batch` ran.
    fn retire(&mut self, batch: &PackedBatch);
    /// Samples with cached positions.
    fn len(&self) -> usize;
    /// Whether nothing is cached.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Everything a backend keeps of chunked samples between steps, by layer
/// kind: keys and values for attention layers, conv and recurrent state
/// for Gated DeltaNet layers. A [`crate::model::decoder::Block`] hands each
/// of its layers the part its kind keeps.
pub struct SeqState<B: Backend> {
    /// The attention layers' keys and values.
    pub kv: B::KvCache,
    /// The Gated DeltaNet layers' state.
    pub delta: B::DeltaState,
}

impl<B: Backend> Default for SeqState<B> {
    fn default() -> Self {
        SeqState { kv: B::KvCache::default(), delta: B::DeltaState::default() }
    }
}

impl<B: Backend> KvStore for SeqState<B> {
    fn begin(&mut self, batch: &PackedBatch) -> Result<(), BackendError> {
        self.kv.begin(batch)?;
        self.delta.begin(batch)
    }
    fn retire(&mut self, batch: &PackedBatch) {
        self.kv.retire(batch);
        self.delta.retire(batch);
    }
    fn len(&self) -> usize {
        self.kv.len().max(self.delta.len())
    }
}

/// A device a decoder runs on: its buffers, weights, kernels, KV cache and
/// collective. One value per tensor-parallel rank.
///
/// Activations are `[rows, width]` [`Tensor`]s of f32 values as the model
/// sees them (a backend may hold them otherwise); the residual stream is a
/// `Tensor<B, H>`, typed by the model's hidden dim. Ops write into buffers
/// the caller owns, so a forward allocates once per step, not per layer.
pub trait Backend: Send + Sync + Sized + 'static {
    /// The compute dtype of GEMM and attention inputs.
    type Compute: ComputeDtype;
    /// Storage of one activation buffer.
    type Storage: Send + Sync;
    /// A weight vector (norm weight, router bias), on the device.
    type Vector: Resident + Send + Sync;
    /// The token embedding table.
    type Embedding: Resident + Send + Sync;
    /// A linear layer `y = x·Wᵀ + b`, in its [`Parallel`] kind.
    type Linear: LinearInfo;
    /// cos/sin of every position of one step.
    type RopeTable;
    /// Each token's experts and weights, for one MoE layer of one step.
    type Routes;
    /// Keys and values of the attention layers, kept between steps.
    type KvCache: KvStore;
    /// The conv and recurrent state of the Gated DeltaNet layers, kept
    /// between steps: another type than [`Self::KvCache`], so a layer of one
    /// kind cannot be handed the other's state.
    type DeltaState: KvStore;

    /// The name `--backend` takes.
    const NAME: &'static str;

    /// This rank's index.
    fn rank(&self) -> usize;
    /// Ranks in this backend's tensor-parallel group.
    fn world_size(&self) -> usize;
    /// Backends for the `n` ranks of a tensor-parallel group, rank order,
    /// joined by this backend's collective.
    fn group(&self, n: usize) -> Result<Vec<Self>, BackendError>;
    /// Stops this rank's group after a failure that leaves the rank unable to
    /// join its peers' collectives (a panic): every rank waiting in one, or
    /// entering one later, fails instead of waiting forever. One rank has no
    /// peers to stop.
    fn abort_group(&self, _why: &str) {}
    /// The compute dtype.
    fn compute(&self) -> Compute {
        <Self::Compute as ComputeDtype>::COMPUTE
    }

    // Buffers.

    /// Zero-filled storage of `len` values.
    fn alloc(&self, len: usize) -> Self::Storage;
    /// Resizes storage to `len` values, keeping its allocation where it can;
    /// the contents are unspecified (every op overwrites its output).
    fn realloc(&self, s: &mut Self::Storage, len: usize);
    /// Copies host values to a new storage.
    fn upload(&self, host: &[f32]) -> Self::Storage;
    /// Copies storage back to the host; `out` has exactly its length.
    fn download(&self, s: &Self::Storage, out: &mut [f32]);

    // Weights.

    /// A weight vector.
    fn vector(&self, v: Vec<f32>) -> Self::Vector;
    /// The embedding table `[vocab, hidden]`, as stored (`dtype` little-endian bytes).
    fn embedding(&self, bytes: TensorBytes, dtype: DType, hidden: usize) -> Self::Embedding;
    /// A linear layer from this rank's block of a weight, as stored (f32,
    /// bf16, FP8 blocks or INT4 groups), with an optional bias `[rows]` of the
    /// whole layer (row-parallel) or of this rank's rows (column-parallel).
    fn linear(&self, w: LinearWeight, bias: Option<Vec<f32>>, kind: Parallel) -> Self::Linear;

    /// [`linear`](Self::linear) computed with f32 inputs whatever the compute
    /// dtype (the MoE router). The default is `linear`, for f32-only backends.
    fn linear_f32(&self, w: LinearWeight, bias: Option<Vec<f32>>, kind: Parallel) -> Self::Linear {
        self.linear(w, bias, kind)
    }

    /// Builds `n` weights with `f(i)` on threads of the backend's choosing
    /// (a layer's hundreds of experts: the CPU backend packs them in
    /// parallel). The default builds them in order on the calling thread.
    fn build_many<T: Send, E: Send>(
        &self,
        n: usize,
        f: impl Fn(usize) -> Result<T, E> + Sync + Send,
    ) -> Result<Vec<T>, E> {
        (0..n).map(f).collect()
    }

    // Ops.

    /// `out[t] = table[token t]`.
    fn embed<H: Dim>(&self, table: &Self::Embedding, batch: &PackedBatch, out: &mut Tensor<Self, H>);
    /// RMSNorm of each row of `x` (`w.len()` columns): `out[t] = x[t] / rms(x[t]) · w`.
    fn rms_norm<W: Dim>(&self, x: Cols<'_, Self>, w: &Self::Vector, eps: f32, out: &mut Tensor<Self, W>);
    /// In place: RMSNorm of each head of `heads` (Qwen3's q/k norm).
    fn rms_norm_heads(&self, x: &mut Tensor<Self>, heads: HeadSpan, w: &Self::Vector, eps: f32);
    /// `out[t, col + h]` = the sum of squares of head `h` of `heads` in row `t`
    /// (the first half of an RMSNorm whose vector is split over ranks).
    fn sum_squares_heads(&self, x: &Tensor<Self>, heads: HeadSpan, out: &mut Tensor<Self>, col: usize);
    /// In place: head `h` of row `t` times `w / sqrt(sums[t, col + h] / n + eps)`
    /// (the second half, once the sums hold every rank's `n` values).
    #[allow(clippy::too_many_arguments)]
    fn scale_heads_rms(
        &self,
        x: &mut Tensor<Self>,
        heads: HeadSpan,
        sums: &Tensor<Self>,
        col: usize,
        n: usize,
        w: &Self::Vector,
        eps: f32,
    );
    /// cos/sin (times `freqs.scale`) of positions `0..len`.
    fn rope_table(&self, freqs: &RopeFreqs, len: usize) -> Self::RopeTable;
    /// In place: rotates each head of `heads` at its token's position within
    /// its sample; pairs `(i, i + d/2)` (HF's `rotate_half`), or `(2i, 2i+1)`
    /// written back as `[evens', odds']` with `interleave` (DeepSeek).
    fn rope(
        &self,
        x: &mut Tensor<Self>,
        heads: HeadSpan,
        interleave: bool,
        table: &Self::RopeTable,
        batch: &PackedBatch,
    );
    /// `out = silu(gate) · up` of `gate_up = [gate | up]`.
    fn swiglu(&self, gate_up: &Tensor<Self>, out: &mut Tensor<Self>);
    /// `out = act(gate, up)` of `gate_up = [gate | up]`, for each [`Glu`]
    /// (`Glu::Silu` is [`Self::swiglu`]).
    fn glu(&self, act: Glu, gate_up: &Tensor<Self>, out: &mut Tensor<Self>);
    /// In place: each row's `heads` times the [`Temperature`] at its token's
    /// absolute position within its sample (Llama 4's NoPE queries).
    fn attn_temperature(&self, x: &mut Tensor<Self>, heads: HeadSpan, t: Temperature, batch: &PackedBatch);
    /// `x *= s` (Gemma's embedding scale).
    fn scale<W: Dim>(&self, x: &mut Tensor<Self, W>, s: f32);
    /// `x += y`.
    fn add<W: Dim>(&self, x: &mut Tensor<Self, W>, y: &Tensor<Self, W>);
    /// `dst[t][to head i] = src[t][from head i]` for every row.
    fn copy_heads(&self, src: &Tensor<Self>, from: HeadSpan, dst: &mut Tensor<Self>, to: HeadSpan);
    /// `out = x·Wᵀ + b`; a row-parallel layer's output is summed over ranks.
    fn linear_forward<W: Dim, V: Dim>(&self, l: &Self::Linear, x: &Tensor<Self, W>, out: &mut Tensor<Self, V>);
    /// `out = rms_norm(x, w)·Wᵀ + b`: [`Self::rms_norm`] into `normed`, then
    /// [`Self::linear_forward`]. A backend may fuse the norm into the GEMM's
    /// reading of its input (same bits), leaving `normed` unwritten.
    #[allow(clippy::too_many_arguments)]
    fn norm_linear_forward<W: Dim, V: Dim>(
        &self,
        l: &Self::Linear,
        x: &Tensor<Self, W>,
        w: &Self::Vector,
        eps: f32,
        normed: &mut Tensor<Self, W>,
        out: &mut Tensor<Self, V>,
    ) {
        self.rms_norm(x.all(), w, eps, normed);
        self.linear_forward(l, normed, out);
    }
    /// `residual += x·Wᵀ + b` (fused into the GEMM where it can be).
    fn linear_add<W: Dim, V: Dim>(&self, l: &Self::Linear, x: &Tensor<Self, W>, residual: &mut Tensor<Self, V>);
    /// `residual += swiglu(gate_up)·Wᵀ + b`: [`Self::swiglu`] into `act`, then
    /// [`Self::linear_add`]. A backend may fuse the SwiGLU into the GEMM's
    /// reading of its input (same bits), leaving `act` unwritten.
    fn swiglu_linear_add<V: Dim>(
        &self,
        l: &Self::Linear,
        gate_up: &Tensor<Self>,
        act: &mut Tensor<Self>,
        residual: &mut Tensor<Self, V>,
    ) {
        self.swiglu(gate_up, act);
        self.linear_add(l, act, residual);
    }
    /// `x += swiglu(rms_norm(x, w)·Gᵀ + g)·Dᵀ + d`: a pre-norm gated MLP's
    /// update of the residual stream, with `gate_up` `G` and `down` `D`.
    /// The default is [`Self::norm_linear_forward`] into `gate_up_out`, then
    /// [`Self::swiglu_linear_add`]: the same bits as those ops. A backend may
    /// instead keep the gate/up activations in its compute dtype (bf16, as
    /// PyTorch's bf16 run does), leaving `normed`, `gate_up_out` and `act`
    /// unwritten; the states then differ from the default's in the last bits.
    #[allow(clippy::too_many_arguments)]
    fn norm_gated_mlp_add<H: Dim>(
        &self,
        gate_up: &Self::Linear,
        down: &Self::Linear,
        w: &Self::Vector,
        eps: f32,
        x: &mut Tensor<Self, H>,
        normed: &mut Tensor<Self, H>,
        gate_up_out: &mut Tensor<Self>,
        act: &mut Tensor<Self>,
    ) {
        self.norm_linear_forward(gate_up, x, w, eps, normed, gate_up_out);
        self.swiglu_linear_add(down, gate_up_out, act, x);
    }
    /// [`AttnBlock`]'s update of the residual stream `x`, the projection's
    /// output and the attention's going to `qkv` `[T, (heads + 2·kv_heads) ·
    /// head_dim]` and `out` `[T, heads · head_dim]`, RoPE (`rotate_half`) at
    /// each token's position. The default is [`Self::norm_linear_forward`],
    /// [`Self::rms_norm_heads`], [`Self::rope`], [`Self::attention`] and
    /// [`Self::linear_add`]: the same bits as those ops. A backend may instead
    /// keep q, k and v in its compute dtype (bf16, as PyTorch's bf16 run
    /// does), leaving `normed` and `qkv` unwritten; the states then differ
    /// from the default's in the last bits.
    #[allow(clippy::too_many_arguments)]
    fn norm_attention_add<H: Dim>(
        &self,
        a: &AttnBlock<'_, Self>,
        x: &mut Tensor<Self, H>,
        normed: &mut Tensor<Self, H>,
        qkv: &mut Tensor<Self>,
        out: &mut Tensor<Self>,
        rope: &Self::RopeTable,
        batch: &PackedBatch,
        cache: &mut Self::KvCache,
        layer: usize,
    ) {
        attention_block_ops(self, a, x, normed, qkv, out, rope, batch, cache, layer);
    }
    /// Causal attention over the packed variable-length segments of `batch`:
    /// `out = softmax(q·kᵀ·scale + mask)·v` per head; with `sinks` (one logit
    /// per query head, gpt-oss), `exp(sink)` joins each row's denominator
    /// and nothing its values. A segment that
    /// continues a sample (chunked prefill) reads its earlier keys and values
    /// from `cache` (layer `layer`); a segment with more chunks to come leaves
    /// its own there.
    #[allow(clippy::too_many_arguments)]
    fn attention(
        &self,
        q: Cols<'_, Self>,
        k: Cols<'_, Self>,
        v: Cols<'_, Self>,
        shape: AttnShape,
        sinks: Option<&Self::Vector>,
        batch: &PackedBatch,
        cache: &mut Self::KvCache,
        layer: usize,
        out: &mut Tensor<Self>,
    );
    /// Depthwise causal conv1d over each segment's positions, then SiLU:
    /// `out[t, c] = silu(Σ_j w[c, j] · x[p - K + 1 + j, c])` at position `p`
    /// of token `t` within its sample (`K = shape.conv_kernel`, `w` `[C, K]`,
    /// `C = shape.channels()`, inputs before position 0 are zeros). A
    /// segment that continues a sample reads its last `K - 1` inputs from
    /// `state` (layer `layer`); a segment with more chunks to come leaves its own there.
    #[allow(clippy::too_many_arguments)]
    fn causal_conv1d(
        &self,
        x: Cols<'_, Self>,
        w: &Self::Vector,
        shape: DeltaShape,
        batch: &PackedBatch,
        state: &mut Self::DeltaState,
        layer: usize,
        out: &mut Tensor<Self>,
    );
    /// The gated delta rule of a Gated DeltaNet layer, then its gated norm.
    /// From the conv's output `qkv` `[T, C]` (`[q | k | v]`), `z` `[T,
    /// v_heads·v_dim]` and `ba` `[T, 2·v_heads]` (`[b | a]`), per value head
    /// `h` (its key head `h / r`) and token at position `p` of its sample:
    /// `q ← q·rsqrt(Σq² + 1e-6)/√k_dim`, `k ← k·rsqrt(Σk² + 1e-6)`,
    /// `β = σ(b)`, `g = -exp(A_log)·softplus(a + dt_bias)`,
    /// `S ← e^g·S`, `S ← S + k ⊗ β(v - Sᵀk)`, `o = Sᵀq` (S `[k_dim, v_dim]`,
    /// zero at position 0), then `out = rms_norm(o)·w·silu(z)` per head.
    /// Recurrence in f32 (or better) on every backend. A segment that
    /// continues a sample starts from the state its earlier chunks left in
    /// `state` (layer `layer`); a segment with more chunks to come leaves its own there.
    #[allow(clippy::too_many_arguments)]
    fn gated_delta_rule(
        &self,
        qkv: &Tensor<Self>,
        z: Cols<'_, Self>,
        ba: Cols<'_, Self>,
        rule: &DeltaRule<'_, Self>,
        batch: &PackedBatch,
        state: &mut Self::DeltaState,
        layer: usize,
        out: &mut Tensor<Self>,
    );
    /// In place: `x[t, i] *= σ(gate[t, i])` with a gate as wide as `x`, or
    /// `x[t, i] *= σ(gate[t, 0])` with a gate of one column (Qwen3-Next's
    /// attention output gate and shared-expert gate).
    fn sigmoid_mul<W: Dim>(&self, x: &mut Tensor<Self, W>, gate: Cols<'_, Self>);
    /// Each token's top-k experts and weights from the router's logits `[T, E]`
    /// (`correction`: noaux_tc's `e_score_correction_bias`).
    fn moe_route(&self, logits: &Tensor<Self>, router: &Router, correction: Option<&Self::Vector>) -> Self::Routes;
    /// `out = Σ_k w_k · expert_k(x) + shared(x)` (or, [`Gating::Input`],
    /// `Σ_k expert_k(w_k · x) + shared(x)`), summed over ranks (one all-reduce).
    #[allow(clippy::too_many_arguments)]
    fn moe_experts<H: Dim>(
        &self,
        experts: &[GatedLinear<Self>],
        shared: Option<&GatedLinear<Self>>,
        x: &Tensor<Self, H>,
        routes: &Self::Routes,
        gating: Gating,
        out: &mut Tensor<Self, H>,
    );
    /// Sums `x` over the ranks of the group, in rank order (deterministic).
    fn all_reduce<W: Dim>(&self, x: &mut Tensor<Self, W>);
    /// Ends a step (or a model's load): waits for the device and reports the
    /// first failure any op met (ops cannot return errors; a device backend
    /// records them). Host backends have nothing to report.
    fn end_step(&self) -> Result<(), BackendError> {
        Ok(())
    }
    /// Copies the whole `[T, H]` buffer into slot `slot` of host `[L, T, H]`
    /// states: at once on a host backend; a device backend copies
    /// asynchronously, while the forward goes on, and completes the copy
    /// through what [`Backend::capture_take`] returns.
    fn capture<L: Dim, H: Dim>(
        &self,
        x: &Tensor<Self, H>,
        out: &mut CapturedStates<L, H>,
        slot: usize,
    ) -> Result<(), ShapeError>;
    /// Takes a step's captures still on their way to the host: called once
    /// per step on a capturing rank, after its last [`Backend::capture`] into
    /// `out`. Running the result on `out`'s values after [`Backend::end_step`]
    /// completes them, on any thread (the pipeline's writer does it while the
    /// next step runs). `None`: nothing is pending (host backends copied already).
    fn capture_take<L: Dim, H: Dim>(&self, _out: &CapturedStates<L, H>) -> Option<PendingCopies> {
        None
    }
}
