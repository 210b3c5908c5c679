//! The test family's `config.json` (`model_type` `strata_test_scaled`): a
//! Llama's, read by the Llama family's parser, and Granite's
//! `residual_multiplier`. A module of `hf` built only with the
//! `test-family` feature (the crate's tests turn it on), declared by its row
//! of the family table, `crate::families`.

use super::{invalid, ArchInfo, ConfigError, LlamaConfig};
use serde::Deserialize;
use serde_json::{Map, Value};

/// The `model_type` that chooses the test family.
pub const MODEL_TYPE: &str = "strata_test_scaled";

/// A Llama with a factor on each residual update, normalised.
#[derive(Clone, Debug, PartialEq)]
pub struct ScaledLlamaConfig {
    /// Everything but the factor, as the same file read as a `llama` says it.
    pub llama: LlamaConfig,
    /// `s` of `x + s·self_attn(norm(x))` and `x + s·mlp(norm(x))`; 1 when absent, as Granite's.
    pub residual_multiplier: f32,
}

#[derive(Deserialize)]
struct Raw {
    model_type: Option<String>,
    residual_multiplier: Option<f64>,
}

impl ScaledLlamaConfig {
    /// Parses and normalises `config.json` text.
    pub fn from_json(text: &str) -> Result<Self, ConfigError> {
        // An object (an array would also fill `Raw`'s fields in order).
        let mut json: Map<String, Value> = serde_json::from_str(text)?;
        let raw: Raw = serde_json::from_str(text)?;
        match raw.model_type.as_deref() {
            Some(MODEL_TYPE) => {}
            Some(other) => return Err(ConfigError::UnsupportedModel(other.into())),
            None => return Err(ConfigError::Missing("model_type")),
        }
        // The rest is a Llama's: the Llama parser reads it under Llama's
        // model_type (Llama's defaults, Llama's refusals), unchanged.
        json.insert("model_type".into(), Value::from("llama"));
        let llama = LlamaConfig::from_json(&Value::Object(json).to_string())?;
        // An f64 past f32's range is infinite here, and refused with the rest.
        let s = raw.residual_multiplier.unwrap_or(1.0) as f32;
        if !s.is_finite() {
            return Err(invalid("residual_multiplier", format!("must be a finite number, got {s}")));
        }
        Ok(ScaledLlamaConfig { llama, residual_multiplier: s })
    }

    /// The outer shape: the Llama's, under this family's `model_type`.
    pub fn info(&self) -> ArchInfo {
        ArchInfo { architecture: MODEL_TYPE.into(), ..self.llama.info() }
    }
}
