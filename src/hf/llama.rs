//! `config.json` of Llama-family checkpoints, normalised into one struct.
//!
//! Reads both the hub's legacy style (top-level `rope_theta` / `rope_scaling`)
//! and transformers 5's (`rope_parameters`), for `llama`, `mistral`, `qwen2`,
//! `qwen3`, and the mixtures of experts on those attention blocks,
//! `qwen3_moe`, `mixtral`, `glm4_moe` (GLM-4.5/4.6) and `minimax_m2`. Every refusal is a [`ConfigError`] that names
//! the field.

use super::moe::{Scoring, TopkMethod};
pub use super::rope::RopeScaling;
use super::rope::{inv_freq, parse_rope};
use super::{
    bounded, elements, invalid, positive, positive_f32, ArchInfo, ConfigError, RopeFreqs, MAX_COUNT, MAX_LAYERS,
};
use serde::Deserialize;
use serde_json::Value;
use std::path::Path;

/// The decoder family, from `model_type`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Arch {
    /// Llama 1/2/3.
    Llama,
    /// Mistral (sliding window on every layer when set).
    Mistral,
    /// Qwen2 (q/k/v bias, optional sliding window on upper layers).
    Qwen2,
    /// Qwen3 (per-head q/k RMSNorm).
    Qwen3,
    /// Qwen3-MoE: Qwen3's attention, a softmax top-k router over `mlp.experts`.
    Qwen3Moe,
    /// Mixtral: Mistral's attention, a softmax top-k router over `block_sparse_moe.experts`.
    Mixtral,
    /// GLM-4.5/4.6: partial RoPE, q/k/v biases, DeepSeek-V3's sigmoid router
    /// with groups and a correction bias, shared experts.
    Glm4Moe,
    /// MiniMax-M2: q/k norms over all heads at once, partial RoPE
    /// (`rotary_dim`), a sigmoid router whose correction bias only chooses,
    /// Mixtral's expert names.
    MiniMaxM2,
}

/// The q/k RMSNorm before RoPE, if any.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum QkNorm {
    /// None (Llama, Qwen2).
    None,
    /// One norm per head, `[head_dim]` weights (Qwen3, GLM-4.5 with `use_qk_norm`).
    PerHead,
    /// One norm over all of q's heads and one over k's, `[heads · head_dim]`
    /// weights (MiniMax-M2).
    AllHeads,
}

impl Arch {
    /// The `model_type` string.
    pub fn name(self) -> &'static str {
        match self {
            Arch::Llama => "llama",
            Arch::Mistral => "mistral",
            Arch::Qwen2 => "qwen2",
            Arch::Qwen3 => "qwen3",
            Arch::Qwen3Moe => "qwen3_moe",
            Arch::Mixtral => "mixtral",
            Arch::Glm4Moe => "glm4_moe",
            Arch::MiniMaxM2 => "minimax_m2",
        }
    }
}

/// The mixture of experts of `qwen3_moe` and `mixtral` (a softmax over every
/// expert's logit, the `top_k` best, their weights renormalised to sum to 1
/// when `norm_topk_prob`, always for Mixtral) and `glm4_moe` (DeepSeek-V3's
/// router: sigmoid scores, groups, `e_score_correction_bias` for the choice,
/// `routed_scaling_factor`; shared experts).
#[derive(Clone, Debug, PartialEq)]
pub struct LlamaMoe {
    /// Softmax or sigmoid scores.
    pub scoring: Scoring,
    /// Greedy, or noaux_tc (groups and a correction bias).
    pub topk_method: TopkMethod,
    /// Expert groups, and the groups kept per token.
    pub n_group: usize,
    /// Groups kept per token.
    pub topk_group: usize,
    /// Factor on every routed weight.
    pub routed_scaling_factor: f32,
    /// The shared experts' width (`n_shared_experts × moe_intermediate_size`), if any.
    pub shared_intermediate_size: Option<usize>,
    /// Routed experts.
    pub experts: usize,
    /// Experts per token.
    pub top_k: usize,
    /// Each expert's MLP width.
    pub intermediate_size: usize,
    /// Renormalise the chosen weights.
    pub norm_topk_prob: bool,
    /// Per layer: whether its MLP is the mixture (Qwen3-MoE's
    /// `mlp_only_layers` and `decoder_sparse_step` make some dense).
    pub sparse: Vec<bool>,
}

/// A Llama-family decoder's sizes and options, normalised.
#[derive(Clone, Debug, PartialEq)]
pub struct LlamaConfig {
    /// Architecture.
    pub arch: Arch,
    /// Residual stream width.
    pub hidden_size: usize,
    /// Decoder layers.
    pub num_layers: usize,
    /// Query heads.
    pub num_heads: usize,
    /// Key/value heads (GQA).
    pub num_kv_heads: usize,
    /// Per-head width (may differ from `hidden_size / num_heads`).
    pub head_dim: usize,
    /// MLP width.
    pub intermediate_size: usize,
    /// Vocabulary size.
    pub vocab_size: usize,
    /// RMSNorm epsilon.
    pub rms_norm_eps: f32,
    /// RoPE base.
    pub rope_theta: f32,
    /// RoPE scaling.
    pub rope_scaling: RopeScaling,
    /// Bias on q/k/v projections.
    pub qkv_bias: bool,
    /// Bias on the output projection.
    pub o_bias: bool,
    /// Bias on gate/up/down.
    pub mlp_bias: bool,
    /// The RMSNorm on q and k before RoPE.
    pub qk_norm: QkNorm,
    /// Columns of each q/k head RoPE rotates, from the first (`head_dim`
    /// unless `partial_rotary_factor`, GLM-4.5's 0.5).
    pub rotary_dim: usize,
    /// Layers the checkpoint holds past `num_layers` that are never run
    /// (GLM-4.5's multi-token-prediction layer).
    pub extra_layers: usize,
    /// Per layer: `Some(w)` if the layer attends to the last `w` positions only.
    pub sliding_windows: Vec<Option<usize>>,
    /// LM head shares the embedding matrix (irrelevant to extraction, recorded).
    pub tie_word_embeddings: bool,
    /// Longest sequence the model supports.
    pub max_position_embeddings: usize,
    /// config.json has no `max_position_embeddings`: the limit is HF's default.
    pub max_position_default: bool,
    /// The mixture of experts (`qwen3_moe`, `mixtral`, `glm4_moe`, `minimax_m2`).
    pub moe: Option<LlamaMoe>,
    /// `quantization_config`: block FP8, or `None` for plain weights.
    pub quant: Option<super::quant::QuantConfig>,
}

#[derive(Deserialize)]
struct Raw {
    model_type: Option<String>,
    hidden_size: Option<usize>,
    num_hidden_layers: Option<usize>,
    num_attention_heads: Option<usize>,
    num_key_value_heads: Option<usize>,
    head_dim: Option<usize>,
    intermediate_size: Option<usize>,
    vocab_size: Option<usize>,
    rms_norm_eps: Option<f64>,
    rope_theta: Option<f64>,
    rope_scaling: Option<Value>,
    rope_parameters: Option<Value>,
    quantization_config: Option<Value>,
    attention_bias: Option<bool>,
    mlp_bias: Option<bool>,
    hidden_act: Option<String>,
    sliding_window: Option<usize>,
    use_sliding_window: Option<bool>,
    max_window_layers: Option<usize>,
    layer_types: Option<Vec<String>>,
    tie_word_embeddings: Option<bool>,
    max_position_embeddings: Option<usize>,
    // Mixtures of experts.
    num_experts: Option<usize>,
    num_local_experts: Option<usize>,
    num_experts_per_tok: Option<usize>,
    moe_intermediate_size: Option<usize>,
    norm_topk_prob: Option<bool>,
    decoder_sparse_step: Option<usize>,
    mlp_only_layers: Option<Vec<usize>>,
    n_routed_experts: Option<usize>,
    n_shared_experts: Option<usize>,
    n_group: Option<usize>,
    topk_group: Option<usize>,
    routed_scaling_factor: Option<f64>,
    first_k_dense_replace: Option<usize>,
    use_qk_norm: Option<bool>,
    partial_rotary_factor: Option<f64>,
    num_nextn_predict_layers: Option<usize>,
    num_mtp_layers: Option<usize>,
    rotary_dim: Option<usize>,
    use_mtp: Option<bool>,
    num_mtp_modules: Option<usize>,
    scoring_func: Option<String>,
    use_routing_bias: Option<bool>,
    shared_intermediate_size: Option<usize>,
    qk_norm_type: Option<String>,
    attn_type_list: Option<Vec<u64>>,
}

/// `max_position_embeddings` of HF's config class for `arch`, used when
/// config.json has none (as transformers does).
fn default_max_positions(arch: Arch) -> usize {
    match arch {
        Arch::Llama => 2048,
        Arch::Mistral => 4096 * 32,
        Arch::Qwen2 | Arch::Qwen3 | Arch::Qwen3Moe => 32768,
        Arch::Mixtral => 4096 * 32,
        Arch::Glm4Moe => 131072,
        Arch::MiniMaxM2 => 196608,
    }
}

impl LlamaConfig {
    /// Reads and normalises `config.json` from a file.
    pub fn from_file(path: &Path) -> Result<Self, ConfigError> {
        Self::from_json(&super::read_config(path)?)
    }

    /// Parses and normalises `config.json` text.
    pub fn from_json(text: &str) -> Result<Self, ConfigError> {
        let raw: Raw = serde_json::from_str(text)?;
        let model_type = raw.model_type.clone().ok_or(ConfigError::Missing("model_type"))?;
        let arch = match model_type.as_str() {
            "llama" => Arch::Llama,
            "mistral" => Arch::Mistral,
            "qwen2" => Arch::Qwen2,
            "qwen3" => Arch::Qwen3,
            "qwen3_moe" => Arch::Qwen3Moe,
            "mixtral" => Arch::Mixtral,
            "glm4_moe" => Arch::Glm4Moe,
            "minimax_m2" => Arch::MiniMaxM2,
            _ => return Err(ConfigError::UnsupportedModel(model_type)),
        };
        // Schemes Strata cannot read are named by the parser; of those it can
        // read, block FP8 (MiniMax-M2's, Qwen3's FP8 releases) is wired into
        // this family, packed INT4 into the DeepSeek family only.
        let quant = super::quant::QuantConfig::from_json(raw.quantization_config.as_ref())?;
        if let Some(q) = quant.as_ref().filter(|q| !q.is_fp8_block()) {
            return Err(ConfigError::Invalid {
                field: "quantization_config",
                problem: format!(
                    "{} weights are read for deepseek_v3, kimi_k2 and kimi_k25 only, not {model_type} \
                     (which reads fp8 with weight_block_size)",
                    q.describe()
                ),
            });
        }
        let need = |v: Option<usize>, f: &'static str| v.ok_or(ConfigError::Missing(f));
        let hidden_size = positive("hidden_size", need(raw.hidden_size, "hidden_size")?)?;
        let num_layers = bounded("num_hidden_layers", need(raw.num_hidden_layers, "num_hidden_layers")?, MAX_LAYERS)?;
        let num_heads =
            bounded("num_attention_heads", need(raw.num_attention_heads, "num_attention_heads")?, MAX_COUNT)?;
        // The config classes' defaults: Llama's is the query heads, the others' a number.
        let kv_default = match arch {
            Arch::Llama => num_heads,
            Arch::Qwen2 | Arch::Qwen3 => 32,
            Arch::Qwen3Moe => 4,
            Arch::Mistral | Arch::Mixtral | Arch::Glm4Moe | Arch::MiniMaxM2 => 8,
        };
        let num_kv_heads = bounded("num_key_value_heads", raw.num_key_value_heads.unwrap_or(kv_default), MAX_COUNT)?;
        let intermediate_size = positive("intermediate_size", need(raw.intermediate_size, "intermediate_size")?)?;
        let vocab_size = positive("vocab_size", need(raw.vocab_size, "vocab_size")?)?;
        if num_heads % num_kv_heads != 0 {
            return Err(invalid(
                "num_key_value_heads",
                format!("{num_kv_heads} does not divide num_attention_heads {num_heads}"),
            ));
        }
        let head_dim = match raw.head_dim {
            Some(d) => d,
            // Qwen3Config's and MiniMaxM2Config's default head_dim, whatever the widths.
            None if matches!(arch, Arch::Qwen3 | Arch::MiniMaxM2) => 128,
            // LlamaConfig refuses widths that do not split into the heads.
            None if arch == Arch::Llama && !hidden_size.is_multiple_of(num_heads) => {
                return Err(invalid(
                    "head_dim",
                    format!(
                        "absent, and hidden_size {hidden_size} is not a multiple of num_attention_heads {num_heads}"
                    ),
                ))
            }
            // The others take `hidden_size // num_attention_heads`, rounded down.
            None => hidden_size / num_heads,
        };
        if head_dim == 0 || head_dim % 2 != 0 {
            return Err(invalid("head_dim", format!("must be a positive even number for RoPE, got {head_dim}")));
        }
        bounded("head_dim", head_dim, MAX_COUNT)?;
        // Every weight's size, so no product of config sizes can wrap later.
        elements("vocab_size", "embed_tokens", &[vocab_size, hidden_size])?;
        elements("num_attention_heads", "qkv_proj", &[num_heads + 2 * num_kv_heads, head_dim, hidden_size])?;
        elements("intermediate_size", "gate_up_proj", &[2, intermediate_size, hidden_size])?;
        // Glm4MoeConfig's and MixtralConfig's default is 1e-5, the others' 1e-6.
        let eps_default = if matches!(arch, Arch::Glm4Moe | Arch::Mixtral) { 1e-5 } else { 1e-6 };
        let rms_norm_eps =
            positive_f32("rms_norm_eps", "rms_norm_eps", raw.rms_norm_eps.unwrap_or(eps_default) as f32)?;
        let (max_position_embeddings, max_position_default) = match raw.max_position_embeddings {
            Some(n) => (positive("max_position_embeddings", n)?, false),
            None => (default_max_positions(arch), true),
        };
        if let Some(act) = &raw.hidden_act {
            if act != "silu" && act != "swish" {
                return Err(invalid("hidden_act", format!("{act:?} is not supported (only silu)")));
            }
        }
        // transformers 5 folds theta and scaling into `rope_parameters`; the hub's
        // older files keep `rope_theta` and `rope_scaling` at top level. Of the two
        // objects, transformers reads one (`rope_source`), theta from it or the top level.
        let (rope, rope_field) = super::rope_source(raw.rope_parameters.as_ref(), raw.rope_scaling.as_ref());
        let (theta_in, rope_scaling) = parse_rope(rope, rope_field, max_position_embeddings)?;
        // MiniMaxM2Config's default theta is 5e6, MixtralConfig's 1e6, the others' 1e4.
        let theta_default = match arch {
            Arch::MiniMaxM2 => 5e6,
            Arch::Mixtral => 1e6,
            _ => 10000.0,
        };
        let rope_theta = theta_in.or(raw.rope_theta.map(|t| t as f32)).unwrap_or(theta_default);
        positive_f32("rope_theta", "rope_theta", rope_theta)?;

        let (qkv_bias, o_bias) = match arch {
            // Qwen2 always has q/k/v bias and never an o bias, whatever the config says.
            Arch::Qwen2 => (true, false),
            // GLM-4.5: `attention_bias` is on q, k and v only.
            Arch::Glm4Moe => (raw.attention_bias.unwrap_or(false), false),
            // MiniMax-M2's projections have no bias, whatever the config says.
            Arch::MiniMaxM2 => (false, false),
            _ => {
                let b = raw.attention_bias.unwrap_or(false);
                (b, b)
            }
        };
        let sliding_windows = Self::windows(arch, &raw, num_layers)?;
        // transformers 5 keeps `partial_rotary_factor` in `rope_parameters`, the
        // hub's files at top level; transformers takes 0.5 for glm4_moe without
        // one, and MiniMax-M2's files give `rotary_dim` (factor rotary_dim / head_dim).
        let factor =
            rope.and_then(|p| p.get("partial_rotary_factor")).and_then(Value::as_f64).or(raw.partial_rotary_factor);
        let (rotary_dim, key) = match arch {
            Arch::MiniMaxM2 if factor.is_none() && raw.rotary_dim.is_some() => {
                (raw.rotary_dim.unwrap_or(head_dim), "rotary_dim")
            }
            Arch::Glm4Moe | Arch::MiniMaxM2 => {
                let f = factor.unwrap_or(if arch == Arch::Glm4Moe { 0.5 } else { 1.0 });
                if !(f > 0.0 && f <= 1.0) {
                    return Err(invalid("partial_rotary_factor", format!("{f}: must be in (0, 1]")));
                }
                // As transformers: int(head_dim · factor).
                ((head_dim as f64 * f) as usize, "partial_rotary_factor")
            }
            // The other families rotate whole heads: transformers' rotation
            // for them has no pass-through columns.
            _ if factor.is_some_and(|f| f != 1.0) => {
                return Err(invalid(
                    "partial_rotary_factor",
                    format!("{} for {model_type}, whose attention rotates whole heads", factor.unwrap_or(1.0)),
                ))
            }
            _ => (head_dim, "partial_rotary_factor"),
        };
        if rotary_dim == 0 || rotary_dim > head_dim || !rotary_dim.is_multiple_of(2) {
            return Err(invalid(
                key,
                format!("rotates {rotary_dim} columns of head_dim {head_dim}: must be a positive even number at most head_dim"),
            ));
        }
        let moe = Self::moe(arch, &raw, num_layers, hidden_size, intermediate_size)?;
        Ok(LlamaConfig {
            arch,
            hidden_size,
            num_layers,
            num_heads,
            num_kv_heads,
            head_dim,
            intermediate_size,
            vocab_size,
            rms_norm_eps,
            rope_theta,
            rope_scaling,
            qkv_bias,
            o_bias,
            mlp_bias: raw.mlp_bias.unwrap_or(false),
            qk_norm: Self::qk_norm(arch, &raw)?,
            rotary_dim,
            // MiniMax-M2 may store `num_mtp_modules` layers when `use_mtp`.
            extra_layers: raw
                .num_nextn_predict_layers
                .or(raw.num_mtp_layers)
                .or(raw.num_mtp_modules.filter(|_| arch == Arch::MiniMaxM2 && raw.use_mtp == Some(true)))
                .unwrap_or(0),
            sliding_windows,
            tie_word_embeddings: raw.tie_word_embeddings.unwrap_or(false),
            quant,
            max_position_embeddings,
            max_position_default,
            moe,
        })
    }

    /// The mixture of experts of `qwen3_moe`, `mixtral`, `glm4_moe` and `minimax_m2` (none for the dense families).
    fn moe(arch: Arch, raw: &Raw, n: usize, hidden: usize, dense: usize) -> Result<Option<LlamaMoe>, ConfigError> {
        let (experts, key, inter) = match arch {
            // The hub's files say `num_experts`; transformers 5 saves `num_local_experts`.
            Arch::Qwen3Moe => (raw.num_experts.or(raw.num_local_experts), "num_experts", raw.moe_intermediate_size),
            // Mixtral's experts are `intermediate_size` wide.
            Arch::Mixtral => (raw.num_local_experts, "num_local_experts", Some(dense)),
            Arch::Glm4Moe => {
                (raw.n_routed_experts.or(raw.num_local_experts), "n_routed_experts", raw.moe_intermediate_size)
            }
            // MiniMax-M2's experts are `intermediate_size` wide, as Mixtral's.
            Arch::MiniMaxM2 => (raw.num_local_experts, "num_local_experts", Some(dense)),
            _ => return Ok(None),
        };
        // Qwen3MoeDecoderLayer builds the mixture only when `num_experts > 0`: with none,
        // every layer is the dense MLP of `intermediate_size`.
        if arch == Arch::Qwen3Moe && experts == Some(0) {
            return Ok(None);
        }
        let experts = bounded(key, experts.ok_or(ConfigError::Missing(key))?, MAX_COUNT)?;
        let top_k = raw.num_experts_per_tok.ok_or(ConfigError::Missing("num_experts_per_tok"))?;
        if top_k == 0 || top_k > experts {
            return Err(invalid("num_experts_per_tok", format!("{top_k} must be between 1 and {key} {experts}")));
        }
        let inter = positive("moe_intermediate_size", inter.ok_or(ConfigError::Missing("moe_intermediate_size"))?)?;
        elements("moe_intermediate_size", "experts", &[experts, 3, inter, hidden])?;
        let sparse = if arch == Arch::Glm4Moe {
            // As DeepSeek: dense for the first `first_k_dense_replace` layers.
            let first = raw.first_k_dense_replace.unwrap_or(1);
            (0..n).map(|l| l >= first).collect()
        } else if arch == Arch::Qwen3Moe {
            // transformers' Qwen3MoeDecoderLayer: experts unless the layer is
            // in `mlp_only_layers`, on every `decoder_sparse_step`-th layer.
            let step = raw.decoder_sparse_step.unwrap_or(1);
            if step == 0 {
                return Err(invalid("decoder_sparse_step", "must be positive"));
            }
            let dense_only = raw.mlp_only_layers.clone().unwrap_or_default();
            super::warn_past_the_last("mlp_only_layers", &dense_only, n);
            (0..n).map(|l| !dense_only.contains(&l) && (l + 1) % step == 0).collect()
        } else {
            vec![true; n]
        };
        // Qwen3MoeConfig's default is false, Glm4MoeConfig's true; Mixtral always renormalises.
        let norm_topk_prob = match arch {
            Arch::Mixtral | Arch::MiniMaxM2 => true,
            Arch::Glm4Moe => raw.norm_topk_prob.unwrap_or(true),
            _ => raw.norm_topk_prob.unwrap_or(false),
        };
        let mut moe = LlamaMoe {
            scoring: Scoring::Softmax,
            topk_method: TopkMethod::Greedy,
            n_group: 1,
            topk_group: 1,
            routed_scaling_factor: 1.0,
            shared_intermediate_size: None,
            experts,
            top_k,
            intermediate_size: inter,
            norm_topk_prob,
            sparse,
        };
        if arch == Arch::Glm4Moe {
            let (n_group, topk_group) = (raw.n_group.unwrap_or(1), raw.topk_group.unwrap_or(1));
            if n_group == 0 || experts % n_group != 0 || topk_group == 0 || topk_group > n_group {
                return Err(invalid(
                    "n_group",
                    format!("{experts} experts in {n_group} groups, {topk_group} kept: not a valid grouping"),
                ));
            }
            // The choice ranks each group by its two best experts.
            if experts / n_group < 2 || top_k > topk_group * (experts / n_group) {
                return Err(invalid(
                    "topk_group",
                    format!(
                        "{topk_group} groups of {} experts cannot give {top_k} experts per token",
                        experts / n_group
                    ),
                ));
            }
            // 0: no shared expert, as transformers' shared MLP of width 0 adds nothing.
            let shared = raw.n_shared_experts.unwrap_or(1);
            if shared > MAX_COUNT {
                return Err(invalid(
                    "n_shared_experts",
                    format!("{shared} is implausibly large (Strata accepts at most {MAX_COUNT})"),
                ));
            }
            moe.scoring = Scoring::Sigmoid;
            moe.topk_method = TopkMethod::NoauxTc;
            (moe.n_group, moe.topk_group) = (n_group, topk_group);
            moe.routed_scaling_factor = positive_f32(
                "routed_scaling_factor",
                "routed_scaling_factor",
                raw.routed_scaling_factor.unwrap_or(1.0) as f32,
            )?;
            let width = shared.checked_mul(inter).ok_or_else(|| invalid("n_shared_experts", "overflows"))?;
            moe.shared_intermediate_size = (shared > 0).then_some(width);
            if let Some(w) = moe.shared_intermediate_size {
                elements("n_shared_experts", "shared_experts", &[3, w, hidden])?;
            }
        }
        if arch == Arch::MiniMaxM2 {
            // MiniMaxM2TopKRouter: sigmoid scores, the bias added for the
            // choice only, the chosen unbiased scores renormalised; no groups.
            if let Some(f) = raw.scoring_func.as_deref().filter(|f| *f != "sigmoid") {
                return Err(invalid("scoring_func", format!("{f:?}: MiniMax-M2's router is \"sigmoid\"")));
            }
            if raw.use_routing_bias == Some(false) {
                return Err(invalid("use_routing_bias", "false: MiniMax-M2's router always adds its correction bias"));
            }
            if let Some(w) = raw.shared_intermediate_size.filter(|&w| w > 0) {
                return Err(invalid("shared_intermediate_size", format!("{w}: MiniMax-M2 has no shared experts")));
            }
            // MiniMax's type 0 is lightning (linear) attention, which
            // transformers' minimax_m2 does not have: refused, not run as softmax.
            if let Some(i) = raw.attn_type_list.as_ref().and_then(|t| t.iter().position(|&a| a != 1)) {
                return Err(invalid(
                    "attn_type_list",
                    format!("layer {i} is not full attention (type 1); linear attention layers are not read"),
                ));
            }
            moe.scoring = Scoring::Sigmoid;
            moe.topk_method = TopkMethod::NoauxTc;
        }
        Ok(Some(moe))
    }

    /// The q/k norm a model_type has (MiniMax-M2's `qk_norm_type` must be
    /// `per_layer`: one norm over all heads).
    fn qk_norm(arch: Arch, raw: &Raw) -> Result<QkNorm, ConfigError> {
        Ok(match arch {
            Arch::Qwen3 | Arch::Qwen3Moe => QkNorm::PerHead,
            Arch::Glm4Moe if raw.use_qk_norm == Some(true) => QkNorm::PerHead,
            Arch::MiniMaxM2 => {
                if raw.use_qk_norm == Some(false) {
                    return Err(invalid("use_qk_norm", "false: transformers' MiniMax-M2 always norms q and k"));
                }
                if let Some(t) = raw.qk_norm_type.as_deref().filter(|t| *t != "per_layer") {
                    return Err(invalid(
                        "qk_norm_type",
                        format!("{t:?}: only \"per_layer\" (all heads at once) is read"),
                    ));
                }
                QkNorm::AllHeads
            }
            _ => QkNorm::None,
        })
    }

    fn windows(arch: Arch, raw: &Raw, n: usize) -> Result<Vec<Option<usize>>, ConfigError> {
        // transformers' Llama, GLM-4.5 and MiniMax-M2 attend to every position,
        // whatever `sliding_window` the config carries.
        if matches!(arch, Arch::Llama | Arch::Glm4Moe | Arch::MiniMaxM2) {
            return Ok(vec![None; n]);
        }
        let qwen = matches!(arch, Arch::Qwen2 | Arch::Qwen3 | Arch::Qwen3Moe);
        // Qwen configs carry a `sliding_window` that only counts when `use_sliding_window` is set.
        let window = if qwen && raw.use_sliding_window != Some(true) { None } else { raw.sliding_window };
        let Some(w) = window else {
            return Ok(vec![None; n]);
        };
        if w == 0 {
            return Err(invalid("sliding_window", "must be positive"));
        }
        if let Some(types) = &raw.layer_types {
            if types.len() != n {
                return Err(invalid("layer_types", format!("has {} entries for {n} layers", types.len())));
            }
            return types
                .iter()
                .map(|t| match super::layer_type(t) {
                    "full_attention" => Ok(None),
                    "sliding_attention" => Ok(Some(w)),
                    _ => Err(invalid("layer_types", format!("unknown layer type {t:?}"))),
                })
                .collect();
        }
        if qwen {
            let first = raw.max_window_layers.unwrap_or(0);
            Ok((0..n).map(|i| (i >= first).then_some(w)).collect())
        } else {
            Ok(vec![Some(w); n])
        }
    }

    /// RoPE over the first `rotary_dim` columns of each head: inverse frequencies after linear or llama3 scaling.
    pub fn rope(&self) -> RopeFreqs {
        RopeFreqs { inv_freq: self.rope_inv_freq(), scale: 1.0 }
    }

    fn rope_inv_freq(&self) -> Vec<f32> {
        inv_freq(self.rope_theta, self.rotary_dim, &self.rope_scaling)
    }

    /// The outer shape.
    pub fn info(&self) -> ArchInfo {
        ArchInfo {
            architecture: self.arch.name().into(),
            num_layers: self.num_layers,
            hidden_size: self.hidden_size,
            vocab_size: self.vocab_size,
            max_position_embeddings: self.max_position_embeddings,
            max_position_default: self.max_position_default,
            recurrent: false,
        }
    }

    /// Width of the fused q/k/v projection output.
    pub fn qkv_size(&self) -> usize {
        (self.num_heads + 2 * self.num_kv_heads) * self.head_dim
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const LEGACY_LLAMA3: &str = r#"{
        "model_type": "llama", "hidden_size": 4096, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": 8, "intermediate_size": 14336,
        "vocab_size": 128256, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
        "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192, "rope_type": "llama3"},
        "max_position_embeddings": 131072, "torch_dtype": "bfloat16"
    }"#;

    #[test]
    fn legacy_and_v5_styles_agree() {
        let old = LlamaConfig::from_json(LEGACY_LLAMA3).unwrap();
        assert_eq!(old.head_dim, 128);
        assert_eq!(old.rope_theta, 500000.0);
        assert!(matches!(old.rope_scaling, RopeScaling::Llama3 { factor: 8.0, .. }));
        let new = LEGACY_LLAMA3
            .replace(r#""rope_theta": 500000.0,"#, "")
            .replace("rope_scaling", "rope_parameters")
            .replace(r#""rope_type": "llama3""#, r#""rope_type": "llama3", "rope_theta": 500000.0"#);
        assert_eq!(LlamaConfig::from_json(&new).unwrap(), old);
    }

    /// `LlamaConfig::from_json` of LEGACY_LLAMA3 at head_dim 16 with `rope_scaling` replaced.
    fn llama3_freqs(scaling: &str, max_positions: usize) -> Vec<f32> {
        let text = LEGACY_LLAMA3
            .replace(r#""hidden_size": 4096"#, r#""hidden_size": 512"#)
            .replace(r#""max_position_embeddings": 131072"#, &format!(r#""max_position_embeddings": {max_positions}"#));
        let (start, end) = (text.find(r#""rope_scaling""#).unwrap(), text.find("},").unwrap() + 1);
        let text = format!("{}\"rope_scaling\": {scaling}{}", &text[..start], &text[end..]);
        LlamaConfig::from_json(&text).unwrap_or_else(|e| panic!("{scaling}: {e}")).rope().inv_freq
    }

    use crate::hf::close_to as close;

    #[test]
    fn llama3_with_high_freq_factor_below_low_freq_factor_is_transformers_two_branch_rule() {
        // transformers 5.25.0 (LlamaConfig, ROPE_INIT_FUNCTIONS["llama3"]) for head_dim 16, base 5e5,
        // factor 8, low_freq_factor 4, high_freq_factor 1, 8192 original positions: divided by 8
        // past wavelength 8192 / 4 (from index 4 on), kept below, no smoothing; and a warning.
        let got = llama3_freqs(
            r#"{"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0, "high_freq_factor": 1.0,
                "original_max_position_embeddings": 8192}"#,
            131072,
        );
        close(
            &got,
            &[
                1.0,
                0.193922758102417,
                0.03760603070259094,
                0.00729266507551074,
                0.00017677668074611574,
                3.428102354519069e-05,
                6.647869668086059e-06,
                1.289173155782919e-06,
            ],
        );
    }

    #[test]
    fn llama3_without_an_original_context_takes_max_position_embeddings() {
        // transformers 5.25.0 fills original_max_position_embeddings with max_position_embeddings
        // (2048 here; a warning says it is not less): base 5e5, head_dim 16, factor 8, low 1, high 4.
        let got = llama3_freqs(
            r#"{"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}"#,
            2048,
        );
        close(
            &got,
            &[
                1.0,
                0.193922758102417,
                0.03760603070259094,
                0.00384058291092515,
                0.00017677668074611574,
                3.428102354519069e-05,
                6.647869668086059e-06,
                1.289173155782919e-06,
            ],
        );
    }

    #[test]
    fn of_rope_scaling_and_rope_parameters_the_one_transformers_reads_counts() {
        // transformers 5.25.0: `rope_scaling or rope_parameters`; theta from the one read, else the
        // top level, else 1e4 (LlamaConfig, head_dim 16).
        let base = r#"{"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 100, "max_position_embeddings": 2048 KEY}"#;
        let parse =
            |key: &str| LlamaConfig::from_json(&base.replace(" KEY", key)).unwrap_or_else(|e| panic!("{key}: {e}"));
        let c = parse(
            r#", "rope_theta": 5000.0, "rope_parameters": {"rope_type": "default", "rope_theta": 1000.0},
               "rope_scaling": {"rope_type": "linear", "factor": 2.0}"#,
        );
        assert_eq!((c.rope_theta, &c.rope_scaling), (5000.0, &RopeScaling::Linear { factor: 2.0 }));
        close(
            &c.rope().inv_freq,
            &[
                0.5,
                0.17242442071437836,
                0.0594603568315506,
                0.02050483413040638,
                0.0070710680447518826,
                0.002438449300825596,
                0.0008408963913097978,
                0.00028998212656006217,
            ],
        );
        let c = parse(
            r#", "rope_parameters": {"rope_type": "default", "rope_theta": 1000.0},
               "rope_scaling": {"rope_type": "linear", "factor": 2.0}"#,
        );
        close(
            &c.rope().inv_freq,
            &[
                0.5,
                0.15811388194561005,
                0.05000000074505806,
                0.015811389312148094,
                0.004999999888241291,
                0.0015811389312148094,
                0.0005000000237487257,
                0.00015811389312148094,
            ],
        );
        // The object not read is not checked either (transformers runs this); an empty
        // `rope_scaling` is false, so `rope_parameters` counts.
        let c = parse(
            r#", "rope_parameters": {"rope_type": "bogus"}, "rope_scaling": {"rope_type": "linear", "factor": 2.0}"#,
        );
        assert_eq!(c.rope_scaling, RopeScaling::Linear { factor: 2.0 });
        let c = parse(
            r#", "rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000.0}, "rope_scaling": {}"#,
        );
        assert_eq!((c.rope_theta, c.rope_scaling), (1000.0, RopeScaling::Linear { factor: 2.0 }));
        // A bad `rope_scaling` is read, and refused, as transformers raises on it.
        let e = LlamaConfig::from_json(&base.replace(
            " KEY",
            r#", "rope_parameters": {"rope_type": "default"}, "rope_scaling": {"rope_type": "bogus"}"#,
        ))
        .unwrap_err();
        assert!(e.to_string().contains("`rope_scaling`: rope type \"bogus\""), "{e}");
    }

    #[test]
    fn qwen2_window_only_when_enabled() {
        let base = r#"{"model_type":"qwen2","hidden_size":64,"num_hidden_layers":4,"num_attention_heads":4,
            "num_key_value_heads":2,"intermediate_size":128,"vocab_size":100,"sliding_window":32,
            "max_window_layers":2,"use_sliding_window":USE}"#;
        let off = LlamaConfig::from_json(&base.replace("USE", "false")).unwrap();
        assert_eq!(off.sliding_windows, vec![None; 4]);
        assert!(off.qkv_bias && !off.o_bias);
        let on = LlamaConfig::from_json(&base.replace("USE", "true")).unwrap();
        assert_eq!(on.sliding_windows, vec![None, None, Some(32), Some(32)]);
        // transformers renames the legacy "attention" full_attention as it loads a config; other names are refused.
        let types = |t: &str| base.replace("USE", &format!(r#"true,"layer_types":{t}"#));
        let legacy =
            LlamaConfig::from_json(&types(r#"["attention","sliding_attention","attention","sliding_attention"]"#));
        assert_eq!(legacy.unwrap().sliding_windows, vec![None, Some(32), None, Some(32)]);
        let e = LlamaConfig::from_json(&types(r#"["mamba","attention","attention","attention"]"#)).unwrap_err();
        assert!(e.to_string().contains("`layer_types`: unknown layer type \"mamba\""), "{e}");
    }

    #[test]
    fn mixtures_of_experts_name_their_layers_and_refuse_bad_sizes() {
        let base = r#"{"model_type":"qwen3_moe","hidden_size":64,"num_hidden_layers":4,"num_attention_heads":4,
            "num_key_value_heads":2,"intermediate_size":128,"vocab_size":100,"num_experts":8,
            "num_experts_per_tok":2,"moe_intermediate_size":32,"decoder_sparse_step":2,"mlp_only_layers":[3]}"#;
        let c = LlamaConfig::from_json(base).unwrap();
        let moe = c.moe.unwrap();
        // Layers 1 and 3 are every second one; 3 is dense by name.
        assert_eq!(moe.sparse, [false, true, false, false]);
        // A layer past the last is never looked up by transformers (`layer_idx in mlp_only_layers`): ignored.
        let past = LlamaConfig::from_json(&base.replace(r#""mlp_only_layers":[3]"#, r#""mlp_only_layers":[3,4,9]"#));
        assert_eq!(past.unwrap().moe.unwrap().sparse, moe.sparse);
        assert!(!moe.norm_topk_prob, "Qwen3MoeConfig's default");
        for (from, to, want) in [
            (r#""num_experts_per_tok":2"#, r#""num_experts_per_tok":9"#, "between 1 and num_experts 8"),
            (r#""decoder_sparse_step":2"#, r#""decoder_sparse_step":0"#, "`decoder_sparse_step`: must be positive"),
            (r#""num_experts":8,"#, "", "lacks required field `num_experts`"),
            (r#""moe_intermediate_size":32,"#, "", "`moe_intermediate_size`"),
            (r#""num_experts_per_tok":2,"#, "", "lacks required field `num_experts_per_tok`"),
            (r#""num_experts":8,"#, r#""num_experts":99999999,"#, "`num_experts`: 99999999 is implausibly large"),
        ] {
            let e = LlamaConfig::from_json(&base.replace(from, to)).unwrap_err().to_string();
            assert!(e.contains(want), "{to}: {e}");
        }
        let mixtral = r#"{"model_type":"mixtral","hidden_size":64,"num_hidden_layers":2,"num_attention_heads":4,"num_key_value_heads":2,
            "intermediate_size":96,"vocab_size":100,"num_local_experts":4,"num_experts_per_tok":2,"sliding_window":16}"#;
        let c = LlamaConfig::from_json(mixtral).unwrap();
        let moe = c.moe.as_ref().unwrap();
        assert_eq!((moe.experts, moe.intermediate_size, moe.norm_topk_prob), (4, 96, true));
        assert_eq!(c.sliding_windows, [Some(16), Some(16)]);
        // A dense family has no mixture, whatever keys it carries.
        let dense = base.replace("qwen3_moe", "qwen3");
        assert!(LlamaConfig::from_json(&dense).unwrap().moe.is_none());
        // Qwen3-MoE without experts: transformers builds every layer's dense MLP (`num_experts > 0 and ...`).
        let none = LlamaConfig::from_json(&base.replace(r#""num_experts":8"#, r#""num_experts":0"#)).unwrap();
        assert_eq!((none.moe, none.intermediate_size), (None, 128));
    }

    #[test]
    fn absent_keys_take_the_config_classes_defaults() {
        // transformers 5.25.0: the model's q_proj for hidden 100 and 8 heads without head_dim
        // (Qwen3Config's 128; the others hidden // heads, 12; LlamaConfig raises), and each
        // config class's num_key_value_heads, rms_norm_eps and rope theta defaults.
        let base = r#"{"model_type":"MT","hidden_size":100,"num_hidden_layers":1,"num_attention_heads":8,
            "num_key_value_heads":4,"intermediate_size":32,"vocab_size":50,"num_experts":4,"num_local_experts":4,
            "n_routed_experts":4,"num_experts_per_tok":2,"moe_intermediate_size":16,"n_group":1}"#;
        for (arch, head_dim) in
            [("qwen3", 128), ("qwen3_moe", 12), ("mistral", 12), ("mixtral", 12), ("qwen2", 12), ("glm4_moe", 12)]
        {
            let c = LlamaConfig::from_json(&base.replace("MT", arch)).unwrap_or_else(|e| panic!("{arch}: {e}"));
            assert_eq!(c.head_dim, head_dim, "{arch}");
        }
        let e = LlamaConfig::from_json(&base.replace("MT", "llama")).unwrap_err().to_string();
        assert!(e.contains("`head_dim`: absent, and hidden_size 100"), "{e}");
        let bare = r#"{"model_type":"MT","hidden_size":2048,"num_hidden_layers":1,"num_attention_heads":32,
            "intermediate_size":32,"vocab_size":50,"num_experts":4,"num_local_experts":4,"n_routed_experts":4,
            "num_experts_per_tok":2,"moe_intermediate_size":16}"#;
        for (arch, kv, eps, theta) in [
            ("llama", 32, 1e-6, 1e4),
            ("mistral", 8, 1e-6, 1e4),
            ("mixtral", 8, 1e-5, 1e6),
            ("qwen2", 32, 1e-6, 1e4),
            ("qwen3", 32, 1e-6, 1e4),
            ("qwen3_moe", 4, 1e-6, 1e4),
            ("glm4_moe", 8, 1e-5, 1e4),
            ("minimax_m2", 8, 1e-6, 5e6),
        ] {
            let c = LlamaConfig::from_json(&bare.replace("MT", arch)).unwrap_or_else(|e| panic!("{arch}: {e}"));
            assert_eq!((c.num_kv_heads, c.rms_norm_eps, c.rope_theta), (kv, eps, theta), "{arch}");
        }
    }

    #[test]
    fn glm4_moe_rotates_a_part_of_each_head_and_refuses_bad_groupings() {
        let base = r#"{"model_type":"glm4_moe","hidden_size":64,"num_hidden_layers":3,"num_attention_heads":4,
            "num_key_value_heads":2,"head_dim":24,"intermediate_size":96,"vocab_size":100,"n_routed_experts":8,
            "num_experts_per_tok":3,"moe_intermediate_size":16,"n_group":2,"topk_group":1,"n_shared_experts":2,
            "first_k_dense_replace":2,"routed_scaling_factor":2.5,"attention_bias":true}"#;
        let c = LlamaConfig::from_json(base).unwrap();
        // No shared expert: transformers' shared MLP of width 0 adds nothing.
        let none = LlamaConfig::from_json(&base.replace(r#""n_shared_experts":2"#, r#""n_shared_experts":0"#));
        assert_eq!(none.unwrap().moe.unwrap().shared_intermediate_size, None);
        // Glm4MoeConfig's default partial_rotary_factor is 0.5: 12 of 24 columns, 6 frequencies.
        assert_eq!((c.rotary_dim, c.rope().inv_freq.len()), (12, 6));
        assert!(c.qkv_bias && !c.o_bias && c.qk_norm == QkNorm::None);
        let moe = c.moe.as_ref().unwrap();
        assert_eq!(moe.sparse, [false, false, true]);
        assert_eq!((moe.scoring, moe.topk_method, moe.norm_topk_prob), (Scoring::Sigmoid, TopkMethod::NoauxTc, true));
        assert_eq!((moe.shared_intermediate_size, moe.routed_scaling_factor), (Some(32), 2.5));
        // The factor at top level (the hub's files) or in rope_parameters (transformers 5's).
        let quarter = base.replace(r#""attention_bias":true"#, r#""attention_bias":true,"partial_rotary_factor":0.25"#);
        assert_eq!(LlamaConfig::from_json(&quarter).unwrap().rotary_dim, 6);
        let v5 = base.replace(
            r#""attention_bias":true"#,
            r#""attention_bias":true,"rope_parameters":{"rope_type":"default","rope_theta":1e4,"partial_rotary_factor":1.0}"#,
        );
        assert_eq!(LlamaConfig::from_json(&v5).unwrap().rotary_dim, 24);
        // A dense family rotates whole heads, and refuses a factor it would not apply.
        let dense = base.replace("glm4_moe", "qwen3");
        assert_eq!(LlamaConfig::from_json(&dense).unwrap().rotary_dim, 24);
        let e = LlamaConfig::from_json(&quarter.replace("glm4_moe", "qwen3")).unwrap_err().to_string();
        assert!(e.contains("0.25 for qwen3, whose attention rotates whole heads"), "{e}");
        // GLM-4.5 attends to every position, whatever `sliding_window` says.
        let window = base.replace(r#""attention_bias":true"#, r#""attention_bias":true,"sliding_window":4"#);
        assert_eq!(LlamaConfig::from_json(&window).unwrap().sliding_windows, [None; 3]);
        for (from, to, want) in [
            (r#""attention_bias":true"#, r#""partial_rotary_factor":0.3"#, "rotates 7 columns"),
            (
                r#""attention_bias":true"#,
                r#""partial_rotary_factor":1.5"#,
                "`partial_rotary_factor`: 1.5: must be in (0, 1]",
            ),
            (r#""n_shared_experts":2"#, r#""n_shared_experts":99999999999"#, "n_shared_experts"),
            (r#""n_group":2"#, r#""n_group":3"#, "8 experts in 3 groups"),
            (r#""topk_group":1"#, r#""topk_group":3"#, "not a valid grouping"),
            (r#""num_experts_per_tok":3"#, r#""num_experts_per_tok":5"#, "cannot give 5 experts per token"),
            (r#""routed_scaling_factor":2.5"#, r#""routed_scaling_factor":0"#, "routed_scaling_factor"),
            (r#""routed_scaling_factor":2.5"#, r#""routed_scaling_factor":-1"#, "routed_scaling_factor"),
            // transformers runs these (no rotation; a shared-expert-free zero; an odd head
            // rotating 2 · ceil(int(15 · 0.5) / 2) columns), degenerate or odd: refused.
            (
                r#""attention_bias":true"#,
                r#""partial_rotary_factor":0"#,
                "`partial_rotary_factor`: 0: must be in (0, 1]",
            ),
            (r#""head_dim":24"#, r#""head_dim":15"#, "`head_dim`: must be a positive even number for RoPE, got 15"),
            (r#""num_experts_per_tok":3"#, r#""num_experts_per_tok":0"#, "`num_experts_per_tok`: 0 must be between 1"),
            (r#""n_routed_experts":8,"#, "", "n_routed_experts"),
        ] {
            let e = LlamaConfig::from_json(&base.replace(from, to)).unwrap_err().to_string();
            assert!(e.contains(want), "{to}: {e}");
        }
    }

    #[test]
    fn minimax_m2_norms_all_heads_and_refuses_what_transformers_does_not_run() {
        let base = r#"{"model_type":"minimax_m2","hidden_size":64,"num_hidden_layers":2,"num_attention_heads":4,
            "num_key_value_heads":2,"head_dim":16,"intermediate_size":32,"vocab_size":100,"num_local_experts":6,
            "num_experts_per_tok":2,"rotary_dim":8,"use_qk_norm":true,"qk_norm_type":"per_layer",
            "scoring_func":"sigmoid","use_routing_bias":true,"shared_intermediate_size":0,"attention_bias":true}"#;
        let c = LlamaConfig::from_json(base).unwrap();
        assert_eq!((c.qk_norm, c.rotary_dim, c.rope().inv_freq.len()), (QkNorm::AllHeads, 8, 4));
        assert!(!c.qkv_bias && !c.o_bias, "MiniMax-M2's projections have no bias");
        let moe = c.moe.as_ref().unwrap();
        assert_eq!((moe.experts, moe.intermediate_size, moe.sparse.clone()), (6, 32, vec![true, true]));
        assert_eq!((moe.scoring, moe.topk_method, moe.norm_topk_prob), (Scoring::Sigmoid, TopkMethod::NoauxTc, true));
        assert_eq!(
            (moe.n_group, moe.topk_group, moe.routed_scaling_factor, moe.shared_intermediate_size),
            (1, 1, 1.0, None)
        );
        // MTP modules, when `use_mtp`, are layers the checkpoint may hold past the last one.
        let mtp = base.replace(r#""attention_bias":true"#, r#""use_mtp":true,"num_mtp_modules":3"#);
        assert_eq!((c.extra_layers, LlamaConfig::from_json(&mtp).unwrap().extra_layers), (0, 3));
        // MiniMaxM2Config's defaults: head_dim 128, theta 5e6.
        let bare = base.replace(r#""head_dim":16,"#, "").replace(r#""rotary_dim":8,"#, "");
        let d = LlamaConfig::from_json(&bare).unwrap();
        assert_eq!((d.head_dim, d.rotary_dim, d.rope_theta), (128, 128, 5e6));
        // Block FP8, as the hub's MiniMax-M2 ships; packed INT4 is the DeepSeek family's only.
        let fp8 = base.replace(
            r#""attention_bias":true"#,
            r#""quantization_config":{"quant_method":"fp8","fmt":"float8_e4m3fn","weight_block_size":[128,128]}"#,
        );
        assert!(LlamaConfig::from_json(&fp8).unwrap().quant.is_some_and(|q| q.is_fp8_block()));
        let int4 = base.replace(
            r#""attention_bias":true"#,
            r#""quantization_config":{"quant_method":"compressed-tensors","format":"pack-quantized",
               "config_groups":{"g":{"targets":["Linear"],"weights":{"num_bits":4,"type":"int","symmetric":true,
               "strategy":"group","group_size":32}}}}"#,
        );
        let e = LlamaConfig::from_json(&int4).unwrap_err().to_string();
        assert!(e.contains("read for deepseek_v3, kimi_k2 and kimi_k25 only, not minimax_m2"), "{e}");
        for (from, to, want) in [
            (r#""qk_norm_type":"per_layer""#, r#""qk_norm_type":"per_head""#, "only \"per_layer\""),
            (r#""use_qk_norm":true"#, r#""use_qk_norm":false"#, "always norms q and k"),
            (r#""scoring_func":"sigmoid""#, r#""scoring_func":"softmax""#, "router is \"sigmoid\""),
            (r#""use_routing_bias":true"#, r#""use_routing_bias":false"#, "always adds its correction bias"),
            (r#""shared_intermediate_size":0"#, r#""shared_intermediate_size":64"#, "no shared experts"),
            (r#""rotary_dim":8"#, r#""rotary_dim":7"#, "`rotary_dim`: rotates 7 columns"),
            (r#""rotary_dim":8"#, r#""rotary_dim":0"#, "`rotary_dim`: rotates 0 columns"),
            (r#""rotary_dim":8"#, r#""rotary_dim":8,"attn_type_list":[1,0]"#, "layer 1 is not full attention"),
            (r#""rotary_dim":8"#, r#""rotary_dim":32"#, "`rotary_dim`: rotates 32 columns of head_dim 16"),
        ] {
            let e = LlamaConfig::from_json(&base.replace(from, to)).unwrap_err().to_string();
            assert!(e.contains(want), "{to}: {e}");
        }
    }

    #[test]
    fn clear_errors() {
        let e = LlamaConfig::from_json(r#"{"model_type":"gpt2"}"#).unwrap_err();
        assert!(e.to_string().contains("unsupported model_type \"gpt2\""), "{e}");
        let e = LlamaConfig::from_json(r#"{"model_type":"llama","hidden_size":64}"#).unwrap_err();
        assert!(e.to_string().contains("num_hidden_layers"), "{e}");
        let e = LlamaConfig::from_json("{not json").unwrap_err();
        assert!(e.to_string().starts_with("malformed config.json"), "{e}");
        let yarn = LEGACY_LLAMA3.replace(r#""rope_type": "llama3""#, r#""rope_type": "yarn""#);
        let e = LlamaConfig::from_json(&yarn).unwrap_err();
        assert!(e.to_string().contains("\"yarn\" is not supported"), "{e}");
        let gqa = LEGACY_LLAMA3.replace(r#""num_key_value_heads": 8"#, r#""num_key_value_heads": 5"#);
        assert!(LlamaConfig::from_json(&gqa).unwrap_err().to_string().contains("does not divide"));
    }
}
