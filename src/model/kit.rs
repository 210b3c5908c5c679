//! The layer kit the families share: a layer's tensors read as stored
//! ([`Reader`]), this rank's share of a GQA layer's projections
//! ([`qkv_o`]) and of a gated MLP ([`gated`]), and zero-centred norm
//! weights ([`plus_one`]). A family's model file builds its blocks from
//! these and adds only its own quirks.

use super::shard::Split;
use super::ModelError;
use crate::backend::{Backend, GatedLinear, Glu, Parallel};
use crate::hf::checkpoint::Checkpoint;
use crate::hf::quant::{LinearWeight, QuantConfig, WeightFormat};
use std::ops::Range;

/// Reads one layer's tensors: weights as stored (bf16 stays bf16, f32/f16 as
/// f32, FP8 E4M3 blocks as codes and scales when the config declares them).
pub(crate) struct Reader<'a> {
    pub(crate) ckpt: &'a Checkpoint,
    /// `model.layers.{i}`.
    pub(crate) prefix: String,
    pub(crate) quant: Option<&'a QuantConfig>,
}

impl Reader<'_> {
    /// A vector `[n]`, whole.
    pub(crate) fn vector(&self, name: &str, n: usize) -> Result<Vec<f32>, ModelError> {
        Ok(self.ckpt.read_f32(&format!("{}.{name}", self.prefix), &[n])?)
    }
    /// Entries `r` of a vector `[n]`.
    pub(crate) fn vector_rows(&self, name: &str, n: usize, r: &Range<usize>) -> Result<Vec<f32>, ModelError> {
        Ok(self.ckpt.read_f32_block(&format!("{}.{name}", self.prefix), &[n], r.clone(), 0..1)?)
    }
    /// Block `rows × cols` of `{name}.weight` (`shape = [out, in]`).
    pub(crate) fn linear(
        &self,
        name: &str,
        shape: [usize; 2],
        rows: Range<usize>,
        cols: Range<usize>,
    ) -> Result<LinearWeight, ModelError> {
        let module = format!("{}.{name}", self.prefix);
        let format = self.quant.map_or(WeightFormat::Plain, |q| q.format_for(&module));
        Ok(self.ckpt.read_linear(&module, shape, rows, cols, format)?)
    }
}

/// A zero-centred `(1 + w)` RMSNorm weight (Gemma's, Qwen3-Next's) as the
/// plain RMSNorm op takes it: `1 + w` of the stored `w`.
pub(crate) fn plus_one(mut w: Vec<f32>) -> Vec<f32> {
    w.iter_mut().for_each(|w| *w += 1.0);
    w
}

/// This rank's share of a GQA layer's projections: `self_attn.{q,k,v}_proj`
/// stacked (its heads' rows, column-parallel, with their biases if
/// `qkv_bias`) and `self_attn.o_proj` (its heads' columns, row-parallel,
/// with its bias if `o_bias`), heads of `head_dim` over `hidden`.
pub(crate) fn qkv_o<B: Backend>(
    b: &B,
    r: &Reader<'_>,
    (hidden, head_dim): (usize, usize),
    (heads, kv_heads): (&Split, &Split),
    [qkv_bias, o_bias]: [bool; 2],
) -> Result<(B::Linear, B::Linear), ModelError> {
    let h = hidden;
    let (q_out, kv_out) = (heads.units() * head_dim, kv_heads.units() * head_dim);
    let (q_rows, kv_rows) = (heads.block(b, head_dim), kv_heads.block(b, head_dim));
    let qkv = LinearWeight::stack(vec![
        r.linear("self_attn.q_proj", [q_out, h], q_rows.clone(), 0..h)?,
        r.linear("self_attn.k_proj", [kv_out, h], kv_rows.clone(), 0..h)?,
        r.linear("self_attn.v_proj", [kv_out, h], kv_rows.clone(), 0..h)?,
    ]);
    let qkv_bias = if qkv_bias {
        let mut bias = r.vector_rows("self_attn.q_proj.bias", q_out, &q_rows)?;
        bias.extend(r.vector_rows("self_attn.k_proj.bias", kv_out, &kv_rows)?);
        bias.extend(r.vector_rows("self_attn.v_proj.bias", kv_out, &kv_rows)?);
        Some(bias)
    } else {
        None
    };
    let o_bias = if o_bias { Some(r.vector("self_attn.o_proj.bias", h)?) } else { None };
    let o_proj = r.linear("self_attn.o_proj", [h, q_out], 0..h, q_rows)?;
    Ok((b.linear(qkv, qkv_bias, Parallel::Column), b.linear(o_proj, o_bias, Parallel::Row)))
}

/// This rank's slice of a gated MLP, from its `[gate, up, down]` modules
/// (`{gate,up,down}_proj` or Mixtral's `w1`, `w3`, `w2`): its rows of gate
/// and up, stacked, and its columns of down; with biases if `bias`.
pub(crate) fn gated<B: Backend>(
    b: &B,
    r: &Reader<'_>,
    [gate, up, down]: [&str; 3],
    h: usize,
    i: usize,
    split: &Split,
    bias: bool,
) -> Result<GatedLinear<B>, ModelError> {
    let rows = split.block(b, 1); // this rank's rows of gate/up, columns of down
    let gate_up = LinearWeight::stack(vec![
        r.linear(gate, [i, h], rows.clone(), 0..h)?,
        r.linear(up, [i, h], rows.clone(), 0..h)?,
    ]);
    let (gate_up_bias, down_bias) = if bias {
        let mut b = r.vector_rows(&format!("{gate}.bias"), i, &rows)?;
        b.extend(r.vector_rows(&format!("{up}.bias"), i, &rows)?);
        (Some(b), Some(r.vector(&format!("{down}.bias"), h)?))
    } else {
        (None, None)
    };
    let down_w = r.linear(down, [h, i], 0..h, rows)?;
    Ok(GatedLinear {
        gate_up_proj: b.linear(gate_up, gate_up_bias, Parallel::Column),
        down_proj: b.linear(down_w, down_bias, Parallel::Row),
        act: Glu::Silu,
    })
}
