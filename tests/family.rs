//! The test family (`model_type` `strata_test_scaled`; its config and model
//! files are `tests/family/`): a Llama with Granite's `residual_multiplier`
//! `s` on each residual update, added to the crate by one row of the family
//! table (`src/families.rs`, built with the `test-family` feature that the
//! tests turn on). Each test fails when the row is missing from a list the
//! table makes: parsing by `model_type`, the supported list of
//! `ConfigError::UnsupportedModel`, `dispatch!` (every load through
//! `model::load`), the TP alias. Its checkpoints are testkit's random Llama,
//! written here, with the config.json rewritten.

use crate::common::*;
use std::path::{Path, PathBuf};
use strata::backend::Cpu;
use strata::hf::{ConfigError, ScaledLlamaConfig};
use strata::model::{self, AnyConfig, BackendKind, LoadOptions, Model, TpScaledLlama};
use strata::pipeline::batch::PackedBatch;
use strata::pipeline::capture::CaptureSet;
use strata::shape::DType;

const LAYERS: usize = 2;
const VOCAB: usize = 64;
const SEED: u64 = 51;

/// As tests/tp.rs's: TP changes only the order of the all-reduced sums.
const TP_TOL: f32 = 2e-5;

/// Testkit's random Llama (f32 weights: the scaled twin below is exact) in `dir`, a `llama`.
fn llama(dir: &Path) -> PathBuf {
    let spec = strata_testkit::LlamaSpec {
        hidden_size: 32,
        num_layers: LAYERS,
        num_heads: 2,
        num_kv_heads: 1,
        intermediate_size: 64,
        vocab_size: VOCAB,
    };
    strata_testkit::write_llama(dir, &spec, DType::F32, SEED).unwrap();
    dir.to_path_buf()
}

/// [`llama`]'s weights under the test family's `model_type`, with
/// `residual_multiplier` `s` (the key left out for `None`).
fn scaled(dir: &Path, s: Option<f64>) -> PathBuf {
    llama(dir);
    let path = dir.join("config.json");
    let mut config: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    config["model_type"] = "strata_test_scaled".into();
    if let Some(s) = s {
        config["residual_multiplier"] = s.into();
    }
    std::fs::write(&path, config.to_string()).unwrap();
    dir.to_path_buf()
}

/// [`llama`] with `o_proj` and `down_proj` times `s`: a plain Llama whose
/// residual updates are `s·self_attn(...)` and `s·mlp(...)`, as the test
/// family's are, made by another route (exactly, for a power of two `s`).
fn llama_with_scaled_updates(dir: &Path, s: f32) -> PathBuf {
    llama(dir);
    let file = dir.join("model.safetensors");
    let mut tensors: Vec<_> = read_tensors(&file).into_iter().collect();
    tensors.sort_by(|a, b| a.0.cmp(&b.0));
    let mut scaled_ones = 0;
    let out: Vec<_> = tensors
        .into_iter()
        .map(|(name, mut t)| {
            if name.ends_with("o_proj.weight") || name.ends_with("down_proj.weight") {
                t.data.iter_mut().for_each(|w| *w *= s);
                scaled_ones += 1;
            }
            let mut bytes = Vec::new();
            DType::F32.encode_into(&t.data, &mut bytes);
            (name, DType::F32.to_safetensors(), t.shape, bytes)
        })
        .collect();
    assert_eq!(scaled_ones, 2 * LAYERS);
    strata_testkit::write_safetensors(dir, &out).unwrap();
    dir.to_path_buf()
}

/// Three samples of different lengths, packed into one batch.
fn batch() -> PackedBatch {
    let mut rng = strata_testkit::Rng::new(SEED);
    let samples: Vec<Vec<u32>> =
        [7, 3, 12].iter().map(|&n| (0..n).map(|_| rng.below(VOCAB as u64) as u32).collect()).collect();
    PackedBatch::from_samples(samples.iter().map(|s| s.as_slice()))
}

fn captures() -> CaptureSet<usize> {
    CaptureSet::try_new(all_points(LAYERS)).unwrap()
}

/// The states `[L, T, H]` at every capture point of [`batch`], through the
/// registry's loader (`dispatch!`), on `backend` over `tp` ranks.
fn states(dir: &Path, backend: BackendKind, tp: usize) -> Vec<f32> {
    let m = model::load(dir, LoadOptions { backend, tp, ..Default::default() }).unwrap();
    m.forward_step(&batch(), &captures(), &mut Default::default()).unwrap().into_vec()
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

#[test]
fn parsing_by_model_type_chooses_the_test_family() {
    let tmp = tempfile::tempdir().unwrap();
    let text = std::fs::read_to_string(scaled(tmp.path(), Some(0.5)).join("config.json")).unwrap();
    let c = AnyConfig::parse(&text).unwrap();
    assert_eq!(c.family(), "ScaledLlama");
    assert_eq!(c.info().architecture, "strata_test_scaled");
    let AnyConfig::ScaledLlama(sc) = &c else { panic!("{c:?}") };
    assert_eq!(sc.residual_multiplier, 0.5);

    // Absent, it is 1 (Granite's default); refused when not a finite number,
    // with the crate's typed errors; another model_type is not this parser's.
    let absent = std::fs::read_to_string(scaled(&tmp.path().join("absent"), None).join("config.json")).unwrap();
    assert_eq!(ScaledLlamaConfig::from_json(&absent).unwrap().residual_multiplier, 1.0);
    let with = |v: &str| text.replace("\"residual_multiplier\":0.5", &format!("\"residual_multiplier\":{v}"));
    assert_ne!(with("2"), text, "the key is rewritten");
    match ScaledLlamaConfig::from_json(&with("1e39")).unwrap_err() {
        ConfigError::Invalid { field: "residual_multiplier", problem } => assert!(problem.contains("inf"), "{problem}"),
        e => panic!("{e}"),
    }
    assert!(matches!(ScaledLlamaConfig::from_json(&with("\"half\"")), Err(ConfigError::Json(_))));
    let llama = text.replace("strata_test_scaled", "llama");
    assert!(matches!(ScaledLlamaConfig::from_json(&llama), Err(ConfigError::UnsupportedModel(t)) if t == "llama"));
    // The Llama parser's refusals are the family's.
    let e = ScaledLlamaConfig::from_json(&text.replace("\"hidden_size\"", "\"hidden\"")).unwrap_err();
    assert!(matches!(e, ConfigError::Missing("hidden_size")), "{e}");
}

#[test]
fn the_supported_list_names_the_test_family_last() {
    let e = AnyConfig::parse(r#"{"model_type": "gpt2"}"#).unwrap_err();
    assert!(matches!(e, ConfigError::UnsupportedModel(_)), "{e}");
    let text = e.to_string();
    assert!(text.ends_with(", kimi_k25, strata_test_scaled)"), "{text}");
}

#[test]
fn at_s_1_the_test_family_is_llama_bit_for_bit() {
    let tmp = tempfile::tempdir().unwrap();
    let plain = llama(&tmp.path().join("llama"));
    for s in [Some(1.0), None] {
        let family = scaled(&tmp.path().join(format!("{s:?}")), s);
        for backend in [BackendKind::Cpu, BackendKind::Reference] {
            let (got, want) = (states(&family, backend, 1), states(&plain, backend, 1));
            assert!(bits(&got) == bits(&want), "{backend}, residual_multiplier {s:?}");
        }
    }
}

#[test]
fn s_scales_each_residual_update_on_every_backend() {
    let tmp = tempfile::tempdir().unwrap();
    let cpu = states(&scaled(&tmp.path().join("family"), Some(0.5)), BackendKind::Cpu, 1);
    let reference = states(&tmp.path().join("family"), BackendKind::Reference, 1);
    let plain = states(&llama(&tmp.path().join("llama")), BackendKind::Cpu, 1);
    let twin = states(&llama_with_scaled_updates(&tmp.path().join("twin"), 0.5), BackendKind::Cpu, 1);
    // The factor moves every layer's output far past the tolerance...
    let moved = max_err(&cpu, &plain);
    assert!(moved > 100.0 * TOL, "residual_multiplier 0.5 moved the states by {moved:e} only");
    // ...to where a Llama with each update's last projection scaled is, and
    // the f64 reference backend agrees, as tests/backends.rs asks of the CPU.
    let err = max_err(&cpu, &twin);
    assert!(err <= TOL, "cpu vs the scaled-weights Llama: {err:e}");
    let err = max_err(&cpu, &reference);
    assert!(err <= TOL, "cpu vs reference: {err:e}");
}

#[test]
fn the_tp_alias_runs_the_test_family_over_ranks() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = scaled(tmp.path(), Some(0.5));
    let one = states(&dir, BackendKind::Cpu, 1);
    let m = TpScaledLlama::<usize, usize, Cpu>::load(&dir, 2).unwrap();
    let two = m.forward_step(&batch(), &captures(), &mut ()).unwrap().into_vec();
    let err = max_err(&two, &one);
    assert!(err <= TP_TOL, "TpScaledLlama over 2 ranks vs one: {err:e}");
    let err = max_err(&states(&dir, BackendKind::Cpu, 2), &one);
    assert!(err <= TP_TOL, "model::load --tp 2 vs one: {err:e}");
}

#[test]
fn strata_extract_runs_the_test_family() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = scaled(&tmp.path().join("model"), Some(0.5));
    let batch = batch();
    let data = tmp.path().join("data.jsonl");
    let lines: Vec<String> = (0..batch.num_samples())
        .map(|i| serde_json::json!({ "input_ids": &batch.token_ids()[batch.range(i)] }).to_string())
        .collect();
    std::fs::write(&data, lines.join("\n") + "\n").unwrap();
    let points: Vec<String> = all_points(LAYERS).iter().map(|p| p.to_string()).collect();
    let out = tmp.path().join("out");
    let (ok, _, err) = strata(&[
        os("extract"),
        os("--model"),
        dir.as_os_str(),
        os("--data"),
        data.as_os_str(),
        os("--capture"),
        os(&points.join(",")),
        os("--dtype"),
        os("f32"),
        os("--compute"),
        os("f32"),
        os("--out"),
        out.as_os_str(),
    ]);
    assert!(ok, "{err}");
    // What the library gives, sample by sample (the CLI packs its own batches:
    // on the CPU a token's states do not depend on the packing).
    let m = model::load(&dir, LoadOptions::default()).unwrap();
    let want = m.forward_step(&batch, &captures(), &mut Default::default()).unwrap();
    let got = read_tensors(&out.join("shard-00000.safetensors"));
    for i in 0..batch.num_samples() {
        let hs = &got[&format!("{i}.hidden_states")];
        let one = want.slice_tokens(batch.range(i)).unwrap();
        assert!(bits(&hs.data) == bits(one.as_slice()), "sample {i}");
    }
}
