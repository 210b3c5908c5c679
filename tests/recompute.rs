//! `strata verify --recompute N`: stored states against a fresh forward. It
//! passes on clean outputs, on either backend, and fails on a dataset written
//! from other weights under the same config, and on a value changed after the
//! fact whose checksum was rewritten to match (which the byte checks miss).

use crate::common;

use common::*;
use std::ffi::OsStr;
use std::path::Path;
use strata::dataset::manifest::Manifest;
use strata::dataset::MappedFile;
use strata_testkit::{write_llama, write_tokens, LlamaSpec};

fn extract(model: Option<&Path>, data: Option<&Path>, out: &Path, extra: &[&str]) {
    let mut args: Vec<&OsStr> = vec![os("extract"), os("--out"), out.as_os_str()];
    if let Some(m) = model {
        args.extend([os("--model"), m.as_os_str()]);
    }
    if let Some(d) = data {
        args.extend([os("--data"), d.as_os_str()]);
    }
    args.extend(extra.iter().map(|s| os(s)));
    let (ok, _, err) = strata(&args);
    assert!(ok, "{err}");
}

/// A small random Llama (hidden 64, 3 layers, vocab 300) with weights from `seed`:
/// two seeds give two checkpoints under byte-identical `config.json`s.
fn small_llama(dir: &Path, seed: u64) {
    let spec = LlamaSpec {
        hidden_size: 64,
        num_layers: 3,
        num_heads: 4,
        num_kv_heads: 2,
        intermediate_size: 96,
        vocab_size: 300,
    };
    write_llama(dir, &spec, strata::shape::DType::F32, seed).unwrap();
}

#[test]
fn passes_on_clean_outputs_with_either_backend() {
    let tmp = tempfile::tempdir().unwrap();
    // The embedded demo model, stored as its checkpoint's bf16.
    let ds = tmp.path().join("demo");
    extract(None, None, &ds, &[]);
    for backend in ["cpu", "reference"] {
        let (ok, text) = verify(&ds, &["--recompute", "10", "--backend", backend]);
        assert!(ok, "{backend}: {text}");
        assert!(
            text.contains("recompute: 4 of 4 samples") && text.contains("input:2") && !text.contains("DIFFERS"),
            "{text}"
        );
    }

    // f32 storage at the same backend and TP size: the fresh states are the stored bytes.
    let model = tmp.path().join("model");
    small_llama(&model, 1);
    let data = tmp.path().join("data.jsonl");
    write_tokens(&data, 300, &[5, 17, 40, 3, 26, 9], 4).unwrap();
    let ds = tmp.path().join("f32");
    extract(
        Some(&model),
        Some(&data),
        &ds,
        &["--dtype", "f32", "--max-batch-tokens", "7", "--capture", "embeddings,input:1,final,final-norm"],
    );
    let (ok, text) = verify(&ds, &["--recompute", "3", "--seed", "5"]);
    assert!(ok, "{text}");
    let rows: Vec<&str> = text.lines().filter(|l| l.contains("max abs")).collect();
    assert_eq!(rows.len(), 4, "{text}");
    assert!(rows.iter().all(|r| r.contains("max abs 0.000e0") && r.ends_with("identical")), "{text}");
    assert!(text.contains("recompute: 3 of 6 samples"), "{text}");

    // Written at --tp 2: recomputed whole, within the f32 tolerance; at --tp 2, identical.
    let ds = tmp.path().join("tp2");
    extract(Some(&model), Some(&data), &ds, &["--dtype", "f32", "--tp", "2"]);
    let (ok, text) = verify(&ds, &["--recompute", "6"]);
    assert!(ok && text.contains(" ok"), "{text}");
    let (ok, text) = verify(&ds, &["--recompute", "6", "--tp", "2"]);
    assert!(ok && !text.contains(" ok") && text.contains("identical"), "{text}");
    // Written in bf16 compute: recomputed by default in the dataset's compute
    // (identical bytes); in f32 it passes at bf16's tolerance.
    let ds = tmp.path().join("bf16");
    extract(Some(&model), Some(&data), &ds, &["--dtype", "f32", "--compute", "bf16"]);
    let (ok, text) = verify(&ds, &["--recompute", "6"]);
    assert!(ok && text.contains("bf16 compute") && text.contains("identical") && !text.contains(" ok"), "{text}");
    let (ok, text) = verify(&ds, &["--recompute", "6", "--compute", "f32"]);
    assert!(ok && text.contains("f32 compute") && !text.contains("DIFFERS"), "{text}");
    // Nothing to recompute is an error, not a pass.
    let (ok, text) = verify(&ds, &["--recompute", "0"]);
    assert!(!ok && text.contains("--recompute"), "{text}");
}

#[test]
fn fails_on_states_from_other_weights_under_the_same_config() {
    let tmp = tempfile::tempdir().unwrap();
    let (a, b) = (tmp.path().join("a"), tmp.path().join("b"));
    small_llama(&a, 1);
    small_llama(&b, 2);
    assert_eq!(std::fs::read(a.join("config.json")).unwrap(), std::fs::read(b.join("config.json")).unwrap());
    let data = tmp.path().join("data.jsonl");
    write_tokens(&data, 300, &[12, 30, 7], 9).unwrap();
    let ds = tmp.path().join("ds");
    extract(Some(&b), Some(&data), &ds, &["--dtype", "bf16"]);
    // Every byte check passes: the dataset is self-consistent.
    let (ok, text) = verify(&ds, &[]);
    assert!(ok, "{text}");
    // Against the weights the user believes it came from, it fails, naming the points.
    let (ok, text) = verify(&ds, &["--recompute", "2", "--model", a.to_str().unwrap()]);
    assert!(!ok && text.contains("DIFFERS") && text.contains("differ from a fresh forward"), "{text}");
    assert!(!text.contains("not the one the dataset was written with"), "same config: {text}");
    // And against its own weights it passes.
    let (ok, text) = verify(&ds, &["--recompute", "2"]);
    assert!(ok, "{text}");
}

#[test]
fn fails_on_a_changed_value_whose_checksum_was_rewritten() {
    let tmp = tempfile::tempdir().unwrap();
    let ds = tmp.path().join("demo");
    // f32 compute: the recompute's tolerance is then the tight one (with bf16
    // compute, which `auto` picks on a CPU with bf16 hardware, it is 1e-1).
    extract(None, None, &ds, &["--capture", "input:1,input:3,final", "--compute", "f32"]);
    let mut m = Manifest::read(&ds).unwrap();
    // Flip the sign of one small bf16 value (|v| < 0.0035) of sample 2's second capture point:
    // a change of under 0.007, less than one bf16 ulp at 1, which a tolerance scaled by max(1, |v|) would miss.
    let victim = m.samples[2].clone();
    let shard = ds.join(&m.shards[victim.shard].file);
    let file = MappedFile::open(&shard).unwrap();
    let entry = file.tensors[&format!("{}.hidden_states", victim.id)].clone();
    let per_point = victim.tokens * 64 * 2; // [T, H] bf16 bytes
    let point1 = &file.bytes(&entry)[per_point..2 * per_point];
    let value = |i: usize| half::bf16::from_le_bytes([point1[2 * i], point1[2 * i + 1]]).to_f32();
    let small = (0..victim.tokens * 64).find(|&i| (0.0015..0.0035).contains(&value(i).abs())).expect("a small value");
    let at = entry.range.start + per_point + 2 * small + 1; // its high byte: sign bit
    drop(file);
    let mut bytes = std::fs::read(&shard).unwrap();
    bytes[at] ^= 0x80;
    std::fs::write(&shard, &bytes).unwrap();
    let (ok, text) = verify(&ds, &[]);
    assert!(!ok && text.contains("checksum"), "the flip is seen by the checksum first: {text}");
    // Rewrite the checksum so that every byte check passes again.
    let names = strata::dataset::Dataset::open(&ds).unwrap().tensor_names(&victim.id);
    m.samples[2].checksum = MappedFile::open(&shard).unwrap().sample_checksum(&names).unwrap();
    std::fs::write(ds.join("manifest.json"), serde_json::to_string_pretty(&m).unwrap()).unwrap();
    let (ok, text) = verify(&ds, &[]);
    assert!(ok, "checksum rewritten: {text}");
    // A fresh forward still catches it, at that point only.
    let (ok, text) = verify(&ds, &["--recompute", "4"]);
    assert!(!ok, "{text}");
    let row = |p: &str| text.lines().find(|l| l.trim_start().starts_with(p)).unwrap_or_default().to_string();
    assert!(row("input:3").ends_with("DIFFERS"), "{text}");
    assert!(row("input:1").ends_with("identical") && row("final").ends_with("identical"), "{text}");
}

#[test]
fn refuses_a_model_that_does_not_fit() {
    let tmp = tempfile::tempdir().unwrap();
    let ds = tmp.path().join("demo");
    extract(None, None, &ds, &[]);
    // qwen3 has 3 layers and hidden 80; the demo dataset 8 and 64.
    let (ok, text) = verify(&ds, &["--recompute", "1", "--model", fixture("qwen3").to_str().unwrap()]);
    assert!(!ok && text.contains("the model does not fit the dataset"), "{text}");
    assert!(text.contains("not the one the dataset was written with"), "{text}");
    // A dataset whose model is not on this machine, without --model.
    let mut m = Manifest::read(&ds).unwrap();
    m.model.path = tmp.path().join("gone").display().to_string();
    std::fs::write(ds.join("manifest.json"), serde_json::to_string_pretty(&m).unwrap()).unwrap();
    let (ok, text) = verify(&ds, &["--recompute", "1"]);
    assert!(!ok && text.contains("pass --model DIR"), "{text}");
}
