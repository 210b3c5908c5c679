//! Tensor-parallel throughput: the `small` Llama (4 × 512 tokens, EAGLE-3
//! points) as 1 rank and as 2 and 4 ranks (threads), interleaved runs, medians
//! and ratios against one rank.
//!
//!     cargo bench --bench tp [-- --runs N]

/// Large buffers on cache lines, as the `strata` binary has them.
#[global_allocator]
static ALLOC: strata::backend::cpu::CacheAligned = strata::backend::cpu::CacheAligned;

use std::time::Instant;
use strata::model::{Llama, Model, TpLlama};
use strata::pipeline::batch::PackedBatch;
use strata::pipeline::capture::{CapturePoint, CaptureSet};
use strata::pipeline::source::JsonlSource;
use strata_testkit::bench::{flag_or, median};

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if args.iter().any(|a| a == "--list") {
        return;
    }
    let runs: usize = flag_or("--runs", 5);
    let dir = strata_testkit::bench_small_dir().unwrap();
    let samples: Vec<Vec<u32>> =
        JsonlSource::open(&dir.join("tokens.jsonl")).unwrap().map(|s| s.unwrap().input_ids).collect();
    let batch = PackedBatch::from_samples(samples.iter().map(|s| s.as_slice()));
    let one: Llama = Llama::load(&dir).unwrap();
    let set = CaptureSet::<usize>::try_new(CapturePoint::eagle3(one.config().num_layers)).unwrap();
    let two = TpLlama::<usize, usize>::load(&dir, 2).unwrap();
    let four = TpLlama::<usize, usize>::load(&dir, 4).unwrap();
    let mut times = [Vec::new(), Vec::new(), Vec::new()];
    for _ in 0..runs {
        let t = Instant::now();
        std::hint::black_box(one.forward(&batch, &set).unwrap());
        times[0].push(t.elapsed().as_secs_f64());
        for (slot, m) in [(1, &two), (2, &four)] {
            let t = Instant::now();
            std::hint::black_box(m.forward_step(&batch, &set, &mut Default::default()).unwrap());
            times[slot].push(t.elapsed().as_secs_f64());
        }
    }
    let n = batch.num_tokens() as f64;
    let base = median(times[0].clone());
    println!(
        "{} tokens, {} cores, {runs} interleaved runs",
        batch.num_tokens(),
        std::thread::available_parallelism().map_or(0, |c| c.get())
    );
    for (tp, t) in [1, 2, 4].iter().zip(times) {
        let m = median(t);
        println!("  --tp {tp}: {:.3} s  {:.0} tokens/s  ratio to --tp 1: {:.2}", m, n / m, base / m);
    }
}
