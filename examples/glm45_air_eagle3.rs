//! EAGLE-3 hidden states of GLM-4.5-Air (`glm4_moe`: 46 decoder layers,
//! hidden 4096, partial RoPE, a sigmoid-routed mixture of 128 experts plus a
//! shared one) on 2 tensor-parallel ranks, as a typed Strata program.
//!
//! The capture points are the EAGLE-3 default, speculators' convention:
//! `input:2, input:N/2, input:N-3, final`, which for N = 46 is `input:2,
//! input:23, input:43, final` (HF `output_hidden_states[2]`, `[23]`, `[43]`,
//! and the last layer's output before the final norm).
//!
//! The layout `[Layers<4>, T, HiddenU<4096>]` over `Tp<U2>` is in the types
//! of `glm_job`: a writer of another width, another number of points, or a
//! split that does not divide 4096 do not compile. GLM-4.5-Air's checkpoint
//! also stores a multi-token-prediction layer (`model.layers.46.*`) that the
//! extraction never runs. This example runs the same generic job on a
//! scaled-down checkpoint of the same structure (46 layers and the MTP one,
//! half of each head rotated, q/k/v biases, a dense first layer, routed and
//! shared experts under GLM's tensor names) with random bf16 weights.
//!
//!     cargo run --release --example glm45_air_eagle3 [-- OUT_DIR]

use std::path::Path;
use strata::format::manifest::{Manifest, ModelInfo};
use strata::job::{Pipeline, Report};
use strata::model::TpLlama;
use strata::parallel::{HiddenU, ShardDim, Tp, TpSize};
use strata::pipeline::capture::{CapturePoint, CaptureSet};
use strata::pipeline::source::JsonlSource;
use strata::shape::{DType, Layers};
use strata::sink::{OpenMode, StrataSink, DEFAULT_SHARD_SIZE};
use strata_testkit::{write_tokens, RandomTensors};
use typenum::{Prod, U1024, U2, U4, U64};

/// GLM-4.5-Air's hidden width, 4 · 1024 = 4096, as a type.
type GlmHidden = HiddenU<Prod<U4, U1024>>;

/// The extraction job, generic over the hidden width `H` and the TP size,
/// with the four EAGLE-3 points of the checkpoint's depth fixed by its types.
fn extraction_job<H: ShardDim<TP> + Default, TP: TpSize + Default>(
    model_dir: &Path,
    data: &Path,
    out: &Path,
) -> Result<Report, Box<dyn std::error::Error>> {
    let model = TpLlama::<H, TP>::load(model_dir, TP::default())?;
    let text = std::fs::read_to_string(model_dir.join("config.json"))?;
    let config = strata::hf::llama::LlamaConfig::from_json(&text)?;
    let points = CapturePoint::eagle3_for(config.num_layers)?;
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

/// The job at GLM-4.5-Air's real layout (compiled here; point it at the released checkpoint's directory).
#[allow(dead_code)]
fn glm_job(model_dir: &Path, data: &Path, out: &Path) -> Result<Report, Box<dyn std::error::Error>> {
    extraction_job::<GlmHidden, Tp<U2>>(model_dir, data, out)
}

/// Writes a random bf16 checkpoint of GLM-4.5-Air's structure at hidden 64
/// (tensor names and config keys as the hub's).
fn write_scaled_down(dir: &Path) -> Result<usize, Box<dyn std::error::Error>> {
    let (h, layers, heads, kv, hd, dense, moe, experts, vocab) = (64, 46, 4, 2, 16, 96, 16, 8, 300);
    std::fs::create_dir_all(dir)?;
    let config = serde_json::json!({
        "architectures": ["Glm4MoeForCausalLM"], "model_type": "glm4_moe",
        "hidden_size": h, "num_hidden_layers": layers, "num_attention_heads": heads,
        "num_key_value_heads": kv, "head_dim": hd, "partial_rotary_factor": 0.5,
        "intermediate_size": dense, "moe_intermediate_size": moe, "n_routed_experts": experts,
        "n_shared_experts": 1, "num_experts_per_tok": 2, "n_group": 1, "topk_group": 1,
        "first_k_dense_replace": 1, "norm_topk_prob": true, "routed_scaling_factor": 1.0,
        "attention_bias": true, "use_qk_norm": false, "num_nextn_predict_layers": 1,
        "rms_norm_eps": 1e-5, "rope_theta": 1000000, "rope_scaling": null,
        "max_position_embeddings": 131072, "vocab_size": vocab, "tie_word_embeddings": false,
        "torch_dtype": "bfloat16",
    });
    std::fs::write(dir.join("config.json"), serde_json::to_string_pretty(&config)?)?;
    let mut t = RandomTensors::new(DType::BF16, 7);
    let mut add = |name: String, shape: Vec<usize>, scale: f32, offset: f32| t.add(name, shape, scale, offset);
    let w = |fan_in: usize| (3.0 / fan_in as f32).sqrt(); // unit-variance outputs
    let mlp = |add: &mut dyn FnMut(String, Vec<usize>, f32, f32), p: String, i: usize| {
        add(format!("{p}.gate_proj.weight"), vec![i, h], w(h), 0.0);
        add(format!("{p}.up_proj.weight"), vec![i, h], w(h), 0.0);
        add(format!("{p}.down_proj.weight"), vec![h, i], w(i), 0.0);
    };
    add("model.embed_tokens.weight".into(), vec![vocab, h], 1.0, 0.0);
    for l in 0..layers {
        let p = format!("model.layers.{l}");
        add(format!("{p}.input_layernorm.weight"), vec![h], 0.2, 1.0);
        for (name, rows) in [("q_proj", heads * hd), ("k_proj", kv * hd), ("v_proj", kv * hd)] {
            add(format!("{p}.self_attn.{name}.weight"), vec![rows, h], w(h), 0.0);
            add(format!("{p}.self_attn.{name}.bias"), vec![rows], 0.1, 0.0);
        }
        add(format!("{p}.self_attn.o_proj.weight"), vec![h, heads * hd], w(heads * hd), 0.0);
        add(format!("{p}.post_attention_layernorm.weight"), vec![h], 0.2, 1.0);
        if l == 0 {
            mlp(&mut add, format!("{p}.mlp"), dense);
            continue;
        }
        add(format!("{p}.mlp.gate.weight"), vec![experts, h], 4.0 * w(h), 0.0);
        add(format!("{p}.mlp.gate.e_score_correction_bias"), vec![experts], 0.1, 0.0);
        for e in 0..experts {
            mlp(&mut add, format!("{p}.mlp.experts.{e}"), moe);
        }
        mlp(&mut add, format!("{p}.mlp.shared_experts"), moe);
    }
    // The multi-token-prediction layer GLM-4.5-Air stores after its last one.
    add(format!("model.layers.{layers}.eh_proj.weight"), vec![h, 2 * h], w(2 * h), 0.0);
    add(format!("model.layers.{layers}.enorm.weight"), vec![h], 0.2, 1.0);
    add("model.norm.weight".into(), vec![h], 0.2, 1.0);
    t.write(dir)?;
    Ok(vocab)
}

/// The same job on the scaled-down checkpoint: hidden 64 over 2 ranks.
fn scaled_down(out: &Path) -> Result<Report, Box<dyn std::error::Error>> {
    let dir = out.with_extension("model");
    let vocab = write_scaled_down(&dir)?;
    write_tokens(&dir.join("tokens.jsonl"), vocab, &[300, 77], 3)?;
    extraction_job::<HiddenU<U64>, Tp<U2>>(&dir, &dir.join("tokens.jsonl"), out)
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let out = std::env::args().nth(1).unwrap_or_else(|| "/tmp/glm45-air-eagle3".into());
    let report = scaled_down(Path::new(&out))?;
    println!(
        "{} samples, {} tokens: input:2, input:23, input:43 and final each, [4, T, 64] bf16 in {out}",
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
        assert_eq!((report.progress.samples, report.progress.tokens), (2, 377));
        let m = strata::format::manifest::Manifest::read(&out).unwrap();
        let points: Vec<&str> = m.capture.iter().map(|c| c.point.as_str()).collect();
        assert_eq!(points, ["input:2", "input:23", "input:43", "final"], "EAGLE-3's points of a 46-layer model");
        assert!(strata::dataset::verify::verify(&out, None).unwrap().is_empty());
        let shard = strata::format::MappedFile::open(&out.join(&m.shards[0].file)).unwrap();
        assert_eq!(shard.tensors["0.hidden_states"].shape, vec![4, 300, 64]);
        assert_eq!(shard.tensors["1.hidden_states"].shape, vec![4, 77, 64]);
    }
}
