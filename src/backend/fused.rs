//! Fused ops ([`FusedOps`]): a block's ops as one call, which a backend may
//! fuse. Each default is the ops it is made of, one by one; a fused op that
//! keeps the same bits says so, and one that does not (activations kept in
//! the compute dtype, as PyTorch's bf16 run keeps them) says where they differ.

use super::{check, AttentionOps, AttnBlock, Buffers, Glu, HeadSpan, HeadSums, LayerState, Qkv, Tensor};
use crate::pipeline::batch::PackedBatch;
use crate::shape::Dim;

/// The buffers of a pre-norm attention block ([`FusedOps::norm_attention_add`]).
pub struct AttnBufs<'a, B: Buffers, H: Dim> {
    /// `[T, H]`: the normed residual stream.
    pub normed: &'a mut Tensor<B, H>,
    /// `[T, (heads + 2·kv_heads) · head_dim]`: the projection's output.
    pub qkv: &'a mut Tensor<B>,
    /// `[T, heads · head_dim]`: the attention's output.
    pub out: &'a mut Tensor<B>,
}

/// The buffers of a pre-norm gated MLP ([`FusedOps::norm_gated_mlp_add`]).
pub struct MlpBufs<'a, B: Buffers, H: Dim> {
    /// `[T, H]`: the normed residual stream.
    pub normed: &'a mut Tensor<B, H>,
    /// `[T, 2 · inter]`: `[gate | up]`.
    pub gate_up: &'a mut Tensor<B>,
    /// `[T, inter]`: the SwiGLU.
    pub act: &'a mut Tensor<B>,
}

/// A block's ops as one call.
pub trait FusedOps: AttentionOps {
    /// `out = rms_norm(x, w)·Wᵀ + b`: [`RowOps::rms_norm`](super::RowOps::rms_norm) into `normed`, then
    /// [`RowOps::linear_forward`](super::RowOps::linear_forward). A backend may fuse the norm into the GEMM's
    /// reading of its input (same bits), leaving `normed` unwritten.
    fn norm_linear_forward<W: Dim, V: Dim>(
        &self,
        l: &Self::Linear,
        x: &Tensor<Self, W>,
        w: &Self::Vector,
        eps: f32,
        normed: &mut Tensor<Self, W>,
        out: &mut Tensor<Self, V>,
    ) {
        check::norm_linear(l, x, w, normed, out);
        self.norm_linear_forward_unchecked(l, x, w, eps, normed, out)
    }
    /// [`FusedOps::norm_linear_forward`], sizes checked.
    fn norm_linear_forward_unchecked<W: Dim, V: Dim>(
        &self,
        l: &Self::Linear,
        x: &Tensor<Self, W>,
        w: &Self::Vector,
        eps: f32,
        normed: &mut Tensor<Self, W>,
        out: &mut Tensor<Self, V>,
    ) {
        self.rms_norm_unchecked(x.all(), w, eps, normed);
        self.linear_forward_unchecked(l, normed, out);
    }

    /// `residual += swiglu(gate_up)·Wᵀ + b`: [`RowOps::glu`](super::RowOps::glu) (`Glu::Silu`) into `act`, then
    /// [`RowOps::linear_add`](super::RowOps::linear_add). A backend may fuse the SwiGLU into the GEMM's
    /// reading of its input (same bits), leaving `act` unwritten.
    fn swiglu_linear_add<V: Dim>(
        &self,
        l: &Self::Linear,
        gate_up: &Tensor<Self>,
        act: &mut Tensor<Self>,
        residual: &mut Tensor<Self, V>,
    ) {
        check::glu("swiglu", gate_up, act);
        check::linear(l, act, residual);
        self.swiglu_linear_add_unchecked(l, gate_up, act, residual)
    }
    /// [`FusedOps::swiglu_linear_add`], sizes checked.
    fn swiglu_linear_add_unchecked<V: Dim>(
        &self,
        l: &Self::Linear,
        gate_up: &Tensor<Self>,
        act: &mut Tensor<Self>,
        residual: &mut Tensor<Self, V>,
    ) {
        self.glu_unchecked(Glu::Silu, gate_up, act);
        self.linear_add_unchecked(l, act, residual);
    }

    /// `x += swiglu(rms_norm(x, w)·Gᵀ + g)·Dᵀ + d`: a pre-norm gated MLP's
    /// update of the residual stream, with `gate_up` `G` and `down` `D`.
    /// The default is [`FusedOps::norm_linear_forward`] into `bufs.gate_up`, then
    /// [`FusedOps::swiglu_linear_add`]: the same bits as those ops. A backend may
    /// instead keep the gate/up activations in its compute dtype (bf16, as
    /// PyTorch's bf16 run does), leaving `bufs` unwritten; the states then
    /// differ from the default's in the last bits.
    fn norm_gated_mlp_add<H: Dim>(
        &self,
        gate_up: &Self::Linear,
        down: &Self::Linear,
        w: &Self::Vector,
        eps: f32,
        x: &mut Tensor<Self, H>,
        bufs: MlpBufs<'_, Self, H>,
    ) {
        check::norm_linear(gate_up, x, w, bufs.normed, bufs.gate_up);
        check::glu("swiglu", bufs.gate_up, bufs.act);
        check::linear(down, bufs.act, x);
        self.norm_gated_mlp_add_unchecked(gate_up, down, w, eps, x, bufs)
    }
    /// [`FusedOps::norm_gated_mlp_add`], sizes checked.
    fn norm_gated_mlp_add_unchecked<H: Dim>(
        &self,
        gate_up: &Self::Linear,
        down: &Self::Linear,
        w: &Self::Vector,
        eps: f32,
        x: &mut Tensor<Self, H>,
        bufs: MlpBufs<'_, Self, H>,
    ) {
        self.norm_linear_forward_unchecked(gate_up, x, w, eps, bufs.normed, bufs.gate_up);
        self.swiglu_linear_add_unchecked(down, bufs.gate_up, bufs.act, x);
    }

    /// [`AttnBlock`]'s update of the residual stream `x`, the projection's
    /// output and the attention's going to `bufs.qkv` `[T, (heads + 2·kv_heads) ·
    /// head_dim]` and `bufs.out` `[T, heads · head_dim]`, RoPE (`rotate_half`) at
    /// each token's position. The default is the ops it is made of
    /// ([`attention_block_ops`]): [`FusedOps::norm_linear_forward`],
    /// [`RowOps::rms_norm_heads`](super::RowOps::rms_norm_heads) (or, over all heads,
    /// `sum_squares_heads`, `all_reduce` and `scale_heads_rms`),
    /// [`RowOps::rope`](super::RowOps::rope), [`AttentionOps::attention`] and
    /// [`RowOps::linear_add`](super::RowOps::linear_add): the same bits as those ops. A backend may instead keep q, k and v in its
    /// compute dtype (bf16, as PyTorch's bf16 run does), leaving `bufs.normed`
    /// and `bufs.qkv` unwritten; the states then differ from the default's in the last bits.
    fn norm_attention_add<H: Dim>(
        &self,
        a: &AttnBlock<'_, Self>,
        x: &mut Tensor<Self, H>,
        bufs: AttnBufs<'_, Self, H>,
        rope: &Self::RopeTable,
        batch: &PackedBatch,
        kv: LayerState<'_, Self::KvCache>,
    ) {
        check::attn_block(a, x, &bufs, rope, batch);
        self.norm_attention_add_unchecked(a, x, bufs, rope, batch, kv)
    }
    /// [`FusedOps::norm_attention_add`], sizes checked.
    fn norm_attention_add_unchecked<H: Dim>(
        &self,
        a: &AttnBlock<'_, Self>,
        x: &mut Tensor<Self, H>,
        bufs: AttnBufs<'_, Self, H>,
        rope: &Self::RopeTable,
        batch: &PackedBatch,
        kv: LayerState<'_, Self::KvCache>,
    ) {
        attention_block_unchecked(self, a, x, bufs, rope, batch, kv);
    }
}

/// [`FusedOps::norm_attention_add`] as the ops it is made of, one by one
/// (what its default runs, and a backend's reference for its fused one),
/// its sizes checked first.
pub fn attention_block_ops<B: FusedOps, H: Dim>(
    b: &B,
    a: &AttnBlock<'_, B>,
    x: &mut Tensor<B, H>,
    bufs: AttnBufs<'_, B, H>,
    rope: &B::RopeTable,
    batch: &PackedBatch,
    kv: LayerState<'_, B::KvCache>,
) {
    check::attn_block(a, x, &bufs, rope, batch);
    attention_block_unchecked(b, a, x, bufs, rope, batch, kv);
}

/// [`attention_block_ops`] once its sizes are checked: the default of
/// [`FusedOps::norm_attention_add_unchecked`], and a backend's fallback
/// where it cannot fuse.
pub(crate) fn attention_block_unchecked<B: FusedOps, H: Dim>(
    b: &B,
    a: &AttnBlock<'_, B>,
    x: &mut Tensor<B, H>,
    bufs: AttnBufs<'_, B, H>,
    rope: &B::RopeTable,
    batch: &PackedBatch,
    kv: LayerState<'_, B::KvCache>,
) {
    let AttnBufs { normed, qkv, out } = bufs;
    let (nh, nkv, hd) = (a.shape.heads, a.shape.kv_heads, a.shape.head_dim);
    b.norm_linear_forward_unchecked(a.qkv_proj, x, a.norm.0, a.norm.1, normed, qkv);
    match &a.qk_norm {
        Some(n) if n.all_heads => {
            // One vector per row over all heads: sums of squares of q's and
            // k's columns, summed over the ranks (every rank holds an equal
            // share, replicated kv heads included, so the mean divides by
            // the local width times the ranks), then scaled.
            let (q, k) = (HeadSpan::heads(0, 1, nh * hd), HeadSpan::heads(nh * hd, 1, nkv * hd));
            let mut sums = Tensor::<B>::zeros(b, qkv.rows(), 2); // [T, 2]: q's, k's
            b.sum_squares_heads_unchecked(qkv, q, &mut sums, 0);
            b.sum_squares_heads_unchecked(qkv, k, &mut sums, 1);
            b.all_reduce(&mut sums);
            let ranks = b.world_size();
            b.scale_heads_rms_unchecked(qkv, q, HeadSums { sums: &sums, col: 0, n: nh * hd * ranks }, n.q, n.eps);
            b.scale_heads_rms_unchecked(qkv, k, HeadSums { sums: &sums, col: 1, n: nkv * hd * ranks }, n.k, n.eps);
        }
        Some(n) => {
            b.rms_norm_heads_unchecked(qkv, HeadSpan::heads(0, nh, hd), n.q, n.eps);
            b.rms_norm_heads_unchecked(qkv, HeadSpan::heads(nh * hd, nkv, hd), n.k, n.eps);
        }
        None => {}
    }
    b.rope_unchecked(qkv, a.rope_span(), false, rope, batch);
    let qkv_cols =
        Qkv { q: qkv.cols(0, nh * hd), k: qkv.cols(nh * hd, nkv * hd), v: qkv.cols((nh + nkv) * hd, nkv * hd) };
    b.attention_unchecked(qkv_cols, a.shape, a.sinks, batch, kv, out);
    b.linear_add_unchecked(a.o_proj, out, x);
}
