//! Llama 4's text decoder (`llama4_text`, and the text model of `llama4`:
//! Scout, Maverick), over any backend.
//!
//! Pre-norm residual blocks, named as in the checkpoints (`model.layers.{i}.*`):
//! `x += self_attn(input_layernorm(x))`, then `x += feed_forward(post_attention_layernorm(x))`.
//! Attention is GQA; on RoPE layers q and k are rotated as complex pairs
//! (adjacent columns), then (`use_qk_norm`) RMS-normed without a weight, and
//! the layer attends within chunks of `attention_chunk_size` positions; NoPE
//! layers attend to every earlier position and scale q by the attention
//! temperature of its absolute position. `feed_forward` is a dense gated MLP
//! (`intermediate_size_mlp` wide) or a mixture of experts: a shared expert
//! (`feed_forward.shared_expert.*`) plus the routed ones (`feed_forward.experts.
//! gate_up_proj [E, hidden, 2·inter]`, gate in the first half, and `down_proj
//! [E, inter, hidden]`), chosen by the top-k of the router's logits
//! (`feed_forward.router`), each routed expert's INPUT scaled by the sigmoid
//! of its logit. No LM head.
//!
//! Tensor parallelism is the Llama family's: heads divided (kv heads
//! replicated when fewer), q/k/v and gate/up column-parallel, o_proj and
//! down_proj row-parallel, each expert's width divided.

use super::decoder::{Block, Frame, LayerStep, Step};
use super::kit::{gated, qkv_o, Reader};
use super::moe::Moe;
use super::shard::Split;
use super::ModelError;
use crate::backend::{
    AttnShape, Backend, GatedLinear, Gating, Glu, HeadSpan, LayerState, LinearInfo, Mask, MlpBufs, Parallel, Qkv,
    Resident, Router, Tensor,
};
use crate::hf::checkpoint::Checkpoint;
use crate::hf::llama4::{Llama4Config, Llama4Layer, Temperature};
use crate::hf::moe::{Scoring, TopkMethod};
use crate::hf::ConfigError;
use crate::shape::Dim;

/// How a layer splits over tensor-parallel ranks.
struct Splits {
    heads: Split,
    kv_heads: Split,
    /// The dense MLP's width.
    mlp: Split,
    /// Each routed expert's width, and the shared expert's.
    experts: Split,
}

impl Splits {
    fn of(c: &Llama4Config) -> Self {
        Splits {
            heads: Split::even("num_attention_heads", c.num_heads),
            kv_heads: Split::replicable("num_key_value_heads", c.num_kv_heads),
            mlp: Split::even("intermediate_size_mlp", c.intermediate_size_mlp),
            experts: Split::even("intermediate_size", c.intermediate_size),
        }
    }
}

/// Self-attention (`self_attn.*`) of this rank's heads.
pub struct Attention<B: Backend> {
    /// `q_proj`, `k_proj`, `v_proj` stacked: `[(heads + 2·kv_heads) · head_dim, hidden]`, column-parallel.
    qkv_proj: B::Linear,
    /// `[hidden, heads · head_dim]`, row-parallel.
    o_proj: B::Linear,
    /// A RoPE layer with `use_qk_norm`: ones `[head_dim]`, the weightless norm as the RMSNorm op takes it.
    qk_norm: Option<B::Vector>,
    /// q and k are rotated (else NoPE).
    rope: bool,
    /// A NoPE layer's query temperature.
    temperature: Option<Temperature>,
    shape: AttnShape,
}

impl<B: Backend> Attention<B> {
    fn load(b: &B, c: &Llama4Config, r: &Reader<'_>, s: &Splits, layer: Llama4Layer) -> Result<Self, ModelError> {
        let (h, hd) = (c.hidden_size, c.head_dim);
        let (qkv_proj, o_proj) = qkv_o(b, r, (h, hd), (&s.heads, &s.kv_heads), [c.attention_bias; 2])?;
        Ok(Attention {
            qkv_proj,
            o_proj,
            qk_norm: (layer.rope && c.qk_norm).then(|| b.vector(vec![1.0; hd])),
            rope: layer.rope,
            temperature: c.temperature.filter(|_| !layer.rope),
            shape: AttnShape {
                heads: s.heads.local(b),
                kv_heads: s.kv_heads.local(b),
                head_dim: hd,
                v_dim: hd,
                mask: layer.chunk.map_or(Mask::Causal, Mask::Chunked),
                scale: (hd as f32).powf(-0.5),
            },
        })
    }

    /// `x += o_proj(attn(q, k, v))` with `[q | k | v] = qkv_proj(h)`, `h` the input
    /// norm of `x` (into `s.normed`); q and k rotated and normed (RoPE layers)
    /// or q tempered (NoPE layers).
    fn forward_add<H: Dim>(
        &self,
        b: &B,
        (norm, eps): (&B::Vector, f32),
        x: &mut Tensor<B, H>,
        step: &Step<'_, B>,
        s: &mut Scratch<B, H>,
        kv: LayerState<'_, B::KvCache>,
    ) {
        let AttnShape { heads: nh, kv_heads: nkv, head_dim: hd, .. } = self.shape;
        b.norm_linear_forward(&self.qkv_proj, x, norm, eps, &mut s.normed, &mut s.qkv);
        // q's and k's heads lie side by side: one span covers both.
        let qk = HeadSpan::heads(0, nh + nkv, hd);
        if self.rope {
            b.rope(&mut s.qkv, qk, true, step.rope, step.batch);
            if let Some(ones) = &self.qk_norm {
                b.rms_norm_heads(&mut s.qkv, qk, ones, eps);
            }
        } else if let Some(t) = self.temperature {
            b.attn_temperature(&mut s.qkv, HeadSpan::heads(0, nh, hd), t, step.batch);
        }
        let qkv = &s.qkv;
        let (q, k, v) = (qkv.cols(0, nh * hd), qkv.cols(nh * hd, nkv * hd), qkv.cols((nh + nkv) * hd, nkv * hd));
        b.attention(Qkv { q, k, v }, self.shape, None, step.batch, kv, &mut s.attn);
        b.linear_add(&self.o_proj, &s.attn, x);
    }

    fn weight_bytes(&self) -> usize {
        self.qkv_proj.resident_bytes()
            + self.o_proj.resident_bytes()
            + self.qk_norm.as_ref().map_or(0, |n| n.resident_bytes())
    }
}

/// `feed_forward.*`: a dense gated MLP or a mixture of experts.
pub enum FeedForward<B: Backend> {
    /// `feed_forward.{gate,up,down}_proj`, this rank's share of `intermediate_size_mlp`.
    Dense(GatedLinear<B>),
    /// The router, the routed experts and the shared expert.
    Moe(Moe<B>),
}

/// The mixture of experts (`feed_forward.*`): the router and this rank's
/// slice of every routed expert and of the shared one.
fn load_moe<B: Backend>(b: &B, c: &Llama4Config, r: &Reader<'_>, s: &Splits) -> Result<Moe<B>, ModelError> {
    let (h, e, i) = (c.hidden_size, c.num_experts, c.intermediate_size);
    let cols = s.experts.block(b, 1); // this rank's part of each expert's width
                                      // This rank's gate rows, then its up rows: the checkpoint's gate is the first half of `2·inter`.
    let rows: Vec<usize> = cols.clone().chain(cols.clone().map(|j| i + j)).collect();
    let all: Vec<usize> = (0..h).collect();
    let (gate_up, down) = (
        format!("{}.feed_forward.experts.gate_up_proj", r.prefix),
        format!("{}.feed_forward.experts.down_proj", r.prefix),
    );
    let ckpt = r.ckpt;
    let experts = b.build_many(e, |x| {
        Ok::<_, ModelError>(GatedLinear {
            gate_up_proj: b.linear(
                ckpt.read_expert_linear(&gate_up, [e, h, 2 * i], x, &rows, 0..h)?,
                None,
                Parallel::Column,
            ),
            down_proj: b.linear(ckpt.read_expert_linear(&down, [e, i, h], x, &all, cols.clone())?, None, Parallel::Row),
            act: Glu::Silu,
        })
    })?;
    let names = [
        "feed_forward.shared_expert.gate_proj",
        "feed_forward.shared_expert.up_proj",
        "feed_forward.shared_expert.down_proj",
    ];
    let shared = gated(b, r, names, h, i, &s.experts, false)?;
    // The router stays f32 under any compute dtype, as the other families' do.
    let gate = b.linear_f32(r.linear("feed_forward.router", [e, h], 0..e, 0..h)?, None, Parallel::Replicated);
    // Top-k of the logits, then the sigmoid of each chosen one (the same
    // choice as the top-k of the sigmoids), not renormalised.
    let router = Router {
        scoring: Scoring::Sigmoid,
        topk_method: TopkMethod::Greedy,
        top_k: c.top_k,
        n_group: 1,
        topk_group: 1,
        norm_topk_prob: false,
        routed_scaling_factor: 1.0,
    };
    Ok(Moe {
        gate,
        e_score_correction_bias: None,
        router,
        experts,
        shared_experts: Some(shared),
        gating: Gating::Input,
    })
}

/// One decoder layer (`model.layers.{i}.*`).
pub struct DecoderLayer<B: Backend> {
    input_layernorm: B::Vector,
    self_attn: Attention<B>,
    post_attention_layernorm: B::Vector,
    feed_forward: FeedForward<B>,
    eps: f32,
}

/// Buffers of one step, shared by every layer.
pub struct Scratch<B: Backend, H: Dim> {
    /// A norm of the residual stream, `[T, H]`.
    normed: Tensor<B, H>,
    /// `[T, (heads + 2·kv_heads) · head_dim]`.
    qkv: Tensor<B>,
    /// The attention's output, `[T, heads · head_dim]`.
    attn: Tensor<B>,
    /// The dense MLP's `[T, 2 · intermediate]`.
    gate_up: Tensor<B>,
    /// The dense MLP's `[T, intermediate]`.
    act: Tensor<B>,
    /// The router's logits, `[T, experts]`.
    logits: Tensor<B>,
    /// The experts' output, `[T, H]`.
    ffn: Tensor<B, H>,
}

impl<B: Backend> DecoderLayer<B> {
    /// Every linear layer of this rank's share of the layer.
    pub fn linears(&self) -> Vec<&B::Linear> {
        let mut out = vec![&self.self_attn.qkv_proj, &self.self_attn.o_proj];
        match &self.feed_forward {
            FeedForward::Dense(m) => out.extend([&m.gate_up_proj, &m.down_proj]),
            FeedForward::Moe(m) => out.extend(m.linears()),
        }
        out
    }
}

impl<B: Backend> Block<B> for DecoderLayer<B> {
    type Config = Llama4Config;
    type Scratch<H: Dim> = Scratch<B, H>;

    fn parse_config(text: &str) -> Result<Llama4Config, ConfigError> {
        Llama4Config::from_json(text)
    }

    fn frame(c: &Llama4Config) -> Frame {
        let frame = Frame::plain(c.info(), c.rms_norm_eps, c.rope(), c.tensor_prefix.clone(), 0);
        Frame { tied_embeddings: c.tie_word_embeddings, ..frame }
    }

    fn splits(c: &Llama4Config) -> Vec<Split> {
        let s = Splits::of(c);
        let (dense, moe) = (c.layers.iter().any(|l| !l.moe), c.layers.iter().any(|l| l.moe));
        [s.heads, s.kv_heads].into_iter().chain(dense.then_some(s.mlp)).chain(moe.then_some(s.experts)).collect()
    }

    fn load(b: &B, c: &Llama4Config, ckpt: &Checkpoint, l: usize) -> Result<Self, ModelError> {
        let s = Splits::of(c);
        let r = Reader { ckpt, prefix: format!("model.layers.{l}"), quant: None };
        let h = c.hidden_size;
        let layer = c.layers[l];
        let feed_forward = if layer.moe {
            FeedForward::Moe(load_moe(b, c, &r, &s)?)
        } else {
            let names = ["feed_forward.gate_proj", "feed_forward.up_proj", "feed_forward.down_proj"];
            FeedForward::Dense(gated(b, &r, names, h, c.intermediate_size_mlp, &s.mlp, false)?)
        };
        Ok(DecoderLayer {
            input_layernorm: b.vector(r.vector("input_layernorm.weight", h)?),
            self_attn: Attention::load(b, c, &r, &s, layer)?,
            post_attention_layernorm: b.vector(r.vector("post_attention_layernorm.weight", h)?),
            feed_forward,
            eps: c.rms_norm_eps,
        })
    }

    fn scratch<H: Dim>(b: &B, c: &Llama4Config, t: usize, hidden: H) -> Scratch<B, H> {
        let s = Splits::of(c);
        let (nh, nkv, hd) = (s.heads.local(b), s.kv_heads.local(b), c.head_dim);
        // Sized by the first use: a model without dense (or MoE) layers never makes them.
        Scratch {
            normed: Tensor::zeros(b, t, hidden),
            qkv: Tensor::zeros(b, t, (nh + 2 * nkv) * hd),
            attn: Tensor::zeros(b, t, nh * hd),
            gate_up: Tensor::empty(b, 0),
            act: Tensor::empty(b, 0),
            logits: Tensor::empty(b, 0),
            ffn: Tensor::empty(b, hidden),
        }
    }

    fn forward<H: Dim>(&self, b: &B, x: &mut Tensor<B, H>, at: LayerStep<'_, B, Scratch<B, H>>) {
        let LayerStep { step, scratch: s, state: cache, index } = at;
        let eps = self.eps;
        // x += self_attn(input_layernorm(x))
        self.self_attn.forward_add(b, (&self.input_layernorm, eps), x, step, s, LayerState::new(&mut cache.kv, index));
        // x += feed_forward(post_attention_layernorm(x))
        match &self.feed_forward {
            FeedForward::Dense(m) => {
                let inter = m.down_proj.in_features();
                s.gate_up.resize(b, x.rows(), 2 * inter);
                s.act.resize(b, x.rows(), inter);
                let (gate_up, down, norm) = (&m.gate_up_proj, &m.down_proj, &self.post_attention_layernorm);
                let bufs = MlpBufs { normed: &mut s.normed, gate_up: &mut s.gate_up, act: &mut s.act };
                b.norm_gated_mlp_add(gate_up, down, norm, eps, x, bufs);
            }
            FeedForward::Moe(m) => {
                b.rms_norm(x.all(), &self.post_attention_layernorm, eps, &mut s.normed);
                s.ffn.resize(b, x.rows(), x.width());
                m.forward(b, &s.normed, &mut s.ffn, &mut s.logits);
                b.add(x, &s.ffn);
            }
        }
    }

    fn weight_bytes(&self) -> usize {
        let ffn = match &self.feed_forward {
            FeedForward::Dense(m) => m.resident_bytes(),
            FeedForward::Moe(m) => m.weight_bytes(),
        };
        self.input_layernorm.resident_bytes()
            + self.self_attn.weight_bytes()
            + self.post_attention_layernorm.resident_bytes()
            + ffn
    }
}
