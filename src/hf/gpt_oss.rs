//! `config.json` of gpt-oss checkpoints (`gpt_oss`: gpt-oss-20b and -120b).
//!
//! Sizes a field leaves out take transformers' `GptOssConfig` defaults.
//! RoPE is YaRN as transformers computes it, including `truncate: false`
//! (the correction range is not rounded to whole dims), which the hub
//! configs set. The experts may be stored in MXFP4 (`quantization_config`
//! with `quant_method: mxfp4`, the hub's format) or plain (a dequantised
//! copy). Every refusal is a [`ConfigError`] that names the field.

use super::{
    bounded, elements, invalid, positive, positive_f32, ArchInfo, ConfigError, GqaSizes, RopeFreqs, MAX_COUNT,
};
use serde::Deserialize;
use serde_json::Value;

/// YaRN's parameters, as `rope_scaling` (or transformers 5's `rope_parameters`) gives them.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Yarn {
    /// Context extension factor (`max_position_embeddings / original_max_position_embeddings` when null).
    pub factor: f32,
    /// Rotations above which dims are extrapolated (kept).
    pub beta_fast: f32,
    /// Rotations below which dims are interpolated (divided by `factor`).
    pub beta_slow: f32,
    /// The pre-training context.
    pub original_max_position_embeddings: f32,
    /// Whether the correction range is rounded out to whole dims (HF's default:
    /// true; a present value by its Python truth, so null is false).
    pub truncate: bool,
    /// The cos/sin magnitude: `attention_factor` if the config sets it, else
    /// `mscale(factor, mscale) / mscale(factor, mscale_all_dim)` when both are
    /// nonzero, else `0.1·ln(factor) + 1` (`mscale(factor, 1)`).
    pub attention_factor: f32,
}

/// A gpt-oss decoder's sizes and options, normalised.
#[derive(Clone, Debug, PartialEq)]
pub struct GptOssConfig {
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
    /// Each expert's width.
    pub intermediate_size: usize,
    /// Routed experts per layer (`num_local_experts`).
    pub num_experts: usize,
    /// Experts per token.
    pub top_k: usize,
    /// Vocabulary size.
    pub vocab_size: usize,
    /// Epsilon of every RMSNorm.
    pub rms_norm_eps: f32,
    /// Bias on q/k/v/o (`attention_bias`).
    pub attention_bias: bool,
    /// Per layer: `Some(w)` for a sliding layer attending to the last `w` positions.
    pub sliding_windows: Vec<Option<usize>>,
    /// RoPE base.
    pub rope_theta: f32,
    /// YaRN scaling, if any.
    pub yarn: Option<Yarn>,
    /// The clamped GLU's limit (`swiglu_limit`).
    pub swiglu_limit: f32,
    /// The clamped GLU's sigmoid slope (`swiglu_alpha`; 1.702 in every release).
    pub swiglu_alpha: f32,
    /// The experts' weights are MXFP4 blocks (`quant_method: mxfp4`).
    pub mxfp4: bool,
    /// Longest sequence.
    pub max_position_embeddings: usize,
    /// config.json has no `max_position_embeddings`: the limit is HF's default.
    pub max_position_default: bool,
    /// The LM head is the embedding matrix.
    pub tie_word_embeddings: bool,
}

#[derive(Deserialize)]
struct Raw {
    tie_word_embeddings: Option<bool>,
    hidden_size: Option<usize>,
    num_hidden_layers: Option<usize>,
    num_attention_heads: Option<usize>,
    num_key_value_heads: Option<usize>,
    head_dim: Option<usize>,
    intermediate_size: Option<usize>,
    num_local_experts: Option<usize>,
    num_experts_per_tok: Option<usize>,
    experts_per_token: Option<usize>,
    vocab_size: Option<usize>,
    rms_norm_eps: Option<f64>,
    attention_bias: Option<bool>,
    hidden_act: Option<String>,
    rope_theta: Option<f64>,
    rope_scaling: Option<Value>,
    rope_parameters: Option<Value>,
    sliding_window: Option<usize>,
    layer_types: Option<Vec<String>>,
    swiglu_limit: Option<f64>,
    swiglu_alpha: Option<f64>,
    max_position_embeddings: Option<usize>,
    quantization_config: Option<Value>,
}

fn num(obj: &Value, key: &str, field: &'static str) -> Result<Option<f64>, ConfigError> {
    match obj.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => v.as_f64().map(Some).ok_or_else(|| invalid(field, format!("`{key}` must be a number, got {v}"))),
    }
}

impl GptOssConfig {
    /// Reads and normalises `config.json` from a file.
    pub fn from_file(path: &std::path::Path) -> Result<Self, ConfigError> {
        Self::from_json(&super::read_config(path)?)
    }

    /// Parses and normalises `config.json` text.
    pub fn from_json(text: &str) -> Result<Self, ConfigError> {
        let top: Value = serde_json::from_str(text)?;
        match top.get("model_type").and_then(Value::as_str) {
            Some("gpt_oss") => {}
            Some(other) => return Err(ConfigError::UnsupportedModel(other.into())),
            None => return Err(ConfigError::Missing("model_type")),
        }
        let raw: Raw = serde_json::from_value(top)?;
        let act = raw.hidden_act.as_deref().unwrap_or("silu");
        if act != "silu" {
            // HF ignores the key (the experts' clamped GLU is fixed); a file that names another asks for something else.
            return Err(invalid("hidden_act", format!("{act:?}: gpt-oss's experts use the clamped SwiGLU (silu)")));
        }
        let mxfp4 = Self::quant(raw.quantization_config.as_ref())?;

        // GptOssConfig's defaults (gpt-oss-120b's sizes).
        let GqaSizes { hidden_size, num_layers, num_heads, num_kv_heads, head_dim } = GqaSizes {
            hidden_size: raw.hidden_size.unwrap_or(2880),
            num_layers: raw.num_hidden_layers.unwrap_or(36),
            num_heads: raw.num_attention_heads.unwrap_or(64),
            num_kv_heads: raw.num_key_value_heads.unwrap_or(8),
            head_dim: raw.head_dim.unwrap_or(64),
        }
        .check()?;
        let intermediate_size = positive("intermediate_size", raw.intermediate_size.unwrap_or(2880))?;
        let num_experts = bounded("num_local_experts", raw.num_local_experts.unwrap_or(128), MAX_COUNT)?;
        // transformers reads `num_experts_per_tok` (default 4) only; the original release's
        // `experts_per_token` (the same number in the hub's files) is never read.
        let top_k = positive("num_experts_per_tok", raw.num_experts_per_tok.unwrap_or(4))?;
        if let Some(e) = raw.experts_per_token.filter(|&e| e != top_k) {
            tracing::warn!(
                "`experts_per_token` is {e} but num_experts_per_tok is {top_k}: transformers reads \
                 num_experts_per_tok only, and so does Strata"
            );
        }
        if top_k > num_experts {
            return Err(invalid("num_experts_per_tok", format!("{top_k} exceeds num_local_experts {num_experts}")));
        }
        if mxfp4 && !(hidden_size.is_multiple_of(32) && intermediate_size.is_multiple_of(32)) {
            return Err(invalid(
                "quantization_config",
                format!(
                    "MXFP4 blocks hold 32 values along the input: hidden_size {hidden_size} and \
                     intermediate_size {intermediate_size} must be multiples of 32"
                ),
            ));
        }
        let vocab_size = positive("vocab_size", raw.vocab_size.unwrap_or(201_088))?;
        elements("vocab_size", "embed_tokens", &[vocab_size, hidden_size])?;
        elements("num_attention_heads", "qkv_proj", &[num_heads + 2 * num_kv_heads, head_dim, hidden_size])?;
        elements("intermediate_size", "gate_up_proj", &[num_experts, 2 * intermediate_size, hidden_size])?;
        let rms_norm_eps = positive_f32("rms_norm_eps", "rms_norm_eps", raw.rms_norm_eps.unwrap_or(1e-5) as f32)?;
        let swiglu_limit = positive_f32("swiglu_limit", "swiglu_limit", raw.swiglu_limit.unwrap_or(7.0) as f32)?;
        let swiglu_alpha = positive_f32("swiglu_alpha", "swiglu_alpha", raw.swiglu_alpha.unwrap_or(1.702) as f32)?;
        let (max_position_embeddings, max_position_default) = match raw.max_position_embeddings {
            Some(n) => (positive("max_position_embeddings", n)?, false),
            None => (131_072, true),
        };
        let sliding_windows = Self::windows(&raw, num_layers)?;
        let (rope_theta, yarn) = Self::parse_rope(&raw, max_position_embeddings)?;
        Ok(GptOssConfig {
            hidden_size,
            num_layers,
            num_heads,
            num_kv_heads,
            head_dim,
            intermediate_size,
            num_experts,
            top_k,
            vocab_size,
            rms_norm_eps,
            attention_bias: raw.attention_bias.unwrap_or(true),
            sliding_windows,
            rope_theta,
            yarn,
            swiglu_limit,
            swiglu_alpha,
            mxfp4,
            max_position_embeddings,
            max_position_default,
            tie_word_embeddings: raw.tie_word_embeddings.unwrap_or(false),
        })
    }

    /// Whether the experts are MXFP4: `quant_method: mxfp4` (whose
    /// `modules_to_not_convert` in every release keeps attention, router,
    /// embeddings and head plain; only the experts are ever converted).
    fn quant(q: Option<&Value>) -> Result<bool, ConfigError> {
        let Some(q) = q.filter(|v| !v.is_null()) else { return Ok(false) };
        match q.get("quant_method").and_then(Value::as_str) {
            Some("mxfp4") => {}
            other => {
                return Err(invalid(
                    "quantization_config",
                    format!(
                        "quant_method {:?} is not supported for gpt_oss (supported: mxfp4, or plain weights)",
                        other.unwrap_or("<none>")
                    ),
                ))
            }
        }
        if q.get("dequantize").and_then(Value::as_bool) == Some(true) {
            return Err(invalid(
                "quantization_config",
                "`dequantize: true` is a loading option, not a storage format; the tensors' format is unknown",
            ));
        }
        Ok(true)
    }

    /// Sliding layers from `layer_types`, or HF's default: even layers
    /// sliding, odd ones full.
    fn windows(raw: &Raw, n: usize) -> Result<Vec<Option<usize>>, ConfigError> {
        let w = raw.sliding_window.unwrap_or(128);
        if w == 0 {
            return Err(invalid("sliding_window", "must be positive"));
        }
        let Some(types) = &raw.layer_types else {
            return Ok((0..n).map(|i| (i % 2 == 0).then_some(w)).collect());
        };
        if types.len() != n {
            return Err(invalid("layer_types", format!("has {} entries for {n} layers", types.len())));
        }
        types
            .iter()
            .map(|t| match super::layer_type(t) {
                "full_attention" => Ok(None),
                "sliding_attention" => Ok(Some(w)),
                _ => Err(invalid(
                    "layer_types",
                    format!("unknown layer type {t:?} (gpt-oss has sliding_attention and full_attention)"),
                )),
            })
            .collect()
    }

    /// `(rope_theta, yarn)`: from transformers 5's `rope_parameters` or the
    /// hub's `rope_theta` and `rope_scaling` (that one when a file has both),
    /// read as `_compute_yarn_parameters` reads them.
    fn parse_rope(raw: &Raw, max_positions: usize) -> Result<(f32, Option<Yarn>), ConfigError> {
        let (params, field) = super::rope_source(raw.rope_parameters.as_ref(), raw.rope_scaling.as_ref());
        let theta_in = match params {
            Some(p) if !p.is_object() => return Err(invalid(field, format!("expected an object, got {p}"))),
            Some(p) => num(p, "rope_theta", field)?,
            None => None,
        };
        let theta = theta_in.or(raw.rope_theta).unwrap_or(150_000.0) as f32;
        positive_f32("rope_theta", "rope_theta", theta)?;
        // No RoPE parameters at all: GptOssConfig's default, the release's YaRN.
        let Some(p) = params else {
            let yarn = Yarn {
                factor: 32.0,
                beta_fast: 32.0,
                beta_slow: 1.0,
                original_max_position_embeddings: 4096.0,
                truncate: false,
                attention_factor: 0.1 * 32f32.ln() + 1.0,
            };
            return Self::yarn_theta(theta).map(|t| (t, Some(yarn)));
        };
        let kind = p.get("rope_type").or_else(|| p.get("type")).and_then(Value::as_str).unwrap_or("default");
        match kind {
            "default" => return Ok((theta, None)),
            "yarn" => Self::yarn_theta(theta)?,
            other => {
                return Err(invalid(
                    field,
                    format!("rope type {other:?} is not supported for gpt_oss (supported: default, yarn)"),
                ))
            }
        };
        // Absent: max_position_embeddings, as standardize_rope_params fills it (null
        // stays an error: transformers divides by it).
        let original = match p.get("original_max_position_embeddings") {
            None => max_positions as f32,
            Some(_) => num(p, "original_max_position_embeddings", field)?
                .ok_or_else(|| invalid(field, "yarn needs `original_max_position_embeddings`"))?
                as f32,
        };
        positive_f32(field, "original_max_position_embeddings", original)?;
        // A null factor is the ratio of the contexts, as `_compute_yarn_parameters` takes it.
        let factor = match p.get("factor") {
            None => return Err(invalid(field, "yarn needs `factor`")),
            Some(Value::Null) => {
                tracing::warn!("`rope_parameters`'s factor field must be a float or int >= 1, got None");
                (max_positions as f64 / original as f64) as f32
            }
            Some(_) => num(p, "factor", field)?.unwrap_or_default() as f32,
        };
        positive_f32(field, "factor", factor)?;
        // `beta_fast or 32`, `beta_slow or 1`: 0 and null take the default; a negative
        // one is refused (transformers' log of it raises).
        let beta = |k: &str, default: f64| -> Result<f32, ConfigError> {
            let v = num(p, k, field)?.filter(|&b| b != 0.0).unwrap_or(default) as f32;
            positive_f32(field, k, v)
        };
        // `mscale` and `mscale_all_dim` (DeepSeek's) count only when both are nonzero.
        let mscale = |k: &str| -> Result<f32, ConfigError> {
            let v = num(p, k, field)?.unwrap_or(0.0) as f32;
            if !(v.is_finite() && v >= 0.0) {
                return Err(invalid(field, format!("`{k}` must be a finite number >= 0, got {v}")));
            }
            Ok(v)
        };
        let (m, m_all) = (mscale("mscale")?, mscale("mscale_all_dim")?);
        let get_mscale = |m: f32| if factor <= 1.0 { 1.0 } else { 0.1 * m * factor.ln() + 1.0 };
        let attention_factor = match num(p, "attention_factor", field)? {
            Some(a) => positive_f32(field, "attention_factor", a as f32)?,
            None if m != 0.0 && m_all != 0.0 => get_mscale(m) / get_mscale(m_all),
            None => get_mscale(1.0),
        };
        let yarn = Yarn {
            factor,
            beta_fast: beta("beta_fast", 32.0)?,
            beta_slow: beta("beta_slow", 1.0)?,
            original_max_position_embeddings: original,
            // `rope_parameters.get("truncate", True)`, tested by its truth value.
            truncate: p.get("truncate").is_none_or(super::truthy),
            attention_factor,
        };
        Ok((theta, Some(yarn)))
    }

    /// YaRN's correction range divides by ln(rope_theta): refused at 1 (where
    /// transformers divides by zero) and below (a reversed range).
    fn yarn_theta(theta: f32) -> Result<f32, ConfigError> {
        if theta <= 1.0 {
            return Err(invalid("rope_theta", format!("yarn needs rope_theta > 1, got {theta}")));
        }
        Ok(theta)
    }

    /// RoPE over the whole head (split-half pairs): inverse frequencies and
    /// the cos/sin magnitude, as transformers' `_compute_yarn_parameters`.
    pub fn rope(&self) -> RopeFreqs {
        let d = self.head_dim;
        let base = self.rope_theta;
        // f32 powers, as torch computes `base ** (arange(0, d, 2) / d)`.
        let pos: Vec<f32> = (0..d / 2).map(|i| base.powf((2 * i) as f32 / d as f32)).collect();
        let Some(y) = self.yarn else {
            return RopeFreqs { inv_freq: pos.iter().map(|p| 1.0 / p).collect(), scale: 1.0 };
        };
        // The dim whose wavelength makes `rot` turns over the original context (f64, as Python's math).
        let corr = |rot: f32| {
            let orig = y.original_max_position_embeddings as f64;
            d as f64 * (orig / (rot as f64 * 2.0 * std::f64::consts::PI)).ln() / (2.0 * (base as f64).ln())
        };
        let (mut low, mut high) = (corr(y.beta_fast), corr(y.beta_slow));
        if y.truncate {
            (low, high) = (low.floor(), high.ceil());
        }
        let (low, mut high) = (low.max(0.0) as f32, high.min(d as f64 - 1.0) as f32);
        if low == high {
            high += 0.001;
        }
        let inv_freq = pos
            .iter()
            .enumerate()
            .map(|(i, p)| {
                let extrapolation = 1.0 - ((i as f32 - low) / (high - low)).clamp(0.0, 1.0);
                let (inter, extra) = (1.0 / (y.factor * p), 1.0 / p);
                inter * (1.0 - extrapolation) + extra * extrapolation
            })
            .collect();
        RopeFreqs { inv_freq, scale: y.attention_factor }
    }

    /// The outer shape.
    pub fn info(&self) -> ArchInfo {
        ArchInfo {
            architecture: "gpt_oss".into(),
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

    const SMALL: &str = r#"{"model_type": "gpt_oss", "hidden_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 64,
        "num_local_experts": 4, "num_experts_per_tok": 2, "vocab_size": 128 KEY}"#;

    fn with(extra: &str) -> Result<GptOssConfig, ConfigError> {
        GptOssConfig::from_json(&SMALL.replace(" KEY", extra))
    }

    #[test]
    fn defaults_are_transformers() {
        let c = with("").unwrap();
        assert_eq!(c.sliding_windows, vec![Some(128), None]);
        assert_eq!((c.rope_theta, c.swiglu_limit, c.swiglu_alpha), (150_000.0, 7.0, 1.702));
        let y = c.yarn.expect("no rope parameters: the release's YaRN, as GptOssConfig's default");
        assert_eq!((y.factor, y.original_max_position_embeddings, y.truncate), (32.0, 4096.0, false));
        let plain = with(r#", "rope_theta": 1000, "rope_scaling": {"rope_type": "default"}"#).unwrap();
        assert_eq!((plain.rope_theta, plain.yarn), (1000.0, None));
        // The legacy "attention" is full_attention.
        let legacy = with(r#", "layer_types": ["attention", "sliding_attention"]"#).unwrap();
        assert_eq!(legacy.sliding_windows, vec![None, Some(128)]);
        assert!(c.attention_bias && !c.mxfp4);
    }

    #[test]
    fn yarn_without_truncation_keeps_fractional_corrections() {
        let yarn = |t: &str| {
            let s = format!(
                r#", "rope_scaling": {{"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                "original_max_position_embeddings": 4096 {t}}}"#
            );
            with(&s).unwrap()
        };
        let (free, cut) = (yarn(r#", "truncate": false"#), yarn(""));
        assert!(!free.yarn.unwrap().truncate && cut.yarn.unwrap().truncate);
        assert!((free.rope().scale - (0.1 * 32f32.ln() + 1.0)).abs() < 1e-7);
        // head_dim 16, theta 150000: low = 2.02…, high = 4.35… (truncated: 2 and 5).
        let (a, b) = (free.rope().inv_freq, cut.rope().inv_freq);
        assert_eq!(a[0], b[0], "dim 0 is extrapolated either way");
        assert_eq!(a[7], b[7], "dim 7 is interpolated either way");
        assert_ne!(a[3], b[3], "a fractional ramp differs from a whole-dim one");
    }

    use crate::hf::close_to as close;

    #[test]
    fn only_num_experts_per_tok_counts_as_in_transformers() {
        // GptOssConfig has no `experts_per_token`: num_experts_per_tok, default 4, whatever it says.
        assert_eq!(with(r#", "experts_per_token": 3"#).unwrap().top_k, 2);
        let alone = SMALL.replace(r#""num_experts_per_tok": 2,"#, r#""experts_per_token": 2,"#).replace(" KEY", "");
        assert_eq!(GptOssConfig::from_json(&alone).unwrap().top_k, 4);
    }

    #[test]
    fn yarn_reads_its_keys_as_transformers_does() {
        // Expected values: transformers 5.25.0, `ROPE_INIT_FUNCTIONS["yarn"](GptOssConfig.from_dict(...))`
        // for SMALL (head_dim 16, base 150000) with the YaRN block below, edited per case.
        let yarn = |edit: &str, extra: &str| {
            let block = format!(
                r#"{{"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                    "original_max_position_embeddings": 4096{edit}}}"#
            );
            with(&format!(r#", "rope_scaling": {block}{extra}"#)).unwrap_or_else(|e| panic!("{edit}: {e}"))
        };
        let truncated = [
            1.0,
            0.22541800141334534,
            0.05081327259540558,
            0.007755465339869261,
            0.0009144543437287211,
            1.818833698052913e-05,
            4.099978468730114e-06,
            9.242089618055616e-07,
        ];
        let mut untruncated = truncated;
        (untruncated[3], untruncated[4]) = (0.006794959306716919, 0.0004564839182421565);
        let reference = yarn("", "").rope();
        close(&reference.inv_freq, &truncated);
        assert!((reference.scale as f64 - 1.3465735902799727).abs() < 1e-6);
        // `beta_fast or 32`, `beta_slow or 1`: zeros take the defaults.
        assert_eq!(yarn(r#", "beta_fast": 0, "beta_slow": 0"#, "").rope(), reference);
        // A null factor is max_position_embeddings / original (65536 / 4096 = 16), with a warning.
        let implicit = yarn(r#", "factor": null"#, r#", "max_position_embeddings": 65536"#);
        assert_eq!(implicit.yarn.unwrap().factor, 16.0);
        let f = implicit.rope();
        let mut want = truncated;
        want[3..].copy_from_slice(&[
            0.007874780334532261,
            0.0009682457894086838,
            3.637667396105826e-05,
            8.199956937460229e-06,
            1.8484179236111231e-06,
        ]);
        close(&f.inv_freq, &want);
        assert!((f.scale as f64 - 1.2772588722239782).abs() < 1e-6, "{}", f.scale);
        // mscale and mscale_all_dim both set: their ratio is the magnitude; mscale alone changes nothing.
        let both = yarn(r#", "mscale": 1.0, "mscale_all_dim": 0.5"#, "").rope();
        close(&both.inv_freq, &truncated);
        assert!((both.scale as f64 - 1.1476934674947155).abs() < 1e-6, "{}", both.scale);
        assert_eq!(yarn(r#", "mscale": 2.0"#, "").rope(), reference);
        // `truncate` by its Python truth: null and 0 are false, a non-empty string true.
        close(&yarn(r#", "truncate": null"#, "").rope().inv_freq, &untruncated);
        close(&yarn(r#", "truncate": 0"#, "").rope().inv_freq, &untruncated);
        close(&yarn(r#", "truncate": "no""#, "").rope().inv_freq, &truncated);
        // No original context: max_position_embeddings (8192 here).
        let absent = SMALL.replace(
            " KEY",
            r#", "max_position_embeddings": 8192,
            "rope_scaling": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0}"#,
        );
        let absent = GptOssConfig::from_json(&absent).unwrap();
        assert_eq!(absent.yarn.unwrap().original_max_position_embeddings, 8192.0);
        close(&absent.rope().inv_freq, &truncated);
        // Plain RoPE takes any positive base, 0.5 too (frequencies above 1).
        let plain = with(r#", "rope_parameters": {"rope_type": "default", "rope_theta": 0.5}"#).unwrap().rope();
        close(
            &plain.inv_freq,
            &[
                1.0,
                1.0905077457427979,
                1.1892070770263672,
                1.2968395948410034,
                1.4142135381698608,
                1.5422108173370361,
                1.6817928552627563,
                1.8340080976486206,
            ],
        );
        assert_eq!(plain.scale, 1.0);
    }

    #[test]
    fn refusals_name_their_field() {
        for (extra, needle) in [
            (r#", "quantization_config": {"quant_method": "fp8"}"#, "quant_method \"fp8\""),
            (r#", "layer_types": ["sliding_attention"]"#, "layer_types"),
            (r#", "layer_types": ["chunked_attention", "full_attention"]"#, "chunked_attention"),
            (r#", "rope_scaling": {"rope_type": "llama3", "factor": 8}"#, "\"llama3\""),
            (r#", "rope_scaling": {"rope_type": "yarn", "factor": 4, "mscale": -1}"#, "`mscale` must be a finite"),
            (r#", "rope_scaling": {"rope_type": "yarn", "factor": 4, "beta_fast": -1}"#, "beta_fast must be"),
            (r#", "rope_scaling": {"rope_type": "yarn", "factor": -4}"#, "factor must be a finite positive"),
            (r#", "rope_scaling": {"rope_type": "yarn"}"#, "yarn needs `factor`"),
            (
                r#", "rope_scaling": {"rope_type": "yarn", "factor": 4, "original_max_position_embeddings": null}"#,
                "yarn needs `original_max_position_embeddings`",
            ),
            (r#", "rope_scaling": {"rope_type": "yarn", "factor": 4, "attention_factor": 0}"#, "attention_factor"),
            (r#", "rope_scaling": {"rope_type": "yarn", "factor": 4, "rope_theta": 1.0}"#, "yarn needs rope_theta > 1"),
            (r#", "hidden_act": "gelu""#, "hidden_act"),
            (r#", "rope_scaling": {"rope_type": "yarn", "factor": 4, "rope_theta": 0.5}"#, "yarn needs rope_theta > 1"),
            // Degenerate values transformers runs (no routed expert, eps 0, clamps at or below 0, no context).
            (r#", "num_experts_per_tok": 0"#, "`num_experts_per_tok`"),
            (r#", "rms_norm_eps": 0"#, "`rms_norm_eps`"),
            (r#", "swiglu_limit": 0"#, "`swiglu_limit`"),
            (r#", "swiglu_alpha": -1"#, "`swiglu_alpha`"),
            (r#", "max_position_embeddings": 0"#, "`max_position_embeddings`"),
            (r#", "num_local_experts": 99999999"#, "`num_local_experts`: 99999999 is implausibly large"),
        ] {
            let e = with(extra).unwrap_err().to_string();
            assert!(e.contains(needle), "{extra}: {e}");
        }
        let e = GptOssConfig::from_json(&SMALL.replace(" KEY", "").replace("64", "48")).unwrap();
        assert_eq!(e.hidden_size, 48, "plain weights take any width");
        let e = GptOssConfig::from_json(
            &SMALL.replace(" KEY", r#", "quantization_config": {"quant_method": "mxfp4"}"#).replace("64", "48"),
        )
        .unwrap_err();
        assert!(e.to_string().contains("multiples of 32"), "{e}");
    }
}
