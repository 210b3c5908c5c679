//! DeepSeek V2/V3 and Kimi-K2 over any backend: multi-head latent attention
//! (MLA) and a mixture of experts with shared experts.
//!
//! Per layer, as in the checkpoints (`model.layers.{i}.*`):
//! `x += self_attn(input_layernorm(x))`, where
//! `q = q_b_proj(q_a_layernorm(q_a_proj(h)))` (or `q_proj(h)` without q-LoRA),
//! `[c_kv, k_rot] = kv_a_proj_with_mqa(h)`, `[k_nope, v] = kv_b_proj(kv_a_layernorm(c_kv))`
//! per head, RoPE on the `qk_rope_head_dim` tail of q and on the shared `k_rot`;
//! then `x += mlp(post_attention_layernorm(x))`, dense for the first
//! `first_k_dense_replace` layers, else `Σ_topk w_e · experts[e](h) + shared_experts(h)`.
//!
//! Tensor parallelism: each rank holds its heads' rows of q_b/kv_b and
//! columns of o_proj, and its slice of every expert's, the shared experts'
//! and the dense MLPs' width ("TP inside each expert": every rank routes
//! every token, so no token moves between ranks, and one all-reduce sums a
//! whole MoE block). q_a, kv_a, the router and the norms are replicated.

use super::decoder::{Block, Decoder, Frame, LayerStep, Step};
use super::moe::Moe;
use super::shard::Split;
use super::ModelError;
use crate::backend::{
    AttnShape, Backend, GatedLinear, Gating, Glu, HeadSpan, LayerState, LinearInfo, Mask, Parallel, Qkv, Resident,
    Router, Tensor,
};
use crate::hf::checkpoint::Checkpoint;
use crate::hf::deepseek::DeepseekConfig;
use crate::hf::moe::TopkMethod;
use crate::hf::quant::{LinearWeight, WeightFormat};
use crate::hf::ConfigError;
use crate::shape::Dim;
use std::ops::Range;

/// Reads the tensors of one checkpoint as stored (plain, FP8 or INT4), in the
/// formats the config's `quantization_config` declares.
struct Reader<'a> {
    ckpt: &'a Checkpoint,
    config: &'a DeepseekConfig,
}

impl Reader<'_> {
    /// Block `rows × cols` of `{module}.weight` (`shape = [out, in]`).
    fn read(
        &self,
        module: &str,
        shape: [usize; 2],
        rows: Range<usize>,
        cols: Range<usize>,
    ) -> Result<LinearWeight, ModelError> {
        let c = self.config;
        let format = c.quant.as_ref().map_or(WeightFormat::Plain, |q| {
            q.format_for(&format!("{}{module}", c.tensor_prefix)) // configs name modules in full
        });
        Ok(self.ckpt.read_linear(module, shape, rows, cols, format)?)
    }

    /// A vector `[n]`.
    fn vector(&self, name: &str, n: usize) -> Result<Vec<f32>, ModelError> {
        Ok(self.ckpt.read_f32(name, &[n])?)
    }

    /// `{module}.bias` `[n]` if the config has attention biases.
    fn bias(&self, module: &str, n: usize) -> Result<Option<Vec<f32>>, ModelError> {
        self.config.attention_bias.then(|| self.vector(&format!("{module}.bias"), n)).transpose()
    }

    /// The whole layer, replicated on every rank.
    fn replicated<B: Backend>(
        &self,
        b: &B,
        module: &str,
        out: usize,
        inp: usize,
        bias: Option<Vec<f32>>,
    ) -> Result<B::Linear, ModelError> {
        Ok(b.linear(self.read(module, [out, inp], 0..out, 0..inp)?, bias, Parallel::Replicated))
    }

    /// Output rows `rows` of a column-parallel layer.
    fn column<B: Backend>(
        &self,
        b: &B,
        module: &str,
        out: usize,
        inp: usize,
        rows: Range<usize>,
    ) -> Result<B::Linear, ModelError> {
        Ok(b.linear(self.read(module, [out, inp], rows, 0..inp)?, None, Parallel::Column))
    }

    /// This rank's slice of a gated MLP (`{p}.gate_proj/up_proj/down_proj`):
    /// its rows of gate/up, its columns of down.
    fn gated<B: Backend>(&self, b: &B, p: &str, inter: usize) -> Result<GatedLinear<B>, ModelError> {
        let h = self.config.hidden_size;
        let rows = Split::even("an MLP width", inter).block(b, 1);
        let gate = self.read(&format!("{p}.gate_proj"), [inter, h], rows.clone(), 0..h)?;
        let up = self.read(&format!("{p}.up_proj"), [inter, h], rows.clone(), 0..h)?;
        let down = self.read(&format!("{p}.down_proj"), [h, inter], 0..h, rows)?;
        Ok(GatedLinear {
            gate_up_proj: b.linear(LinearWeight::stack(vec![gate, up]), None, Parallel::Column),
            down_proj: b.linear(down, None, Parallel::Row),
            act: Glu::Silu,
        })
    }
}

/// Multi-head latent attention (`self_attn.*`) of this rank's heads.
pub struct Mla<B: Backend> {
    /// `q_a_proj` and `q_a_layernorm` (q-LoRA), replicated; `None` = plain `q_proj`.
    q_a: Option<(B::Linear, B::Vector)>,
    /// `q_b_proj` (or `q_proj`): `[heads · qk_head_dim, q_lora_rank | hidden]`, column-parallel.
    q_b_proj: B::Linear,
    /// `[kv_lora_rank + qk_rope_head_dim, hidden]`, replicated.
    kv_a_proj_with_mqa: B::Linear,
    kv_a_layernorm: B::Vector,
    /// `[heads · (qk_nope_head_dim + v_head_dim), kv_lora_rank]`, column-parallel.
    kv_b_proj: B::Linear,
    /// `[hidden, heads · v_head_dim]`, row-parallel.
    o_proj: B::Linear,
    dims: MlaDims,
}

/// The sizes an MLA forward needs.
#[derive(Clone, Copy, Debug)]
struct MlaDims {
    /// Heads on this rank.
    heads: usize,
    nope: usize,
    rope: usize,
    v: usize,
    kv_lora_rank: usize,
    interleave: bool,
    scale: f32,
    eps: f32,
}

/// Buffers of the MLA block, sized by the step.
pub struct MlaScratch<B: Backend> {
    /// `[T, q_lora_rank]`: `q_a_proj(h)` and its norm.
    qa: Tensor<B>,
    qa_norm: Tensor<B>,
    /// `[T, heads · qk_head_dim]`.
    q: Tensor<B>,
    /// `[T, kv_lora_rank + qk_rope_head_dim]`: `[c_kv | k_rot]`.
    ckv: Tensor<B>,
    /// `[T, kv_lora_rank]`: `kv_a_layernorm(c_kv)`.
    latent: Tensor<B>,
    /// `[T, heads · (qk_nope_head_dim + v_head_dim)]`: `[k_nope | v]` per head.
    kvb: Tensor<B>,
    /// `[T, heads · qk_head_dim]`: `[k_nope | k_rot]` per head.
    k: Tensor<B>,
    /// `[T, heads · v_head_dim]`.
    v: Tensor<B>,
    /// `[T, heads · v_head_dim]`.
    out: Tensor<B>,
}

impl<B: Backend> Mla<B> {
    fn load(b: &B, r: &Reader<'_>, p: &str) -> Result<Self, ModelError> {
        let c = r.config;
        let h = c.hidden_size;
        let (nh, qk, nope, vd) = (c.num_heads, c.qk_head_dim(), c.qk_nope_head_dim, c.v_head_dim);
        let heads = Split::even("num_attention_heads", nh);
        let per_head = |w: usize| heads.block(b, w); // this rank's heads, `w` rows or columns each
        let (q_a, q_b_proj) = match c.q_lora_rank {
            Some(rank) => {
                let q_a_proj = format!("{p}.self_attn.q_a_proj");
                let q_a = r.replicated(b, &q_a_proj, rank, h, r.bias(&q_a_proj, rank)?)?;
                let norm = b.vector(r.vector(&format!("{p}.self_attn.q_a_layernorm.weight"), rank)?);
                (Some((q_a, norm)), r.column(b, &format!("{p}.self_attn.q_b_proj"), nh * qk, rank, per_head(qk))?)
            }
            None => (None, r.column(b, &format!("{p}.self_attn.q_proj"), nh * qk, h, per_head(qk))?),
        };
        let kva = c.kv_lora_rank + c.qk_rope_head_dim;
        let kv_a = format!("{p}.self_attn.kv_a_proj_with_mqa");
        let o_proj = format!("{p}.self_attn.o_proj");
        let o_bias = r.bias(&o_proj, h)?;
        Ok(Mla {
            q_a,
            q_b_proj,
            kv_a_proj_with_mqa: r.replicated(b, &kv_a, kva, h, r.bias(&kv_a, kva)?)?,
            kv_a_layernorm: b.vector(r.vector(&format!("{p}.self_attn.kv_a_layernorm.weight"), c.kv_lora_rank)?),
            kv_b_proj: r.column(
                b,
                &format!("{p}.self_attn.kv_b_proj"),
                nh * (nope + vd),
                c.kv_lora_rank,
                per_head(nope + vd),
            )?,
            o_proj: b.linear(r.read(&o_proj, [h, nh * vd], 0..h, per_head(vd))?, o_bias, Parallel::Row),
            dims: MlaDims {
                heads: heads.local(b),
                nope,
                rope: c.qk_rope_head_dim,
                v: vd,
                kv_lora_rank: c.kv_lora_rank,
                interleave: c.rope_interleave,
                scale: c.softmax_scale(),
                eps: c.rms_norm_eps,
            },
        })
    }

    /// `x += o_proj(attn(q, k, v))` of `h = input_layernorm(x)`.
    fn forward_add<H: Dim>(
        &self,
        b: &B,
        h: &Tensor<B, H>,
        x: &mut Tensor<B, H>,
        step: &Step<'_, B>,
        s: &mut MlaScratch<B>,
        kv: LayerState<'_, B::KvCache>,
    ) {
        let d = self.dims;
        let t = h.rows();
        let (nh, nope, rope, vd, kvr, eps) = (d.heads, d.nope, d.rope, d.v, d.kv_lora_rank, d.eps);
        let qk = nope + rope;
        // q = q_b_proj(q_a_layernorm(q_a_proj(h))), or q_proj(h).
        s.q.resize(b, t, nh * qk);
        match &self.q_a {
            Some((q_a_proj, q_a_layernorm)) => {
                let r = q_a_proj.out_features();
                s.qa.resize(b, t, r);
                b.linear_forward(q_a_proj, h, &mut s.qa);
                s.qa_norm.resize(b, t, r);
                b.rms_norm(s.qa.all(), q_a_layernorm, eps, &mut s.qa_norm);
                b.linear_forward(&self.q_b_proj, &s.qa_norm, &mut s.q);
            }
            None => b.linear_forward(&self.q_b_proj, h, &mut s.q),
        }
        // [c_kv | k_rot] = kv_a_proj_with_mqa(h); [k_nope | v] per head = kv_b_proj(kv_a_layernorm(c_kv)).
        s.ckv.resize(b, t, kvr + rope);
        b.linear_forward(&self.kv_a_proj_with_mqa, h, &mut s.ckv);
        s.latent.resize(b, t, kvr);
        b.rms_norm(s.ckv.cols(0, kvr), &self.kv_a_layernorm, eps, &mut s.latent);
        s.kvb.resize(b, t, nh * (nope + vd));
        b.linear_forward(&self.kv_b_proj, &s.latent, &mut s.kvb);
        // RoPE on the rotary tails: the shared k_rot and each head's q.
        let k_rot = HeadSpan { offset: kvr, count: 1, stride: 0, width: rope };
        b.rope(&mut s.ckv, k_rot, d.interleave, step.rope, step.batch);
        let q_rot = HeadSpan { offset: nope, count: nh, stride: qk, width: rope };
        b.rope(&mut s.q, q_rot, d.interleave, step.rope, step.batch);
        // Keys [k_nope | k_rot] and values, per head.
        s.k.resize(b, t, nh * qk);
        s.v.resize(b, t, nh * vd);
        let kvb = |offset, width| HeadSpan { offset, count: nh, stride: nope + vd, width };
        b.copy_heads(&s.kvb, kvb(0, nope), &mut s.k, HeadSpan { offset: 0, count: nh, stride: qk, width: nope });
        b.copy_heads(
            &s.ckv,
            HeadSpan { count: nh, ..k_rot },
            &mut s.k,
            HeadSpan { offset: nope, count: nh, stride: qk, width: rope },
        );
        b.copy_heads(&s.kvb, kvb(nope, vd), &mut s.v, HeadSpan::heads(0, nh, vd));
        let shape = AttnShape { heads: nh, kv_heads: nh, head_dim: qk, v_dim: vd, mask: Mask::Causal, scale: d.scale };
        s.out.resize(b, t, nh * vd);
        let qkv = Qkv { q: s.q.all(), k: s.k.all(), v: s.v.all() };
        b.attention(qkv, shape, None, step.batch, kv, &mut s.out);
        b.linear_add(&self.o_proj, &s.out, x);
    }

    fn linears(&self) -> Vec<&B::Linear> {
        let mut out: Vec<&B::Linear> = self.q_a.iter().map(|(l, _)| l).collect();
        out.extend([&self.q_b_proj, &self.kv_a_proj_with_mqa, &self.kv_b_proj, &self.o_proj]);
        out
    }

    fn weight_bytes(&self) -> usize {
        let norms = self.q_a.as_ref().map_or(0, |(_, n)| n.resident_bytes()) + self.kv_a_layernorm.resident_bytes();
        norms + self.linears().iter().map(|l| l.resident_bytes()).sum::<usize>()
    }
}

/// A dense gated MLP (`mlp.*` of the first `first_k_dense_replace` layers).
pub struct Mlp<B: Backend> {
    proj: GatedLinear<B>,
}

/// Buffers of the MLP and MoE blocks.
pub struct MlpScratch<B: Backend> {
    /// `[T, 2 · intermediate]`.
    gate_up: Tensor<B>,
    /// `[T, intermediate]`.
    act: Tensor<B>,
    /// Router logits `[T, experts]`.
    logits: Tensor<B>,
}

impl<B: Backend> Mlp<B> {
    /// `out = down_proj(silu(gate_proj(h)) · up_proj(h))`.
    fn forward<H: Dim>(&self, b: &B, h: &Tensor<B, H>, out: &mut Tensor<B, H>, s: &mut MlpScratch<B>) {
        let inter = self.proj.down_proj.in_features();
        s.gate_up.resize(b, h.rows(), 2 * inter);
        s.act.resize(b, h.rows(), inter);
        b.linear_forward(&self.proj.gate_up_proj, h, &mut s.gate_up);
        b.glu(Glu::Silu, &s.gate_up, &mut s.act);
        b.linear_forward(&self.proj.down_proj, &s.act, out);
    }
}

/// The mixture of experts (`mlp.*` of the other layers).
fn load_moe<B: Backend>(b: &B, r: &Reader<'_>, p: &str) -> Result<Moe<B>, ModelError> {
    let c = r.config;
    let (h, e) = (c.hidden_size, c.n_routed_experts);
    // Hundreds of experts per layer: the backend chooses how to build them.
    let experts = b.build_many(e, |i| r.gated(b, &format!("{p}.mlp.experts.{i}"), c.moe_intermediate_size))?;
    let shared_experts = if c.n_shared_experts > 0 {
        Some(r.gated(b, &format!("{p}.mlp.shared_experts"), c.moe_intermediate_size * c.n_shared_experts)?)
    } else {
        None
    };
    let e_score_correction_bias = if c.topk_method == TopkMethod::NoauxTc {
        Some(b.vector(r.vector(&format!("{p}.mlp.gate.e_score_correction_bias"), e)?))
    } else {
        None
    };
    Ok(Moe {
        // The router stays f32 under any compute dtype, as HF keeps it: a
        // flipped expert choice costs more accuracy than the tiny GEMM saves.
        gate: b.linear_f32(r.read(&format!("{p}.mlp.gate"), [e, h], 0..e, 0..h)?, None, Parallel::Replicated),
        e_score_correction_bias,
        router: Router {
            scoring: c.scoring,
            topk_method: c.topk_method,
            top_k: c.num_experts_per_tok,
            n_group: c.n_group,
            topk_group: c.topk_group,
            norm_topk_prob: c.norm_topk_prob,
            routed_scaling_factor: c.routed_scaling_factor,
        },
        experts,
        shared_experts,
        gating: Gating::Output,
    })
}

/// The feed-forward block of a layer.
pub enum Ffn<B: Backend> {
    /// A dense MLP.
    Dense(Mlp<B>),
    /// A mixture of experts.
    Moe(Moe<B>),
}

impl<B: Backend> Ffn<B> {
    fn forward<H: Dim>(&self, b: &B, h: &Tensor<B, H>, out: &mut Tensor<B, H>, s: &mut MlpScratch<B>) {
        match self {
            Ffn::Dense(m) => m.forward(b, h, out, s),
            Ffn::Moe(m) => m.forward(b, h, out, &mut s.logits),
        }
    }

    fn linears(&self) -> Vec<&B::Linear> {
        match self {
            Ffn::Dense(m) => vec![&m.proj.gate_up_proj, &m.proj.down_proj],
            Ffn::Moe(m) => m.linears(),
        }
    }

    fn weight_bytes(&self) -> usize {
        match self {
            Ffn::Dense(m) => m.proj.gate_up_proj.resident_bytes() + m.proj.down_proj.resident_bytes(),
            Ffn::Moe(m) => m.weight_bytes(),
        }
    }
}

/// One decoder layer (`model.layers.{i}.*`).
pub struct DecoderLayer<B: Backend> {
    input_layernorm: B::Vector,
    self_attn: Mla<B>,
    post_attention_layernorm: B::Vector,
    mlp: Ffn<B>,
    eps: f32,
}

impl<B: Backend> DecoderLayer<B> {
    /// Every linear layer of this rank's share of the layer.
    pub fn linears(&self) -> Vec<&B::Linear> {
        let mut out = self.self_attn.linears();
        out.extend(self.mlp.linears());
        out
    }
}

impl<B: Backend, H: Dim> Decoder<B, DecoderLayer<B>, H> {
    /// Every linear layer of this rank, in layer order.
    pub fn linears(&self) -> Vec<&B::Linear> {
        self.layers().iter().flat_map(DecoderLayer::linears).collect()
    }
}

/// Buffers of one step, shared by every layer.
pub struct Scratch<B: Backend, H: Dim> {
    /// A norm of the residual stream, `[T, H]`.
    normed: Tensor<B, H>,
    /// The feed-forward block's output, `[T, H]`.
    ffn: Tensor<B, H>,
    attn: MlaScratch<B>,
    mlp: MlpScratch<B>,
}

impl<B: Backend> Block<B> for DecoderLayer<B> {
    type Config = DeepseekConfig;
    type Scratch<H: Dim> = Scratch<B, H>;

    fn parse_config(text: &str) -> Result<DeepseekConfig, ConfigError> {
        DeepseekConfig::from_json(text)
    }

    fn frame(c: &DeepseekConfig) -> Frame {
        let frame =
            Frame::plain(c.info(), c.rms_norm_eps, c.rope(), c.tensor_prefix.clone(), c.num_nextn_predict_layers);
        Frame { tied_embeddings: c.tie_word_embeddings, ..frame }
    }

    fn splits(c: &DeepseekConfig) -> Vec<Split> {
        // Heads and every MLP width present divide evenly (no kv-head replication: MLA has none).
        let dense = (0..c.num_layers).any(|l| !c.is_moe(l));
        let mut splits = vec![Split::even("num_attention_heads", c.num_heads)];
        splits.extend(dense.then(|| Split::even("intermediate_size", c.intermediate_size)));
        splits.extend((c.n_routed_experts > 0).then(|| Split::even("moe_intermediate_size", c.moe_intermediate_size)));
        splits
    }

    fn quantization(c: &DeepseekConfig) -> Option<String> {
        c.quant.as_ref().map(|q| q.describe())
    }

    fn load(b: &B, c: &DeepseekConfig, ckpt: &Checkpoint, l: usize) -> Result<Self, ModelError> {
        let r = Reader { ckpt, config: c };
        let p = format!("model.layers.{l}");
        let self_attn = Mla::load(b, &r, &p)?;
        let mlp = if c.is_moe(l) {
            Ffn::Moe(load_moe(b, &r, &p)?)
        } else {
            Ffn::Dense(Mlp { proj: r.gated(b, &format!("{p}.mlp"), c.intermediate_size)? })
        };
        let h = c.hidden_size;
        Ok(DecoderLayer {
            input_layernorm: b.vector(r.vector(&format!("{p}.input_layernorm.weight"), h)?),
            self_attn,
            post_attention_layernorm: b.vector(r.vector(&format!("{p}.post_attention_layernorm.weight"), h)?),
            mlp,
            eps: c.rms_norm_eps,
        })
    }

    fn scratch<H: Dim>(b: &B, _: &DeepseekConfig, _tokens: usize, hidden: H) -> Scratch<B, H> {
        let e = || Tensor::empty(b, 0);
        Scratch {
            normed: Tensor::empty(b, hidden),
            ffn: Tensor::empty(b, hidden),
            attn: MlaScratch {
                qa: e(),
                qa_norm: e(),
                q: e(),
                ckv: e(),
                latent: e(),
                kvb: e(),
                k: e(),
                v: e(),
                out: e(),
            },
            mlp: MlpScratch { gate_up: e(), act: e(), logits: e() },
        }
    }

    fn forward<H: Dim>(&self, b: &B, x: &mut Tensor<B, H>, at: LayerStep<'_, B, Scratch<B, H>>) {
        let LayerStep { step, scratch: s, state: cache, index } = at;
        let (t, hidden) = (x.rows(), x.width());
        s.normed.resize(b, t, hidden);
        s.ffn.resize(b, t, hidden);
        // x += self_attn(input_layernorm(x))
        b.rms_norm(x.all(), &self.input_layernorm, self.eps, &mut s.normed);
        self.self_attn.forward_add(b, &s.normed, x, step, &mut s.attn, LayerState::new(&mut cache.kv, index));
        // x += mlp(post_attention_layernorm(x))
        b.rms_norm(x.all(), &self.post_attention_layernorm, self.eps, &mut s.normed);
        self.mlp.forward(b, &s.normed, &mut s.ffn, &mut s.mlp);
        b.add(x, &s.ffn);
    }

    fn weight_bytes(&self) -> usize {
        self.input_layernorm.resident_bytes()
            + self.self_attn.weight_bytes()
            + self.post_attention_layernorm.resident_bytes()
            + self.mlp.weight_bytes()
    }
}
