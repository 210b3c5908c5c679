//! Size checks at the entry of every op, shared by the backends. An op
//! handed buffers that do not fit is a bug in the model code, not bad input,
//! so these panic, naming the op and the axis; sizes that come from outside
//! (host data, captures) are checked with a `ShapeError` instead.

use super::{
    AttentionOps, AttnBlock, AttnBufs, Buffers, Cols, HeadSpan, LinearInfo, RopeInfo, Tensor, VectorInfo, Weights,
};
use crate::pipeline::batch::PackedBatch;
use crate::shape::{check_dim, CapturedStates, Dim, ShapeError};

/// Panics unless `actual == expected`.
#[track_caller]
pub(crate) fn shape(op: &str, axis: &str, expected: usize, actual: usize) {
    if expected != actual {
        panic!("{op}: axis {axis}: expected {expected}, got {actual}");
    }
}

/// Panics unless every head of `heads` fits a row of `width` columns.
#[track_caller]
pub(crate) fn heads(op: &str, heads: HeadSpan, width: usize) {
    let end = heads.count.checked_sub(1).map_or(0, |last| heads.offset + last * heads.stride + heads.width);
    if end > width {
        panic!("{op}: heads {heads:?} reach column {end} of a width-{width} buffer");
    }
}

/// Panics unless a linear layer fits its input `[T, in]` and output `[T, out]`.
#[track_caller]
pub(crate) fn linear<B: Buffers, W: Dim, V: Dim>(l: &impl LinearInfo, x: &Tensor<B, W>, out: &Tensor<B, V>) {
    shape("linear", "input width", l.in_features(), x.width().size());
    shape("linear", "output width", l.out_features(), out.width().size());
    shape("linear", "tokens", x.rows(), out.rows());
}

/// Panics unless the embedding's output is `[T, hidden]` for the batch's tokens.
#[track_caller]
pub(crate) fn embed<B: Buffers, H: Dim>(batch: &PackedBatch, hidden: usize, out: &Tensor<B, H>) {
    shape("embed", "tokens", batch.num_tokens(), out.rows());
    shape("embed", "hidden", hidden, out.width().size());
}

/// Panics unless `span` fits `x` and `out` has a column per head from `col`.
#[track_caller]
pub(crate) fn sum_squares_heads<B: Buffers>(x: &Tensor<B>, span: HeadSpan, out: &Tensor<B>, col: usize) {
    heads("sum_squares_heads", span, x.width());
    shape("sum_squares_heads", "tokens", x.rows(), out.rows());
    if col + span.count > out.width() {
        panic!("sum_squares_heads: columns {col}..{} of a width-{} output", col + span.count, out.width());
    }
}

/// Panics unless `sums` has a column per head from `col`, `weight` is a head
/// wide and `n` is positive.
#[track_caller]
pub(crate) fn scale_heads_rms<B: Buffers>(
    x: &Tensor<B>,
    span: HeadSpan,
    sums: &Tensor<B>,
    col: usize,
    n: usize,
    weight: usize,
) {
    heads("scale_heads_rms", span, x.width());
    shape("scale_heads_rms", "weight", span.width, weight);
    shape("scale_heads_rms", "tokens", x.rows(), sums.rows());
    if col + span.count > sums.width() || n == 0 {
        panic!("scale_heads_rms: columns {col}..{} of width-{} sums over {n} values", col + span.count, sums.width());
    }
}

/// Panics unless per-head RMSNorm's heads fit the buffer and the weight is one head wide.
#[track_caller]
pub(crate) fn rms_norm_heads<B: Buffers>(x: &Tensor<B>, span: HeadSpan, weight: usize) {
    heads("rms_norm_heads", span, x.width());
    shape("rms_norm_heads", "weight", span.width, weight);
}

/// Panics unless RoPE's heads fit the buffer, are as wide as the table rotates
/// (`2 · half` columns), and the buffer holds the batch's tokens.
#[track_caller]
pub(crate) fn rope<B: Buffers>(x: &Tensor<B>, span: HeadSpan, half: usize, batch: &PackedBatch) {
    heads("rope", span, x.width());
    shape("rope", "rotated width", 2 * half, span.width);
    shape("rope", "tokens", batch.num_tokens(), x.rows());
}

/// Panics unless the scaled heads fit the buffer, which holds the batch's tokens.
#[track_caller]
pub(crate) fn temperature<B: Buffers>(x: &Tensor<B>, span: HeadSpan, batch: &PackedBatch) {
    heads("attn_temperature", span, x.width());
    shape("attn_temperature", "tokens", batch.num_tokens(), x.rows());
}

/// Panics unless attention sinks, if any, are one per query head.
#[track_caller]
pub(crate) fn sinks(len: Option<usize>, s: super::AttnShape) {
    if let Some(n) = len {
        shape("attention", "sinks", s.heads, n);
    }
}

/// Panics unless `gate_up` is `[T, 2·I]` for `out` `[T, I]` (op `op`).
#[track_caller]
pub(crate) fn glu<B: Buffers>(op: &'static str, gate_up: &Tensor<B>, out: &Tensor<B>) {
    shape(op, "width", 2 * out.width(), gate_up.width());
    shape(op, "tokens", gate_up.rows(), out.rows());
}

/// Panics unless `x` and `y` hold as many values.
#[track_caller]
pub(crate) fn add<B: Buffers, W: Dim>(x: &Tensor<B, W>, y: &Tensor<B, W>) {
    shape("add", "elements", x.len(), y.len());
}

/// Panics unless the heads copied fit both buffers and match in count and width.
#[track_caller]
pub(crate) fn copy_heads<B: Buffers>(src: &Tensor<B>, from: HeadSpan, dst: &Tensor<B>, to: HeadSpan) {
    shape("copy_heads", "heads", from.count, to.count);
    shape("copy_heads", "head width", from.width, to.width);
    shape("copy_heads", "tokens", src.rows(), dst.rows());
    heads("copy_heads", from, src.width());
    heads("copy_heads", to, dst.width());
}

/// Panics unless `out` has a row per index, as wide as `x`, and every index is a row of `x`.
#[track_caller]
pub(crate) fn gather_rows<B: Buffers, W: Dim>(x: &Tensor<B, W>, rows: &[usize], out: &Tensor<B, W>) {
    shape("gather_rows", "rows", rows.len(), out.rows());
    shape("gather_rows", "width", x.width().size(), out.width().size());
    if let Some(&r) = rows.iter().find(|&&r| r >= x.rows()) {
        panic!("gather_rows: row {r} of a {}-row buffer", x.rows());
    }
}

/// Panics unless noaux_tc's correction has one value per expert.
#[track_caller]
pub(crate) fn correction<B: Buffers>(logits: &Tensor<B>, correction: Option<usize>) {
    if let Some(c) = correction {
        shape("moe_route", "experts", logits.width(), c);
    }
}

/// Panics unless an RMSNorm's input block, weight and output agree.
#[track_caller]
pub(crate) fn rms_norm<B: Buffers>(x: &Cols<'_, B>, weight: usize, out: (usize, usize)) {
    shape("rms_norm", "weight", x.width, weight);
    shape("rms_norm", "output width", x.width, out.1);
    shape("rms_norm", "tokens", x.rows, out.0);
}

/// Panics unless attention's queries, keys, values and output fit the shape and the batch.
#[track_caller]
pub(crate) fn attention<B: Buffers>(
    q: &Cols<'_, B>,
    k: &Cols<'_, B>,
    v: &Cols<'_, B>,
    s: super::AttnShape,
    batch: &PackedBatch,
    out: (usize, usize),
) {
    let t = batch.num_tokens();
    for (what, rows) in [("q", q.rows), ("k", k.rows), ("v", v.rows), ("out", out.0)] {
        shape("attention", what, t, rows);
    }
    shape("attention", "q width", s.heads * s.head_dim, q.width);
    shape("attention", "k width", s.kv_heads * s.head_dim, k.width);
    shape("attention", "v width", s.kv_heads * s.v_dim, v.width);
    shape("attention", "out width", s.heads * s.v_dim, out.1);
    if s.kv_heads == 0 || !s.heads.is_multiple_of(s.kv_heads) {
        panic!("attention: {} query heads do not share {} kv heads evenly", s.heads, s.kv_heads);
    }
}

/// Checks a `[rows, width]` buffer against slot `slot` of `[L, T, H]` states.
pub(crate) fn capture<L: Dim, H: Dim>(
    rows: usize,
    width: usize,
    out: &CapturedStates<L, H>,
    slot: usize,
) -> Result<(), ShapeError> {
    check_dim("capture", "tokens", out.tokens(), rows)?;
    check_dim("capture", "hidden", out.hidden(), width)?;
    if slot >= out.layers().size() {
        return Err(ShapeError::new("capture slot", "layers", out.layers().size(), slot + 1));
    }
    Ok(())
}

/// Panics unless the conv1d's input and output are `[T, C]` for the batch,
/// and its weight `[C, K]`.
#[track_caller]
pub(crate) fn conv1d<B: Buffers>(
    x: &Cols<'_, B>,
    w: usize,
    s: super::DeltaShape,
    batch: &PackedBatch,
    out: &Tensor<B>,
) {
    let c = s.channels();
    shape("causal_conv1d", "tokens", batch.num_tokens(), x.rows);
    shape("causal_conv1d", "channels", c, x.width);
    shape("causal_conv1d", "weight", c * s.conv_kernel, w);
    shape("causal_conv1d", "output tokens", x.rows, out.rows());
    shape("causal_conv1d", "output channels", c, out.width());
    if s.conv_kernel == 0 {
        panic!("causal_conv1d: a kernel of no taps");
    }
}

/// Panics unless the delta rule's inputs and output fit its shape and the batch.
#[track_caller]
pub(crate) fn delta_rule<B: Buffers>(
    qkv: &Tensor<B>,
    z: &Cols<'_, B>,
    ba: &Cols<'_, B>,
    s: super::DeltaShape,
    vectors: [usize; 3],
    batch: &PackedBatch,
    out: &Tensor<B>,
) {
    let t = batch.num_tokens();
    let op = "gated_delta_rule";
    if s.k_heads == 0 || !s.v_heads.is_multiple_of(s.k_heads) {
        panic!("{op}: {} value heads over {} key heads", s.v_heads, s.k_heads);
    }
    shape(op, "tokens", t, qkv.rows());
    shape(op, "qkv width", s.channels(), qkv.width());
    shape(op, "z tokens", t, z.rows);
    shape(op, "z width", s.v_heads * s.v_dim, z.width);
    shape(op, "ba tokens", t, ba.rows);
    shape(op, "ba width", 2 * s.v_heads, ba.width);
    shape(op, "A_log", s.v_heads, vectors[0]);
    shape(op, "dt_bias", s.v_heads, vectors[1]);
    shape(op, "norm weight", s.v_dim, vectors[2]);
    shape(op, "output tokens", t, out.rows());
    shape(op, "output width", s.v_heads * s.v_dim, out.width());
}

/// Panics unless `gate` has `x`'s rows and either its width or one column.
#[track_caller]
pub(crate) fn sigmoid_mul<B: Buffers, W: Dim>(x: &Tensor<B, W>, gate: &Cols<'_, B>) {
    shape("sigmoid_mul", "tokens", x.rows(), gate.rows);
    if gate.width != 1 {
        shape("sigmoid_mul", "gate width", x.width().size(), gate.width);
    }
}

/// Panics unless an RMSNorm of `x` fits `normed` and the linear layer reads
/// `normed` into `out`.
#[track_caller]
pub(crate) fn norm_linear<B: Weights, W: Dim, V: Dim>(
    l: &B::Linear,
    x: &Tensor<B, W>,
    w: &B::Vector,
    normed: &Tensor<B, W>,
    out: &Tensor<B, V>,
) {
    rms_norm(&x.all(), w.len(), (normed.rows(), normed.width().size()));
    linear(l, normed, out);
}

/// Panics unless a pre-norm attention block's weights fit its buffers and
/// the batch: every op of [`super::attention_block_ops`] at once.
#[track_caller]
pub(crate) fn attn_block<B: AttentionOps, H: Dim>(
    a: &AttnBlock<'_, B>,
    x: &Tensor<B, H>,
    bufs: &AttnBufs<'_, B, H>,
    rope: &B::RopeTable,
    batch: &PackedBatch,
) {
    let (nh, nkv, hd) = (a.shape.heads, a.shape.kv_heads, a.shape.head_dim);
    norm_linear::<B, H, usize>(a.qkv_proj, x, a.norm.0, bufs.normed, bufs.qkv);
    if let Some(n) = &a.qk_norm {
        let (q, k) = if n.all_heads { (nh * hd, nkv * hd) } else { (hd, hd) };
        shape("norm_attention_add", "q norm", q, n.q.len());
        shape("norm_attention_add", "k norm", k, n.k.len());
    }
    self::rope(bufs.qkv, a.rope_span(), rope.half(), batch);
    let qkv: &Tensor<B> = bufs.qkv;
    let (q, k, v) = (qkv.cols(0, nh * hd), qkv.cols(nh * hd, nkv * hd), qkv.cols((nh + nkv) * hd, nkv * hd));
    sinks(a.sinks.map(VectorInfo::len), a.shape);
    attention(&q, &k, &v, a.shape, batch, (bufs.out.rows(), bufs.out.width()));
    linear(a.o_proj, bufs.out, x);
}
