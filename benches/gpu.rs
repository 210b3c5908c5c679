//! GPU throughput of the CUDA backend, for scripts/gpu-check.sh (which runs
//! this binary on a GPU machine). Random-weight bf16 checkpoints are written
//! first (no downloads), then:
//!
//! (a) a Llama-3-8B-shaped model (hidden 4096, 32/8 heads, MLP 14336, vocab
//!     128256; `--layers`, default 32), bf16 compute, 8 samples x 2048 tokens
//!     in one packed step: prefill tokens/s and model-FLOPs utilisation
//!     against the GPU's dense bf16 peak;
//! (b) capture and writer: the whole pipeline (EAGLE-3 points, gather, bf16
//!     shards, fsync) over `--steps` such steps, against the bare forward of
//!     the same steps, interleaved; the overhead in percent; and the forward
//!     capturing the final states alone, to price each capture point's
//!     device-to-host copy;
//! (c) a DeepSeek-V3-shaped MoE model (V3's attention and expert sizes,
//!     8 of `--experts` routed experts plus one shared per token, `--moe-layers`
//!     MoE layers after one dense one): tokens/s;
//! (d) the bf16 attention op alone (the step's Q/K/V packed to bf16, then
//!     `attention_bf16_vN`), one causal sample of 4096 and of 16384 tokens,
//!     32 query and 8 KV heads, at head dims 128 and 256: TFLOP/s, counting
//!     4 x head_dim x heads x T(T+1)/2.
//!
//!     cargo bench --features cuda --bench gpu -- [--only llama|deepseek|attention]
//!         [--layers 32] [--steps 4] [--experts 32] [--moe-layers 2]
//!         [--runs 5] [--dir DIR] [--peak-tflops X]
//!
//! FLOPs counted per token: 2 x every GEMM's weight elements (the LM head is
//! not run: extraction stops at the final norm) plus causal attention,
//! 4 x head_dim x heads x (keys at or before the token). Peak: 989.4 dense
//! bf16 TFLOP/s on H100/H200 SXM, 312 on A100 (datasheets), else
//! `--peak-tflops`.
//!
//! Without a GPU it says so and exits 0 (1 under `STRATA_REQUIRE_GPU=1`).

use std::path::{Path, PathBuf};
use std::time::Instant;
use strata::backend::cuda::probe;
use strata::backend::Compute;
use strata::format::manifest::{Manifest, ModelInfo};
use strata::job::Pipeline;
use strata::model::{AnyCache, AnyConfig, AnyModel, BackendKind, LoadOptions, Model};
use strata::pipeline::batch::PackedBatch;
use strata::pipeline::capture::{CapturePoint, CaptureSet};
use strata::pipeline::source::JsonlSource;
use strata::shape::DType;
use strata::sink::{OpenMode, StrataSink, DEFAULT_SHARD_SIZE};
use strata_testkit::bench::{flag, median};
use strata_testkit::{DeepseekSpec, LlamaSpec, Storage};

struct Args {
    only: Option<String>,
    layers: usize,
    steps: usize,
    experts: usize,
    moe_layers: usize,
    runs: usize,
    dir: PathBuf,
    peak: Option<f64>,
}

fn args() -> Args {
    let get = flag;
    let num = |k: &str, d: usize| get(k).map_or(d, |s| s.parse().unwrap_or_else(|_| panic!("{k} takes a number")));
    Args {
        only: get("--only"),
        layers: num("--layers", 32),
        steps: num("--steps", 4),
        experts: num("--experts", 32),
        moe_layers: num("--moe-layers", 2),
        runs: num("--runs", 5).max(1),
        dir: get("--dir").map_or_else(|| std::env::temp_dir().join("strata-gpu-bench"), PathBuf::from),
        peak: get("--peak-tflops").map(|s| s.parse::<f64>().expect("--peak-tflops takes a number") * 1e12),
    }
}

/// Samples of `len` random tokens, `count` of them.
fn tokens(vocab: usize, count: usize, len: usize, seed: u64) -> Vec<Vec<u32>> {
    let mut rng = strata_testkit::Rng::new(seed);
    (0..count).map(|_| (0..len).map(|_| rng.below(vocab as u64) as u32).collect()).collect()
}

fn load(dir: &Path) -> AnyModel {
    let t = Instant::now();
    let opts =
        LoadOptions { backend: BackendKind::Cuda, compute: Compute::Bf16, tp: 1, devices: vec![0], lm_head: false };
    let m = strata::model::load(dir, opts).unwrap_or_else(|e| panic!("loading {}: {e}", dir.display()));
    println!(
        "    loaded onto the GPU in {:.1} s ({:.2} GB of weights)",
        t.elapsed().as_secs_f64(),
        m.weight_bytes() as f64 / 1e9
    );
    m
}

fn write<E: std::fmt::Debug>(what: &str, dir: &Path, f: impl FnOnce() -> Result<(), E>) {
    let t = Instant::now();
    if dir.join("config.json").exists() {
        std::fs::remove_dir_all(dir).unwrap();
    }
    f().unwrap_or_else(|e| panic!("writing {what} to {}: {e:?}", dir.display()));
    println!("    wrote {what} in {:.1} s", t.elapsed().as_secs_f64());
}

/// Medians over the steps of: the forward capturing the final states alone,
/// the forward capturing the EAGLE-3 points, and the whole pipeline.
fn forward_and_pipeline(
    model: &AnyModel,
    dir: &Path,
    out: &Path,
    samples: &[Vec<u32>],
    per_step: usize,
    runs: usize,
) -> (f64, f64, f64) {
    let config_text = AnyConfig::read_text(dir).unwrap();
    let info = AnyConfig::read(dir).unwrap().info();
    let points = CapturePoint::eagle3_for(info.num_layers).unwrap();
    let set = CaptureSet::<usize>::try_new(points.clone()).unwrap();
    let batches: Vec<PackedBatch> =
        samples.chunks(per_step).map(|c| PackedBatch::from_samples(c.iter().map(|s| s.as_slice()))).collect();
    let budget = batches[0].num_tokens();
    let jsonl: String = samples.iter().map(|s| format!("{{\"input_ids\": {s:?}}}\n")).collect();
    // The same depth (the final pre-norm states), one capture point: the
    // difference to `set` is what copying the other points out costs.
    let last = CaptureSet::<usize>::try_new(vec![CapturePoint::FinalPreNorm]).unwrap();
    // Warm-up: cuBLAS's first calls and the allocator's first blocks.
    model.forward_step(&batches[0], &set, &mut AnyCache::default()).unwrap();
    let (mut bare, mut one, mut whole) = (Vec::new(), Vec::new(), Vec::new());
    for run in 0..runs {
        for side in [run % 2, 1 - run % 2] {
            let t = Instant::now();
            if side == 0 {
                for b in &batches {
                    std::hint::black_box(model.forward_step(b, &set, &mut AnyCache::default()).unwrap());
                }
                bare.push(t.elapsed().as_secs_f64());
                let t = Instant::now();
                for b in &batches {
                    std::hint::black_box(model.forward_step(b, &last, &mut AnyCache::default()).unwrap());
                }
                one.push(t.elapsed().as_secs_f64());
            } else {
                let target = out.join(format!("run{run}"));
                let manifest = Manifest::new(
                    ModelInfo::new("bench", &info, &config_text),
                    &points,
                    DType::BF16,
                    DEFAULT_SHARD_SIZE,
                );
                let sink = StrataSink::<usize, usize>::open(
                    &target,
                    manifest,
                    points.len(),
                    info.hidden_size,
                    OpenMode::Overwrite,
                )
                .unwrap();
                let source = JsonlSource::new("bench".into(), jsonl.as_bytes());
                Pipeline::new(source)
                    .max_batch_tokens(budget)
                    .model(model)
                    .capture(set.clone())
                    .sink(sink)
                    .run()
                    .unwrap();
                whole.push(t.elapsed().as_secs_f64());
                std::fs::remove_dir_all(&target).unwrap();
            }
        }
    }
    let (bare, one) = (median(bare), median(one));
    if points.len() > 1 {
        let per_point = (bare - one) / (points.len() - 1) as f64 / batches.len() as f64;
        println!(
            "    capture          {:.1} ms per extra capture point per step ({} points: {:.1}% of the forward)",
            per_point * 1e3,
            points.len(),
            100.0 * (bare - one) / bare
        );
    }
    (one, bare, median(whole))
}

fn llama(a: &Args, peak: Option<f64>) {
    let spec = LlamaSpec {
        hidden_size: 4096,
        num_layers: a.layers,
        num_heads: 32,
        num_kv_heads: 8,
        intermediate_size: 14336,
        vocab_size: 128256,
    };
    println!("(a) Llama-3-8B shape, {} layers, bf16 weights and compute, 8 x 2048 tokens per step", spec.num_layers);
    let dir = a.dir.join("llama");
    write("the checkpoint", &dir, || strata_testkit::write_llama(&dir, &spec, DType::BF16, 5));
    let model = load(&dir);
    let (len, per_step) = (2048, 8);
    let samples = tokens(spec.vocab_size, per_step * a.steps.max(1), len, 9);
    let out = a.dir.join("out");
    let (one, bare, whole) = forward_and_pipeline(&model, &dir, &out, &samples, per_step, a.runs);
    let ntok = (samples.len() * len) as f64;
    let (h, i, hd) = (spec.hidden_size as f64, spec.intermediate_size as f64, 128f64);
    let (q, kv) = (spec.num_heads as f64 * hd, spec.num_kv_heads as f64 * hd);
    let gemm = 2.0 * (h * (q + 2.0 * kv) + q * h + 3.0 * h * i);
    // Keys at or before each token, summed over a sample: len (len + 1) / 2.
    let attn_per_sample = 4.0 * hd * spec.num_heads as f64 * (len * (len + 1) / 2) as f64;
    let flops = spec.num_layers as f64 * (gemm * ntok + attn_per_sample * samples.len() as f64);
    let tflops = |t: f64| flops / t / 1e12;
    println!(
        "    forward          {one:.3} s for {ntok} tokens: {:.0} tokens/s, {:.1} TFLOP/s",
        ntok / one,
        tflops(one)
    );
    match peak {
        Some(peak) => {
            println!(
                "    MFU              {:.1}% of {:.1} TFLOP/s dense bf16",
                100.0 * flops / one / peak,
                peak / 1e12
            );
            println!(
                "    + EAGLE-3 points {bare:.3} s: {:.0} tokens/s, MFU {:.1}%",
                ntok / bare,
                100.0 * flops / bare / peak
            );
        }
        None => {
            println!("    MFU              unknown: no dense bf16 peak known for this GPU; pass --peak-tflops");
            println!("    + EAGLE-3 points {bare:.3} s: {:.0} tokens/s", ntok / bare);
        }
    }
    println!(
        "    pipeline         {whole:.3} s: {:.0} tokens/s (capture EAGLE-3 points, bf16 shards, fsync)",
        ntok / whole
    );
    println!(
        "    capture+writer   {:+.1}% time over the forward capturing the final states alone (goal: at most +10%)",
        (whole / one - 1.0) * 100.0
    );
    drop(model);
    let _ = std::fs::remove_dir_all(&dir);
}

fn deepseek(a: &Args) {
    let spec = DeepseekSpec {
        model_type: "deepseek_v3",
        hidden_size: 7168,
        num_layers: 1 + a.moe_layers,
        num_heads: 128,
        q_lora_rank: 1536,
        kv_lora_rank: 512,
        qk_nope_head_dim: 128,
        qk_rope_head_dim: 64,
        v_head_dim: 128,
        intermediate_size: 18432,
        n_routed_experts: a.experts,
        n_shared_experts: 1,
        num_experts_per_tok: 8,
        moe_intermediate_size: 2048,
        first_k_dense_replace: 1,
        vocab_size: 129280,
    };
    println!(
        "(c) DeepSeek-V3 shape, 1 dense + {} MoE layers, {} routed experts (8 per token) + 1 shared, bf16, 8 x 2048 tokens",
        a.moe_layers, a.experts
    );
    let dir = a.dir.join("deepseek");
    write("the checkpoint", &dir, || strata_testkit::write_deepseek_stored(&dir, &spec, Storage::Bf16, false, 5));
    let model = load(&dir);
    let samples = tokens(spec.vocab_size, 8, 2048, 13);
    let batch = PackedBatch::from_samples(samples.iter().map(|s| s.as_slice()));
    let set = CaptureSet::<usize>::try_new(vec![CapturePoint::FinalPreNorm]).unwrap();
    model.forward_step(&batch, &set, &mut AnyCache::default()).unwrap();
    let times: Vec<f64> = (0..a.runs)
        .map(|_| {
            let t = Instant::now();
            std::hint::black_box(model.forward_step(&batch, &set, &mut AnyCache::default()).unwrap());
            t.elapsed().as_secs_f64()
        })
        .collect();
    let t = median(times);
    let n = batch.num_tokens() as f64;
    println!(
        "    forward          {t:.3} s for {n} tokens: {:.0} tokens/s ({:.0} per layer-second)",
        n / t,
        n * spec.num_layers as f64 / t
    );
    drop(model);
    let _ = std::fs::remove_dir_all(&dir);
}

fn main() {
    let v: Vec<String> = std::env::args().collect();
    if v.iter().any(|a| a == "--list") {
        return; // `cargo test --benches` lists benches; nothing to list here
    }
    let a = args();
    let gpus = match probe::probe(&[0]) {
        Ok(g) => g,
        Err(e) => {
            eprintln!("no GPU to benchmark: {e}");
            std::process::exit(if std::env::var_os("STRATA_REQUIRE_GPU").is_some() { 1 } else { 0 });
        }
    };
    let gpu = &gpus[0];
    println!("GPU 0: {} ({}, {:.0} GiB)", gpu.name, gpu.arch(), gpu.memory as f64 / (1u64 << 30) as f64);
    println!("CUDA libraries: {}", probe::versions());
    match strata::backend::cuda::Driver::open(0) {
        Ok(d) => {
            use strata::backend::cuda::Device;
            println!(
                "kernels loaded as {}; MoE experts' bf16 GEMMs: {:?} (manifest kernel `{}`)",
                d.image.name(),
                d.gemm_path(),
                d.gemm_path().kernel(strata::backend::Compute::Bf16)
            );
        }
        Err(e) => println!("GPU 0 did not open: {e}"),
    }
    let peak = a.peak.or_else(|| {
        let n = gpu.name.to_uppercase();
        if (n.contains("H100") || n.contains("H200")) && !n.contains("PCIE") && !n.contains("NVL") {
            Some(989.4e12)
        } else if n.contains("A100") {
            Some(312e12)
        } else {
            None
        }
    });
    std::fs::create_dir_all(&a.dir).unwrap();
    if a.only.as_deref().is_none_or(|o| o == "llama") {
        llama(&a, peak);
    }
    if a.only.as_deref().is_none_or(|o| o == "deepseek") {
        deepseek(&a);
    }
    if a.only.as_deref().is_none_or(|o| o == "attention") {
        attention(&a);
    }
}

/// (d): the attention op's TFLOP/s at 4K and 16K tokens, head dims 128 and 256.
fn attention(a: &Args) {
    use strata::backend::cuda::{Cuda, Driver};
    use strata::backend::prelude::*;
    use strata::backend::{AttnShape, Bf16, LayerState, Mask, Qkv, Tensor};
    use strata::pipeline::batch::Segment;
    println!("(d) bf16 attention alone, 32 query / 8 KV heads, one causal sample");
    let dev = match Driver::open(0) {
        Ok(d) => d,
        Err(e) => return println!("    GPU 0 did not open: {e}"),
    };
    let b = Cuda::<Bf16, Driver>::new(dev, vec![0]);
    for hd in [128usize, 256] {
        for t in [4096usize, 16384] {
            let shape = AttnShape { heads: 32, kv_heads: 8, head_dim: hd, v_dim: hd, mask: Mask::Causal, scale: 0.1 };
            let (qw, kw) = (32 * hd, 8 * hd);
            let values: Vec<f32> = {
                let mut rng = strata_testkit::Rng::new(7);
                (0..t * (qw + 2 * kw)).map(|_| rng.below(2001) as f32 / 1000.0 - 1.0).collect()
            };
            let qkv = Tensor::<Cuda<Bf16, Driver>>::from_host(&b, &values, t, qw + 2 * kw).unwrap();
            let mut out = Tensor::<Cuda<Bf16, Driver>>::zeros(&b, t, qw);
            let mut batch = PackedBatch::new();
            batch.push_segment(&vec![0u32; t], Segment { key: 0, pos0: 0, keep: false });
            let mut cache = Default::default();
            let mut times = Vec::new();
            for run in 0..=a.runs {
                KvStore::begin(&mut cache, &batch).unwrap();
                let start = Instant::now();
                let cols = Qkv { q: qkv.cols(0, qw), k: qkv.cols(qw, kw), v: qkv.cols(qw + kw, kw) };
                b.attention(cols, shape, None, &batch, LayerState::new(&mut cache, 0), &mut out);
                if let Err(e) = b.end_step() {
                    return println!("    head dim {hd}, {t} tokens: failed: {e}");
                }
                if run > 0 {
                    times.push(start.elapsed().as_secs_f64()); // the first run compiles and warms up
                }
            }
            let flops = 4.0 * hd as f64 * 32.0 * (t * (t + 1) / 2) as f64;
            let s = median(times);
            println!("    head dim {hd:3}, {t:5} tokens: {:7.2} ms, {:6.1} TFLOP/s", s * 1e3, flops / s / 1e12);
        }
    }
}
