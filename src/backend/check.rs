//! Size checks at the entry of every op, shared by the backends. An op
//! handed buffers that do not fit is a bug in the model code, not bad input,
//! so these panic, naming the op and the axis; sizes that come from outside
//! (host data, captures) are checked with a `ShapeError` instead.

use super::{Cols, HeadSpan, LinearInfo};
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

/// Panics unless a linear layer fits its input `[rows, in]` and output `[rows, out]`.
#[track_caller]
pub(crate) fn linear(l: &impl LinearInfo, x: (usize, usize), out: (usize, usize)) {
    shape("linear", "input width", l.in_features(), x.1);
    shape("linear", "output width", l.out_features(), out.1);
    shape("linear", "tokens", x.0, out.0);
}

/// Panics unless an RMSNorm's input block, weight and output agree.
#[track_caller]
pub(crate) fn rms_norm<B: super::Backend>(x: &Cols<'_, B>, weight: usize, out: (usize, usize)) {
    shape("rms_norm", "weight", x.width, weight);
    shape("rms_norm", "output width", x.width, out.1);
    shape("rms_norm", "tokens", x.rows, out.0);
}

/// Panics unless attention's queries, keys, values and output fit the shape and the batch.
#[track_caller]
pub(crate) fn attention<B: super::Backend>(
    q: &Cols<'_, B>,
    k: &Cols<'_, B>,
    v: &Cols<'_, B>,
    s: super::AttnShape,
    batch: &crate::pipeline::batch::PackedBatch,
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
