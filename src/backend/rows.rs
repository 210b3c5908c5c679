//! Row ops: what a decoder does to each token's row on its own (the
//! embedding lookup, norms, RoPE, activations, elementwise updates) and the
//! linear layers' GEMMs.
//!
//! Each op is a provided method that checks its buffers' sizes once (the
//! `check` guards: a misfit is a bug in the model code, so it panics,
//! naming the op and the axis) and then calls its `_unchecked` twin, which
//! is what a backend implements. The twins are safe functions: "unchecked"
//! means the guard has run, not that a misfit would be undefined behaviour
//! (slice bounds and a kernel launch's own checks still hold).

use super::{check, Buffers, Cols, EmbeddingInfo, Glu, HeadSpan, Temperature, Tensor, VectorInfo, Weights};
use crate::hf::RopeFreqs;
use crate::pipeline::batch::PackedBatch;
use crate::shape::Dim;

/// What the shape guards need of a RoPE table.
pub trait RopeInfo {
    /// Half the columns of a head it rotates.
    fn half(&self) -> usize;
}

/// Per-head sums of squares and what they sum: the first half of an
/// RMSNorm whose vector is split over ranks ([`RowOps::scale_heads_rms`]).
pub struct HeadSums<'a, B: Buffers> {
    /// `[T, ≥ col + heads]`: head `h` of row `t` at `[t, col + h]`.
    pub sums: &'a Tensor<B>,
    /// The column of head 0.
    pub col: usize,
    /// Values each sum covers, over every rank (the norm's width).
    pub n: usize,
}

impl<B: Buffers> Clone for HeadSums<'_, B> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<B: Buffers> Copy for HeadSums<'_, B> {}

/// Row ops and linear layers.
pub trait RowOps: Weights {
    /// cos/sin of every position of one step.
    type RopeTable: RopeInfo + Send + Sync;

    /// `out[t] = table[token t]`.
    fn embed<H: Dim>(&self, table: &Self::Embedding, batch: &PackedBatch, out: &mut Tensor<Self, H>) {
        check::embed(batch, table.hidden(), out);
        self.embed_unchecked(table, batch, out)
    }
    /// [`RowOps::embed`], sizes checked.
    fn embed_unchecked<H: Dim>(&self, table: &Self::Embedding, batch: &PackedBatch, out: &mut Tensor<Self, H>);

    /// RMSNorm of each row of `x` (`w.len()` columns): `out[t] = x[t] / rms(x[t]) · w`.
    fn rms_norm<W: Dim>(&self, x: Cols<'_, Self>, w: &Self::Vector, eps: f32, out: &mut Tensor<Self, W>) {
        check::rms_norm(&x, w.len(), (out.rows(), out.width().size()));
        self.rms_norm_unchecked(x, w, eps, out)
    }
    /// [`RowOps::rms_norm`], sizes checked.
    fn rms_norm_unchecked<W: Dim>(&self, x: Cols<'_, Self>, w: &Self::Vector, eps: f32, out: &mut Tensor<Self, W>);

    /// In place: RMSNorm of each head of `heads` (Qwen3's q/k norm).
    fn rms_norm_heads(&self, x: &mut Tensor<Self>, heads: HeadSpan, w: &Self::Vector, eps: f32) {
        check::rms_norm_heads(x, heads, w.len());
        self.rms_norm_heads_unchecked(x, heads, w, eps)
    }
    /// [`RowOps::rms_norm_heads`], sizes checked.
    fn rms_norm_heads_unchecked(&self, x: &mut Tensor<Self>, heads: HeadSpan, w: &Self::Vector, eps: f32);

    /// `out[t, col + h]` = the sum of squares of head `h` of `heads` in row `t`
    /// (the first half of an RMSNorm whose vector is split over ranks).
    fn sum_squares_heads(&self, x: &Tensor<Self>, heads: HeadSpan, out: &mut Tensor<Self>, col: usize) {
        check::sum_squares_heads(x, heads, out, col);
        self.sum_squares_heads_unchecked(x, heads, out, col)
    }
    /// [`RowOps::sum_squares_heads`], sizes checked.
    fn sum_squares_heads_unchecked(&self, x: &Tensor<Self>, heads: HeadSpan, out: &mut Tensor<Self>, col: usize);

    /// In place: head `h` of row `t` times `w / sqrt(sums[t, col + h] / n + eps)`
    /// (the second half, once the sums hold every rank's `n` values).
    fn scale_heads_rms(
        &self,
        x: &mut Tensor<Self>,
        heads: HeadSpan,
        sums: HeadSums<'_, Self>,
        w: &Self::Vector,
        eps: f32,
    ) {
        check::scale_heads_rms(x, heads, sums.sums, sums.col, sums.n, w.len());
        self.scale_heads_rms_unchecked(x, heads, sums, w, eps)
    }
    /// [`RowOps::scale_heads_rms`], sizes checked.
    fn scale_heads_rms_unchecked(
        &self,
        x: &mut Tensor<Self>,
        heads: HeadSpan,
        sums: HeadSums<'_, Self>,
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
    ) {
        check::rope(x, heads, table.half(), batch);
        self.rope_unchecked(x, heads, interleave, table, batch)
    }
    /// [`RowOps::rope`], sizes checked.
    fn rope_unchecked(
        &self,
        x: &mut Tensor<Self>,
        heads: HeadSpan,
        interleave: bool,
        table: &Self::RopeTable,
        batch: &PackedBatch,
    );

    /// `out = act(gate, up)` of `gate_up = [gate | up]`, for each [`Glu`]
    /// (`Glu::Silu`: SwiGLU, `silu(gate) · up`).
    fn glu(&self, act: Glu, gate_up: &Tensor<Self>, out: &mut Tensor<Self>) {
        check::glu("glu", gate_up, out);
        self.glu_unchecked(act, gate_up, out)
    }
    /// [`RowOps::glu`], sizes checked.
    fn glu_unchecked(&self, act: Glu, gate_up: &Tensor<Self>, out: &mut Tensor<Self>);

    /// In place: each row's `heads` times the [`Temperature`] at its token's
    /// absolute position within its sample (Llama 4's NoPE queries).
    fn attn_temperature(&self, x: &mut Tensor<Self>, heads: HeadSpan, t: Temperature, batch: &PackedBatch) {
        check::temperature(x, heads, batch);
        self.attn_temperature_unchecked(x, heads, t, batch)
    }
    /// [`RowOps::attn_temperature`], sizes checked.
    fn attn_temperature_unchecked(&self, x: &mut Tensor<Self>, heads: HeadSpan, t: Temperature, batch: &PackedBatch);

    /// `x *= s` (Gemma's embedding scale).
    fn scale<W: Dim>(&self, x: &mut Tensor<Self, W>, s: f32);

    /// `x += y`.
    fn add<W: Dim>(&self, x: &mut Tensor<Self, W>, y: &Tensor<Self, W>) {
        check::add(x, y);
        self.add_unchecked(x, y)
    }
    /// [`RowOps::add`], sizes checked.
    fn add_unchecked<W: Dim>(&self, x: &mut Tensor<Self, W>, y: &Tensor<Self, W>);

    /// `dst[t][to head i] = src[t][from head i]` for every row.
    fn copy_heads(&self, src: &Tensor<Self>, from: HeadSpan, dst: &mut Tensor<Self>, to: HeadSpan) {
        check::copy_heads(src, from, dst, to);
        self.copy_heads_unchecked(src, from, dst, to)
    }
    /// [`RowOps::copy_heads`], sizes checked.
    fn copy_heads_unchecked(&self, src: &Tensor<Self>, from: HeadSpan, dst: &mut Tensor<Self>, to: HeadSpan);

    /// `out[i] = x[rows[i]]`: the rows a step samples, the LM head's input.
    fn gather_rows<W: Dim>(&self, x: &Tensor<Self, W>, rows: &[usize], out: &mut Tensor<Self, W>) {
        check::gather_rows(x, rows, out);
        self.gather_rows_unchecked(x, rows, out)
    }
    /// [`RowOps::gather_rows`], sizes checked.
    fn gather_rows_unchecked<W: Dim>(&self, x: &Tensor<Self, W>, rows: &[usize], out: &mut Tensor<Self, W>);

    /// In place: `x[t, i] *= σ(gate[t, i])` with a gate as wide as `x`, or
    /// `x[t, i] *= σ(gate[t, 0])` with a gate of one column (Qwen3-Next's
    /// attention output gate and shared-expert gate).
    fn sigmoid_mul<W: Dim>(&self, x: &mut Tensor<Self, W>, gate: Cols<'_, Self>) {
        check::sigmoid_mul(x, &gate);
        self.sigmoid_mul_unchecked(x, gate)
    }
    /// [`RowOps::sigmoid_mul`], sizes checked.
    fn sigmoid_mul_unchecked<W: Dim>(&self, x: &mut Tensor<Self, W>, gate: Cols<'_, Self>);

    /// `out = x·Wᵀ + b`; a row-parallel layer's output is summed over ranks.
    fn linear_forward<W: Dim, V: Dim>(&self, l: &Self::Linear, x: &Tensor<Self, W>, out: &mut Tensor<Self, V>) {
        check::linear(l, x, out);
        self.linear_forward_unchecked(l, x, out)
    }
    /// [`RowOps::linear_forward`], sizes checked.
    fn linear_forward_unchecked<W: Dim, V: Dim>(
        &self,
        l: &Self::Linear,
        x: &Tensor<Self, W>,
        out: &mut Tensor<Self, V>,
    );

    /// `residual += x·Wᵀ + b` (fused into the GEMM where it can be).
    fn linear_add<W: Dim, V: Dim>(&self, l: &Self::Linear, x: &Tensor<Self, W>, residual: &mut Tensor<Self, V>) {
        check::linear(l, x, residual);
        self.linear_add_unchecked(l, x, residual)
    }
    /// [`RowOps::linear_add`], sizes checked.
    fn linear_add_unchecked<W: Dim, V: Dim>(
        &self,
        l: &Self::Linear,
        x: &Tensor<Self, W>,
        residual: &mut Tensor<Self, V>,
    );
}
