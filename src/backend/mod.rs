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

mod attention;
mod check;
mod compute;
pub mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;
mod delta;
mod device_error;
mod error;
pub mod host;
mod kv_cache;
pub mod reference;
mod router;
mod state;
mod tensor;
mod weights;

/// Llama 4's query temperature, a config value the backend ops take ([`Backend::attn_temperature`]).
pub use crate::hf::llama4::Temperature;
pub use attention::{attention_block_ops, AttnBlock, AttnShape, Gating, HeadSpan, Mask, QkNorm};
pub use compute::{Bf16, Compute, ComputeDtype, F32};
pub use cpu::Cpu;
pub use delta::{DeltaRule, DeltaShape, DELTA_CHUNK};
pub use device_error::DeviceError;
pub use error::{BackendError, PendingCopies};
pub use kv_cache::{DeltaCache, KvCache};
pub use reference::Reference;
pub use router::Router;
pub use state::{KvStore, SeqState};
pub use tensor::{Cols, Tensor};
pub use weights::{GatedLinear, Glu, LinearInfo, Parallel, Resident};

use crate::hf::checkpoint::TensorBytes;
use crate::hf::quant::LinearWeight;
use crate::hf::RopeFreqs;
use crate::pipeline::batch::PackedBatch;
use crate::shape::{CapturedStates, DType, Dim, ShapeError};

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

    /// Whether the device has bf16 arithmetic: `--compute auto` then picks
    /// bf16 for weights stored in bf16, FP8 or INT4.
    fn native_bf16() -> bool;
    /// The kernel its GEMMs take, as the manifest records it (a resume
    /// refuses to mix kernels, whose last bits may differ).
    fn kernel(&self) -> &'static str;

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
    /// `out = act(gate, up)` of `gate_up = [gate | up]`, for each [`Glu`]
    /// (`Glu::Silu`: SwiGLU, `silu(gate) · up`).
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
    /// `residual += swiglu(gate_up)·Wᵀ + b`: [`Self::glu`] (`Glu::Silu`) into `act`, then
    /// [`Self::linear_add`]. A backend may fuse the SwiGLU into the GEMM's
    /// reading of its input (same bits), leaving `act` unwritten.
    fn swiglu_linear_add<V: Dim>(
        &self,
        l: &Self::Linear,
        gate_up: &Tensor<Self>,
        act: &mut Tensor<Self>,
        residual: &mut Tensor<Self, V>,
    ) {
        self.glu(Glu::Silu, gate_up, act);
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
