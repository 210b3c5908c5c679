//! Forward throughput on the `small` Llama shape (hidden 1024, 8 layers,
//! 16/4 heads, MLP 2816, vocab 32000, random f32 weights) over 4 × 512 tokens,
//! capturing the EAGLE-3 points (all 8 layers run).
//!
//!     cargo bench --bench forward
//!
//! `STRATA_BENCH_MODEL=DIR` benches an existing checkpoint (with `tokens.jsonl`)
//! instead; scripts/bench_vs_torch.py uses that to time PyTorch on the same one.

/// Large buffers on cache lines, as the `strata` binary has them.
#[global_allocator]
static ALLOC: strata::backend::cpu::CacheAligned = strata::backend::cpu::CacheAligned;

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use strata::model::Llama;
use strata::pipeline::batch::PackedBatch;
use strata::pipeline::capture::{CapturePoint, CaptureSet};
use strata::pipeline::source::JsonlSource;

fn forward(c: &mut Criterion) {
    let dir = strata_testkit::bench_small_dir().unwrap();
    let model: Llama = Llama::load(&dir).unwrap();
    let samples: Vec<Vec<u32>> =
        JsonlSource::open(&dir.join("tokens.jsonl")).unwrap().map(|s| s.unwrap().input_ids).collect();
    let batch = PackedBatch::from_samples(samples.iter().map(|s| s.as_slice()));
    let set = CaptureSet::<usize>::try_new(CapturePoint::eagle3(model.config().num_layers)).unwrap();
    let mut g = c.benchmark_group("forward");
    g.sample_size(10).measurement_time(std::time::Duration::from_secs(20));
    g.throughput(Throughput::Elements(batch.num_tokens() as u64));
    g.bench_function("small_4x512_f32", |b| b.iter(|| model.forward(&batch, &set).unwrap()));
    g.finish();
}

criterion_group!(benches, forward);
criterion_main!(benches);
