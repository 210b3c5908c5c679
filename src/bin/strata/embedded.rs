//! The default model and data of `strata extract`, compiled into the binary so
//! the first run needs no download. It is the `llama-default` parity fixture:
//! a random-weight 8-layer Llama in bf16 whose outputs are checked against HF.
//! The library never sees it: it is the binary's business.

/// `config.json` of the embedded model.
pub const CONFIG_JSON: &str = include_str!("../../../tests/fixtures/llama-default/config.json");
/// Its weights.
pub static MODEL_SAFETENSORS: &[u8] = include_bytes!("../../../tests/fixtures/llama-default/model.safetensors");
/// Sample data, JSON Lines.
pub const DATA_JSONL: &str = include_str!("../../../tests/fixtures/llama-default/data.jsonl");
/// How messages name the embedded model.
pub const NAME: &str = "<embedded llama-default>";

/// How messages name the embedded data.
pub const DATA_NAME: &str = "<embedded data>";

/// The embedded model as a job's model source.
pub fn source() -> strata::job::ModelSource {
    strata::job::ModelSource::Static { name: NAME, config_json: CONFIG_JSON, weights: MODEL_SAFETENSORS }
}
