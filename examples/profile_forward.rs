//! Runs the bench forward a few times (for `perf record`), printing each time.
//!
//!     cargo run --release --example profile_forward -- DIR [RUNS]

/// Large buffers on cache lines: the GEMM's tiles load whole lines.
#[global_allocator]
static ALLOC: strata::backend::cpu::CacheAligned = strata::backend::cpu::CacheAligned;

use std::time::Instant;
use strata::model::Llama;
use strata::pipeline::batch::PackedBatch;
use strata::pipeline::capture::{CapturePoint, CaptureSet};
use strata::pipeline::source::JsonlSource;

fn main() {
    let mut args = std::env::args().skip(1);
    let dir = std::path::PathBuf::from(args.next().expect("usage: profile_forward DIR [RUNS]"));
    let runs: usize = args.next().map_or(3, |r| r.parse().expect("RUNS"));
    let model: Llama = Llama::load(&dir).unwrap();
    let samples: Vec<Vec<u32>> =
        JsonlSource::open(&dir.join("tokens.jsonl")).unwrap().map(|s| s.unwrap().input_ids).collect();
    let batch = PackedBatch::from_samples(samples.iter().map(|s| s.as_slice()));
    let set = CaptureSet::<usize>::try_new(CapturePoint::eagle3(model.config().num_layers)).unwrap();
    for _ in 0..runs {
        let t = Instant::now();
        std::hint::black_box(model.forward(&batch, &set).unwrap());
        let s = t.elapsed().as_secs_f64();
        println!("{:.3} s, {:.0} tokens/s", s, batch.num_tokens() as f64 / s);
    }
}
