//! The Gated DeltaNet ops ([`RecurrentOps`]) and their types: the chunk
//! grid, a layer's sizes, and the weights of its recurrence.

use super::{check, Buffers, Cols, KvStore, LayerState, RowOps, Tensor, VectorInfo};
use crate::pipeline::batch::PackedBatch;

/// The recurrent layers of a Gated DeltaNet hybrid, with their state.
pub trait RecurrentOps: RowOps {
    /// The conv and recurrent state of the Gated DeltaNet layers, kept
    /// between steps: another type than [`super::AttentionOps::KvCache`], so
    /// a layer of one kind cannot be handed the other's state.
    type DeltaState: KvStore;

    /// Depthwise causal conv1d over each segment's positions, then SiLU:
    /// `out[t, c] = silu(Σ_j w[c, j] · x[p - K + 1 + j, c])` at position `p`
    /// of token `t` within its sample (`K = shape.conv_kernel`, `w` `[C, K]`,
    /// `C = shape.channels()`, inputs before position 0 are zeros). A
    /// segment that continues a sample reads its last `K - 1` inputs from
    /// `state` (its layer's part); a segment with more chunks to come leaves its own there.
    fn causal_conv1d(
        &self,
        x: Cols<'_, Self>,
        w: &Self::Vector,
        shape: DeltaShape,
        batch: &PackedBatch,
        state: LayerState<'_, Self::DeltaState>,
        out: &mut Tensor<Self>,
    ) {
        check::conv1d(&x, w.len(), shape, batch, out);
        self.causal_conv1d_unchecked(x, w, shape, batch, state, out)
    }
    /// [`RecurrentOps::causal_conv1d`], sizes checked.
    fn causal_conv1d_unchecked(
        &self,
        x: Cols<'_, Self>,
        w: &Self::Vector,
        shape: DeltaShape,
        batch: &PackedBatch,
        state: LayerState<'_, Self::DeltaState>,
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
    /// `state` (its layer's part); a segment with more chunks to come leaves its own there.
    fn gated_delta_rule(
        &self,
        qkv: &Tensor<Self>,
        gates: DeltaGates<'_, Self>,
        rule: &DeltaRule<'_, Self>,
        batch: &PackedBatch,
        state: LayerState<'_, Self::DeltaState>,
        out: &mut Tensor<Self>,
    ) {
        let (sh, vectors) = (rule.shape, [rule.a_log.len(), rule.dt_bias.len(), rule.norm.len()]);
        check::delta_rule(qkv, &gates.z, &gates.ba, sh, vectors, batch, out);
        self.gated_delta_rule_unchecked(qkv, gates, rule, batch, state, out)
    }
    /// [`RecurrentOps::gated_delta_rule`], sizes checked.
    fn gated_delta_rule_unchecked(
        &self,
        qkv: &Tensor<Self>,
        gates: DeltaGates<'_, Self>,
        rule: &DeltaRule<'_, Self>,
        batch: &PackedBatch,
        state: LayerState<'_, Self::DeltaState>,
        out: &mut Tensor<Self>,
    );
}

/// The per-token gates of a Gated DeltaNet layer, from its input projections.
pub struct DeltaGates<'a, B: Buffers> {
    /// `[T, v_heads · v_dim]`: the output gate, `silu(z)`.
    pub z: Cols<'a, B>,
    /// `[T, 2 · v_heads]`: `[b | a]`, the write strength and the decay's input.
    pub ba: Cols<'a, B>,
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
/// [`RecurrentOps::gated_delta_rule`] takes them (this rank's heads).
pub struct DeltaRule<'a, B: Buffers> {
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
