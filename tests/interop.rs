//! Python interop: the native and speculators outputs read with the
//! `safetensors` and `numpy` packages match the HF reference (tests/interop/check.py);
//! a `datasets` directory goes in, and the speculators dataset directory
//! comes out readable by `datasets.load_from_disk` (tests/interop/datasets_check.py).
//!
//! Uses `$STRATA_PYTHON` (else `python3`). Without numpy, safetensors and
//! datasets the tests say so and skip, unless `STRATA_REQUIRE_INTEROP=1` (set
//! by .ci/run, which installs them) turns that into a failure.

use crate::common;

use common::*;
use std::process::Command;

fn python_with(modules: &str) -> Option<String> {
    let py = std::env::var("STRATA_PYTHON").unwrap_or_else(|_| "python3".into());
    let ok = Command::new(&py).args(["-c", &format!("import {modules}")]).output().map(|o| o.status.success());
    match ok {
        Ok(true) => Some(py),
        _ => {
            let why = format!("{py} with {modules} is not available");
            if std::env::var("STRATA_REQUIRE_INTEROP").as_deref() == Ok("1") {
                panic!("{why} (STRATA_REQUIRE_INTEROP=1)");
            }
            eprintln!("SKIPPED interop test: {why}; `pip install {}` or set STRATA_PYTHON", modules.replace(',', ""));
            None
        }
    }
}

fn python() -> Option<String> {
    python_with("numpy, safetensors")
}

fn run_py(py: &str, args: &[&std::ffi::OsStr]) -> String {
    let script = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/interop/datasets_check.py");
    let o = Command::new(py).arg(script).args(args).output().unwrap();
    let text = String::from_utf8_lossy(&o.stdout).to_string() + &String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{text}");
    text
}

fn extract_spec(model: &std::path::Path, data: &std::path::Path, out: &std::path::Path, extra: &[&str]) {
    let o = Command::new(env!("CARGO_BIN_EXE_strata"))
        .args(["extract", "--capture", "input:1,final", "--format", "speculators", "--model"])
        .arg(model)
        .arg("--data")
        .arg(data)
        .arg("--out")
        .arg(out)
        .args(extra)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
}

#[test]
fn a_datasets_directory_goes_in_and_the_trainers_dataset_directory_comes_out() {
    let Some(py) = python_with("numpy, safetensors, datasets") else { return };
    let tmp = tempfile::tempdir().unwrap();
    // Token rows in a save_to_disk directory, as the speculators prepare step writes them.
    let mut rng = strata_testkit::Rng::new(5);
    let rows: Vec<serde_json::Value> = (0..7)
        .map(|i| {
            let n = 3 + i * 5;
            let ids: Vec<u64> = (0..n).map(|_| rng.below(256)).collect();
            let mask: Vec<u64> = (0..n).map(|t| (t >= n / 2) as u64).collect();
            serde_json::json!({"input_ids": ids, "loss_mask": mask})
        })
        .collect();
    let rows_file = tmp.path().join("rows.json");
    std::fs::write(&rows_file, serde_json::to_string(&rows).unwrap()).unwrap();
    let prepared = tmp.path().join("prepared");
    run_py(&py, &[os("write"), prepared.as_os_str(), rows_file.as_os_str()]);
    let out = tmp.path().join("out");
    extract_spec(&fixture("llama-default"), &prepared, &out, &[]);
    let text = run_py(&py, &[os("read"), out.as_os_str(), rows_file.as_os_str()]);
    println!("hf-dataset input: {}", text.trim());

    // Conversations: the rows and masks of the parity fixture, in the table and the files.
    let model = chat_model(tmp.path(), "chatml");
    let chat = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/chat");
    let out = tmp.path().join("conv-out");
    extract_spec(&model, &chat.join("conversations.openai.jsonl"), &out, &["--chat-date", "2026-01-15"]);
    let expected = std::fs::read_to_string(chat.join("expected/chatml.openai.jsonl")).unwrap();
    let rows: Vec<serde_json::Value> = expected
        .lines()
        .flat_map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap()["auto"].as_array().unwrap().clone())
        .collect();
    assert!(rows.len() >= 10);
    std::fs::write(&rows_file, serde_json::to_string(&rows).unwrap()).unwrap();
    let text = run_py(&py, &[os("read"), out.as_os_str(), rows_file.as_os_str()]);
    println!("conversations: {}", text.trim());
}

#[test]
fn python_reads_native_and_speculators_outputs() {
    let Some(py) = python() else { return };
    for (name, dtype) in [("qwen3", "f32"), ("llama-default", "bf16"), ("mistral-swa", "f16")] {
        let tmp = tempfile::tempdir().unwrap();
        let fx = fixture(name);
        let capture = "embeddings,input:1,output:1,final,final-norm";
        for format in ["strata", "speculators"] {
            let o = Command::new(env!("CARGO_BIN_EXE_strata"))
                // f32 compute: the check's tolerances are those of the storage
                // dtype alone (`auto` picks bf16 on CPUs with bf16 hardware).
                .args(["extract", "--capture", capture, "--dtype", dtype, "--format", format, "--compute", "f32"])
                .arg("--model")
                .arg(&fx)
                .arg("--data")
                .arg(fx.join("data.jsonl"))
                .arg("--out")
                .arg(tmp.path().join(format))
                .output()
                .unwrap();
            assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        }
        let o = Command::new(&py)
            .arg(std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/interop/check.py"))
            .arg(tmp.path().join("strata"))
            .arg(tmp.path().join("speculators"))
            .arg(&fx)
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&o.stdout).to_string() + &String::from_utf8_lossy(&o.stderr);
        assert!(o.status.success(), "{name}: {text}");
        println!("{name}: {}", text.trim());
    }
}

#[test]
fn fp8_states_read_by_python_equal_strata_decoding() {
    let Some(py) = python() else { return };
    let tmp = tempfile::tempdir().unwrap();
    let (native, spec) = (tmp.path().join("native"), tmp.path().join("spec"));
    for (out, format) in [(&native, "strata"), (&spec, "speculators")] {
        let (ok, _, err) = strata(&[
            os("extract"),
            os("--dtype"),
            os("fp8"),
            os("--format"),
            os(format),
            os("--out"),
            out.as_os_str(),
        ]);
        assert!(ok, "{err}");
    }
    // What inspect and verify decode: the library's reading of each sample, as f32 [L, T, H].
    let ds = strata::dataset::Dataset::open(&native).unwrap();
    let mut tensors = Vec::new();
    for s in &ds.manifest.samples {
        let shard = ds.shard(s.shard).unwrap();
        let r = ds.sample(&shard, &s.id, s.tokens).unwrap();
        assert_eq!((r.stored, r.dtype), (strata::shape::DType::F8E4M3, strata::shape::DType::F32));
        tensors.push((s.id.clone(), r.shape.to_vec(), r.hidden.to_vec()));
    }
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = tensors
        .iter()
        .map(|(id, shape, bytes)| {
            (id.clone(), safetensors::tensor::TensorView::new(safetensors::Dtype::F32, shape.clone(), bytes).unwrap())
        })
        .collect();
    let decoded = tmp.path().join("decoded.safetensors");
    safetensors::serialize_to_file(views, None, &decoded).unwrap();
    let script = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/interop/fp8_check.py");
    let o = Command::new(&py).arg(script).arg(&native).arg(&spec).arg(&decoded).output().unwrap();
    let text = String::from_utf8_lossy(&o.stdout).to_string() + &String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{text}");
    println!("{}", text.trim());
}

/// `--draft-vocab-size`: the trainer's `token_freq.pt`, `d2t-N.npy` and
/// `t2d-N.npy` against tests/interop/draft_vocab_check.py, which computes
/// them from the input rows itself. The rows have masked-out tokens, ties
/// in every count, and fewer distinct tokens than the largest N.
#[test]
fn draft_vocab_files_match_an_independent_computation() {
    let Some(py) = python_with("numpy, datasets") else { return };
    let tmp = tempfile::tempdir().unwrap();
    let mut rng = strata_testkit::Rng::new(36);
    let mut text = String::new();
    // Hand-made ties first: 10, 11, 12 and 13 twice each under the mask, 200 and 201 only outside it.
    text += "{\"input_ids\": [10, 10, 11, 11, 12, 200, 201], \"loss_mask\": [1, 1, 1, 1, 1, 0, 0]}\n";
    text += "{\"input_ids\": [12, 13, 13, 200], \"loss_mask\": [1, 1, 1, 0]}\n";
    // Then rows drawing from 40 ids, so counts repeat; one row has no mask (all tokens count).
    for i in 0..12 {
        let len = 5 + rng.below(30) as usize;
        let ids: Vec<u64> = (0..len).map(|_| 20 + rng.below(40)).collect();
        let row = if i == 3 {
            serde_json::json!({"input_ids": ids})
        } else {
            serde_json::json!({"input_ids": ids, "loss_mask": (0..len).map(|t| (t % 3 != 0) as u8).collect::<Vec<_>>()})
        };
        text += &(row.to_string() + "\n");
    }
    let data = tmp.path().join("rows.jsonl");
    std::fs::write(&data, text).unwrap();
    let out = tmp.path().join("out");
    // The llama-default fixture: 256 tokens, 8 layers.
    let sizes = "2,3,30,100,256";
    extract_spec(&fixture("llama-default"), &data, &out, &["--draft-vocab-size", sizes]);
    let script = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/interop/draft_vocab_check.py");
    let o = Command::new(&py).arg(script).arg(&out).arg(&data).args(["256", sizes, "1,8"]).output().unwrap();
    let text = String::from_utf8_lossy(&o.stdout).to_string() + &String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{text}");
    // The check must have seen ties and a fill.
    assert!(text.contains("filled") && !text.contains(" 0 tied counts"), "{text}");
    assert!(text.contains("N=100: ") && !text.contains("N=100: 44 tokens seen, 0"), "{text}");
    println!("{}", text.trim());
}

/// A reply's `content` is the text vLLM 0.19.1 returns: its
/// `FastIncrementalDetokenizer` (a `tokenizers` `DecodeStream` primed with the
/// prompt, run by `tests/interop/decode_stream.py` with the Python package)
/// against `Tokenizer::decode_content`, on the chat fixture's byte-level BPE
/// and a Llama 2-style SentencePiece BPE (leading-space strip, byte fallback),
/// over random prompts and replies: special tokens, bytes of unfinished
/// characters, ids the stream has to restart on.
#[test]
fn replies_decode_as_vllms_decode_stream() {
    let Some(py) = python_with("tokenizers.decoders") else { return };
    let script = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/interop/decode_stream.py");
    let tmp = tempfile::tempdir().unwrap();
    let sp = tmp.path().join("sp");
    std::fs::create_dir(&sp).unwrap();
    let o = Command::new(&py).arg(&script).arg("make-sp").arg(&sp).output().unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let chat = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/chat");
    let mut rng = 0x9e37_79b9_7f4a_7c15u64;
    let mut next = |n: usize| {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        (rng % n as u64) as usize
    };
    let (mut cases, mut want_strata) = (String::new(), Vec::new());
    for dir in [&chat, &sp] {
        let t = strata::chat::Tokenizer::load(dir, &serde_json::Value::Null).unwrap();
        let vocab = t.vocab_size();
        let mut enc = strata::chat::Encoded::default();
        t.encode("hello world, ab cd", false, &mut enc).unwrap();
        for case in 0..200 {
            // Prompts: text, or text and random ids, or none at all; replies of random ids.
            let mut prompt = if case % 3 == 0 { vec![] } else { enc.ids.clone() };
            prompt.extend((0..next(4) * (case % 2)).map(|_| next(vocab) as u32));
            let ids: Vec<u32> = (0..1 + next(12)).map(|_| next(vocab) as u32).collect();
            let skip = case % 4 != 1;
            let line = serde_json::json!({"tokenizer": dir.join("tokenizer.json"), "prompt": prompt, "ids": ids, "skip": skip});
            cases += &format!("{line}\n");
            want_strata.push(t.decode_content(&prompt, &ids, skip).unwrap());
        }
    }
    std::fs::write(tmp.path().join("cases.jsonl"), cases).unwrap();
    let out = tmp.path().join("texts.json");
    let o =
        Command::new(&py).arg(&script).arg("decode").arg(tmp.path().join("cases.jsonl")).arg(&out).output().unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let vllm: Vec<String> = serde_json::from_str(&std::fs::read_to_string(&out).unwrap()).unwrap();
    assert_eq!(vllm.len(), want_strata.len());
    let mut differs_from_whole = 0;
    let lines: Vec<String> =
        std::fs::read_to_string(tmp.path().join("cases.jsonl")).unwrap().lines().map(String::from).collect();
    for (i, (v, s)) in vllm.iter().zip(&want_strata).enumerate() {
        assert_eq!(s, v, "case {i} ({}): Strata's reply text is not vLLM's", lines[i]);
        let c: serde_json::Value = serde_json::from_str(&lines[i]).unwrap();
        let whole = tokenizers::Tokenizer::from_file(c["tokenizer"].as_str().unwrap()).unwrap();
        let ids: Vec<u32> = c["ids"].as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect();
        differs_from_whole += (whole.decode(&ids, c["skip"].as_bool().unwrap()).unwrap() != *v) as usize;
    }
    // The cases reach what a reply decoded alone gets wrong (a leading space, unfinished bytes).
    assert!(differs_from_whole >= 20, "only {differs_from_whole} of {} cases differ from a whole decode", vllm.len());
}
