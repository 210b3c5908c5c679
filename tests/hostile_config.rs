//! Hostile or careless `config.json`s and checkpoints: zero and absurd sizes,
//! values that can only give NaN, sizes that would exhaust memory, a tensor
//! stored twice, repeated capture points, a missing `max_position_embeddings`,
//! and FIFOs in place of files. Each gives a clear error, never a panic, an
//! allocation abort or a hang.

use crate::common;

use common::*;
use serde_json::{json, Value};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};
use strata::hf::checkpoint::Checkpoint;
use strata::hf::{DeepseekConfig, LlamaConfig};
use strata::model::{AnyConfig, LoadOptions};
use strata_testkit::{write_deepseek, DeepseekSpec};

/// How a `strata` run ended.
struct Run {
    code: Option<i32>,
    stderr: String,
}

impl Run {
    /// Asserts a failure (exit 1) whose message holds every needle, without a panic or an allocation abort.
    fn fails_with(&self, needles: &[&str]) {
        assert_eq!(self.code, Some(1), "expected exit 1:\n{}", self.stderr);
        for n in needles {
            assert!(self.stderr.contains(n), "message lacks {n:?}:\n{}", self.stderr);
        }
    }
}

/// Runs `cmd` (stdout and stderr to files, so a chatty child cannot block on
/// a full pipe), killing it after `secs`; fails the test on a timeout, a
/// panic or an allocation abort.
fn run_for(mut cmd: Command, secs: u64) -> Run {
    let tmp = tempfile::tempdir().unwrap();
    let err_path = tmp.path().join("stderr");
    cmd.stdin(Stdio::null())
        .stdout(Stdio::from(std::fs::File::create(tmp.path().join("stdout")).unwrap()))
        .stderr(Stdio::from(std::fs::File::create(&err_path).unwrap()));
    let mut child = cmd.spawn().unwrap();
    let start = Instant::now();
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        if start.elapsed() > Duration::from_secs(secs) {
            let _ = child.kill();
            let _ = child.wait();
            panic!("strata did not finish within {secs} s: {:?}", cmd);
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let stderr = std::fs::read_to_string(&err_path).unwrap();
    assert!(!stderr.contains("panicked"), "strata panicked:\n{stderr}");
    assert!(!stderr.contains("memory allocation"), "strata aborted on an allocation:\n{stderr}");
    Run { code: status.code(), stderr }
}

/// `strata extract --model MODEL --data DATA --out TMP/out EXTRA...`, optionally
/// under a 2 GB address-space limit.
fn extract(model: &Path, data: &Path, extra: &[&str], limit_memory: bool) -> Run {
    let out = tempfile::tempdir().unwrap();
    let bin = env!("CARGO_BIN_EXE_strata");
    let mut cmd = if limit_memory {
        let mut c = Command::new("sh");
        c.args(["-c", "ulimit -v 2000000; exec \"$0\" \"$@\"", bin]);
        // Few threads and malloc arenas: the limit then bounds the model, not the runtime.
        c.env("RAYON_NUM_THREADS", "2").env("MALLOC_ARENA_MAX", "2");
        c
    } else {
        Command::new(bin)
    };
    cmd.arg("extract").arg("--model").arg(model).arg("--data").arg(data).arg("--out").arg(out.path().join("o"));
    cmd.args(extra);
    run_for(cmd, 120)
}

/// A copy of fixture `name` (config and weight files) in a temporary directory.
fn copy_fixture(name: &str) -> tempfile::TempDir {
    let tmp = tempfile::tempdir().unwrap();
    for e in std::fs::read_dir(fixture(name)).unwrap() {
        let e = e.unwrap();
        let f = e.file_name().to_string_lossy().to_string();
        if f != "expected.safetensors" {
            std::fs::copy(e.path(), tmp.path().join(&f)).unwrap();
        }
    }
    tmp
}

fn config_of(name: &str) -> Value {
    serde_json::from_str(&std::fs::read_to_string(fixture(name).join("config.json")).unwrap()).unwrap()
}

/// A copy of fixture `name` whose config.json `edit` changed.
fn with_config(name: &str, edit: impl FnOnce(&mut Value)) -> tempfile::TempDir {
    let dir = copy_fixture(name);
    let mut c = config_of(name);
    edit(&mut c);
    std::fs::write(dir.path().join("config.json"), c.to_string()).unwrap();
    dir
}

fn data(name: &str) -> PathBuf {
    fixture(name).join("data.jsonl")
}

/// Parses `base` with `key` set to `value` (`null` removes it) and returns the error text.
fn refusal<T: std::fmt::Debug, E: std::fmt::Display>(
    base: &Value,
    edits: &[(&str, Value)],
    parse: impl Fn(&str) -> Result<T, E>,
) -> String {
    let mut c = base.clone();
    for (k, v) in edits {
        let target = if k.starts_with("rope.") { &mut c["rope_parameters"] } else { &mut c };
        let key = k.trim_start_matches("rope.");
        if v.is_null() {
            target.as_object_mut().unwrap().remove(key);
        } else {
            target[key] = v.clone();
        }
    }
    match parse(&c.to_string()) {
        Ok(parsed) => panic!("{edits:?} was accepted: {parsed:?}"),
        Err(e) => e.to_string(),
    }
}

#[test]
fn deepseek_sizes_are_validated_like_llamas() {
    let base = config_of("deepseek-v3");
    let huge = json!(1u64 << 40);
    let cases: Vec<(Vec<(&str, Value)>, &str)> = vec![
        (vec![("q_lora_rank", json!(0))], "`q_lora_rank`: must be positive"),
        (vec![("kv_lora_rank", json!(0))], "`kv_lora_rank`: must be positive"),
        (vec![("num_attention_heads", json!(0))], "`num_attention_heads`: must be positive"),
        (vec![("qk_nope_head_dim", json!(0))], "`qk_nope_head_dim`: must be positive"),
        (vec![("qk_rope_head_dim", json!(0))], "`qk_rope_head_dim`: must be positive"),
        (vec![("v_head_dim", json!(0))], "`v_head_dim`: must be positive"),
        (vec![("hidden_size", json!(0))], "`hidden_size`: must be positive"),
        (vec![("vocab_size", json!(0))], "`vocab_size`: must be positive"),
        (vec![("intermediate_size", json!(0))], "`intermediate_size`: must be positive"),
        (vec![("num_hidden_layers", json!(0))], "`num_hidden_layers`: must be positive"),
        (vec![("max_position_embeddings", json!(0))], "`max_position_embeddings`: must be positive"),
        (vec![("n_routed_experts", json!(0))], "`n_routed_experts`: must be positive"),
        (vec![("n_routed_experts", huge.clone())], "`n_routed_experts`: 1099511627776 is implausibly large"),
        (vec![("num_attention_heads", huge.clone())], "`num_attention_heads`: 1099511627776 is implausibly large"),
        (vec![("num_experts_per_tok", json!(9))], "`num_experts_per_tok`: 9 is not in 1..=8"),
        (vec![("num_experts_per_tok", json!(0))], "`num_experts_per_tok`: 0 is not in 1..=8"),
        (vec![("moe_intermediate_size", json!(0))], "`moe_intermediate_size`: must be positive"),
        (vec![("moe_layer_freq", json!(0))], "`moe_layer_freq`: must be positive"),
        (vec![("n_group", json!(0))], "`n_group`: must be positive"),
        (vec![("topk_group", json!(0))], "`topk_group`: must be positive"),
        (vec![("n_group", json!(3))], "`n_group`: 3 groups of 8 experts"),
        (vec![("topk_group", json!(5))], "topk_group must be at most n_group"),
        // One of four groups of two experts cannot supply three.
        (
            vec![("topk_group", json!(1))],
            "`topk_group`: 1 of 4 groups of 2 experts hold fewer than num_experts_per_tok 3",
        ),
        (vec![("kv_lora_rank", json!(u64::MAX))], "`kv_lora_rank`: makes kv_a_proj_with_mqa"),
        // Strata's bounds, far above any real model (transformers has none).
        (vec![("qk_nope_head_dim", huge.clone())], "`qk_nope_head_dim`: 1099511627776 is implausibly large"),
        (vec![("n_shared_experts", huge.clone())], "`n_shared_experts`: is implausibly large"),
        (vec![("num_nextn_predict_layers", json!(70_000))], "`num_nextn_predict_layers`: is implausibly large"),
        // Keys transformers' DeepSeek-V3 does not read (always sigmoid, group-limited), whose
        // value says the checkpoint is another router than the one transformers computes.
        (vec![("scoring_func", json!("sqrtsoftplus"))], "`scoring_func`: \"sqrtsoftplus\""),
        (vec![("topk_method", json!("bogus"))], "`topk_method`: \"bogus\""),
        // Required sizes: transformers' class defaults (DeepSeek-V3's 7168 wide, ...) cannot be the checkpoint's.
        (vec![("hidden_size", Value::Null)], "lacks required field `hidden_size`"),
        (vec![("num_hidden_layers", Value::Null)], "lacks required field `num_hidden_layers`"),
        (vec![("num_attention_heads", Value::Null)], "lacks required field `num_attention_heads`"),
        (vec![("intermediate_size", Value::Null)], "lacks required field `intermediate_size`"),
        (vec![("vocab_size", Value::Null)], "lacks required field `vocab_size`"),
        (vec![("kv_lora_rank", Value::Null)], "lacks required field `kv_lora_rank`"),
        (vec![("qk_nope_head_dim", Value::Null)], "lacks required field `qk_nope_head_dim`"),
        (vec![("qk_rope_head_dim", Value::Null)], "lacks required field `qk_rope_head_dim`"),
        (vec![("v_head_dim", Value::Null)], "lacks required field `v_head_dim`"),
        (vec![("vocab_size", json!(1u64 << 62))], "`vocab_size`: makes embed_tokens"),
    ];
    for (edits, needle) in cases {
        let e = refusal(&base, &edits, DeepseekConfig::from_json);
        assert!(e.contains(needle), "{edits:?}: {e}");
    }
    // null still means "no q LoRA" and "no routed experts".
    let mut dense = base.clone();
    dense["q_lora_rank"] = Value::Null;
    dense["n_routed_experts"] = Value::Null;
    let c = DeepseekConfig::from_json(&dense.to_string()).unwrap();
    assert_eq!((c.q_lora_rank, c.n_routed_experts), (None, 0));
    // More leading dense layers than layers: every layer dense, as transformers builds it.
    let mut all_dense = base.clone();
    all_dense["first_k_dense_replace"] = json!(4);
    let c = DeepseekConfig::from_json(&all_dense.to_string()).unwrap();
    assert!((0..c.num_layers).all(|l| !c.is_moe(l)), "first_k_dense_replace 4 of 3 layers");
}

#[test]
fn llama_sizes_cannot_overflow_or_be_absurd() {
    let base = config_of("qwen3");
    let cases: Vec<(Vec<(&str, Value)>, &str)> = vec![
        // (A billion layers is tried through the CLI, under a memory limit.)
        (vec![("num_hidden_layers", json!(70_000))], "`num_hidden_layers`: 70000 is implausibly large"),
        (vec![("head_dim", json!(1u64 << 40))], "`head_dim`: 1099511627776 is implausibly large"),
        (vec![("vocab_size", json!(1u64 << 62))], "`vocab_size`: makes embed_tokens"),
        (vec![("intermediate_size", json!(1u64 << 62))], "`intermediate_size`: makes gate_up_proj"),
        (vec![("max_position_embeddings", json!(0))], "`max_position_embeddings`: must be positive"),
        (vec![("num_key_value_heads", json!(1u64 << 40))], "`num_key_value_heads`: 1099511627776 is implausibly large"),
        // Zero widths: transformers runs them (embeddings straight to the norm, an MLP adding 0).
        (vec![("num_hidden_layers", json!(0))], "`num_hidden_layers`: must be positive"),
        (vec![("intermediate_size", json!(0))], "`intermediate_size`: must be positive"),
        // Required sizes: transformers' class defaults cannot be the checkpoint's.
        (vec![("hidden_size", Value::Null)], "lacks required field `hidden_size`"),
        (vec![("num_hidden_layers", Value::Null)], "lacks required field `num_hidden_layers`"),
        (vec![("num_attention_heads", Value::Null)], "lacks required field `num_attention_heads`"),
        (vec![("intermediate_size", Value::Null)], "lacks required field `intermediate_size`"),
        (vec![("vocab_size", Value::Null)], "lacks required field `vocab_size`"),
    ];
    for (edits, needle) in cases {
        let e = refusal(&base, &edits, LlamaConfig::from_json);
        assert!(e.contains(needle), "{edits:?}: {e}");
    }
}

/// A small DeepSeek-V3-layout spec whose checkpoint testkit writes to match its config.
fn small_deepseek() -> DeepseekSpec {
    DeepseekSpec {
        model_type: "deepseek_v3",
        hidden_size: 32,
        num_layers: 2,
        num_heads: 2,
        q_lora_rank: 16,
        kv_lora_rank: 16,
        qk_nope_head_dim: 8,
        qk_rope_head_dim: 4,
        v_head_dim: 8,
        intermediate_size: 48,
        n_routed_experts: 4,
        n_shared_experts: 1,
        num_experts_per_tok: 2,
        moe_intermediate_size: 16,
        first_k_dense_replace: 1,
        vocab_size: 64,
    }
}

#[test]
fn zero_sizes_fail_cleanly_through_the_cli() {
    // Checkpoints whose tensors agree with the zero sizes (a `[0, 32]` q_a_proj
    // for q_lora_rank 0): no shape check catches them, only the config's.
    let tmp = tempfile::tempdir().unwrap();
    let tokens = tmp.path().join("data.jsonl");
    std::fs::write(&tokens, "{\"input_ids\": [1, 2, 3]}\n").unwrap();
    type Zero = fn(&mut DeepseekSpec);
    let cases: [(&str, Zero); 7] = [
        ("q_lora_rank", |s| s.q_lora_rank = 0),
        ("kv_lora_rank", |s| s.kv_lora_rank = 0),
        ("num_attention_heads", |s| s.num_heads = 0),
        ("qk_nope_head_dim", |s| s.qk_nope_head_dim = 0),
        ("v_head_dim", |s| s.v_head_dim = 0),
        ("moe_intermediate_size", |s| s.moe_intermediate_size = 0),
        ("hidden_size", |s| s.hidden_size = 0),
    ];
    for (field, zero) in cases {
        let mut spec = small_deepseek();
        zero(&mut spec);
        let dir = tmp.path().join(field);
        write_deepseek(&dir, &spec, 1).unwrap();
        let r = extract(&dir, &tokens, &["--capture", "final"], false);
        r.fails_with(&[&format!("`{field}`: must be positive")]);
    }
    // The unchanged spec runs: the failures are the zeros'.
    let dir = tmp.path().join("good");
    write_deepseek(&dir, &small_deepseek(), 1).unwrap();
    let r = extract(&dir, &tokens, &["--capture", "final"], false);
    assert_eq!(r.code, Some(0), "{}", r.stderr);
}

#[test]
fn values_that_can_only_give_nan_are_refused() {
    let llama = config_of("llama-default"); // llama3 RoPE in rope_parameters
    let cases: Vec<(Vec<(&str, Value)>, &str)> = vec![
        (vec![("rms_norm_eps", json!(0.0))], "`rms_norm_eps`: rms_norm_eps must be a finite positive number, got 0"),
        (vec![("rms_norm_eps", json!(-1e-5))], "`rms_norm_eps`: rms_norm_eps must be a finite positive number"),
        // Underflows f32 to 0.
        (vec![("rms_norm_eps", json!(1e-300))], "`rms_norm_eps`: rms_norm_eps must be a finite positive number, got 0"),
        // Overflows f32 to infinity.
        (vec![("rope.rope_theta", json!(1e300))], "`rope_theta`: rope_theta must be a finite positive number, got inf"),
        (vec![("rope.factor", json!(0.0))], "`rope_parameters`: `factor` must be a finite positive number"),
        (vec![("rope.factor", json!(-8.0))], "`rope_parameters`: `factor` must be a finite positive number"),
        (vec![("rope.low_freq_factor", json!(-1.0))], "`low_freq_factor` must be a finite positive number"),
        (vec![("rope.high_freq_factor", json!(-1.0))], "`high_freq_factor` must be a finite positive number"),
        (vec![("rope.original_max_position_embeddings", json!(0))], "`original_max_position_embeddings` must be"),
    ];
    for (edits, needle) in cases {
        let e = refusal(&llama, &edits, LlamaConfig::from_json);
        assert!(e.contains(needle), "llama {edits:?}: {e}");
    }
    let ds = config_of("deepseek-v3"); // YaRN in rope_parameters
    let cases: Vec<(Vec<(&str, Value)>, &str)> = vec![
        (vec![("rms_norm_eps", json!(0.0))], "`rms_norm_eps`: rms_norm_eps must be a finite positive number, got 0"),
        (vec![("rms_norm_eps", json!(-1.0))], "`rms_norm_eps`: rms_norm_eps must be a finite positive number"),
        (vec![("rope.rope_theta", json!(0.0))], "`rope_theta`: rope_theta must be a finite positive number, got 0"),
        (vec![("rope.rope_theta", json!(-10000.0))], "`rope_theta`: rope_theta must be a finite positive number"),
        (vec![("rope.rope_theta", json!(1e39))], "`rope_theta`: rope_theta must be a finite positive number, got inf"),
        (vec![("rope.rope_theta", json!(1.0))], "`rope_theta`: yarn needs rope_theta > 1"),
        (vec![("rope.rope_theta", json!(0.5))], "`rope_theta`: yarn needs rope_theta > 1"),
        (vec![("rope.factor", json!(0.0))], "`rope_parameters`: `factor` must be a finite positive number"),
        (vec![("rope.factor", json!(-4.0))], "`factor` must be a finite positive number"),
        (vec![("rope.factor", json!("4"))], "`rope_parameters`: `factor` must be a number, got \"4\""),
        (vec![("rope.beta_fast", json!(-2))], "`beta_fast` must be a finite positive number"),
        (vec![("rope.beta_slow", json!(-1))], "`beta_slow` must be a finite positive number"),
        (vec![("rope.original_max_position_embeddings", json!(0))], "`original_max_position_embeddings` must be"),
        (vec![("rope.mscale", json!(-1.0))], "`mscale` must be a finite number >= 0"),
        (vec![("rope.mscale_all_dim", json!(-0.5))], "`mscale_all_dim` must be a finite number >= 0"),
        (vec![("routed_scaling_factor", json!(0.0))], "`routed_scaling_factor`: routed_scaling_factor must be"),
        (vec![("routed_scaling_factor", json!(1e300))], "`routed_scaling_factor`: routed_scaling_factor must be"),
    ];
    for (edits, needle) in cases {
        let e = refusal(&ds, &edits, DeepseekConfig::from_json);
        assert!(e.contains(needle), "deepseek {edits:?}: {e}");
    }
    // Through the CLI too, for both families.
    let dir = with_config("deepseek-v3", |c| c["rms_norm_eps"] = json!(0.0));
    extract(dir.path(), &data("deepseek-v3"), &["--capture", "final"], false).fails_with(&["`rms_norm_eps`"]);
    let dir = with_config("qwen3", |c| c["rms_norm_eps"] = json!(-1e-6));
    extract(dir.path(), &data("qwen3"), &["--capture", "final"], false).fails_with(&["`rms_norm_eps`"]);
}

#[test]
fn huge_sizes_fail_before_allocating_under_a_memory_limit() {
    // The limit leaves room for a real run: a good model still extracts under it.
    let ok = extract(&fixture("qwen3"), &data("qwen3"), &["--capture", "final"], true);
    assert_eq!(ok.code, Some(0), "a good run fails under the limit:\n{}", ok.stderr);
    let huge = json!(1u64 << 40);
    let cases: Vec<(&str, &str, Value, &str)> = vec![
        ("qwen3", "num_hidden_layers", json!(1_000_000_000), "1000000000 is implausibly large"),
        ("qwen3", "num_hidden_layers", json!(1000), "num_hidden_layers is 1000, but the checkpoint holds tensors of 3"),
        ("qwen3", "hidden_size", huge.clone(), "make model.embed_tokens.weight [220, 1099511627776]"),
        ("qwen3", "vocab_size", huge.clone(), "make model.embed_tokens.weight [1099511627776, 80]"),
        ("qwen3", "intermediate_size", huge.clone(), "expected shape [1099511627776, 80], got [112, 80]"),
        ("qwen3", "intermediate_size", json!(1u64 << 62), "`intermediate_size`: makes gate_up_proj"),
        ("deepseek-v3", "num_hidden_layers", json!(1_000_000_000), "1000000000 is implausibly large"),
        ("deepseek-v3", "num_hidden_layers", json!(5000), "num_hidden_layers is 5000, but the checkpoint holds"),
        ("deepseek-v3", "n_routed_experts", json!(1 << 20), "`n_routed_experts`: 1048576 is implausibly large"),
        ("deepseek-v3", "moe_intermediate_size", huge.clone(), "expected shape [1099511627776, 72]"),
        ("deepseek-v3", "kv_lora_rank", huge.clone(), "[1099511627782, 72]"),
        ("deepseek-v3", "vocab_size", huge, "make model.embed_tokens.weight [1099511627776, 72]"),
    ];
    for (name, field, value, needle) in cases {
        let dir = with_config(name, |c| c[field] = value.clone());
        let r = extract(dir.path(), &data(name), &["--capture", "final"], true);
        r.fails_with(&[needle]);
    }
    // A checkpoint with more layers than config.json says is refused too.
    let dir = with_config("qwen3", |c| {
        c["num_hidden_layers"] = json!(2);
        c["layer_types"] = json!(["full_attention", "full_attention"]);
    });
    let r = extract(dir.path(), &data("qwen3"), &["--capture", "final"], true);
    r.fails_with(&["num_hidden_layers is 2, but the checkpoint also holds model.layers.2.*"]);
}

/// Splits qwen3's weights into two shards that both hold `model.norm.weight`:
/// the first its real value, the second zeros. Returns the directory and the real value.
fn norm_in_two_shards(owner: Option<&str>) -> (tempfile::TempDir, Vec<f32>) {
    let dir = tempfile::tempdir().unwrap();
    std::fs::copy(fixture("qwen3").join("config.json"), dir.path().join("config.json")).unwrap();
    let bytes = std::fs::read(fixture("qwen3").join("model.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let (a, b) = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors");
    type Stored = (String, safetensors::Dtype, Vec<usize>, Vec<u8>);
    let mut shards: [Vec<Stored>; 2] = [vec![], vec![]];
    let mut map = serde_json::Map::new();
    let mut real = vec![];
    for (i, (name, v)) in st.tensors().into_iter().enumerate() {
        let t = (name.clone(), v.dtype(), v.shape().to_vec(), v.data().to_vec());
        if name == "model.norm.weight" {
            real = v.data().chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect();
            shards[1].push((name.clone(), t.1, t.2.clone(), vec![0; t.3.len()]));
            shards[0].push(t);
            if let Some(o) = owner {
                map.insert(name, json!(o));
            }
        } else {
            map.insert(name, json!(if i % 2 == 0 { a } else { b }));
            shards[i % 2].push(t);
        }
    }
    for (file, tensors) in [a, b].iter().zip(&shards) {
        let views: Vec<_> = tensors
            .iter()
            .map(|(n, d, s, b)| (n.clone(), safetensors::tensor::TensorView::new(*d, s.clone(), b).unwrap()))
            .collect();
        std::fs::write(dir.path().join(file), safetensors::serialize(views, None).unwrap()).unwrap();
    }
    let index = json!({"metadata": {}, "weight_map": map});
    std::fs::write(dir.path().join("model.safetensors.index.json"), index.to_string()).unwrap();
    (dir, real)
}

#[test]
fn a_tensor_in_two_shards_is_taken_from_the_one_the_index_names() {
    // The index names the first shard: its copy counts, the zeros are ignored.
    let (dir, real) = norm_in_two_shards(Some("model-00001-of-00002.safetensors"));
    let ckpt = Checkpoint::open(dir.path()).unwrap();
    assert_eq!(ckpt.read_f32("model.norm.weight", &[real.len()]).unwrap(), real);
    // It names the second: the zeros count.
    let (dir, real) = norm_in_two_shards(Some("model-00002-of-00002.safetensors"));
    let ckpt = Checkpoint::open(dir.path()).unwrap();
    assert_eq!(ckpt.read_f32("model.norm.weight", &[real.len()]).unwrap(), vec![0.0; real.len()]);
    // It names neither: refused, naming the tensor and both files.
    let (dir, _) = norm_in_two_shards(None);
    let e = Checkpoint::open(dir.path()).err().expect("two copies and no owner").to_string();
    for needle in [
        "\"model.norm.weight\" is stored in both",
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
    ] {
        assert!(e.contains(needle), "lacks {needle:?}: {e}");
    }
    let r = extract(dir.path(), &data("qwen3"), &["--capture", "final"], false);
    r.fails_with(&["\"model.norm.weight\" is stored in both", "weight_map names neither"]);
}

#[test]
fn repeated_capture_points_are_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let tokens = tmp.path().join("data.jsonl");
    std::fs::write(&tokens, "{\"input_ids\": [1, 2, 3]}\n").unwrap();
    let run = |extra: &[&str]| {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_strata"));
        cmd.arg("extract").arg("--data").arg(&tokens).arg("--out").arg(tmp.path().join("o")).args(extra);
        run_for(cmd, 120)
    };
    // The embedded model (8 layers).
    run(&["--capture", "input:2,input:2"]).fails_with(&["capture point input:2 is listed twice"]);
    run(&["--capture", "eagle3,input:4"]).fails_with(&["capture point input:4 is listed twice (eagle3 stands for"]);
    // Two layers: eagle3's input:2 does not exist.
    let r = extract(&fixture("deepseek-v3-nolora"), &data("deepseek-v3-nolora"), &["--capture", "eagle3"], false);
    r.fails_with(&["eagle3 preset", "needs at least 3 decoder layers, but the model has 2", "--capture"]);
    // Four layers: input:2 twice, then input:1, which the trainer refuses as
    // layer ids: three distinct points are spread instead, with a warning.
    let out = tempfile::tempdir().unwrap();
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_strata"));
    cmd.arg("extract").arg("--model").arg(fixture("llama-gqa-sharded"));
    cmd.arg("--data").arg(data("llama-gqa-sharded")).arg("--out").arg(out.path());
    let r = run_for(cmd, 120);
    assert_eq!(r.code, Some(0), "{}", r.stderr);
    assert!(r.stderr.contains("input:1,input:2,input:3,final are captured instead"), "{}", r.stderr);
    let manifest: Value =
        serde_json::from_str(&std::fs::read_to_string(out.path().join("manifest.json")).unwrap()).unwrap();
    let points: Vec<&str> =
        manifest["capture"].as_array().unwrap().iter().map(|c| c["point"].as_str().unwrap()).collect();
    assert_eq!(points, ["input:1", "input:2", "input:3", "final"]);
}

#[test]
fn missing_max_position_embeddings_is_hfs_default() {
    let mut c = config_of("llama-default");
    let info = LlamaConfig::from_json(&c.to_string()).unwrap().info();
    assert_eq!((info.max_position_embeddings, info.max_position_default), (256, false));
    c.as_object_mut().unwrap().remove("max_position_embeddings");
    let info = LlamaConfig::from_json(&c.to_string()).unwrap().info();
    assert_eq!((info.max_position_embeddings, info.max_position_default), (2048, true));
    for (model_type, default) in [("mistral", 131072), ("qwen2", 32768), ("qwen3", 32768)] {
        c["model_type"] = json!(model_type);
        let info = AnyConfig::parse(&c.to_string()).unwrap().info();
        assert_eq!((info.max_position_embeddings, info.max_position_default), (default, true), "{model_type}");
    }
    for (name, default) in [("deepseek-v3", 4096), ("deepseek-v2-lite", 2048), ("kimi-k25-wrapper", 4096)] {
        let mut c = config_of(name);
        let text = c.get_mut("text_config").is_some();
        let inner = if text { &mut c["text_config"] } else { &mut c };
        inner.as_object_mut().unwrap().remove("max_position_embeddings");
        let info = AnyConfig::parse(&c.to_string()).unwrap().info();
        assert_eq!((info.max_position_embeddings, info.max_position_default), (default, true), "{name}");
    }
    // A sample past the default is refused before the model runs.
    let dir = with_config("llama-default", |c| {
        c.as_object_mut().unwrap().remove("max_position_embeddings");
    });
    let tmp = tempfile::tempdir().unwrap();
    let tokens = tmp.path().join("data.jsonl");
    let ids: Vec<u32> = (0..2049).map(|i| i % 256).collect();
    std::fs::write(&tokens, json!({ "input_ids": ids }).to_string() + "\n").unwrap();
    extract(dir.path(), &tokens, &["--capture", "final"], false).fails_with(&["max_position_embeddings 2048"]);
}

/// Makes a FIFO at `path`.
fn mkfifo(path: &Path) {
    let c = std::ffi::CString::new(path.to_str().unwrap()).unwrap();
    // SAFETY: a valid NUL-terminated path.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o644) }, 0, "mkfifo {}", path.display());
}

/// Runs `f` on another thread, failing the test if it takes more than 20 s (a blocked open).
fn within_20s<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> T {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    rx.recv_timeout(Duration::from_secs(20)).expect("blocked on a FIFO for 20 s")
}

#[test]
fn fifos_in_place_of_checkpoint_files_are_refused() {
    // config.json, through the library.
    let dir = tempfile::tempdir().unwrap();
    mkfifo(&dir.path().join("config.json"));
    let p = dir.path().to_path_buf();
    let e = within_20s(move || AnyConfig::read(&p).unwrap_err().to_string());
    assert!(e.contains("config.json is a FIFO, not a regular file"), "{e}");
    let p = dir.path().to_path_buf();
    let e = within_20s(move || strata::model::load(&p, LoadOptions::default()).err().unwrap().to_string());
    assert!(e.contains("is a FIFO"), "{e}");
    let p = dir.path().join("config.json");
    let e = within_20s(move || LlamaConfig::from_file(&p).unwrap_err().to_string());
    assert!(e.contains("is a FIFO"), "{e}");
    let p = dir.path().join("config.json");
    let e = within_20s(move || DeepseekConfig::from_file(&p).unwrap_err().to_string());
    assert!(e.contains("is a FIFO"), "{e}");

    // The weights, and the shard index, through the CLI.
    let weights = tempfile::tempdir().unwrap();
    std::fs::copy(fixture("qwen3").join("config.json"), weights.path().join("config.json")).unwrap();
    mkfifo(&weights.path().join("model.safetensors"));
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_strata"));
    cmd.arg("extract").arg("--model").arg(weights.path()).arg("--data").arg(data("qwen3"));
    cmd.arg("--out").arg(weights.path().join("o"));
    run_for(cmd, 20).fails_with(&["model.safetensors is a FIFO, not a regular file"]);

    let index = copy_fixture("llama-gqa-sharded");
    let path = index.path().join("model.safetensors.index.json");
    std::fs::remove_file(&path).unwrap();
    mkfifo(&path);
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_strata"));
    cmd.arg("extract").arg("--model").arg(index.path()).arg("--data").arg(data("llama-gqa-sharded"));
    cmd.arg("--out").arg(index.path().join("o"));
    run_for(cmd, 20).fails_with(&["model.safetensors.index.json is a FIFO, not a regular file"]);

    let shard = copy_fixture("llama-gqa-sharded");
    let path = shard.path().join("model-00003-of-00012.safetensors");
    std::fs::remove_file(&path).unwrap();
    mkfifo(&path);
    assert!(within_20s(move || Checkpoint::open(shard.path()).err().unwrap().to_string()).contains("is a FIFO"));
}

/// The CLI reads config.json itself (src/bin/strata/extract.rs, `config_text`);
/// this passes once that read goes through `AnyConfig::read_text`.
#[test]
fn fifo_config_json_through_the_cli() {
    let dir = tempfile::tempdir().unwrap();
    mkfifo(&dir.path().join("config.json"));
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_strata"));
    cmd.arg("extract").arg("--model").arg(dir.path()).arg("--data").arg(data("qwen3"));
    cmd.arg("--out").arg(dir.path().join("o"));
    run_for(cmd, 20).fails_with(&["config.json is a FIFO, not a regular file"]);
}
