//! Helpers shared by the integration tests: fixtures and their HF references.
#![allow(dead_code)]

use std::collections::HashMap;
use std::ffi::OsStr;
use std::path::{Path, PathBuf};
use strata::pipeline::capture::CapturePoint;
use strata::shape::DType;

/// Absolute and relative tolerance of f32 parity with HF: `|a - b| <= TOL * max(1, |b|)`.
pub const TOL: f32 = 1e-4;

/// The f32 tolerance against HF of the hybrid fixtures ([`HYBRID`]): HF's own f32 states of
/// them lie up to 3e-4 from its f64 run (measured; each DeltaNet head's gated norm divides out the
/// magnitude of an output that may cancel, so its f32 rounding shows), so two correct f32
/// implementations differ by that much. The f64 reference backend is checked against HF's f64
/// states at [`TOL`] instead (tests/backends.rs).
pub const HYBRID_TOL: f32 = 1e-3;

/// The f32 tolerance against HF of fixture `name`: [`TOL`], or [`HYBRID_TOL`] for a hybrid one.
pub fn tol(name: &str) -> f32 {
    if HYBRID.contains(&name) {
        HYBRID_TOL
    } else {
        TOL
    }
}

/// Every Llama-family parity fixture (see scripts/make_fixtures.py).
pub const FIXTURES: &[&str] = &[
    "llama-default",
    "llama-gqa-sharded",
    "mistral-swa",
    "qwen2-swa",
    "qwen3",
    "qwen3-moe",
    "mixtral",
    "glm4-moe",
    "minimax-m2",
];

/// The Gemma 3 parity fixtures: `gemma3_text`, and the `gemma3` multimodal wrapper (scripts/make_fixtures.py).
pub const GEMMA: &[&str] = &["gemma3-text", "gemma3"];

/// The gpt-oss parity fixtures: MXFP4 experts as the hub ships them, and the dense twin
/// transformers' dequantiser makes of them (scripts/make_fixtures.py).
pub const GPT_OSS: &[&str] = &["gpt-oss", "gpt-oss-mxfp4"];

/// The Llama 4 parity fixtures: `llama4_text` (Scout's layout: MoE everywhere, q/k norm, the
/// hub's older keys) and the `llama4` multimodal wrapper (Maverick's: dense and MoE layers
/// alternating, no q/k norm), both with chunked RoPE layers and tempered NoPE ones (scripts/make_fixtures.py).
pub const LLAMA4: &[&str] = &["llama4-text", "llama4"];

/// The hybrid linear-attention parity fixtures: Qwen3-Next (grouped projections, the hub's older
/// keys) and Qwen3.5-MoE in its multimodal wrapper (split projections, fused experts, bf16), each
/// with samples that cross 64-position DeltaNet chunks (scripts/make_fixtures.py).
pub const HYBRID: &[&str] = &["qwen3-next", "qwen3_5-moe"];

/// The DeepSeek-family parity fixtures with plain weights (scripts/make_fixtures.py).
pub const DEEPSEEK: &[&str] = &["deepseek-v3", "deepseek-v3-nolora", "deepseek-v2-lite", "deepseek-v2-group"];

/// The DeepSeek-family parity fixtures with FP8 or INT4 weights (scripts/make_quant_fixtures.py).
pub const QUANT: &[&str] = &["deepseek-v3-fp8", "kimi-k2-fp8-sharded", "kimi-k2-int4", "kimi-k25-wrapper"];

/// Llama-family parity fixtures with FP8 weights (scripts/make_quant_fixtures.py).
pub const LLAMA_QUANT: &[&str] = &["minimax-m2-fp8"];

/// Every HF-parity fixture, of every family and storage format.
pub fn all_fixtures() -> impl Iterator<Item = &'static str> {
    FIXTURES
        .iter()
        .chain(GEMMA)
        .chain(GPT_OSS)
        .chain(LLAMA4)
        .chain(DEEPSEEK)
        .chain(QUANT)
        .chain(LLAMA_QUANT)
        .chain(HYBRID)
        .copied()
}

/// Path of a fixture directory: in the checkout the test was built from, or,
/// where that is gone (test binaries carried to a GPU machine by
/// scripts/gpu-check.sh), under the current directory.
pub fn fixture(name: &str) -> PathBuf {
    let built = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures");
    let root = if built.is_dir() { built } else { PathBuf::from("tests/fixtures") };
    root.join(name)
}

/// A decoded f32 tensor.
pub struct Tensor {
    pub shape: Vec<usize>,
    pub data: Vec<f32>,
}

/// Reads every tensor of a safetensors file as f32 (I64 tensors are converted too).
pub fn read_tensors(path: &Path) -> HashMap<String, Tensor> {
    let bytes = std::fs::read(path).unwrap_or_else(|e| panic!("read {}: {e}", path.display()));
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    st.tensors()
        .into_iter()
        .map(|(name, v)| {
            let n: usize = v.shape().iter().product();
            let data = match v.dtype() {
                safetensors::Dtype::I64 => {
                    v.data().chunks_exact(8).map(|c| i64::from_le_bytes(c.try_into().unwrap()) as f32).collect()
                }
                safetensors::Dtype::U8 => v.data().iter().map(|&b| b as f32).collect(),
                d => {
                    let dt = DType::from_safetensors(d).expect("float dtype");
                    let mut out = vec![0f32; n];
                    dt.decode_into(v.data(), &mut out);
                    out
                }
            };
            (name, Tensor { shape: v.shape().to_vec(), data })
        })
        .collect()
}

/// Token ids of each line of a fixture's data.jsonl.
pub fn samples(name: &str) -> Vec<Vec<u32>> {
    std::fs::read_to_string(fixture(name).join("data.jsonl"))
        .unwrap()
        .lines()
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).unwrap();
            v["input_ids"].as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect()
        })
        .collect()
}

/// The layer count of a fixture.
pub fn num_layers(name: &str) -> usize {
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(fixture(name).join("config.json")).unwrap()).unwrap();
    let text = v.get("text_config").unwrap_or(&v); // a multimodal wrapper's language model
    text["num_hidden_layers"].as_u64().unwrap() as usize
}

/// Every capture point of an `n`-layer model.
pub fn all_points(n: usize) -> Vec<CapturePoint> {
    let mut v = vec![CapturePoint::Embeddings];
    v.extend((0..n).map(CapturePoint::LayerInput));
    v.extend((0..n).map(CapturePoint::LayerOutput));
    v.push(CapturePoint::FinalPreNorm);
    v.push(CapturePoint::FinalPostNorm);
    v
}

/// HF's `[T, H]` states of sample `i` at a capture point.
pub fn expected(exp: &HashMap<String, Tensor>, i: usize, p: CapturePoint, n: usize) -> &[f32] {
    match p.hf_index(n) {
        Some(k) => {
            let t = &exp[&format!("sample{i}.hidden_states")];
            let per = t.shape[1] * t.shape[2];
            &t.data[k * per..(k + 1) * per]
        }
        None => &exp[&format!("sample{i}.final_pre_norm")].data,
    }
}

/// Largest `|a - b| / max(1, |b|)`.
pub fn max_err(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len(), "length mismatch");
    a.iter().zip(b).map(|(x, y)| (x - y).abs() / y.abs().max(1.0)).fold(0.0, f32::max)
}

/// Runs the `strata` binary; returns (success, stdout, stderr).
pub fn strata(args: &[&std::ffi::OsStr]) -> (bool, String, String) {
    let o = std::process::Command::new(env!("CARGO_BIN_EXE_strata")).args(args).output().unwrap();
    let (out, err) = (String::from_utf8_lossy(&o.stdout).to_string(), String::from_utf8_lossy(&o.stderr).to_string());
    assert!(!err.contains("panicked"), "strata panicked: {err}");
    (o.status.success(), out, err)
}

/// Every file under `dir`, subdirectories included (relative names and bytes),
/// sorted, for whole-directory comparisons.
pub fn dir_contents(dir: &Path) -> Vec<(String, Vec<u8>)> {
    fn walk(dir: &Path, prefix: &str, v: &mut Vec<(String, Vec<u8>)>) {
        for e in std::fs::read_dir(dir).unwrap() {
            let e = e.unwrap();
            let name = format!("{prefix}{}", e.file_name().to_string_lossy());
            if e.file_type().unwrap().is_dir() {
                walk(&e.path(), &format!("{name}/"), v);
            } else {
                v.push((name, std::fs::read(e.path()).unwrap()));
            }
        }
    }
    let mut v = Vec::new();
    walk(dir, "", &mut v);
    v.sort();
    v
}

/// A CLI argument.
pub fn os(s: &str) -> &std::ffi::OsStr {
    std::ffi::OsStr::new(s)
}

/// `strata verify DIR ARGS...`: (success, stdout + stderr).
pub fn verify(dir: &Path, extra: &[&str]) -> (bool, String) {
    let mut args: Vec<&std::ffi::OsStr> = vec![os("verify"), dir.as_os_str()];
    args.extend(extra.iter().map(|s| os(s)));
    let (ok, out, err) = strata(&args);
    (ok, out + &err)
}

/// `n` samples of random lengths in `lens` for the embedded model (vocab 256), with ids and loss masks.
pub fn write_data(path: &Path, n: usize, lens: std::ops::Range<u64>, seed: u64) {
    let mut rng = strata_testkit::Rng::new(seed);
    let mut text = String::new();
    for i in 0..n {
        let len = lens.start + rng.below(lens.end - lens.start);
        let ids: Vec<u64> = (0..len).map(|_| rng.below(256)).collect();
        let mask: Vec<u64> = (0..len).map(|t| (t >= len / 3) as u64).collect();
        text += &serde_json::json!({"id": format!("s{i:05}"), "input_ids": ids, "loss_mask": mask}).to_string();
        text.push('\n');
    }
    std::fs::write(path, text).unwrap();
}

/// `strata extract` on the embedded model with `--data` and `--out`.
pub fn run_embedded(data: &Path, out: &Path, extra: &[&str]) -> (bool, String, String) {
    let mut args: Vec<&OsStr> = vec![os("extract"), os("--data"), data.as_os_str(), os("--out"), out.as_os_str()];
    args.extend(extra.iter().map(|s| os(s)));
    // The embedded model needs --data only with --model; here --data replaces the demo samples.
    strata(&args)
}

/// A tiny random-weight Llama (hidden 32, 2 layers) with `vocab` tokens, in `dir`.
pub fn tiny_llama(dir: &Path, vocab: usize) {
    tiny_llama_seeded(dir, vocab, 3);
}

/// [`tiny_llama`] with the weights of another seed.
pub fn tiny_llama_seeded(dir: &Path, vocab: usize, seed: u64) {
    std::fs::create_dir_all(dir).unwrap();
    let spec = strata_testkit::LlamaSpec {
        hidden_size: 32,
        num_layers: 2,
        num_heads: 2,
        num_kv_heads: 1,
        intermediate_size: 64,
        vocab_size: vocab,
    };
    strata_testkit::write_llama(dir, &spec, strata::shape::DType::F32, seed).unwrap();
}

/// [`tiny_llama`] in `dir/model-{template}` with the chat fixtures' tokenizer
/// and `templates/{template}.jinja` as its chat_template.jinja.
pub fn chat_model(dir: &Path, template: &str) -> PathBuf {
    let model = dir.join(format!("model-{template}"));
    tiny_llama(&model, 512);
    let chat = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/chat");
    for f in ["tokenizer.json", "tokenizer_config.json"] {
        std::fs::copy(chat.join(f), model.join(f)).unwrap();
    }
    std::fs::copy(chat.join(format!("templates/{template}.jinja")), model.join("chat_template.jinja")).unwrap();
    model
}

/// Every sample of fixture `name`, packed into one batch.
pub fn whole(name: &str) -> strata::pipeline::batch::PackedBatch {
    let samples = samples(name);
    strata::pipeline::batch::PackedBatch::from_samples(samples.iter().map(|s| s.as_slice()))
}

/// Worst relative error against HF f32 over every sample and capture point,
/// and the relative L2 error over all of them.
pub fn errors(
    name: &str,
    states: &strata::shape::CapturedStates<usize, usize>,
    batch: &strata::pipeline::batch::PackedBatch,
) -> (f32, f64) {
    let n = num_layers(name);
    let points = all_points(n);
    let exp = read_tensors(&fixture(name).join("expected.safetensors"));
    let (mut worst, mut sq, mut norm) = (0f32, 0f64, 0f64);
    for i in 0..batch.num_samples() {
        let one = states.slice_tokens(batch.range(i)).unwrap();
        for (slot, p) in points.iter().enumerate() {
            let want = expected(&exp, i, *p, n);
            worst = worst.max(max_err(one.layer(slot), want));
            for (g, w) in one.layer(slot).iter().zip(want) {
                sq += (*g as f64 - *w as f64).powi(2);
                norm += (*w as f64).powi(2);
            }
        }
    }
    (worst, (sq / norm).sqrt())
}

/// HF's own bf16 run's relative L2 error against its f32 states.
pub fn torch_bf16_error(name: &str, batch: &strata::pipeline::batch::PackedBatch) -> f64 {
    let n = num_layers(name);
    let exp = read_tensors(&fixture(name).join("expected.safetensors"));
    let torch = read_tensors(&fixture(name).join("expected_bf16.safetensors"));
    let (mut sq, mut norm) = (0f64, 0f64);
    for i in 0..batch.num_samples() {
        for p in all_points(n) {
            for (g, w) in expected(&torch, i, p, n).iter().zip(expected(&exp, i, p, n)) {
                sq += (*g as f64 - *w as f64).powi(2);
                norm += (*w as f64).powi(2);
            }
        }
    }
    (sq / norm).sqrt()
}
