//! The hybrid linear-attention Qwen models (Qwen3-Next, Qwen3.5,
//! Qwen3.5-MoE), over any backend.
//!
//! Pre-norm residual blocks, named as in the checkpoints (`model.layers.{i}.*`):
//! `x += mixer(input_layernorm(x))`, then `x += mlp(post_attention_layernorm(x))`,
//! where the mixer is a Gated DeltaNet (`linear_attn.*`) or gated attention
//! (`self_attn.*`) as `layer_types` says, and the MLP a gated MLP or a
//! mixture of experts with a sigmoid-gated shared expert
//! (`mlp.shared_expert.*`, `mlp.shared_expert_gate`). Layer, q/k and final
//! norms are zero-centred (`1 + w`, added at load); the DeltaNet's gated
//! norm is plain.
//!
//! - Gated DeltaNet: `[q | k | v | z | b | a] = in_proj(h)` (one GEMM, the
//!   rows of either [`InProj`] layout put in this order at load), `[q | k |
//!   v] ← silu(conv1d(q | k | v))`, the gated delta rule and gated norm
//!   ([`RecurrentOps::gated_delta_rule`](crate::backend::RecurrentOps::gated_delta_rule)), then `out_proj`.
//! - Gated attention: `q_proj` holds each head's query and output gate; `x +=
//!   o_proj(attention(rope(q_norm(q)), rope(k_norm(k)), v) · σ(gate))`, RoPE
//!   over the first `rotary_dim` columns of each head.
//!
//! Tensor parallelism: key heads and value heads of the DeltaNet, query and
//! kv heads of attention, and every MLP width split over ranks (column-
//! parallel in, row-parallel out); the conv's channels follow their heads.

use super::decoder::{Block, Frame, LayerStep, Step};
use super::kit::{gated, plus_one, Reader};
use super::moe::Moe;
use super::shard::Split;
use super::ModelError;
use crate::backend::{
    AttnShape, Backend, DeltaGates, DeltaRule, DeltaShape, GatedLinear, Gating, Glu, HeadSpan, LayerState, LinearInfo,
    Mask, MlpBufs, Parallel, Qkv, Resident, Router, Tensor,
};
use crate::hf::checkpoint::Checkpoint;
use crate::hf::llama::LlamaMoe;
use crate::hf::quant::LinearWeight;
use crate::hf::qwen3_next::{InProj, LayerKind, Qwen3NextConfig};
use crate::hf::ConfigError;
use crate::shape::Dim;
use std::ops::Range;

/// How a layer splits over tensor-parallel ranks.
struct Splits {
    k_heads: Split,
    v_heads: Split,
    heads: Split,
    kv_heads: Split,
    mlp: Split,
    experts: Option<Split>,
    shared: Option<Split>,
}

impl Splits {
    fn of(c: &Qwen3NextConfig) -> Self {
        Splits {
            k_heads: Split::even("linear_num_key_heads", c.linear.k_heads),
            v_heads: Split::even("linear_num_value_heads", c.linear.v_heads),
            heads: Split::even("num_attention_heads", c.num_heads),
            kv_heads: Split::replicable("num_key_value_heads", c.num_kv_heads),
            mlp: Split::even("intermediate_size", c.intermediate_size),
            experts: c.moe.as_ref().map(|m| Split::even("moe_intermediate_size", m.intermediate_size)),
            shared: c
                .moe
                .as_ref()
                .and_then(|m| m.shared_intermediate_size)
                .map(|w| Split::even("shared_expert_intermediate_size", w)),
        }
    }
}

/// A Gated DeltaNet layer (`linear_attn.*`) of this rank's heads.
pub struct GatedDeltaNet<B: Backend> {
    /// `[q | k | v | z | b | a]` of this rank's heads: `[C + v_heads·v_dim + 2·v_heads, hidden]`, column-parallel.
    in_proj: B::Linear,
    /// `conv1d.weight`, this rank's channels: `[C, K]`.
    conv: B::Vector,
    /// `[v_heads]` each.
    a_log: B::Vector,
    dt_bias: B::Vector,
    /// The gated norm's `[v_dim]`.
    norm: B::Vector,
    /// `[hidden, v_heads·v_dim]`, row-parallel.
    out_proj: B::Linear,
    shape: DeltaShape,
    eps: f32,
}

/// This rank's rows of each part of the input projections, in the order
/// `[q | k | v | z | b | a]`: `(tensor, its shape, rows)` blocks.
fn in_proj_rows(c: &Qwen3NextConfig, kh: Range<usize>, vh: Range<usize>) -> Vec<(&'static str, usize, Range<usize>)> {
    let l = c.linear;
    let (dk, dv, r) = (l.k_dim, l.v_dim, l.v_heads / l.k_heads);
    match c.in_proj {
        InProj::Grouped => {
            // Key head g's groups: `[q | k | v (r heads) | z (r heads)]` and `[b (r) | a (r)]`.
            let (gw, qkvz_rows) = (2 * dk + 2 * r * dv, l.k_heads * (2 * dk + 2 * r * dv));
            let ba_rows = l.k_heads * 2 * r;
            let part = |at: usize, w: usize| {
                kh.clone().map(move |g| ("in_proj_qkvz", qkvz_rows, g * gw + at..g * gw + at + w))
            };
            let ba = |at: usize| kh.clone().map(move |g| ("in_proj_ba", ba_rows, g * 2 * r + at..g * 2 * r + at + r));
            let mut out: Vec<_> = part(0, dk).collect();
            out.extend(part(dk, dk));
            out.extend(part(2 * dk, r * dv));
            out.extend(part(2 * dk + r * dv, r * dv));
            out.extend(ba(0));
            out.extend(ba(r));
            out
        }
        InProj::Split => {
            let qkv_rows = 2 * l.k_heads * dk + l.v_heads * dv;
            let kd = l.k_heads * dk;
            vec![
                ("in_proj_qkv", qkv_rows, kh.start * dk..kh.end * dk),
                ("in_proj_qkv", qkv_rows, kd + kh.start * dk..kd + kh.end * dk),
                ("in_proj_qkv", qkv_rows, 2 * kd + vh.start * dv..2 * kd + vh.end * dv),
                ("in_proj_z", l.v_heads * dv, vh.start * dv..vh.end * dv),
                ("in_proj_b", l.v_heads, vh.clone()),
                ("in_proj_a", l.v_heads, vh),
            ]
        }
    }
}

impl<B: Backend> GatedDeltaNet<B> {
    fn load(b: &B, c: &Qwen3NextConfig, r: &Reader<'_>, s: &Splits) -> Result<Self, ModelError> {
        let (l, h) = (c.linear, c.hidden_size);
        let (kh, vh) = (s.k_heads.block(b, 1), s.v_heads.block(b, 1));
        let parts = in_proj_rows(c, kh.clone(), vh.clone());
        let in_proj = LinearWeight::stack(
            parts
                .into_iter()
                .map(|(name, rows, block)| r.linear(&format!("linear_attn.{name}"), [rows, h], block, 0..h))
                .collect::<Result<_, _>>()?,
        );
        // The conv's channels `[q | k | v]` (in this order in both layouts), this rank's heads'.
        let channels = 2 * l.k_heads * l.k_dim + l.v_heads * l.v_dim;
        let k = l.conv_kernel;
        let name = format!("{}.linear_attn.conv1d.weight", r.prefix);
        let all = r.ckpt.read_f32(&name, &[channels, 1, k])?;
        let kd = l.k_heads * l.k_dim;
        let mut conv = Vec::new();
        for block in [kh.start * l.k_dim..kh.end * l.k_dim, kd + kh.start * l.k_dim..kd + kh.end * l.k_dim] {
            conv.extend_from_slice(&all[block.start * k..block.end * k]);
        }
        conv.extend_from_slice(&all[(2 * kd + vh.start * l.v_dim) * k..(2 * kd + vh.end * l.v_dim) * k]);
        let shape = DeltaShape { k_heads: kh.len(), v_heads: vh.len(), k_dim: l.k_dim, v_dim: l.v_dim, conv_kernel: k };
        let value_width = l.v_heads * l.v_dim;
        let out_cols = vh.start * l.v_dim..vh.end * l.v_dim;
        Ok(GatedDeltaNet {
            in_proj: b.linear(in_proj, None, Parallel::Column),
            conv: b.vector(conv),
            a_log: b.vector(r.vector_rows("linear_attn.A_log", l.v_heads, &vh)?),
            dt_bias: b.vector(r.vector_rows("linear_attn.dt_bias", l.v_heads, &vh)?),
            norm: b.vector(r.vector("linear_attn.norm.weight", l.v_dim)?),
            out_proj: b.linear(
                r.linear("linear_attn.out_proj", [h, value_width], 0..h, out_cols)?,
                None,
                Parallel::Row,
            ),
            shape,
            eps: c.rms_norm_eps,
        })
    }

    /// `x += out_proj(gated_norm(delta_rule(silu(conv1d(q | k | v))), z))` of `in_proj(norm(x))`.
    fn forward_add<H: Dim>(
        &self,
        b: &B,
        (norm, eps): (&B::Vector, f32),
        x: &mut Tensor<B, H>,
        step: &Step<'_, B>,
        s: &mut Scratch<B, H>,
        mut state: LayerState<'_, B::DeltaState>,
    ) {
        let sh = self.shape;
        let (t, c, vw) = (x.rows(), sh.channels(), sh.v_heads * sh.v_dim);
        s.proj.resize(b, t, c + vw + 2 * sh.v_heads);
        s.mixed.resize(b, t, c);
        s.out.resize(b, t, vw);
        b.norm_linear_forward(&self.in_proj, x, norm, eps, &mut s.normed, &mut s.proj);
        b.causal_conv1d(s.proj.cols(0, c), &self.conv, sh, step.batch, state.reborrow(), &mut s.mixed);
        let rule = DeltaRule { shape: sh, a_log: &self.a_log, dt_bias: &self.dt_bias, norm: &self.norm, eps: self.eps };
        let gates = DeltaGates { z: s.proj.cols(c, vw), ba: s.proj.cols(c + vw, 2 * sh.v_heads) };
        b.gated_delta_rule(&s.mixed, gates, &rule, step.batch, state, &mut s.out);
        b.linear_add(&self.out_proj, &s.out, x);
    }

    fn weight_bytes(&self) -> usize {
        [&self.conv, &self.a_log, &self.dt_bias, &self.norm].iter().map(|v| v.resident_bytes()).sum::<usize>()
            + self.in_proj.resident_bytes()
            + self.out_proj.resident_bytes()
    }
}

/// Gated self-attention (`self_attn.*`) of this rank's heads.
pub struct GatedAttention<B: Backend> {
    /// `[q | k | v | gate]`: `[(2·heads + 2·kv_heads) · head_dim, hidden]`, column-parallel.
    qkvg_proj: B::Linear,
    /// `[hidden, heads · head_dim]`, row-parallel.
    o_proj: B::Linear,
    /// `1 + w` of `q_norm` and `k_norm`, `[head_dim]`.
    q_norm: B::Vector,
    k_norm: B::Vector,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    rotary_dim: usize,
    eps: f32,
}

impl<B: Backend> GatedAttention<B> {
    fn load(b: &B, c: &Qwen3NextConfig, r: &Reader<'_>, s: &Splits) -> Result<Self, ModelError> {
        let (h, hd) = (c.hidden_size, c.head_dim);
        let (heads, kv) = (s.heads.block(b, 1), s.kv_heads.block(b, hd));
        // q_proj holds head i's query at rows 2i·hd .. (2i + 1)·hd and its gate after it.
        let q_rows = 2 * c.num_heads * hd;
        let per_head = |at: usize| heads.clone().map(move |i| 2 * i * hd + at..2 * i * hd + at + hd);
        let mut parts = Vec::new();
        for rows in per_head(0) {
            parts.push(r.linear("self_attn.q_proj", [q_rows, h], rows, 0..h)?);
        }
        let kv_out = c.num_kv_heads * hd;
        parts.push(r.linear("self_attn.k_proj", [kv_out, h], kv.clone(), 0..h)?);
        parts.push(r.linear("self_attn.v_proj", [kv_out, h], kv.clone(), 0..h)?);
        for rows in per_head(hd) {
            parts.push(r.linear("self_attn.q_proj", [q_rows, h], rows, 0..h)?);
        }
        let bias = if c.attention_bias {
            let mut bias = Vec::new();
            for rows in per_head(0) {
                bias.extend(r.vector_rows("self_attn.q_proj.bias", q_rows, &rows)?);
            }
            bias.extend(r.vector_rows("self_attn.k_proj.bias", kv_out, &kv)?);
            bias.extend(r.vector_rows("self_attn.v_proj.bias", kv_out, &kv)?);
            for rows in per_head(hd) {
                bias.extend(r.vector_rows("self_attn.q_proj.bias", q_rows, &rows)?);
            }
            Some(bias)
        } else {
            None
        };
        let o_bias = if c.attention_bias { Some(r.vector("self_attn.o_proj.bias", h)?) } else { None };
        let o_cols = heads.start * hd..heads.end * hd;
        Ok(GatedAttention {
            qkvg_proj: b.linear(LinearWeight::stack(parts), bias, Parallel::Column),
            o_proj: b.linear(r.linear("self_attn.o_proj", [h, c.num_heads * hd], 0..h, o_cols)?, o_bias, Parallel::Row),
            q_norm: b.vector(plus_one(r.vector("self_attn.q_norm.weight", hd)?)),
            k_norm: b.vector(plus_one(r.vector("self_attn.k_norm.weight", hd)?)),
            heads: heads.len(),
            kv_heads: s.kv_heads.local(b),
            head_dim: hd,
            rotary_dim: c.rotary_dim,
            eps: c.rms_norm_eps,
        })
    }

    /// `x += o_proj(attention(rope(q_norm(q)), rope(k_norm(k)), v) · σ(gate))` of `qkvg_proj(norm(x))`.
    fn forward_add<H: Dim>(
        &self,
        b: &B,
        (norm, eps): (&B::Vector, f32),
        x: &mut Tensor<B, H>,
        step: &Step<'_, B>,
        s: &mut Scratch<B, H>,
        kv: LayerState<'_, B::KvCache>,
    ) {
        let (nh, nkv, hd) = (self.heads, self.kv_heads, self.head_dim);
        let t = x.rows();
        s.proj.resize(b, t, (2 * nh + 2 * nkv) * hd);
        s.out.resize(b, t, nh * hd);
        b.norm_linear_forward(&self.qkvg_proj, x, norm, eps, &mut s.normed, &mut s.proj);
        b.rms_norm_heads(&mut s.proj, HeadSpan::heads(0, nh, hd), &self.q_norm, self.eps);
        b.rms_norm_heads(&mut s.proj, HeadSpan::heads(nh * hd, nkv, hd), &self.k_norm, self.eps);
        let span = HeadSpan { offset: 0, count: nh + nkv, stride: hd, width: self.rotary_dim };
        b.rope(&mut s.proj, span, false, step.rope, step.batch);
        let shape = AttnShape {
            heads: nh,
            kv_heads: nkv,
            head_dim: hd,
            v_dim: hd,
            mask: Mask::Causal,
            scale: (hd as f32).powf(-0.5),
        };
        let p = &s.proj;
        let (q, k, v) = (p.cols(0, nh * hd), p.cols(nh * hd, nkv * hd), p.cols((nh + nkv) * hd, nkv * hd));
        b.attention(Qkv { q, k, v }, shape, None, step.batch, kv, &mut s.out);
        b.sigmoid_mul(&mut s.out, p.cols((nh + 2 * nkv) * hd, nh * hd));
        b.linear_add(&self.o_proj, &s.out, x);
    }

    fn weight_bytes(&self) -> usize {
        self.qkvg_proj.resident_bytes()
            + self.o_proj.resident_bytes()
            + self.q_norm.resident_bytes()
            + self.k_norm.resident_bytes()
    }
}

/// A layer's token mixer.
pub enum Mixer<B: Backend> {
    /// Gated DeltaNet.
    Linear(GatedDeltaNet<B>),
    /// Gated attention.
    Full(GatedAttention<B>),
}

/// A mixture of experts whose shared expert is scaled by `σ(shared_expert_gate(h))`.
pub struct GatedMoe<B: Backend> {
    /// The routed experts (no shared expert in it).
    moe: Moe<B>,
    /// `mlp.shared_expert`.
    shared_expert: GatedLinear<B>,
    /// `mlp.shared_expert_gate`, `[1, hidden]`, replicated.
    shared_expert_gate: B::Linear,
}

/// The feed-forward block of a layer.
pub enum Ffn<B: Backend> {
    /// A gated MLP.
    Dense(GatedLinear<B>),
    /// A mixture of experts with a gated shared expert.
    Moe(GatedMoe<B>),
}

/// The routed experts of a layer: `mlp.experts.{j}.{gate,up,down}_proj`
/// (Qwen3-Next), or the fused `mlp.experts.gate_up_proj` `[E, 2·inter,
/// hidden]` and `mlp.experts.down_proj` `[E, hidden, inter]` (Qwen3.5-MoE).
fn load_experts<B: Backend>(
    b: &B,
    c: &Qwen3NextConfig,
    m: &LlamaMoe,
    r: &Reader<'_>,
    split: &Split,
) -> Result<Vec<GatedLinear<B>>, ModelError> {
    let (h, e, i) = (c.hidden_size, m.experts, m.intermediate_size);
    let fused = format!("{}.mlp.experts.gate_up_proj", r.prefix);
    if !r.ckpt.contains(&fused) {
        return b.build_many(e, |j| {
            let [g, u, d] = ["gate_proj", "up_proj", "down_proj"].map(|n| format!("mlp.experts.{j}.{n}"));
            gated(b, r, [&g, &u, &d], h, i, split, false)
        });
    }
    let down = format!("{}.mlp.experts.down_proj", r.prefix);
    let cols = split.block(b, 1);
    let rows: Vec<usize> = cols.clone().chain(cols.clone().map(|c| c + i)).collect();
    let all: Vec<usize> = (0..h).collect();
    b.build_many(e, |x| {
        Ok(GatedLinear {
            gate_up_proj: b.linear(
                r.ckpt.read_expert_rows(&fused, [e, 2 * i, h], x, &rows, 0..h)?,
                None,
                Parallel::Column,
            ),
            down_proj: b.linear(r.ckpt.read_expert_rows(&down, [e, h, i], x, &all, cols.clone())?, None, Parallel::Row),
            act: Glu::Silu,
        })
    })
}

impl<B: Backend> Ffn<B> {
    fn load(b: &B, c: &Qwen3NextConfig, r: &Reader<'_>, s: &Splits, l: usize) -> Result<Self, ModelError> {
        let h = c.hidden_size;
        let names = ["gate_proj", "up_proj", "down_proj"];
        let Some(m) = c.moe.as_ref().filter(|m| m.sparse[l]) else {
            let [g, u, d] = names.map(|n| format!("mlp.{n}"));
            return Ok(Ffn::Dense(gated(b, r, [&g, &u, &d], h, c.intermediate_size, &s.mlp, false)?));
        };
        let split = s.experts.as_ref().expect("a mixture's config has an expert width");
        let experts = load_experts(b, c, m, r, split)?;
        let e = m.experts;
        let gate = b.linear_f32(r.linear("mlp.gate", [e, h], 0..e, 0..h)?, None, Parallel::Replicated);
        let router = Router {
            scoring: m.scoring,
            topk_method: m.topk_method,
            top_k: m.top_k,
            n_group: m.n_group,
            topk_group: m.topk_group,
            norm_topk_prob: m.norm_topk_prob,
            routed_scaling_factor: m.routed_scaling_factor,
        };
        let moe =
            Moe { gate, e_score_correction_bias: None, router, experts, shared_experts: None, gating: Gating::Output };
        let [g, u, d] = names.map(|n| format!("mlp.shared_expert.{n}"));
        let width = m.shared_intermediate_size.expect("set for these configs");
        let shared_split = s.shared.as_ref().expect("set with the width");
        let shared_expert = gated(b, r, [&g, &u, &d], h, width, shared_split, false)?;
        let shared_expert_gate =
            b.linear(r.linear("mlp.shared_expert_gate", [1, h], 0..1, 0..h)?, None, Parallel::Replicated);
        Ok(Ffn::Moe(GatedMoe { moe, shared_expert, shared_expert_gate }))
    }

    /// `x += ffn(norm(x))`.
    fn forward_add<H: Dim>(&self, b: &B, (norm, eps): (&B::Vector, f32), x: &mut Tensor<B, H>, s: &mut Scratch<B, H>) {
        match self {
            Ffn::Dense(m) => {
                let w = m.down_proj.in_features();
                s.gate_up.resize(b, x.rows(), 2 * w);
                s.act.resize(b, x.rows(), w);
                b.norm_gated_mlp_add(
                    &m.gate_up_proj,
                    &m.down_proj,
                    norm,
                    eps,
                    x,
                    MlpBufs { normed: &mut s.normed, gate_up: &mut s.gate_up, act: &mut s.act },
                );
            }
            Ffn::Moe(m) => {
                let t = x.rows();
                b.rms_norm(x.all(), norm, eps, &mut s.normed);
                s.ffn.resize(b, t, x.width());
                m.moe.forward(b, &s.normed, &mut s.ffn, &mut s.logits);
                // σ(shared_expert_gate(h)) · shared_expert(h), added to the routed experts' sum.
                let se = &m.shared_expert;
                let w = se.down_proj.in_features();
                s.gate_up.resize(b, t, 2 * w);
                s.act.resize(b, t, w);
                s.shared.resize(b, t, x.width());
                s.gate.resize(b, t, 1);
                b.linear_forward(&se.gate_up_proj, &s.normed, &mut s.gate_up);
                b.glu(Glu::Silu, &s.gate_up, &mut s.act);
                b.linear_forward(&se.down_proj, &s.act, &mut s.shared);
                b.linear_forward(&m.shared_expert_gate, &s.normed, &mut s.gate);
                b.sigmoid_mul(&mut s.shared, s.gate.all());
                b.add(&mut s.ffn, &s.shared);
                b.add(x, &s.ffn);
            }
        }
    }

    fn weight_bytes(&self) -> usize {
        match self {
            Ffn::Dense(m) => m.resident_bytes(),
            Ffn::Moe(m) => {
                m.moe.weight_bytes() + m.shared_expert.resident_bytes() + m.shared_expert_gate.resident_bytes()
            }
        }
    }
}

/// One decoder layer (`model.layers.{i}.*`).
pub struct DecoderLayer<B: Backend> {
    /// `1 + w`.
    input_layernorm: B::Vector,
    mixer: Mixer<B>,
    /// `1 + w`.
    post_attention_layernorm: B::Vector,
    mlp: Ffn<B>,
    eps: f32,
}

/// Buffers of one step, shared by every layer (resized to each layer's widths).
pub struct Scratch<B: Backend, H: Dim> {
    /// A norm of the residual stream, `[T, H]`.
    normed: Tensor<B, H>,
    /// The mixer's input projection, `[T, proj]`.
    proj: Tensor<B>,
    /// The conv's output `[T, C]`.
    mixed: Tensor<B>,
    /// The mixer's output before its output projection.
    out: Tensor<B>,
    /// The MLP's `[T, 2·inter]`, `[T, inter]`.
    gate_up: Tensor<B>,
    act: Tensor<B>,
    /// A mixture's router logits `[T, experts]`, its output `[T, H]`, the
    /// shared expert's `[T, H]` and its gate's logit `[T, 1]`.
    logits: Tensor<B>,
    ffn: Tensor<B, H>,
    shared: Tensor<B, H>,
    gate: Tensor<B>,
}

impl<B: Backend> Block<B> for DecoderLayer<B> {
    type Config = Qwen3NextConfig;
    type Scratch<H: Dim> = Scratch<B, H>;

    fn parse_config(text: &str) -> Result<Qwen3NextConfig, ConfigError> {
        Qwen3NextConfig::from_json(text)
    }

    fn frame(c: &Qwen3NextConfig) -> Frame {
        let frame = Frame::plain(c.info(), c.rms_norm_eps, c.rope_freqs(), c.tensor_prefix.clone(), 0);
        Frame { norm_offset: 1.0, tied_embeddings: c.tie_word_embeddings, ..frame }
    }

    fn splits(c: &Qwen3NextConfig) -> Vec<Split> {
        let s = Splits::of(c);
        let has = |k: LayerKind| c.layer_types.contains(&k);
        let dense = c.moe.as_ref().is_none_or(|m| m.sparse.contains(&false));
        let linear = has(LayerKind::Linear).then_some([s.k_heads, s.v_heads]).into_iter().flatten();
        let full = has(LayerKind::Full).then_some([s.heads, s.kv_heads]).into_iter().flatten();
        linear.chain(full).chain(dense.then_some(s.mlp)).chain(s.experts).chain(s.shared).collect()
    }

    fn sequence_state_bytes(c: &Qwen3NextConfig) -> usize {
        let l = c.linear;
        let shape = DeltaShape {
            k_heads: l.k_heads,
            v_heads: l.v_heads,
            k_dim: l.k_dim,
            v_dim: l.v_dim,
            conv_kernel: l.conv_kernel,
        };
        c.layer_types.iter().filter(|&&k| k == LayerKind::Linear).count() * shape.state_bytes()
    }

    fn load(b: &B, c: &Qwen3NextConfig, ckpt: &Checkpoint, l: usize) -> Result<Self, ModelError> {
        let s = Splits::of(c);
        let r = Reader { ckpt, prefix: format!("model.layers.{l}"), quant: None };
        let h = c.hidden_size;
        Ok(DecoderLayer {
            input_layernorm: b.vector(plus_one(r.vector("input_layernorm.weight", h)?)),
            mixer: match c.layer_types[l] {
                LayerKind::Linear => Mixer::Linear(GatedDeltaNet::load(b, c, &r, &s)?),
                LayerKind::Full => Mixer::Full(GatedAttention::load(b, c, &r, &s)?),
            },
            post_attention_layernorm: b.vector(plus_one(r.vector("post_attention_layernorm.weight", h)?)),
            mlp: Ffn::load(b, c, &r, &s, l)?,
            eps: c.rms_norm_eps,
        })
    }

    fn scratch<H: Dim>(b: &B, _c: &Qwen3NextConfig, t: usize, hidden: H) -> Scratch<B, H> {
        Scratch {
            normed: Tensor::zeros(b, t, hidden),
            proj: Tensor::empty(b, 0),
            mixed: Tensor::empty(b, 0),
            out: Tensor::empty(b, 0),
            gate_up: Tensor::empty(b, 0),
            act: Tensor::empty(b, 0),
            logits: Tensor::empty(b, 0),
            ffn: Tensor::empty(b, hidden),
            shared: Tensor::empty(b, hidden),
            gate: Tensor::empty(b, 1),
        }
    }

    fn forward<H: Dim>(&self, b: &B, x: &mut Tensor<B, H>, at: LayerStep<'_, B, Scratch<B, H>>) {
        let LayerStep { step, scratch: s, state: cache, index } = at;
        // x += mixer(input_layernorm(x)): each kind of layer keeps its own kind of state.
        let norm = (&self.input_layernorm, self.eps);
        match &self.mixer {
            Mixer::Linear(m) => m.forward_add(b, norm, x, step, s, LayerState::new(&mut cache.delta, index)),
            Mixer::Full(m) => m.forward_add(b, norm, x, step, s, LayerState::new(&mut cache.kv, index)),
        }
        // x += mlp(post_attention_layernorm(x))
        self.mlp.forward_add(b, (&self.post_attention_layernorm, self.eps), x, s);
    }

    fn weight_bytes(&self) -> usize {
        let mixer = match &self.mixer {
            Mixer::Linear(m) => m.weight_bytes(),
            Mixer::Full(m) => m.weight_bytes(),
        };
        self.input_layernorm.resident_bytes()
            + mixer
            + self.post_attention_layernorm.resident_bytes()
            + self.mlp.weight_bytes()
    }
}
