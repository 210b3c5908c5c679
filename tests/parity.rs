//! Parity with HF transformers at every capture point of every fixture,
//! through the library and through the `strata extract` CLI.

use crate::common;

use common::*;
use std::process::Command;
use strata::backend::Cpu;
use strata::hf::llama::LlamaConfig;
use strata::model::decoder::{Block, Decoder};
use strata::model::gemma3::DecoderLayer as GemmaLayer;
use strata::model::gpt_oss::DecoderLayer as GptOssLayer;
use strata::model::llama::DecoderLayer as LlamaLayer;
use strata::model::llama4::DecoderLayer as Llama4Layer;
use strata::model::qwen3_next::DecoderLayer as HybridLayer;
use strata::model::Llama;
use strata::pipeline::batch::PackedBatch;
use strata::pipeline::capture::{CapturePoint, CaptureSet};
use strata::shape::{Hidden, Layers};

#[test]
fn library_matches_hf_at_every_capture_point() {
    for name in FIXTURES {
        library_matches::<LlamaLayer<Cpu>>(name);
    }
    for name in GEMMA {
        library_matches::<GemmaLayer<Cpu>>(name);
    }
    for name in GPT_OSS {
        library_matches::<GptOssLayer<Cpu>>(name);
    }
    for name in LLAMA4 {
        library_matches::<Llama4Layer<Cpu>>(name);
    }
    for name in HYBRID {
        library_matches::<HybridLayer<Cpu>>(name);
    }
}

/// Fixture `name` through the library's decoder of block `L`, all samples in one packed batch.
fn library_matches<L: Block<Cpu>>(name: &str) {
    {
        let n = num_layers(name);
        let points = all_points(n);
        let model = Decoder::<Cpu, L>::load(&fixture(name)).unwrap();
        let exp = read_tensors(&fixture(name).join("expected.safetensors"));
        let samples = samples(name);
        // All samples packed into one batch: packing must not leak across samples.
        let batch = PackedBatch::from_samples(samples.iter().map(|s| s.as_slice()));
        let set = CaptureSet::<usize>::try_new(points.clone()).unwrap();
        let states = model.forward(&batch, &set).unwrap();
        let mut worst = 0f32;
        for i in 0..samples.len() {
            let one = states.slice_tokens(batch.range(i)).unwrap();
            for (slot, p) in points.iter().enumerate() {
                let err = max_err(one.layer(slot), expected(&exp, i, *p, n));
                let tol = tol(name);
                assert!(err <= tol, "{name} sample {i} {p}: error {err:e} > {tol:e}");
                worst = worst.max(err);
            }
        }
        println!("{name}: worst relative error {worst:.2e}");
    }
}

#[test]
fn cli_matches_hf_at_every_capture_point() {
    for name in FIXTURES.iter().chain(GEMMA).chain(GPT_OSS).chain(LLAMA4).chain(HYBRID) {
        let n = num_layers(name);
        let points = all_points(n);
        let list: Vec<String> = points.iter().map(|p| p.to_string()).collect();
        let out = tempfile::tempdir().unwrap();
        let status = Command::new(env!("CARGO_BIN_EXE_strata"))
            .args(["extract", "--model"])
            .arg(fixture(name))
            .arg("--data")
            .arg(fixture(name).join("data.jsonl"))
            .args(["--capture", &list.join(","), "--dtype", "f32", "--compute", "f32", "--max-batch-tokens", "20"])
            .args(["--format", "speculators", "--out"])
            .arg(out.path())
            .output()
            .unwrap();
        assert!(status.status.success(), "{name}: {}", String::from_utf8_lossy(&status.stderr));
        let exp = read_tensors(&fixture(name).join("expected.safetensors"));
        for (i, ids) in samples(name).iter().enumerate() {
            let got = read_tensors(&out.path().join(format!("hidden_states/hs_{i}.safetensors")));
            let tok = &got["token_ids"];
            assert_eq!(tok.data, ids.iter().map(|&v| v as f32).collect::<Vec<_>>());
            let hs = &got["hidden_states"];
            let (t, l, h) = (ids.len(), points.len(), hs.shape[2]);
            assert_eq!(hs.shape, vec![t, l, h], "{name} sample {i}: [T, L, H]");
            for (slot, p) in points.iter().enumerate() {
                let layer: Vec<f32> = (0..t).flat_map(|ti| hs.data[(ti * l + slot) * h..][..h].to_vec()).collect();
                let err = max_err(&layer, expected(&exp, i, *p, n));
                assert!(err <= tol(name), "{name} sample {i} {p} via CLI: error {err:e}");
            }
        }
    }
}

#[test]
fn native_format_matches_hf_at_every_capture_point() {
    for name in FIXTURES.iter().chain(GEMMA).chain(GPT_OSS).chain(LLAMA4).chain(HYBRID) {
        let n = num_layers(name);
        let points = all_points(n);
        let list: Vec<String> = points.iter().map(|p| p.to_string()).collect();
        let out = tempfile::tempdir().unwrap();
        let o = Command::new(env!("CARGO_BIN_EXE_strata"))
            .args(["extract", "--model"])
            .arg(fixture(name))
            .arg("--data")
            .arg(fixture(name).join("data.jsonl"))
            .args([
                "--capture",
                &list.join(","),
                "--dtype",
                "f32",
                "--compute",
                "f32",
                "--max-batch-tokens",
                "7",
                "--out",
            ])
            .arg(out.path())
            .output()
            .unwrap();
        assert!(o.status.success(), "{name}: {}", String::from_utf8_lossy(&o.stderr));
        let exp = read_tensors(&fixture(name).join("expected.safetensors"));
        let got = read_tensors(&out.path().join("shard-00000.safetensors"));
        for (i, ids) in samples(name).iter().enumerate() {
            let hs = &got[&format!("{i}.hidden_states")];
            assert_eq!(hs.shape, vec![points.len(), ids.len(), hs.shape[2]], "{name} sample {i}: [L, T, H]");
            let per = ids.len() * hs.shape[2];
            for (slot, p) in points.iter().enumerate() {
                let err = max_err(&hs.data[slot * per..(slot + 1) * per], expected(&exp, i, *p, n));
                assert!(err <= tol(name), "{name} sample {i} {p} via native format: error {err:e}");
            }
            assert_eq!(got[&format!("{i}.loss_mask")].data, vec![1.0; ids.len()]);
        }
    }
}

#[test]
fn sliding_window_is_exercised_by_the_fixtures() {
    // The same weights with the window switched off must disagree with HF:
    // otherwise the fixtures would not test the window at all.
    for name in ["mistral-swa", "qwen2-swa"] {
        let dir = fixture(name);
        let mut config = LlamaConfig::from_file(&dir.join("config.json")).unwrap();
        assert!(config.sliding_windows.iter().any(|w| w.is_some()), "{name} has no window");
        config.sliding_windows.iter_mut().for_each(|w| *w = None);
        let ckpt = strata::hf::checkpoint::Checkpoint::open(&dir).unwrap();
        let model: Llama = Llama::from_checkpoint(config, &ckpt).unwrap();
        let samples = samples(name);
        let last = samples.len() - 1;
        let batch = PackedBatch::from_samples([samples[last].as_slice()]);
        let set = CaptureSet::<usize>::try_new(vec![CapturePoint::FinalPreNorm]).unwrap();
        let states = model.forward(&batch, &set).unwrap();
        let exp = read_tensors(&dir.join("expected.safetensors"));
        let err = max_err(states.layer(0), expected(&exp, last, CapturePoint::FinalPreNorm, num_layers(name)));
        assert!(err > 100.0 * TOL, "{name}: window off still matches (error {err:e})");
    }
}

#[test]
fn statically_typed_job_on_the_default_model() {
    // Hidden width and capture count as types: the result is `CapturedStates<Layers<4>, Hidden<64>>`.
    let model = Llama::<Hidden<64>>::load(&fixture("llama-default")).unwrap();
    let set = CaptureSet::<Layers<4>>::try_new(CapturePoint::eagle3(8)).unwrap();
    let batch = PackedBatch::from_samples([&[1u32, 2, 3][..]]);
    let states: strata::shape::CapturedStates<Layers<4>, Hidden<64>> = model.forward(&batch, &set).unwrap();
    assert_eq!(states.shape(), [4, 3, 64]);

    // The wrong static width is refused at load time with the axis named.
    let err = Llama::<Hidden<96>>::load(&fixture("llama-default")).err().unwrap();
    assert_eq!(err.to_string(), "config.json hidden_size: axis hidden: expected 96, got 64");
}
