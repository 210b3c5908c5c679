//! The Llama family (Llama, Mistral, Qwen2, Qwen3, and the mixtures of
//! experts Qwen3-MoE, Mixtral, GLM-4.5 and MiniMax-M2), over any backend.
//!
//! Pre-norm residual blocks, named as in the checkpoints (`model.layers.{i}.*`):
//! `x += self_attn(input_layernorm(x))`, then `x += mlp(post_attention_layernorm(x))`,
//! where `mlp` is a gated MLP or a mixture of experts (`mlp.gate` and
//! `mlp.experts.{j}.{gate,up,down}_proj` in Qwen3-MoE,
//! `block_sparse_moe.gate` and `block_sparse_moe.experts.{j}.{w1,w3,w2}` in
//! Mixtral and MiniMax-M2, which adds `block_sparse_moe.e_score_correction_bias`;
//! GLM-4.5 adds `mlp.gate.e_score_correction_bias` and `mlp.shared_experts.*`). q/k/v and gate/up are fused into one GEMM each at
//! load time. No LM head.
//!
//! Tensor parallelism, as in vLLM and gpt-fast, is each linear layer's kind:
//! q/k/v and gate/up are column-parallel (split by output rows), o_proj and
//! down_proj row-parallel (split by input columns, summed over ranks); heads
//! and kv heads are divided across ranks (kv heads replicated when fewer);
//! each expert's width is divided across ranks, as DeepSeek's is.

use super::decoder::{Block, Frame, LayerStep, Step};
use super::kit::{gated, qkv_o, Reader};
use super::moe::Moe;
use super::shard::Split;
use super::ModelError;
use crate::backend::{
    self, AttnBlock, AttnBufs, AttnShape, Backend, Gating, LayerState, Mask, MlpBufs, Parallel, Resident, Router,
    Tensor,
};
use crate::hf::checkpoint::Checkpoint;
use crate::hf::llama::{Arch, LlamaConfig, LlamaMoe, QkNorm};
use crate::hf::moe::TopkMethod;
use crate::hf::ConfigError;
use crate::shape::Dim;

/// How a layer splits over tensor-parallel ranks: query heads, kv heads
/// (replicated when there are fewer than ranks), the MLP width.
struct Splits {
    heads: Split,
    kv_heads: Split,
    mlp: Split,
    /// Each expert's width (a mixture of experts).
    experts: Option<Split>,
    /// The shared experts' width, if any.
    shared: Option<Split>,
}

impl Splits {
    fn of(c: &LlamaConfig) -> Self {
        Splits {
            heads: Split::even("num_attention_heads", c.num_heads),
            kv_heads: Split::replicable("num_key_value_heads", c.num_kv_heads),
            mlp: Split::even("intermediate_size", c.intermediate_size),
            experts: c.moe.as_ref().map(|m| Split::even("moe_intermediate_size", m.intermediate_size)),
            shared: c
                .moe
                .as_ref()
                .and_then(|m| m.shared_intermediate_size)
                .map(|w| Split::even("n_shared_experts × moe_intermediate_size", w)),
        }
    }
}

/// Self-attention (`self_attn.*`) of this rank's heads.
pub struct Attention<B: Backend> {
    /// `q_proj`, `k_proj`, `v_proj` stacked: `[(heads + 2·kv_heads) · head_dim, hidden]`, column-parallel.
    qkv_proj: B::Linear,
    /// `[hidden, heads · head_dim]`, row-parallel.
    o_proj: B::Linear,
    /// Qwen3's per-head norms (`[head_dim]`), or MiniMax-M2's over all
    /// heads (this rank's `[heads · head_dim]` and `[kv_heads · head_dim]`).
    q_norm: Option<B::Vector>,
    k_norm: Option<B::Vector>,
    /// The norms span all heads.
    qk_norm_all_heads: bool,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    /// Columns of each q/k head RoPE rotates.
    rotary_dim: usize,
    window: Option<usize>,
    eps: f32,
}

/// Buffers of the attention block.
pub struct AttnScratch<B: Backend> {
    /// `[T, (heads + 2·kv_heads) · head_dim]`.
    qkv: Tensor<B>,
    /// `[T, heads · head_dim]`.
    out: Tensor<B>,
}

impl<B: Backend> Attention<B> {
    fn load(b: &B, c: &LlamaConfig, r: &Reader<'_>, s: &Splits, window: Option<usize>) -> Result<Self, ModelError> {
        let (h, hd) = (c.hidden_size, c.head_dim);
        let (q_out, kv_out) = (c.num_heads * hd, c.num_kv_heads * hd);
        // This rank's heads: its rows of q/k/v and columns of o_proj.
        let (qkv_proj, o_proj) = qkv_o(b, r, (h, hd), (&s.heads, &s.kv_heads), [c.qkv_bias, c.o_bias])?;
        let (q_rows, kv_rows) = (s.heads.block(b, hd), s.kv_heads.block(b, hd));
        let (q_norm, k_norm) = match c.qk_norm {
            QkNorm::PerHead => (
                Some(b.vector(r.vector("self_attn.q_norm.weight", hd)?)),
                Some(b.vector(r.vector("self_attn.k_norm.weight", hd)?)),
            ),
            // This rank's heads of one weight over all heads.
            QkNorm::AllHeads => (
                Some(b.vector(r.vector_rows("self_attn.q_norm.weight", q_out, &q_rows)?)),
                Some(b.vector(r.vector_rows("self_attn.k_norm.weight", kv_out, &kv_rows)?)),
            ),
            QkNorm::None => (None, None),
        };
        Ok(Attention {
            qkv_proj,
            o_proj,
            q_norm,
            k_norm,
            qk_norm_all_heads: c.qk_norm == QkNorm::AllHeads,
            heads: s.heads.local(b),
            kv_heads: s.kv_heads.local(b),
            head_dim: hd,
            rotary_dim: c.rotary_dim,
            window,
            eps: c.rms_norm_eps,
        })
    }

    /// `x += o_proj(attn(rope(q), rope(k), v))` with `[q | k | v] = qkv_proj(norm(x))`.
    fn forward_add<H: Dim>(
        &self,
        b: &B,
        norm: PreNorm<'_, B, H>,
        x: &mut Tensor<B, H>,
        step: &Step<'_, B>,
        s: &mut AttnScratch<B>,
        kv: LayerState<'_, B::KvCache>,
    ) {
        let hd = self.head_dim;
        let shape = AttnShape {
            heads: self.heads,
            kv_heads: self.kv_heads,
            head_dim: hd,
            v_dim: hd,
            mask: self.window.map_or(Mask::Causal, Mask::Sliding),
            scale: (hd as f32).powf(-0.5),
        };
        // q/k norm (Qwen3), then RoPE at each token's position within its sample.
        let qk_norm = match (&self.q_norm, &self.k_norm) {
            (Some(q), Some(k)) => Some(backend::QkNorm { q, k, eps: self.eps, all_heads: self.qk_norm_all_heads }),
            _ => None,
        };
        let block = AttnBlock {
            qkv_proj: &self.qkv_proj,
            o_proj: &self.o_proj,
            norm: (norm.weight, norm.eps),
            qk_norm,
            shape,
            sinks: None,
            rotary_dim: self.rotary_dim,
        };
        let bufs = AttnBufs { normed: norm.normed, qkv: &mut s.qkv, out: &mut s.out };
        b.norm_attention_add(&block, x, bufs, step.rope, step.batch, kv);
    }

    fn weight_bytes(&self) -> usize {
        let norms =
            [&self.q_norm, &self.k_norm].iter().map(|n| n.as_ref().map_or(0, |n| n.resident_bytes())).sum::<usize>();
        self.qkv_proj.resident_bytes() + self.o_proj.resident_bytes() + norms
    }
}

/// The RMSNorm a block applies to the residual stream before its first
/// projection (fused into it by backends that can), and the buffer the
/// normalised rows go to when it is not.
pub struct PreNorm<'a, B: Backend, H: Dim> {
    weight: &'a B::Vector,
    eps: f32,
    /// `[T, H]`.
    normed: &'a mut Tensor<B, H>,
}

/// The MLP (`mlp.*`) of this rank's share of the intermediate width.
pub struct Mlp<B: Backend> {
    /// `gate_proj` and `up_proj` stacked: `[2 · intermediate, hidden]`, column-parallel.
    gate_up_proj: B::Linear,
    /// `[hidden, intermediate]`, row-parallel.
    down_proj: B::Linear,
}

/// Buffers of the MLP block.
pub struct MlpScratch<B: Backend> {
    /// `[T, 2 · intermediate]`.
    gate_up: Tensor<B>,
    /// `[T, intermediate]`: the SwiGLU, left unwritten by a backend that
    /// fuses it into the down projection (`swiglu_linear_add`).
    act: Tensor<B>,
    /// A mixture's router logits, `[T, experts]`.
    logits: Tensor<B>,
}

impl<B: Backend> Mlp<B> {
    fn load(b: &B, c: &LlamaConfig, r: &Reader<'_>, s: &Splits) -> Result<Self, ModelError> {
        let names = ["mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"];
        let p = gated(b, r, names, c.hidden_size, c.intermediate_size, &s.mlp, c.mlp_bias)?;
        Ok(Mlp { gate_up_proj: p.gate_up_proj, down_proj: p.down_proj })
    }

    /// `x += down_proj(silu(gate_proj(h)) · up_proj(h))` with `h = norm(x)`.
    fn forward_add<H: Dim>(&self, b: &B, norm: PreNorm<'_, B, H>, x: &mut Tensor<B, H>, s: &mut MlpScratch<B>) {
        let (gate_up, down) = (&self.gate_up_proj, &self.down_proj);
        let bufs = MlpBufs { normed: norm.normed, gate_up: &mut s.gate_up, act: &mut s.act };
        b.norm_gated_mlp_add(gate_up, down, norm.weight, norm.eps, x, bufs);
    }

    fn weight_bytes(&self) -> usize {
        self.gate_up_proj.resident_bytes() + self.down_proj.resident_bytes()
    }
}

/// A layer's mixture of experts, under Qwen3-MoE's, Mixtral's or GLM-4.5's
/// names: the router (`{module}.gate`, f32 inputs, as HF keeps it), its
/// correction bias (GLM-4.5's `mlp.gate.e_score_correction_bias`), every
/// routed expert and the shared ones (`mlp.shared_experts.*`).
fn load_moe<B: Backend>(
    b: &B,
    c: &LlamaConfig,
    m: &LlamaMoe,
    r: &Reader<'_>,
    s: &Splits,
) -> Result<Moe<B>, ModelError> {
    let (h, e, i) = (c.hidden_size, m.experts, m.intermediate_size);
    let (module, names) = match c.arch {
        Arch::Mixtral | Arch::MiniMaxM2 => ("block_sparse_moe", ["w1", "w3", "w2"]),
        _ => ("mlp", ["gate_proj", "up_proj", "down_proj"]),
    };
    let split = s.experts.as_ref().expect("a mixture's config has an expert width");
    let experts = b.build_many(e, |j| {
        let [g, u, d] = names.map(|n| format!("{module}.experts.{j}.{n}"));
        gated(b, r, [&g, &u, &d], h, i, split, false)
    })?;
    let gate = b.linear_f32(r.linear(&format!("{module}.gate"), [e, h], 0..e, 0..h)?, None, Parallel::Replicated);
    let router = Router {
        scoring: m.scoring,
        topk_method: m.topk_method,
        top_k: m.top_k,
        n_group: m.n_group,
        topk_group: m.topk_group,
        norm_topk_prob: m.norm_topk_prob,
        routed_scaling_factor: m.routed_scaling_factor,
    };
    // GLM-4.5 keeps the bias in the router, MiniMax-M2 beside it.
    let bias = if c.arch == Arch::MiniMaxM2 { "e_score_correction_bias" } else { "gate.e_score_correction_bias" };
    let e_score_correction_bias = match m.topk_method {
        TopkMethod::NoauxTc => Some(b.vector(r.vector(&format!("{module}.{bias}"), e)?)),
        _ => None,
    };
    let shared_experts = match (m.shared_intermediate_size, &s.shared) {
        (Some(w), Some(split)) => {
            let [g, u, d] = names.map(|n| format!("{module}.shared_experts.{n}"));
            Some(gated(b, r, [&g, &u, &d], h, w, split, false)?)
        }
        _ => None,
    };
    Ok(Moe { gate, e_score_correction_bias, router, experts, shared_experts, gating: Gating::Output })
}

impl<B: Backend> Attention<B> {
    fn linears(&self) -> Vec<&B::Linear> {
        vec![&self.qkv_proj, &self.o_proj]
    }
}

impl<B: Backend> Mlp<B> {
    fn linears(&self) -> Vec<&B::Linear> {
        vec![&self.gate_up_proj, &self.down_proj]
    }
}

impl<B: Backend> DecoderLayer<B> {
    /// Every linear layer of this rank's share of the layer.
    pub fn linears(&self) -> Vec<&B::Linear> {
        let mut out = self.self_attn.linears();
        out.extend(match &self.mlp {
            Ffn::Dense(m) => m.linears(),
            Ffn::Moe(m) => m.linears(),
        });
        out
    }
}

impl<B: Backend, H: Dim> super::decoder::Decoder<B, DecoderLayer<B>, H> {
    /// Every linear layer of this rank, in layer order.
    pub fn linears(&self) -> Vec<&B::Linear> {
        self.layers().iter().flat_map(DecoderLayer::linears).collect()
    }
}

/// The feed-forward block of a layer.
pub enum Ffn<B: Backend> {
    /// A gated MLP.
    Dense(Mlp<B>),
    /// A mixture of experts.
    Moe(Moe<B>),
}

impl<B: Backend> Ffn<B> {
    /// `x += ffn(norm(x))`; a mixture's output goes through `out` `[T, H]`.
    fn forward_add<H: Dim>(
        &self,
        b: &B,
        norm: PreNorm<'_, B, H>,
        x: &mut Tensor<B, H>,
        s: &mut MlpScratch<B>,
        out: &mut Tensor<B, H>,
    ) {
        match self {
            Ffn::Dense(m) => m.forward_add(b, norm, x, s),
            Ffn::Moe(m) => {
                b.rms_norm(x.all(), norm.weight, norm.eps, norm.normed);
                out.resize(b, x.rows(), x.width());
                m.forward(b, norm.normed, out, &mut s.logits);
                b.add(x, out);
            }
        }
    }

    fn weight_bytes(&self) -> usize {
        match self {
            Ffn::Dense(m) => m.weight_bytes(),
            Ffn::Moe(m) => m.weight_bytes(),
        }
    }
}

/// One decoder layer (`model.layers.{i}.*`).
pub struct DecoderLayer<B: Backend> {
    input_layernorm: B::Vector,
    self_attn: Attention<B>,
    post_attention_layernorm: B::Vector,
    mlp: Ffn<B>,
    eps: f32,
}

// The layer's two residual updates, apart: its `forward` runs one after
// the other, and a family that joins them to the stream otherwise (a
// factor on each, as the test family's) runs them around its own ops.
impl<B: Backend> DecoderLayer<B> {
    /// `x += self_attn(input_layernorm(x))`, keeping keys and values in `kv`.
    pub(crate) fn attention_add<H: Dim>(
        &self,
        b: &B,
        x: &mut Tensor<B, H>,
        step: &Step<'_, B>,
        s: &mut Scratch<B, H>,
        kv: LayerState<'_, B::KvCache>,
    ) {
        let norm = PreNorm { weight: &self.input_layernorm, eps: self.eps, normed: &mut s.normed };
        self.self_attn.forward_add(b, norm, x, step, &mut s.attn, kv);
    }

    /// `x += mlp(post_attention_layernorm(x))`.
    pub(crate) fn ffn_add<H: Dim>(&self, b: &B, x: &mut Tensor<B, H>, s: &mut Scratch<B, H>) {
        let norm = PreNorm { weight: &self.post_attention_layernorm, eps: self.eps, normed: &mut s.normed };
        self.mlp.forward_add(b, norm, x, &mut s.mlp, &mut s.ffn);
    }
}

/// Buffers of one step, shared by every layer.
pub struct Scratch<B: Backend, H: Dim> {
    /// A norm of the residual stream, `[T, H]`.
    normed: Tensor<B, H>,
    attn: AttnScratch<B>,
    mlp: MlpScratch<B>,
    /// A mixture of experts' output, `[T, H]`.
    ffn: Tensor<B, H>,
}

impl<B: Backend> Block<B> for DecoderLayer<B> {
    type Config = LlamaConfig;
    type Scratch<H: Dim> = Scratch<B, H>;

    fn parse_config(text: &str) -> Result<LlamaConfig, ConfigError> {
        LlamaConfig::from_json(text)
    }

    fn frame(c: &LlamaConfig) -> Frame {
        let frame = Frame::plain(c.info(), c.rms_norm_eps, c.rope(), String::new(), c.extra_layers);
        Frame { tied_embeddings: c.tie_word_embeddings, ..frame }
    }

    fn splits(c: &LlamaConfig) -> Vec<Split> {
        let s = Splits::of(c);
        // Mixtral has no dense layer: its `intermediate_size` is the experts'.
        let dense = c.moe.as_ref().is_none_or(|m| m.sparse.contains(&false));
        [s.heads, s.kv_heads].into_iter().chain(dense.then_some(s.mlp)).chain(s.experts).chain(s.shared).collect()
    }

    fn quantization(c: &LlamaConfig) -> Option<String> {
        c.quant.as_ref().map(|q| q.describe())
    }

    fn load(b: &B, c: &LlamaConfig, ckpt: &Checkpoint, l: usize) -> Result<Self, ModelError> {
        let splits = Splits::of(c);
        let r = Reader { ckpt, prefix: format!("model.layers.{l}"), quant: c.quant.as_ref() };
        let h = c.hidden_size;
        Ok(DecoderLayer {
            input_layernorm: b.vector(r.vector("input_layernorm.weight", h)?),
            self_attn: Attention::load(b, c, &r, &splits, c.sliding_windows[l])?,
            post_attention_layernorm: b.vector(r.vector("post_attention_layernorm.weight", h)?),
            mlp: match &c.moe {
                Some(m) if m.sparse[l] => Ffn::Moe(load_moe(b, c, m, &r, &splits)?),
                _ => Ffn::Dense(Mlp::load(b, c, &r, &splits)?),
            },
            eps: c.rms_norm_eps,
        })
    }

    fn scratch<H: Dim>(b: &B, c: &LlamaConfig, t: usize, hidden: H) -> Scratch<B, H> {
        // Every layer has the same widths: this rank's heads and MLP width.
        let s = Splits::of(c);
        let (nh, nkv, hd, inter) = (s.heads.local(b), s.kv_heads.local(b), c.head_dim, s.mlp.local(b));
        Scratch {
            normed: Tensor::zeros(b, t, hidden),
            attn: AttnScratch { qkv: Tensor::zeros(b, t, (nh + 2 * nkv) * hd), out: Tensor::zeros(b, t, nh * hd) },
            mlp: MlpScratch {
                gate_up: Tensor::zeros(b, t, 2 * inter),
                act: Tensor::zeros(b, t, inter),
                logits: Tensor::empty(b, 0),
            },
            ffn: Tensor::empty(b, hidden),
        }
    }

    fn forward<H: Dim>(&self, b: &B, x: &mut Tensor<B, H>, at: LayerStep<'_, B, Scratch<B, H>>) {
        let LayerStep { step, scratch: s, state, index } = at;
        self.attention_add(b, x, step, s, LayerState::new(&mut state.kv, index));
        self.ffn_add(b, x, s);
    }

    fn weight_bytes(&self) -> usize {
        self.input_layernorm.resident_bytes()
            + self.self_attn.weight_bytes()
            + self.post_attention_layernorm.resident_bytes()
            + self.mlp.weight_bytes()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn run_time_splits_are_checked() {
        let c = LlamaConfig::from_json(
            r#"{"model_type":"qwen2","hidden_size":896,"num_hidden_layers":2,"num_attention_heads":14,
            "num_key_value_heads":2,"intermediate_size":4864,"vocab_size":100}"#,
        )
        .unwrap();
        let opts = crate::model::LoadOptions { tp: 4, ..Default::default() };
        assert_eq!(
            crate::model::AnyConfig::Llama(c.clone()).check(&opts).unwrap_err().to_string(),
            "--tp 4: num_attention_heads 14 is not divisible by 4; choose a TP size that divides it"
        );
        let s = Splits::of(&c);
        assert_eq!((s.heads.per_rank(2), s.kv_heads.per_rank(2), s.mlp.per_rank(2)), (Ok(7), Ok(1), Ok(2432)));
    }
}
