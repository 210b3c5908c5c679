//! Bad input and bad checkpoints give a clear error naming the problem,
//! never a panic, and write no output file.

use crate::common;

use common::*;
use std::path::{Path, PathBuf};
use std::process::Command;

struct Run {
    ok: bool,
    stderr: String,
    out: PathBuf,
    _tmp: tempfile::TempDir,
}

fn extract(model: Option<&Path>, data: &str, extra: &[&str]) -> Run {
    let tmp = tempfile::tempdir().unwrap();
    let data_path = tmp.path().join("data.jsonl");
    std::fs::write(&data_path, data).unwrap();
    let out = tmp.path().join("out");
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_strata"));
    cmd.arg("extract").arg("--data").arg(&data_path).arg("--out").arg(&out).args(extra);
    if let Some(m) = model {
        cmd.arg("--model").arg(m);
    }
    let o = cmd.output().unwrap();
    let stderr = String::from_utf8_lossy(&o.stderr).to_string();
    assert!(!stderr.contains("panicked"), "panic: {stderr}");
    Run { ok: o.status.success(), stderr, out, _tmp: tmp }
}

fn output_files(dir: &Path) -> Vec<String> {
    match std::fs::read_dir(dir) {
        Err(_) => vec![],
        Ok(rd) => rd.map(|e| e.unwrap().file_name().to_string_lossy().to_string()).collect(),
    }
}

/// Asserts failure with a message containing every `needle`, and no output.
fn fails_with(r: Run, needles: &[&str]) {
    assert!(!r.ok, "expected failure");
    for n in needles {
        assert!(r.stderr.contains(n), "message lacks {n:?}:\n{}", r.stderr);
    }
    assert!(output_files(&r.out).is_empty(), "files written: {:?}", output_files(&r.out));
}

const GOOD: &str = "{\"input_ids\": [1, 2, 3]}\n";

#[test]
fn token_id_out_of_vocabulary() {
    // The embedded model has vocab_size 256.
    let r = extract(None, &format!("{GOOD}{{\"input_ids\": [5, 256]}}\n"), &[]);
    fails_with(r, &["data.jsonl:2:", "input_ids[1] = 256 is out of range (vocab_size 256)"]);
}

#[test]
fn empty_sample() {
    fails_with(extract(None, &format!("{GOOD}{GOOD}{{\"input_ids\": []}}\n"), &[]), &["data.jsonl:3:", "empty sample"]);
}

#[test]
fn sample_longer_than_max_position_embeddings() {
    let ids: Vec<String> = (0..65).map(|i| (i % 300).to_string()).collect();
    let data = format!("{GOOD}{{\"input_ids\": [{}]}}\n", ids.join(","));
    let r = extract(Some(&fixture("llama-gqa-sharded")), &data, &[]);
    fails_with(r, &["data.jsonl:2:", "more than 64 tokens, the limit set by max_position_embeddings 64"]);
}

#[test]
fn malformed_line() {
    fails_with(extract(None, &format!("{GOOD}{{\"input_ids\": [1, 2\n"), &[]), &["data.jsonl:2:", "malformed JSON"]);
    fails_with(
        extract(None, "{\"tokens\": [1]}\n", &[]),
        &["data.jsonl:1:", "no `input_ids`, `text`, `conversations` or `messages` field"],
    );
    fails_with(extract(None, "{\"input_ids\": [1, 2.5]}\n", &[]), &["data.jsonl:1:", "input_ids[1] = 2.5"]);
}

#[test]
fn bad_capture_points() {
    fails_with(extract(None, GOOD, &["--capture", "input:8"]), &["needs layer 8", "has 8 layers"]);
    fails_with(extract(None, GOOD, &["--capture", "layer:3"]), &["cannot parse capture point \"layer:3\""]);
}

#[test]
fn refuses_non_empty_output_without_resume_or_overwrite() {
    let r = extract(None, GOOD, &[]);
    assert!(r.ok, "{}", r.stderr);
    std::fs::write(r.out.join("notes.txt"), b"mine").unwrap();
    let again = Command::new(env!("CARGO_BIN_EXE_strata")).arg("extract").arg("--out").arg(&r.out).output().unwrap();
    assert!(!again.status.success());
    assert!(String::from_utf8_lossy(&again.stderr).contains("is not empty; pass --resume"));
    let over = Command::new(env!("CARGO_BIN_EXE_strata"))
        .args(["extract", "--overwrite", "--format", "speculators", "--out"])
        .arg(&r.out)
        .output()
        .unwrap();
    assert!(over.status.success(), "{}", String::from_utf8_lossy(&over.stderr));
    let mut files = output_files(&r.out);
    files.sort();
    // --overwrite removes every trace of the old output, of either format; other files stay.
    assert_eq!(
        files,
        [
            ".strata.lock",
            "data-00000-of-00001.arrow",
            "dataset_info.json",
            "hidden_states",
            "manifest.json",
            "notes.txt",
            "state.json",
        ]
    );
    assert_eq!(output_files(&r.out.join("hidden_states")).len(), 4);
    let m = strata::dataset::manifest::Manifest::read(&r.out).unwrap();
    assert_eq!((m.format.as_str(), m.complete, m.shards.len()), ("speculators", true, 4));
}

/// A copy of the qwen3 fixture whose weights or config a test then damages.
fn damaged_copy(damage: impl FnOnce(&Path)) -> tempfile::TempDir {
    let tmp = tempfile::tempdir().unwrap();
    for f in ["config.json", "model.safetensors"] {
        std::fs::copy(fixture("qwen3").join(f), tmp.path().join(f)).unwrap();
    }
    damage(tmp.path());
    tmp
}

/// Rewrites model.safetensors through `edit(name, dtype, shape, bytes)`; `None` drops the tensor.
fn rewrite_weights(
    dir: &Path,
    edit: impl Fn(&str, safetensors::Dtype, Vec<usize>, Vec<u8>) -> Option<(safetensors::Dtype, Vec<usize>, Vec<u8>)>,
) {
    let path = dir.join("model.safetensors");
    let bytes = std::fs::read(&path).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let kept: Vec<(String, safetensors::Dtype, Vec<usize>, Vec<u8>)> = st
        .tensors()
        .into_iter()
        .filter_map(|(n, v)| edit(&n, v.dtype(), v.shape().to_vec(), v.data().to_vec()).map(|(d, s, b)| (n, d, s, b)))
        .collect();
    let views: Vec<(String, safetensors::tensor::TensorView)> = kept
        .iter()
        .map(|(n, d, s, b)| (n.clone(), safetensors::tensor::TensorView::new(*d, s.clone(), b).unwrap()))
        .collect();
    std::fs::write(&path, safetensors::serialize(views, None).unwrap()).unwrap();
}

#[test]
fn missing_tensor() {
    let dir = damaged_copy(|d| {
        rewrite_weights(d, |n, dt, s, b| (n != "model.layers.1.mlp.up_proj.weight").then_some((dt, s, b)))
    });
    let r = extract(Some(dir.path()), GOOD, &[]);
    fails_with(r, &["tensor \"model.layers.1.mlp.up_proj.weight\" is missing"]);
}

#[test]
fn tensor_of_wrong_shape() {
    let dir = damaged_copy(|d| {
        rewrite_weights(d, |n, dt, s, b| {
            Some(if n == "model.norm.weight" { (dt, vec![s[0] / 2], b[..b.len() / 2].to_vec()) } else { (dt, s, b) })
        })
    });
    fails_with(extract(Some(dir.path()), GOOD, &[]), &["tensor \"model.norm.weight\": expected shape [80], got [40]"]);
}

#[test]
fn tensor_of_wrong_dtype() {
    let dir = damaged_copy(|d| {
        rewrite_weights(d, |n, dt, s, b| {
            Some(if n == "model.norm.weight" { (safetensors::Dtype::I32, s, b) } else { (dt, s, b) })
        })
    });
    fails_with(extract(Some(dir.path()), GOOD, &[]), &["tensor \"model.norm.weight\" has dtype I32"]);
}

#[test]
fn truncated_safetensors_file() {
    let dir = damaged_copy(|d| {
        let p = d.join("model.safetensors");
        let len = std::fs::metadata(&p).unwrap().len();
        std::fs::OpenOptions::new().write(true).open(&p).unwrap().set_len(len - 100).unwrap();
    });
    fails_with(
        extract(Some(dir.path()), GOOD, &[]),
        &["model.safetensors is not a valid safetensors file", "truncated"],
    );
}

#[test]
fn malformed_and_unsupported_configs() {
    let dir = damaged_copy(|d| std::fs::write(d.join("config.json"), "{\"model_type\": \"qwen3\",").unwrap());
    fails_with(extract(Some(dir.path()), GOOD, &[]), &["malformed config.json"]);
    let dir = damaged_copy(|d| std::fs::write(d.join("config.json"), "{\"model_type\": \"gpt_neox\"}").unwrap());
    fails_with(extract(Some(dir.path()), GOOD, &[]), &["unsupported model_type \"gpt_neox\""]);
    let dir = damaged_copy(|d| {
        let c = std::fs::read_to_string(d.join("config.json")).unwrap();
        std::fs::write(d.join("config.json"), c.replace("\"rope_type\": \"default\"", "\"rope_type\": \"dynamic\""))
            .unwrap()
    });
    fails_with(extract(Some(dir.path()), GOOD, &[]), &["rope type \"dynamic\" is not supported"]);
    let r = extract(Some(Path::new("/nonexistent/model")), GOOD, &[]);
    fails_with(r, &["cannot read /nonexistent/model/config.json"]);
}

/// `--backend cuda` where it cannot run: a clear error before any input or
/// weight is read, a non-zero exit, no output. Built without `--features
/// cuda` it says so; with it, on a machine without a driver or GPU (CI, this
/// test's home), the probe says what is missing. On a GPU machine the probe
/// passes, so the test checks only the device arguments there.
#[test]
fn cuda_without_a_gpu_or_the_feature_is_a_clear_error() {
    let gpu = cfg!(feature = "cuda") && std::path::Path::new("/dev/nvidiactl").exists();
    if !gpu {
        let needles: &[&str] = if cfg!(feature = "cuda") {
            &["--backend cuda needs an NVIDIA GPU", "use --backend cpu"]
        } else {
            &["built without the CUDA backend", "--features cuda"]
        };
        fails_with(extract(None, GOOD, &["--backend", "cuda"]), needles);
        // The spelling the CUDA issue and other tools use.
        fails_with(extract(None, GOOD, &["--device", "cuda"]), needles);
    }
    fails_with(
        extract(None, GOOD, &["--backend", "cuda", "--devices", "0,1"]),
        &["--devices lists 2 GPUs but --tp is 1", "--tp 2"],
    );
    fails_with(
        extract(None, GOOD, &["--backend", "cuda", "--devices", "1,1", "--tp", "2"]),
        &["--devices names GPU 1 twice"],
    );
    fails_with(extract(None, GOOD, &["--devices", "0"]), &["only --backend cuda uses"]);
}

// Hub ids: `--model org/name` from the local Hugging Face cache, never downloaded.

/// Puts the checkpoint in `fixture` into the cache under `cache` as `org/name` at
/// commit `commit`, named by the refs `refs`: files in `blobs/`, linked from the snapshot, as the hub library lays them out.
fn cache_model(cache: &Path, id: &str, fixture_name: &str, commit: &str, refs: &[&str]) -> PathBuf {
    let repo = cache.join(format!("models--{}", id.replace('/', "--")));
    let snap = repo.join("snapshots").join(commit);
    std::fs::create_dir_all(&snap).unwrap();
    std::fs::create_dir_all(repo.join("blobs")).unwrap();
    std::fs::create_dir_all(repo.join("refs")).unwrap();
    for file in ["config.json", "model.safetensors"] {
        let blob = format!("{commit}-{file}");
        std::fs::copy(fixture(fixture_name).join(file), repo.join("blobs").join(&blob)).unwrap();
        std::os::unix::fs::symlink(format!("../../blobs/{blob}"), snap.join(file)).unwrap();
    }
    for r in refs {
        std::fs::write(repo.join("refs").join(r), commit).unwrap();
    }
    snap
}

/// `strata ARGS` in `cwd` with `env` (and none of the cache variables of this process): (ok, stderr).
fn strata_in(cwd: &Path, env: &[(&str, &Path)], args: &[&str]) -> (bool, String, String) {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_strata"));
    cmd.current_dir(cwd).args(args);
    for k in ["HF_HUB_CACHE", "HF_HOME"] {
        cmd.env_remove(k);
    }
    cmd.env("HOME", cwd.join("no-home"));
    for (k, v) in env {
        cmd.env(k, v);
    }
    let o = cmd.output().unwrap();
    let err = String::from_utf8_lossy(&o.stderr).to_string();
    assert!(!err.contains("panicked"), "{err}");
    (o.status.success(), String::from_utf8_lossy(&o.stdout).to_string(), err)
}

fn manifest_of(out: &Path) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(out.join("manifest.json")).unwrap()).unwrap()
}

#[test]
fn a_hub_id_is_found_in_the_local_cache_by_revision_and_named_as_given() {
    let tmp = tempfile::tempdir().unwrap();
    let t = tmp.path();
    std::fs::write(t.join("d.jsonl"), GOOD).unwrap();
    let hub = t.join("hub");
    cache_model(&hub, "meta-llama/Llama-Test", "llama-default", "c0ffee11", &["main"]);
    cache_model(&hub, "meta-llama/Llama-Test", "qwen3", "beef2222", &["v2"]);
    let run = |env: &[(&str, &Path)], out: &str, extra: &[&str]| {
        let mut args = vec!["extract", "--model", "meta-llama/Llama-Test", "--data", "d.jsonl", "--out", out];
        args.extend(extra);
        strata_in(t, env, &args)
    };
    // HF_HUB_CACHE, revision main by default: the output is the directory's own, named by the id.
    let (ok, _, err) = run(&[("HF_HUB_CACHE", &hub)], "o1", &[]);
    assert!(ok, "{err}");
    let m = manifest_of(&t.join("o1"));
    assert_eq!(
        (m["model"]["path"].as_str(), m["model"]["architecture"].as_str()),
        (Some("meta-llama/Llama-Test"), Some("llama"))
    );
    let (ok, _, err) = strata_in(
        t,
        &[],
        &["extract", "--model", fixture("llama-default").to_str().unwrap(), "--data", "d.jsonl", "--out", "direct"],
    );
    assert!(ok, "{err}");
    let shard = |o: &str| std::fs::read(t.join(o).join("shard-00000.safetensors")).unwrap();
    assert!(shard("o1") == shard("direct"), "the cached snapshot gives other states than its files read directly");
    // A tag, and a commit given as the revision.
    for rev in ["v2", "beef2222"] {
        let out = format!("o-{rev}");
        let (ok, _, err) = run(&[("HF_HUB_CACHE", &hub)], &out, &["--revision", rev]);
        assert!(ok, "{err}");
        assert_eq!(manifest_of(&t.join(&out))["model"]["architecture"], "qwen3");
    }
    // HF_HOME/hub, then ~/.cache/huggingface/hub.
    let (ok, _, err) = run(&[("HF_HOME", t)], "o2", &[]);
    assert!(ok, "{err}");
    std::fs::create_dir_all(t.join("home/.cache/huggingface")).unwrap();
    std::fs::rename(&hub, t.join("home/.cache/huggingface/hub")).unwrap();
    let (ok, _, err) = run(&[("HOME", &t.join("home"))], "o3", &[]);
    assert!(ok, "{err}");
    assert_eq!(manifest_of(&t.join("o3"))["model"]["path"], "meta-llama/Llama-Test");
}

#[test]
fn a_missing_hub_id_says_where_it_looked_and_how_to_fetch_it() {
    let tmp = tempfile::tempdir().unwrap();
    let t = tmp.path();
    std::fs::write(t.join("d.jsonl"), GOOD).unwrap();
    let hub = t.join("hub");
    cache_model(&hub, "meta-llama/Llama-Test", "llama-default", "c0ffee11", &["main"]);
    for (model, rev, needles) in [
        (
            "meta-llama/Llama-Other",
            None,
            vec![
                "models--meta-llama--Llama-Other/refs/main",
                "huggingface-cli download meta-llama/Llama-Other",
                "HF_HUB_CACHE",
            ],
        ),
        ("meta-llama/Llama-Test", Some("v9"), vec!["refs/v9", "--revision v9", "downloads nothing"]),
    ] {
        let mut args = vec!["extract", "--model", model, "--data", "d.jsonl", "--out", "o"];
        if let Some(r) = rev {
            args.extend(["--revision", r]);
        }
        let (ok, _, err) = strata_in(t, &[("HF_HUB_CACHE", &hub)], &args);
        assert!(!ok, "{model} {rev:?} was found");
        for n in needles {
            assert!(err.contains(n), "{n:?} missing from:\n{err}");
        }
        assert!(!t.join("o").exists(), "an output was started");
    }
    // --revision with a directory is refused, not ignored.
    let (ok, _, err) = strata_in(
        t,
        &[],
        &[
            "extract",
            "--model",
            fixture("llama-default").to_str().unwrap(),
            "--revision",
            "v2",
            "--data",
            "d.jsonl",
            "--out",
            "o",
        ],
    );
    assert!(!ok && err.contains("--revision v2 applies to hub ids"), "{err}");
}

#[test]
fn a_directory_named_like_a_hub_id_wins_and_says_so() {
    let tmp = tempfile::tempdir().unwrap();
    let t = tmp.path();
    std::fs::write(t.join("d.jsonl"), GOOD).unwrap();
    let hub = t.join("hub");
    cache_model(&hub, "meta-llama/Llama-Test", "llama-default", "c0ffee11", &["main"]);
    // ./meta-llama/Llama-Test holds another model.
    let local = t.join("meta-llama/Llama-Test");
    std::fs::create_dir_all(&local).unwrap();
    for f in ["config.json", "model.safetensors"] {
        std::fs::copy(fixture("qwen3").join(f), local.join(f)).unwrap();
    }
    let (ok, _, err) = strata_in(
        t,
        &[("HF_HUB_CACHE", &hub)],
        &["extract", "--model", "meta-llama/Llama-Test", "--data", "d.jsonl", "--out", "o"],
    );
    assert!(ok, "{err}");
    assert!(err.contains("a directory of that name wins"), "{err}");
    assert_eq!(manifest_of(&t.join("o"))["model"]["architecture"], "qwen3");
}
