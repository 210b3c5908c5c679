//! Conversations to rows: exact parity with transformers' `apply_chat_template`
//! plus the render-boundary algorithm, on the fixtures
//! `scripts/make_chat_fixtures.py` writes (tests/fixtures/chat), for both
//! message styles, every row mode, the length limit and generation masks;
//! and the tiktoken BPE against Python's `tiktoken`.

use crate::common;

use common::{chat_model, tiny_llama};
use serde_json::Value;
use std::path::{Path, PathBuf};
use strata::chat::{Chat, ChatOptions, Conversation, LongRows, MaskSource, RowMode, RowOptions, RowsError, Style};

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/chat")
}

fn jsonl(path: &Path) -> Vec<Value> {
    std::fs::read_to_string(path).unwrap().lines().map(|l| serde_json::from_str(l).unwrap()).collect()
}

fn chat(template: &str) -> Chat {
    let opts = ChatOptions {
        template_file: Some(fixtures().join(format!("templates/{template}.jinja"))),
        date: chrono::NaiveDate::from_ymd_opt(2026, 1, 15).unwrap(),
        ..Default::default()
    };
    Chat::load(&fixtures(), &opts).unwrap()
}

fn conversation(style: &str, line: &Value) -> Conversation {
    match style {
        "sharegpt" => Conversation::parse(Style::ShareGpt, &line["conversations"], None).unwrap(),
        _ => Conversation::parse(Style::OpenAi, &line["messages"], line.get("tools")).unwrap(),
    }
}

/// Rows as the fixture writes them: `[{input_ids, loss_mask}]`.
fn rows_json(r: &Result<strata::chat::Rows, RowsError>) -> Value {
    match r {
        Ok(rows) => Value::Array(
            rows.rows.iter().map(|r| serde_json::json!({"input_ids": r.input_ids, "loss_mask": r.loss_mask})).collect(),
        ),
        Err(_) => Value::Array(vec![]),
    }
}

fn strip(rows: &Value) -> Value {
    // The fixture's per-turn rows also carry their turn.
    Value::Array(
        rows.as_array()
            .unwrap()
            .iter()
            .filter(|r| !r.is_null())
            .map(|r| serde_json::json!({"input_ids": r["input_ids"], "loss_mask": r["loss_mask"]}))
            .collect(),
    )
}

fn check(template: &str, style: &str, expected: &str, max_len: usize) -> usize {
    let chat = chat(template);
    let mut r = chat.renderer().unwrap();
    let inputs = jsonl(&fixtures().join(format!("conversations.{style}.jsonl")));
    let want = jsonl(&fixtures().join(format!("expected/{expected}.jsonl")));
    assert_eq!(inputs.len(), want.len());
    let mut checked = 0;
    for (line, want) in inputs.iter().zip(&want) {
        let id = line["id"].as_str().unwrap();
        let c = conversation(style, line);
        let opts = |rows| RowOptions { mask: MaskSource::Boundary, rows, max_len, long: LongRows::Truncate };
        let auto = r.rows(&c, &opts(RowMode::Auto));
        let per_turn = r.rows(&c, &opts(RowMode::PerTurn));
        let per_conv = r.rows(&c, &opts(RowMode::PerConversation));
        let ctx = format!("{expected} {id}");
        match (&want["skip"], &want["error"]) {
            (Value::String(s), _) => {
                let e = auto.unwrap_err();
                let ok =
                    matches!((s.as_str(), &e), ("empty", RowsError::Empty) | ("no-assistant", RowsError::NoAssistant));
                assert!(ok, "{ctx}: skip {s}, got {e}");
                continue;
            }
            (_, Value::String(_)) => {
                let failed =
                    matches!(auto, Err(RowsError::Conversation(_) | RowsError::Refused(_) | RowsError::Render(_)));
                assert!(failed, "{ctx}: expected an error, got {auto:?}");
                continue;
            }
            _ => {}
        }
        if want["per_turn"].as_array().unwrap().is_empty()
            && want["long_prompt_turns"].as_array().is_none_or(|l| l.is_empty())
        {
            // Only an opening assistant turn: no rows.
            assert!(matches!(auto, Err(RowsError::NoAssistant)), "{ctx}: {auto:?}");
            continue;
        }
        assert_eq!(rows_json(&per_turn), strip(&want["per_turn"]), "{ctx}: per-turn");
        assert_eq!(rows_json(&auto), strip(&want["auto"]), "{ctx}: auto");
        if want["stable"] == true {
            let pc = want["per_conversation"].clone();
            let pc = if pc.is_null() { Value::Array(vec![]) } else { Value::Array(vec![pc]) };
            assert_eq!(rows_json(&per_conv), strip(&pc), "{ctx}: per-conversation");
            assert!(!auto.as_ref().unwrap().per_turn, "{ctx}");
        } else {
            assert!(matches!(per_conv, Err(RowsError::Conversation(_))), "{ctx}: {per_conv:?}");
            assert!(auto.as_ref().unwrap().per_turn, "{ctx}");
        }
        if let Some(long) = want["long_prompt_turns"].as_array() {
            assert_eq!(per_turn.as_ref().unwrap().long_prompts, long.len(), "{ctx}: long prompts");
        }
        checked += 1;
    }
    checked
}

#[test]
fn boundary_masks_equal_transformers_for_every_template_style_and_row_mode() {
    let mut n = 0;
    for t in ["llama3", "chatml", "qwen3", "generation"] {
        for s in ["sharegpt", "openai"] {
            n += check(t, s, &format!("{t}.{s}"), usize::MAX);
        }
    }
    n += check("llama3_2", "openai", "llama3_2.openai", usize::MAX);
    assert!(n >= 80, "only {n} conversations compared");
}

#[test]
fn length_limit_truncates_rows_and_skips_long_prompts_like_the_reference() {
    assert!(check("chatml", "openai", "chatml.openai.max48", 48) >= 8);
}

#[test]
fn generation_masks_equal_transformers_assistant_masks() {
    let chat = chat("generation");
    let mut r = chat.renderer().unwrap();
    let mut n = 0;
    for style in ["sharegpt", "openai"] {
        let inputs = jsonl(&fixtures().join(format!("conversations.{style}.jsonl")));
        let want = jsonl(&fixtures().join(format!("expected/generation.{style}.jsonl")));
        for (line, want) in inputs.iter().zip(&want) {
            let opts = RowOptions {
                mask: MaskSource::Generation,
                rows: RowMode::Auto,
                max_len: usize::MAX,
                long: LongRows::Truncate,
            };
            let got = r.rows(&conversation(style, line), &opts);
            if want["skip"].is_string() {
                assert!(got.is_err(), "{}", line["id"]);
                continue;
            }
            let got = got.unwrap();
            assert_eq!(got.rows.len(), 1);
            assert_eq!(serde_json::json!(got.rows[0].input_ids), want["input_ids"], "{style} {}", line["id"]);
            assert_eq!(serde_json::json!(got.rows[0].loss_mask), want["loss_mask"], "{style} {}", line["id"]);
            n += 1;
        }
    }
    assert!(n >= 20);
}

#[test]
fn tiktoken_bpe_equals_python_tiktoken() {
    let dir = fixtures().join("tiktoken");
    let model = std::fs::read_to_string(dir.join("tiktoken.model")).unwrap();
    let config: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("tokenizer_config.json")).unwrap()).unwrap();
    let pattern = std::fs::read_to_string(dir.join("pattern.txt")).unwrap();
    assert_eq!(pattern, strata::chat::tiktoken::KIMI_PATTERN, "the fixture's pattern is Kimi-K2's");
    let tok = strata::chat::Tokenizer::tiktoken(&model, "tiktoken.model", &config).unwrap();
    let mut enc = strata::chat::Encoded::default();
    let cases = jsonl(&dir.join("expected.jsonl"));
    for case in &cases {
        let text = case["text"].as_str().unwrap();
        tok.encode(text, false, &mut enc).unwrap();
        assert_eq!(serde_json::json!(enc.ids), case["ids"], "{text:?}");
        // The spans tile the text.
        let mut at = 0;
        for &(s, e) in &enc.spans {
            assert_eq!(s, at, "{text:?}");
            at = e;
        }
        assert_eq!(at, text.len());
    }
    assert!(cases.len() >= 30);
}

// ---- The CLI end to end ------------------------------------------------------------------

fn extract(model: &Path, data: &Path, out: &Path, extra: &[&str]) -> (bool, String, String) {
    let o = std::process::Command::new(env!("CARGO_BIN_EXE_strata"))
        .args(["extract", "--capture", "input:1,final", "--model"])
        .arg(model)
        .arg("--data")
        .arg(data)
        .arg("--out")
        .arg(out)
        .args(extra)
        .output()
        .unwrap();
    let (stdout, stderr) =
        (String::from_utf8_lossy(&o.stdout).to_string(), String::from_utf8_lossy(&o.stderr).to_string());
    assert!(!stderr.contains("panicked"), "{stderr}");
    (o.status.success(), stdout, stderr)
}

/// `(id, input_ids, loss_mask)` of every sample of a native output, in order.
fn native_rows(out: &Path) -> Vec<(String, Vec<i64>, Vec<u8>)> {
    let ds = strata::dataset::Dataset::open(out).unwrap();
    let mut rows = vec![];
    for s in &ds.manifest.samples {
        let shard = ds.shard(s.shard).unwrap();
        let r = ds.sample(&shard, &s.id, s.tokens).unwrap();
        rows.push((s.id.clone(), r.input_ids.clone(), r.loss_mask.to_vec()));
    }
    rows
}

/// The fixture's rows for `mode` (`auto`, `per_turn`), with the ids Strata gives them.
fn expected_rows(expected: &str, mode: &str) -> Vec<(String, Vec<i64>, Vec<u8>)> {
    let mut rows = vec![];
    for line in jsonl(&fixtures().join(format!("expected/{expected}.jsonl"))) {
        let id = line["id"].as_str().unwrap();
        for r in line[mode].as_array().unwrap().iter().filter(|r| !r.is_null()) {
            let ids = r["input_ids"].as_array().unwrap().iter().map(|v| v.as_i64().unwrap()).collect();
            let mask = r["loss_mask"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as u8).collect();
            let name = match r.get("turn") {
                Some(t) if mode == "per_turn" || line["stable"] == false => format!("{id}#{t}"),
                _ => id.to_string(),
            };
            rows.push((name, ids, mask));
        }
    }
    rows
}

#[test]
fn extract_writes_the_reference_rows_and_counts_them() {
    let tmp = tempfile::tempdir().unwrap();
    let date = ["--chat-date", "2026-01-15"];
    // ChatML: prefix-stable, one row per conversation.
    let model = chat_model(tmp.path(), "chatml");
    let out = tmp.path().join("chatml");
    let (ok, stdout, stderr) = extract(&model, &fixtures().join("conversations.sharegpt.jsonl"), &out, &date);
    assert!(ok, "{stderr}");
    assert_eq!(native_rows(&out), expected_rows("chatml.sharegpt", "auto"));
    for want in [
        "14 conversations (sharegpt): 12 rows of a whole conversation, 0 of one turn;",
        "tokens saved against one row per turn",
        "skipped     1 empty conversations, 1 without an assistant turn",
        "roles       counted as assistant: bot",
    ] {
        assert!(stdout.contains(want), "lacks {want:?}:\n{stdout}");
    }
    // Qwen3: not prefix-stable where reasoning is dropped, so those conversations give one row per turn;
    // one conversation's renders diverge: counted, reported, left out.
    let model = chat_model(tmp.path(), "qwen3");
    let out = tmp.path().join("qwen3");
    let (ok, stdout, stderr) = extract(&model, &fixtures().join("conversations.openai.jsonl"), &out, &date);
    assert!(ok, "{stderr}");
    assert_eq!(native_rows(&out), expected_rows("qwen3.openai", "auto"));
    assert!(stdout.contains("errors      1 records could not be rendered or tokenized"), "{stdout}");
    assert!(stdout.contains("the renders diverge"), "{stdout}");
    // --rows per-turn everywhere.
    let out = tmp.path().join("qwen3-per-turn");
    let (ok, _, stderr) = extract(
        &model,
        &fixtures().join("conversations.openai.jsonl"),
        &out,
        &[&date[..], &["--rows", "per-turn"]].concat(),
    );
    assert!(ok, "{stderr}");
    assert_eq!(native_rows(&out), expected_rows("qwen3.openai", "per_turn"));
}

#[test]
fn limits_generation_masks_and_resume_through_the_cli() {
    let tmp = tempfile::tempdir().unwrap();
    let date = ["--chat-date", "2026-01-15"];
    let model = chat_model(tmp.path(), "chatml");
    let data = fixtures().join("conversations.openai.jsonl");
    let out = tmp.path().join("max48");
    let (ok, stdout, stderr) = extract(&model, &data, &out, &[&date[..], &["--max-seq-len", "48"]].concat());
    assert!(ok, "{stderr}");
    assert_eq!(native_rows(&out), expected_rows("chatml.openai.max48", "auto"));
    assert!(stdout.contains("rows cut,") && stdout.contains("turns left out"), "{stdout}");
    let out = tmp.path().join("skip");
    let (ok, stdout, stderr) =
        extract(&model, &data, &out, &[&date[..], &["--max-seq-len", "48", "--skip-long"]].concat());
    // Every row is too long and left out: no sample, so the run fails, saying why.
    assert!(!ok && stdout.contains("0 rows cut"), "{stdout}");
    assert!(
        stderr.contains("none of the 14 input records gave a sample") && stderr.contains("--skip-long"),
        "{stderr}"
    );
    assert!(native_rows(&out).is_empty());

    // Generation blocks, through --chat-template.
    let out = tmp.path().join("gen");
    let gen = fixtures().join("templates/generation.jinja");
    let args = [&date[..], &["--loss-mask", "generation", "--chat-template", gen.to_str().unwrap()]].concat();
    let (ok, _, stderr) = extract(&model, &data, &out, &args);
    assert!(ok, "{stderr}");
    let want: Vec<(String, Vec<i64>, Vec<u8>)> = jsonl(&fixtures().join("expected/generation.openai.jsonl"))
        .into_iter()
        .filter(|l| l["skip"].is_null())
        .map(|l| {
            let ids = l["input_ids"].as_array().unwrap().iter().map(|v| v.as_i64().unwrap()).collect();
            let mask = l["loss_mask"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as u8).collect();
            (l["id"].as_str().unwrap().to_string(), ids, mask)
        })
        .collect();
    assert_eq!(native_rows(&out), want);
    // The model's own template has no generation blocks: a clear error before any output.
    let (ok, _, stderr) = extract(&model, &data, &tmp.path().join("nogen"), &["--loss-mask", "generation"]);
    assert!(!ok && stderr.contains("needs a chat template with {% generation %} blocks"), "{stderr}");

    // A resume renders the recorded date, and refuses another.
    let out = tmp.path().join("resume");
    let llama = chat_model(tmp.path(), "llama3_2");
    assert!(extract(&llama, &data, &out, &date).0);
    let before = std::fs::read(out.join("manifest.json")).unwrap();
    let (ok, _, stderr) = extract(&llama, &data, &out, &["--resume"]);
    assert!(ok, "{stderr}");
    assert_eq!(std::fs::read(out.join("manifest.json")).unwrap(), before);
    let (ok, _, stderr) = extract(&llama, &data, &out, &["--resume", "--chat-date", "2026-02-01"]);
    assert!(!ok && stderr.contains("prepare.chat_date differs"), "{stderr}");
    assert!(stderr.contains("has 2026-01-15, this run has 2026-02-01"), "{stderr}");
    assert!(stderr.contains("run with --chat-date 2026-01-15 as it did") && stderr.contains("--overwrite"), "{stderr}");
}

#[test]
fn a_template_strata_cannot_render_names_the_construct() {
    let tmp = tempfile::tempdir().unwrap();
    let model = chat_model(tmp.path(), "chatml");
    let bad = tmp.path().join("bad.jinja");
    std::fs::write(&bad, "{% for m in messages %}{{ m.content | wordwrap(5) }}{% endfor %}").unwrap();
    let out = tmp.path().join("out");
    let data = fixtures().join("conversations.openai.jsonl");
    let (ok, _, stderr) = extract(&model, &data, &out, &["--chat-template", bad.to_str().unwrap()]);
    assert!(!ok && stderr.contains("wordwrap") && stderr.contains("Strata cannot render this construct"), "{stderr}");
    assert!(!out.join("manifest.json").exists() || native_rows(&out).is_empty());
    // Python's `%` string formatting fails on the first conversation: the run stops there.
    std::fs::write(&bad, "{% for m in messages %}{{ '%s: %s' % (m.role, m.content) }}{% endfor %}").unwrap();
    let (ok, _, stderr) = extract(&model, &data, &tmp.path().join("o1"), &["--chat-template", bad.to_str().unwrap()]);
    assert!(!ok && stderr.contains("% operator") && stderr.contains("failed on the first conversation"), "{stderr}");
    std::fs::write(&bad, "{% for m in messages %}{% generation %}x{% endfor %}").unwrap();
    let (ok, _, stderr) = extract(&model, &data, &tmp.path().join("o2"), &["--chat-template", bad.to_str().unwrap()]);
    assert!(!ok && stderr.contains("chat template") && stderr.contains("line 1"), "{stderr}");
}

#[test]
fn text_and_a_tiktoken_model_directory() {
    let tmp = tempfile::tempdir().unwrap();
    // Text through the HF tokenizer.
    let model = chat_model(tmp.path(), "chatml");
    let data = tmp.path().join("text.jsonl");
    std::fs::write(&data, "{\"text\": \"Hello, world!\", \"id\": \"a\"}\n{\"text\": \"Bonjour à tous\"}\n").unwrap();
    let out = tmp.path().join("text");
    let (ok, stdout, stderr) = extract(&model, &data, &out, &[]);
    assert!(ok && stdout.contains("2 records (text)"), "{stdout}{stderr}");
    let rows = native_rows(&out);
    let tok = Chat::load(&model, &ChatOptions::default()).unwrap();
    let mut enc = strata::chat::Encoded::default();
    tok.tokenizer.encode("Hello, world!", true, &mut enc).unwrap();
    assert_eq!(rows[0].1, enc.ids.iter().map(|&v| v as i64).collect::<Vec<_>>());
    assert!(rows[0].2.iter().all(|&m| m == 1));

    // A Kimi-style directory: tiktoken.model, no tokenizer.json.
    let kimi = tmp.path().join("kimi");
    tiny_llama(&kimi, 700);
    for f in ["tiktoken.model", "tokenizer_config.json"] {
        std::fs::copy(fixtures().join("tiktoken").join(f), kimi.join(f)).unwrap();
    }
    // Empty text is refused (no tokens), so those cases stay with the unit parity test.
    let cases: Vec<Value> =
        jsonl(&fixtures().join("tiktoken/expected.jsonl")).into_iter().filter(|c| c["text"] != "").collect();
    let lines: String = cases.iter().map(|c| format!("{}\n", serde_json::json!({"text": c["text"]}))).collect();
    std::fs::write(&data, lines).unwrap();
    let out = tmp.path().join("kimi-out");
    let (ok, _, stderr) = extract(&kimi, &data, &out, &[]);
    assert!(ok, "{stderr}");
    let rows = native_rows(&out);
    assert_eq!(rows.len(), cases.len());
    for (row, case) in rows.iter().zip(&cases) {
        assert_eq!(serde_json::json!(row.1), case["ids"], "{}", case["text"]);
    }
    // Conversations need a template this directory does not have.
    let (ok, _, stderr) = extract(&kimi, &fixtures().join("conversations.openai.jsonl"), &tmp.path().join("k2"), &[]);
    assert!(!ok && stderr.contains("no chat template") && stderr.contains("--chat-template"), "{stderr}");
}

#[test]
fn verify_checks_the_trainers_table_against_the_files() {
    let tmp = tempfile::tempdir().unwrap();
    let model = chat_model(tmp.path(), "chatml");
    let out = tmp.path().join("spec");
    let data = fixtures().join("conversations.sharegpt.jsonl");
    let (ok, _, stderr) = extract(&model, &data, &out, &["--format", "speculators", "--chat-date", "2026-01-15"]);
    assert!(ok, "{stderr}");
    let verify = || {
        let o = std::process::Command::new(env!("CARGO_BIN_EXE_strata")).arg("verify").arg(&out).output().unwrap();
        (o.status.success(), String::from_utf8_lossy(&o.stdout).to_string() + &String::from_utf8_lossy(&o.stderr))
    };
    let (ok, text) = verify();
    assert!(ok, "{text}");
    // The table with one mask bit flipped in row 3.
    let rows = expected_rows("chatml.sharegpt", "auto");
    let mut w = strata::sink::hf_dataset::TableWriter::new(Vec::new()).unwrap();
    for (i, (_, ids, mask)) in rows.iter().enumerate() {
        let mask: Vec<i64> = mask.iter().enumerate().map(|(t, &m)| (m as i64) ^ (i == 3 && t == 0) as i64).collect();
        w.push(ids.iter().copied(), mask.into_iter()).unwrap();
    }
    std::fs::write(out.join("data-00000-of-00001.arrow"), w.finish().unwrap().0).unwrap();
    let (ok, text) = verify();
    assert!(
        !ok && text.contains("row 3 does not hold the token ids and mask of \"hidden_states/hs_3.safetensors\""),
        "{text}"
    );
    std::fs::remove_file(out.join("data-00000-of-00001.arrow")).unwrap();
    let (ok, text) = verify();
    assert!(!ok && text.contains("the dataset table the trainer loads"), "{text}");
}

#[test]
fn token_ids_need_no_tokenizer_even_a_broken_one() {
    let tmp = tempfile::tempdir().unwrap();
    let model = chat_model(tmp.path(), "chatml");
    std::fs::write(model.join("tokenizer.json"), "{ not json").unwrap();
    let data = tmp.path().join("ids.jsonl");
    std::fs::write(&data, "{\"input_ids\": [1, 2, 3]}\n").unwrap();
    let (ok, stdout, stderr) = extract(&model, &data, &tmp.path().join("a"), &[]);
    assert!(ok && stdout.contains("wrote 1 samples"), "{stderr}");
    assert!(stderr.contains("token ids still work"), "{stderr}");
    // Conversations say why they cannot be rendered.
    let conv = fixtures().join("conversations.openai.jsonl");
    let (ok, _, stderr) = extract(&model, &conv, &tmp.path().join("b"), &[]);
    assert!(!ok && stderr.contains("needs the model's tokenizer: tokenizer:"), "{stderr}");
}

#[test]
fn the_tokenizer_files_truncation_and_padding_are_not_applied_and_limits_are_checked() {
    let tmp = tempfile::tempdir().unwrap();
    let model = chat_model(tmp.path(), "chatml");
    // As transformers does for chat text: a tokenizer.json's own truncation and padding are off.
    let path = model.join("tokenizer.json");
    let mut tok: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    tok["truncation"] =
        serde_json::json!({"direction": "Right", "max_length": 5, "strategy": "LongestFirst", "stride": 0});
    tok["padding"] = serde_json::json!({"strategy": {"Fixed": 300}, "direction": "Right", "pad_to_multiple_of": null,
                                        "pad_id": 0, "pad_type_id": 0, "pad_token": "<|endoftext|>"});
    std::fs::write(&path, tok.to_string()).unwrap();
    let out = tmp.path().join("out");
    let data = fixtures().join("conversations.openai.jsonl");
    let (ok, _, stderr) = extract(&model, &data, &out, &["--chat-date", "2026-01-15"]);
    assert!(ok, "{stderr}");
    assert_eq!(native_rows(&out), expected_rows("chatml.openai", "auto"));
    // A limit past what the model takes is refused up front.
    let (ok, _, stderr) = extract(&model, &data, &tmp.path().join("o2"), &["--max-seq-len", "1000000"]);
    assert!(!ok && stderr.contains("--max-seq-len 1000000 is more than the model takes"), "{stderr}");
}

// ---- Long texts in pieces ------------------------------------------------------------------

/// Texts of every kind the fixtures hold, and long ones made of them.
fn long_texts() -> Vec<String> {
    let mut texts: Vec<String> = Vec::new();
    let mut rendered = String::new();
    for t in ["chatml", "llama3", "qwen3"] {
        let chat = chat(t);
        let tmpl = chat.template.as_ref().unwrap();
        for line in jsonl(&fixtures().join("conversations.openai.jsonl")) {
            let c = conversation("openai", &line);
            let msgs = strata::chat::template::json_value(&Value::Array(c.messages.clone()));
            if let Ok(r) = tmpl.render(&msgs, None, false) {
                rendered.push_str(&r.text);
            }
        }
    }
    texts.push(rendered);
    let tik: Vec<String> = jsonl(&fixtures().join("tiktoken/expected.jsonl"))
        .iter()
        .map(|c| c["text"].as_str().unwrap().to_string())
        .collect();
    texts.push(tik.join("\n").repeat(4));
    texts.push(tik.join(" ").repeat(4));
    texts.push("The quick brown fox, jumps over the lazy dog! ".repeat(300));
    texts.push(format!("{}x{}", " ".repeat(3000), "\n\n  def f(x):\n        return x  # é ".repeat(200)));
    texts.push("日本語のテキストと中文文本混合".repeat(400));
    texts
}

fn tiktoken_fixture() -> strata::chat::Tokenizer {
    let dir = fixtures().join("tiktoken");
    let model = std::fs::read_to_string(dir.join("tiktoken.model")).unwrap();
    let config: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("tokenizer_config.json")).unwrap()).unwrap();
    strata::chat::Tokenizer::tiktoken(&model, "tiktoken.model", &config).unwrap()
}

#[test]
fn texts_tokenized_in_pieces_give_the_whole_texts_tokens() {
    let hf = chat("chatml").tokenizer;
    let tik = tiktoken_fixture();
    let mut compared = 0;
    for (name, tok) in [("tokenizer.json", &hf), ("tiktoken", &tik)] {
        for text in long_texts() {
            let mut whole = strata::chat::Encoded::default();
            tok.encode(&text, false, &mut whole).unwrap();
            assert!(whole.ids.len() > 1000, "{name}: a short text");
            for chunk in [97, 512, 4000, 1 << 16] {
                // A stretch with no place to cut (a run of spaces, or a tokenizer.json's one
                // pre-token piece of CJK text) is refused when it is longer than the pieces.
                let p = match tok.prefix_in(&text, usize::MAX, chunk) {
                    Ok(p) => p,
                    Err(strata::chat::ChatError::Text(m)) if chunk < (1 << 16) && m.contains("no place") => continue,
                    Err(e) => panic!("{name}, pieces of {chunk} bytes: {e}"),
                };
                assert!(!p.more);
                assert_eq!(p.enc.ids, whole.ids, "{name}, pieces of {chunk} bytes: {:?}", &text[..60]);
                assert_eq!(p.enc.spans, whole.spans, "{name}, pieces of {chunk} bytes");
                // Cut to a limit: the whole text's first tokens, and it says there are more.
                let cap = whole.ids.len() / 3;
                let p = tok.prefix_in(&text, cap, chunk).unwrap();
                assert!(p.more);
                assert_eq!(p.enc.ids, whole.ids[..cap], "{name}, pieces of {chunk} bytes, cap {cap}");
                compared += 1;
            }
            // With a BOS where the tokenizer adds one.
            let mut with = strata::chat::Encoded::default();
            tok.encode(&text, true, &mut with).unwrap();
            let mut limited = strata::chat::Encoded::default();
            assert!(!tok.encode_limited(&text, true, usize::MAX, &mut limited).unwrap());
            assert_eq!(limited.ids, with.ids, "{name}: add_special");
            assert!(tok.encode_limited(&text, true, 10, &mut limited).unwrap());
            assert_eq!(limited.ids, with.ids[..10], "{name}: add_special, cut");
        }
    }
    assert!(compared >= 40, "{compared}");
}

#[test]
fn a_second_text_reuses_the_first_ones_tokens_before_they_part() {
    let hf = chat("chatml").tokenizer;
    let tik = tiktoken_fixture();
    for tok in [&hf, &tik] {
        for base in long_texts() {
            let mut cuts: Vec<usize> = [0, 1, 100, base.len() / 3, base.len() / 2, base.len() - 1, base.len()]
                .into_iter()
                .filter(|&c| base.is_char_boundary(c))
                .collect();
            cuts.dedup();
            for cap in [usize::MAX, 700] {
                let Ok(p) = tok.prefix_in(&base, cap, 300) else { continue };
                for &c in &cuts {
                    // The base cut short, and the base cut there then going on otherwise.
                    for other in [
                        base[..c].to_string(),
                        format!("{}<|im_end|>\n<|im_start|>user\nand then{}", &base[..c], "!".repeat(c % 7)),
                    ] {
                        let want = tok.prefix(&other, cap).unwrap();
                        let got = p.derive(tok, &base, &other).unwrap();
                        assert_eq!((p.ids(&got), got.more), (want.enc.ids.clone(), want.more), "cut at {c}, cap {cap}");
                        assert_eq!(got.tail.spans, want.enc.spans[got.shared..]);
                    }
                }
            }
        }
    }
}

// ---- Long conversations: one render, tokens reused -----------------------------------------

/// `turns` messages alternating user and assistant, with reasoning on some assistant turns.
fn long_conversation(turns: usize, reasoning: bool) -> Conversation {
    let msgs: Vec<Value> = (0..turns)
        .map(|i| {
            let role = if i % 2 == 0 { "user" } else { "assistant" };
            let mut m = serde_json::json!({"role": role, "content": format!("turn {i}: {}", "lorem ipsum dolor sit amet, ".repeat(1 + i % 5))});
            if reasoning && i % 4 == 1 {
                m["reasoning_content"] = Value::from(format!("thinking about {i}"));
            }
            m
        })
        .collect();
    Conversation::parse(Style::OpenAi, &Value::Array(msgs), None).unwrap()
}

/// A row's token ids and loss mask.
type IdsAndMask = (Vec<u32>, Vec<u8>);

/// The rows as the speculators stack makes them, each render tokenized whole
/// (the definition the fast path must meet): a turn whose prompt has at
/// least `max_len` tokens is left out; rows and masks are cut to `max_len`;
/// one row when every kept turn's cut row starts the whole conversation's cut row.
fn reference_rows(chat: &Chat, c: &Conversation, mode: RowMode, max_len: usize) -> Result<Vec<IdsAndMask>, String> {
    let t = chat.template.as_ref().unwrap();
    let mut c = c.clone();
    c.drop_trailing();
    let ids = |upto: usize, gen: bool| {
        let v = strata::chat::template::json_value(&Value::Array(c.messages[..upto].to_vec()));
        let r = t.render(&v, None, gen).map_err(|e| e.to_string())?;
        let mut e = strata::chat::Encoded::default();
        chat.tokenizer.encode(&r.text, false, &mut e).unwrap();
        Ok::<_, String>(e.ids)
    };
    let cut = |v: &[u32]| v[..v.len().min(max_len)].to_vec();
    let mut kept = vec![];
    for (j, role) in c.roles.iter().enumerate() {
        if *role != strata::chat::Role::Assistant || j == 0 {
            continue;
        }
        let prompt = ids(j, true)?;
        if prompt.len() >= max_len {
            continue;
        }
        let row = ids(j + 1, false)?;
        let b = if row.starts_with(&prompt) {
            prompt.len()
        } else {
            let common = prompt.iter().zip(&row).take_while(|(a, b)| a == b).count();
            let hist = ids(j, false)?;
            if !row.starts_with(&hist) || common < hist.len() {
                return Err(format!("turn {j} diverges"));
            }
            common
        };
        kept.push((row, b));
    }
    let last = cut(&ids(c.messages.len(), false)?);
    let stable = kept.iter().all(|(r, _)| last.starts_with(&cut(r)));
    if mode == RowMode::PerTurn || !stable {
        let mask = |r: &[u32], b: usize| {
            let n = r.len().min(max_len);
            let mut m = vec![0u8; n];
            m[b.min(n)..].fill(1);
            m
        };
        return Ok(kept.iter().map(|(r, b)| (cut(r), mask(r, *b))).collect());
    }
    let mut mask = vec![0u8; last.len()];
    for (r, b) in &kept {
        for m in &mut mask[(*b).min(last.len())..r.len().min(last.len())] {
            *m = 1;
        }
    }
    Ok(if kept.is_empty() { vec![] } else { vec![(last, mask)] })
}

#[test]
fn long_conversations_give_the_rows_of_rendering_and_tokenizing_every_turn() {
    let mut compared = 0;
    for template in ["chatml", "llama3", "qwen3"] {
        let chat = chat(template);
        let mut r = chat.renderer().unwrap();
        for (turns, reasoning) in [(40, false), (41, true), (7, true)] {
            let c = long_conversation(turns, reasoning);
            for max_len in [usize::MAX, 2000, 300, 40] {
                for mode in [RowMode::Auto, RowMode::PerTurn] {
                    let opts = RowOptions { mask: MaskSource::Boundary, rows: mode, max_len, long: LongRows::Truncate };
                    let want = reference_rows(&chat, &c, mode, max_len);
                    let got = r.rows(&c, &opts);
                    let ctx = format!("{template}, {turns} turns, max {max_len}, {mode:?}");
                    match (want, got) {
                        (Ok(want), Ok(got)) => {
                            let got: Vec<_> =
                                got.rows.iter().map(|r| (r.input_ids.clone(), r.loss_mask.clone())).collect();
                            if got != want {
                                let lens = |v: &[IdsAndMask]| v.iter().map(|r| r.0.len()).collect::<Vec<_>>();
                                let first = got.iter().zip(&want).position(|(a, b)| a != b);
                                panic!(
                                    "{ctx}: rows of {:?} tokens, the reference {:?}; first differing row {first:?}",
                                    lens(&got),
                                    lens(&want)
                                );
                            }
                            compared += 1;
                        }
                        (Err(_), Err(RowsError::Conversation(_) | RowsError::Refused(_))) => {}
                        (w, g) => {
                            panic!("{ctx}: reference {:?}, fast path {:?}", w.map(|r| r.len()), g.map(|r| r.rows.len()))
                        }
                    }
                }
            }
        }
    }
    assert!(compared >= 60, "{compared}");
}
