//! A statically typed extraction job: the demo model (the `llama-default`
//! fixture the CLI embeds: hidden 64), four EAGLE-3 capture points, written
//! in the native format. The layout `[Layers<4>, T, Hidden<64>]` is in the
//! types: a writer for another hidden size or capture count would not compile.
//!
//!     cargo run --release --example typed_job -- /tmp/typed-job

/// Large buffers on cache lines: the GEMM's tiles load whole lines.
#[global_allocator]
static ALLOC: strata::backend::cpu::CacheAligned = strata::backend::cpu::CacheAligned;

use std::path::Path;
use strata::format::manifest::{Manifest, ModelInfo};
use strata::hf::{Checkpoint, LlamaConfig};
use strata::job::Pipeline;
use strata::model::Llama;
use strata::pipeline::capture::{CapturePoint, CaptureSet};
use strata::pipeline::source::JsonlSource;
use strata::shape::{DType, Hidden, Layers};
use strata::sink::{OpenMode, StrataSink, DEFAULT_SHARD_SIZE};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let out = std::env::args().nth(1).unwrap_or_else(|| "/tmp/typed-job".into());
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/llama-default");
    let config_json = std::fs::read_to_string(dir.join("config.json"))?;
    let config = LlamaConfig::from_json(&config_json)?;
    let model = Llama::<Hidden<64>>::from_checkpoint(config.clone(), &Checkpoint::open(&dir)?)?;
    let points = CapturePoint::eagle3(config.num_layers);
    let info = ModelInfo::new(&dir.display().to_string(), &config.info(), &config_json);
    let manifest = Manifest::new(info, &points, DType::BF16, DEFAULT_SHARD_SIZE);
    let sink = StrataSink::<Layers<4>, Hidden<64>>::open(
        std::path::Path::new(&out),
        manifest,
        Layers,
        Hidden,
        OpenMode::Overwrite,
    )?;
    let source = JsonlSource::open(&dir.join("data.jsonl"))?;
    let (report, _) = Pipeline::new(source)
        .max_batch_tokens(16)
        .model(&model)
        .capture(CaptureSet::<Layers<4>>::try_new(points)?)
        .sink(sink)
        .run()?;
    println!(
        "{} samples, {} tokens in {} steps -> {out}",
        report.progress.samples, report.progress.tokens, report.steps
    );
    Ok(())
}
