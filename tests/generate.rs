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
            park: false,
            continues: None,
        })
        .collect()
}

/// Fixture `name` on the CUDA backend's own code over the CPU emulator, at `tp` ranks, with its LM head.
#[cfg(feature = "cuda")]
fn emulated(name: &str, tp: usize) -> AnyModel {
    use crate::cuda_emu::Emulated;
    use strata::backend::cuda::Cuda;
    use strata::backend::F32;
    use strata::hf::checkpoint::Checkpoint;
    let dir = fixture(name);
    let config = strata::model::AnyConfig::read(&dir).unwrap();
    let prefix = config.tensor_prefix();
    let b = Cuda::<F32, Emulated>::new(Emulated::default(), (0..tp).collect());
    let open = move || Checkpoint::open_scoped(&dir, &prefix);
    config.load_on_with(b, tp, true, open).unwrap()
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
    use crate::cuda_emu::gxx_or_skip;
    if !gxx_or_skip("greedy_tokens_are_transformers_on_the_emulated_cuda_backend") {
        return;
    }
    for (name, ranks) in [("llama-default", &[1, 2][..]), ("deepseek-v3", &[2]), ("qwen3-next", &[1])] {
        let doc = &greedy_fixtures().into_iter().find(|(n, _)| n == name).unwrap().1;
        for &tp in ranks {
            let m = emulated(name, tp);
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
                park: false,
                continues: None,
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

/// A turn that continues the cache of the turn before it (the whole row,
/// or a common prefix cut back to) draws the tokens, and its fed positions
/// get the states, of the same prompt prefilled whole; a continuation that
/// cannot fit the budget starts over with the same result. Hybrid models
/// (a recurrent state) continue only whole rows.
#[test]
fn a_continued_cache_is_a_fresh_prefill() {
    for (name, tp, recurrent) in [("llama-default", 1, false), ("qwen3-next", 1, true), ("deepseek-v3", 2, false)] {
        check_continuation(name, &load(name, BackendKind::Cpu, tp), recurrent);
    }
}

/// The CUDA cache's side of [`a_continued_cache_is_a_fresh_prefill`]: a
/// continued entry cut back and grown to its new reservation, on the emulator.
#[cfg(feature = "cuda")]
#[test]
fn a_continued_cache_is_a_fresh_prefill_on_the_emulated_cuda_backend() {
    if !crate::cuda_emu::gxx_or_skip("a_continued_cache_is_a_fresh_prefill_on_the_emulated_cuda_backend") {
        return;
    }
    for (name, tp, recurrent) in [("llama-default", 1, false), ("qwen3-next", 1, true)] {
        check_continuation(&format!("{name} (emulated cuda)"), &emulated(name, tp), recurrent);
    }
}

fn check_continuation(name: &str, m: &AnyModel, recurrent: bool) {
    use strata::generate::Decode;
    let captures =
        CaptureSet::<usize>::try_new(vec![CapturePoint::LayerInput(1), CapturePoint::FinalPostNorm]).unwrap();
    let seq = |prompt: Vec<u32>, record: u128| Sequence {
        prompt,
        max_tokens: 12,
        params: SamplingParams { temperature: 0.9, ..SamplingParams::default() },
        stop: Vec::new(),
        key: DrawKey { seed: 5, record, generation: 0, position: 0 },
        park: true,
        continues: None,
    };
    // Each sequence's tokens and the states of its fed positions, by position.
    type Fed = std::collections::HashMap<usize, Vec<(usize, Vec<f32>)>>;
    // What to do when a sequence ends (add the next turn).
    type Then<'a> = Box<dyn FnMut(&mut Decode<'_, AnyModel, usize>, usize, &Generated) + 'a>;
    let drive =
        |d: &mut Decode<'_, AnyModel, usize>, cache: &mut model::AnyCache, fed: &mut Fed, mut then: Then<'_>| {
            let mut out = std::collections::HashMap::new();
            while !d.is_idle() {
                let done = d
                    .step(cache, |segs, states| {
                        let states = states.wait()?;
                        let mut row = 0;
                        for seg in segs {
                            for t in 0..seg.len {
                                let h = states.hidden();
                                let v: Vec<f32> =
                                    (0..2).flat_map(|l| states.layer(l)[(row + t) * h..][..h].to_vec()).collect();
                                fed.entry(seg.index).or_default().push((seg.pos0 + t, v));
                            }
                            row += seg.len;
                        }
                        Ok::<_, strata::model::ModelError>(())
                    })
                    .unwrap();
                for (i, g) in done {
                    then(d, i, &g);
                    out.insert(i, g);
                }
            }
            out
        };
    {
        let first: Vec<u32> = (0..30).map(|t| (t * 11 + 3) % 100).collect();
        // A sequence beside the first, running longer.
        let other = Sequence { max_tokens: 30, park: false, ..seq((0..30).map(|t| (t * 5 + 1) % 100).collect(), 9) };
        for (budget, cut) in [(false, false), (false, true), (true, false)] {
            if cut && recurrent {
                continue;
            }
            let mut cache = model::AnyCache::default();
            let mut opts = DecodeOptions { max_batch_tokens: 16, max_num_seqs: 4, kv_cache_bytes: None };
            if budget {
                // Room for the first turn and the other sequence, not for the next turn beside it.
                let probe = DecodeOptions { kv_cache_bytes: Some(usize::MAX), ..opts };
                let p = Decode::new(m, &mut cache, captures.clone(), probe, 200).unwrap();
                opts.kv_cache_bytes = Some(p.need(&seq(first.clone(), 0)) + p.need(&other));
            }
            let mut d = Decode::new(m, &mut cache, captures.clone(), opts, 200).unwrap();
            d.add(0, seq(first.clone(), 0)).unwrap();
            d.add(2, other.clone()).unwrap();
            let mut fed = Fed::new();
            let mut next_prompt = Vec::new();
            let mut reused = usize::MAX;
            let out = drive(
                &mut d,
                &mut cache,
                &mut fed,
                Box::new(|d, i, g| {
                    if i != 0 {
                        return;
                    }
                    let mut row = first.clone();
                    row.extend(&g.output);
                    // The next turn: the whole row and more, or its first 20 tokens and others.
                    let shared = if cut { 20 } else { row.len() };
                    let mut p = row[..shared].to_vec();
                    p.extend([7, 8, 9, 10, 11]);
                    next_prompt = p.clone();
                    let next = Sequence { continues: Some((0, shared)), park: false, ..seq(p, 1) };
                    reused = d.add(1, next).unwrap();
                }),
            );
            let what = format!("{name} budget {budget:?} cut {cut}");
            match budget {
                false => assert_eq!(reused, if cut { 20 } else { 42 }, "{what}"),
                true => assert_eq!(reused, 0, "{what}: a continuation that does not fit starts over"),
            }
            assert_eq!(d.stats().reused, reused, "{what}");
            // The second turn alone, prefilled whole.
            let mut fresh_cache = model::AnyCache::default();
            let mut f = Decode::new(m, &mut fresh_cache, captures.clone(), opts, 200).unwrap();
            f.add(1, Sequence { park: false, ..seq(next_prompt.clone(), 1) }).unwrap();
            let mut fresh_fed = Fed::new();
            let fresh = drive(&mut f, &mut fresh_cache, &mut fresh_fed, Box::new(|_, _, _| {}));
            assert_eq!(out[&1], fresh[&1], "{what}: other tokens");
            let want: std::collections::HashMap<usize, Vec<f32>> = fresh_fed.remove(&1).unwrap().into_iter().collect();
            let got = &fed[&1];
            assert_eq!(got.first().unwrap().0, reused, "{what}: fed from the first position not cached");
            assert_eq!(got.len() + reused, want.len(), "{what}");
            for (pos, v) in got {
                assert!(want[pos] == *v, "{what}: the states of position {pos} differ from a whole prefill's");
            }
        }
    }
}

/// A prefill (max_tokens 0) beside generations: its prompt's states are
/// those of a forward of the prompt alone, it draws nothing and ends with
/// its last chunk, and the generations beside it draw their tokens as
/// without it. `abort` hands back what was in flight and queued.
#[test]
fn a_prefill_rides_with_generations() {
    use strata::generate::Decode;
    let m = load("llama-default", BackendKind::Cpu, 1);
    let captures =
        CaptureSet::<usize>::try_new(vec![CapturePoint::LayerInput(1), CapturePoint::FinalPostNorm]).unwrap();
    let gens: Vec<Sequence> = (0..3u32)
        .map(|i| Sequence {
            prompt: (0..9 + i).map(|t| (t * 13 + i) % 100).collect(),
            max_tokens: 10,
            params: SamplingParams { temperature: 0.8, ..SamplingParams::default() },
            key: DrawKey { seed: 2, record: i as u128, generation: 0, position: 0 },
            ..free_seq()
        })
        .collect();
    let prompt: Vec<u32> = (0..37).map(|t| (t * 7 + 1) % 100).collect();
    let prefill = Sequence { prompt: prompt.clone(), max_tokens: 0, ..free_seq() };
    let opts = DecodeOptions { max_batch_tokens: 16, max_num_seqs: 8, kv_cache_bytes: None };
    let mut cache = model::AnyCache::default();
    let mut d = Decode::new(&m, &mut cache, captures.clone(), opts, 100).unwrap();
    for (i, s) in gens.iter().enumerate() {
        d.add(i, s.clone()).unwrap();
    }
    d.add(9, prefill).unwrap();
    let mut rows: Vec<(usize, Vec<f32>)> = Vec::new();
    let mut done = std::collections::HashMap::new();
    while !d.is_idle() {
        let finished = d
            .step(&mut cache, |segs, states| {
                let states = states.wait()?;
                let (h, mut row) = (states.hidden(), 0);
                for seg in segs {
                    if seg.index == 9 {
                        for t in 0..seg.len {
                            let v = (0..2).flat_map(|l| states.layer(l)[(row + t) * h..][..h].to_vec()).collect();
                            rows.push((seg.pos0 + t, v));
                        }
                    }
                    row += seg.len;
                }
                Ok::<_, strata::model::ModelError>(())
            })
            .unwrap();
        done.extend(finished);
    }
    assert_eq!(done[&9], Generated { output: vec![], finish: Finish::Length }, "a prefill draws nothing");
    assert_eq!(rows.iter().map(|r| r.0).collect::<Vec<_>>(), (0..37).collect::<Vec<_>>(), "fed once, in order");
    let whole = strata::pipeline::batch::PackedBatch::from_samples([&prompt[..]]);
    let alone = m.forward_step(&whole, &captures, &mut Default::default()).unwrap();
    for (pos, v) in &rows {
        let h = alone.hidden();
        let want: Vec<f32> = (0..2).flat_map(|l| alone.layer(l)[pos * h..][..h].to_vec()).collect();
        assert!(want == *v, "position {pos}: the prefill's states are not the prompt's forward");
    }
    let (free, _) = generate(&m, &mut Default::default(), &captures, gens.clone(), WIDE, |_, _| Ok(())).unwrap();
    for (i, g) in free.iter().enumerate() {
        assert_eq!(done[&i], *g, "generation {i} changed beside a prefill");
    }
    // A prefill begun with no generation in flight runs to the capture depth, on a model
    // without its LM head too; a generation that arrives mid-way waits out its chunks.
    for head in [false, true] {
        let m = model::load(&fixture("llama-default"), LoadOptions { lm_head: head, ..Default::default() }).unwrap();
        let mut cache = model::AnyCache::default();
        let mut d = Decode::new(&m, &mut cache, captures.clone(), opts, 100).unwrap();
        d.add(9, Sequence { prompt: prompt.clone(), max_tokens: 0, ..free_seq() }).unwrap();
        let mut fed = Vec::new();
        let mut done = std::collections::HashMap::new();
        let mut steps = 0;
        while !d.is_idle() {
            if steps == 1 && head {
                d.add(0, gens[0].clone()).unwrap();
            }
            steps += 1;
            let finished = d
                .step(&mut cache, |segs, states| {
                    let states = states.wait()?;
                    let (h, mut row) = (states.hidden(), 0);
                    for seg in segs {
                        for t in 0..seg.len {
                            let v: Vec<f32> =
                                (0..2).flat_map(|l| states.layer(l)[(row + t) * h..][..h].to_vec()).collect();
                            fed.push((seg.index, seg.pos0 + t, v));
                        }
                        row += seg.len;
                    }
                    Ok::<_, strata::model::ModelError>(())
                })
                .unwrap();
            done.extend(finished);
        }
        let first_gen = fed.iter().position(|f| f.0 == 0);
        let last_prefill = fed.iter().rposition(|f| f.0 == 9).unwrap();
        assert!(first_gen.is_none_or(|g| g > last_prefill), "a generation ran beside a shallow prefill");
        for (_, pos, v) in fed.iter().filter(|f| f.0 == 9) {
            let h = alone.hidden();
            let want: Vec<f32> = (0..2).flat_map(|l| alone.layer(l)[pos * h..][..h].to_vec()).collect();
            assert!(want == *v, "head {head}: position {pos} of the shallow prefill");
        }
        if head {
            assert_eq!(done[&0], free[0], "the generation that waited");
        }
    }
    // Aborted: the sequences in flight by index, the queued ones back.
    let mut d = Decode::new(&m, &mut cache, captures.clone(), DecodeOptions { max_num_seqs: 1, ..opts }, 100).unwrap();
    d.add(0, gens[0].clone()).unwrap();
    d.add(1, gens[1].clone()).unwrap();
    d.step(&mut cache, |_, s| s.wait().map(drop)).unwrap();
    let (running, waiting) = d.abort();
    assert_eq!((running, waiting.len(), waiting[0].0), (vec![0], 1, 1));
    assert!(d.is_idle());
}

fn free_seq() -> Sequence {
    Sequence {
        prompt: vec![1, 2, 3],
        max_tokens: 4,
        params: SamplingParams::default(),
        stop: Vec::new(),
        key: DrawKey { seed: 0, record: 0, generation: 0, position: 0 },
        park: false,
        continues: None,
    }
}

/// `strata generate --model DIR --data DATA --out OUT` for fixture `name`'s
/// model (and its data.jsonl unless `data` is given).
fn generate_cmd(name: &str, data: Option<&std::path::Path>, out: &std::path::Path) -> std::process::Command {
    let mut c = std::process::Command::new(env!("CARGO_BIN_EXE_strata"));
    c.arg("generate").arg("--model").arg(fixture(name)).arg("--data");
    match data {
        Some(d) => c.arg(d),
        None => c.arg(fixture(name).join("data.jsonl")),
    };
    c.arg("--out").arg(out);
    c
}

/// `strata generate` on fixture `name` into `out`, with `extra` options; its stderr on failure.
fn generate_cli(name: &str, out: &std::path::Path, extra: &[&str]) {
    let o = generate_cmd(name, None, out)
        .args(["--capture", "input:1,final", "--dtype", "f32", "--compute", "f32", "--seed", "11"])
        .args(["--temperature", "0.8", "--top-p", "0.9", "--max-tokens", "9"])
        .args(extra)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success() && !err.contains("panicked"), "{name} generate {extra:?}: {err}");
}

/// The rows of a speculators directory, read back from its hs files as JSON Lines of
/// `input_ids` and `loss_mask`.
fn rows_of(out: &std::path::Path) -> (String, usize) {
    let mut text = String::new();
    let mut i = 0;
    while let Ok(true) = std::fs::exists(out.join(format!("hidden_states/hs_{i}.safetensors"))) {
        let t = read_tensors(&out.join(format!("hidden_states/hs_{i}.safetensors")));
        let ids: Vec<u32> = t["token_ids"].data.iter().map(|&x| x as u32).collect();
        let mask: Vec<u8> = t["loss_mask"].data.iter().map(|&x| x as u8).collect();
        text += &serde_json::json!({"input_ids": ids, "loss_mask": mask}).to_string();
        text.push('\n');
        i += 1;
    }
    (text, i)
}

/// Every file of a dataset directory but the manifest (whose run-specific
/// fields differ), as bytes.
fn files_of(out: &std::path::Path) -> Vec<(String, Vec<u8>)> {
    let mut v = Vec::new();
    for dir in [out.to_path_buf(), out.join("hidden_states")] {
        for e in std::fs::read_dir(&dir).unwrap() {
            let p = e.unwrap().path();
            if p.is_file() && p.file_name().unwrap() != "manifest.json" {
                v.push((p.strip_prefix(out).unwrap().display().to_string(), std::fs::read(&p).unwrap()));
            }
        }
    }
    v.sort();
    v
}

/// One pass equals two: each generated row's hs file (and the rows' table)
/// is byte for byte what `strata extract --format speculators` writes for
/// the same ids and masks, on every fixture, on the cpu and reference backends.
#[test]
fn one_pass_equals_two_on_every_fixture() {
    for (name, _) in &greedy_fixtures() {
        for backend in ["cpu", "reference"] {
            let tmp = tempfile::tempdir().unwrap();
            let (gen, ext) = (tmp.path().join("gen"), tmp.path().join("ext"));
            generate_cli(name, &gen, &["--backend", backend]);
            let (rows, n) = rows_of(&gen);
            assert_eq!(n, samples(name).len(), "{name}: one row per prompt");
            let data = tmp.path().join("rows.jsonl");
            std::fs::write(&data, rows).unwrap();
            let o = std::process::Command::new(env!("CARGO_BIN_EXE_strata"))
                .args(["extract", "--format", "speculators", "--backend", backend])
                .arg("--model")
                .arg(fixture(name))
                .arg("--data")
                .arg(&data)
                .arg("--out")
                .arg(&ext)
                .args(["--capture", "input:1,final", "--dtype", "f32", "--compute", "f32"])
                .output()
                .unwrap();
            assert!(o.status.success(), "{name}: {}", String::from_utf8_lossy(&o.stderr));
            let mut g = files_of(&gen);
            g.retain(|(n, _)| n != "regenerated.jsonl"); // generate's own, beside the dataset
            let e = files_of(&ext);
            assert_eq!(g.len(), e.len(), "{name} {backend}");
            for ((gn, gb), (en, eb)) in g.iter().zip(&e) {
                assert_eq!(gn, en);
                assert!(gb == eb, "{name} {backend}: {gn} differs from extract's");
            }
        }
    }
}

/// The same input and seed give the same bytes whatever the batching.
#[test]
fn generated_datasets_do_not_depend_on_batching() {
    // Budgets that hold one or two of the fixtures' sequences at a time.
    for (name, budget) in [("llama-default", "150KiB"), ("qwen3-next", "1300KiB"), ("deepseek-v3", "120KiB")] {
        let tmp = tempfile::tempdir().unwrap();
        let base = tmp.path().join("base");
        generate_cli(name, &base, &[]);
        let want = files_of(&base);
        for (i, extra) in [
            &["--max-batch-tokens", "7"][..],
            &["--max-batch-tokens", "64", "--max-num-seqs", "1"],
            &["--max-num-seqs", "64", "--kv-cache-memory", budget],
        ]
        .iter()
        .enumerate()
        {
            let out = tmp.path().join(format!("run{i}"));
            generate_cli(name, &out, extra);
            let got = files_of(&out);
            assert_eq!(got.len(), want.len(), "{name} {extra:?}");
            for ((gn, gb), (_, wb)) in got.iter().zip(&want) {
                assert!(gb == wb, "{name} {extra:?}: {gn} differs");
            }
        }
    }
}

#[test]
fn generate_refuses_what_it_cannot_do_by_name() {
    let tmp = tempfile::tempdir().unwrap();
    let run = |extra: &[&str]| {
        let o = generate_cmd("llama-default", None, &tmp.path().join("o")).args(extra).output().unwrap();
        let err = String::from_utf8_lossy(&o.stderr).to_string();
        assert!(!o.status.success() && !err.contains("panicked"), "{extra:?}: {err}");
        err
    };
    assert!(run(&["--top-p", "1.5"]).contains("top_p must be in (0, 1], got 1.5"));
    assert!(run(&["--temperature", "-1"]).contains("temperature must be non-negative"));
    assert!(run(&["--top-k", "-3"]).contains("top_k must be 0 (disable), or at least 1"));
    // No --max-tokens: a response may run to position 256, 512 KiB of this model's cache.
    assert!(run(&["--kv-cache-memory", "100KiB"]).contains("give --max-tokens"));
    assert!(run(&["--on-nonfinite", "skip"]).contains("drop the flag"));
    assert!(run(&["--rows", "per-conversation"]).contains("[possible values: per-turn, auto]"));
}

/// A record whose cache cannot fit the budget is left out by name; the run goes on.
#[test]
fn a_record_that_cannot_fit_the_cache_is_left_out() {
    let tmp = tempfile::tempdir().unwrap();
    let o = generate_cmd("llama-default", None, &tmp.path().join("o"))
        .args(["--max-tokens", "4", "--kv-cache-memory", "20KiB"])
        .output()
        .unwrap();
    let (stdout, err) = (String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr));
    assert!(o.status.success(), "{err}");
    // 2048 bytes per position: the prompts of 1 and 6 tokens fit 20 KiB, those of 19 and 40 do not.
    assert!(err.contains("need 47104 bytes of cache, more than --kv-cache-memory (20480 bytes)"), "{err}");
    assert!(stdout.contains("2 rows, 2 records left out"), "{stdout}");
}

/// A prompt whose response would pass the model's positions is left out,
/// by name, and the others are written.
#[test]
fn a_prompt_too_long_for_max_tokens_is_refused_alone() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("o");
    // llama-gqa-sharded has 64 positions; its samples are 1 to 40 tokens long.
    let o = generate_cmd("llama-gqa-sharded", None, &out).args(["--max-tokens", "30", "--seed", "1"]).output().unwrap();
    let (stdout, err) = (String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr));
    assert!(o.status.success(), "{err}");
    assert!(err.contains("pass the model's 64 positions"), "{err}");
    let lens: Vec<usize> = samples("llama-gqa-sharded").iter().map(Vec::len).collect();
    let fit = lens.iter().filter(|&&n| n + 30 <= 64).count();
    assert!(fit < lens.len() && fit > 0, "{lens:?}");
    assert!(stdout.contains(&format!("{fit} rows, {} records left out", lens.len() - fit)), "{stdout}");
}

/// A generation killed mid-run resumes to the bytes of an uninterrupted run,
/// with the seed the output recorded; another seed is refused as another job.
#[test]
fn a_killed_generation_resumes_to_the_same_bytes() {
    use std::time::{Duration, Instant};
    let tmp = tempfile::tempdir().unwrap();
    let data = tmp.path().join("prompts.jsonl");
    let lines: String = (0..400u32)
        .map(|i| {
            let ids: Vec<u32> = (0..(10 + i % 40)).map(|t| (t * 31 + i * 7) % 256).collect();
            format!("{}\n", serde_json::json!({ "input_ids": ids }))
        })
        .collect();
    std::fs::write(&data, lines).unwrap();
    let cmd = |out: &std::path::Path, extra: &[&str]| {
        let mut c = generate_cmd("llama-default", Some(&data), out);
        c.args(["--max-tokens", "24", "--temperature", "0.9", "--max-num-seqs", "8", "--compute", "f32"]).args(extra);
        c
    };
    // No --seed: the first run draws one and records it.
    let whole = tmp.path().join("whole");
    let o = cmd(&whole, &[]).output().unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let seed = strata::dataset::manifest::Manifest::read(&whole).unwrap().generation.unwrap().seed;

    let cut = tmp.path().join("cut");
    let seed_arg = seed.to_string();
    let mut child = cmd(&cut, &["--seed", &seed_arg])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let start = Instant::now();
    loop {
        let files = strata::dataset::manifest::Manifest::read(&cut).map(|m| m.shards.len()).unwrap_or(0);
        if files >= 30 {
            break;
        }
        assert!(child.try_wait().unwrap().is_none(), "the run finished before it could be killed");
        assert!(start.elapsed() < Duration::from_secs(120), "no rows after 120 s");
        std::thread::sleep(Duration::from_millis(2));
    }
    child.kill().unwrap();
    child.wait().unwrap();
    assert!(!strata::dataset::manifest::Manifest::read(&cut).unwrap().complete, "the run was not interrupted");
    // Without --seed: the recorded one.
    let o = cmd(&cut, &["--resume"]).output().unwrap();
    let stdout = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(stdout.contains("of an earlier run"), "{stdout}");
    let (a, b) = (files_of(&whole), files_of(&cut));
    assert_eq!(a.len(), b.len());
    for ((an, ab), (_, bb)) in a.iter().zip(&b) {
        assert!(ab == bb, "{an}: the resumed output differs from the uninterrupted run");
    }
    let o = cmd(&cut, &["--resume", "--seed", &(seed ^ 1).to_string()]).output().unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success() && err.contains("generation differs"), "{err}");
}

/// `regenerated.jsonl`: a line per generation in the layout of `speculators
/// regenerate-responses`, its ids and masks the dataset's rows.
#[test]
fn regenerated_jsonl_holds_each_generation_as_speculators_writes_it() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("o");
    generate_cli("llama-default", &out, &["--stop-token-ids", "5,17"]);
    let text = std::fs::read_to_string(out.join("regenerated.jsonl")).unwrap();
    let (rows, n) = rows_of(&out);
    // --stop-token-ids, and config.json's eos_token_id (the fixture has no generation_config.json).
    let stop = strata::dataset::manifest::Manifest::read(&out).unwrap().generation.unwrap().stop_token_ids;
    let eos =
        serde_json::from_str::<Value>(&std::fs::read_to_string(fixture("llama-default").join("config.json")).unwrap())
            .unwrap()["eos_token_id"]
            .as_u64()
            .map(|e| e as u32);
    assert_eq!(stop, [&[5u32, 17][..], eos.as_slice()].concat());
    assert_eq!(text.lines().count(), n);
    for (i, (line, row)) in text.lines().zip(rows.lines()).enumerate() {
        let v: Value = serde_json::from_str(line).unwrap();
        let row: Value = serde_json::from_str(row).unwrap();
        let keys: Vec<&str> = v.as_object().unwrap().keys().map(String::as_str).collect();
        // No tokenizer in the fixture: no text.
        assert_eq!(keys, ["id", "primary_id", "input_ids", "loss_mask", "metadata"]);
        assert_eq!(v["id"], format!("{i}_gen0"));
        assert_eq!(v["primary_id"], i.to_string());
        assert_eq!((&v["input_ids"], &v["loss_mask"]), (&row["input_ids"], &row["loss_mask"]));
        let m = &v["metadata"];
        let completion = row["loss_mask"].as_array().unwrap().iter().filter(|x| x.as_u64() == Some(1)).count();
        let total = row["input_ids"].as_array().unwrap().len();
        assert_eq!(m["usage"]["completion_tokens"], completion);
        assert_eq!(m["usage"]["prompt_tokens"], total - completion);
        assert_eq!(m["usage"]["total_tokens"], total);
        let last = row["input_ids"].as_array().unwrap().last().unwrap().as_u64().unwrap();
        let want = if stop.contains(&(last as u32)) { "stop" } else { "length" };
        assert_eq!(m["finish_reason"], want, "row {i}");
        assert_eq!(m["is_tool_call"], false);
        assert_eq!(m["idx"], i);
        assert_eq!(m["sampling_params"]["seed"], 11);
        assert_eq!(m["sampling_params"]["top_p"], 0.9f32 as f64);
    }
}

/// A record with ids outside the vocabulary is left out alone, by name.
#[test]
fn a_record_with_ids_outside_the_vocabulary_is_left_out_alone() {
    let tmp = tempfile::tempdir().unwrap();
    let data = tmp.path().join("d.jsonl");
    std::fs::write(&data, "{\"input_ids\": [1, 2]}\n{\"input_ids\": [3, 999]}\n{\"input_ids\": [4]}\n").unwrap();
    let o =
        generate_cmd("llama-default", Some(&data), &tmp.path().join("o")).args(["--max-tokens", "3"]).output().unwrap();
    let (stdout, err) = (String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr));
    assert!(o.status.success(), "{err}");
    assert!(err.contains("input_ids[1] = 999 is out of range (vocab_size 256)"), "{err}");
    assert!(stdout.contains("2 rows, 1 records left out"), "{stdout}");
}

/// Conversations for the regeneration tests: the chat fixture's, a bare
/// prompt, a ShareGPT one, and records the tool refuses.
fn conversations(dir: &std::path::Path) -> std::path::PathBuf {
    let chat = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/chat");
    let mut text = std::fs::read_to_string(chat.join("conversations.openai.jsonl")).unwrap();
    for extra in [
        serde_json::json!({"prompt": "Write a haiku about rust."}),
        serde_json::json!({"conversations": [{"from": "system", "value": "Be terse."}, {"from": "human", "value": "One?"},
            {"from": "gpt", "value": "1"}, {"from": "human", "value": "Two?"}, {"from": "gpt", "value": "2"},
            {"from": "human", "value": "Three?"}]}),
        serde_json::json!({"id": "only-assistant", "messages": [{"role": "assistant", "content": "hi"}]}),
    ] {
        text += &format!("{extra}\n");
    }
    let path = dir.join("conversations.jsonl");
    std::fs::write(&path, text).unwrap();
    path
}

/// `strata generate` on conversations with the chat fixture's tokenizer and `template`.
fn generate_chat(model: &std::path::Path, data: &std::path::Path, out: &std::path::Path, extra: &[&str]) -> String {
    let o = std::process::Command::new(env!("CARGO_BIN_EXE_strata"))
        .arg("generate")
        .arg("--model")
        .arg(model)
        .arg("--data")
        .arg(data)
        .arg("--out")
        .arg(out)
        .args(["--capture", "input:1,final", "--dtype", "f32", "--compute", "f32", "--seed", "5"])
        .args(["--temperature", "1", "--max-tokens", "300", "--chat-date", "2026-01-15"])
        // Stop ids the tiny model draws now and then: replies of a few tokens, so that
        // conversations go on to their next turns.
        .args(["--stop-token-ids", "3,40,77,120,150,201,260,301,333,380"])
        .args(extra)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr).to_string();
    assert!(o.status.success() && !err.contains("panicked"), "generate {extra:?}: {err}");
    String::from_utf8_lossy(&o.stdout).to_string()
}

/// `regenerated.jsonl` of `out`, parsed.
fn regenerated(out: &std::path::Path) -> Vec<Value> {
    let text = std::fs::read_to_string(out.join("regenerated.jsonl")).unwrap();
    text.lines().map(|l| serde_json::from_str(l).unwrap()).collect()
}

/// Conversations regenerate as speculators' tool runs them against vLLM:
/// one row per generation, `{primary_id}_gen{k}`, the history holding each
/// reply's content (special tokens skipped, the stop token dropped); the
/// records it refuses are refused, alone.
#[test]
fn conversations_regenerate_turn_by_turn() {
    let tmp = tempfile::tempdir().unwrap();
    let model = chat_model(tmp.path(), "chatml");
    let data = conversations(tmp.path());
    let out = tmp.path().join("o");
    let said = generate_chat(&model, &data, &out, &[]);
    // Later turns continue the cache of the turn before (what their prompts share).
    let kept = said.split("prompt tokens: ").nth(1).expect("the summary counts prompt tokens");
    let nums: Vec<usize> = kept.split(|c: char| !c.is_ascii_digit()).filter_map(|w| w.parse().ok()).take(2).collect();
    assert!(nums[1] > 0 && nums[0] > 0, "prefilled and kept: {nums:?} in {said}");
    let lines = regenerated(&out);
    let chat = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/chat");
    let config: Value =
        serde_json::from_str(&std::fs::read_to_string(chat.join("tokenizer_config.json")).unwrap()).unwrap();
    let tokenizer = strata::chat::Tokenizer::load(&model, &config).unwrap();
    let stops: Vec<u32> = strata::dataset::manifest::Manifest::read(&out).unwrap().generation.unwrap().stop_token_ids;
    let (rows, n) = rows_of(&out);
    assert_eq!(n, lines.len(), "one row per generation");
    let mut turns = std::collections::BTreeMap::<String, usize>::new();
    let mut prev: Option<&Value> = None;
    for (line, row) in lines.iter().zip(rows.lines()) {
        let row: Value = serde_json::from_str(row).unwrap();
        assert_eq!((&line["input_ids"], &line["loss_mask"]), (&row["input_ids"], &row["loss_mask"]));
        let primary = line["primary_id"].as_str().unwrap();
        let k = turns.entry(primary.to_string()).or_default();
        assert_eq!(line["id"], format!("{primary}_gen{k}"));
        *k += 1;
        let mask: Vec<u64> = line["loss_mask"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap()).collect();
        let p = mask.iter().position(|&m| m == 1).unwrap();
        assert!(mask[p..].iter().all(|&m| m == 1) && mask[..p].iter().all(|&m| m == 0));
        assert_eq!(line["metadata"]["usage"]["prompt_tokens"], p);
        if let Some(before) = prev.filter(|b| b["primary_id"] == line["primary_id"]) {
            // The history holds the reply as vLLM returns its content.
            let ids: Vec<u32> =
                before["input_ids"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as u32).collect();
            let start = before["metadata"]["usage"]["prompt_tokens"].as_u64().unwrap() as usize;
            let mut out_ids = &ids[start..];
            if before["metadata"]["finish_reason"] == "stop" {
                assert!(stops.contains(out_ids.last().unwrap()));
                out_ids = &out_ids[..out_ids.len() - 1];
            }
            let content = tokenizer.decode_content(&ids[..start], out_ids, true).unwrap();
            let text = line["text"].as_str().unwrap();
            let prompt_text = tokenizer.decode(&ids[..start]).unwrap();
            assert!(text.starts_with(&prompt_text), "the history grows: {text:?}");
            assert!(
                text[prompt_text.len()..].starts_with(&format!("{content}<|im_end|>\n<|im_start|>user\n")),
                "{content:?} in {text:?}"
            );
        }
        prev = Some(line);
    }
    assert!(turns.values().any(|&k| k >= 3), "a conversation ran three turns: {turns:?}");
    let m = strata::dataset::manifest::Manifest::read(&out).unwrap();
    let refused: Vec<(&str, &str)> = m.skipped.iter().map(|s| (s.id.as_str(), s.reason.as_str())).collect();
    for (id, why) in [
        ("empty", "no user turn"),
        ("only-assistant", "no user turn"),
        ("tools", "the record has `tools`, and \"auto\" tool choice needs --tool-call-parser"),
    ] {
        assert!(refused.iter().any(|(i, r)| *i == id && r.starts_with(why)), "{id}: {refused:?}");
    }

    // The same bytes whatever the batching; --rows auto writes the same generations.
    for (i, extra) in [
        &["--max-num-seqs", "1", "--max-batch-tokens", "7"][..],
        &["--max-num-seqs", "64", "--max-batch-tokens", "64"],
        &["--rows", "auto"],
    ]
    .iter()
    .enumerate()
    {
        let other = tmp.path().join(format!("run{i}"));
        generate_chat(&model, &data, &other, extra);
        assert!(
            std::fs::read(other.join("regenerated.jsonl")).unwrap()
                == std::fs::read(out.join("regenerated.jsonl")).unwrap(),
            "{extra:?}: regenerated.jsonl differs"
        );
        if extra[0] != "--rows" {
            assert!(files_of(&other) == files_of(&out), "{extra:?}: the dataset differs");
            continue;
        }
        // Merged rows: a row per chain of prefixes, each the last generation's ids with every span's loss.
        let (merged, m) = rows_of(&other);
        // The tiny model's replies hold special tokens and stop on ids other than
        // <|im_end|>, so the next prompt seldom starts with a row's tokens (`merge` is
        // tested on rows that do in the job's unit tests); whatever merged, each
        // generation lies in a merged row.
        assert!(m <= n);
        let last_of: std::collections::HashMap<Vec<u64>, Vec<u64>> = merged
            .lines()
            .map(|l| {
                let v: Value = serde_json::from_str(l).unwrap();
                let f = |k: &str| v[k].as_array().unwrap().iter().map(|x| x.as_u64().unwrap()).collect::<Vec<u64>>();
                (f("input_ids"), f("loss_mask"))
            })
            .collect();
        for l in &lines {
            let f = |k: &str| l[k].as_array().unwrap().iter().map(|x| x.as_u64().unwrap()).collect::<Vec<u64>>();
            let ids = f("input_ids");
            // Each generation is a prefix of a merged row, its span among that row's ones.
            let (row_ids, row_mask) = last_of.iter().find(|(r, _)| r.starts_with(&ids)).expect("a merged row holds it");
            let mask = f("loss_mask");
            assert!(mask.iter().zip(row_mask).all(|(&a, &b)| a <= b), "{:?}", row_ids.len());
        }
    }
}

/// One pass equals two for conversations, and a run killed between the
/// rows of one conversation resumes to the uninterrupted bytes.
#[test]
fn regenerated_conversations_are_extracts_and_resume() {
    let tmp = tempfile::tempdir().unwrap();
    let model = chat_model(tmp.path(), "chatml");
    let data = conversations(tmp.path());
    let out = tmp.path().join("o");
    generate_chat(&model, &data, &out, &[]);
    let (rows, _) = rows_of(&out);
    let rows_file = tmp.path().join("rows.jsonl");
    std::fs::write(&rows_file, rows).unwrap();
    let ext = tmp.path().join("ext");
    let o = std::process::Command::new(env!("CARGO_BIN_EXE_strata"))
        .args([
            "extract",
            "--format",
            "speculators",
            "--capture",
            "input:1,final",
            "--dtype",
            "f32",
            "--compute",
            "f32",
        ])
        .arg("--model")
        .arg(&model)
        .arg("--data")
        .arg(&rows_file)
        .arg("--out")
        .arg(&ext)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let mut g = files_of(&out);
    g.retain(|(n, _)| n != "regenerated.jsonl");
    assert!(g == files_of(&ext), "a generated conversation's files differ from extract's");

    let mut partial = 0;
    for k in 1..=12 {
        let cut = tmp.path().join(format!("cut{k}"));
        let o = std::process::Command::new(env!("CARGO_BIN_EXE_strata"))
            .env("STRATA_FAILPOINT", format!("journaled:{k}"))
            .arg("generate")
            .arg("--model")
            .arg(&model)
            .arg("--data")
            .arg(&data)
            .arg("--out")
            .arg(&cut)
            .args(["--capture", "input:1,final", "--dtype", "f32", "--compute", "f32", "--seed", "5"])
            .args(["--temperature", "1", "--max-tokens", "300", "--chat-date", "2026-01-15"])
            .args(["--stop-token-ids", "3,40,77,120,150,201,260,301,333,380", "--max-num-seqs", "2"])
            .output()
            .unwrap();
        if o.status.success() {
            break; // fewer commits than k
        }
        // The files that made it (one journaled but not renamed in is written again).
        let m = strata::dataset::manifest::Manifest::read(&cut).unwrap();
        let kept = m.shards.iter().take_while(|s| cut.join(&s.file).exists()).count();
        let done = m.shards[..kept].last().and_then(|s| s.input.as_ref()).map_or(0, |p| p.samples);
        partial += m.samples.iter().any(|s| s.shard < kept && s.index == Some(done)) as usize;
        generate_chat(&model, &data, &cut, &["--resume"]);
        let (c, w) = (files_of(&cut), files_of(&out));
        let names = |v: &[(String, Vec<u8>)]| v.iter().map(|(n, _)| n.clone()).collect::<Vec<_>>();
        assert_eq!(names(&c), names(&w), "killed at commit {k}");
        for ((n, a), (_, b)) in c.iter().zip(&w) {
            assert!(a == b, "killed at commit {k}: {n} differs from the uninterrupted run's");
        }
    }
    assert!(partial > 0, "no kill fell between the rows of one conversation");
}

/// `--no-states` writes the same rows (table and regenerated.jsonl) with no states.
#[test]
fn no_states_regenerates_the_same_rows() {
    let tmp = tempfile::tempdir().unwrap();
    let (a, b) = (tmp.path().join("a"), tmp.path().join("b"));
    generate_cli("llama-default", &a, &[]);
    generate_cli("llama-default", &b, &["--no-states"]);
    for f in ["regenerated.jsonl", "data-00000-of-00001.arrow"] {
        assert!(std::fs::read(a.join(f)).unwrap() == std::fs::read(b.join(f)).unwrap(), "{f} differs");
    }
    let t = read_tensors(&b.join("hidden_states/hs_0.safetensors"));
    assert_eq!(t["hidden_states"].shape[1], 0, "no capture point");
    let m = strata::dataset::manifest::Manifest::read(&b).unwrap();
    assert!(m.capture.is_empty() && m.generation.unwrap().no_states);
}

/// Two or three parts, merged, are the bytes of one run: the rows, their
/// states and regenerated.jsonl, with conversations of several rows each.
#[test]
fn generated_parts_merge_to_one_run() {
    let tmp = tempfile::tempdir().unwrap();
    let model = chat_model(tmp.path(), "chatml");
    let data = conversations(tmp.path());
    let whole = tmp.path().join("whole");
    generate_chat(&model, &data, &whole, &[]);
    for n in [2, 3] {
        let out = tmp.path().join(format!("parts{n}"));
        for i in 0..n {
            generate_chat(&model, &data, &out, &["--part-index", &i.to_string(), "--num-parts", &n.to_string()]);
        }
        let o = std::process::Command::new(env!("CARGO_BIN_EXE_strata")).arg("merge").arg(&out).output().unwrap();
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        let (a, b) = (files_of(&whole), files_of(&out));
        let names = |v: &[(String, Vec<u8>)]| v.iter().map(|(n, _)| n.clone()).collect::<Vec<_>>();
        assert_eq!(names(&a), names(&b), "{n} parts");
        for ((name, x), (_, y)) in a.iter().zip(&b) {
            assert!(x == y, "{n} parts: {name} differs from one run's");
        }
    }
}

/// 256 conversations of 512 new tokens each (no stop ids), the cache held to
/// a quarter of what they would need at once: the run completes, its peak
/// RSS stays under the flag + the weights + 256 MiB, and the cache's
/// high-water mark is at least 90% of the flag.
#[test]
fn generation_memory_is_bounded_by_the_cache_flag() {
    let tmp = tempfile::tempdir().unwrap();
    // 2 layers of 4 KV heads of 16: 1 KiB of f32 cache per position, about 550 KiB per
    // sequence (small enough for CI; `cargo bench --bench memory -- --only generate` runs
    // the same check at 8 KiB per position).
    let spec = strata_testkit::LlamaSpec {
        hidden_size: 64,
        num_layers: 2,
        num_heads: 4,
        num_kv_heads: 4,
        intermediate_size: 128,
        vocab_size: 512,
    };
    let chat = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/chat");
    let case = strata_testkit::generation_memory_case(tmp.path(), &chat, &spec).unwrap();
    let run = case.run(std::path::Path::new(env!("CARGO_BIN_EXE_strata")), &tmp.path().join("out"));
    let flag = case.flag as f64;
    println!("flag {:.1} MiB, weights {} bytes: {run}", flag / (1 << 20) as f64, case.weights);
    assert_eq!(run.lines, 256, "every conversation regenerated");
    assert!(run.high_water <= flag && run.high_water >= 0.9 * flag, "{run}");
    assert!(run.peak_mib <= run.bound_mib, "{run}");
}

/// One pass against two on the emulated CUDA backend, measured: the states
/// each generated row was given while decoding (prefill chunks, then one
/// token a step) against one forward of the finished rows, as `extract`
/// runs them. The CUDA kernels make no batch-invariance promise, so this
/// reports how far apart they are (bitwise-equal share, worst relative
/// error per point) and fails only past a loose bound.
#[test]
fn one_pass_against_two_on_the_emulated_cuda_backend() {
    use crate::cuda_emu::gxx_or_skip;
    use strata::generate::StepSegment;
    use strata::pipeline::batch::PackedBatch;
    if !gxx_or_skip("one_pass_against_two_on_the_emulated_cuda_backend") {
        return;
    }
    for (name, tp) in [("llama-default", 1), ("qwen3-next", 1), ("deepseek-v3", 2)] {
        let doc = &greedy_fixtures().into_iter().find(|(n, _)| n == name).unwrap().1;
        let m = emulated(name, tp);
        let n = m.num_layers();
        let points = vec![CapturePoint::LayerInput(1), CapturePoint::LayerInput(n - 1), CapturePoint::FinalPreNorm];
        let captures = CaptureSet::<usize>::try_new(points.clone()).unwrap();
        let hidden = strata::shape::Dim::size(&m.hidden());
        let seqs = sequences(doc);
        let mut got: Vec<Vec<Vec<f32>>> = vec![vec![Vec::new(); points.len()]; seqs.len()];
        let opts = DecodeOptions { max_batch_tokens: 16, max_num_seqs: 64, kv_cache_bytes: None };
        let (generated, _) = generate(
            &m,
            &mut Default::default(),
            &captures,
            seqs.clone(),
            opts,
            |segments: &[StepSegment], states: strata::shape::CapturedStates<usize, usize>| {
                let mut row = 0;
                for seg in segments {
                    for (l, buf) in got[seg.index].iter_mut().enumerate() {
                        buf.extend_from_slice(&states.layer(l)[row * hidden..(row + seg.len) * hidden]);
                    }
                    row += seg.len;
                }
                Ok::<_, strata::model::ModelError>(())
            },
        )
        .unwrap();
        let rows: Vec<Vec<u32>> =
            seqs.iter().zip(&generated).map(|(s, g)| [s.prompt.clone(), g.output.clone()].concat()).collect();
        let batch = PackedBatch::from_samples(rows.iter().map(|r| r.as_slice()));
        let want = m.forward_step(&batch, &captures, &mut Default::default()).unwrap();
        let (mut equal, mut total) = (0usize, 0usize);
        let mut worst = vec![0f32; points.len()];
        for (i, per_point) in got.iter().enumerate() {
            let r = batch.range(i);
            for (l, g) in per_point.iter().enumerate() {
                let w = &want.layer(l)[r.start * hidden..r.end * hidden];
                assert_eq!(g.len(), w.len(), "{name}: row {i} has states for every token");
                let scale = w.iter().fold(0f32, |a, x| a.max(x.abs())).max(1e-6);
                for (a, b) in g.iter().zip(w) {
                    equal += (a.to_bits() == b.to_bits()) as usize;
                    total += 1;
                    worst[l] = worst[l].max((a - b).abs() / scale);
                }
            }
        }
        println!(
            "{name} (emulated cuda, --tp {tp}): {:.2}% of {total} captured values bitwise equal to one forward of the \
             finished rows; worst error relative to each row's largest value, per point {points:?}: {:?}",
            100.0 * equal as f64 / total as f64,
            worst.iter().map(|e| format!("{e:.2e}")).collect::<Vec<_>>()
        );
        assert!(worst.iter().all(|&e| e < 1e-3), "{name}: decoding drifts from one forward: {worst:?}");
    }
}
