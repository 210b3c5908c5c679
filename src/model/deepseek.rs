//! DeepSeek V2/V3 and Kimi-K2 on the CPU: multi-head latent attention (MLA)
//! and a mixture of experts with shared experts, over packed batches.
//!
//! Per layer, as in the checkpoints (`model.layers.{i}.*`):
//! `x += o_proj(attn(q, k, v))` on `input_layernorm(x)`, where
//! `q = q_b_proj(q_a_layernorm(q_a_proj(h)))` (or `q_proj(h)` without q-LoRA),
//! `[c_kv, k_rot] = kv_a_proj_with_mqa(h)`, `[k_nope, v] = kv_b_proj(kv_a_layernorm(c_kv))`
//! per head, RoPE on the `qk_rope_head_dim` tail of q and on the shared `k_rot`;
//! then `x += mlp(post_attention_layernorm(x))`, dense for the first
//! `first_k_dense_replace` layers, else `shared_experts(h) + Σ_topk w_e · expert_e(h)`.

use super::frame::{self, Captures};
use super::{KvCache, ModelError};
use crate::batch::PackedBatch;
use crate::capture::{CaptureSet, Tap};
use crate::checkpoint::{Checkpoint, CheckpointError, PrefixMismatch};
use crate::config::ConfigError;
use crate::cpu::attention::{varlen_attention, AttnSegment, AttnShape, KvRef};
use crate::cpu::ops::{rms_norm, rope_head, swiglu};
use crate::cpu::PackedLinear;
use crate::quant::{LinearWeight, QuantConfig, WeightFormat};
use crate::shape::{dim_from_size, CapturedStates, DType, Dim};
use crate::tp::Collective;
use rayon::prelude::*;
use serde::Deserialize;
use serde_json::Value;
use std::path::Path;
use std::sync::Arc;
use tracing::{debug_span, info_span};

/// How router scores are made from logits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Scoring {
    /// DeepSeek-V2.
    Softmax,
    /// DeepSeek-V3, Kimi-K2.
    Sigmoid,
}

/// How the top-k experts are chosen.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TopkMethod {
    /// The k best scores.
    Greedy,
    /// Best `topk_group` groups by their best score, then the k best in them (V2).
    GroupLimitedGreedy,
    /// Scores plus `e_score_correction_bias`; groups ranked by the sum of their
    /// two best; weights from the unbiased scores (V3).
    NoauxTc,
}

/// RoPE of the rotary part.
#[derive(Clone, Debug, PartialEq)]
pub enum DsRope {
    /// Plain RoPE.
    Default,
    /// YaRN with DeepSeek's mscale.
    Yarn {
        /// Context extension factor.
        factor: f32,
        /// Pre-training context.
        original_max_position_embeddings: f32,
        /// Fast boundary (rotations).
        beta_fast: f32,
        /// Slow boundary (rotations).
        beta_slow: f32,
        /// cos/sin magnitude factor.
        mscale: f32,
        /// Softmax scale factor.
        mscale_all_dim: f32,
    },
}

/// A DeepSeek V2/V3 (or Kimi-K2) config, normalised.
#[derive(Clone, Debug, PartialEq)]
pub struct DeepseekConfig {
    /// `model_type`.
    pub model_type: String,
    /// Residual width.
    pub hidden_size: usize,
    /// Decoder layers.
    pub num_layers: usize,
    /// Attention heads.
    pub num_heads: usize,
    /// Dense MLP width.
    pub intermediate_size: usize,
    /// Vocabulary.
    pub vocab_size: usize,
    /// Longest sequence.
    pub max_position_embeddings: usize,
    /// RMSNorm epsilon.
    pub rms_norm_eps: f32,
    /// q LoRA rank; `None` = plain `q_proj`.
    pub q_lora_rank: Option<usize>,
    /// Latent KV width.
    pub kv_lora_rank: usize,
    /// Per-head q/k width without RoPE.
    pub qk_nope_head_dim: usize,
    /// Per-head q/k width with RoPE.
    pub qk_rope_head_dim: usize,
    /// Per-head value width.
    pub v_head_dim: usize,
    /// RoPE base.
    pub rope_theta: f32,
    /// RoPE scaling.
    pub rope: DsRope,
    /// Rotary dims come in interleaved pairs.
    pub rope_interleave: bool,
    /// Bias on q_a/kv_a/o projections.
    pub attention_bias: bool,
    /// Routed experts; 0 = every layer dense.
    pub n_routed_experts: usize,
    /// Shared experts (their MLP width is `n_shared_experts · moe_intermediate_size`).
    pub n_shared_experts: usize,
    /// Experts per token.
    pub num_experts_per_tok: usize,
    /// Expert MLP width.
    pub moe_intermediate_size: usize,
    /// Leading dense layers.
    pub first_k_dense_replace: usize,
    /// MoE on every `moe_layer_freq`-th layer after them.
    pub moe_layer_freq: usize,
    /// Scale of routed expert weights.
    pub routed_scaling_factor: f32,
    /// Normalise the top-k weights to sum to 1.
    pub norm_topk_prob: bool,
    /// Router scoring.
    pub scoring: Scoring,
    /// Expert choice.
    pub topk_method: TopkMethod,
    /// Expert groups.
    pub n_group: usize,
    /// Groups kept per token.
    pub topk_group: usize,
    /// `quantization_config`: FP8 blocks or packed INT4; `None` for plain weights.
    pub quant: Option<QuantConfig>,
    /// Prefix of the text model's tensor names: `language_model.` inside
    /// Kimi-K2.5's multimodal wrapper, else empty.
    pub tensor_prefix: String,
}

#[derive(Deserialize)]
struct Raw {
    model_type: Option<String>,
    hidden_size: Option<usize>,
    num_hidden_layers: Option<usize>,
    num_attention_heads: Option<usize>,
    intermediate_size: Option<usize>,
    vocab_size: Option<usize>,
    max_position_embeddings: Option<usize>,
    rms_norm_eps: Option<f64>,
    q_lora_rank: Option<usize>,
    kv_lora_rank: Option<usize>,
    qk_nope_head_dim: Option<usize>,
    qk_rope_head_dim: Option<usize>,
    v_head_dim: Option<usize>,
    rope_theta: Option<f64>,
    rope_scaling: Option<Value>,
    rope_parameters: Option<Value>,
    rope_interleave: Option<bool>,
    attention_bias: Option<bool>,
    hidden_act: Option<String>,
    n_routed_experts: Option<usize>,
    n_shared_experts: Option<usize>,
    num_experts_per_tok: Option<usize>,
    moe_intermediate_size: Option<usize>,
    first_k_dense_replace: Option<usize>,
    moe_layer_freq: Option<usize>,
    routed_scaling_factor: Option<f64>,
    norm_topk_prob: Option<bool>,
    scoring_func: Option<String>,
    topk_method: Option<String>,
    n_group: Option<usize>,
    topk_group: Option<usize>,
    quantization_config: Option<Value>,
}

fn invalid(field: &'static str, problem: impl Into<String>) -> ConfigError {
    ConfigError::Invalid { field, problem: problem.into() }
}

impl DeepseekConfig {
    /// Reads and normalises `config.json` from a file.
    pub fn from_file(path: &Path) -> Result<Self, ConfigError> {
        let text = std::fs::read_to_string(path)
            .map_err(|cause| ConfigError::Io { path: path.display().to_string(), cause })?;
        Self::from_json(&text)
    }

    /// Checks that heads and every MLP width split over `size` ranks.
    pub fn check_tp(&self, size: usize) -> Result<(), String> {
        let mut widths = vec![("num_attention_heads", self.num_heads)];
        if (0..self.num_layers).any(|l| !self.is_moe(l)) {
            widths.push(("intermediate_size", self.intermediate_size));
        }
        if self.n_routed_experts > 0 {
            widths.push(("moe_intermediate_size", self.moe_intermediate_size));
        }
        for (what, n) in widths {
            if size == 0 || !n.is_multiple_of(size) {
                return Err(format!(
                    "--tp {size}: {what} {n} is not divisible by {size}; choose a TP size that divides it"
                ));
            }
        }
        Ok(())
    }

    /// Whether `model_type` is one of this family's.
    pub fn handles(model_type: &str) -> bool {
        matches!(model_type, "deepseek_v2" | "deepseek_v3" | "kimi_k2" | "kimi_k25")
    }

    /// Parses and normalises `config.json` text. Kimi-K2.5's multimodal
    /// wrapper (`kimi_k25`) is read through its `text_config`, whose tensors
    /// live under `language_model.`; its vision tower is not used.
    pub fn from_json(text: &str) -> Result<Self, ConfigError> {
        let v: Value = serde_json::from_str(text)?;
        if v.get("model_type").and_then(Value::as_str) == Some("kimi_k25") {
            let inner = v
                .get("text_config")
                .filter(|t| t.is_object())
                .ok_or(ConfigError::Missing("text_config (kimi_k25 keeps the language model's config there)"))?;
            let mut inner = inner.clone();
            if inner.get("model_type").is_none() {
                inner["model_type"] = "kimi_k2".into(); // the text model Kimi-K2.5 wraps
            }
            let mut c = Self::from_value(inner)?;
            if c.model_type == "kimi_k25" {
                return Err(invalid("text_config", "model_type is kimi_k25 again; expected kimi_k2 or deepseek_v3"));
            }
            if c.quant.is_none() {
                c.quant = QuantConfig::from_json(v.get("quantization_config"))?;
            }
            c.tensor_prefix = "language_model.".into();
            return Ok(c);
        }
        Self::from_value(v)
    }

    fn from_value(v: Value) -> Result<Self, ConfigError> {
        let r: Raw = serde_json::from_value(v)?;
        let model_type = r.model_type.clone().ok_or(ConfigError::Missing("model_type"))?;
        if !Self::handles(&model_type) {
            return Err(ConfigError::UnsupportedModel(model_type));
        }
        let v3 = model_type != "deepseek_v2";
        let need = |v: Option<usize>, f: &'static str| v.ok_or(ConfigError::Missing(f));
        if let Some(act) = &r.hidden_act {
            if act != "silu" {
                return Err(invalid("hidden_act", format!("{act:?} is not supported (only silu)")));
            }
        }
        let params = r.rope_parameters.as_ref().or(r.rope_scaling.as_ref()).filter(|v| !v.is_null());
        let num = |k: &str| params.and_then(|p| p.get(k)).and_then(Value::as_f64).map(|v| v as f32);
        let rope_theta = num("rope_theta").or(r.rope_theta.map(|t| t as f32)).unwrap_or(10000.0);
        let kind = params
            .and_then(|p| p.get("rope_type").or_else(|| p.get("type")))
            .and_then(Value::as_str)
            .unwrap_or("default");
        let rope = match kind {
            "default" => DsRope::Default,
            "yarn" => DsRope::Yarn {
                factor: num("factor").ok_or_else(|| invalid("rope_parameters", "yarn needs `factor`"))?,
                original_max_position_embeddings: num("original_max_position_embeddings")
                    .ok_or_else(|| invalid("rope_parameters", "yarn needs `original_max_position_embeddings`"))?,
                beta_fast: num("beta_fast").unwrap_or(32.0),
                beta_slow: num("beta_slow").unwrap_or(1.0),
                mscale: num("mscale").unwrap_or(1.0),
                mscale_all_dim: num("mscale_all_dim").unwrap_or(0.0),
            },
            other => {
                return Err(invalid(
                    "rope_parameters",
                    format!("rope type {other:?} is not supported for DeepSeek (supported: default, yarn)"),
                ))
            }
        };
        let scoring = match r.scoring_func.as_deref() {
            None => {
                if v3 {
                    Scoring::Sigmoid
                } else {
                    Scoring::Softmax
                }
            }
            Some("softmax") => Scoring::Softmax,
            Some("sigmoid") => Scoring::Sigmoid,
            Some(o) => return Err(invalid("scoring_func", format!("{o:?} (expected softmax or sigmoid)"))),
        };
        let topk_method = match r.topk_method.as_deref() {
            None => {
                if v3 {
                    TopkMethod::NoauxTc
                } else {
                    TopkMethod::Greedy
                }
            }
            Some("greedy") => TopkMethod::Greedy,
            Some("group_limited_greedy") => TopkMethod::GroupLimitedGreedy,
            Some("noaux_tc") => TopkMethod::NoauxTc,
            Some(o) => {
                return Err(invalid(
                    "topk_method",
                    format!("{o:?} (expected greedy, group_limited_greedy or noaux_tc)"),
                ))
            }
        };
        let c = DeepseekConfig {
            hidden_size: need(r.hidden_size, "hidden_size")?,
            num_layers: need(r.num_hidden_layers, "num_hidden_layers")?,
            num_heads: need(r.num_attention_heads, "num_attention_heads")?,
            intermediate_size: need(r.intermediate_size, "intermediate_size")?,
            vocab_size: need(r.vocab_size, "vocab_size")?,
            max_position_embeddings: r.max_position_embeddings.unwrap_or(usize::MAX),
            rms_norm_eps: r.rms_norm_eps.unwrap_or(1e-6) as f32,
            q_lora_rank: r.q_lora_rank,
            kv_lora_rank: need(r.kv_lora_rank, "kv_lora_rank")?,
            qk_nope_head_dim: need(r.qk_nope_head_dim, "qk_nope_head_dim")?,
            qk_rope_head_dim: need(r.qk_rope_head_dim, "qk_rope_head_dim")?,
            v_head_dim: need(r.v_head_dim, "v_head_dim")?,
            rope_theta,
            rope,
            rope_interleave: r.rope_interleave.unwrap_or(true),
            attention_bias: r.attention_bias.unwrap_or(false),
            n_routed_experts: r.n_routed_experts.unwrap_or(0),
            n_shared_experts: r.n_shared_experts.unwrap_or(0),
            num_experts_per_tok: r.num_experts_per_tok.unwrap_or(0),
            moe_intermediate_size: r.moe_intermediate_size.unwrap_or(0),
            first_k_dense_replace: r.first_k_dense_replace.unwrap_or(0),
            moe_layer_freq: r.moe_layer_freq.unwrap_or(1),
            routed_scaling_factor: r.routed_scaling_factor.unwrap_or(1.0) as f32,
            norm_topk_prob: r.norm_topk_prob.unwrap_or(false),
            scoring,
            topk_method,
            n_group: r.n_group.unwrap_or(1).max(1),
            topk_group: r.topk_group.unwrap_or(1).max(1),
            quant: QuantConfig::from_json(r.quantization_config.as_ref())?,
            tensor_prefix: String::new(),
            model_type,
        };
        if !c.qk_rope_head_dim.is_multiple_of(2) {
            return Err(invalid("qk_rope_head_dim", "must be even"));
        }
        if c.n_routed_experts > 0 {
            if c.num_experts_per_tok == 0 || c.num_experts_per_tok > c.n_routed_experts {
                return Err(invalid("num_experts_per_tok", format!("must be 1..={}", c.n_routed_experts)));
            }
            if c.moe_intermediate_size == 0 {
                return Err(invalid("moe_intermediate_size", "must be positive"));
            }
            if !c.n_routed_experts.is_multiple_of(c.n_group) || c.topk_group > c.n_group {
                return Err(invalid(
                    "n_group",
                    format!("{} groups of {} experts, topk_group {}", c.n_group, c.n_routed_experts, c.topk_group),
                ));
            }
            if c.topk_method == TopkMethod::NoauxTc && c.n_routed_experts / c.n_group < 2 {
                return Err(invalid("n_group", "noaux_tc ranks groups by their two best experts: need 2 per group"));
            }
        }
        Ok(c)
    }

    /// The outer shape.
    pub fn info(&self) -> crate::config::ArchInfo {
        crate::config::ArchInfo {
            architecture: self.model_type.clone(),
            num_layers: self.num_layers,
            hidden_size: self.hidden_size,
            vocab_size: self.vocab_size,
            max_position_embeddings: self.max_position_embeddings,
        }
    }

    /// Per-head q/k width.
    pub fn qk_head_dim(&self) -> usize {
        self.qk_nope_head_dim + self.qk_rope_head_dim
    }

    /// Whether layer `l` is a mixture of experts.
    pub fn is_moe(&self, l: usize) -> bool {
        self.n_routed_experts > 0 && l >= self.first_k_dense_replace && l.is_multiple_of(self.moe_layer_freq.max(1))
    }

    /// Inverse frequencies of the rotary dims and the cos/sin magnitude factor.
    fn rope_inv_freq(&self) -> (Vec<f32>, f32) {
        let d = self.qk_rope_head_dim;
        let base = self.rope_theta;
        let pos_freqs: Vec<f32> = (0..d / 2).map(|i| base.powf((2 * i) as f32 / d as f32)).collect();
        match self.rope {
            DsRope::Default => (pos_freqs.iter().map(|p| 1.0 / p).collect(), 1.0),
            DsRope::Yarn {
                factor,
                original_max_position_embeddings: orig,
                beta_fast,
                beta_slow,
                mscale,
                mscale_all_dim,
            } => {
                let get_mscale = |scale: f32, m: f32| if scale <= 1.0 { 1.0 } else { 0.1 * m * scale.ln() + 1.0 };
                let attention_factor = if mscale != 0.0 && mscale_all_dim != 0.0 {
                    get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim)
                } else {
                    get_mscale(factor, 1.0)
                };
                let dimf = d as f64;
                let corr = |rot: f32| {
                    dimf * ((orig as f64) / (rot as f64 * 2.0 * std::f64::consts::PI)).ln() / (2.0 * (base as f64).ln())
                };
                let low = corr(beta_fast).floor().max(0.0) as f32;
                let high = (corr(beta_slow).ceil() as f32).min(d as f32 - 1.0);
                let high = if low == high { high + 0.001 } else { high };
                let inv = pos_freqs
                    .iter()
                    .enumerate()
                    .map(|(i, p)| {
                        let ramp = ((i as f32 - low) / (high - low)).clamp(0.0, 1.0);
                        let extrapolation = 1.0 - ramp;
                        (1.0 / (factor * p)) * (1.0 - extrapolation) + (1.0 / p) * extrapolation
                    })
                    .collect();
                (inv, attention_factor)
            }
        }
    }

    /// Softmax scale: `qk_head_dim^-0.5`, times YaRN's `mscale(mscale_all_dim)^2`.
    fn softmax_scale(&self) -> f32 {
        let base = (self.qk_head_dim() as f32).powf(-0.5);
        match self.rope {
            DsRope::Yarn { factor, mscale_all_dim, .. } if mscale_all_dim != 0.0 && factor > 1.0 => {
                let m = 0.1 * mscale_all_dim * factor.ln() + 1.0;
                base * m * m
            }
            _ => base,
        }
    }
}

/// MLA weights of one layer (`self_attn.*`).
struct Mla {
    q_a_proj: Option<PackedLinear>,
    q_a_layernorm: Option<Vec<f32>>,
    /// `q_b_proj`, or `q_proj` without q-LoRA.
    q_b_proj: PackedLinear,
    kv_a_proj_with_mqa: PackedLinear,
    kv_a_layernorm: Vec<f32>,
    kv_b_proj: PackedLinear,
    o_proj: PackedLinear,
    /// o_proj's bias when added after the all-reduce (tensor parallelism).
    o_bias: Option<Vec<f32>>,
}

/// A gated MLP (a dense layer, a shared expert block, or one routed expert).
struct GatedMlp {
    /// `gate_proj` and `up_proj` stacked.
    gate_up_proj: PackedLinear,
    down_proj: PackedLinear,
    inter: usize,
}

/// The MoE block (`mlp.*`).
struct Moe {
    /// Router `mlp.gate.weight`.
    gate: PackedLinear,
    e_score_correction_bias: Option<Vec<f32>>,
    experts: Vec<GatedMlp>,
    shared_experts: Option<GatedMlp>,
}

enum Ffn {
    Dense(GatedMlp),
    Moe(Moe),
}

struct DecoderLayer {
    input_layernorm: Vec<f32>,
    self_attn: Mla,
    post_attention_layernorm: Vec<f32>,
    mlp: Ffn,
}

/// A loaded DeepSeek V2/V3 / Kimi-K2 model whose hidden width is the dim `H`.
pub struct Deepseek<H: Dim = usize> {
    config: DeepseekConfig,
    hidden: H,
    dtype: DType,
    embed_tokens: frame::Embedding,
    layers: Vec<DecoderLayer>,
    norm: Vec<f32>,
    inv_freq: Vec<f32>,
    rope_scale: f32,
    /// Attention heads this rank holds.
    heads: usize,
    /// The rank's communicator; `None` for a single rank.
    comm: Option<Arc<dyn Collective<Buf = [f32]>>>,
}

/// Reads the linear layers of one checkpoint as stored (plain, FP8 or INT4),
/// in the formats the config's `quantization_config` declares.
struct Linears<'a> {
    ckpt: &'a Checkpoint,
    config: &'a DeepseekConfig,
}

impl Linears<'_> {
    /// Block `rows × cols` of `{module}.weight` (`[out, inp]`).
    fn read(
        &self,
        module: &str,
        shape: [usize; 2],
        rows: std::ops::Range<usize>,
        cols: std::ops::Range<usize>,
    ) -> Result<LinearWeight, ModelError> {
        let c = self.config;
        let format = c.quant.as_ref().map_or(WeightFormat::Plain, |q| {
            q.format_for(&format!("{}{module}", c.tensor_prefix)) // configs name modules in full
        });
        Ok(self.ckpt.read_linear(module, shape, rows, cols, format)?)
    }

    /// The whole layer.
    fn full(&self, module: &str, out: usize, inp: usize, bias: Option<Vec<f32>>) -> Result<PackedLinear, ModelError> {
        Ok(PackedLinear::from_weight(self.read(module, [out, inp], 0..out, 0..inp)?, bias))
    }

    /// Rank `rank` of `size`'s slice of a gated MLP: its rows of gate/up, its columns of down.
    fn gated(&self, p: &str, h: usize, inter: usize, rank: usize, size: usize) -> Result<GatedMlp, ModelError> {
        let local = inter / size;
        let rows = rank * local..(rank + 1) * local;
        let gate = self.read(&format!("{p}.gate_proj"), [inter, h], rows.clone(), 0..h)?;
        let up = self.read(&format!("{p}.up_proj"), [inter, h], rows.clone(), 0..h)?;
        let down = self.read(&format!("{p}.down_proj"), [h, inter], 0..h, rows)?;
        Ok(GatedMlp {
            gate_up_proj: PackedLinear::from_weight(LinearWeight::stack(vec![gate, up]), None),
            down_proj: PackedLinear::from_weight(down, None),
            inter: local,
        })
    }
}

impl GatedMlp {
    /// `out = down(silu(gate(x)) * up(x))` for `t` rows.
    fn forward(&self, x: &[f32], t: usize, gu: &mut Vec<f32>, act: &mut Vec<f32>, out: &mut [f32]) {
        gu.resize(t * 2 * self.inter, 0.0);
        act.resize(t * self.inter, 0.0);
        self.gate_up_proj.forward(x, t, gu, false);
        swiglu(gu, self.inter, act);
        self.down_proj.forward(act, t, out, false);
    }
}

impl<H: Dim + Default> Deepseek<H> {
    /// Loads `config.json` and the weights of a checkpoint directory.
    pub fn load(dir: &Path) -> Result<Self, ModelError> {
        let text = std::fs::read_to_string(dir.join("config.json"))
            .map_err(|cause| ConfigError::Io { path: dir.join("config.json").display().to_string(), cause })?;
        let config = DeepseekConfig::from_json(&text)?;
        let ckpt = Checkpoint::open_scoped(dir, &config.tensor_prefix)?;
        Self::from_checkpoint(config, &ckpt)
    }

    /// Builds the model from a config and an opened checkpoint.
    pub fn from_checkpoint(config: DeepseekConfig, ckpt: &Checkpoint) -> Result<Self, ModelError> {
        Self::from_checkpoint_rank(config, ckpt, 1, None)
    }

    /// Builds tensor-parallel rank `comm.rank()` of `size`: it holds its heads'
    /// rows of q_b/kv_b and columns of o_proj, and its slice of every expert's,
    /// the shared experts' and the dense MLPs' width ("TP inside each expert":
    /// every rank routes every token, so no token is sent between ranks, and one
    /// all-reduce per block sums the partial outputs). q_a, kv_a, the router and
    /// the norms are replicated.
    pub fn from_checkpoint_rank(
        config: DeepseekConfig,
        ckpt: &Checkpoint,
        size: usize,
        comm: Option<Arc<dyn Collective<Buf = [f32]>>>,
    ) -> Result<Self, ModelError> {
        config.check_tp(size).map_err(ModelError::Parallel)?;
        let rank = comm.as_ref().map_or(0, |c| c.rank());
        let _span = info_span!("load", arch = %config.model_type, layers = config.num_layers, rank).entered();
        if ckpt.prefix() != config.tensor_prefix {
            let (expected, actual) = (config.tensor_prefix.clone(), ckpt.prefix().to_string());
            return Err(CheckpointError::from(PrefixMismatch { expected, actual }).into());
        }
        let hidden: H = dim_from_size("config.json hidden_size", "hidden", config.hidden_size)?;
        let c = &config;
        let h = c.hidden_size;
        let (nh, qk, nope, rope, vd) =
            (c.num_heads, c.qk_head_dim(), c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim);
        let lh = nh / size; // heads on this rank
        let heads = rank * lh..(rank + 1) * lh;
        let per_head = |w: usize| heads.start * w..heads.end * w;
        let embed_tokens = frame::Embedding::read(ckpt, c.vocab_size, h)?;
        let dtype = embed_tokens.dtype();
        let bias = |name: &str, n: usize| -> Result<Option<Vec<f32>>, ModelError> {
            Ok(if c.attention_bias { Some(ckpt.read_f32(name, &[n])?) } else { None })
        };
        let lin = Linears { ckpt, config: c };
        let mut layers = Vec::with_capacity(c.num_layers);
        for l in 0..c.num_layers {
            let p = format!("model.layers.{l}");
            let w = |name: &str, shape: &[usize]| ckpt.read_f32(&format!("{p}.{name}"), shape);
            // Row (output) slice of a column-parallel weight.
            let rows =
                |name: &str, out: usize, inp: usize, r: std::ops::Range<usize>| -> Result<PackedLinear, ModelError> {
                    Ok(PackedLinear::from_weight(lin.read(&format!("{p}.{name}"), [out, inp], r, 0..inp)?, None))
                };
            let (q_a_proj, q_a_layernorm, q_b_proj) = match c.q_lora_rank {
                Some(r) => (
                    Some(lin.full(
                        &format!("{p}.self_attn.q_a_proj"),
                        r,
                        h,
                        bias(&format!("{p}.self_attn.q_a_proj.bias"), r)?,
                    )?),
                    Some(w("self_attn.q_a_layernorm.weight", &[r])?),
                    rows("self_attn.q_b_proj", nh * qk, r, per_head(qk))?,
                ),
                None => (None, None, rows("self_attn.q_proj", nh * qk, h, per_head(qk))?),
            };
            let kva = c.kv_lora_rank + rope;
            let o_bias = bias(&format!("{p}.self_attn.o_proj.bias"), h)?;
            let self_attn = Mla {
                q_a_proj,
                q_a_layernorm,
                q_b_proj,
                kv_a_proj_with_mqa: lin.full(
                    &format!("{p}.self_attn.kv_a_proj_with_mqa"),
                    kva,
                    h,
                    bias(&format!("{p}.self_attn.kv_a_proj_with_mqa.bias"), kva)?,
                )?,
                kv_a_layernorm: w("self_attn.kv_a_layernorm.weight", &[c.kv_lora_rank])?,
                kv_b_proj: rows("self_attn.kv_b_proj", nh * (nope + vd), c.kv_lora_rank, per_head(nope + vd))?,
                o_proj: {
                    let wt = lin.read(&format!("{p}.self_attn.o_proj"), [h, nh * vd], 0..h, per_head(vd))?;
                    PackedLinear::from_weight(wt, if size == 1 { o_bias.clone() } else { None })
                },
                o_bias: if size == 1 { None } else { o_bias },
            };
            let mlp = if c.is_moe(l) {
                let e = c.n_routed_experts;
                // Experts are read and repacked in parallel: with hundreds per layer, loading
                // (decoding INT4 nibbles, transposing into panels) is most of the time.
                let experts = (0..e)
                    .into_par_iter()
                    .map(|i| lin.gated(&format!("{p}.mlp.experts.{i}"), h, c.moe_intermediate_size, rank, size))
                    .collect::<Result<_, _>>()?;
                let shared_experts = if c.n_shared_experts > 0 {
                    Some(lin.gated(
                        &format!("{p}.mlp.shared_experts"),
                        h,
                        c.moe_intermediate_size * c.n_shared_experts,
                        rank,
                        size,
                    )?)
                } else {
                    None
                };
                let e_score_correction_bias = if c.topk_method == TopkMethod::NoauxTc {
                    Some(w("mlp.gate.e_score_correction_bias", &[e])?)
                } else {
                    None
                };
                Ffn::Moe(Moe {
                    gate: lin.full(&format!("{p}.mlp.gate"), e, h, None)?,
                    e_score_correction_bias,
                    experts,
                    shared_experts,
                })
            } else {
                Ffn::Dense(lin.gated(&format!("{p}.mlp"), h, c.intermediate_size, rank, size)?)
            };
            layers.push(DecoderLayer {
                input_layernorm: w("input_layernorm.weight", &[h])?,
                self_attn,
                post_attention_layernorm: w("post_attention_layernorm.weight", &[h])?,
                mlp,
            });
        }
        let norm = ckpt.read_f32("model.norm.weight", &[h])?;
        let (inv_freq, rope_scale) = config.rope_inv_freq();
        Ok(Deepseek { config, hidden, dtype, embed_tokens, layers, norm, inv_freq, rope_scale, heads: lh, comm })
    }
}

/// Per-step activations, sized by the batch.
#[derive(Default)]
struct Scratch {
    normed: Vec<f32>,
    qa: Vec<f32>,
    q: Vec<f32>,
    ckv: Vec<f32>,
    latent: Vec<f32>,
    kvb: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    attn: Vec<f32>,
    ffn: Vec<f32>,
    logits: Vec<f32>,
    rows: Vec<f32>,
    gu: Vec<f32>,
    act: Vec<f32>,
    eout: Vec<f32>,
}

/// Rotates a rotary block: HF's `rotate_half` pairs `(i, i + d/2)`, or with
/// `interleave` the pairs `(2i, 2i+1)`, written back as `[evens', odds']` as HF does.
fn rope_rotary(x: &mut [f32], cos: &[f32], sin: &[f32], interleave: bool, tmp: &mut [f32]) {
    if !interleave {
        rope_head(x, cos, sin);
        return;
    }
    let half = cos.len();
    for i in 0..half {
        let (a, b) = (x[2 * i], x[2 * i + 1]);
        tmp[i] = a * cos[i] - b * sin[i];
        tmp[half + i] = b * cos[i] + a * sin[i];
    }
    x.copy_from_slice(&tmp[..2 * half]);
}

impl<H: Dim> Deepseek<H> {
    /// The normalised config.
    pub fn config(&self) -> &DeepseekConfig {
        &self.config
    }
    /// The hidden dim.
    pub fn hidden(&self) -> H {
        self.hidden
    }
    /// The checkpoint's weight dtype.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// Every linear layer of this rank, in layer order.
    pub fn linears(&self) -> Vec<&PackedLinear> {
        let mut out = Vec::new();
        for l in &self.layers {
            let a = &l.self_attn;
            out.extend(a.q_a_proj.iter());
            out.extend([&a.q_b_proj, &a.kv_a_proj_with_mqa, &a.kv_b_proj, &a.o_proj]);
            let mlps: Vec<&GatedMlp> = match &l.mlp {
                Ffn::Dense(m) => vec![m],
                Ffn::Moe(m) => {
                    out.push(&m.gate);
                    m.experts.iter().chain(m.shared_experts.iter()).collect()
                }
            };
            for m in mlps {
                out.extend([&m.gate_up_proj, &m.down_proj]);
            }
        }
        out
    }

    /// Bytes of memory the weights hold (quantised ones as codes and scales).
    pub fn resident_bytes(&self) -> usize {
        let v = |x: &[f32]| x.len() * 4;
        let vectors: usize = self
            .layers
            .iter()
            .map(|l| {
                let (a, bias) = (&l.self_attn, |m: &Ffn| match m {
                    Ffn::Moe(m) => m.e_score_correction_bias.as_deref().map_or(0, v),
                    Ffn::Dense(_) => 0,
                });
                a.q_a_layernorm.as_deref().map_or(0, v)
                    + v(&a.kv_a_layernorm)
                    + a.o_bias.as_deref().map_or(0, v)
                    + bias(&l.mlp)
                    + v(&l.input_layernorm)
                    + v(&l.post_attention_layernorm)
            })
            .sum();
        let linears: usize = self.linears().iter().map(|l| l.resident_bytes()).sum();
        self.embed_tokens.resident_bytes() + vectors + linears + v(&self.norm) + v(&self.inv_freq)
    }

    /// Runs one step (whole samples or chunks; see `Llama::forward_step`) and
    /// returns the captured states `[L, T, H]`.
    pub fn forward_step<L: Dim>(
        &self,
        batch: &PackedBatch,
        captures: &CaptureSet<L>,
        cache: &mut KvCache,
    ) -> Result<CapturedStates<L, H>, ModelError> {
        Ok(self.forward_rank(batch, captures, cache, true)?.expect("capturing forward returns states"))
    }

    /// The forward of one tensor-parallel rank; only a capturing rank fills
    /// and returns the states.
    pub fn forward_rank<L: Dim>(
        &self,
        batch: &PackedBatch,
        captures: &CaptureSet<L>,
        cache: &mut KvCache,
        capture: bool,
    ) -> Result<Option<CapturedStates<L, H>>, ModelError> {
        let c = &self.config;
        frame::check_batch(batch, c.vocab_size, c.max_position_embeddings)?;
        let (t, h) = (batch.num_tokens(), c.hidden_size);
        let mut caps = Captures::new(captures, c.num_layers, t, self.hidden, capture)?;
        cache.check(batch)?;
        let _span = info_span!("forward", tokens = batch.num_tokens(), samples = batch.num_samples()).entered();
        let mut x = self.embed_tokens.embed(batch);
        let (cos, sin) = frame::rope_table(&self.inv_freq, batch.max_position(), self.rope_scale);
        let mut s = Scratch::default();
        for (k, layer) in self.layers.iter().enumerate().take(caps.depth) {
            caps.record(Tap::Residual(k), &x);
            let _s = debug_span!("layer", k).entered();
            self.attention(k, layer, batch, &cos, &sin, &mut x, &mut s, cache);
            rms_norm(&x, &layer.post_attention_layernorm, c.rms_norm_eps, &mut s.normed);
            s.ffn.resize(t * h, 0.0);
            match &layer.mlp {
                Ffn::Dense(m) => m.forward(&s.normed, t, &mut s.gu, &mut s.act, &mut s.ffn),
                Ffn::Moe(m) => self.moe(m, t, &mut s),
            }
            if let Some(comm) = &self.comm {
                comm.all_reduce_sum(&mut s.ffn);
            }
            x.iter_mut().zip(&s.ffn).for_each(|(x, f)| *x += f);
        }
        cache.retire(batch);
        Ok(caps.finish(&x, &self.norm, c.rms_norm_eps, &mut s.normed))
    }

    #[allow(clippy::too_many_arguments)]
    fn attention(
        &self,
        k: usize,
        layer: &DecoderLayer,
        batch: &PackedBatch,
        cos: &[f32],
        sin: &[f32],
        x: &mut [f32],
        s: &mut Scratch,
        cache: &mut KvCache,
    ) {
        let c = &self.config;
        let t = batch.num_tokens();
        let (h, nh, nope, rope, vd) = (c.hidden_size, self.heads, c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim);
        let (qk, kvr) = (c.qk_head_dim(), c.kv_lora_rank);
        let a = &layer.self_attn;
        s.normed.resize(t * h, 0.0);
        rms_norm(x, &layer.input_layernorm, c.rms_norm_eps, &mut s.normed);
        s.q.resize(t * nh * qk, 0.0);
        match (&a.q_a_proj, &a.q_a_layernorm) {
            (Some(qa), Some(ln)) => {
                let r = qa.out_features();
                s.qa.resize(t * r, 0.0);
                qa.forward(&s.normed, t, &mut s.qa, false);
                let mut qn = std::mem::take(&mut s.latent);
                qn.resize(t * r, 0.0);
                rms_norm(&s.qa, ln, c.rms_norm_eps, &mut qn);
                a.q_b_proj.forward(&qn, t, &mut s.q, false);
                s.latent = qn;
            }
            _ => a.q_b_proj.forward(&s.normed, t, &mut s.q, false),
        }
        s.ckv.resize(t * (kvr + rope), 0.0);
        a.kv_a_proj_with_mqa.forward(&s.normed, t, &mut s.ckv, false);
        s.latent.resize(t * kvr, 0.0);
        for (row, dst) in s.ckv.chunks_exact(kvr + rope).zip(s.latent.chunks_exact_mut(kvr)) {
            rms_norm(&row[..kvr], &a.kv_a_layernorm, c.rms_norm_eps, dst);
        }
        s.kvb.resize(t * nh * (nope + vd), 0.0);
        a.kv_b_proj.forward(&s.latent, t, &mut s.kvb, false);
        // Keys [k_nope | k_rot] and values per head; RoPE on q's and k's rotary tails.
        s.k.resize(t * nh * qk, 0.0);
        s.v.resize(t * nh * vd, 0.0);
        let half = rope / 2;
        let mut tmp = vec![0f32; rope];
        for (seg_i, seg) in batch.segments().iter().enumerate() {
            for (i, row) in batch.range(seg_i).enumerate() {
                let pos = seg.pos0 + i;
                let (cs, sn) = (&cos[pos * half..(pos + 1) * half], &sin[pos * half..(pos + 1) * half]);
                let ckv = &mut s.ckv[row * (kvr + rope)..(row + 1) * (kvr + rope)];
                rope_rotary(&mut ckv[kvr..], cs, sn, c.rope_interleave, &mut tmp);
                let k_rot = &s.ckv[row * (kvr + rope) + kvr..(row + 1) * (kvr + rope)];
                for hh in 0..nh {
                    let q = &mut s.q[(row * nh + hh) * qk..(row * nh + hh + 1) * qk];
                    rope_rotary(&mut q[nope..], cs, sn, c.rope_interleave, &mut tmp);
                    let kvb = &s.kvb[(row * nh + hh) * (nope + vd)..(row * nh + hh + 1) * (nope + vd)];
                    let kk = &mut s.k[(row * nh + hh) * qk..(row * nh + hh + 1) * qk];
                    kk[..nope].copy_from_slice(&kvb[..nope]);
                    kk[nope..].copy_from_slice(k_rot);
                    s.v[(row * nh + hh) * vd..(row * nh + hh + 1) * vd].copy_from_slice(&kvb[nope..]);
                }
            }
        }
        let (kw, vw) = (nh * qk, nh * vd);
        for (seg_i, seg) in batch.segments().iter().enumerate().filter(|(_, g)| g.uses_cache()) {
            let r = batch.range(seg_i);
            let e = cache.layer_mut(seg.key, k);
            e.k.extend_from_slice(&s.k[r.start * kw..r.end * kw]);
            e.v.extend_from_slice(&s.v[r.start * vw..r.end * vw]);
        }
        let segments: Vec<AttnSegment> = batch
            .segments()
            .iter()
            .enumerate()
            .map(|(i, seg)| {
                let rows = batch.range(i);
                let kv = if seg.uses_cache() {
                    let e = cache.layer(seg.key, k);
                    KvRef { k: &e.k, v: &e.v, stride: kw, v_stride: vw }
                } else {
                    KvRef { k: &s.k[rows.start * kw..], v: &s.v[rows.start * vw..], stride: kw, v_stride: vw }
                };
                AttnSegment { rows, pos0: seg.pos0, kv }
            })
            .collect();
        let shape =
            AttnShape { heads: nh, kv_heads: nh, head_dim: qk, v_dim: vd, window: None, scale: c.softmax_scale() };
        s.attn.resize(t * nh * vd, 0.0);
        varlen_attention(&s.q, kw, &segments, shape, &mut s.attn);
        frame::row_parallel(self.comm.as_deref(), &a.o_proj, a.o_bias.as_deref(), &s.attn, t, x, &mut s.ffn);
    }

    /// Routed experts plus shared experts of `s.normed` into `s.ffn`.
    fn moe(&self, m: &Moe, t: usize, s: &mut Scratch) {
        let c = &self.config;
        let (h, e, k) = (c.hidden_size, c.n_routed_experts, c.num_experts_per_tok);
        s.logits.resize(t * e, 0.0);
        m.gate.forward(&s.normed, t, &mut s.logits, false);
        // Route every token: (expert, weight) pairs.
        let per_group = e / c.n_group;
        let mut routes: Vec<Vec<(usize, f32)>> = vec![Vec::new(); e];
        let mut scores = vec![0f32; e];
        let mut choice = vec![0f32; e];
        let mut order: Vec<usize> = Vec::with_capacity(e);
        for (tok, logits) in s.logits.chunks_exact(e).enumerate() {
            match c.scoring {
                Scoring::Sigmoid => scores.iter_mut().zip(logits).for_each(|(s, l)| *s = 1.0 / (1.0 + (-l).exp())),
                Scoring::Softmax => {
                    let max = logits.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
                    let z: f32 = logits.iter().map(|l| (l - max).exp()).sum();
                    scores.iter_mut().zip(logits).for_each(|(s, l)| *s = (l - max).exp() / z);
                }
            }
            choice.copy_from_slice(&scores);
            if let Some(b) = &m.e_score_correction_bias {
                choice.iter_mut().zip(b).for_each(|(c, b)| *c += b);
            }
            if c.topk_method != TopkMethod::Greedy && c.n_group > 1 {
                let group_score = |g: usize| -> f32 {
                    let grp = &choice[g * per_group..(g + 1) * per_group];
                    if c.topk_method == TopkMethod::NoauxTc {
                        let (mut a, mut b) = (f32::NEG_INFINITY, f32::NEG_INFINITY);
                        for &v in grp {
                            if v > a {
                                b = a;
                                a = v;
                            } else if v > b {
                                b = v;
                            }
                        }
                        a + b
                    } else {
                        grp.iter().cloned().fold(f32::NEG_INFINITY, f32::max)
                    }
                };
                let mut groups: Vec<(usize, f32)> = (0..c.n_group).map(|g| (g, group_score(g))).collect();
                groups.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
                for &(g, _) in &groups[c.topk_group..] {
                    // Masked like HF: -inf for noaux_tc choice, 0 for group_limited_greedy scores.
                    let fill = if c.topk_method == TopkMethod::NoauxTc { f32::NEG_INFINITY } else { 0.0 };
                    choice[g * per_group..(g + 1) * per_group].fill(fill);
                }
            }
            order.clear();
            order.extend(0..e);
            order.sort_by(|&a, &b| choice[b].total_cmp(&choice[a]).then(a.cmp(&b)));
            let picked = &order[..k];
            let weight = |i: usize| if c.topk_method == TopkMethod::NoauxTc { scores[i] } else { choice[i] };
            let denom = if c.norm_topk_prob { picked.iter().map(|&i| weight(i)).sum::<f32>() + 1e-20 } else { 1.0 };
            for &i in picked {
                routes[i].push((tok, weight(i) / denom * c.routed_scaling_factor));
            }
        }
        // Experts in index order, each over the rows routed to it.
        s.ffn[..t * h].fill(0.0);
        for (i, tokens) in routes.iter().enumerate().filter(|(_, r)| !r.is_empty()) {
            let n = tokens.len();
            s.rows.resize(n * h, 0.0);
            for (dst, &(tok, _)) in s.rows.chunks_exact_mut(h).zip(tokens) {
                dst.copy_from_slice(&s.normed[tok * h..(tok + 1) * h]);
            }
            s.eout.resize(n * h, 0.0);
            m.experts[i].forward(&s.rows, n, &mut s.gu, &mut s.act, &mut s.eout);
            for (src, &(tok, w)) in s.eout.chunks_exact(h).zip(tokens) {
                s.ffn[tok * h..(tok + 1) * h].iter_mut().zip(src).for_each(|(o, v)| *o += v * w);
            }
        }
        if let Some(sh) = &m.shared_experts {
            s.eout.resize(t * h, 0.0);
            sh.forward(&s.normed, t, &mut s.gu, &mut s.act, &mut s.eout);
            s.ffn.iter_mut().zip(&s.eout).for_each(|(o, v)| *o += v);
        }
    }
}

impl<H: Dim> super::Model for Deepseek<H> {
    type Hidden = H;
    fn hidden(&self) -> H {
        self.hidden
    }
    fn num_layers(&self) -> usize {
        self.config.num_layers
    }
    fn dtype(&self) -> DType {
        Deepseek::dtype(self)
    }
    fn weight_bytes(&self) -> usize {
        self.resident_bytes()
    }
    fn forward_step<L: Dim>(
        &self,
        batch: &PackedBatch,
        captures: &CaptureSet<L>,
        cache: &mut KvCache,
    ) -> Result<CapturedStates<L, H>, ModelError> {
        Deepseek::forward_step(self, batch, captures, cache)
    }
}
