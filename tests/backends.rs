//! Every parity fixture through every backend, through the same model code:
//! each backend agrees with HF transformers at every capture point, and the
//! two agree with each other. A new backend is added to `BACKENDS` here.

use crate::common;

use common::*;
use strata::model::{self, BackendKind, LoadOptions, Model};
use strata::pipeline::batch::PackedBatch;
use strata::pipeline::capture::CaptureSet;

const BACKENDS: &[BackendKind] = &[BackendKind::Cpu, BackendKind::Reference];

/// Runs every sample of a fixture, packed into one step, on `backend`; returns
/// the states `[L, T, H]` and the worst relative error from HF.
fn run(name: &str, backend: BackendKind) -> (Vec<f32>, f32) {
    let n = num_layers(name);
    let points = all_points(n);
    let m = model::load(&fixture(name), LoadOptions { backend, tp: 1, ..Default::default() }).unwrap();
    let exp = read_tensors(&fixture(name).join("expected.safetensors"));
    let samples = samples(name);
    let batch = PackedBatch::from_samples(samples.iter().map(|s| s.as_slice()));
    let set = CaptureSet::<usize>::try_new(points.clone()).unwrap();
    let states = m.forward_step(&batch, &set, &mut Default::default()).unwrap();
    let mut worst = 0f32;
    for i in 0..samples.len() {
        let one = states.slice_tokens(batch.range(i)).unwrap();
        for (slot, p) in points.iter().enumerate() {
            let err = max_err(one.layer(slot), expected(&exp, i, *p, n));
            let tol = tol(name);
            assert!(err <= tol, "{name} on {backend}: sample {i} {p}: error {err:e} > {tol:e}");
            worst = worst.max(err);
        }
    }
    (states.into_vec(), worst)
}

#[test]
fn every_backend_matches_hf_on_every_fixture() {
    for name in all_fixtures() {
        let mut line = format!("{name:22}");
        let mut first: Option<Vec<f32>> = None;
        for &backend in BACKENDS {
            let (states, worst) = run(name, backend);
            line += &format!("  {backend} {worst:.2e}");
            match &first {
                None => first = Some(states),
                Some(cpu) => {
                    let d = max_err(&states, cpu);
                    assert!(d <= tol(name), "{name}: {backend} differs from cpu by {d:e}");
                    line += &format!(" (vs cpu {d:.1e})");
                }
            }
        }
        println!("{line}");
    }
}

/// The reference backend runs chunked prefill through its own KV cache: small
/// budgets split every sample, and the files still match HF.
#[test]
fn reference_backend_through_the_cli_with_chunked_prefill() {
    for name in ["mistral-swa", "qwen3", "deepseek-v3", "kimi-k2-int4"] {
        let n = num_layers(name);
        let list: Vec<String> = all_points(n).iter().map(|p| p.to_string()).collect();
        let tmp = tempfile::tempdir().unwrap();
        let out = tmp.path().join("out");
        let (ok, _, err) = strata(&[
            "extract".as_ref(),
            "--model".as_ref(),
            fixture(name).as_os_str(),
            "--data".as_ref(),
            fixture(name).join("data.jsonl").as_os_str(),
            "--capture".as_ref(),
            list.join(",").as_ref(),
            "--dtype".as_ref(),
            "f32".as_ref(),
            "--max-batch-tokens".as_ref(),
            "5".as_ref(),
            "--backend".as_ref(),
            "reference".as_ref(),
            "--out".as_ref(),
            out.as_os_str(),
        ]);
        assert!(ok, "{name}: {err}");
        let exp = read_tensors(&fixture(name).join("expected.safetensors"));
        let got = read_tensors(&out.join("shard-00000.safetensors"));
        for (i, ids) in samples(name).iter().enumerate() {
            let hs = &got[&format!("{i}.hidden_states")];
            let per = ids.len() * hs.shape[2];
            for (slot, p) in all_points(n).iter().enumerate() {
                let err = max_err(&hs.data[slot * per..(slot + 1) * per], expected(&exp, i, *p, n));
                assert!(err <= TOL, "{name} --backend reference sample {i} {p}: {err:e}");
            }
        }
    }
}

#[test]
fn reference_backend_refuses_tensor_parallelism_clearly() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("out");
    let (ok, _, err) = strata(&[
        "extract".as_ref(),
        "--backend".as_ref(),
        "reference".as_ref(),
        "--tp".as_ref(),
        "2".as_ref(),
        "--out".as_ref(),
        out.as_os_str(),
    ]);
    assert!(!ok && err.contains("the reference backend runs one rank"), "{err}");
    assert!(!out.exists(), "nothing is written");
}

/// The seam is real only if no model file depends on a concrete backend:
/// only the registry (`model/any.rs`) names them.
#[test]
fn no_model_file_names_a_concrete_backend() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src/model");
    let mut checked = 0;
    for e in std::fs::read_dir(&dir).unwrap() {
        let path = e.unwrap().path();
        if path.file_name().unwrap() == "any.rs" {
            continue;
        }
        let text = std::fs::read_to_string(&path).unwrap();
        for word in ["Cpu", "Reference", "backend::cpu", "backend::reference", "PackedLinear"] {
            assert!(!text.contains(word), "{} names {word:?}", path.display());
        }
        checked += 1;
    }
    assert!(checked >= 6, "only {checked} files in src/model");
}

/// Attention sinks (gpt-oss: one logit per head in every softmax's
/// denominator) agree between the CPU backend, in both computes, and the
/// reference backend, over two packed samples with a window; and they move
/// the output, so the comparison sees them.
#[test]
fn attention_sinks_agree_between_backends() {
    use strata::backend::prelude::*;
    use strata::backend::{AttnShape, Bf16, Cpu, LayerState, Mask, Qkv, Reference, Tensor, F32};
    use strata::pipeline::batch::Segment;
    fn run<B: Backend>(b: &B, qkv: &[f32], sinks: Option<&[f32]>, batch: &PackedBatch) -> Vec<f32> {
        let (nh, nkv, hd) = (4, 2, 16);
        let s = AttnShape { heads: nh, kv_heads: nkv, head_dim: hd, v_dim: hd, mask: Mask::Sliding(9), scale: 0.25 };
        let t = batch.num_tokens();
        let x = Tensor::<B>::from_host(b, qkv, t, (nh + 2 * nkv) * hd).unwrap();
        let sinks = sinks.map(|k| b.vector(k.to_vec()));
        let mut out = Tensor::<B>::zeros(b, t, nh * hd);
        let mut cache = B::KvCache::default();
        cache.begin(batch).unwrap();
        let (q, k, v) = (x.cols(0, nh * hd), x.cols(nh * hd, nkv * hd), x.cols((nh + nkv) * hd, nkv * hd));
        b.attention(Qkv { q, k, v }, s, sinks.as_ref(), batch, LayerState::new(&mut cache, 0), &mut out);
        out.to_host(b)
    }
    let mut batch = PackedBatch::new();
    batch.push_segment(&[1; 13], Segment { key: 0, pos0: 0, keep: false });
    batch.push_segment(&[1; 30], Segment { key: 1, pos0: 0, keep: false });
    let qkv: Vec<f32> = (0..43 * 128).map(|i| ((i * 7919 % 997) as f32 / 250.0) - 2.0).collect();
    let sinks = [1.5f32, -0.5, 0.0, -4.0];
    let want = run(&Reference, &qkv, Some(&sinks), &batch);
    let plain = run(&Reference, &qkv, None, &batch);
    assert!(max_err(&plain, &want) > 1e-2, "the sinks change the output");
    let f32 = run(&Cpu::<F32>::default(), &qkv, Some(&sinks), &batch);
    assert!(max_err(&f32, &want) <= 1e-5, "cpu f32 vs reference: {:e}", max_err(&f32, &want));
    let bf16 = run(&Cpu::<Bf16>::default(), &qkv, Some(&sinks), &batch);
    assert!(max_err(&bf16, &want) <= 3e-2, "cpu bf16 vs reference: {:e}", max_err(&bf16, &want));
}

/// The reference backend's f64 recurrence (token by token) against HF run in f64 on the same
/// weights, at the tight tolerance: its f64 arithmetic is the Gated DeltaNet's definition, so
/// what separates the f32 implementations (HYBRID_TOL) is f32 rounding, not a formula.
#[test]
fn reference_backend_matches_hf_f64_on_the_hybrids() {
    for name in HYBRID {
        let n = num_layers(name);
        let m =
            model::load(&fixture(name), LoadOptions { backend: BackendKind::Reference, ..Default::default() }).unwrap();
        let exp = read_tensors(&fixture(name).join("expected.safetensors"));
        let set = CaptureSet::<usize>::try_new(all_points(n)).unwrap();
        let mut worst = 0f32;
        for (i, ids) in samples(name).iter().enumerate() {
            let batch = PackedBatch::from_samples([ids.as_slice()]);
            let states = m.forward_step(&batch, &set, &mut Default::default()).unwrap();
            let f64_states = &exp[&format!("sample{i}.hidden_states_f64")];
            let per = ids.len() * f64_states.shape[2];
            for (slot, p) in all_points(n).iter().enumerate() {
                let Some(k) = p.hf_index(n) else { continue };
                let err = max_err(states.layer(slot), &f64_states.data[k * per..(k + 1) * per]);
                assert!(err <= TOL, "{name} sample {i} {p}: {err:e} from HF in f64");
                worst = worst.max(err);
            }
        }
        println!("{name}: reference vs HF f64 worst {worst:.2e}");
    }
}
