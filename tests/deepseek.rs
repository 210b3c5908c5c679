//! DeepSeek V3 (MLA + MoE) parity with HF transformers at every capture point.

use crate::common;

use common::*;
use strata::backend::SeqState;
use strata::model::Deepseek;
use strata::pipeline::batch::PackedBatch;
use strata::pipeline::capture::CaptureSet;

#[test]
fn library_matches_hf_at_every_capture_point() {
    for name in DEEPSEEK {
        let n = num_layers(name);
        let points = all_points(n);
        let model: Deepseek = Deepseek::load(&fixture(name)).unwrap();
        let exp = read_tensors(&fixture(name).join("expected.safetensors"));
        let samples = samples(name);
        let batch = PackedBatch::from_samples(samples.iter().map(|s| s.as_slice()));
        let set = CaptureSet::<usize>::try_new(points.clone()).unwrap();
        let states = model.forward_step(&batch, &set, &mut SeqState::default()).unwrap();
        let mut worst = 0f32;
        for i in 0..samples.len() {
            let one = states.slice_tokens(batch.range(i)).unwrap();
            for (slot, p) in points.iter().enumerate() {
                let err = max_err(one.layer(slot), expected(&exp, i, *p, n));
                assert!(err <= TOL, "{name} sample {i} {p}: error {err:e} > {TOL:e}");
                worst = worst.max(err);
            }
        }
        println!("{name}: worst relative error {worst:.2e}");
    }
}

fn extract(name: &str, out: &std::path::Path, extra: &[&str]) -> std::process::Output {
    let list: Vec<String> = all_points(num_layers(name)).iter().map(|p| p.to_string()).collect();
    std::process::Command::new(env!("CARGO_BIN_EXE_strata"))
        .args(["extract", "--model"])
        .arg(fixture(name))
        .arg("--data")
        .arg(fixture(name).join("data.jsonl"))
        .args(["--capture", &list.join(","), "--dtype", "f32", "--compute", "f32", "--out"])
        .arg(out)
        .args(extra)
        .output()
        .unwrap()
}

#[test]
fn cli_matches_hf_and_does_not_depend_on_the_batch_budget() {
    for name in DEEPSEEK {
        let n = num_layers(name);
        let points = all_points(n);
        let tmp = tempfile::tempdir().unwrap();
        let mut first = None;
        for budget in ["5", "8192"] {
            let out = tmp.path().join(budget);
            let o = extract(name, &out, &["--max-batch-tokens", budget]);
            assert!(o.status.success(), "{name}: {}", String::from_utf8_lossy(&o.stderr));
            let files = dir_contents(&out);
            match &first {
                None => first = Some(files),
                Some(f) => assert!(*f == files, "{name}: --max-batch-tokens {budget} changes the output"),
            }
        }
        let exp = read_tensors(&fixture(name).join("expected.safetensors"));
        let got = read_tensors(&tmp.path().join("5").join("shard-00000.safetensors"));
        for (i, ids) in samples(name).iter().enumerate() {
            let hs = &got[&format!("{i}.hidden_states")];
            let per = ids.len() * hs.shape[2];
            for (slot, p) in points.iter().enumerate() {
                let err = max_err(&hs.data[slot * per..(slot + 1) * per], expected(&exp, i, *p, n));
                assert!(err <= TOL, "{name} sample {i} {p} via CLI: {err:e}");
            }
        }
    }
}

#[test]
fn tp_2_matches_tp_1_and_hf() {
    for name in DEEPSEEK {
        let n = num_layers(name);
        let points = all_points(n);
        let exp = read_tensors(&fixture(name).join("expected.safetensors"));
        let tmp = tempfile::tempdir().unwrap();
        let mut base: Option<std::collections::HashMap<String, Tensor>> = None;
        for tp in ["1", "2"] {
            let out = tmp.path().join(tp);
            let o = extract(name, &out, &["--tp", tp, "--max-batch-tokens", "16"]);
            assert!(o.status.success(), "{name} --tp {tp}: {}", String::from_utf8_lossy(&o.stderr));
            let got = read_tensors(&out.join("shard-00000.safetensors"));
            let mut worst = 0f32;
            for (i, ids) in samples(name).iter().enumerate() {
                let hs = &got[&format!("{i}.hidden_states")];
                let per = ids.len() * hs.shape[2];
                for (slot, p) in points.iter().enumerate() {
                    let err = max_err(&hs.data[slot * per..(slot + 1) * per], expected(&exp, i, *p, n));
                    assert!(err <= TOL, "{name} --tp {tp} sample {i} {p}: {err:e} from HF");
                }
                if let Some(b) = &base {
                    let err = max_err(&hs.data, &b[&format!("{i}.hidden_states")].data);
                    assert!(err <= 2e-5, "{name} --tp {tp} sample {i}: {err:e} from --tp 1");
                    worst = worst.max(err);
                }
            }
            if base.is_none() {
                base = Some(got);
            } else {
                println!("{name} --tp {tp}: worst relative difference from --tp 1: {worst:.2e}");
            }
        }
    }
}

#[test]
fn bad_tp_splits_are_refused_before_loading() {
    let tmp = tempfile::tempdir().unwrap();
    let o = extract("deepseek-v3", &tmp.path().join("o"), &["--tp", "3"]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success() && err.contains("--tp 3: num_attention_heads 4 is not divisible by 3"), "{err}");
    assert!(!tmp.path().join("o").exists());
}
