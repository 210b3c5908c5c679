//! The one table of architecture families, as vLLM's `registry.py` is for
//! vLLM: each family is one row, and every list of families is generated
//! from the rows. `hf` makes its config modules, their re-exports and the
//! supported list of `ConfigError::UnsupportedModel` from them; `model` its
//! decoder modules, the model aliases (`Llama<H, B>`, `TpLlama<H, TP, B>`)
//! and their re-exports; `model::any` the `AnyConfig` enum, parsing by
//! `model_type` and `dispatch!`.
//!
//! A row reads `Variant module Config TpAlias "doc" ["model_type", ...];`:
//! - `Variant`: the `AnyConfig` variant, and the model alias
//!   `model::Variant<H, B>` (a `Decoder` of the family's layers);
//! - `module`: `hf::module` holds `Config` (its `config.json`, normalised),
//!   `model::module` its `DecoderLayer<B>`;
//! - `TpAlias`: the family over tensor-parallel ranks, `model::TpAlias<H, TP, B>`;
//! - `"doc"`: what the family is, for the generated docs;
//! - the `model_type` strings that choose it, wrappers and aliases included.
//!   `ConfigError::UnsupportedModel` lists them in the rows' order. The
//!   first row also reads a `model_type` no row names, and refuses it in
//!   its own words (a missing field, malformed JSON) before the error's.
//!
//! A row may also carry, before it, outer attributes (`#[cfg(...)]`), which
//! every list puts on all it makes of the row (its `mod` lines and
//! re-export, aliases, `AnyConfig` variant, match arms and `model_type`
//! strings), and after it `in ("hf/path.rs", "model/path.rs")`: the files of
//! its config and model modules when they are not `src/hf/module.rs` and
//! `src/model/module.rs`, as `#[path]` reads them (relative to `src/hf/` and
//! `src/model/`). The test family, last so that the supported list of a
//! build without it keeps its text, uses both: it is built only with the
//! `test-family` feature, which the crate's tests turn on, and its files
//! live under `tests/family/`. The first row is the fallback of parsing
//! and must be in every build.

/// Calls `$then! { [$($arg)*] rows }`: the table, handed to a macro that
/// makes one list from it (see the module documentation for a row's parts).
macro_rules! families {
    ($then:ident $(, $arg:tt)*) => {
        $then! {
            [$($arg)*]
            Llama llama LlamaConfig TpLlama
                "A Llama-family model: Llama, Mistral, Qwen2, Qwen3, their mixtures of experts (Qwen3-MoE, Mixtral), GLM-4.5 and MiniMax-M2"
                ["llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "mixtral", "glm4_moe", "minimax_m2"];
            Gemma3 gemma3 Gemma3Config TpGemma3
                "Gemma 3's text model (`gemma3_text`, and the text model of the `gemma3` wrapper)"
                ["gemma3", "gemma3_text"];
            GptOss gpt_oss GptOssConfig TpGptOss
                "gpt-oss"
                ["gpt_oss"];
            Llama4 llama4 Llama4Config TpLlama4
                "Llama 4's text model (`llama4_text`, and the text model of the `llama4` wrapper)"
                ["llama4", "llama4_text"];
            Qwen3Next qwen3_next Qwen3NextConfig TpQwen3Next
                "A Gated DeltaNet hybrid: Qwen3-Next, Qwen3.5 and Qwen3.5-MoE"
                ["qwen3_next", "qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text"];
            Deepseek deepseek DeepseekConfig TpDeepseek
                "DeepSeek V2/V3, Kimi-K2 and Kimi-K2.5 (its text model)"
                ["deepseek_v2", "deepseek_v3", "kimi_k2", "kimi_k25"];
            #[cfg(feature = "test-family")]
            ScaledLlama scaled_llama ScaledLlamaConfig TpScaledLlama
                "A test family, built for the crate's tests only: Llama with Granite's `residual_multiplier` on each residual update"
                ["strata_test_scaled"] in ("../../tests/family/config.rs", "../../tests/family/model.rs");
        }
    };
}
pub(crate) use families;
