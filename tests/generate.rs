//! Generation: greedy tokens against transformers' `generate(do_sample=False)`
//! on every family fixture (`greedy.json`, written by
//! `scripts/make_greedy_fixtures.py`), on the CPU at `--tp 1` and `--tp 2`
//! and on the reference backend; and the same tokens whatever the batching.

use crate::common::*;
use serde_json::Value;
use strata::generate::{generate, DecodeOptions, DrawKey, Finish, Generated, SamplingParams, Sequence};
use strata::model::{self, AnyModel, BackendKind, LoadOptions, Model};
use strata::pipeline::capture::{CapturePoint, CaptureSet};

/// Every fixture with a `greedy.json`.
fn greedy_fixtures() -> Vec<(String, Value)> {
    let mut out: Vec<(String, Value)> = std::fs::read_dir(fixture(""))
        .unwrap()
        .filter_map(|e| {
            let e = e.unwrap();
            let text = std::fs::read_to_string(e.path().join("greedy.json")).ok()?;
            Some((e.file_name().to_string_lossy().into_owned(), serde_json::from_str(&text).unwrap()))
        })
        .collect();
    out.sort_by(|a, b| a.0.cmp(&b.0));
    out
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect()
}

fn load(name: &str, backend: BackendKind, tp: usize) -> AnyModel {
    let opts = LoadOptions { backend, tp, lm_head: true, ..Default::default() };
    model::load(&fixture(name), opts).unwrap_or_else(|e| panic!("{name} --tp {tp}: {e}"))
}

/// Greedy sequences of the fixture's prompts, EOS ignored (no stop ids).
fn sequences(doc: &Value) -> Vec<Sequence> {
    let n = doc["new_tokens"].as_u64().unwrap() as usize;
    doc["prompts"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| Sequence {
            prompt: ids(&p["input_ids"]),
            max_tokens: n,
            params: SamplingParams::greedy(),
            stop: Vec::new(),
            key: DrawKey { seed: 0, record: 0, generation: 0, position: 0 },
        })
        .collect()
}

fn run(m: &AnyModel, seqs: Vec<Sequence>, opts: DecodeOptions) -> Vec<Generated> {
    let captures = CaptureSet::<usize>::try_new(vec![CapturePoint::Embeddings]).unwrap();
    generate(m, &mut Default::default(), &captures, seqs, opts, |_, _| Ok(())).unwrap().0
}

const WIDE: DecodeOptions = DecodeOptions { max_batch_tokens: 8192, max_num_seqs: 64, kv_cache_bytes: None };

fn check(name: &str, what: &str, doc: &Value, got: &[Generated]) {
    for (i, (p, g)) in doc["prompts"].as_array().unwrap().iter().zip(got).enumerate() {
        let want = ids(&p["output"]);
        assert_eq!(g.finish, Finish::Length, "{name} {what} prompt {i}");
        assert_eq!(
            g.output,
            want,
            "{name} {what}: prompt {i} ({} tokens) generates other tokens than transformers",
            p["input_ids"].as_array().unwrap().len()
        );
    }
}

#[test]
fn greedy_tokens_are_transformers_on_every_fixture() {
    let fixtures = greedy_fixtures();
    assert!(fixtures.len() >= 20, "greedy.json of {} fixtures", fixtures.len());
    for (name, doc) in &fixtures {
        let m = load(name, BackendKind::Cpu, 1);
        check(name, "cpu --tp 1", doc, &run(&m, sequences(doc), WIDE));
    }
}

#[test]
fn greedy_tokens_are_transformers_at_tp_2() {
    for (name, doc) in &greedy_fixtures() {
        let m = load(name, BackendKind::Cpu, 2);
        check(name, "cpu --tp 2", doc, &run(&m, sequences(doc), WIDE));
    }
}

#[test]
fn greedy_tokens_are_transformers_on_the_reference_backend() {
    for (name, doc) in &greedy_fixtures() {
        let m = load(name, BackendKind::Reference, 1);
        check(name, "reference", doc, &run(&m, sequences(doc), WIDE));
    }
}

#[test]
fn greedy_tokens_do_not_depend_on_batching() {
    for name in ["llama-default", "qwen3-next", "deepseek-v3"] {
        let doc = &greedy_fixtures().into_iter().find(|(n, _)| n == name).unwrap().1;
        let m = load(name, BackendKind::Cpu, 1);
        let base = run(&m, sequences(doc), WIDE);
        for opts in [
            DecodeOptions { max_batch_tokens: 7, ..WIDE },
            DecodeOptions { max_batch_tokens: 64, max_num_seqs: 1, ..WIDE },
            DecodeOptions { max_batch_tokens: 3, max_num_seqs: 2, ..WIDE },
        ] {
            assert_eq!(run(&m, sequences(doc), opts), base, "{name} {opts:?}");
        }
    }
}

#[test]
fn a_model_loaded_without_its_head_cannot_sample() {
    let m = model::load(&fixture("llama-default"), LoadOptions::default()).unwrap();
    let captures = CaptureSet::<usize>::try_new(vec![CapturePoint::Embeddings]).unwrap();
    let batch = strata::pipeline::batch::PackedBatch::from_samples([&[1u32, 2, 3][..]]);
    let e = m.forward_sample_pending(&batch, &captures, &mut Default::default(), Some(&[2])).err().unwrap();
    assert!(e.to_string().contains("no LM head"), "{e}");
}

/// The CUDA backend's own code (the LM head's row gather and GEMM, decode
/// steps against its KV cache) on the CPU emulator: greedy tokens against
/// transformers' on a dense, an MLA + MoE and a hybrid fixture, over one or two ranks.
#[cfg(feature = "cuda")]
#[test]
fn greedy_tokens_are_transformers_on_the_emulated_cuda_backend() {
    use crate::cuda_emu::{gxx_or_skip, Emulated};
    use strata::backend::cuda::Cuda;
    use strata::backend::F32;
    use strata::hf::checkpoint::Checkpoint;
    use strata::model::AnyConfig;
    if !gxx_or_skip("greedy_tokens_are_transformers_on_the_emulated_cuda_backend") {
        return;
    }
    for (name, ranks) in [("llama-default", &[1, 2][..]), ("deepseek-v3", &[2]), ("qwen3-next", &[1])] {
        let doc = &greedy_fixtures().into_iter().find(|(n, _)| n == name).unwrap().1;
        for &tp in ranks {
            let dir = fixture(name);
            let config = AnyConfig::read(&dir).unwrap();
            let prefix = config.tensor_prefix();
            let b = Cuda::<F32, Emulated>::new(Emulated::default(), (0..tp).collect());
            let open = move || Checkpoint::open_scoped(&dir, &prefix);
            let m = config.load_on_with(b, tp, true, open).unwrap();
            check(name, &format!("emulated cuda --tp {tp}"), doc, &run(&m, sequences(doc), WIDE));
        }
    }
}

/// Sequences of equal length, each needing `1/k` of the budget: the cache
/// the backend holds never passes `--kv-cache-memory`, fills at least 90%
/// of it, and the tokens are those of an unbounded run.
#[test]
fn the_cache_stays_under_its_budget_and_fills_it() {
    for (name, tp) in [("llama-default", 1), ("qwen3-next", 1), ("deepseek-v3", 2)] {
        let m = load(name, BackendKind::Cpu, tp);
        let seqs: Vec<Sequence> = (0..24u32)
            .map(|i| Sequence {
                prompt: (0..20).map(|t| (t * 7 + i) % 100).collect(),
                max_tokens: 40,
                params: SamplingParams::default(),
                stop: Vec::new(),
                key: DrawKey { seed: 3, record: i as u128, generation: 0, position: 0 },
            })
            .collect();
        let captures = CaptureSet::<usize>::try_new(vec![CapturePoint::Embeddings]).unwrap();
        let cost = strata::generate::CacheCost::measure(&m, &mut Default::default(), &captures, 60).unwrap();
        assert!(cost.per_position > 0, "{name}: {cost:?}");
        let budget = cost.of(60) * 5 + cost.of(60) / 2; // room for 5 sequences, not 6
        let opts = DecodeOptions { kv_cache_bytes: Some(budget), ..WIDE };
        let (got, stats) = generate(&m, &mut Default::default(), &captures, seqs.clone(), opts, |_, _| Ok(())).unwrap();
        assert_eq!(stats.max_in_flight, 5, "{name}: {stats:?}");
        assert!(stats.cache_high_water <= budget, "{name}: held {} of {budget}", stats.cache_high_water);
        assert!(
            stats.cache_high_water as f64 >= 0.9 * budget as f64,
            "{name}: held only {} of {budget}",
            stats.cache_high_water
        );
        assert_eq!(stats.cache_high_water, 5 * cost.of(60), "{name}: the measured cost is what the cache holds");
        let (free, _) = generate(&m, &mut Default::default(), &captures, seqs, WIDE, |_, _| Ok(())).unwrap();
        assert_eq!(got, free, "{name}: the budget changed the tokens");
        // A sequence that cannot fit is refused by name, before any step.
        let big = vec![Sequence { max_tokens: 400, ..free_seq() }];
        let opts = DecodeOptions { kv_cache_bytes: Some(cost.of(100)), ..WIDE };
        let e = generate(&m, &mut Default::default(), &captures, big, opts, |_, _| Ok(())).unwrap_err().to_string();
        assert!(e.contains("--kv-cache-memory"), "{e}");
    }
}

fn free_seq() -> Sequence {
    Sequence {
        prompt: vec![1, 2, 3],
        max_tokens: 4,
        params: SamplingParams::default(),
        stop: Vec::new(),
        key: DrawKey { seed: 0, record: 0, generation: 0, position: 0 },
    }
}
