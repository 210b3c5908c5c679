//! gpt-oss's decoder (`gpt_oss`: gpt-oss-20b, gpt-oss-120b), over any backend.
//!
//! Pre-norm residual blocks, named as in the checkpoints (`model.layers.{i}.*`):
//! `x += self_attn(input_layernorm(x))`, then `x += mlp(post_attention_layernorm(x))`.
//! Attention is GQA with biases on q/k/v/o, split-half RoPE with YaRN, and
//! one learned sink logit per head (`self_attn.sinks`) in every softmax's
//! denominator; sliding layers (`layer_types`) attend to the last
//! `sliding_window` positions. The MLP is a mixture of experts: a router with
//! a bias (`mlp.router`), top-k of its logits then a softmax over the chosen
//! (the same weights as softmax, top-k, renormalise), and experts fused into
//! `mlp.experts.gate_up_proj [E, hidden, 2·inter]` (gate at even columns, up
//! at odd ones) and `down_proj [E, inter, hidden]`, with biases, run through
//! the clamped GLU `(clamp(up) + 1) · g · σ(α·g)`, `g = min(gate, limit)`.
//! The experts are MXFP4 blocks (`*_blocks`, `*_scales`) when the config
//! says `quant_method: mxfp4`, kept packed; plain otherwise. No LM head.
//!
//! Tensor parallelism is the Llama family's for attention (heads and their
//! sinks divided, kv heads replicated when fewer) and DeepSeek's for the
//! experts (each expert's width divided). Row-parallel biases (`o_proj`, the
//! experts' `down_proj`) are added once, after the all-reduce. An MXFP4
//! block a cut falls inside stays whole in meaning: each rank keeps the
//! codes of its columns and the block's scale.

use super::decoder::{Block, Frame, LayerStep};
use super::kit::{qkv_o, Reader};
use super::moe::Moe;
use super::shard::Split;
use super::ModelError;
use crate::backend::{
    AttnBlock, AttnBufs, AttnShape, Backend, GatedLinear, Gating, Glu, LayerState, Mask, Parallel, Resident, Router,
    Tensor,
};
use crate::hf::checkpoint::Checkpoint;
use crate::hf::gpt_oss::GptOssConfig;
use crate::hf::moe::{Scoring, TopkMethod};
use crate::hf::quant::LinearWeight;
use crate::hf::ConfigError;
use crate::shape::Dim;

/// How a layer splits over tensor-parallel ranks.
struct Splits {
    heads: Split,
    kv_heads: Split,
    /// Each expert's width.
    experts: Split,
}

impl Splits {
    fn of(c: &GptOssConfig) -> Self {
        Splits {
            heads: Split::even("num_attention_heads", c.num_heads),
            kv_heads: Split::replicable("num_key_value_heads", c.num_kv_heads),
            experts: Split::even("intermediate_size", c.intermediate_size),
        }
    }
}

/// Self-attention (`self_attn.*`) of this rank's heads.
pub struct Attention<B: Backend> {
    /// `q_proj`, `k_proj`, `v_proj` stacked, with their biases:
    /// `[(heads + 2·kv_heads) · head_dim, hidden]`, column-parallel.
    qkv_proj: B::Linear,
    /// `[hidden, heads · head_dim]` and its bias, row-parallel.
    o_proj: B::Linear,
    /// This rank's heads' sink logits, `[heads]`.
    sinks: B::Vector,
    shape: AttnShape,
}

impl<B: Backend> Attention<B> {
    fn load(b: &B, c: &GptOssConfig, r: &Reader<'_>, s: &Splits, window: Option<usize>) -> Result<Self, ModelError> {
        let (h, hd) = (c.hidden_size, c.head_dim);
        let (qkv_proj, o_proj) = qkv_o(b, r, (h, hd), (&s.heads, &s.kv_heads), [c.attention_bias; 2])?;
        Ok(Attention {
            qkv_proj,
            o_proj,
            sinks: b.vector(r.vector_rows("self_attn.sinks", c.num_heads, &s.heads.block(b, 1))?),
            shape: AttnShape {
                heads: s.heads.local(b),
                kv_heads: s.kv_heads.local(b),
                head_dim: hd,
                v_dim: hd,
                mask: window.map_or(Mask::Causal, Mask::Sliding),
                scale: (hd as f32).powf(-0.5),
            },
        })
    }

    fn weight_bytes(&self) -> usize {
        self.qkv_proj.resident_bytes() + self.o_proj.resident_bytes() + self.sinks.resident_bytes()
    }
}

/// The mixture of experts (`mlp.*`): the router and this rank's slice of every expert.
fn load_mlp<B: Backend>(b: &B, c: &GptOssConfig, r: &Reader<'_>, s: &Splits) -> Result<Moe<B>, ModelError> {
    let (h, e, i) = (c.hidden_size, c.num_experts, c.intermediate_size);
    let cols = s.experts.block(b, 1); // this rank's part of each expert's width
                                      // Strata's fused layout: this rank's gate rows, then its up rows; in the
                                      // checkpoint's `2·inter` axis the gate of unit j is 2j and its up 2j + 1.
    let rows: Vec<usize> = cols.clone().map(|j| 2 * j).chain(cols.clone().map(|j| 2 * j + 1)).collect();
    let all: Vec<usize> = (0..h).collect();
    let (gate_up, down) =
        (format!("{}.mlp.experts.gate_up_proj", r.prefix), format!("{}.mlp.experts.down_proj", r.prefix));
    let ckpt = r.ckpt;
    let p = &r.prefix;
    let gate_up_bias = ckpt.read_f32(&format!("{p}.mlp.experts.gate_up_proj_bias"), &[e, 2 * i])?; // [E, 2·inter]
    let down_bias = ckpt.read_f32(&format!("{p}.mlp.experts.down_proj_bias"), &[e, h])?; // [E, hidden]
    let act = Glu::Clamped { alpha: c.swiglu_alpha, limit: c.swiglu_limit };
    let experts = b.build_many(e, |x| {
        let (gu, dn) = if c.mxfp4 {
            (
                LinearWeight::Quant(ckpt.read_mxfp4(&gate_up, [e, 2 * i, h], x, &rows, 0..h)?),
                LinearWeight::Quant(ckpt.read_mxfp4(&down, [e, h, i], x, &all, cols.clone())?),
            )
        } else {
            (
                ckpt.read_expert_linear(&gate_up, [e, h, 2 * i], x, &rows, 0..h)?,
                ckpt.read_expert_linear(&down, [e, i, h], x, &all, cols.clone())?,
            )
        };
        let gu_bias = rows.iter().map(|&o| gate_up_bias[x * 2 * i + o]).collect();
        let dn_bias = down_bias[x * h..(x + 1) * h].to_vec();
        Ok::<_, ModelError>(GatedLinear {
            gate_up_proj: b.linear(gu, Some(gu_bias), Parallel::Column),
            down_proj: b.linear(dn, Some(dn_bias), Parallel::Row),
            act,
        })
    })?;
    let gate = b.linear_f32(
        r.linear("mlp.router", [e, h], 0..e, 0..h)?,
        Some(r.vector("mlp.router.bias", e)?),
        Parallel::Replicated,
    );
    // Top-k of the logits, then a softmax over them: softmax, top-k, renormalise.
    let router = Router {
        scoring: Scoring::Softmax,
        topk_method: TopkMethod::Greedy,
        top_k: c.top_k,
        n_group: 1,
        topk_group: 1,
        norm_topk_prob: true,
        routed_scaling_factor: 1.0,
    };
    Ok(Moe { gate, e_score_correction_bias: None, router, experts, shared_experts: None, gating: Gating::Output })
}

/// One decoder layer (`model.layers.{i}.*`).
pub struct DecoderLayer<B: Backend> {
    input_layernorm: B::Vector,
    self_attn: Attention<B>,
    post_attention_layernorm: B::Vector,
    mlp: Moe<B>,
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
    /// The router's logits, `[T, experts]`.
    logits: Tensor<B>,
    /// The experts' output, `[T, H]`.
    ffn: Tensor<B, H>,
}

impl<B: Backend> DecoderLayer<B> {
    /// Every linear layer of this rank's share of the layer.
    pub fn linears(&self) -> Vec<&B::Linear> {
        let mut out = vec![&self.self_attn.qkv_proj, &self.self_attn.o_proj];
        out.extend(self.mlp.linears());
        out
    }
}

impl<B: Backend> Block<B> for DecoderLayer<B> {
    type Config = GptOssConfig;
    type Scratch<H: Dim> = Scratch<B, H>;

    fn parse_config(text: &str) -> Result<GptOssConfig, ConfigError> {
        GptOssConfig::from_json(text)
    }

    fn frame(c: &GptOssConfig) -> Frame {
        Frame {
            tied_embeddings: c.tie_word_embeddings,
            ..Frame::plain(c.info(), c.rms_norm_eps, c.rope(), String::new(), 0)
        }
    }

    fn splits(c: &GptOssConfig) -> Vec<Split> {
        let s = Splits::of(c);
        vec![s.heads, s.kv_heads, s.experts]
    }

    fn quantization(c: &GptOssConfig) -> Option<String> {
        c.mxfp4.then(|| "MXFP4 experts (E2M1 codes, E8M0 scales per 32 inputs)".into())
    }

    fn load(b: &B, c: &GptOssConfig, ckpt: &Checkpoint, l: usize) -> Result<Self, ModelError> {
        let s = Splits::of(c);
        let r = Reader { ckpt, prefix: format!("model.layers.{l}"), quant: None };
        let h = c.hidden_size;
        Ok(DecoderLayer {
            input_layernorm: b.vector(r.vector("input_layernorm.weight", h)?),
            self_attn: Attention::load(b, c, &r, &s, c.sliding_windows[l])?,
            post_attention_layernorm: b.vector(r.vector("post_attention_layernorm.weight", h)?),
            mlp: load_mlp(b, c, &r, &s)?,
            eps: c.rms_norm_eps,
        })
    }

    fn scratch<H: Dim>(b: &B, c: &GptOssConfig, t: usize, hidden: H) -> Scratch<B, H> {
        let s = Splits::of(c);
        let (nh, nkv, hd) = (s.heads.local(b), s.kv_heads.local(b), c.head_dim);
        Scratch {
            normed: Tensor::zeros(b, t, hidden),
            qkv: Tensor::zeros(b, t, (nh + 2 * nkv) * hd),
            attn: Tensor::zeros(b, t, nh * hd),
            logits: Tensor::empty(b, 0),
            ffn: Tensor::empty(b, hidden),
        }
    }

    fn forward<H: Dim>(&self, b: &B, x: &mut Tensor<B, H>, at: LayerStep<'_, B, Scratch<B, H>>) {
        let LayerStep { step, scratch: s, state: cache, index } = at;
        let a = &self.self_attn;
        // x += self_attn(input_layernorm(x)), the sinks in every softmax.
        let block = AttnBlock {
            qkv_proj: &a.qkv_proj,
            o_proj: &a.o_proj,
            norm: (&self.input_layernorm, self.eps),
            qk_norm: None,
            shape: a.shape,
            sinks: Some(&a.sinks),
            rotary_dim: a.shape.head_dim,
        };
        let bufs = AttnBufs { normed: &mut s.normed, qkv: &mut s.qkv, out: &mut s.attn };
        b.norm_attention_add(&block, x, bufs, step.rope, step.batch, LayerState::new(&mut cache.kv, index));
        // x += mlp(post_attention_layernorm(x))
        b.rms_norm(x.all(), &self.post_attention_layernorm, self.eps, &mut s.normed);
        s.ffn.resize(b, x.rows(), x.width());
        self.mlp.forward(b, &s.normed, &mut s.ffn, &mut s.logits);
        b.add(x, &s.ffn);
    }

    fn weight_bytes(&self) -> usize {
        self.input_layernorm.resident_bytes()
            + self.self_attn.weight_bytes()
            + self.post_attention_layernorm.resident_bytes()
            + self.mlp.weight_bytes()
    }
}
