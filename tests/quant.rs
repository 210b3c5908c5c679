//! Real DeepSeek / Kimi checkpoint formats: FP8 block weights, compressed-tensors
//! INT4 experts and Kimi-K2.5's multimodal wrapper, against HF transformers run
//! on the exactly dequantised weights (fixtures by scripts/make_quant_fixtures.py).

use crate::common;

use common::*;
use std::path::Path;
use strata::backend::LinearInfo;
use strata::backend::SeqState;
use strata::hf::quant::QuantKind;
use strata::model::{Deepseek, Llama};
use strata::pipeline::batch::PackedBatch;
use strata::pipeline::capture::CaptureSet;
use strata::shape::CapturedStates;

fn extract(model: &Path, data: &Path, n: usize, out: &Path, extra: &[&str]) -> std::process::Output {
    let list: Vec<String> = all_points(n).iter().map(|p| p.to_string()).collect();
    std::process::Command::new(env!("CARGO_BIN_EXE_strata"))
        .args(["extract", "--model"])
        .arg(model)
        .arg("--data")
        .arg(data)
        .args(["--capture", &list.join(","), "--dtype", "f32", "--compute", "f32", "--out"])
        .arg(out)
        .args(extra)
        .output()
        .unwrap()
}

/// Worst relative error of every sample and capture point of an output against HF.
fn check_against_hf(name: &str, out: &Path, what: &str) -> f32 {
    let n = num_layers(name);
    let exp = read_tensors(&fixture(name).join("expected.safetensors"));
    let got = read_tensors(&out.join("shard-00000.safetensors"));
    let mut worst = 0f32;
    for (i, ids) in samples(name).iter().enumerate() {
        let hs = &got[&format!("{i}.hidden_states")];
        let per = ids.len() * hs.shape[2];
        for (slot, p) in all_points(n).iter().enumerate() {
            let err = max_err(&hs.data[slot * per..(slot + 1) * per], expected(&exp, i, *p, n));
            assert!(err <= TOL, "{name} {what} sample {i} {p}: {err:e} from HF");
            worst = worst.max(err);
        }
    }
    worst
}

#[test]
fn cli_matches_hf_at_tp_1_and_2() {
    for name in QUANT.iter().chain(LLAMA_QUANT) {
        let n = num_layers(name);
        let tmp = tempfile::tempdir().unwrap();
        let data = fixture(name).join("data.jsonl");
        let mut line = format!("{name}:");
        for (tp, budget) in [("1", "8192"), ("1", "5"), ("2", "16")] {
            let out = tmp.path().join(format!("tp{tp}-{budget}"));
            let o = extract(&fixture(name), &data, n, &out, &["--tp", tp, "--max-batch-tokens", budget]);
            assert!(o.status.success(), "{name} --tp {tp}: {}", String::from_utf8_lossy(&o.stderr));
            let worst = check_against_hf(name, &out, &format!("--tp {tp}"));
            line += &format!(" tp{tp}/budget {budget} worst {worst:.2e};");
        }
        // Decoding is exact and per tile, so chunking does not change a bit.
        assert!(
            dir_contents(&tmp.path().join("tp1-8192")) == dir_contents(&tmp.path().join("tp1-5")),
            "{name}: --max-batch-tokens changes the output"
        );
        let (a, b) = (
            read_tensors(&tmp.path().join("tp1-8192/shard-00000.safetensors")),
            read_tensors(&tmp.path().join("tp2-16/shard-00000.safetensors")),
        );
        let diff = a.iter().map(|(k, t)| max_err(&b[k].data, &t.data)).fold(0f32, f32::max);
        assert!(diff <= 2e-5, "{name}: --tp 2 differs from --tp 1 by {diff:e}");
        println!("{line} tp2 vs tp1 {diff:.2e}");
    }
}

/// Every sample of `name` packed into one step, and every capture point of its depth.
fn whole_step(name: &str) -> (PackedBatch, CaptureSet<usize>) {
    let samples = samples(name);
    let batch = PackedBatch::from_samples(samples.iter().map(|s| s.as_slice()));
    (batch, CaptureSet::<usize>::try_new(all_points(num_layers(name))).unwrap())
}

/// Each sample's states of `whole_step(name)` within TOL of HF at every point.
fn assert_matches_hf(name: &str, states: &CapturedStates<usize, usize>, batch: &PackedBatch) {
    let n = num_layers(name);
    let exp = read_tensors(&fixture(name).join("expected.safetensors"));
    for i in 0..batch.segments().len() {
        let one = states.slice_tokens(batch.range(i)).unwrap();
        for (slot, p) in all_points(n).iter().enumerate() {
            let err = max_err(one.layer(slot), expected(&exp, i, *p, n));
            assert!(err <= TOL, "{name} sample {i} {p}: {err:e}");
        }
    }
}

/// A Llama-family FP8 checkpoint (MiniMax-M2's format) matches HF on the
/// dequantised weights with every FP8 weight held as codes: attention and
/// experts FP8, the routers bf16 (its `modules_to_not_convert`).
#[test]
fn llama_family_keeps_fp8_weights_fp8() {
    for name in LLAMA_QUANT {
        let model: Llama = Llama::load(&fixture(name)).unwrap();
        let (batch, set) = whole_step(name);
        assert_matches_hf(name, &model.forward_step(&batch, &set, &mut SeqState::default()).unwrap(), &batch);
        let linears = model.linears();
        let held = |k: QuantKind| linears.iter().filter(|l| l.held_as() == Some(k)).count();
        let (fp8, bf16, total) = (held(QuantKind::Fp8), held(QuantKind::Bf16), linears.len());
        let routers = model.config().moe.as_ref().map_or(0, |m| m.sparse.iter().filter(|&&s| s).count());
        assert_eq!(fp8, total - routers, "{name}: {fp8} of {total} linear layers held as FP8");
        assert_eq!(bf16, routers, "{name}: the routers are held as stored (bf16)");
    }
}

#[test]
fn library_keeps_quantized_weights_quantized() {
    for name in QUANT {
        let model: Deepseek = Deepseek::load(&fixture(name)).unwrap();
        let (batch, set) = whole_step(name);
        assert_matches_hf(name, &model.forward_step(&batch, &set, &mut SeqState::default()).unwrap(), &batch);
        // Every weight the checkpoint quantises is held as its codes, and the bf16 ones as bf16.
        let linears = model.linears();
        let held = |k: QuantKind| linears.iter().filter(|l| l.held_as() == Some(k)).count();
        let (quantized, total) = (held(QuantKind::Fp8) + held(QuantKind::Int4), linears.len());
        assert_eq!(quantized + held(QuantKind::Bf16), total, "{name}: every linear is held as stored");
        let c = model.config();
        let moe_layers = (0..c.num_layers).filter(|&l| c.is_moe(l)).count();
        let want = if name.contains("int4") || name.contains("k25") {
            2 * c.n_routed_experts * moe_layers // routed experts only: fused gate/up, and down
        } else {
            total - moe_layers // all but the routers
        };
        assert_eq!(quantized, want, "{name}: {quantized} of {total} linear layers held quantised");
    }
}

/// Copies a fixture so a test can alter it.
fn copy_fixture(name: &str, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(fixture(name)).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), to.join(e.file_name())).unwrap();
    }
}

fn edit_config(dir: &Path, f: impl FnOnce(&mut serde_json::Value)) {
    let path = dir.join("config.json");
    let mut v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    f(&mut v);
    std::fs::write(path, serde_json::to_string_pretty(&v).unwrap()).unwrap();
}

/// Runs an extraction expected to fail; returns its stderr after checking nothing was written.
fn refused(model: &Path, name: &str) -> String {
    let out = model.parent().unwrap().join("out");
    let o = extract(model, &fixture(name).join("data.jsonl"), num_layers(name), &out, &[]);
    assert!(!o.status.success(), "{}: extraction should fail", model.display());
    assert!(!out.exists(), "a refused run must not leave output");
    String::from_utf8_lossy(&o.stderr).into_owned()
}

#[test]
fn the_wrappers_vision_shard_is_never_opened() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("m");
    copy_fixture("kimi-k25-wrapper", &dir);
    // Garbage where the vision-only shard was: a loader that opened it would fail.
    std::fs::write(dir.join("vision-00001.safetensors"), b"not a safetensors file").unwrap();
    let out = tmp.path().join("out");
    let n = num_layers("kimi-k25-wrapper");
    let o = extract(&dir, &fixture("kimi-k25-wrapper").join("data.jsonl"), n, &out, &[]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    check_against_hf("kimi-k25-wrapper", &out, "with a corrupt vision shard");
}

#[test]
fn unsupported_schemes_are_named() {
    let tmp = tempfile::tempdir().unwrap();
    for (i, (name, quant, needle)) in [
        ("kimi-k2-int4", serde_json::json!({"quant_method": "gptq", "bits": 4}), "quant_method \"gptq\""),
        ("kimi-k2-int4", serde_json::json!({"quant_method": "bitsandbytes"}), "quant_method \"bitsandbytes\""),
        (
            "deepseek-v3-fp8",
            serde_json::json!({"quant_method": "fp8", "fmt": "e5m2", "weight_block_size": [128, 128]}),
            "e5m2",
        ),
        (
            "kimi-k2-int4",
            serde_json::json!({"quant_method": "compressed-tensors", "format": "pack-quantized",
                "config_groups": {"g": {"targets": ["Linear"], "weights": {"num_bits": 8, "type": "int",
                "symmetric": true, "strategy": "channel"}}}}),
            "8-bit int weights are not supported",
        ),
    ]
    .into_iter()
    .enumerate()
    {
        let dir = tmp.path().join(format!("{i}/m"));
        copy_fixture(name, &dir);
        edit_config(&dir, |v| v["quantization_config"] = quant);
        let err = refused(&dir, name);
        assert!(err.contains("quantization_config") && err.contains(needle), "{name}: {err}");
    }
}

#[test]
fn tensors_that_disagree_with_the_config_are_refused() {
    let tmp = tempfile::tempdir().unwrap();
    // FP8 tensors with no quantization_config.
    let dir = tmp.path().join("a/m");
    copy_fixture("deepseek-v3-fp8", &dir);
    edit_config(&dir, |v| {
        v.as_object_mut().unwrap().remove("quantization_config");
    });
    let err = refused(&dir, "deepseek-v3-fp8");
    assert!(err.contains("F8_E4M3") && err.contains("quantization_config"), "{err}");
    // INT4 tensors the config does not select (everything ignored).
    let dir = tmp.path().join("b/m");
    copy_fixture("kimi-k2-int4", &dir);
    edit_config(&dir, |v| v["quantization_config"]["ignore"] = serde_json::json!(["re:.*"]));
    let err = refused(&dir, "kimi-k2-int4");
    assert!(err.contains("weight_packed") && err.contains("does not select"), "{err}");
    // A weight_shape that does not match the config.
    let dir = tmp.path().join("c/m");
    copy_fixture("kimi-k2-int4", &dir);
    edit_config(&dir, |v| v["moe_intermediate_size"] = serde_json::json!(64));
    let err = refused(&dir, "kimi-k2-int4");
    assert!(err.contains("weight_packed") || err.contains("weight_shape"), "{err}");
}

#[test]
fn resident_weights_stay_within_1_25x_of_the_files() {
    use strata_testkit::{write_deepseek_stored, DeepseekSpec, Storage};
    let spec = DeepseekSpec {
        model_type: "kimi_k2",
        hidden_size: 256,
        num_layers: 3,
        num_heads: 4,
        q_lora_rank: 128,
        kv_lora_rank: 64,
        qk_nope_head_dim: 32,
        qk_rope_head_dim: 16,
        v_head_dim: 32,
        intermediate_size: 512,
        n_routed_experts: 32,
        n_shared_experts: 1,
        num_experts_per_tok: 4,
        moe_intermediate_size: 256,
        first_k_dense_replace: 1,
        vocab_size: 512,
    };
    let tmp = tempfile::tempdir().unwrap();
    for (storage, wrapper) in [(Storage::Int4Experts, true), (Storage::Fp8, false), (Storage::Bf16, false)] {
        let dir = tmp.path().join(format!("{storage:?}"));
        write_deepseek_stored(&dir, &spec, storage, wrapper, 3).unwrap();
        let file = std::fs::metadata(dir.join("model.safetensors")).unwrap().len() as f64;
        let model: Deepseek = Deepseek::load(&dir).unwrap();
        let ratio = model.resident_bytes() as f64 / file;
        println!(
            "{storage:?}: {:.1} MB on disk, {:.1} MB resident ({ratio:.3}x)",
            file / 1e6,
            model.resident_bytes() as f64 / 1e6
        );
        assert!(ratio <= 1.25, "{storage:?}: resident {ratio:.3}x the file size");
        // And it runs.
        let batch = PackedBatch::from_samples([&[1u32, 2, 3, 500][..], &[7, 8]]);
        let set = CaptureSet::<usize>::try_new(all_points(spec.num_layers)).unwrap();
        let states = model.forward_step(&batch, &set, &mut SeqState::default()).unwrap();
        assert!(states.as_slice().iter().all(|v| v.is_finite()), "{storage:?}: non-finite states");
    }
}

/// gpt-oss's MXFP4 experts stay packed (4.25 bits a weight) at both compute
/// dtypes, measured at load as the extract summary reports it
/// (`Model::weight_bytes`), before any forward. The attention, router and
/// embedding weights are bf16 in the file as on the hub, and stay bf16.
#[test]
fn gpt_oss_mxfp4_weights_stay_within_1_25x_of_the_file() {
    use strata::backend::Compute;
    use strata::model::{LoadOptions, Model};
    let dir = fixture("gpt-oss-mxfp4");
    let file = std::fs::metadata(dir.join("model.safetensors")).unwrap().len() as f64;
    let dense = std::fs::metadata(fixture("gpt-oss").join("model.safetensors")).unwrap().len() as f64;
    for compute in [Compute::F32, Compute::Bf16] {
        let model = strata::model::load(&dir, LoadOptions { compute, ..Default::default() }).unwrap();
        let ratio = model.weight_bytes() as f64 / file;
        println!(
            "gpt-oss-mxfp4 --compute {compute}: {:.1} KB on disk, {:.1} KB resident ({ratio:.3}x; the dense twin's file is {:.2}x)",
            file / 1e3,
            model.weight_bytes() as f64 / 1e3,
            dense / file
        );
        assert!(ratio <= 1.25, "--compute {compute}: resident {ratio:.3}x the file size");
    }
}

#[test]
fn fp8_nan_codes_are_refused_as_corruption() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("m");
    copy_fixture("deepseek-v3-fp8", &dir);
    let path = dir.join("model.safetensors");
    let mut bytes = std::fs::read(&path).unwrap();
    let name = "model.layers.1.mlp.experts.2.down_proj.weight";
    let (n, meta) = safetensors::SafeTensors::read_metadata(&bytes).unwrap();
    let start = 8 + n + meta.info(name).unwrap().data_offsets.0;
    bytes[start + 5] = 0xff;
    std::fs::write(&path, bytes).unwrap();
    let err = refused(&dir, "deepseek-v3-fp8");
    assert!(err.contains(name) && err.contains("NaN"), "{err}");
}

#[test]
fn a_wrapper_opened_without_its_prefix_is_a_clear_error() {
    use strata::hf::checkpoint::Checkpoint;
    use strata::hf::DeepseekConfig;
    let dir = fixture("kimi-k25-wrapper");
    let config = DeepseekConfig::from_file(&dir.join("config.json")).unwrap();
    assert_eq!((config.model_type.as_str(), config.tensor_prefix.as_str()), ("kimi_k2", "language_model."));
    let err = Deepseek::<usize>::from_checkpoint(config.clone(), &Checkpoint::open(&dir).unwrap()).err().unwrap();
    assert!(err.to_string().contains("open_scoped"), "{err}");
    let ckpt = Checkpoint::open_scoped(&dir, &config.tensor_prefix).unwrap();
    assert!(Deepseek::<usize>::from_checkpoint(config, &ckpt).is_ok());
}
