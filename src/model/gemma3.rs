//! Gemma 3's text decoder (`gemma3_text`, and the text tower of `gemma3`),
//! over any backend.
//!
//! Sandwich-norm residual blocks, named as in the checkpoints
//! (`model.layers.{i}.*`):
//! `x += post_attention_layernorm(self_attn(input_layernorm(x)))`, then
//! `x += post_feedforward_layernorm(mlp(pre_feedforward_layernorm(x)))`.
//! Every RMSNorm is Gemma's `(1 + w)`: the stored `w` is centred on 0, so
//! the weights are loaded as `1 + w` and run through the plain RMSNorm op
//! (the final `model.norm` too, through [`Frame::norm_offset`]). Attention is
//! GQA with per-head q/k norms before RoPE and scores scaled by
//! `query_pre_attn_scalar^-1/2`; local layers attend to a sliding window with
//! their own RoPE table ([`Step::rope_local`]), global layers to every
//! position; the MLP is `down_proj(gelu_tanh(gate_proj(h)) · up_proj(h))`.
//! The embeddings are scaled by √hidden ([`Frame::embed_scale`]). No LM head.
//!
//! Tensor parallelism is the Llama family's: q/k/v and gate/up
//! column-parallel, o_proj and down_proj row-parallel (summed over ranks
//! before the post-norm), heads divided, kv heads replicated when fewer.

use super::decoder::{Block, Frame, LayerStep, Step};
use super::kit::{gated, plus_one, qkv_o, Reader};
use super::shard::Split;
use super::ModelError;
use crate::backend::{AttnShape, Backend, Glu, HeadSpan, LayerState, Mask, Qkv, Resident, Tensor};
use crate::hf::checkpoint::Checkpoint;
use crate::hf::gemma3::Gemma3Config;
use crate::hf::ConfigError;
use crate::shape::Dim;

/// How a layer splits over tensor-parallel ranks.
struct Splits {
    heads: Split,
    kv_heads: Split,
    mlp: Split,
}

impl Splits {
    fn of(c: &Gemma3Config) -> Self {
        Splits {
            heads: Split::even("num_attention_heads", c.num_heads),
            kv_heads: Split::replicable("num_key_value_heads", c.num_kv_heads),
            mlp: Split::even("intermediate_size", c.intermediate_size),
        }
    }
}

/// Self-attention (`self_attn.*`) of this rank's heads.
pub struct Attention<B: Backend> {
    /// `q_proj`, `k_proj`, `v_proj` stacked: `[(heads + 2·kv_heads) · head_dim, hidden]`, column-parallel.
    qkv_proj: B::Linear,
    /// `[hidden, heads · head_dim]`, row-parallel.
    o_proj: B::Linear,
    /// `1 + q_norm.weight`, `[head_dim]`.
    q_norm: B::Vector,
    /// `1 + k_norm.weight`, `[head_dim]`.
    k_norm: B::Vector,
    shape: AttnShape,
}

impl<B: Backend> Attention<B> {
    fn load(b: &B, c: &Gemma3Config, r: &Reader<'_>, s: &Splits, window: Option<usize>) -> Result<Self, ModelError> {
        let (h, hd) = (c.hidden_size, c.head_dim);
        let (qkv_proj, o_proj) = qkv_o(b, r, (h, hd), (&s.heads, &s.kv_heads), [c.attention_bias; 2])?;
        Ok(Attention {
            qkv_proj,
            o_proj,
            q_norm: b.vector(plus_one(r.vector("self_attn.q_norm.weight", hd)?)),
            k_norm: b.vector(plus_one(r.vector("self_attn.k_norm.weight", hd)?)),
            shape: AttnShape {
                heads: s.heads.local(b),
                kv_heads: s.kv_heads.local(b),
                head_dim: hd,
                v_dim: hd,
                mask: window.map_or(Mask::Causal, Mask::Sliding),
                scale: c.query_pre_attn_scalar.powf(-0.5),
            },
        })
    }

    /// `out = o_proj(attn(rope(q_norm(q)), rope(k_norm(k)), v))` with
    /// `[q | k | v] = qkv_proj(h)`, `h` the input norm of `x` (into `s.normed`).
    fn forward<H: Dim>(
        &self,
        b: &B,
        (norm, eps): (&B::Vector, f32),
        x: &Tensor<B, H>,
        step: &Step<'_, B>,
        s: &mut Scratch<B, H>,
        kv: LayerState<'_, B::KvCache>,
    ) {
        let AttnShape { heads: nh, kv_heads: nkv, head_dim: hd, .. } = self.shape;
        // Local layers rotate with their own table, which Gemma's frame always supplies.
        let rope = match self.shape.mask {
            Mask::Sliding(_) => step.rope_local.expect("gemma3's frame has a local RoPE table"),
            _ => step.rope,
        };
        b.norm_linear_forward(&self.qkv_proj, x, norm, eps, &mut s.normed, &mut s.qkv);
        b.rms_norm_heads(&mut s.qkv, HeadSpan::heads(0, nh, hd), &self.q_norm, eps);
        b.rms_norm_heads(&mut s.qkv, HeadSpan::heads(nh * hd, nkv, hd), &self.k_norm, eps);
        b.rope(&mut s.qkv, HeadSpan::heads(0, nh + nkv, hd), false, rope, step.batch);
        let qkv = &s.qkv;
        let (q, k, v) = (qkv.cols(0, nh * hd), qkv.cols(nh * hd, nkv * hd), qkv.cols((nh + nkv) * hd, nkv * hd));
        b.attention(Qkv { q, k, v }, self.shape, None, step.batch, kv, &mut s.attn);
        b.linear_forward(&self.o_proj, &s.attn, &mut s.proj);
    }

    fn weight_bytes(&self) -> usize {
        self.qkv_proj.resident_bytes()
            + self.o_proj.resident_bytes()
            + self.q_norm.resident_bytes()
            + self.k_norm.resident_bytes()
    }
}

/// The MLP (`mlp.*`) of this rank's share of the intermediate width.
pub struct Mlp<B: Backend> {
    /// `gate_proj` and `up_proj` stacked: `[2 · intermediate, hidden]`, column-parallel.
    gate_up_proj: B::Linear,
    /// `[hidden, intermediate]`, row-parallel.
    down_proj: B::Linear,
}

impl<B: Backend> Mlp<B> {
    /// `out = down_proj(gelu_tanh(gate_proj(h)) · up_proj(h))`, `h` the pre-norm of `x`.
    fn forward<H: Dim>(&self, b: &B, (norm, eps): (&B::Vector, f32), x: &Tensor<B, H>, s: &mut Scratch<B, H>) {
        b.norm_linear_forward(&self.gate_up_proj, x, norm, eps, &mut s.normed, &mut s.gate_up);
        b.glu(Glu::GeluTanh, &s.gate_up, &mut s.act);
        b.linear_forward(&self.down_proj, &s.act, &mut s.proj);
    }
}

/// One decoder layer (`model.layers.{i}.*`); every norm weight is held as `1 + w`.
pub struct DecoderLayer<B: Backend> {
    input_layernorm: B::Vector,
    self_attn: Attention<B>,
    post_attention_layernorm: B::Vector,
    pre_feedforward_layernorm: B::Vector,
    mlp: Mlp<B>,
    post_feedforward_layernorm: B::Vector,
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
    /// `[T, 2 · intermediate]`.
    gate_up: Tensor<B>,
    /// `[T, intermediate]`.
    act: Tensor<B>,
    /// o_proj's or down_proj's output before its post-norm, `[T, H]`.
    proj: Tensor<B, H>,
}

impl<B: Backend> DecoderLayer<B> {
    /// Every linear layer of this rank's share of the layer.
    pub fn linears(&self) -> Vec<&B::Linear> {
        let (a, m) = (&self.self_attn, &self.mlp);
        vec![&a.qkv_proj, &a.o_proj, &m.gate_up_proj, &m.down_proj]
    }
}

impl<B: Backend> Block<B> for DecoderLayer<B> {
    type Config = Gemma3Config;
    type Scratch<H: Dim> = Scratch<B, H>;

    fn parse_config(text: &str) -> Result<Gemma3Config, ConfigError> {
        Gemma3Config::from_json(text)
    }

    fn frame(c: &Gemma3Config) -> Frame {
        Frame {
            rope_local: Some(c.rope_local()),
            // HF: `hidden_size ** 0.5`, a Python float made an f32 tensor.
            embed_scale: Some((c.hidden_size as f64).sqrt() as f32),
            norm_offset: 1.0,
            tied_embeddings: c.tie_word_embeddings,
            logit_softcap: c.final_logit_softcapping,
            ..Frame::plain(c.info(), c.rms_norm_eps, c.rope(), c.tensor_prefix.clone(), 0)
        }
    }

    fn splits(c: &Gemma3Config) -> Vec<Split> {
        let s = Splits::of(c);
        vec![s.heads, s.kv_heads, s.mlp]
    }

    fn load(b: &B, c: &Gemma3Config, ckpt: &Checkpoint, l: usize) -> Result<Self, ModelError> {
        let s = Splits::of(c);
        let r = Reader { ckpt, prefix: format!("model.layers.{l}"), quant: None };
        let h = c.hidden_size;
        let norm = |name: &str| -> Result<B::Vector, ModelError> { Ok(b.vector(plus_one(r.vector(name, h)?))) };
        let names = ["mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"];
        let mlp = gated(b, &r, names, h, c.intermediate_size, &s.mlp, false)?;
        Ok(DecoderLayer {
            input_layernorm: norm("input_layernorm.weight")?,
            self_attn: Attention::load(b, c, &r, &s, c.sliding_windows[l])?,
            post_attention_layernorm: norm("post_attention_layernorm.weight")?,
            pre_feedforward_layernorm: norm("pre_feedforward_layernorm.weight")?,
            mlp: Mlp { gate_up_proj: mlp.gate_up_proj, down_proj: mlp.down_proj },
            post_feedforward_layernorm: norm("post_feedforward_layernorm.weight")?,
            eps: c.rms_norm_eps,
        })
    }

    fn scratch<H: Dim>(b: &B, c: &Gemma3Config, t: usize, hidden: H) -> Scratch<B, H> {
        let s = Splits::of(c);
        let (nh, nkv, hd, inter) = (s.heads.local(b), s.kv_heads.local(b), c.head_dim, s.mlp.local(b));
        Scratch {
            normed: Tensor::zeros(b, t, hidden),
            qkv: Tensor::zeros(b, t, (nh + 2 * nkv) * hd),
            attn: Tensor::zeros(b, t, nh * hd),
            gate_up: Tensor::zeros(b, t, 2 * inter),
            act: Tensor::zeros(b, t, inter),
            proj: Tensor::zeros(b, t, hidden),
        }
    }

    fn forward<H: Dim>(&self, b: &B, x: &mut Tensor<B, H>, at: LayerStep<'_, B, Scratch<B, H>>) {
        let LayerStep { step, scratch: s, state: cache, index } = at;
        let eps = self.eps;
        // x += post_attention_layernorm(self_attn(input_layernorm(x)))
        self.self_attn.forward(b, (&self.input_layernorm, eps), x, step, s, LayerState::new(&mut cache.kv, index));
        b.rms_norm(s.proj.all(), &self.post_attention_layernorm, eps, &mut s.normed);
        b.add(x, &s.normed);
        // x += post_feedforward_layernorm(mlp(pre_feedforward_layernorm(x)))
        self.mlp.forward(b, (&self.pre_feedforward_layernorm, eps), x, s);
        b.rms_norm(s.proj.all(), &self.post_feedforward_layernorm, eps, &mut s.normed);
        b.add(x, &s.normed);
    }

    fn weight_bytes(&self) -> usize {
        let norms = [
            &self.input_layernorm,
            &self.post_attention_layernorm,
            &self.pre_feedforward_layernorm,
            &self.post_feedforward_layernorm,
        ];
        norms.iter().map(|n| n.resident_bytes()).sum::<usize>()
            + self.self_attn.weight_bytes()
            + self.mlp.gate_up_proj.resident_bytes()
            + self.mlp.down_proj.resident_bytes()
    }
}
