//! Hugging Face checkpoints: safetensors weights ([`checkpoint`]), one
//! normalised `config.json` per architecture family (a module per row of
//! the family table, `crate::families`: [`llama`], [`deepseek`], ...), and
//! the quantisation schemes weights may be stored in ([`quant`]).
//!
//! Everything here is host-side parsing and checking; nothing runs a model.

pub mod checkpoint;
pub mod hub;
pub mod moe;
pub mod quant;
pub mod rope;

pub use checkpoint::{Checkpoint, CheckpointError};

/// From the family table: each family's config module and its config type,
/// and every `model_type` the table names.
macro_rules! config_modules {
    ([] $($(#[$attr:meta])* $variant:ident $module:ident $config:ident $tp:ident $doc:literal [$($model_type:literal),+]
        $(in ($hf_path:literal, $model_path:literal))?;)+) => {
        $(
            $(#[$attr])*
            $(#[path = $hf_path])?
            pub mod $module;
            $(#[$attr])*
            pub use $module::$config;
        )+
        /// Every `model_type` Strata runs, in the family table's order.
        pub fn model_types() -> &'static [&'static str] {
            // Built by statements, not an array literal: a row's attributes
            // (`#[cfg]`) may take its strings out, and an array's elements take none.
            static ALL: std::sync::LazyLock<Vec<&'static str>> = std::sync::LazyLock::new(|| {
                let mut all = Vec::new();
                $(
                    $(#[$attr])*
                    all.extend([$($model_type),+]);
                )+
                all
            });
            &ALL
        }
    };
}
crate::families::families!(config_modules);

/// Why a `config.json` cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file cannot be read.
    #[error("cannot read {path}: {cause}")]
    Io {
        /// The file.
        path: String,
        /// The OS error.
        cause: std::io::Error,
    },
    /// Not JSON, or a field of the wrong JSON type.
    #[error("malformed config.json: {0}")]
    Json(#[from] serde_json::Error),
    /// A `model_type` Strata does not run.
    #[error("unsupported model_type {0:?} (supported: {supported})", supported = model_types().join(", "))]
    UnsupportedModel(String),
    /// A field the architecture needs is absent.
    #[error("config.json lacks required field `{0}`")]
    Missing(&'static str),
    /// A field with a value Strata cannot run.
    #[error("config.json field `{field}`: {problem}")]
    Invalid {
        /// The field.
        field: &'static str,
        /// What is wrong with it.
        problem: String,
    },
}

/// A field with a value Strata cannot run, and why.
pub(crate) fn invalid(field: &'static str, problem: impl Into<String>) -> ConfigError {
    ConfigError::Invalid { field, problem: problem.into() }
}

/// What every architecture's config says about the model's outer shape.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ArchInfo {
    /// `model_type`.
    pub architecture: String,
    /// Decoder layers.
    pub num_layers: usize,
    /// Residual width.
    pub hidden_size: usize,
    /// Vocabulary size.
    pub vocab_size: usize,
    /// Longest sequence.
    pub max_position_embeddings: usize,
    /// `max_position_embeddings` is HF's default for the architecture:
    /// config.json has no such field.
    pub max_position_default: bool,
    /// Some layers keep a recurrent state (Gated DeltaNet), which a cache
    /// cannot cut back to an earlier position as it can keys and values.
    pub recurrent: bool,
}

/// Largest `config.json` (or shard index) read: real ones are kilobytes to a
/// few megabytes, and a bound keeps a hostile file from filling memory.
pub const MAX_JSON_BYTES: u64 = 64 << 20;

/// Most decoder layers a config may declare. Far above any real model, and
/// low enough that a per-layer table built from config.json alone stays small.
pub const MAX_LAYERS: usize = 1 << 16;

/// Most routed experts, heads or per-head dims a config may declare: far
/// above any real model (hundreds of experts, head dims of a few hundred).
pub const MAX_COUNT: usize = 1 << 16;

/// Reads a `config.json`: a regular file (a FIFO or device is refused
/// instead of blocking) of at most [`MAX_JSON_BYTES`].
pub fn read_config(path: &std::path::Path) -> Result<String, ConfigError> {
    crate::files::read_text(path, MAX_JSON_BYTES)
        .map_err(|cause| ConfigError::Io { path: path.display().to_string(), cause })
}

/// A key that is present, null or not (`Some(None)` for null), apart from an
/// absent one (`None`): `#[serde(default, deserialize_with = "present")]`.
pub(crate) fn present<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<Option<usize>>, D::Error> {
    <Option<usize> as serde::Deserialize>::deserialize(d).map(Some)
}

/// Refuses a size that is zero.
pub(crate) fn positive(field: &'static str, v: usize) -> Result<usize, ConfigError> {
    if v == 0 {
        return Err(ConfigError::Invalid { field, problem: "must be positive".into() });
    }
    Ok(v)
}

/// Refuses a size that is zero or above `max` (absurd for any real model).
pub(crate) fn bounded(field: &'static str, v: usize, max: usize) -> Result<usize, ConfigError> {
    positive(field, v)?;
    if v > max {
        return Err(ConfigError::Invalid {
            field,
            problem: format!("{v} is implausibly large (Strata accepts at most {max})"),
        });
    }
    Ok(v)
}

/// Refuses a float the model can only turn into NaN or infinity: non-finite
/// (an f64 that overflowed f32 included), or not above zero.
pub(crate) fn positive_f32(field: &'static str, what: &str, v: f32) -> Result<f32, ConfigError> {
    if !v.is_finite() || v <= 0.0 {
        return Err(ConfigError::Invalid {
            field,
            problem: format!("{what} must be a finite positive number, got {v}"),
        });
    }
    Ok(v)
}

/// Layers a per-layer list names past the model's last, which transformers
/// never looks up (`layer_idx in list`): ignored, with a warning.
pub(crate) fn warn_past_the_last(field: &str, list: &[usize], n: usize) {
    let past: Vec<usize> = list.iter().copied().filter(|&l| l >= n).collect();
    if !past.is_empty() {
        tracing::warn!(
            "`{field}` names layers {past:?} of a {n}-layer model; they are ignored, as transformers ignores them"
        );
    }
}

/// Python's truth value of a JSON value: how transformers reads a key it tests
/// with `if value:` or `value or default` (null, false, 0, "", [] and {} are false).
pub(crate) fn truthy(v: &serde_json::Value) -> bool {
    use serde_json::Value;
    match v {
        Value::Null => false,
        Value::Bool(b) => *b,
        Value::Number(n) => n.as_f64().is_some_and(|x| x != 0.0),
        Value::String(s) => !s.is_empty(),
        Value::Array(a) => !a.is_empty(),
        Value::Object(o) => !o.is_empty(),
    }
}

/// The RoPE parameters transformers reads from a config that may carry
/// `rope_parameters` (transformers 5), `rope_scaling` (the hub's older files)
/// or both, and the key they came from: `rope_scaling or rope_parameters`, as
/// `convert_rope_params_to_dict` does, so a truthy `rope_scaling` wins and the
/// other is never read.
pub(crate) fn rope_source<'a>(
    rope_parameters: Option<&'a serde_json::Value>,
    rope_scaling: Option<&'a serde_json::Value>,
) -> (Option<&'a serde_json::Value>, &'static str) {
    let parameters = rope_parameters.filter(|p| !p.is_null());
    match rope_scaling.filter(|s| truthy(s)) {
        Some(scaling) => {
            if parameters.is_some() {
                tracing::warn!(
                    "config.json has both `rope_scaling` and `rope_parameters`: `rope_scaling` is read, as \
                     transformers reads it, and `rope_parameters` is ignored"
                );
            }
            (Some(scaling), "rope_scaling")
        }
        None => (parameters, "rope_parameters"),
    }
}

/// A `layer_types` entry under transformers' names: the legacy `"attention"`
/// and `"mamba"` are read as `full_attention` and `linear_attention`
/// (`_LEGACY_LAYER_TYPE_REMAP`, applied to every config as it loads).
pub(crate) fn layer_type(name: &str) -> &str {
    match name {
        "attention" => "full_attention",
        "mamba" => "linear_attention",
        other => other,
    }
}

/// A JSON number as Python prints it (`1`, `1.0`, `1e-05`), so that a warning
/// transformers also logs reads the same, word for word.
pub(crate) fn py_repr(v: &serde_json::Value) -> String {
    match v {
        serde_json::Value::Number(n) if n.is_f64() => py_float(n.as_f64().unwrap_or(f64::NAN)),
        serde_json::Value::Null => "None".into(),
        other => other.to_string(),
    }
}

/// Python's `repr` of a float: the shortest digits that round-trip, positional
/// for exponents in [-4, 16), else `d.ddde±XX`.
fn py_float(x: f64) -> String {
    if !x.is_finite() {
        return if x.is_nan() {
            "nan".into()
        } else if x > 0.0 {
            "inf".into()
        } else {
            "-inf".into()
        };
    }
    let sci = format!("{x:e}");
    let (mantissa, exp) = sci.split_once('e').unwrap_or((&sci, "0"));
    let exp: i32 = exp.parse().unwrap_or(0);
    if (-4..16).contains(&exp) {
        let s = x.to_string();
        if s.contains('.') {
            s
        } else {
            s + ".0"
        }
    } else {
        format!("{mantissa}e{}{:02}", if exp < 0 { '-' } else { '+' }, exp.abs())
    }
}

/// The elements of a weight of shape `dims`, refusing shapes whose f32 bytes
/// overflow: sizes multiply only through here, so no product can wrap.
pub(crate) fn elements(field: &'static str, what: &str, dims: &[usize]) -> Result<usize, ConfigError> {
    dims.iter()
        .try_fold(1usize, |acc, &d| acc.checked_mul(d))
        .filter(|&n| n.checked_mul(4).is_some_and(|b| b <= isize::MAX as usize))
        .ok_or_else(|| ConfigError::Invalid {
            field,
            problem: format!("makes {what} {dims:?} larger than memory can address"),
        })
}

/// A GQA decoder's outer sizes, checked: each positive and bounded, the kv
/// heads dividing the query heads, an even head width (RoPE rotates pairs).
#[derive(Clone, Copy, Debug)]
pub(crate) struct GqaSizes {
    pub hidden_size: usize,
    pub num_layers: usize,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
}

impl GqaSizes {
    /// Checks the sizes a config gives (its class's defaults already taken).
    pub(crate) fn check(self) -> Result<Self, ConfigError> {
        positive("hidden_size", self.hidden_size)?;
        bounded("num_hidden_layers", self.num_layers, MAX_LAYERS)?;
        let (heads, kv) = (self.num_heads, self.num_kv_heads);
        bounded("num_attention_heads", heads, MAX_COUNT)?;
        bounded("num_key_value_heads", kv, MAX_COUNT)?;
        if heads % kv != 0 {
            let problem = format!("{kv} does not divide num_attention_heads {heads}");
            return Err(ConfigError::Invalid { field: "num_key_value_heads", problem });
        }
        let hd = bounded("head_dim", self.head_dim, MAX_COUNT)?;
        if hd % 2 != 0 {
            return Err(ConfigError::Invalid {
                field: "head_dim",
                problem: format!("must be even for RoPE, got {hd}"),
            });
        }
        Ok(self)
    }
}

/// The text model's part of a `config.json` that holds either a text model
/// alone (`model_type` is `text_type`) or a multimodal wrapper of one
/// (`wrapper_type`, the text model in `text_config`, its tensors under
/// `language_model.`; the vision model is not read).
pub(crate) struct TextModel {
    /// `model_type`: `text_type` or `wrapper_type`.
    pub model_type: String,
    /// The text model's keys: the file itself, or the wrapper's `text_config`.
    pub config: serde_json::Value,
    /// The text model's tensor prefix: empty, or `language_model.`.
    pub tensor_prefix: String,
    /// `quantization_config`: the wrapper's at the top, or the text model's own.
    pub quantization: Option<serde_json::Value>,
    /// `tie_word_embeddings` as transformers reads it: the wrapper's own key
    /// (its `ForConditionalGeneration` ties through the top config), or else
    /// the text model's; `None` where neither says (the family's default).
    pub tie_word_embeddings: Option<bool>,
}

impl TextModel {
    /// Splits `text` as `model_type` says; a `text_config` naming another
    /// `model_type` than `text_type` is refused.
    pub(crate) fn of(text: &str, text_type: &str, wrapper_type: &str) -> Result<Self, ConfigError> {
        use serde_json::Value;
        let top: Value = serde_json::from_str(text)?;
        let model_type = top.get("model_type").and_then(Value::as_str).ok_or(ConfigError::Missing("model_type"))?;
        let (config, tensor_prefix) = if model_type == text_type {
            (top.clone(), String::new())
        } else if model_type == wrapper_type {
            let tc = top.get("text_config").filter(|v| !v.is_null()).ok_or(ConfigError::Missing("text_config"))?;
            if !tc.is_object() {
                let problem = format!("expected an object, got {tc}");
                return Err(ConfigError::Invalid { field: "text_config", problem });
            }
            (tc.clone(), "language_model.".to_string())
        } else {
            return Err(ConfigError::UnsupportedModel(model_type.into()));
        };
        if let Some(t) = config.get("model_type").and_then(Value::as_str).filter(|t| *t != text_type) {
            let problem = format!("the text model of {wrapper_type} is {text_type}, not {t:?}");
            return Err(ConfigError::Invalid { field: "model_type", problem });
        }
        let quantization =
            top.get("quantization_config").or(config.get("quantization_config")).filter(|v| !v.is_null()).cloned();
        let tie_word_embeddings = tie_word_embeddings(&top, &config)?;
        Ok(TextModel { model_type: model_type.to_string(), config, tensor_prefix, quantization, tie_word_embeddings })
    }
}

/// `tie_word_embeddings` of a config's top level, or else of its text model
/// (`text` may be `top` itself); `None` where neither holds a bool.
pub(crate) fn tie_word_embeddings(
    top: &serde_json::Value,
    text: &serde_json::Value,
) -> Result<Option<bool>, ConfigError> {
    let key = "tie_word_embeddings";
    match [top.get(key), text.get(key)].into_iter().flatten().find(|v| !v.is_null()) {
        None => Ok(None),
        Some(v) => v.as_bool().map(Some).ok_or_else(|| invalid(key, format!("expected true or false, got {v}"))),
    }
}

/// The rotary embedding of one architecture: inverse frequencies of the
/// rotated dim pairs (after linear, llama3 or YaRN scaling) and the factor
/// cos/sin are multiplied by (YaRN's `mscale`; 1 otherwise).
#[derive(Clone, Debug, PartialEq)]
pub struct RopeFreqs {
    /// One per rotated pair.
    pub inv_freq: Vec<f32>,
    /// cos/sin magnitude.
    pub scale: f32,
}

/// Tests: `got` is `want` (transformers' values, f64) within a relative 1e-6.
#[cfg(test)]
pub(crate) fn close_to(got: &[f32], want: &[f64]) {
    assert_eq!(got.len(), want.len());
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        assert!((g as f64 - w).abs() <= 1e-6 * w.abs(), "[{i}]: {g:e}, want {w:e}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_supported_list_is_the_family_tables_in_its_order() {
        // The text before the family table (kept byte for byte: users and tests read it); a row
        // added at the table's end adds its names after these.
        let e = ConfigError::UnsupportedModel("gpt2".into()).to_string();
        let before = "unsupported model_type \"gpt2\" (supported: llama, mistral, qwen2, qwen3, qwen3_moe, mixtral, \
                      glm4_moe, minimax_m2, gemma3, gemma3_text, gpt_oss, llama4, llama4_text, qwen3_next, qwen3_5, \
                      qwen3_5_text, qwen3_5_moe, qwen3_5_moe_text, deepseek_v2, deepseek_v3, kimi_k2, kimi_k25";
        assert!(e.starts_with(before) && e.ends_with(')'), "{e}");
        let mut seen = std::collections::HashSet::new();
        assert!(model_types().iter().all(|t| seen.insert(t)), "a model_type in two rows: {:?}", model_types());
    }

    #[test]
    fn numbers_print_as_python_prints_them() {
        // What `repr` gives in Python for each (checked with CPython 3.11).
        for (json, python) in [
            ("1", "1"),
            ("1.0", "1.0"),
            ("4.0", "4.0"),
            ("0.5", "0.5"),
            ("-1.0", "-1.0"),
            ("1e-5", "1e-05"),
            ("0.0001", "0.0001"),
            ("1e16", "1e+16"),
            ("1.5e16", "1.5e+16"),
            ("123456789012345.0", "123456789012345.0"),
            ("8192", "8192"),
            ("null", "None"),
        ] {
            let v: serde_json::Value = serde_json::from_str(json).unwrap();
            assert_eq!(py_repr(&v), python, "{json}");
        }
    }
}
