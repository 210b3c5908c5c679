//! The seed's job as a typed Strata program: EAGLE-3 hidden states of
//! Kimi-K2.5 (DeepSeek-V3 layout: 61 decoder layers, hidden 7168, MLA + MoE)
//! on 8 tensor-parallel ranks.
//!
//! The seed captured decoder layers 2, 30, 58 and 60 with vLLM, whose aux
//! layer `k` is the residual stream entering layer `k`. Stated in Strata's one
//! convention that is `input:2, input:30, input:58, input:60` (HF
//! `output_hidden_states[2]`, `[30]`, `[58]`, `[60]`).
//!
//! The layout `[Layers<4>, T, HiddenU<7168>]` over `Tp<U8>` is in the types of
//! `kimi_job`: a writer of another width, a capture list of another length, a
//! split that does not divide 7168, or the seed's reply unwrapped twice
//! (tests/ui/seed_bug_reply_unwrapped_twice.rs) do not compile. `kimi_job`
//! reads the released checkpoint as it is: the `kimi_k25` multimodal wrapper
//! (`text_config`, `language_model.*`; the vision tower is never read) with
//! compressed-tensors INT4 routed experts, kept as INT4 in memory. This
//! example runs the same generic job on a scaled-down checkpoint of the same
//! structure and storage (wrapper, INT4 experts in groups of 32, bf16
//! elsewhere; 61 layers, MLA with q-LoRA, noaux_tc routing, a dense first
//! layer, TP 8) with random weights.
//!
//!     cargo run --release --example kimi_k25_eagle3 [-- OUT_DIR]

/// Large buffers on cache lines: the GEMM's tiles load whole lines. Not in
/// the integration tests, which include this file's test: that process's
/// allocator stays the default for every suite.
#[cfg_attr(not(test), global_allocator)]
static ALLOC: strata::backend::cpu::CacheAligned = strata::backend::cpu::CacheAligned;

use std::path::Path;
use strata::format::manifest::{Manifest, ModelInfo};
use strata::job::{Pipeline, Report};
use strata::model::TpDeepseek;
use strata::parallel::{HiddenU, ShardDim, Tp, TpSize};
use strata::pipeline::capture::{CapturePoint, CaptureSet};
use strata::pipeline::source::JsonlSource;
use strata::shape::{DType, Layers};
use strata::sink::{OpenMode, StrataSink, DEFAULT_SHARD_SIZE};
use strata_testkit::{write_deepseek_stored, write_tokens, DeepseekSpec, Storage};
use typenum::{Prod, U1024, U64, U7, U8};

/// Kimi-K2.5's hidden width, 7 · 1024 = 7168, as a type.
type KimiHidden = HiddenU<Prod<U7, U1024>>;
/// The seed's capture points, in Strata's convention.
const SEED_LAYERS: [usize; 4] = [2, 30, 58, 60];

/// The extraction job, generic over the hidden width `H` and the TP size,
/// with four capture points fixed by its types.
fn extraction_job<H: ShardDim<TP> + Default, TP: TpSize + Default>(
    model_dir: &Path,
    data: &Path,
    out: &Path,
) -> Result<Report, Box<dyn std::error::Error>> {
    let model = TpDeepseek::<H, TP>::load(model_dir, TP::default())?;
    let text = std::fs::read_to_string(model_dir.join("config.json"))?;
    let config = strata::hf::DeepseekConfig::from_json(&text)?;
    let points: Vec<CapturePoint> = SEED_LAYERS.iter().map(|&k| CapturePoint::LayerInput(k)).collect();
    let info = ModelInfo::new(&model_dir.display().to_string(), &config.info(), &text);
    let manifest = Manifest::new(info, &points, DType::BF16, DEFAULT_SHARD_SIZE);
    let sink = StrataSink::<Layers<4>, H>::open(out, manifest, Layers, H::default(), OpenMode::Overwrite)?;
    let (report, _) = Pipeline::new(JsonlSource::open(data)?)
        .max_batch_tokens(8192)
        .model(&model)
        .capture(CaptureSet::<Layers<4>>::try_new(points)?)
        .sink(sink)
        .run()?;
    Ok(report)
}

/// The job at Kimi-K2.5's real layout (compiled here; point it at the released checkpoint's directory).
#[allow(dead_code)]
fn kimi_job(model_dir: &Path, data: &Path, out: &Path) -> Result<Report, Box<dyn std::error::Error>> {
    extraction_job::<KimiHidden, Tp<U8>>(model_dir, data, out)
}

/// The same job on a scaled-down checkpoint of the same structure and storage: hidden 64 over 8 ranks.
fn scaled_down(out: &Path) -> Result<Report, Box<dyn std::error::Error>> {
    let dir = out.with_extension("model");
    let spec = DeepseekSpec {
        model_type: "kimi_k2",
        hidden_size: 64,
        num_layers: 61,
        num_heads: 8,
        q_lora_rank: 48,
        kv_lora_rank: 32,
        qk_nope_head_dim: 16,
        qk_rope_head_dim: 8,
        v_head_dim: 16,
        intermediate_size: 128,
        n_routed_experts: 16,
        n_shared_experts: 1,
        num_experts_per_tok: 4,
        moe_intermediate_size: 32,
        first_k_dense_replace: 1,
        vocab_size: 500,
    };
    write_deepseek_stored(&dir, &spec, Storage::Int4Experts, true, 1)?;
    write_tokens(&dir.join("tokens.jsonl"), spec.vocab_size, &[512, 259], 2)?;
    extraction_job::<HiddenU<U64>, Tp<U8>>(&dir, &dir.join("tokens.jsonl"), out)
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let out = std::env::args().nth(1).unwrap_or_else(|| "/tmp/kimi-k25-eagle3".into());
    let report = scaled_down(Path::new(&out))?;
    println!(
        "{} samples, {} tokens: 4 captured layers each, [4, T, 64] bf16 in {out}",
        report.progress.samples, report.progress.tokens
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    #[test]
    fn runs_end_to_end_on_the_scaled_down_model() {
        let tmp = tempfile::tempdir().unwrap();
        let out = tmp.path().join("out");
        let report = super::scaled_down(&out).unwrap();
        // The seed's two samples (512 and 259 tokens): 2 samples, not 771 tensors.
        assert_eq!((report.progress.samples, report.progress.tokens), (2, 771));
        let m = strata::format::manifest::Manifest::read(&out).unwrap();
        let points: Vec<&str> = m.capture.iter().map(|c| c.point.as_str()).collect();
        assert_eq!(points, ["input:2", "input:30", "input:58", "input:60"]);
        assert!(strata::dataset::verify::verify(&out, None).unwrap().is_empty());
        let shard = strata::format::MappedFile::open(&out.join(&m.shards[0].file)).unwrap();
        assert_eq!(shard.tensors["0.hidden_states"].shape, vec![4, 512, 64]);
        assert_eq!(shard.tensors["1.hidden_states"].shape, vec![4, 259, 64]);
    }
}
