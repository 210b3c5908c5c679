//! A statically typed extraction job: the embedded demo model (hidden 64),
//! four EAGLE-3 capture points, written in the native format. The layout
//! `[Layers<4>, T, Hidden<64>]` is in the types: a writer for another hidden
//! size or capture count would not compile.
//!
//!     cargo run --release --example typed_job -- /tmp/typed-job

use strata::capture::{CapturePoint, CaptureSet};
use strata::checkpoint::Checkpoint;
use strata::config::LlamaConfig;
use strata::manifest::{Manifest, ModelInfo};
use strata::model::Llama;
use strata::pipeline::Pipeline;
use strata::shape::{DType, Hidden, Layers};
use strata::sink::{OpenMode, StrataSink};
use strata::source::JsonlSource;
use strata::{embedded, sink::DEFAULT_SHARD_SIZE};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let out = std::env::args().nth(1).unwrap_or_else(|| "/tmp/typed-job".into());
    let config = LlamaConfig::from_json(embedded::CONFIG_JSON)?;
    let ckpt = Checkpoint::from_static(embedded::NAME, embedded::MODEL_SAFETENSORS)?;
    let model = Llama::<Hidden<64>>::from_checkpoint(config.clone(), &ckpt)?;
    let points = CapturePoint::eagle3(config.num_layers);
    let info = ModelInfo::new(embedded::NAME, &config.info(), embedded::CONFIG_JSON);
    let manifest = Manifest::new(info, &points, DType::BF16, DEFAULT_SHARD_SIZE);
    let sink = StrataSink::<Layers<4>, Hidden<64>>::open(out.as_ref(), manifest, Layers, Hidden, OpenMode::Overwrite)?;
    let source = JsonlSource::new("demo".into(), embedded::DATA_JSONL.as_bytes());
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
