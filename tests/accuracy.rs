//! bf16 compute against PyTorch's bf16: on every parity fixture and on the
//! bench model, Strata's `--compute bf16` is at least as close to HF's f32
//! states as HF's own bf16 run (sdpa) is. The error is the relative L2 norm
//! `‖x − ref‖ / ‖ref‖` over all capture points and samples of a fixture
//! together. Both references are stored by scripts/make_bf16_reference.py.

use crate::common;

use common::*;
use std::collections::HashMap;
use strata::backend::Compute;
use strata::model::{AnyCache, LoadOptions, Model};
use strata::pipeline::batch::PackedBatch;
use strata::pipeline::capture::CaptureSet;

/// Squared error and squared reference norm of `got` against `want`, in f64.
fn add(acc: &mut (f64, f64), got: &[f32], want: &[f32]) {
    assert_eq!(got.len(), want.len());
    for (g, w) in got.iter().zip(want) {
        acc.0 += (*g as f64 - *w as f64).powi(2);
        acc.1 += (*w as f64).powi(2);
    }
}

/// Relative L2 errors against HF f32 of Strata in `compute` and of HF bf16, for a fixture directory.
fn errors(dir: &std::path::Path, name: &str, compute: Compute) -> (f64, f64) {
    let n = num_layers(name);
    let points = all_points(n);
    let exp = read_tensors(&dir.join("expected.safetensors"));
    let torch = read_tensors(&fixture(name).join("expected_bf16.safetensors"));
    let model = strata::model::load(dir, LoadOptions { compute, ..Default::default() }).unwrap();
    let samples = samples(name);
    let batch = PackedBatch::from_samples(samples.iter().map(|s| s.as_slice()));
    let set = CaptureSet::<usize>::try_new(points.clone()).unwrap();
    let states = model.forward_step(&batch, &set, &mut AnyCache::default()).unwrap();
    let (mut ours, mut theirs) = ((0f64, 0f64), (0f64, 0f64));
    for i in 0..samples.len() {
        let one = states.slice_tokens(batch.range(i)).unwrap();
        for (slot, p) in points.iter().enumerate() {
            let want = expected(&exp, i, *p, n);
            add(&mut ours, one.layer(slot), want);
            add(&mut theirs, expected(&torch, i, *p, n), want);
        }
    }
    ((ours.0 / ours.1).sqrt(), (theirs.0 / theirs.1).sqrt())
}

fn check(dir: &std::path::Path, name: &str, report: &mut HashMap<String, (f64, f64)>) {
    let (ours, torch) = errors(dir, name, Compute::Bf16);
    let (f32_err, _) = errors(dir, name, Compute::F32);
    println!("{name:<20} strata bf16 {ours:.3e}   pytorch bf16 {torch:.3e}   (strata f32 {f32_err:.1e})");
    report.insert(name.to_string(), (ours, torch));
}

#[test]
fn bf16_compute_is_at_least_as_accurate_as_pytorch_bf16() {
    let mut report = HashMap::new();
    for name in FIXTURES.iter().chain(GEMMA).chain(GPT_OSS).chain(LLAMA4).chain(DEEPSEEK).chain(HYBRID) {
        check(&fixture(name), name, &mut report);
    }
    // The bench model's weights are regenerated (311 MB), not committed.
    let tmp = tempfile::tempdir().unwrap();
    let spec = strata_testkit::LlamaSpec::small();
    strata_testkit::write_llama(tmp.path(), &spec, strata::shape::DType::BF16, 7).unwrap();
    for f in ["config.json", "data.jsonl", "expected.safetensors"] {
        std::fs::copy(fixture("bench-small").join(f), tmp.path().join(f)).unwrap();
    }
    check(tmp.path(), "bench-small", &mut report);
    let worse: Vec<_> = report.iter().filter(|(_, (ours, torch))| ours > torch).collect();
    assert!(worse.is_empty(), "bf16 error above PyTorch's (strata, pytorch): {worse:?}");
}
