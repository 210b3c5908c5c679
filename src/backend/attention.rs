//! Attention ([`AttentionOps`]) and its types: head spans of a packed row,
//! a layer's attention shape and mask, output gating, and the attention
//! block the fused op takes.

use super::{check, Buffers, Cols, KvStore, LayerState, RowOps, Tensor, VectorInfo, Weights};
use crate::pipeline::batch::PackedBatch;

/// Attention over packed variable-length segments, with its KV cache.
pub trait AttentionOps: RowOps {
    /// Keys and values of the attention layers, kept between steps.
    type KvCache: KvStore;

    /// Causal attention over the packed variable-length segments of `batch`:
    /// `out = softmax(q·kᵀ·scale + mask)·v` per head; with `sinks` (one logit
    /// per query head, gpt-oss), `exp(sink)` joins each row's denominator
    /// and nothing its values. A segment that continues a sample (chunked
    /// prefill) reads its earlier keys and values from `kv` (its layer's
    /// part); a segment with more chunks to come leaves its own there.
    fn attention(
        &self,
        qkv: Qkv<'_, Self>,
        shape: AttnShape,
        sinks: Option<&Self::Vector>,
        batch: &PackedBatch,
        kv: LayerState<'_, Self::KvCache>,
        out: &mut Tensor<Self>,
    ) {
        check::sinks(sinks.map(VectorInfo::len), shape);
        check::attention(&qkv.q, &qkv.k, &qkv.v, shape, batch, (out.rows(), out.width()));
        self.attention_unchecked(qkv, shape, sinks, batch, kv, out)
    }
    /// [`AttentionOps::attention`], sizes checked.
    fn attention_unchecked(
        &self,
        qkv: Qkv<'_, Self>,
        shape: AttnShape,
        sinks: Option<&Self::Vector>,
        batch: &PackedBatch,
        kv: LayerState<'_, Self::KvCache>,
        out: &mut Tensor<Self>,
    );
}

/// The queries `[T, heads · head_dim]`, keys `[T, kv_heads · head_dim]` and
/// values `[T, kv_heads · v_dim]` attention reads: column blocks of one
/// buffer or of several.
pub struct Qkv<'a, B: Buffers> {
    /// Queries.
    pub q: Cols<'a, B>,
    /// Keys.
    pub k: Cols<'a, B>,
    /// Values.
    pub v: Cols<'a, B>,
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
/// ([`super::FusedOps::norm_attention_add`]): `x += o_proj(attention(rope(q_norm(q)),
/// rope(k_norm(k)), v))` with `[q | k | v] = qkv_proj(rms_norm(x))`.
pub struct AttnBlock<'a, B: Weights> {
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
pub struct QkNorm<'a, B: Buffers> {
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

impl<B: Weights> AttnBlock<'_, B> {
    /// The q and k heads RoPE rotates, `rotary_dim` columns of each.
    pub fn rope_span(&self) -> HeadSpan {
        let s = self.shape;
        HeadSpan { offset: 0, count: s.heads + s.kv_heads, stride: s.head_dim, width: self.rotary_dim }
    }
}
