//! `config.json` of the hybrid linear-attention Qwen models: Qwen3-Next
//! (`qwen3_next`), Qwen3.5 (`qwen3_5_text`, dense) and Qwen3.5-MoE
//! (`qwen3_5_moe_text`), the last two also as the multimodal wrappers
//! (`qwen3_5`, `qwen3_5_moe`) the hub ships, whose text model is read from
//! `text_config` and whose tensors live under `model.language_model.` (the
//! vision tower and the `mtp.*` module are not read).
//!
//! Layers are Gated DeltaNet (`linear_attention`) or gated full attention
//! (`full_attention`), from `layer_types` or, without it, every
//! `full_attention_interval`-th layer (4) full. Sizes a field leaves out
//! take transformers' defaults. Every refusal names its field.

use super::llama::LlamaMoe;
use super::moe::{Scoring, TopkMethod};
use super::rope::{inv_freq, parse_rope, RopeScaling};
use super::{elements, invalid, positive, positive_f32, ArchInfo, ConfigError, GqaSizes, RopeFreqs, TextModel};
use serde::Deserialize;
use serde_json::Value;

/// How a checkpoint stores a Gated DeltaNet layer's input projections.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum InProj {
    /// Qwen3-Next: `in_proj_qkvz` `[k_heads × (q, k, v, z), hidden]`, each
    /// key head's group `[q (k_dim) | k (k_dim) | v (r·v_dim) | z (r·v_dim)]`,
    /// and `in_proj_ba` `[k_heads × (b, a), hidden]`, groups `[b (r) | a (r)]`
    /// (`r = v_heads / k_heads`). A rank's heads are whole groups: its rows of
    /// both tensors are one contiguous block each.
    Grouped,
    /// Qwen3.5: `in_proj_qkv` `[q (k_heads·k_dim) | k | v (v_heads·v_dim)]`,
    /// `in_proj_z` `[v_heads·v_dim]`, `in_proj_b` and `in_proj_a` `[v_heads]`:
    /// a rank reads one block of each of q, k, v, z, b and a.
    Split,
}

/// The kind of a layer's token mixer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LayerKind {
    /// Gated DeltaNet (`linear_attn.*`).
    Linear,
    /// Gated softmax attention (`self_attn.*`).
    Full,
}

/// The Gated DeltaNet layers' sizes (the whole layer, every rank's heads).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LinearSizes {
    /// `linear_num_key_heads`.
    pub k_heads: usize,
    /// `linear_num_value_heads`, a multiple of `k_heads`.
    pub v_heads: usize,
    /// `linear_key_head_dim`.
    pub k_dim: usize,
    /// `linear_value_head_dim`.
    pub v_dim: usize,
    /// `linear_conv_kernel_dim`.
    pub conv_kernel: usize,
}

/// A hybrid Qwen text decoder's sizes and options, normalised.
#[derive(Clone, Debug, PartialEq)]
pub struct Qwen3NextConfig {
    /// As config.json names it (the wrapper's for a multimodal checkpoint).
    pub model_type: String,
    /// The input projections' layout.
    pub in_proj: InProj,
    /// Residual stream width.
    pub hidden_size: usize,
    /// Decoder layers.
    pub num_layers: usize,
    /// Full attention's query heads.
    pub num_heads: usize,
    /// Full attention's key/value heads.
    pub num_kv_heads: usize,
    /// Full attention's head width (256).
    pub head_dim: usize,
    /// Columns of each q/k head RoPE rotates (`head_dim · partial_rotary_factor`, 0.25 by default).
    pub rotary_dim: usize,
    /// RoPE base.
    pub rope_theta: f32,
    /// RoPE scaling.
    pub rope_scaling: RopeScaling,
    /// Bias on q/k/v/o.
    pub attention_bias: bool,
    /// The Gated DeltaNet sizes.
    pub linear: LinearSizes,
    /// Each layer's token mixer.
    pub layer_types: Vec<LayerKind>,
    /// The dense MLP's width (Qwen3.5; Qwen3-Next's dense layers).
    pub intermediate_size: usize,
    /// The mixture of experts, if any: softmax top-k, renormalised, with
    /// `shared_intermediate_size` the sigmoid-gated shared expert's width.
    pub moe: Option<LlamaMoe>,
    /// Vocabulary size.
    pub vocab_size: usize,
    /// Epsilon of every RMSNorm.
    pub rms_norm_eps: f32,
    /// Longest sequence.
    pub max_position_embeddings: usize,
    /// config.json has no `max_position_embeddings`: the limit is HF's default.
    pub max_position_default: bool,
    /// Prefix of the text model's tensor names: `model.language_model.` in a wrapper.
    pub tensor_prefix: String,
    /// The LM head is the embedding matrix.
    pub tie_word_embeddings: bool,
}

#[derive(Deserialize)]
struct Raw {
    hidden_size: Option<usize>,
    num_hidden_layers: Option<usize>,
    num_attention_heads: Option<usize>,
    num_key_value_heads: Option<usize>,
    head_dim: Option<usize>,
    intermediate_size: Option<usize>,
    vocab_size: Option<usize>,
    rms_norm_eps: Option<f64>,
    hidden_act: Option<String>,
    attention_bias: Option<bool>,
    rope_theta: Option<f64>,
    rope_scaling: Option<Value>,
    rope_parameters: Option<Value>,
    partial_rotary_factor: Option<f64>,
    max_position_embeddings: Option<usize>,
    linear_conv_kernel_dim: Option<usize>,
    linear_key_head_dim: Option<usize>,
    linear_value_head_dim: Option<usize>,
    linear_num_key_heads: Option<usize>,
    linear_num_value_heads: Option<usize>,
    layer_types: Option<Vec<String>>,
    full_attention_interval: Option<usize>,
    num_experts: Option<usize>,
    num_experts_per_tok: Option<usize>,
    moe_intermediate_size: Option<usize>,
    shared_expert_intermediate_size: Option<usize>,
    norm_topk_prob: Option<bool>,
    decoder_sparse_step: Option<usize>,
    mlp_only_layers: Option<Vec<usize>>,
    attn_output_gate: Option<bool>,
}

/// Which family a `model_type` is: (text type, wrapper type, layout, mixture).
fn family(model_type: &str) -> Option<(&'static str, &'static str, InProj, bool)> {
    match model_type {
        "qwen3_next" => Some(("qwen3_next", "qwen3_next", InProj::Grouped, true)),
        "qwen3_5" | "qwen3_5_text" => Some(("qwen3_5_text", "qwen3_5", InProj::Split, false)),
        "qwen3_5_moe" | "qwen3_5_moe_text" => Some(("qwen3_5_moe_text", "qwen3_5_moe", InProj::Split, true)),
        _ => None,
    }
}

impl Qwen3NextConfig {
    /// Parses and normalises `config.json` text.
    pub fn from_json(text: &str) -> Result<Self, ConfigError> {
        let top: Value = serde_json::from_str(text)?;
        let ty = top.get("model_type").and_then(Value::as_str).ok_or(ConfigError::Missing("model_type"))?;
        let (text_type, wrapper, in_proj, mixture) =
            family(ty).ok_or_else(|| ConfigError::UnsupportedModel(ty.to_string()))?;
        let TextModel { model_type, config, tensor_prefix, quantization, tie_word_embeddings } =
            TextModel::of(text, text_type, wrapper)?;
        // The wrapper's text model lives under `model.language_model.` (its own `model.` dropped).
        let tensor_prefix = if tensor_prefix.is_empty() { tensor_prefix } else { "model.language_model.".into() };
        if let Some(q) = super::quant::QuantConfig::from_json(quantization.as_ref())? {
            return Err(invalid(
                "quantization_config",
                format!("{} weights are not read for {model_type} (plain bf16, f16 or f32 only)", q.describe()),
            ));
        }
        let raw: Raw = serde_json::from_value(config)?;
        if let Some(act) = &raw.hidden_act {
            if act != "silu" && act != "swish" {
                return Err(invalid("hidden_act", format!("{act:?} is not supported (only silu)")));
            }
        }
        // transformers reads no such key and always gates; a checkpoint without
        // the gate's rows in q_proj would fail on its shape, so say why here.
        if raw.attn_output_gate == Some(false) {
            return Err(invalid("attn_output_gate", "false: these models' attention always has an output gate"));
        }
        let defaults = Defaults::of(text_type);
        let GqaSizes { hidden_size, num_layers, num_heads, num_kv_heads, head_dim } = GqaSizes {
            hidden_size: raw.hidden_size.unwrap_or(defaults.hidden),
            num_layers: raw.num_hidden_layers.unwrap_or(defaults.layers),
            num_heads: raw.num_attention_heads.unwrap_or(16),
            num_kv_heads: raw.num_key_value_heads.unwrap_or(defaults.kv_heads),
            head_dim: raw.head_dim.unwrap_or(256),
        }
        .check()?;
        let vocab_size = positive("vocab_size", raw.vocab_size.unwrap_or(defaults.vocab))?;
        let intermediate_size = positive("intermediate_size", raw.intermediate_size.unwrap_or(defaults.inter))?;
        elements("vocab_size", "embed_tokens", &[vocab_size, hidden_size])?;
        // q_proj holds each head's query and its output gate.
        elements("num_attention_heads", "qkv_proj", &[2 * num_heads + 2 * num_kv_heads, head_dim, hidden_size])?;
        elements("intermediate_size", "gate_up_proj", &[2, intermediate_size, hidden_size])?;
        let linear = LinearSizes {
            k_heads: positive("linear_num_key_heads", raw.linear_num_key_heads.unwrap_or(16))?,
            v_heads: positive("linear_num_value_heads", raw.linear_num_value_heads.unwrap_or(32))?,
            k_dim: positive("linear_key_head_dim", raw.linear_key_head_dim.unwrap_or(128))?,
            v_dim: positive("linear_value_head_dim", raw.linear_value_head_dim.unwrap_or(128))?,
            conv_kernel: positive("linear_conv_kernel_dim", raw.linear_conv_kernel_dim.unwrap_or(4))?,
        };
        if !linear.v_heads.is_multiple_of(linear.k_heads) {
            return Err(invalid(
                "linear_num_value_heads",
                format!("{} is not a multiple of linear_num_key_heads {}", linear.v_heads, linear.k_heads),
            ));
        }
        let LinearSizes { k_heads, v_heads, k_dim, v_dim, conv_kernel } = linear;
        let proj = [2 * k_heads * k_dim + 2 * v_heads * v_dim + 2 * v_heads, hidden_size];
        elements("linear_num_value_heads", "in_proj", &proj)?;
        elements("linear_conv_kernel_dim", "conv1d", &[2 * k_heads * k_dim + v_heads * v_dim, conv_kernel])?;
        elements("linear_num_value_heads", "recurrent state", &[v_heads, k_dim, v_dim])?;
        let rms_norm_eps = positive_f32("rms_norm_eps", "rms_norm_eps", raw.rms_norm_eps.unwrap_or(1e-6) as f32)?;
        let (max_position_embeddings, max_position_default) = match raw.max_position_embeddings {
            Some(n) => (positive("max_position_embeddings", n)?, false),
            None => (defaults.positions, true),
        };
        let layer_types = Self::layer_types(&raw, num_layers)?;
        let (rope_theta, rope_scaling, rotary_dim) = Self::rope(&raw, head_dim, max_position_embeddings)?;
        let moe = if mixture { Self::moe(&raw, text_type, hidden_size, num_layers)? } else { None };
        Ok(Qwen3NextConfig {
            model_type,
            in_proj,
            hidden_size,
            num_layers,
            num_heads,
            num_kv_heads,
            head_dim,
            rotary_dim,
            rope_theta,
            rope_scaling,
            attention_bias: raw.attention_bias.unwrap_or(false),
            linear,
            layer_types,
            intermediate_size,
            moe,
            vocab_size,
            rms_norm_eps,
            max_position_embeddings,
            max_position_default,
            tensor_prefix,
            tie_word_embeddings: tie_word_embeddings.unwrap_or(false),
        })
    }

    fn layer_types(raw: &Raw, n: usize) -> Result<Vec<LayerKind>, ConfigError> {
        if let Some(types) = &raw.layer_types {
            if types.len() != n {
                return Err(invalid("layer_types", format!("has {} entries for {n} layers", types.len())));
            }
            // The legacy "mamba" and "attention" too, as transformers renames them.
            return types
                .iter()
                .map(|t| match super::layer_type(t) {
                    "linear_attention" => Ok(LayerKind::Linear),
                    "full_attention" => Ok(LayerKind::Full),
                    _ => Err(invalid("layer_types", format!("unknown layer type {t:?}"))),
                })
                .collect();
        }
        let every = raw.full_attention_interval.unwrap_or(4);
        if every == 0 {
            return Err(invalid("full_attention_interval", "must be positive"));
        }
        Ok((0..n).map(|i| if (i + 1).is_multiple_of(every) { LayerKind::Full } else { LayerKind::Linear }).collect())
    }

    /// (theta, scaling, rotary_dim): transformers 5's `rope_parameters`
    /// (where `partial_rotary_factor` and Qwen3.5's `mrope_section` live), or
    /// the older top-level `rope_theta`, `rope_scaling` and `partial_rotary_factor`
    /// (`rope_scaling` when a file has both, as transformers).
    /// MRoPE's three position components are equal on text, so its sections
    /// all rotate by the one text position: 1-D RoPE, whatever the sections.
    fn rope(raw: &Raw, head_dim: usize, max_positions: usize) -> Result<(f32, RopeScaling, usize), ConfigError> {
        let (params, field) = super::rope_source(raw.rope_parameters.as_ref(), raw.rope_scaling.as_ref());
        let (theta, scaling) = parse_rope(params, field, max_positions)?;
        let theta = theta.or(raw.rope_theta.map(|t| t as f32)).unwrap_or(10_000.0);
        positive_f32("rope_theta", "rope_theta", theta)?;
        let factor = params
            .and_then(|p| p.get("partial_rotary_factor"))
            .and_then(Value::as_f64)
            .or(raw.partial_rotary_factor)
            .unwrap_or(0.25);
        if !(factor > 0.0 && factor <= 1.0) {
            return Err(invalid("partial_rotary_factor", format!("{factor}: must be in (0, 1]")));
        }
        let rotary_dim = (head_dim as f64 * factor) as usize;
        if rotary_dim == 0 || !rotary_dim.is_multiple_of(2) {
            return Err(invalid(
                "partial_rotary_factor",
                format!("{factor} of head_dim {head_dim} rotates {rotary_dim} columns: must be a positive even number"),
            ));
        }
        // Each section is the rotated pairs one position component drives; on text
        // all three are the token's position, so transformers' recomposition is 1-D
        // RoPE even for sections that do not cover the rotated pairs: only their
        // form is checked (transformers indexes by them).
        if let Some(sections) = params.and_then(|p| p.get("mrope_section")).filter(|v| !v.is_null()) {
            if !sections.as_array().is_some_and(|a| a.iter().all(|c| c.as_u64().is_some())) {
                return Err(invalid(field, format!("mrope_section {sections}: expected a list of counts")));
            }
        }
        Ok((theta, scaling, rotary_dim))
    }

    fn moe(raw: &Raw, text_type: &str, hidden: usize, n: usize) -> Result<Option<LlamaMoe>, ConfigError> {
        let qwen35 = text_type == "qwen3_5_moe_text";
        let experts = raw.num_experts.unwrap_or(if qwen35 { 256 } else { 512 });
        if experts == 0 {
            return Ok(None); // Qwen3NextConfig: no experts, every MLP dense
        }
        let top_k = positive("num_experts_per_tok", raw.num_experts_per_tok.unwrap_or(if qwen35 { 8 } else { 10 }))?;
        if top_k > experts {
            return Err(invalid("num_experts_per_tok", format!("{top_k} exceeds num_experts {experts}")));
        }
        let inter = positive("moe_intermediate_size", raw.moe_intermediate_size.unwrap_or(512))?;
        let shared = positive("shared_expert_intermediate_size", raw.shared_expert_intermediate_size.unwrap_or(512))?;
        elements("num_experts", "experts", &[experts, 3, inter, hidden])?;
        // Qwen3.5-MoE: every layer's MLP is the mixture, always renormalised.
        let sparse = if qwen35 {
            vec![true; n]
        } else {
            let step = raw.decoder_sparse_step.unwrap_or(1);
            if step == 0 {
                return Err(invalid("decoder_sparse_step", "must be positive"));
            }
            let dense_only = raw.mlp_only_layers.clone().unwrap_or_default();
            super::warn_past_the_last("mlp_only_layers", &dense_only, n);
            (0..n).map(|l| !dense_only.contains(&l) && (l + 1).is_multiple_of(step)).collect()
        };
        Ok(Some(LlamaMoe {
            scoring: Scoring::Softmax,
            topk_method: TopkMethod::Greedy,
            n_group: 1,
            topk_group: 1,
            routed_scaling_factor: 1.0,
            shared_intermediate_size: Some(shared),
            experts,
            top_k,
            intermediate_size: inter,
            norm_topk_prob: qwen35 || raw.norm_topk_prob.unwrap_or(true),
            sparse,
        }))
    }

    /// The full-attention layers' RoPE (over `rotary_dim` columns).
    pub fn rope_freqs(&self) -> RopeFreqs {
        RopeFreqs { inv_freq: inv_freq(self.rope_theta, self.rotary_dim, &self.rope_scaling), scale: 1.0 }
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
            recurrent: self.layer_types.contains(&LayerKind::Linear),
        }
    }
}

/// transformers' defaults of the sizes that differ between the three configs.
struct Defaults {
    hidden: usize,
    layers: usize,
    kv_heads: usize,
    vocab: usize,
    inter: usize,
    positions: usize,
}

impl Defaults {
    fn of(text_type: &str) -> Self {
        match text_type {
            // Qwen3NextConfig.
            "qwen3_next" => {
                Defaults { hidden: 2048, layers: 48, kv_heads: 2, vocab: 151_936, inter: 5632, positions: 32768 }
            }
            // Qwen3_5TextConfig.
            "qwen3_5_text" => {
                Defaults { hidden: 4096, layers: 32, kv_heads: 4, vocab: 248_320, inter: 12288, positions: 32768 }
            }
            // Qwen3_5MoeTextConfig (no dense MLP: the width is unused).
            _ => Defaults { hidden: 2048, layers: 40, kv_heads: 2, vocab: 248_320, inter: 512, positions: 32768 },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const NEXT: &str = r#"{"model_type": "qwen3_next", "hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 32, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
        "linear_key_head_dim": 16, "linear_value_head_dim": 16, "num_experts": 4, "num_experts_per_tok": 2,
        "vocab_size": 100 KEY}"#;

    fn with(key: &str) -> Result<Qwen3NextConfig, ConfigError> {
        Qwen3NextConfig::from_json(&NEXT.replace(" KEY", key))
    }

    #[test]
    fn defaults_and_the_interval() {
        let c = with("").unwrap();
        assert_eq!(c.layer_types, vec![LayerKind::Linear, LayerKind::Linear, LayerKind::Linear, LayerKind::Full]);
        assert_eq!((c.rotary_dim, c.in_proj, c.tensor_prefix.as_str()), (8, InProj::Grouped, ""));
        let every_other = with(r#", "full_attention_interval": 2"#).unwrap();
        assert_eq!(every_other.layer_types[1], LayerKind::Full);
        let m = c.moe.unwrap();
        assert!(m.norm_topk_prob && m.sparse == vec![true; 4]);
        // A dense Qwen3-Next: no experts.
        assert!(with(r#", "num_experts": 0"#).unwrap().moe.is_none());
        // transformers renames the legacy "mamba" and "attention" as it loads a config.
        let legacy = with(r#", "layer_types": ["mamba", "mamba", "attention", "attention"]"#).unwrap();
        assert_eq!(legacy.layer_types, [LayerKind::Linear, LayerKind::Linear, LayerKind::Full, LayerKind::Full]);
        // mlp_only_layers past the last layer are never looked up by transformers: ignored.
        let dense = with(r#", "mlp_only_layers": [1, 7]"#).unwrap().moe.unwrap().sparse;
        assert_eq!(dense, [true, false, true, true]);
    }

    #[test]
    fn the_wrapper_splits_its_text_model_under_model_language_model() {
        let text = NEXT.replace("qwen3_next", "qwen3_5_moe_text").replace(" KEY", "");
        let wrapper = format!(r#"{{"model_type": "qwen3_5_moe", "text_config": {text}, "vision_config": {{}}}}"#);
        let c = Qwen3NextConfig::from_json(&wrapper).unwrap();
        assert_eq!((c.model_type.as_str(), c.tensor_prefix.as_str()), ("qwen3_5_moe", "model.language_model."));
        assert_eq!(c.in_proj, InProj::Split);
        let other = wrapper.replace("qwen3_5_moe_text", "qwen3_5_text");
        let err = Qwen3NextConfig::from_json(&other).unwrap_err().to_string();
        assert!(err.contains("model_type"), "{err}");
        // Without its text model: refused, not transformers' default one.
        let err = Qwen3NextConfig::from_json(r#"{"model_type": "qwen3_5"}"#).unwrap_err().to_string();
        assert!(err.contains("lacks required field `text_config`"), "{err}");
    }

    #[test]
    fn mrope_sections_that_miss_the_rotated_pairs_are_1d_rope_on_text() {
        // transformers 5.25.0's Qwen3_5TextRotaryEmbedding for head_dim 32, partial_rotary_factor
        // 0.25, base 1e4 and mrope_section [2, 1, 1], [2, 1, 2], [1, 1, 1] or [4, 4, 4]: inv_freq
        // [1, 0.1, 0.01, 0.001], and cos/sin at text positions the same for every split.
        let want = [1.0, 0.10000000149011612, 0.009999999776482582, 0.0010000000474974513];
        for sections in ["[2, 1, 1]", "[2, 1, 2]", "[1, 1, 1]", "[4, 4, 4]"] {
            let key = format!(
                r#", "rope_parameters": {{"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.25,
                    "mrope_section": {sections}}}"#
            );
            let text = NEXT.replace("qwen3_next", "qwen3_5_text").replace(" KEY", &key);
            let c = Qwen3NextConfig::from_json(&text).unwrap_or_else(|e| panic!("{sections}: {e}"));
            let got = c.rope_freqs().inv_freq;
            assert_eq!(got.len(), want.len());
            for (g, w) in got.iter().zip(want) {
                assert!((*g as f64 - w).abs() <= 1e-6 * w, "{sections}: {got:?}");
            }
        }
    }

    #[test]
    fn refusals_name_their_field() {
        for (key, field) in [
            (r#", "linear_num_value_heads": 3"#, "linear_num_value_heads"),
            (r#", "layer_types": ["full_attention"]"#, "layer_types"),
            (
                r#", "layer_types": ["linear_attention", "sliding_attention", "full_attention", "full_attention"]"#,
                "layer_types",
            ),
            (r#", "full_attention_interval": 0"#, "full_attention_interval"),
            (r#", "partial_rotary_factor": 1.5"#, "partial_rotary_factor"),
            (r#", "rope_parameters": {"rope_theta": 1e4, "mrope_section": ["a"]}"#, "rope_parameters"),
            (r#", "hidden_act": "gelu""#, "hidden_act"),
            (r#", "attn_output_gate": false"#, "attn_output_gate"),
            // Degenerate values transformers runs (zero widths, no routed expert, eps 0, no
            // context, no rotation), and odd rotations (15-wide heads; 0.3 of 32 is 9 columns).
            (r#", "intermediate_size": 0"#, "intermediate_size"),
            (r#", "shared_expert_intermediate_size": 0"#, "shared_expert_intermediate_size"),
            (r#", "num_experts_per_tok": 0"#, "num_experts_per_tok"),
            (r#", "rms_norm_eps": 0"#, "rms_norm_eps"),
            (r#", "max_position_embeddings": 0"#, "max_position_embeddings"),
            (r#", "num_hidden_layers": 0"#, "num_hidden_layers"),
            (r#", "partial_rotary_factor": 0"#, "partial_rotary_factor"),
            (r#", "partial_rotary_factor": 0.3"#, "partial_rotary_factor"),
            (r#", "head_dim": 15"#, "head_dim"),
            (r#", "num_experts_per_tok": 9"#, "num_experts_per_tok"),
            (
                r#", "quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}"#,
                "quantization_config",
            ),
        ] {
            let err = with(key).unwrap_err();
            assert!(matches!(&err, ConfigError::Invalid { field: f, .. } if *f == field), "{key}: {err}");
        }
    }
}
