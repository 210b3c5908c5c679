//! RoPE in `config.json`: one parameters object (`rope_scaling`, or
//! transformers 5's `rope_parameters`) parsed into a theta and a scaling, and
//! the inverse frequencies they give. Every family's config reads its RoPE
//! here; refusals name the field.

use super::{invalid, positive_f32, py_repr, ConfigError};
use serde_json::Value;

/// Rotary embedding frequency scaling.
#[derive(Clone, Debug, PartialEq)]
pub enum RopeScaling {
    /// Plain RoPE.
    None,
    /// Position interpolation: frequencies divided by `factor`.
    Linear {
        /// Divisor.
        factor: f32,
    },
    /// Llama 3.x wavelength-dependent scaling.
    Llama3 {
        /// Divisor for low frequencies.
        factor: f32,
        /// Low-frequency threshold factor.
        low_freq_factor: f32,
        /// High-frequency threshold factor.
        high_freq_factor: f32,
        /// Context length the model was pre-trained with.
        original_max_position_embeddings: f32,
    },
}

fn num(obj: &Value, key: &'static str, field: &'static str) -> Result<Option<f32>, ConfigError> {
    match obj.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => v
            .as_f64()
            .map(|f| Some(f as f32))
            .ok_or_else(|| invalid(field, format!("`{key}` must be a number, got {v}"))),
    }
}

/// `(rope_theta, scaling)` of one RoPE parameters object (`None`: plain RoPE,
/// theta unsaid). llama3's `original_max_position_embeddings` defaults to
/// `max_position_embeddings`, as transformers' `standardize_rope_params` fills it.
pub(crate) fn parse_rope(
    params: Option<&Value>,
    field: &'static str,
    max_position_embeddings: usize,
) -> Result<(Option<f32>, RopeScaling), ConfigError> {
    let Some(p) = params.filter(|v| !v.is_null()) else {
        return Ok((None, RopeScaling::None));
    };
    if !p.is_object() {
        return Err(invalid(field, format!("expected an object, got {p}")));
    }
    let theta = num(p, "rope_theta", field)?;
    let kind = p.get("rope_type").or_else(|| p.get("type")).and_then(Value::as_str).unwrap_or("default");
    let need = |key: &'static str| {
        num(p, key, field)?.ok_or_else(|| invalid(field, format!("rope type {kind:?} needs `{key}`")))
    };
    let scaling = match kind {
        "default" => RopeScaling::None,
        "linear" => RopeScaling::Linear { factor: need("factor")? },
        "llama3" => RopeScaling::Llama3 {
            factor: need("factor")?,
            low_freq_factor: need("low_freq_factor")?,
            high_freq_factor: need("high_freq_factor")?,
            // Absent: the model's context (null stays an error, as transformers' division by None).
            original_max_position_embeddings: match p.get("original_max_position_embeddings") {
                None => max_position_embeddings as f32,
                Some(_) => need("original_max_position_embeddings")?,
            },
        },
        other => {
            return Err(invalid(
                field,
                format!(
                    "rope type {other:?} is not supported for this architecture (supported: default, linear, llama3)"
                ),
            ))
        }
    };
    // Anything else turns every frequency into NaN or infinity.
    match scaling {
        RopeScaling::None => {}
        RopeScaling::Linear { factor } => {
            positive_f32(field, "`factor`", factor)?;
        }
        RopeScaling::Llama3 { factor, low_freq_factor, high_freq_factor, original_max_position_embeddings } => {
            positive_f32(field, "`factor`", factor)?;
            positive_f32(field, "`low_freq_factor`", low_freq_factor)?;
            positive_f32(field, "`high_freq_factor`", high_freq_factor)?;
            positive_f32(field, "`original_max_position_embeddings`", original_max_position_embeddings)?;
            // transformers accepts this (Llama 4 Scout ships 1.0 and 1.0) with this warning:
            // no frequency then lies between the two wavelengths, and `inv_freq` never
            // evaluates the smoothing, which divides by their difference.
            if high_freq_factor <= low_freq_factor {
                let (high, low) = (py_repr(&p["high_freq_factor"]), py_repr(&p["low_freq_factor"]));
                tracing::warn!(
                    "`rope_parameters`'s high_freq_factor field must be greater than low_freq_factor, \
                     got high_freq_factor={high} and low_freq_factor={low}"
                );
            }
            // transformers' other warning on these values (a filled-in context included).
            if original_max_position_embeddings >= max_position_embeddings as f32 {
                let original =
                    p.get("original_max_position_embeddings").map_or(max_position_embeddings.to_string(), py_repr);
                tracing::warn!(
                    "`rope_parameters`'s original_max_position_embeddings field must be less than \
                     max_position_embeddings, got {original} and max_position_embeddings={max_position_embeddings}"
                );
            }
        }
    }
    Ok((theta, scaling))
}

/// RoPE's inverse frequencies of `d` rotated columns at base `theta`, after
/// linear or llama3 scaling (the Llama family's, and Gemma 3's).
pub(crate) fn inv_freq(theta: f32, d: usize, scaling: &RopeScaling) -> Vec<f32> {
    let base: Vec<f32> = (0..d / 2).map(|i| 1.0 / theta.powf((2 * i) as f32 / d as f32)).collect();
    match *scaling {
        RopeScaling::None => base,
        RopeScaling::Linear { factor } => base.into_iter().map(|f| f / factor).collect(),
        RopeScaling::Llama3 { factor, low_freq_factor, high_freq_factor, original_max_position_embeddings: old } => {
            let low_wavelen = old / low_freq_factor;
            let high_wavelen = old / high_freq_factor;
            base.into_iter()
                .map(|f| {
                    let wavelen = 2.0 * std::f32::consts::PI / f;
                    // transformers' order: divided past the low-frequency wavelength, kept
                    // below the high one, smoothed between, a band that is empty unless
                    // high_freq_factor > low_freq_factor (and whose smoothing divides by
                    // their difference, so it is not evaluated otherwise).
                    if wavelen > low_wavelen {
                        f / factor
                    } else if high_freq_factor <= low_freq_factor || wavelen < high_wavelen {
                        f
                    } else {
                        let smooth = (old / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor);
                        (1.0 - smooth) * f / factor + smooth * f
                    }
                })
                .collect()
        }
    }
}
