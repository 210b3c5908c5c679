//! `strata serve` end to end: the binary started on an ephemeral port,
//! requests sent over plain HTTP/1.1 from many threads, and the files it
//! writes compared byte for byte with `strata extract --format speculators`.

mod common;

use common::*;
use serde_json::{json, Value};
use std::io::{BufRead, Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A server process; killed when dropped.
struct Server {
    child: Child,
    addr: String,
    /// What it printed on stdout before it was ready.
    banner: String,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn bin() -> PathBuf {
    std::env::var_os("STRATA_BIN").map_or_else(|| PathBuf::from(env!("CARGO_BIN_EXE_strata")), PathBuf::from)
}

/// Starts `strata serve ARGS --port 0` and waits until it is ready.
fn serve(args: &[&str]) -> Server {
    let mut child = Command::new(bin())
        .arg("serve")
        .args(args)
        .args(["--port", "0"])
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    let mut out = std::io::BufReader::new(child.stdout.take().unwrap());
    let mut banner = String::new();
    let mut addr = None;
    loop {
        let mut line = String::new();
        if out.read_line(&mut line).unwrap() == 0 {
            let status = child.wait().unwrap();
            panic!("strata serve exited ({status}) before it was ready:\n{banner}");
        }
        banner += &line;
        if let Some(rest) = line.strip_prefix("listening on http://") {
            addr = Some(rest.split_whitespace().next().unwrap().to_string());
        }
        // The banner ends with the prompt limit (and the chat line, when off).
        if line.trim_start().starts_with("prompts") {
            break;
        }
    }
    // Later lines (none expected) are read and dropped so the pipe never fills.
    std::thread::spawn(move || for _ in out.lines() {});
    let server = Server { child, addr: addr.expect("a listening line"), banner };
    let (status, _) = http(&server.addr, "GET", "/health", None);
    assert_eq!(status, 200);
    server
}

/// One HTTP/1.1 request on its own connection: (status, body).
fn http(addr: &str, method: &str, path: &str, body: Option<&str>) -> (u16, String) {
    let mut s = TcpStream::connect(addr).unwrap();
    let body = body.unwrap_or("");
    write!(
        s,
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).unwrap();
    let text = String::from_utf8_lossy(&raw).to_string();
    let status: u16 =
        text.split_whitespace().nth(1).and_then(|c| c.parse().ok()).unwrap_or_else(|| panic!("no status in {text:?}"));
    let body = text.split_once("\r\n\r\n").map_or("", |(_, b)| b).to_string();
    (status, body)
}

fn complete(addr: &str, model: &str, ids: &[u32]) -> (u16, Value) {
    let body = json!({"model": model, "prompt": ids, "max_tokens": 1, "return_token_ids": true}).to_string();
    let (status, text) = http(addr, "POST", "/v1/completions", Some(&body));
    (status, serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}: {text:?}")))
}

/// What the trainer does with a reply: checks the ids, reads the file, deletes it.
fn take_file(reply: &Value, ids: &[u32]) -> Vec<u8> {
    let got: Vec<u32> = serde_json::from_value(reply["choices"][0]["prompt_token_ids"].clone()).unwrap();
    assert_eq!(got, ids);
    let path = PathBuf::from(reply["kv_transfer_params"]["hidden_states_path"].as_str().unwrap());
    assert!(path.is_absolute(), "{}", path.display());
    let bytes = std::fs::read(&path).unwrap();
    std::fs::remove_file(&path).unwrap();
    bytes
}

/// The prompts' files as `extract --format speculators` writes them (row i is prompt i).
fn offline(model: &Path, prompts: &[Vec<u32>], extra: &[&str]) -> Vec<Vec<u8>> {
    let tmp = tempfile::tempdir().unwrap();
    let data = tmp.path().join("data.jsonl");
    let text: String = prompts.iter().map(|p| json!({"input_ids": p}).to_string() + "\n").collect();
    std::fs::write(&data, text).unwrap();
    let out = tmp.path().join("out");
    let mut args = vec![os("extract"), os("--model"), model.as_os_str(), os("--data"), data.as_os_str()];
    args.extend([os("--out"), out.as_os_str(), os("--format"), os("speculators")]);
    args.extend(extra.iter().map(|s| os(s)));
    let (ok, _, err) = strata(&args);
    assert!(ok, "{err}");
    (0..prompts.len()).map(|i| std::fs::read(out.join(format!("hidden_states/hs_{i}.safetensors"))).unwrap()).collect()
}

fn names_in(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> =
        std::fs::read_dir(dir).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into()).collect();
    v.sort();
    v
}

fn prompts(n: usize, lens: &[usize], vocab: u64, seed: u64) -> Vec<Vec<u32>> {
    let mut rng = strata_testkit::Rng::new(seed);
    (0..n).map(|i| (0..lens[i % lens.len()]).map(|_| rng.below(vocab) as u32).collect()).collect()
}

/// Sends `all` from `threads` client threads at once (thread t sends prompts t, t + threads, ...)
/// and checks each served file against the offline run's, byte for byte.
fn served_equal_offline(addr: &str, model: &Path, all: &[Vec<u32>], threads: usize) {
    let name = model.to_str().unwrap().to_string();
    let handles: Vec<_> = (0..threads)
        .map(|t| {
            let (addr, name, mine) = (addr.to_string(), name.clone(), all.to_vec());
            std::thread::spawn(move || {
                (t..mine.len())
                    .step_by(threads)
                    .map(|i| {
                        let (status, reply) = complete(&addr, &name, &mine[i]);
                        assert_eq!(status, 200, "{reply}");
                        (i, take_file(&reply, &mine[i]))
                    })
                    .collect::<Vec<_>>()
            })
        })
        .collect();
    let mut served: Vec<(usize, Vec<u8>)> = handles.into_iter().flat_map(|t| t.join().unwrap()).collect();
    served.sort();
    let expected = offline(model, all, &[]);
    for (i, bytes) in served {
        assert!(
            bytes == expected[i],
            "prompt {i} ({} tokens): the served file differs from the offline one",
            all[i].len()
        );
    }
}

#[test]
fn concurrent_requests_of_mixed_lengths_get_the_offline_files_byte_for_byte() {
    let model = fixture("llama-default");
    let states = tempfile::tempdir().unwrap();
    // Steps of 24 tokens: prompts of 40 to 200 tokens are split across steps, short ones share them.
    let server = serve(&[
        "--model",
        model.to_str().unwrap(),
        "--max-batch-tokens",
        "24",
        "--hidden-states-dir",
        states.path().to_str().unwrap(),
    ]);
    let all = prompts(36, &[1, 7, 24, 25, 40, 3, 200, 13, 90], 256, 11);
    served_equal_offline(&server.addr, &model, &all, 6);
    assert_eq!(names_in(states.path()), Vec::<String>::new(), "files or temporaries remain");
    let (_, metrics) = http(&server.addr, "GET", "/metrics", None);
    let m = parse_metrics(&metrics);
    assert_eq!(m["strata_requests_total{status=\"200\"}"], 36.0);
    assert!(m["strata_steps_total"] >= (all.iter().map(Vec::len).sum::<usize>() / 24) as f64);
}

/// A hybrid model under continuous batching: requests split across steps of 24 tokens,
/// several at once, each carrying its Gated DeltaNet state (and a partial 64-position
/// chunk) between steps beside the others', get the offline files byte for byte.
#[test]
fn a_hybrid_models_requests_carry_their_deltanet_state_across_steps() {
    let model = fixture("qwen3-next");
    let states = tempfile::tempdir().unwrap();
    let server = serve(&[
        "--model",
        model.to_str().unwrap(),
        "--max-batch-tokens",
        "24",
        "--hidden-states-dir",
        states.path().to_str().unwrap(),
    ]);
    let all = prompts(12, &[1, 70, 24, 130, 65, 9], 160, 5);
    served_equal_offline(&server.addr, &model, &all, 4);
}

/// Parses Prometheus' text format strictly: every line a comment (`# HELP`,
/// `# TYPE` with a known type) or `name{labels} value`.
fn parse_metrics(text: &str) -> std::collections::HashMap<String, f64> {
    let mut m = std::collections::HashMap::new();
    let name_ok = |n: &str| !n.is_empty() && n.chars().all(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':');
    for line in text.lines() {
        if let Some(rest) = line.strip_prefix("# ") {
            let mut w = rest.split_whitespace();
            match (w.next(), w.next(), w.next()) {
                (Some("HELP"), Some(n), Some(_)) => assert!(name_ok(n), "{line}"),
                (Some("TYPE"), Some(n), Some(t)) => {
                    assert!(
                        name_ok(n) && ["counter", "gauge", "histogram", "summary", "untyped"].contains(&t),
                        "{line}"
                    )
                }
                _ => panic!("bad comment line {line:?}"),
            }
            continue;
        }
        let (series, value) = line.rsplit_once(' ').unwrap_or_else(|| panic!("bad line {line:?}"));
        let base = series.split('{').next().unwrap();
        assert!(name_ok(base), "{line}");
        if let Some(labels) = series.strip_prefix(base).filter(|l| !l.is_empty()) {
            assert!(labels.starts_with('{') && labels.ends_with('}'), "{line}");
            for kv in labels[1..labels.len() - 1].split(',') {
                let (k, v) = kv.split_once('=').unwrap_or_else(|| panic!("{line}"));
                assert!(name_ok(k) && v.starts_with('"') && v.ends_with('"'), "{line}");
            }
        }
        let v: f64 = value.parse().unwrap_or_else(|_| panic!("bad value in {line:?}"));
        m.insert(series.to_string(), v);
    }
    m
}

#[test]
fn each_bad_request_gets_a_4xx_naming_its_problem_and_metrics_parse() {
    let model = fixture("llama-default");
    let states = tempfile::tempdir().unwrap();
    let server = serve(&[
        "--model",
        model.to_str().unwrap(),
        "--hidden-states-dir",
        states.path().to_str().unwrap(),
        "--served-model-name",
        "org/llama",
        "--max-seq-len",
        "64",
    ]);
    let (status, body) = http(&server.addr, "GET", "/v1/models", None);
    assert_eq!(status, 200);
    let v: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["data"][0]["id"], "org/llama");
    let long: Vec<u32> = vec![5; 65];
    let cases: Vec<(String, u16, &str)> = vec![
        ("{\"prompt\": [1, 2".into(), 400, "not JSON"),
        (
            json!({"model": "org/llama", "prompt": "Hello", "max_tokens": 1}).to_string(),
            400,
            "string prompt is not served",
        ),
        (json!({"model": "org/llama", "prompt": [[1, 2], [3]], "max_tokens": 1}).to_string(), 400, "batch of prompts"),
        (
            json!({"model": "org/llama", "prompt": [1, 256], "max_tokens": 1}).to_string(),
            400,
            "token id 256 at prompt[1] is outside the vocabulary (vocab_size 256",
        ),
        (json!({"model": "org/llama", "prompt": [], "max_tokens": 1}).to_string(), 400, "empty"),
        (
            json!({"model": "org/llama", "prompt": long, "max_tokens": 1}).to_string(),
            400,
            "65 tokens, more than the model takes: at most 64 (--max-seq-len 64)",
        ),
        (json!({"model": "org/llama", "prompt": [1], "max_tokens": 16}).to_string(), 400, "generation is not served"),
        (json!({"model": "other", "prompt": [1], "max_tokens": 1}).to_string(), 404, "`other` does not exist"),
    ];
    for (body, status, words) in &cases {
        let (got, text) = http(&server.addr, "POST", "/v1/completions", Some(body));
        assert_eq!(got, *status, "{body}: {text}");
        let v: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}: {text}"));
        let msg = v["error"]["message"].as_str().unwrap();
        assert!(msg.contains(words), "{body}: {msg}");
        assert_eq!(v["error"]["code"], *status);
    }
    // A body larger than any prompt this server takes.
    let huge = format!("{{\"prompt\": [{}1]}}", " ".repeat(2 << 20));
    let (got, text) = http(&server.addr, "POST", "/v1/completions", Some(&huge));
    assert_eq!(got, 413, "{text}");
    let (got, _) = http(&server.addr, "GET", "/v1/completions", None);
    assert_eq!(got, 405);
    let (got, _) = http(&server.addr, "GET", "/nowhere", None);
    assert_eq!(got, 404);
    // Still serving.
    let (status, reply) = complete(&server.addr, "org/llama", &[1, 2, 3]);
    assert_eq!(status, 200);
    take_file(&reply, &[1, 2, 3]);
    let (status, text) = http(&server.addr, "GET", "/metrics", None);
    assert_eq!(status, 200);
    let m = parse_metrics(&text);
    assert_eq!(m["strata_requests_total{status=\"400\"}"], 7.0);
    assert_eq!(m["strata_requests_total{status=\"404\"}"], 2.0);
    assert_eq!(m["strata_requests_total{status=\"413\"}"], 1.0);
    assert_eq!(m["strata_requests_total{status=\"200\"}"], 1.0);
    assert_eq!(m["strata_prompt_tokens_total"], 3.0);
    for name in [
        "strata_queue_depth",
        "strata_pending_bytes",
        "strata_forward_seconds_total",
        "strata_write_seconds_total",
        "strata_step_fill_count",
        "strata_request_seconds_count",
    ] {
        assert!(m.contains_key(name), "{name} missing from /metrics:\n{text}");
    }
}

#[test]
fn a_prompt_with_non_finite_states_gets_a_500_naming_the_point_and_its_step_mates_their_files() {
    let tmp = tempfile::tempdir().unwrap();
    let model = tmp.path().join("model");
    tiny_llama(&model, 64);
    // Token 7's embedding is past f16's range: any prompt holding it overflows once stored as f16.
    let path = model.join("model.safetensors");
    let bytes = std::fs::read(&path).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut tensors: Vec<(String, Vec<usize>, Vec<u8>)> =
        st.tensors().into_iter().map(|(n, v)| (n.to_string(), v.shape().to_vec(), v.data().to_vec())).collect();
    for (n, shape, data) in tensors.iter_mut() {
        if n == "model.embed_tokens.weight" {
            let h = shape[1];
            for v in data[7 * h * 4..8 * h * 4].chunks_mut(4) {
                v.copy_from_slice(&1.0e9f32.to_le_bytes());
            }
        }
    }
    let views: Vec<(String, safetensors::tensor::TensorView)> = tensors
        .iter()
        .map(|(n, s, d)| {
            (n.clone(), safetensors::tensor::TensorView::new(safetensors::Dtype::F32, s.clone(), d).unwrap())
        })
        .collect();
    safetensors::serialize_to_file(views, None, &path).unwrap();
    let states = tmp.path().join("hs");
    let server = serve(&[
        "--model",
        model.to_str().unwrap(),
        "--capture",
        "input:0,final",
        "--dtype",
        "f16",
        "--hidden-states-dir",
        states.to_str().unwrap(),
    ]);
    let name = model.to_str().unwrap().to_string();
    let threads: Vec<_> = (0..8u32)
        .map(|i| {
            let (addr, name) = (server.addr.clone(), name.clone());
            std::thread::spawn(move || {
                let ids: Vec<u32> = if i % 2 == 0 { vec![1, 7, 3, 4 + i] } else { vec![1, 2, 3, 8 + i] };
                let (status, reply) = complete(&addr, &name, &ids);
                if i % 2 == 0 {
                    assert_eq!(status, 500, "{reply}");
                    let msg = reply["error"]["message"].as_str().unwrap();
                    assert!(msg.contains("capture point input:0 holds 0 NaN and"), "{msg}");
                } else {
                    assert_eq!(status, 200, "{reply}");
                    take_file(&reply, &ids);
                }
            })
        })
        .collect();
    threads.into_iter().for_each(|t| t.join().unwrap());
    assert_eq!(names_in(&states), Vec::<String>::new());
}

#[test]
fn the_chat_endpoint_renders_text_parts_as_transformers_does_and_refuses_images_by_type() {
    let tmp = tempfile::tempdir().unwrap();
    let model = chat_model(tmp.path(), "chatml");
    let states = tmp.path().join("hs");
    let m = model.to_str().unwrap();
    let server = serve(&["--model", m, "--capture", "input:1,final", "--hidden-states-dir", states.to_str().unwrap()]);
    let name = model.to_str().unwrap();
    // The fixture's first conversation, through its first assistant turn, as text parts.
    let chat = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/chat");
    let line = std::fs::read_to_string(chat.join("conversations.openai.jsonl")).unwrap();
    let conv: Value = serde_json::from_str(line.lines().next().unwrap()).unwrap();
    let expected = std::fs::read_to_string(chat.join("expected/chatml.openai.jsonl")).unwrap();
    let expected: Value = serde_json::from_str(expected.lines().next().unwrap()).unwrap();
    let turn = expected["per_turn"][0]["turn"].as_u64().unwrap() as usize;
    let want: Vec<u32> = serde_json::from_value(expected["per_turn"][0]["input_ids"].clone()).unwrap();
    let messages: Vec<Value> = conv["messages"].as_array().unwrap()[..=turn]
        .iter()
        .map(|m| json!({"role": m["role"], "content": [{"type": "text", "text": m["content"]}]}))
        .collect();
    // As the speculators client sends it: add_generation_prompt false, continue_final_message false.
    let body = json!({"model": name, "messages": messages, "max_tokens": 1, "add_generation_prompt": false,
                      "continue_final_message": false, "return_token_ids": true});
    let (status, text) = http(&server.addr, "POST", "/v1/chat/completions", Some(&body.to_string()));
    assert_eq!(status, 200, "{text}");
    let reply: Value = serde_json::from_str(&text).unwrap();
    let got: Vec<u32> = serde_json::from_value(reply["prompt_token_ids"].clone()).unwrap();
    assert_eq!(got, want, "the chat render differs from transformers' apply_chat_template");
    let path = reply["kv_transfer_params"]["hidden_states_path"].as_str().unwrap();
    assert_eq!(
        offline(&model, std::slice::from_ref(&want), &["--capture", "input:1,final"])[0],
        std::fs::read(path).unwrap()
    );
    std::fs::remove_file(path).unwrap();
    let body = json!({"model": name, "max_tokens": 1, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "look"}, {"type": "image_url", "image_url": {"url": "file:///x.png"}}]}]});
    let (status, text) = http(&server.addr, "POST", "/v1/chat/completions", Some(&body.to_string()));
    assert_eq!(status, 400, "{text}");
    assert!(text.contains("messages[0].content[1] is a `image_url` part"), "{text}");
}

#[test]
fn compute_auto_is_resolved_alike_by_extract_serve_and_verify_recompute_on_a_bf16_checkpoint() {
    let model = fixture("llama-default");
    let tmp = tempfile::tempdir().unwrap();
    let data = tmp.path().join("d.jsonl");
    write_data(&data, 3, 5..20, 1);
    let out = tmp.path().join("out");
    let m = model.to_str().unwrap();
    let (ok, _, err) =
        strata(&[os("extract"), os("--model"), os(m), os("--data"), data.as_os_str(), os("--out"), out.as_os_str()]);
    assert!(ok, "{err}");
    let manifest: Value = serde_json::from_str(&std::fs::read_to_string(out.join("manifest.json")).unwrap()).unwrap();
    let extract = manifest["run"]["compute"].as_str().unwrap().to_string();
    let states = tmp.path().join("hs");
    let server = serve(&["--model", m, "--hidden-states-dir", states.to_str().unwrap(), "--compute", "auto"]);
    let serve = server.banner.split(" compute").next().unwrap().rsplit(", ").next().unwrap().to_string();
    let (ok, text) = verify(&out, &["--recompute", "2", "--compute", "auto"]);
    assert!(ok, "{text}");
    let verify = text.split(" compute, --tp").next().unwrap().rsplit('(').next().unwrap().to_string();
    let native = strata::backend::cpu::bf16::has_native_bf16();
    let want = if native { "bf16" } else { "f32" };
    assert_eq!((extract.as_str(), serve.as_str(), verify.as_str()), (want, want, want), "{}\n{text}", server.banner);
}

#[test]
fn a_client_that_never_deletes_keeps_the_directory_under_the_cap_and_the_ttl_clears_it() {
    let model = fixture("llama-default");
    let tmp = tempfile::tempdir().unwrap();
    let states = tmp.path().join("hs");
    // Files of 64 tokens × 4 points × 64 wide in bf16 are 33,360 bytes; the cap holds two.
    let cap = 70_000;
    let server = serve(&[
        "--model",
        model.to_str().unwrap(),
        "--hidden-states-dir",
        states.to_str().unwrap(),
        "--max-pending-bytes",
        &cap.to_string(),
        "--pending-ttl",
        "1s",
    ]);
    let name = model.to_str().unwrap().to_string();
    let done = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let watch = {
        let (states, done) = (states.clone(), done.clone());
        std::thread::spawn(move || {
            let mut most = 0u64;
            while !done.load(std::sync::atomic::Ordering::Relaxed) {
                let bytes: u64 = std::fs::read_dir(&states)
                    .map(|d| d.filter_map(|e| e.ok()?.metadata().ok()).map(|m| m.len()).sum())
                    .unwrap_or(0);
                most = most.max(bytes);
                std::thread::sleep(Duration::from_millis(5));
            }
            most
        })
    };
    let all = prompts(5, &[64], 256, 3);
    let threads: Vec<_> = all
        .iter()
        .cloned()
        .map(|ids| {
            let (addr, name) = (server.addr.clone(), name.clone());
            std::thread::spawn(move || {
                let (status, reply) = complete(&addr, &name, &ids);
                assert_eq!(status, 200, "{reply}");
                // Never deleted, never even read: a trainer that died after the reply.
            })
        })
        .collect();
    threads.into_iter().for_each(|t| t.join().unwrap());
    let t = Instant::now();
    while !names_in(&states).is_empty() && t.elapsed() < Duration::from_secs(10) {
        std::thread::sleep(Duration::from_millis(50));
    }
    done.store(true, std::sync::atomic::Ordering::Relaxed);
    let most = watch.join().unwrap();
    assert!(most > 0 && most <= cap, "the directory held {most} bytes, the cap is {cap}");
    assert_eq!(names_in(&states), Vec::<String>::new(), "--pending-ttl 1s left files");
    let (_, text) = http(&server.addr, "GET", "/metrics", None);
    assert_eq!(parse_metrics(&text)["strata_expired_total"], 5.0);
}

#[test]
fn sigterm_with_requests_in_flight_exits_0_within_10_s_and_leaves_no_temporary_file() {
    let model = fixture("llama-default");
    let tmp = tempfile::tempdir().unwrap();
    let states = tmp.path().join("hs");
    // The reference backend with steps of 8 tokens: 24 prompts of 250 tokens keep it busy for seconds.
    let mut server = serve(&[
        "--model",
        model.to_str().unwrap(),
        "--hidden-states-dir",
        states.to_str().unwrap(),
        "--backend",
        "reference",
        "--max-batch-tokens",
        "8",
        "--shutdown-grace",
        "1s",
    ]);
    let name = model.to_str().unwrap().to_string();
    let all = prompts(24, &[250], 256, 5);
    let threads: Vec<_> = all
        .iter()
        .cloned()
        .map(|ids| {
            let (addr, name) = (server.addr.clone(), name.clone());
            std::thread::spawn(move || {
                let (status, reply) = complete(&addr, &name, &ids);
                match status {
                    200 => {
                        take_file(&reply, &ids);
                    }
                    503 => assert!(reply["error"]["message"].as_str().unwrap().contains("stopping"), "{reply}"),
                    other => panic!("{other}: {reply}"),
                }
                status
            })
        })
        .collect();
    std::thread::sleep(Duration::from_millis(600));
    let (_, text) = http(&server.addr, "GET", "/metrics", None);
    assert!(parse_metrics(&text)["strata_steps_total"] > 0.0, "nothing ran before SIGTERM");
    let t = Instant::now();
    assert_eq!(unsafe { libc::kill(server.child.id() as i32, libc::SIGTERM) }, 0);
    let status = loop {
        if let Some(s) = server.child.try_wait().unwrap() {
            break s;
        }
        assert!(t.elapsed() < Duration::from_secs(10), "still running 10 s after SIGTERM");
        std::thread::sleep(Duration::from_millis(20));
    };
    assert!(status.success(), "{status}");
    let statuses: Vec<u16> = threads.into_iter().map(|t| t.join().unwrap()).collect();
    assert!(statuses.contains(&503), "no request was stopped: {statuses:?}");
    // Served files were taken by their clients; nothing else may remain.
    assert_eq!(names_in(&states), Vec::<String>::new());
}

#[test]
fn a_request_whose_client_hung_up_while_queued_is_dropped_before_its_forward() {
    let model = fixture("llama-default");
    let tmp = tempfile::tempdir().unwrap();
    let states = tmp.path().join("hs");
    let server = serve(&[
        "--model",
        model.to_str().unwrap(),
        "--hidden-states-dir",
        states.to_str().unwrap(),
        "--backend",
        "reference",
        "--max-batch-tokens",
        "4",
    ]);
    let name = model.to_str().unwrap().to_string();
    // Long prompts keep the model busy (the reference backend, steps of 4 tokens); the next ones queue behind them.
    let long = prompts(6, &[250], 256, 9);
    let busy: Vec<_> = long
        .into_iter()
        .map(|ids| {
            let (addr, name) = (server.addr.clone(), name.clone());
            std::thread::spawn(move || {
                let (status, reply) = complete(&addr, &name, &ids);
                assert_eq!(status, 200, "{reply}");
                take_file(&reply, &ids);
            })
        })
        .collect();
    std::thread::sleep(Duration::from_millis(100));
    for _ in 0..3 {
        let mut s = TcpStream::connect(&server.addr).unwrap();
        let body = json!({"model": name, "prompt": [1, 2, 3], "max_tokens": 1}).to_string();
        write!(s, "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: {}\r\n\r\n{body}", body.len()).unwrap();
        std::thread::sleep(Duration::from_millis(50));
        drop(s);
    }
    busy.into_iter().for_each(|t| t.join().unwrap());
    std::thread::sleep(Duration::from_millis(300));
    let (_, text) = http(&server.addr, "GET", "/metrics", None);
    let m = parse_metrics(&text);
    assert_eq!(m["strata_dropped_queued_total"], 3.0, "{text}");
    assert_eq!(m["strata_prompt_tokens_total"], 1500.0, "{text}");
    assert_eq!(names_in(&states), Vec::<String>::new());
}

#[test]
fn serve_refuses_a_capture_list_the_trainer_cannot_read() {
    let states = tempfile::tempdir().unwrap();
    let o = Command::new(bin())
        .args(["serve", "--capture", "input:2,final-norm", "--port", "0", "--hidden-states-dir"])
        .arg(states.path())
        .output()
        .unwrap();
    assert!(!o.status.success());
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("does not end with `final`"), "{err}");
}

/// `$STRATA_PYTHON` (else `python3`) when it has `modules`; otherwise the
/// test says why and skips, unless `STRATA_REQUIRE_INTEROP=1` (.ci/run) makes that a failure.
fn python_with(modules: &str) -> Option<String> {
    let py = std::env::var("STRATA_PYTHON").unwrap_or_else(|_| "python3".into());
    let ok = Command::new(&py).args(["-c", &format!("import {modules}")]).output().map(|o| o.status.success());
    if ok.unwrap_or(false) {
        return Some(py);
    }
    let why = format!("{py} with {modules} is not available");
    if std::env::var("STRATA_REQUIRE_INTEROP").as_deref() == Ok("1") {
        panic!("{why} (STRATA_REQUIRE_INTEROP=1)");
    }
    eprintln!("SKIPPED interop test: {why}; `pip install 'openai>=2' numpy safetensors` or set STRATA_PYTHON");
    None
}

#[test]
fn the_openai_client_called_as_the_speculators_trainer_calls_it_gets_files_it_can_load() {
    let Some(py) = python_with("openai, numpy, safetensors") else { return };
    let model = fixture("llama-default");
    let tmp = tempfile::tempdir().unwrap();
    let states = tmp.path().join("hs");
    let server = serve(&[
        "--model",
        model.to_str().unwrap(),
        "--dtype",
        "f32",
        "--max-batch-tokens",
        "32",
        "--served-model-name",
        "meta-llama/Llama-3.1-8B-Instruct",
        "--hidden-states-dir",
        states.to_str().unwrap(),
    ]);
    let all = prompts(6, &[5, 40, 1, 100, 33, 7], 256, 21);
    let file = tmp.path().join("prompts.json");
    std::fs::write(&file, serde_json::to_string(&all).unwrap()).unwrap();
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/interop/serve_client.py");
    let base = format!("http://{}/v1", server.addr);
    let o = Command::new(&py)
        .arg(script)
        .args([base.as_str(), "meta-llama/Llama-3.1-8B-Instruct"])
        .arg(&file)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&o.stdout).to_string() + &String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{text}");
    assert!(text.contains("ok 6 prompts, [T, L, H] with (L, H) = (4, 64)"), "{text}");
    assert_eq!(names_in(&states), Vec::<String>::new());
}
