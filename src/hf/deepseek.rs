//! `config.json` of DeepSeek V2/V3, Kimi-K2 and Kimi-K2.5's wrapper, normalised:
//! multi-head latent attention sizes, the mixture of experts and its router,
//! YaRN, and the `quantization_config` of FP8 or INT4 weights.

use super::moe::{Scoring, TopkMethod};
use super::quant::QuantConfig;
use super::{
    bounded, elements, invalid, positive, positive_f32, ArchInfo, ConfigError, RopeFreqs, MAX_COUNT, MAX_LAYERS,
};
use serde::Deserialize;
use serde_json::Value;
use std::path::Path;

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
        /// cos/sin magnitude factor, with `mscale_all_dim` (0 when absent: then `mscale(factor, 1)`).
        mscale: f32,
        /// Softmax scale factor (0 when absent: no softmax scaling).
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
    /// config.json has no `max_position_embeddings`: the limit is HF's default.
    pub max_position_default: bool,
    /// Multi-token-prediction layers the checkpoint may hold after the
    /// decoder's (`model.layers.{num_layers}` on, DeepSeek-V3's); never run.
    pub num_nextn_predict_layers: usize,
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
    /// Leading dense layers (every layer when it is `num_layers` or more).
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
    /// The LM head is the embedding matrix.
    pub tie_word_embeddings: bool,
}

#[derive(Deserialize)]
struct Raw {
    model_type: Option<String>,
    tie_word_embeddings: Option<bool>,
    hidden_size: Option<usize>,
    num_hidden_layers: Option<usize>,
    num_attention_heads: Option<usize>,
    intermediate_size: Option<usize>,
    vocab_size: Option<usize>,
    max_position_embeddings: Option<usize>,
    num_nextn_predict_layers: Option<usize>,
    rms_norm_eps: Option<f64>,
    // Null and absent differ: null is "none", absent the class default.
    #[serde(default, deserialize_with = "super::present")]
    q_lora_rank: Option<Option<usize>>,
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
    #[serde(default, deserialize_with = "super::present")]
    n_routed_experts: Option<Option<usize>>,
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

/// transformers' class defaults of the keys a config may leave out:
/// `DeepseekV3Config`'s for deepseek_v3 and the Kimi models (transformers reads
/// Kimi-K2's text model as deepseek_v3), `DeepseekV2Config`'s for deepseek_v2.
struct MoeDefaults {
    q_lora_rank: usize,
    n_routed_experts: usize,
    n_shared_experts: usize,
    num_experts_per_tok: usize,
    moe_intermediate_size: usize,
    first_k_dense_replace: usize,
    routed_scaling_factor: f64,
    norm_topk_prob: bool,
    n_group: usize,
    topk_group: usize,
}

impl MoeDefaults {
    fn of(v3: bool) -> Self {
        if v3 {
            MoeDefaults {
                q_lora_rank: 1536,
                n_routed_experts: 256,
                n_shared_experts: 1,
                num_experts_per_tok: 8,
                moe_intermediate_size: 2048,
                first_k_dense_replace: 3,
                routed_scaling_factor: 2.5,
                norm_topk_prob: true,
                n_group: 8,
                topk_group: 4,
            }
        } else {
            // n_group, topk_group and num_experts_per_tok are None there: one group, and no
            // top-k (refused, as transformers' top-k of None raises).
            MoeDefaults {
                q_lora_rank: 1536,
                n_routed_experts: 64,
                n_shared_experts: 2,
                num_experts_per_tok: 0,
                moe_intermediate_size: 1407,
                first_k_dense_replace: 0,
                routed_scaling_factor: 1.0,
                norm_topk_prob: false,
                n_group: 1,
                topk_group: 1,
            }
        }
    }
}

impl DeepseekConfig {
    /// Reads and normalises `config.json` from a file.
    pub fn from_file(path: &Path) -> Result<Self, ConfigError> {
        Self::from_json(&super::read_config(path)?)
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
            let tied = super::tie_word_embeddings(&v, &inner)?;
            let mut c = Self::from_value(inner)?;
            if c.model_type == "kimi_k25" {
                return Err(invalid("text_config", "model_type is kimi_k25 again; expected kimi_k2 or deepseek_v3"));
            }
            if c.quant.is_none() {
                c.quant = QuantConfig::from_json(v.get("quantization_config"))?;
            }
            c.tensor_prefix = "language_model.".into();
            c.tie_word_embeddings = tied.unwrap_or(false);
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
        // Of `rope_parameters` and `rope_scaling`, the one transformers reads.
        let (params, field) = super::rope_source(r.rope_parameters.as_ref(), r.rope_scaling.as_ref());
        if let Some(p) = params.filter(|p| !p.is_object()) {
            return Err(invalid(field, format!("expected an object, got {p}")));
        }
        let num = |k: &str| -> Result<Option<f32>, ConfigError> {
            match params.and_then(|p| p.get(k)) {
                None | Some(Value::Null) => Ok(None),
                Some(v) => v
                    .as_f64()
                    .map(|f| Some(f as f32))
                    .ok_or_else(|| invalid(field, format!("`{k}` must be a number, got {v}"))),
            }
        };
        let rope_theta = num("rope_theta")?.or(r.rope_theta.map(|t| t as f32)).unwrap_or(10000.0);
        positive_f32("rope_theta", "rope_theta", rope_theta)?;
        let kind = params
            .and_then(|p| p.get("rope_type").or_else(|| p.get("type")))
            .and_then(Value::as_str)
            .unwrap_or("default");
        let (max_position_embeddings, max_position_default) = match r.max_position_embeddings {
            Some(n) => (positive("max_position_embeddings", n)?, false),
            // HF's DeepseekV2Config says 2048; V3's (and the remote code Kimi-K2 ships) 4096.
            None => (if v3 { 4096 } else { 2048 }, true),
        };
        let rope = match kind {
            "default" => DsRope::Default,
            "yarn" => {
                // Absent (not null) takes the model's context, as standardize_rope_params fills it.
                let original_absent = params.is_some_and(|p| p.get("original_max_position_embeddings").is_none());
                let original = original_absent.then_some(max_position_embeddings);
                Self::yarn(field, rope_theta, original, &num)?
            }
            other => {
                return Err(invalid(
                    field,
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
        let hidden_size = positive("hidden_size", need(r.hidden_size, "hidden_size")?)?;
        let num_layers = bounded("num_hidden_layers", need(r.num_hidden_layers, "num_hidden_layers")?, MAX_LAYERS)?;
        let num_heads = bounded("num_attention_heads", need(r.num_attention_heads, "num_attention_heads")?, MAX_COUNT)?;
        let d = MoeDefaults::of(v3);
        // Null means plain q_proj; absent, the class's q LoRA rank.
        let q_lora_rank = match r.q_lora_rank {
            Some(Some(0)) => {
                return Err(invalid("q_lora_rank", "must be positive (null means plain q_proj, no q LoRA)"))
            }
            Some(rank) => rank,
            None => Some(d.q_lora_rank),
        };
        // Null means no routed experts (every layer dense); absent, the class's count; 0 is a mistake.
        let n_routed_experts = match r.n_routed_experts {
            Some(Some(0)) => {
                return Err(invalid("n_routed_experts", "must be positive (null means every layer is dense)"))
            }
            Some(Some(e)) => bounded("n_routed_experts", e, MAX_COUNT)?,
            Some(None) => 0,
            None => d.n_routed_experts,
        };
        let group = |v: Option<usize>, f: &'static str, default: usize| match v {
            Some(0) => Err(invalid(f, format!("must be positive (null means {default})"))),
            v => Ok(v.unwrap_or(default)),
        };
        let c = DeepseekConfig {
            hidden_size,
            num_layers,
            num_heads,
            intermediate_size: positive("intermediate_size", need(r.intermediate_size, "intermediate_size")?)?,
            vocab_size: positive("vocab_size", need(r.vocab_size, "vocab_size")?)?,
            max_position_embeddings,
            max_position_default,
            num_nextn_predict_layers: r.num_nextn_predict_layers.unwrap_or(0),
            rms_norm_eps: positive_f32("rms_norm_eps", "rms_norm_eps", r.rms_norm_eps.unwrap_or(1e-6) as f32)?,
            q_lora_rank,
            kv_lora_rank: positive("kv_lora_rank", need(r.kv_lora_rank, "kv_lora_rank")?)?,
            qk_nope_head_dim: bounded("qk_nope_head_dim", need(r.qk_nope_head_dim, "qk_nope_head_dim")?, MAX_COUNT)?,
            qk_rope_head_dim: bounded("qk_rope_head_dim", need(r.qk_rope_head_dim, "qk_rope_head_dim")?, MAX_COUNT)?,
            v_head_dim: bounded("v_head_dim", need(r.v_head_dim, "v_head_dim")?, MAX_COUNT)?,
            rope_theta,
            rope,
            rope_interleave: r.rope_interleave.unwrap_or(true),
            attention_bias: r.attention_bias.unwrap_or(false),
            n_routed_experts,
            n_shared_experts: r.n_shared_experts.unwrap_or(d.n_shared_experts),
            // DeepseekV2Config has no default (None): 0, refused below when there are experts.
            num_experts_per_tok: r.num_experts_per_tok.unwrap_or(d.num_experts_per_tok),
            moe_intermediate_size: r.moe_intermediate_size.unwrap_or(d.moe_intermediate_size),
            first_k_dense_replace: r.first_k_dense_replace.unwrap_or(d.first_k_dense_replace),
            moe_layer_freq: r.moe_layer_freq.unwrap_or(1),
            routed_scaling_factor: r.routed_scaling_factor.unwrap_or(d.routed_scaling_factor) as f32,
            norm_topk_prob: r.norm_topk_prob.unwrap_or(d.norm_topk_prob),
            scoring,
            topk_method,
            n_group: group(r.n_group, "n_group", d.n_group)?,
            topk_group: group(r.topk_group, "topk_group", d.topk_group)?,
            quant: QuantConfig::from_json(r.quantization_config.as_ref())?,
            tensor_prefix: String::new(),
            tie_word_embeddings: r.tie_word_embeddings.unwrap_or(false),
            model_type,
        };
        c.check_sizes()?;
        Ok(c)
    }

    /// YaRN's parameters as `_compute_yarn_parameters` reads them, refusing
    /// values that can only give NaN or infinite frequencies; `original`: the
    /// context to take when the config has no `original_max_position_embeddings`.
    fn yarn(
        field: &'static str,
        theta: f32,
        original: Option<usize>,
        num: &dyn Fn(&str) -> Result<Option<f32>, ConfigError>,
    ) -> Result<DsRope, ConfigError> {
        let need = |k: &'static str| num(k)?.ok_or_else(|| invalid(field, format!("yarn needs `{k}`")));
        let pos = |k: &'static str, v: f32| positive_f32(field, &format!("`{k}`"), v);
        let non_negative = |k: &'static str, v: f32| {
            if v.is_finite() && v >= 0.0 {
                Ok(v)
            } else {
                Err(invalid(field, format!("`{k}` must be a finite number >= 0, got {v}")))
            }
        };
        // The correction range divides by ln(rope_theta).
        if theta <= 1.0 {
            return Err(invalid("rope_theta", format!("yarn needs rope_theta > 1, got {theta}")));
        }
        Ok(DsRope::Yarn {
            factor: pos("factor", need("factor")?)?,
            original_max_position_embeddings: pos(
                "original_max_position_embeddings",
                match original {
                    Some(context) => context as f32,
                    None => need("original_max_position_embeddings")?,
                },
            )?,
            // `beta_fast or 32`, `beta_slow or 1`: 0 takes the default too.
            beta_fast: pos("beta_fast", num("beta_fast")?.filter(|&b| b != 0.0).unwrap_or(32.0))?,
            beta_slow: pos("beta_slow", num("beta_slow")?.filter(|&b| b != 0.0).unwrap_or(1.0))?,
            // Absent counts as 0: the two take part only when both are nonzero.
            mscale: non_negative("mscale", num("mscale")?.unwrap_or(0.0))?,
            mscale_all_dim: non_negative("mscale_all_dim", num("mscale_all_dim")?.unwrap_or(0.0))?,
        })
    }

    /// Checks every size the parse took: the experts and their router, the
    /// layer split, and that no weight's size overflows.
    fn check_sizes(&self) -> Result<(), ConfigError> {
        let c = self;
        if !c.qk_rope_head_dim.is_multiple_of(2) {
            return Err(invalid("qk_rope_head_dim", "must be even"));
        }
        if c.num_nextn_predict_layers > MAX_LAYERS {
            return Err(invalid("num_nextn_predict_layers", "is implausibly large"));
        }
        let (h, nh, qk) = (c.hidden_size, c.num_heads, c.qk_nope_head_dim + c.qk_rope_head_dim);
        elements("vocab_size", "embed_tokens", &[c.vocab_size, h])?;
        if let Some(rank) = c.q_lora_rank {
            elements("q_lora_rank", "q_a_proj", &[rank, h])?;
        }
        elements("num_attention_heads", "q_b_proj", &[nh, qk, c.q_lora_rank.unwrap_or(h)])?;
        // Saturates: usize::MAX elements fail the check below.
        let kva = c.kv_lora_rank.saturating_add(c.qk_rope_head_dim);
        elements("kv_lora_rank", "kv_a_proj_with_mqa", &[kva, h])?;
        elements("kv_lora_rank", "kv_b_proj", &[nh, c.qk_nope_head_dim + c.v_head_dim, c.kv_lora_rank])?;
        elements("num_attention_heads", "o_proj", &[h, nh, c.v_head_dim])?;
        elements("intermediate_size", "gate_up_proj", &[2, c.intermediate_size, h])?;
        if c.n_routed_experts == 0 {
            return Ok(());
        }
        let e = c.n_routed_experts;
        if c.num_experts_per_tok == 0 || c.num_experts_per_tok > e {
            return Err(invalid("num_experts_per_tok", format!("{} is not in 1..={e}", c.num_experts_per_tok)));
        }
        positive("moe_intermediate_size", c.moe_intermediate_size)?;
        positive("moe_layer_freq", c.moe_layer_freq)?;
        if c.n_shared_experts > MAX_COUNT {
            return Err(invalid("n_shared_experts", "is implausibly large"));
        }
        positive_f32("routed_scaling_factor", "routed_scaling_factor", c.routed_scaling_factor)?;
        elements("moe_intermediate_size", "experts' gate_up_proj", &[e, 2, c.moe_intermediate_size, h])?;
        elements(
            "n_shared_experts",
            "shared_experts' gate_up_proj",
            &[2, c.moe_intermediate_size, c.n_shared_experts, h],
        )?;
        if !e.is_multiple_of(c.n_group) || c.topk_group > c.n_group {
            return Err(invalid(
                "n_group",
                format!("{} groups of {e} experts, topk_group {}: groups must divide the experts and topk_group must be at most n_group", c.n_group, c.topk_group),
            ));
        }
        let per_group = e / c.n_group;
        if c.topk_method != TopkMethod::Greedy && c.topk_group * per_group < c.num_experts_per_tok {
            return Err(invalid(
                "topk_group",
                format!(
                    "{} of {} groups of {per_group} experts hold fewer than num_experts_per_tok {}",
                    c.topk_group, c.n_group, c.num_experts_per_tok
                ),
            ));
        }
        if c.topk_method == TopkMethod::NoauxTc && per_group < 2 {
            return Err(invalid("n_group", "noaux_tc ranks groups by their two best experts: need 2 per group"));
        }
        Ok(())
    }

    /// The outer shape.
    pub fn info(&self) -> ArchInfo {
        ArchInfo {
            architecture: self.model_type.clone(),
            num_layers: self.num_layers,
            hidden_size: self.hidden_size,
            vocab_size: self.vocab_size,
            max_position_embeddings: self.max_position_embeddings,
            max_position_default: self.max_position_default,
            recurrent: false,
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

    /// RoPE of the rotary dims: inverse frequencies (default or YaRN) and YaRN's cos/sin magnitude factor.
    pub fn rope(&self) -> RopeFreqs {
        let (inv_freq, scale) = self.rope_inv_freq();
        RopeFreqs { inv_freq, scale }
    }

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
    pub fn softmax_scale(&self) -> f32 {
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

#[cfg(test)]
mod tests {
    use super::*;

    /// A small DeepSeek-V3 config with YaRN in `rope_parameters`, edited by `rope`.
    fn v3(rope: &str) -> DeepseekConfig {
        let text = format!(
            r#"{{"model_type": "deepseek_v3", "hidden_size": 72, "num_hidden_layers": 3, "num_attention_heads": 4,
                "intermediate_size": 96, "vocab_size": 100, "kv_lora_rank": 16, "q_lora_rank": 40,
                "qk_nope_head_dim": 8, "qk_rope_head_dim": 16, "v_head_dim": 8, "max_position_embeddings": 512,
                "n_routed_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 16, "n_group": 4,
                "topk_group": 2, {rope}}}"#
        );
        DeepseekConfig::from_json(&text).unwrap_or_else(|e| panic!("{rope}: {e}"))
    }

    use crate::hf::close_to as close;

    #[test]
    fn absent_moe_keys_take_the_config_classes_defaults() {
        // transformers 5.25.0's DeepseekV3Config / DeepseekV2Config defaults for the keys left out.
        let text = |model_type: &str| {
            format!(
                r#"{{"model_type": "{model_type}", "hidden_size": 72, "num_hidden_layers": 4, "num_attention_heads": 4,
                    "intermediate_size": 96, "vocab_size": 100, "kv_lora_rank": 16, "qk_nope_head_dim": 8,
                    "qk_rope_head_dim": 16, "v_head_dim": 8 EXTRA}}"#
            )
        };
        for model_type in ["deepseek_v3", "kimi_k2"] {
            let c = DeepseekConfig::from_json(&text(model_type).replace(" EXTRA", "")).unwrap();
            assert_eq!(c.q_lora_rank, Some(1536), "{model_type}");
            assert_eq!((c.n_routed_experts, c.n_shared_experts, c.num_experts_per_tok), (256, 1, 8));
            assert_eq!((c.moe_intermediate_size, c.first_k_dense_replace, c.n_group, c.topk_group), (2048, 3, 8, 4));
            assert_eq!((c.routed_scaling_factor, c.norm_topk_prob), (2.5, true));
        }
        // V2 has no default top-k (None: transformers' top-k fails), so it is required with experts.
        let e = DeepseekConfig::from_json(&text("deepseek_v2").replace(" EXTRA", "")).unwrap_err().to_string();
        assert!(e.contains("`num_experts_per_tok`"), "{e}");
        let c = DeepseekConfig::from_json(&text("deepseek_v2").replace(" EXTRA", r#", "num_experts_per_tok": 6"#));
        let c = c.unwrap();
        assert_eq!(
            (c.q_lora_rank, c.n_routed_experts, c.n_shared_experts, c.moe_intermediate_size),
            (Some(1536), 64, 2, 1407)
        );
        assert_eq!((c.first_k_dense_replace, c.routed_scaling_factor, c.norm_topk_prob), (0, 1.0, false));
        // Null still says "none": plain q_proj, every layer dense.
        let null = text("deepseek_v3").replace(" EXTRA", r#", "q_lora_rank": null, "n_routed_experts": null"#);
        let c = DeepseekConfig::from_json(&null).unwrap();
        assert_eq!((c.q_lora_rank, c.n_routed_experts), (None, 0));
        // Kimi-K2.5's wrapper without its text model: refused, not transformers' 61-layer default.
        let e = DeepseekConfig::from_json(r#"{"model_type": "kimi_k25"}"#).unwrap_err().to_string();
        assert!(e.contains("lacks required field `text_config"), "{e}");
    }

    const YARN: &str = r#""rope_parameters": {"rope_type": "yarn", "factor": 4.0, "beta_fast": 32, "beta_slow": 1,
        "mscale": 1.0, "mscale_all_dim": 1.0, "original_max_position_embeddings": 16, "rope_theta": 10000.0"#;

    #[test]
    fn yarn_reads_its_keys_as_transformers_does() {
        // Expected values: transformers 5.25.0, `ROPE_INIT_FUNCTIONS["yarn"](DeepseekV3Config.from_dict(...))`
        // and `yarn_apply_mscale` on qk_head_dim^-0.5 for the config above, edited per case.
        let reference = v3(&format!("{YARN}}}"));
        close(
            &reference.rope().inv_freq,
            &[
                1.0,
                0.07905694097280502,
                0.02500000037252903,
                0.007905694656074047,
                0.0024999999441206455,
                0.0007905694656074047,
                0.0002500000118743628,
                7.905694656074047e-05,
            ],
        );
        assert_eq!(reference.rope().scale, 1.0);
        assert!((reference.softmax_scale() as f64 - 0.2646422579642267).abs() < 1e-6);
        // `beta_fast or 32`, `beta_slow or 1`.
        let zeros = v3(&format!(r#"{YARN}, "beta_fast": 0, "beta_slow": 0}}"#));
        assert_eq!((zeros.rope(), zeros.softmax_scale()), (reference.rope(), reference.softmax_scale()));
        // No original context: max_position_embeddings (512).
        let absent = v3(&format!("{}}}", YARN.replace(r#", "original_max_position_embeddings": 16"#, "")));
        close(
            &absent.rope().inv_freq,
            &[
                1.0,
                0.2569350600242615,
                0.0625,
                0.013834965415298939,
                0.0024999999441206455,
                0.0007905694656074047,
                0.0002500000118743628,
                7.905694656074047e-05,
            ],
        );
        // Null is not absent: transformers divides by it.
        let text = format!(
            "{}}}",
            YARN.replace(r#""original_max_position_embeddings": 16"#, r#""original_max_position_embeddings": null"#)
        );
        let text = format!(
            r#"{{"model_type": "deepseek_v3", "hidden_size": 72, "num_hidden_layers": 3, "num_attention_heads": 4,
                "intermediate_size": 96, "vocab_size": 100, "kv_lora_rank": 16, "q_lora_rank": 40,
                "qk_nope_head_dim": 8, "qk_rope_head_dim": 16, "v_head_dim": 8, {text}}}"#
        );
        let e = DeepseekConfig::from_json(&text).unwrap_err().to_string();
        assert!(e.contains("yarn needs `original_max_position_embeddings`"), "{e}");
        // No `mscale`: not both set, so the magnitude is mscale(factor, 1), not a ratio of 1.
        let m = v3(&format!("{}}}", YARN.replace(r#""mscale": 1.0, "#, "")));
        assert!((m.rope().scale as f64 - 1.138629436111989).abs() < 1e-6, "{}", m.rope().scale);
        assert!((m.softmax_scale() as f64 - 0.2646422579642267).abs() < 1e-6);
        // With `rope_scaling` beside it, `rope_parameters` is not read (transformers' `rope_scaling or ...`).
        let both = v3(&format!(r#"{YARN}}}, "rope_scaling": {{"rope_type": "default"}}"#));
        assert_eq!(both.rope, DsRope::Default);
    }
}
