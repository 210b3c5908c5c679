//! The second round of hostile input: chat templates, tokenizers, long
//! conversations, unknown roles, merge and planted links. Each class of bad
//! case has a test here; bounds are asserted under `ulimit -v` and with a
//! timeout (absolute times with a 5x margin for this shared 2-core machine,
//! or as scaling: twice the input at most 2.5x the time), never by reading logs.

mod common;

use common::chat_model;
use serde_json::{json, Value};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// One finished `strata` run.
struct Run {
    code: Option<i32>,
    stdout: String,
    stderr: String,
    secs: f64,
}

impl Run {
    fn ok(&self) -> bool {
        self.code == Some(0)
    }

    /// Asserts success.
    fn assert_ok(&self) -> &Self {
        assert!(self.ok(), "expected success, exit {:?}:\n{}\n{}", self.code, self.stdout, self.stderr);
        self
    }

    /// Asserts exit 1 with every needle in the output.
    fn assert_fails(&self, needles: &[&str]) -> &Self {
        assert_eq!(self.code, Some(1), "expected exit 1:\n{}\n{}", self.stdout, self.stderr);
        self.assert_says(needles)
    }

    /// Asserts every needle is in stdout or stderr.
    fn assert_says(&self, needles: &[&str]) -> &Self {
        let all = format!("{}{}", self.stdout, self.stderr);
        for n in needles {
            assert!(all.contains(n), "output lacks {n:?}:\n{all}");
        }
        self
    }
}

/// Runs `strata ARGS` killing it after `secs` (a test failure), under
/// `ulimit -v KB` when given; stdout and stderr go to files, so a chatty run
/// cannot block on a full pipe. A panic or an allocation abort fails the test.
fn strata_in(args: &[&str], limit_kb: Option<u64>, secs: u64, env: &[(&str, &str)], cwd: Option<&Path>) -> Run {
    let tmp = tempfile::tempdir().unwrap();
    let bin = env!("CARGO_BIN_EXE_strata");
    let mut cmd = match limit_kb {
        Some(kb) => {
            let mut c = Command::new("sh");
            c.args(["-c", &format!("ulimit -v {kb}; exec \"$0\" \"$@\""), bin]);
            // Few threads and malloc arenas: the limit then bounds the work, not the runtime's reservations.
            c.env("RAYON_NUM_THREADS", "2").env("MALLOC_ARENA_MAX", "2");
            c
        }
        None => Command::new(bin),
    };
    cmd.args(args).envs(env.iter().copied());
    if let Some(d) = cwd {
        cmd.current_dir(d);
    }
    let (out_path, err_path) = (tmp.path().join("stdout"), tmp.path().join("stderr"));
    cmd.stdin(Stdio::null())
        .stdout(Stdio::from(std::fs::File::create(&out_path).unwrap()))
        .stderr(Stdio::from(std::fs::File::create(&err_path).unwrap()));
    let start = Instant::now();
    let mut child = cmd.spawn().unwrap();
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        if start.elapsed() > Duration::from_secs(secs) {
            let _ = child.kill();
            let _ = child.wait();
            panic!("strata did not finish within {secs} s: {args:?}");
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    let secs = start.elapsed().as_secs_f64();
    let stdout = std::fs::read_to_string(&out_path).unwrap();
    let stderr = String::from_utf8_lossy(&std::fs::read(&err_path).unwrap()).into_owned();
    assert!(!stderr.contains("panicked"), "strata panicked:\n{stderr}");
    assert!(!stderr.contains("memory allocation of"), "strata aborted on an allocation:\n{stderr}");
    assert!(!stderr.contains("overflowed its stack"), "strata overflowed its stack:\n{stderr}");
    Run { code: status.code(), stdout, stderr, secs }
}

fn strata(args: &[&str]) -> Run {
    strata_in(args, None, 120, &[], None)
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// Writes JSON Lines.
fn write_jsonl(path: &Path, lines: impl IntoIterator<Item = Value>) {
    let mut text = String::new();
    for l in lines {
        text.push_str(&l.to_string());
        text.push('\n');
    }
    std::fs::write(path, text).unwrap();
}

/// A short conversation that renders on every fixture template.
fn hello(id: &str) -> Value {
    json!({"id": id, "messages": [{"role": "user", "content": "Hi there"}, {"role": "assistant", "content": "Hello!"}]})
}

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/chat")
}

/// `strata extract` of `data` on `model` into `out` (`--chat-date` fixed), `extra` appended.
fn extract_args<'a>(model: &'a Path, data: &'a Path, out: &'a Path, extra: &[&'a str]) -> Vec<&'a str> {
    let mut a = vec!["extract", "--capture", "final", "--chat-date", "2026-01-15", "--model", s(model)];
    a.extend(["--data", s(data), "--out", s(out)]);
    a.extend_from_slice(extra);
    a
}

// ---- 9. Empty special tokens ----------------------------------------------------------------

#[test]
fn class9_an_empty_special_token_is_refused_in_tiktoken_and_tokenizer_json() {
    let tmp = tempfile::tempdir().unwrap();
    let data = tmp.path().join("text.jsonl");
    write_jsonl(&data, [json!({"text": "Hello, world"})]);

    // tiktoken: an added_tokens_decoder entry with empty content.
    let kimi = tmp.path().join("kimi");
    common::tiny_llama(&kimi, 700);
    std::fs::copy(fixtures().join("tiktoken/tiktoken.model"), kimi.join("tiktoken.model")).unwrap();
    let mut config: Value =
        serde_json::from_str(&std::fs::read_to_string(fixtures().join("tiktoken/tokenizer_config.json")).unwrap())
            .unwrap();
    config["added_tokens_decoder"]["410"] = json!({"content": "", "special": true});
    std::fs::write(kimi.join("tokenizer_config.json"), config.to_string()).unwrap();
    let r = strata(&extract_args(&kimi, &data, &tmp.path().join("o1"), &[]));
    r.assert_fails(&["added_tokens_decoder[410]", "empty `content`"]);
    assert!(!tmp.path().join("o1/manifest.json").exists());

    // tokenizer.json: an added token with empty content.
    let model = chat_model(tmp.path(), "chatml");
    let path = model.join("tokenizer.json");
    let mut tok: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    tok["added_tokens"].as_array_mut().unwrap().push(json!({"id": 450, "content": "", "single_word": false,
        "lstrip": false, "rstrip": false, "normalized": false, "special": true}));
    std::fs::write(&path, tok.to_string()).unwrap();
    let r = strata(&extract_args(&model, &data, &tmp.path().join("o2"), &[]));
    r.assert_fails(&["tokenizer.json: added_tokens[", "(id 450)", "empty `content`"]);
}

// ---- 4. Unknown roles ----------------------------------------------------------------------

/// `n` conversations, each with its own unknown role (and so no assistant
/// turn after a first message), after one that renders.
fn unknown_roles(path: &Path, n: usize) {
    let lines = std::iter::once(hello("ok"))
        .chain((0..n).map(|i| json!({"messages": [{"role": format!("model-{i}"), "content": "x"}]})));
    write_jsonl(path, lines);
}

#[test]
fn class4_unknown_roles_are_linear_and_warned_once_each_up_to_a_cap() {
    let tmp = tempfile::tempdir().unwrap();
    let model = chat_model(tmp.path(), "chatml");
    let (small, big) = (tmp.path().join("small.jsonl"), tmp.path().join("big.jsonl"));
    unknown_roles(&small, 75_000);
    unknown_roles(&big, 150_000);
    let a = strata(&extract_args(&model, &small, &tmp.path().join("a"), &[]));
    let b = strata(&extract_args(&model, &big, &tmp.path().join("b"), &[]));
    b.assert_ok().assert_says(&["wrote 1 samples", "150000 without an assistant turn", "and 149980 more"]);
    a.assert_ok();
    // 150k role names within 5 s (25 s with the margin), and twice the input at most 2.5x the time.
    assert!(b.secs < 25.0, "150k unknown roles took {:.1} s", b.secs);
    assert!(b.secs < 2.5 * a.secs.max(0.5), "75k took {:.2} s, 150k {:.2} s", a.secs, b.secs);
    // One warning per name up to the cap, then one line.
    let warnings = b.stderr.lines().filter(|l| l.contains("unknown role")).count();
    assert!(warnings <= 21, "{warnings} warning lines:\n{}", &b.stderr[..b.stderr.len().min(4000)]);
}
