//! CPU throughput of a small MoE shape: a random DeepSeek-V3-layout model
//! (hidden 1024, 8 layers, 16 heads, MLA q-LoRA 512 / kv 256, 16 experts of
//! width 704 with top-4 and 1 shared, one dense first layer of width 2816,
//! vocab 32000) over 4 × 512 tokens, EAGLE-3 points; `--tp 1` and `--tp 2`.
//!
//!     cargo bench --bench moe [-- --runs N]

/// Large buffers on cache lines, as the `strata` binary has them.
#[global_allocator]
static ALLOC: strata::backend::cpu::CacheAligned = strata::backend::cpu::CacheAligned;

use std::time::Instant;
use strata::model::{Deepseek, Model, TpDeepseek};
use strata::pipeline::batch::PackedBatch;
use strata::pipeline::capture::{CapturePoint, CaptureSet};
use strata::pipeline::source::JsonlSource;
use strata_testkit::bench::{flag_or, median};
use strata_testkit::{write_deepseek, write_tokens, DeepseekSpec};

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if args.iter().any(|a| a == "--list") {
        return;
    }
    let runs: usize = flag_or("--runs", 5);
    let dir = std::env::temp_dir().join("strata-bench-moe");
    let spec = DeepseekSpec {
        model_type: "deepseek_v3",
        hidden_size: 1024,
        num_layers: 8,
        num_heads: 16,
        q_lora_rank: 512,
        kv_lora_rank: 256,
        qk_nope_head_dim: 64,
        qk_rope_head_dim: 32,
        v_head_dim: 64,
        intermediate_size: 2816,
        n_routed_experts: 16,
        n_shared_experts: 1,
        num_experts_per_tok: 4,
        moe_intermediate_size: 704,
        first_k_dense_replace: 1,
        vocab_size: 32000,
    };
    if !dir.join("tokens.jsonl").exists() {
        write_deepseek(&dir, &spec, 5).unwrap();
        write_tokens(&dir.join("tokens.jsonl"), spec.vocab_size, &[512; 4], 6).unwrap();
    }
    let samples: Vec<Vec<u32>> =
        JsonlSource::open(&dir.join("tokens.jsonl")).unwrap().map(|s| s.unwrap().input_ids).collect();
    let batch = PackedBatch::from_samples(samples.iter().map(|s| s.as_slice()));
    let one: Deepseek = Deepseek::load(&dir).unwrap();
    let two = TpDeepseek::<usize, usize>::load(&dir, 2).unwrap();
    let set = CaptureSet::<usize>::try_new(CapturePoint::eagle3(spec.num_layers)).unwrap();
    let (mut t1, mut t2) = (Vec::new(), Vec::new());
    for _ in 0..runs {
        let t = Instant::now();
        std::hint::black_box(one.forward_step(&batch, &set, &mut Default::default()).unwrap());
        t1.push(t.elapsed().as_secs_f64());
        let t = Instant::now();
        std::hint::black_box(Model::forward_step(&two, &batch, &set, &mut Default::default()).unwrap());
        t2.push(t.elapsed().as_secs_f64());
    }
    let n = batch.num_tokens() as f64;
    let (a, b) = (median(t1), median(t2));
    println!("small MoE (16 experts, top-4 + 1 shared), {} tokens, {runs} interleaved runs", batch.num_tokens());
    println!("  --tp 1: {a:.3} s  {:.0} tokens/s", n / a);
    println!("  --tp 2: {b:.3} s  {:.0} tokens/s  (ratio {:.2})", n / b, a / b);
}
