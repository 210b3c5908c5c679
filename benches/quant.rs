//! Quantised checkpoints: resident memory against file size, and speed
//! against the same model stored in bf16 (and in f32).
//!
//! One random DeepSeek-V3-layout model (hidden 1024, 4 layers with a dense
//! first one, MLA q-LoRA 512 / kv 256, 64 routed experts of width 512 with
//! top-8 plus one shared, vocab 32000), written four ways by `strata::synth`:
//! f32, bf16, FP8 128×128 blocks (DeepSeek-V3 / Kimi-K2) and INT4 routed
//! experts in Kimi-K2.5's wrapper (compressed-tensors pack-quantized, groups of 32).
//!
//! Memory: each checkpoint is loaded in a child process, which reports the
//! model's own count of weight bytes and its anonymous RSS (`RssAnon`, which
//! leaves out the mapped files) after loading.
//! Speed: every model runs the same batches in interleaved rounds; medians.
//!
//!     cargo bench --bench quant [-- --runs N]

/// Large buffers on cache lines, as the `strata` binary has them.
#[global_allocator]
static ALLOC: strata::backend::cpu::CacheAligned = strata::backend::cpu::CacheAligned;

use std::path::{Path, PathBuf};
use std::time::Instant;
use strata::model::Deepseek;
use strata::pipeline::batch::PackedBatch;
use strata::pipeline::capture::{CapturePoint, CaptureSet};
use strata_testkit::bench::{flag_or, median, status_kib};
use strata_testkit::{write_deepseek_stored, write_tokens, DeepseekSpec, Storage};

const STORAGES: [Storage; 4] = [Storage::F32, Storage::Bf16, Storage::Fp8, Storage::Int4Experts];

fn spec() -> DeepseekSpec {
    DeepseekSpec {
        model_type: "kimi_k2",
        hidden_size: 1024,
        num_layers: 4,
        num_heads: 16,
        q_lora_rank: 512,
        kv_lora_rank: 256,
        qk_nope_head_dim: 64,
        qk_rope_head_dim: 32,
        v_head_dim: 64,
        intermediate_size: 2816,
        n_routed_experts: 64,
        n_shared_experts: 1,
        num_experts_per_tok: 8,
        moe_intermediate_size: 512,
        first_k_dense_replace: 1,
        vocab_size: 32000,
    }
}

fn dir_bytes(dir: &Path) -> u64 {
    std::fs::read_dir(dir)
        .unwrap()
        .filter_map(|e| e.ok())
        .filter(|e| e.file_name().to_string_lossy().ends_with(".safetensors"))
        .map(|e| e.metadata().unwrap().len())
        .sum()
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if args.iter().any(|a| a == "--list") {
        return;
    }
    // Child mode: load one checkpoint and report its memory.
    if let Some(i) = args.iter().position(|a| a == "--load-only") {
        let before = status_kib("RssAnon:");
        let t = Instant::now();
        let model: Deepseek = Deepseek::load(Path::new(&args[i + 1])).unwrap();
        let secs = t.elapsed().as_secs_f64();
        let after = status_kib("RssAnon:");
        println!("{} {} {secs}", model.resident_bytes(), (after - before) * 1024);
        return;
    }
    let runs: usize = flag_or("--runs", 5);
    let root = std::env::temp_dir().join("strata-bench-quant");
    let spec = spec();
    let dirs: Vec<PathBuf> = STORAGES.iter().map(|s| root.join(format!("{s:?}"))).collect();
    for (s, d) in STORAGES.iter().zip(&dirs) {
        if !d.join("config.json").exists() {
            let t = Instant::now();
            write_deepseek_stored(d, &spec, *s, *s == Storage::Int4Experts, 11).unwrap();
            eprintln!("wrote {s:?} in {:.1}s", t.elapsed().as_secs_f64());
        }
    }
    if !root.join("tokens.jsonl").exists() {
        write_tokens(&root.join("tokens.jsonl"), spec.vocab_size, &[512; 4], 12).unwrap();
    }

    println!("memory (one rank, weights only; file = all .safetensors bytes):");
    println!(
        "  {:<12} {:>10} {:>12} {:>8} {:>12} {:>8} {:>8}",
        "storage", "file MB", "resident MB", "ratio", "RssAnon MB", "ratio", "load s"
    );
    let exe = std::env::current_exe().unwrap();
    for (s, d) in STORAGES.iter().zip(&dirs) {
        let out = std::process::Command::new(&exe).arg("--load-only").arg(d).output().unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        let text = String::from_utf8_lossy(&out.stdout);
        let v: Vec<f64> = text.split_whitespace().map(|x| x.parse().unwrap()).collect();
        let file = dir_bytes(d) as f64;
        println!(
            "  {:<12} {:>10.1} {:>12.1} {:>8.3} {:>12.1} {:>8.3} {:>8.2}",
            format!("{s:?}"),
            file / 1e6,
            v[0] / 1e6,
            v[0] / file,
            v[1] / 1e6,
            v[1] / file,
            v[2]
        );
    }

    let models: Vec<Deepseek> = dirs.iter().map(|d| Deepseek::load(d).unwrap()).collect();
    let samples: Vec<Vec<u32>> = strata::pipeline::source::JsonlSource::open(&root.join("tokens.jsonl"))
        .unwrap()
        .map(|s| s.unwrap().input_ids)
        .collect();
    let set = CaptureSet::<usize>::try_new(CapturePoint::eagle3(spec.num_layers)).unwrap();
    for (label, batch) in [
        ("4 x 512 tokens (~256 rows per expert)", PackedBatch::from_samples(samples.iter().map(|s| s.as_slice()))),
        ("1 x 128 tokens (~16 rows per expert)", PackedBatch::from_samples([&samples[0][..128]])),
    ] {
        let mut times = vec![Vec::new(); models.len()];
        for _ in 0..runs {
            for (m, t) in models.iter().zip(&mut times) {
                let start = Instant::now();
                std::hint::black_box(m.forward_step(&batch, &set, &mut Default::default()).unwrap());
                t.push(start.elapsed().as_secs_f64());
            }
        }
        let n = batch.num_tokens() as f64;
        let med: Vec<f64> = times.into_iter().map(median).collect();
        let bf16 = med[1];
        println!("speed, {label}, median of {runs} interleaved runs:");
        for (s, t) in STORAGES.iter().zip(&med) {
            println!("  {:<12} {:>8.3} s {:>8.0} tokens/s   {:.2}x bf16", format!("{s:?}"), t, n / t, bf16 / t);
        }
    }
}
