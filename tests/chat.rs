//! Conversations to rows: exact parity with transformers' `apply_chat_template`
//! plus the render-boundary algorithm, on the fixtures
//! `scripts/make_chat_fixtures.py` writes (tests/fixtures/chat), for both
//! message styles, every row mode, the length limit and generation masks;
//! and the tiktoken BPE against Python's `tiktoken`.

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
        kwargs: Default::default(),
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
                assert!(matches!(auto, Err(RowsError::Conversation(_))), "{ctx}: expected an error, got {auto:?}");
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
