//! `config.json` of Gemma 3 checkpoints: `gemma3_text` (Gemma-3-1B, and text
//! models saved alone), and `gemma3`, the multimodal wrapper of the 4B, 12B
//! and 27B releases, whose text model is read from `text_config` and whose
//! tensors live under `language_model.` (its vision tower is not used).
//!
//! Sizes a field leaves out take transformers' `Gemma3TextConfig` defaults,
//! as the hub's wrapper configs rely on them (gemma-3-4b-it's `text_config`
//! names six fields). Every refusal is a [`ConfigError`] that names the field.

use super::rope::{inv_freq, parse_rope, RopeScaling};
use super::{elements, invalid, positive, positive_f32, ArchInfo, ConfigError, GqaSizes, RopeFreqs, TextModel};
use serde::Deserialize;
use serde_json::Value;

/// A Gemma 3 text decoder's sizes and options, normalised.
#[derive(Clone, Debug, PartialEq)]
pub struct Gemma3Config {
    /// `gemma3_text`, or `gemma3` for the multimodal wrapper.
    pub model_type: String,
    /// Residual stream width.
    pub hidden_size: usize,
    /// Decoder layers.
    pub num_layers: usize,
    /// Query heads.
    pub num_heads: usize,
    /// Key/value heads (GQA).
    pub num_kv_heads: usize,
    /// Per-head width (Gemma's is not `hidden_size / num_heads`).
    pub head_dim: usize,
    /// MLP width.
    pub intermediate_size: usize,
    /// Vocabulary size.
    pub vocab_size: usize,
    /// Epsilon of every RMSNorm.
    pub rms_norm_eps: f32,
    /// Attention scores are scaled by `query_pre_attn_scalar^-1/2`, not `head_dim^-1/2`.
    pub query_pre_attn_scalar: f32,
    /// Bias on q/k/v/o (`attention_bias`).
    pub attention_bias: bool,
    /// RoPE base and scaling of the global (full-attention) layers.
    pub rope_theta: f32,
    /// Scaling of the global layers' RoPE (linear in the 4B+ releases).
    pub rope_scaling: RopeScaling,
    /// RoPE base of the local (sliding) layers.
    pub rope_local_theta: f32,
    /// Scaling of the local layers' RoPE: none in the releases, but transformers
    /// applies whatever `rope_parameters.sliding_attention` says.
    pub rope_local_scaling: RopeScaling,
    /// Per layer: `Some(w)` for a local layer attending to the last `w` positions.
    pub sliding_windows: Vec<Option<usize>>,
    /// Longest sequence.
    pub max_position_embeddings: usize,
    /// config.json has no `max_position_embeddings`: the limit is HF's default.
    pub max_position_default: bool,
    /// Prefix of the text model's tensor names: `language_model.` in the wrapper.
    pub tensor_prefix: String,
    /// The LM head is the embedding matrix (Gemma's default: true).
    pub tie_word_embeddings: bool,
    /// `final_logit_softcapping`: `cap · tanh(logits / cap)`, as
    /// `Gemma3ForCausalLM` applies it (the text model only: transformers'
    /// `Gemma3ForConditionalGeneration` does not read it).
    pub final_logit_softcapping: Option<f32>,
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
    query_pre_attn_scalar: Option<f64>,
    attention_bias: Option<bool>,
    hidden_activation: Option<String>,
    hidden_act: Option<String>,
    rope_theta: Option<f64>,
    rope_local_base_freq: Option<f64>,
    rope_scaling: Option<Value>,
    rope_parameters: Option<Value>,
    sliding_window: Option<usize>,
    sliding_window_pattern: Option<usize>,
    #[serde(rename = "_sliding_window_pattern")]
    sliding_window_pattern_saved: Option<usize>,
    layer_types: Option<Vec<String>>,
    max_position_embeddings: Option<usize>,
    attn_logit_softcapping: Option<f64>,
    final_logit_softcapping: Option<f64>,
    use_bidirectional_attention: Option<bool>,
}

impl Gemma3Config {
    /// Parses and normalises `config.json` text.
    pub fn from_json(text: &str) -> Result<Self, ConfigError> {
        let TextModel { model_type, config, tensor_prefix, quantization, tie_word_embeddings } =
            TextModel::of(text, "gemma3_text", "gemma3")?;
        let raw: Raw = serde_json::from_value(config)?;
        if let Some(q) = super::quant::QuantConfig::from_json(quantization.as_ref())? {
            return Err(invalid(
                "quantization_config",
                format!("{} weights are not read for gemma3 (plain bf16, f16 or f32 only)", q.describe()),
            ));
        }
        if raw.use_bidirectional_attention == Some(true) {
            return Err(invalid(
                "use_bidirectional_attention",
                "true makes every layer attend to later tokens (an encoder, EmbeddingGemma); Strata's decoders are causal",
            ));
        }
        if let Some(cap) = raw.attn_logit_softcapping {
            return Err(invalid(
                "attn_logit_softcapping",
                format!("{cap}: Gemma 3 has no score soft-capping (Gemma 2 does), and Strata does not apply one"),
            ));
        }
        let act = raw.hidden_activation.as_deref().or(raw.hidden_act.as_deref()).unwrap_or("gelu_pytorch_tanh");
        if act != "gelu_pytorch_tanh" {
            return Err(invalid(
                "hidden_activation",
                format!("{act:?} is not supported (Gemma 3's MLP is gelu_pytorch_tanh)"),
            ));
        }

        // Gemma3TextConfig's defaults.
        let GqaSizes { hidden_size, num_layers, num_heads, num_kv_heads, head_dim } = GqaSizes {
            hidden_size: raw.hidden_size.unwrap_or(2304),
            num_layers: raw.num_hidden_layers.unwrap_or(26),
            num_heads: raw.num_attention_heads.unwrap_or(8),
            num_kv_heads: raw.num_key_value_heads.unwrap_or(4),
            head_dim: raw.head_dim.unwrap_or(256),
        }
        .check()?;
        let intermediate_size = positive("intermediate_size", raw.intermediate_size.unwrap_or(9216))?;
        let vocab_size = positive("vocab_size", raw.vocab_size.unwrap_or(262_208))?;
        elements("vocab_size", "embed_tokens", &[vocab_size, hidden_size])?;
        elements("num_attention_heads", "qkv_proj", &[num_heads + 2 * num_kv_heads, head_dim, hidden_size])?;
        elements("intermediate_size", "gate_up_proj", &[2, intermediate_size, hidden_size])?;
        let rms_norm_eps = positive_f32("rms_norm_eps", "rms_norm_eps", raw.rms_norm_eps.unwrap_or(1e-6) as f32)?;
        let query_pre_attn_scalar = positive_f32(
            "query_pre_attn_scalar",
            "query_pre_attn_scalar",
            raw.query_pre_attn_scalar.unwrap_or(256.0) as f32,
        )?;
        let (max_position_embeddings, max_position_default) = match raw.max_position_embeddings {
            Some(n) => (positive("max_position_embeddings", n)?, false),
            None => (131_072, true),
        };
        let sliding_windows = Self::windows(&raw, num_layers)?;
        let (rope_theta, rope_scaling, rope_local_theta, rope_local_scaling) =
            Self::ropes(&raw, max_position_embeddings)?;
        let final_logit_softcapping = match raw.final_logit_softcapping {
            Some(cap) if model_type == "gemma3_text" => {
                Some(super::positive_f32("final_logit_softcapping", "the cap", cap as f32)?)
            }
            _ => None,
        };
        Ok(Gemma3Config {
            model_type,
            hidden_size,
            num_layers,
            num_heads,
            num_kv_heads,
            head_dim,
            intermediate_size,
            vocab_size,
            rms_norm_eps,
            query_pre_attn_scalar,
            attention_bias: raw.attention_bias.unwrap_or(false),
            rope_theta,
            rope_scaling,
            rope_local_theta,
            rope_local_scaling,
            sliding_windows,
            max_position_embeddings,
            max_position_default,
            tensor_prefix,
            tie_word_embeddings: tie_word_embeddings.unwrap_or(true),
            final_logit_softcapping,
        })
    }

    /// Local layers from `layer_types`, or, in older files, every layer but
    /// each `sliding_window_pattern`-th (default 6: five local, one global).
    fn windows(raw: &Raw, n: usize) -> Result<Vec<Option<usize>>, ConfigError> {
        let w = raw.sliding_window.unwrap_or(4096);
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
        let pattern = raw.sliding_window_pattern.or(raw.sliding_window_pattern_saved).unwrap_or(6);
        if pattern == 0 {
            return Err(invalid("sliding_window_pattern", "must be positive"));
        }
        Ok((0..n).map(|i| (!(i + 1).is_multiple_of(pattern)).then_some(w)).collect())
    }

    /// (global theta, global scaling, local theta, local scaling), as
    /// Gemma3TextConfig resolves them: transformers 5's `rope_parameters` per
    /// layer type, or the older `rope_theta`, `rope_local_base_freq` and
    /// `rope_scaling`; `rope_scaling` applies to the global layers only.
    fn ropes(raw: &Raw, max_positions: usize) -> Result<(f32, RopeScaling, f32, RopeScaling), ConfigError> {
        let field = "rope_parameters";
        let (mut full, mut sliding) = (None, None);
        if let Some(p) = raw.rope_parameters.as_ref().filter(|p| !p.is_null()) {
            let obj = p.as_object().ok_or_else(|| invalid(field, format!("expected an object, got {p}")))?;
            if obj.keys().any(|k| k != "full_attention" && k != "sliding_attention") {
                return Err(invalid(
                    field,
                    "Gemma 3 takes one entry per layer type (full_attention, sliding_attention), not one for all layers",
                ));
            }
            full = obj.get("full_attention").filter(|v| !v.is_null()).cloned();
            sliding = obj.get("sliding_attention").filter(|v| !v.is_null()).cloned();
        }
        // `rope_scaling` updates the global layers' entry, as HF's conversion does.
        if let Some(s) = raw.rope_scaling.as_ref().filter(|s| !s.is_null()) {
            let (Some(entry), Some(update)) =
                (full.get_or_insert_with(|| Value::Object(Default::default())).as_object_mut(), s.as_object())
            else {
                return Err(invalid("rope_scaling", format!("expected an object, got {s}")));
            };
            entry.extend(update.clone());
        }
        let (full_theta, scaling) = parse_rope(full.as_ref(), field, max_positions)?;
        // The releases scale the global layers only; transformers builds the
        // local layers' RoPE from their own entry, scaled or not, and so does Strata.
        let (local_theta, local_scaling) = parse_rope(sliding.as_ref(), field, max_positions)?;
        let theta = full_theta.or(raw.rope_theta.map(|t| t as f32)).unwrap_or(1_000_000.0);
        let local = local_theta.or(raw.rope_local_base_freq.map(|t| t as f32)).unwrap_or(10_000.0);
        positive_f32("rope_theta", "rope_theta", theta)?;
        positive_f32("rope_local_base_freq", "rope_local_base_freq", local)?;
        Ok((theta, scaling, local, local_scaling))
    }

    /// The global layers' RoPE.
    pub fn rope(&self) -> RopeFreqs {
        RopeFreqs { inv_freq: inv_freq(self.rope_theta, self.head_dim, &self.rope_scaling), scale: 1.0 }
    }

    /// The local layers' RoPE.
    pub fn rope_local(&self) -> RopeFreqs {
        RopeFreqs { inv_freq: inv_freq(self.rope_local_theta, self.head_dim, &self.rope_local_scaling), scale: 1.0 }
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
}

#[cfg(test)]
mod tests {
    use super::*;

    /// gemma-3-4b-it's config.json as public quotations give it (see
    /// tests/fixtures/configs/README.md; vision_config trimmed): the text
    /// model names six fields and takes the rest from the defaults.
    const GEMMA3_4B: &str = r#"{
        "architectures": ["Gemma3ForConditionalGeneration"], "boi_token_index": 255999,
        "eoi_token_index": 256000, "eos_token_id": [1, 106], "image_token_index": 262144,
        "initializer_range": 0.02, "mm_tokens_per_image": 256, "model_type": "gemma3",
        "text_config": {"hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text",
            "num_hidden_layers": 34, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
            "sliding_window": 1024},
        "torch_dtype": "bfloat16", "transformers_version": "4.50.0.dev0",
        "vision_config": {"model_type": "siglip_vision_model", "hidden_size": 1152}
    }"#;

    #[test]
    fn the_wrappers_defaults_and_layer_pattern() {
        let c = Gemma3Config::from_json(GEMMA3_4B).unwrap();
        assert_eq!((c.hidden_size, c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim), (2560, 34, 8, 4, 256));
        assert_eq!(
            (c.vocab_size, c.query_pre_attn_scalar, c.tensor_prefix.as_str()),
            (262_208, 256.0, "language_model.")
        );
        // Every sixth layer is global: 5, 11, 17, 23, 29.
        let global: Vec<usize> = (0..34).filter(|&i| c.sliding_windows[i].is_none()).collect();
        assert_eq!(global, vec![5, 11, 17, 23, 29]);
        assert_eq!(c.sliding_windows[0], Some(1024));
        // Linear scaling on the global layers only.
        assert_eq!((c.rope_theta, c.rope_local_theta), (1e6, 1e4));
        assert_eq!(c.rope_scaling, RopeScaling::Linear { factor: 8.0 });
        let (g, l) = (c.rope(), c.rope_local());
        assert_eq!(g.inv_freq.len(), 128);
        assert_eq!(g.inv_freq[0], 1.0 / 8.0);
        assert_eq!(l.inv_freq[0], 1.0);
        assert!((l.inv_freq[1] - 1e4f32.powf(-2.0 / 256.0)).abs() < 1e-7);
    }

    #[test]
    fn the_legacy_attention_layer_type_is_full_attention() {
        let text = r#"{"model_type": "gemma3_text", "num_hidden_layers": 3, "sliding_window": 8,
            "layer_types": ["sliding_attention", "attention", "sliding_attention"]}"#;
        assert_eq!(Gemma3Config::from_json(text).unwrap().sliding_windows, [Some(8), None, Some(8)]);
    }

    #[test]
    fn transformers_5_rope_parameters_agree_with_the_legacy_keys() {
        let legacy = Gemma3Config::from_json(GEMMA3_4B).unwrap();
        let v5 = GEMMA3_4B.replace(
            r#""rope_scaling": {"factor": 8.0, "rope_type": "linear"}"#,
            r#""rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}"#,
        );
        assert_eq!(Gemma3Config::from_json(&v5).unwrap(), legacy);
    }

    use crate::hf::close_to as close;

    #[test]
    fn a_scaled_sliding_entry_scales_the_local_layers_as_transformers_does() {
        // Expected values: transformers 5.25.0's Gemma3RotaryEmbedding (sliding_attention_inv_freq,
        // full_attention_inv_freq) for head_dim 16 and these rope_parameters.
        let text = |rope: &str| {
            let c = format!(
                r#"{{"model_type": "gemma3_text", "hidden_size": 64, "num_hidden_layers": 6, "num_attention_heads": 4,
                    "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 64, "vocab_size": 100,
                    "max_position_embeddings": 1024, "rope_parameters": {rope}}}"#
            );
            Gemma3Config::from_json(&c).unwrap_or_else(|e| panic!("{rope}: {e}"))
        };
        let full = [
            1.0,
            0.17782793939113617,
            0.03162277862429619,
            0.005623413249850273,
            0.0010000000474974513,
            0.00017782794020604342,
            3.162277425872162e-05,
            5.62341347176698e-06,
        ];
        let c = text(
            r#"{"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                "sliding_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}}"#,
        );
        close(&c.rope().inv_freq, &full);
        close(
            &c.rope_local().inv_freq,
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
        // llama3 on the local layers, its original context left to max_position_embeddings (1024).
        let c = text(
            r#"{"sliding_attention": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "rope_theta": 1e4}}"#,
        );
        close(&c.rope().inv_freq, &full);
        close(
            &c.rope_local().inv_freq,
            &[
                1.0,
                0.3162277638912201,
                0.10000000149011612,
                0.03162277862429619,
                0.003086760640144348,
                0.00039528473280370235,
                0.0001250000059371814,
                3.9528473280370235e-05,
            ],
        );
    }

    #[test]
    fn refusals_name_their_field() {
        let text = r#"{"model_type": "gemma3_text", "num_hidden_layers": 2, KEY}"#;
        for (key, field) in [
            (r#""use_bidirectional_attention": true"#, "use_bidirectional_attention"),
            (r#""attn_logit_softcapping": 50.0"#, "attn_logit_softcapping"),
            (r#""hidden_activation": "gelu""#, "hidden_activation"),
            (r#""layer_types": ["full_attention"]"#, "layer_types"),
            (r#""sliding_window_pattern": 0"#, "sliding_window_pattern"),
            (r#""rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}"#, "rope_parameters"),
            (r#""rope_parameters": {"sliding_attention": {"rope_type": "linear", "factor": -2.0}}"#, "rope_parameters"),
            (r#""num_key_value_heads": 3"#, "num_key_value_heads"),
            // Degenerate values transformers runs (an empty residual, zero MLP, eps 0, no context).
            (r#""hidden_size": 0"#, "hidden_size"),
            (r#""intermediate_size": 0"#, "intermediate_size"),
            (r#""rms_norm_eps": 0.0"#, "rms_norm_eps"),
            (r#""max_position_embeddings": 0"#, "max_position_embeddings"),
            (r#""head_dim": 15"#, "head_dim"),
        ] {
            match Gemma3Config::from_json(&text.replace("KEY", key)) {
                Err(ConfigError::Invalid { field: f, .. }) => assert_eq!(f, field, "{key}"),
                other => panic!("{key}: {other:?}"),
            }
        }
        let wrapper = r#"{"model_type": "gemma3"}"#;
        assert!(matches!(Gemma3Config::from_json(wrapper), Err(ConfigError::Missing("text_config"))));
        // transformers ignores the inner model_type (the wrapper fixes the class); another
        // model's name says the checkpoint is not a Gemma 3 text model.
        let other = r#"{"model_type": "gemma3", "text_config": {"model_type": "llama"}}"#;
        assert!(matches!(Gemma3Config::from_json(other), Err(ConfigError::Invalid { field: "model_type", .. })));
    }
}
