//! A checkpoint's `generation_config.json` read as vLLM 0.19.1's
//! `--generation-config auto` reads it (`get_diff_sampling_param`): the
//! sampling defaults `repetition_penalty`, `temperature`, `top_k`, `top_p`,
//! `min_p`, and `max_new_tokens` as the default `max_tokens`; each only
//! where it differs from transformers' `GenerationConfig` default (vLLM
//! takes `to_diff_dict()`, so `top_k: 50` there leaves vLLM's 0, off).
//! `eos_token_id` (an int or a list) gives stop ids. Without the file, vLLM
//! falls back to transformers' `GenerationConfig.from_model_config`: the
//! model's `config.json` `eos_token_id` (its text model's in a wrapper).

use serde_json::Value;
use std::path::Path;

/// What `generation_config.json` sets, each `None` where it does not.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct GenerationDefaults {
    /// `temperature`.
    pub temperature: Option<f32>,
    /// `top_k`.
    pub top_k: Option<i64>,
    /// `top_p`.
    pub top_p: Option<f32>,
    /// `min_p`.
    pub min_p: Option<f32>,
    /// `repetition_penalty`.
    pub repetition_penalty: Option<f32>,
    /// `max_new_tokens`: the default `max_tokens`.
    pub max_tokens: Option<usize>,
    /// `eos_token_id`, an int or a list: stop ids.
    pub eos_token_ids: Vec<u32>,
}

/// A `generation_config.json` that cannot be read as one.
#[derive(Debug, thiserror::Error)]
#[error("{path}: {problem}")]
pub struct GenerationConfigError {
    /// The file.
    pub path: String,
    /// What is wrong.
    pub problem: String,
}

/// transformers' `GenerationConfig` defaults of the keys vLLM reads: a file's
/// value equal to one of these is not in `to_diff_dict()`, so vLLM ignores it.
const HF_DEFAULTS: [(&str, f64); 4] =
    [("temperature", 1.0), ("top_k", 50.0), ("top_p", 1.0), ("repetition_penalty", 1.0)];

/// The sampling fields a job or a request gives, each `None` where it does not.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct AskedSampling {
    /// `temperature`.
    pub temperature: Option<f32>,
    /// `top_k` (0 or -1: off).
    pub top_k: Option<i64>,
    /// `top_p`.
    pub top_p: Option<f32>,
    /// `min_p`.
    pub min_p: Option<f32>,
    /// `repetition_penalty`.
    pub repetition_penalty: Option<f32>,
    /// `presence_penalty`.
    pub presence_penalty: Option<f32>,
    /// `frequency_penalty`.
    pub frequency_penalty: Option<f32>,
}

impl GenerationDefaults {
    /// The sampling parameters of `asked`, each over this file's default
    /// and then vLLM's, checked as vLLM checks them; `true` where a
    /// temperature in (0, 0.01) was raised to 0.01.
    pub fn params(&self, asked: &AskedSampling) -> Result<(super::SamplingParams, bool), super::SamplingError> {
        let params = super::SamplingParams {
            temperature: asked.temperature.or(self.temperature).unwrap_or(1.0),
            top_k: None,
            top_p: asked.top_p.or(self.top_p).unwrap_or(1.0),
            min_p: asked.min_p.or(self.min_p).unwrap_or(0.0),
            repetition_penalty: asked.repetition_penalty.or(self.repetition_penalty).unwrap_or(1.0),
            presence_penalty: asked.presence_penalty.unwrap_or(0.0),
            frequency_penalty: asked.frequency_penalty.unwrap_or(0.0),
        };
        params.checked(asked.top_k.or(self.top_k).unwrap_or(0))
    }

    /// `DIR/generation_config.json`; without it, the stop ids of `config`
    /// (the model's `config.json` text) and no sampling defaults.
    pub fn read(dir: &Path, config: &str) -> Result<Self, GenerationConfigError> {
        let path = dir.join("generation_config.json");
        if !crate::files::is_regular(&path).unwrap_or(false) {
            return Self::from_model_config(config).map_err(|problem| GenerationConfigError {
                path: dir.join("config.json").display().to_string(),
                problem,
            });
        }
        let err = |problem: String| GenerationConfigError { path: path.display().to_string(), problem };
        let text = crate::files::read_text(&path, crate::hf::MAX_JSON_BYTES).map_err(|e| err(e.to_string()))?;
        Self::parse(&text).map_err(err)
    }

    /// What `GenerationConfig.from_model_config` takes of a `config.json`
    /// that vLLM reads: its `eos_token_id` (the text model's in a wrapper).
    pub fn from_model_config(text: &str) -> Result<Self, String> {
        let v: Value = serde_json::from_str(text).map_err(|e| e.to_string())?;
        let eos = v.get("eos_token_id").filter(|e| !e.is_null()).or_else(|| v.get("text_config")?.get("eos_token_id"));
        Ok(GenerationDefaults { eos_token_ids: eos_ids(eos)?, ..Default::default() })
    }

    /// Parses the file's text.
    pub fn parse(text: &str) -> Result<Self, String> {
        let v: Value = serde_json::from_str(text).map_err(|e| e.to_string())?;
        let num = |key: &str| -> Result<Option<f64>, String> {
            match v.get(key) {
                None | Some(Value::Null) => Ok(None),
                Some(x) => {
                    let x = x.as_f64().ok_or_else(|| format!("{key} must be a number, got {x}"))?;
                    let default = HF_DEFAULTS.iter().find(|(k, _)| *k == key).map(|d| d.1);
                    Ok((default != Some(x)).then_some(x))
                }
            }
        };
        let int = |key: &str| -> Result<Option<i64>, String> {
            match num(key)? {
                Some(x) if x.fract() != 0.0 => Err(format!("{key} must be an integer, got {x}")),
                x => Ok(x.map(|x| x as i64)),
            }
        };
        let eos_token_ids = eos_ids(v.get("eos_token_id"))?;
        let max_tokens = match int("max_new_tokens")? {
            Some(n) if n < 1 => return Err(format!("max_new_tokens must be at least 1, got {n}")),
            n => n.map(|n| n as usize),
        };
        Ok(GenerationDefaults {
            temperature: num("temperature")?.map(|x| x as f32),
            top_k: int("top_k")?,
            top_p: num("top_p")?.map(|x| x as f32),
            min_p: num("min_p")?.map(|x| x as f32),
            repetition_penalty: num("repetition_penalty")?.map(|x| x as f32),
            max_tokens,
            eos_token_ids,
        })
    }
}

/// An `eos_token_id`: an int, a list of them, or none.
fn eos_ids(v: Option<&Value>) -> Result<Vec<u32>, String> {
    match v {
        None | Some(Value::Null) => Ok(Vec::new()),
        Some(Value::Array(list)) => list.iter().map(token_id).collect(),
        Some(x) => Ok(vec![token_id(x)?]),
    }
}

fn token_id(v: &Value) -> Result<u32, String> {
    v.as_u64().and_then(|x| u32::try_from(x).ok()).ok_or_else(|| format!("eos_token_id holds {v}, not a token id"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn values_equal_to_transformers_defaults_are_not_taken() {
        let d = GenerationDefaults::parse(
            r#"{"do_sample": true, "temperature": 0.6, "top_k": 50, "top_p": 0.95, "eos_token_id": [1, 106],
                "max_new_tokens": 300, "repetition_penalty": 1.0, "min_p": 0.05}"#,
        )
        .unwrap();
        assert_eq!(d.temperature, Some(0.6));
        assert_eq!(d.top_k, None, "vLLM's to_diff_dict drops HF's default top_k 50");
        assert_eq!(d.top_p, Some(0.95));
        assert_eq!(d.repetition_penalty, None);
        assert_eq!(d.min_p, Some(0.05));
        assert_eq!(d.max_tokens, Some(300));
        assert_eq!(d.eos_token_ids, vec![1, 106]);
        let d = GenerationDefaults::parse(r#"{"eos_token_id": 2, "top_k": 20}"#).unwrap();
        assert_eq!((d.eos_token_ids, d.top_k, d.temperature), (vec![2], Some(20), None));
    }

    #[test]
    fn without_the_file_the_model_configs_eos_ids_stop() {
        let d =
            GenerationDefaults::from_model_config(r#"{"eos_token_id": [128001, 128008, 128009], "temperature": 0.5}"#)
                .unwrap();
        assert_eq!(d, GenerationDefaults { eos_token_ids: vec![128001, 128008, 128009], ..Default::default() });
        let wrapped = GenerationDefaults::from_model_config(r#"{"text_config": {"eos_token_id": 1}}"#).unwrap();
        assert_eq!(wrapped.eos_token_ids, vec![1]);
    }

    #[test]
    fn bad_values_are_named() {
        for (text, want) in [
            (r#"{"eos_token_id": "x"}"#, "eos_token_id holds"),
            (r#"{"top_k": 2.5}"#, "top_k must be an integer"),
            (r#"{"temperature": "hot"}"#, "temperature must be a number"),
            (r#"{"max_new_tokens": 0}"#, "max_new_tokens must be at least 1"),
        ] {
            let e = GenerationDefaults::parse(text).unwrap_err();
            assert!(e.contains(want), "{text}: {e}");
        }
    }
}
