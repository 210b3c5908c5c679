//! `config.json` of Llama 4 checkpoints: `llama4_text` (a text model saved
//! alone) and `llama4`, the multimodal wrapper Scout and Maverick ship as,
//! whose text model is read from `text_config` and whose tensors live under
//! `language_model.` (the vision model is not read).
//!
//! Sizes a field leaves out take transformers' `Llama4TextConfig` defaults.
//! Per layer the config says three things, each from its own key:
//! - whether it rotates q and k (`no_rope_layers[i]` nonzero: the name is
//!   inverted; default every fourth layer is NoPE, `no_rope_layer_interval`);
//! - whether it attends within chunks (`layer_types`, or, in the hub's
//!   files, every RoPE layer when `attention_chunk_size` is set);
//! - whether its MLP is a mixture of experts (`moe_layers`, or every
//!   `interleave_moe_layer_step`-th layer).
//!
//! Every refusal is a [`ConfigError`] that names the field.

use super::rope::{inv_freq, parse_rope, RopeScaling};
use super::{
    bounded, elements, invalid, positive, positive_f32, ArchInfo, ConfigError, GqaSizes, RopeFreqs, TextModel,
    MAX_COUNT,
};
use serde::Deserialize;
use serde_json::Value;

/// One decoder layer's variant.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Llama4Layer {
    /// q and k are rotated (a RoPE layer; else NoPE, with the temperature).
    pub rope: bool,
    /// `Some(c)`: attention within chunks of `c` positions (`chunked_attention`).
    pub chunk: Option<usize>,
    /// The MLP is the mixture of experts (else the dense MLP of `intermediate_size_mlp`).
    pub moe: bool,
}

/// Llama 4's attention temperature on its NoPE layers: the query at
/// absolute position `p` is scaled by `ln(1 + floor((p + 1) / floor_scale)) ·
/// attn_scale + 1` (`attn_temperature_tuning`, arXiv:2501.19399).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Temperature {
    /// `floor_scale` (8192 in the releases).
    pub floor_scale: f32,
    /// `attn_scale` (0.1).
    pub attn_scale: f32,
}

impl Temperature {
    /// The factor at position `p`, in f32 as transformers computes it.
    pub fn at(self, p: usize) -> f32 {
        ((p as f32 + 1.0) / self.floor_scale).floor().ln_1p() * self.attn_scale + 1.0
    }
}

/// A Llama 4 text decoder's sizes and options, normalised.
#[derive(Clone, Debug, PartialEq)]
pub struct Llama4Config {
    /// `llama4_text`, or `llama4` for the multimodal wrapper.
    pub model_type: String,
    /// Residual stream width.
    pub hidden_size: usize,
    /// Decoder layers.
    pub num_layers: usize,
    /// Query heads.
    pub num_heads: usize,
    /// Key/value heads (GQA).
    pub num_kv_heads: usize,
    /// Per-head width.
    pub head_dim: usize,
    /// Each routed expert's width, and the shared expert's (`intermediate_size`).
    pub intermediate_size: usize,
    /// The dense MLP's width (`intermediate_size_mlp`).
    pub intermediate_size_mlp: usize,
    /// Routed experts per MoE layer (`num_local_experts`).
    pub num_experts: usize,
    /// Experts per token.
    pub top_k: usize,
    /// Vocabulary size.
    pub vocab_size: usize,
    /// Epsilon of every RMSNorm, the weightless q/k norm's included.
    pub rms_norm_eps: f32,
    /// Bias on q/k/v/o (`attention_bias`).
    pub attention_bias: bool,
    /// A weightless RMS norm of q and k after RoPE, on RoPE layers (`use_qk_norm`).
    pub qk_norm: bool,
    /// The NoPE layers' query temperature (`attn_temperature_tuning`).
    pub temperature: Option<Temperature>,
    /// Each layer's variant.
    pub layers: Vec<Llama4Layer>,
    /// RoPE base.
    pub rope_theta: f32,
    /// RoPE scaling (llama3 in Scout).
    pub rope_scaling: RopeScaling,
    /// Longest sequence.
    pub max_position_embeddings: usize,
    /// config.json has no `max_position_embeddings`: the limit is HF's default.
    pub max_position_default: bool,
    /// Prefix of the text model's tensor names: `language_model.` in the wrapper.
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
    intermediate_size_mlp: Option<usize>,
    num_local_experts: Option<usize>,
    num_experts_per_tok: Option<usize>,
    vocab_size: Option<usize>,
    rms_norm_eps: Option<f64>,
    attention_bias: Option<bool>,
    hidden_act: Option<String>,
    use_qk_norm: Option<bool>,
    // A bool in transformers; the hub's Scout and Maverick files write 4.
    attn_temperature_tuning: Option<Value>,
    floor_scale: Option<f64>,
    attn_scale: Option<f64>,
    no_rope_layers: Option<Vec<i64>>,
    no_rope_layer_interval: Option<usize>,
    // Absent: transformers' 8192; null: no chunking.
    #[serde(default, deserialize_with = "super::present")]
    attention_chunk_size: Option<Option<usize>>,
    layer_types: Option<Vec<String>>,
    moe_layers: Option<Vec<usize>>,
    interleave_moe_layer_step: Option<usize>,
    rope_theta: Option<f64>,
    rope_scaling: Option<Value>,
    rope_parameters: Option<Value>,
    max_position_embeddings: Option<usize>,
}

impl Llama4Config {
    /// Parses and normalises `config.json` text.
    pub fn from_json(text: &str) -> Result<Self, ConfigError> {
        let TextModel { model_type, config, tensor_prefix, quantization, tie_word_embeddings } =
            TextModel::of(text, "llama4_text", "llama4")?;
        let raw: Raw = serde_json::from_value(config)?;
        if let Some(q) = quantization {
            let method = q.get("quant_method").and_then(Value::as_str).unwrap_or("an unnamed method");
            return Err(invalid(
                "quantization_config",
                format!("{method} weights are not read for llama4 (plain bf16, f16 or f32 only)"),
            ));
        }
        let act = raw.hidden_act.as_deref().unwrap_or("silu");
        if act != "silu" {
            return Err(invalid("hidden_act", format!("{act:?} is not supported (Llama 4's MLPs are silu)")));
        }

        // Llama4TextConfig's defaults.
        // head_dim: the dataclass's 128, not hidden / heads (transformers uses that only for an explicit null).
        let GqaSizes { hidden_size, num_layers, num_heads, num_kv_heads, head_dim } = GqaSizes {
            hidden_size: raw.hidden_size.unwrap_or(5120),
            num_layers: raw.num_hidden_layers.unwrap_or(48),
            num_heads: raw.num_attention_heads.unwrap_or(40),
            num_kv_heads: raw.num_key_value_heads.unwrap_or(8),
            head_dim: raw.head_dim.unwrap_or(128),
        }
        .check()?;
        let intermediate_size = positive("intermediate_size", raw.intermediate_size.unwrap_or(8192))?;
        let intermediate_size_mlp = positive("intermediate_size_mlp", raw.intermediate_size_mlp.unwrap_or(16384))?;
        let num_experts = bounded("num_local_experts", raw.num_local_experts.unwrap_or(16), MAX_COUNT)?;
        let top_k = positive("num_experts_per_tok", raw.num_experts_per_tok.unwrap_or(1))?;
        if top_k > num_experts {
            return Err(invalid("num_experts_per_tok", format!("{top_k} exceeds num_local_experts {num_experts}")));
        }
        let vocab_size = positive("vocab_size", raw.vocab_size.unwrap_or(202_048))?;
        elements("vocab_size", "embed_tokens", &[vocab_size, hidden_size])?;
        elements("num_attention_heads", "qkv_proj", &[num_heads + 2 * num_kv_heads, head_dim, hidden_size])?;
        elements("intermediate_size", "experts.gate_up_proj", &[num_experts, 2 * intermediate_size, hidden_size])?;
        elements("intermediate_size_mlp", "gate_up_proj", &[2, intermediate_size_mlp, hidden_size])?;
        let rms_norm_eps = positive_f32("rms_norm_eps", "rms_norm_eps", raw.rms_norm_eps.unwrap_or(1e-5) as f32)?;
        let (max_position_embeddings, max_position_default) = match raw.max_position_embeddings {
            Some(n) => (positive("max_position_embeddings", n)?, false),
            None => (4096 * 32, true),
        };
        let layers = Self::layers(&raw, num_layers)?;
        let temperature = Self::temperature(&raw)?;
        let (rope_theta, rope_scaling) = Self::rope_params(&raw, max_position_embeddings)?;
        Ok(Llama4Config {
            model_type,
            hidden_size,
            num_layers,
            num_heads,
            num_kv_heads,
            head_dim,
            intermediate_size,
            intermediate_size_mlp,
            num_experts,
            top_k,
            vocab_size,
            rms_norm_eps,
            attention_bias: raw.attention_bias.unwrap_or(false),
            qk_norm: raw.use_qk_norm.unwrap_or(true),
            temperature,
            layers,
            rope_theta,
            rope_scaling,
            max_position_embeddings,
            max_position_default,
            tensor_prefix,
            tie_word_embeddings: tie_word_embeddings.unwrap_or(false),
        })
    }

    /// Each layer's RoPE, chunking and MLP, as `Llama4TextConfig.__post_init__` resolves them.
    fn layers(raw: &Raw, n: usize) -> Result<Vec<Llama4Layer>, ConfigError> {
        // RoPE: `no_rope_layers` (by its Python truth, as transformers reads it: nonzero
        // rotates; an empty list counts as unset), or a NoPE layer every interval-th.
        let rope: Vec<bool> = match raw.no_rope_layers.as_deref().filter(|l| !l.is_empty()) {
            Some(list) => {
                if list.len() < n {
                    return Err(invalid("no_rope_layers", format!("has {} entries for {n} layers", list.len())));
                }
                list[..n].iter().map(|&v| v != 0).collect()
            }
            None => {
                let interval = positive("no_rope_layer_interval", raw.no_rope_layer_interval.unwrap_or(4))?;
                (0..n).map(|i| !(i + 1).is_multiple_of(interval)).collect()
            }
        };
        // Chunking: `layer_types`, or chunked on RoPE layers when there is a chunk size.
        let chunk_size = match raw.attention_chunk_size {
            None => Some(8192),
            Some(Some(0)) => return Err(invalid("attention_chunk_size", "must be positive")),
            Some(c) => c,
        };
        let chunked: Vec<bool> = match &raw.layer_types {
            Some(types) => {
                if types.len() != n {
                    return Err(invalid("layer_types", format!("has {} entries for {n} layers", types.len())));
                }
                types
                    .iter()
                    .map(|t| match super::layer_type(t) {
                        "full_attention" => Ok(false),
                        "chunked_attention" if chunk_size.is_some() => Ok(true),
                        "chunked_attention" => {
                            Err(invalid("layer_types", "chunked_attention needs attention_chunk_size"))
                        }
                        _ => Err(invalid(
                            "layer_types",
                            format!("unknown layer type {t:?} (supported: full_attention, chunked_attention)"),
                        )),
                    })
                    .collect::<Result<_, _>>()?
            }
            None => rope.iter().map(|&r| r && chunk_size.is_some()).collect(),
        };
        // MoE: `moe_layers`, or every step-th layer from step - 1.
        let moe: Vec<bool> = match &raw.moe_layers {
            Some(list) => {
                super::warn_past_the_last("moe_layers", list, n);
                (0..n).map(|i| list.contains(&i)).collect()
            }
            None => {
                let step = positive("interleave_moe_layer_step", raw.interleave_moe_layer_step.unwrap_or(1))?;
                (0..n).map(|i| (i + 1).is_multiple_of(step)).collect()
            }
        };
        Ok((0..n)
            .map(|i| Llama4Layer { rope: rope[i], chunk: chunk_size.filter(|_| chunked[i]), moe: moe[i] })
            .collect())
    }

    /// The temperature, if `attn_temperature_tuning` is truthy (a bool, or a
    /// number as the hub's files write it; Python's truth: nonzero).
    fn temperature(raw: &Raw) -> Result<Option<Temperature>, ConfigError> {
        let field = "attn_temperature_tuning";
        let on = match &raw.attn_temperature_tuning {
            None | Some(Value::Null) => true,
            Some(Value::Bool(b)) => *b,
            Some(Value::Number(n)) => n.as_f64() != Some(0.0),
            Some(other) => return Err(invalid(field, format!("expected a bool, got {other}"))),
        };
        if !on {
            return Ok(None);
        }
        let floor_scale = positive_f32("floor_scale", "floor_scale", raw.floor_scale.unwrap_or(8192.0) as f32)?;
        let attn_scale = raw.attn_scale.unwrap_or(0.1) as f32;
        if !attn_scale.is_finite() {
            return Err(invalid("attn_scale", format!("must be finite, got {attn_scale}")));
        }
        Ok(Some(Temperature { floor_scale, attn_scale }))
    }

    /// `(rope_theta, scaling)`: transformers 5's `rope_parameters`, or the
    /// hub's `rope_theta` and `rope_scaling` (that one when a file has both, as transformers).
    fn rope_params(raw: &Raw, max_position_embeddings: usize) -> Result<(f32, RopeScaling), ConfigError> {
        let (params, field) = super::rope_source(raw.rope_parameters.as_ref(), raw.rope_scaling.as_ref());
        let (theta, scaling) = parse_rope(params, field, max_position_embeddings)?;
        let theta = theta.or(raw.rope_theta.map(|t| t as f32)).unwrap_or(500_000.0);
        positive_f32("rope_theta", "rope_theta", theta)?;
        Ok((theta, scaling))
    }

    /// RoPE's frequencies (one per rotated pair of adjacent columns).
    pub fn rope(&self) -> RopeFreqs {
        RopeFreqs { inv_freq: inv_freq(self.rope_theta, self.head_dim, &self.rope_scaling), scale: 1.0 }
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

    fn text(extra: &str) -> String {
        format!(
            r#"{{"model_type": "llama4_text", "hidden_size": 64, "num_hidden_layers": 8, "num_attention_heads": 4,
                "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 100{extra}}}"#
        )
    }

    #[test]
    fn defaults_give_scouts_layer_pattern() {
        let c = Llama4Config::from_json(&text("")).unwrap();
        let nope: Vec<usize> = (0..8).filter(|&i| !c.layers[i].rope).collect();
        assert_eq!(nope, vec![3, 7], "a NoPE layer every fourth");
        assert!(c.layers.iter().all(|l| l.moe), "interleave_moe_layer_step 1: every layer routes");
        assert!(c.layers.iter().all(|l| l.chunk == if l.rope { Some(8192) } else { None }));
        assert_eq!(c.temperature, Some(Temperature { floor_scale: 8192.0, attn_scale: 0.1 }));
        assert!(c.qk_norm);
        // No head_dim: the dataclass's 128, not hidden / heads (16 here).
        let c = Llama4Config::from_json(&text("").replace(r#""head_dim": 16,"#, "")).unwrap();
        assert_eq!(c.head_dim, 128);
    }

    #[test]
    fn the_hubs_integer_temperature_flag_and_an_empty_no_rope_list_are_read_as_transformers_reads_them() {
        let c = Llama4Config::from_json(&text(r#", "attn_temperature_tuning": 4, "no_rope_layers": []"#)).unwrap();
        assert!(c.temperature.is_some());
        assert_eq!(c.layers.iter().filter(|l| !l.rope).count(), 2, "an empty list is the default interval");
        let c = Llama4Config::from_json(&text(r#", "attn_temperature_tuning": false"#)).unwrap();
        assert_eq!(c.temperature, None);
    }

    #[test]
    fn layer_lists_are_read_as_transformers_reads_them() {
        // no_rope_layers by its Python truth (`self.use_rope = config.no_rope_layers[i]`): 2 and -1 rotate.
        let c = Llama4Config::from_json(&text(r#", "no_rope_layers": [1, 1, 1, 2, -1, 1, 1, 0]"#)).unwrap();
        assert_eq!(
            c.layers.iter().map(|l| l.rope).collect::<Vec<_>>(),
            [true, true, true, true, true, true, true, false]
        );
        assert!(c.layers[3].chunk.is_some(), "a RoPE layer is chunked, as transformers derives layer_types");
        // moe_layers past the last layer are never looked up (`layer_idx in config.moe_layers`).
        let c = Llama4Config::from_json(&text(r#", "moe_layers": [1, 8, 30]"#)).unwrap();
        assert_eq!((0..8).filter(|&i| c.layers[i].moe).collect::<Vec<_>>(), [1]);
        // The legacy "attention" is full_attention.
        let types = r#", "layer_types": ["attention", "chunked_attention", "attention", "attention",
            "attention", "attention", "attention", "attention"]"#;
        let c = Llama4Config::from_json(&text(types)).unwrap();
        assert_eq!((0..8).filter(|&i| c.layers[i].chunk.is_some()).collect::<Vec<_>>(), [1]);
    }

    #[test]
    fn moe_layers_and_layer_types_override_the_intervals() {
        let c = Llama4Config::from_json(&text(
            r#", "moe_layers": [1, 5], "interleave_moe_layer_step": 4, "attention_chunk_size": 16,
               "layer_types": ["full_attention", "chunked_attention", "full_attention", "full_attention",
                               "full_attention", "full_attention", "full_attention", "chunked_attention"]"#,
        ))
        .unwrap();
        let moe: Vec<usize> = (0..8).filter(|&i| c.layers[i].moe).collect();
        assert_eq!(moe, vec![1, 5]);
        let chunked: Vec<usize> = (0..8).filter(|&i| c.layers[i].chunk.is_some()).collect();
        assert_eq!(chunked, vec![1, 7], "layer_types decides the mask, not no_rope_layers");
        let c = Llama4Config::from_json(&text(r#", "interleave_moe_layer_step": 2, "attention_chunk_size": null"#))
            .unwrap();
        assert_eq!((0..8).filter(|&i| c.layers[i].moe).collect::<Vec<_>>(), vec![1, 3, 5, 7]);
        assert!(c.layers.iter().all(|l| l.chunk.is_none()), "no chunk size: every layer full");
    }

    #[test]
    fn bad_layer_lists_are_refused_by_name() {
        let cases = [
            (r#", "no_rope_layers": [1, 1]"#, "no_rope_layers"),
            (r#", "layer_types": ["sliding_attention"]"#, "layer_types"),
            (r#", "attention_chunk_size": 0"#, "attention_chunk_size"),
            (r#", "hidden_act": "gelu""#, "hidden_act"),
            (r#", "rope_scaling": {"rope_type": "yarn", "factor": 4.0}"#, "rope_scaling"),
            (r#", "quantization_config": {"quant_method": "fbgemm_fp8"}"#, "quantization_config"),
            (r#", "num_experts_per_tok": 17"#, "num_experts_per_tok"),
            // Degenerate values transformers runs (zero widths, no routed expert, eps 0, no context).
            (r#", "intermediate_size": 0"#, "`intermediate_size`"),
            (r#", "intermediate_size_mlp": 0"#, "`intermediate_size_mlp`"),
            (r#", "num_experts_per_tok": 0"#, "`num_experts_per_tok`"),
            (r#", "rms_norm_eps": 0.0"#, "`rms_norm_eps`"),
            (r#", "max_position_embeddings": 0"#, "`max_position_embeddings`"),
            (r#", "num_hidden_layers": 0"#, "`num_hidden_layers`"),
            (r#", "rope_theta": 1e39"#, "`rope_theta`"),
            (r#", "num_local_experts": 99999999"#, "`num_local_experts`: 99999999 is implausibly large"),
        ];
        for (extra, field) in cases {
            let e = Llama4Config::from_json(&text(extra)).unwrap_err().to_string();
            assert!(e.contains(field), "{extra}: {e}");
        }
        // The wrapper without its text model: refused, not transformers' default Scout-sized one.
        let e = Llama4Config::from_json(r#"{"model_type": "llama4"}"#).unwrap_err().to_string();
        assert!(e.contains("lacks required field `text_config`"), "{e}");
    }
}
