//! Multi-turn regeneration as `speculators regenerate-responses` (the 0.9
//! wheel, `speculators/cli/regenerate_responses.py`) runs it against a vLLM
//! (0.19.1) server, with the server's side (what `content` and `tool_calls`
//! a reply holds) done here.
//!
//! A conversation's system and user turns drive it; its assistant turns are
//! dropped and regenerated; its `tool` messages are cached results, handed
//! back in order after each generated tool call. Every generation is a row.
//! The conversation stops, keeping its rows, when prompt + completion pass
//! `max_tokens` (the tool's test: a turn cut by `max_tokens` always does), on
//! a parallel call, a call for another tool than the cached result answers,
//! or when no cached result is left.

use serde_json::{Map, Value};
use std::collections::VecDeque;

use crate::hf::truthy;

/// The conversation's messages: `messages`, else `conversations`, else a
/// message-list `prompt` (each only when a non-empty list).
fn messages(row: &Map<String, Value>) -> &[Value] {
    for key in ["messages", "conversations", "prompt"] {
        if let Some(Value::Array(a)) = row.get(key) {
            if !a.is_empty() || key == "prompt" {
                return a;
            }
        }
    }
    &[]
}

/// A field as Python's `row.get(key)` sees it: absent and `null` alike.
fn get<'a>(m: &'a Map<String, Value>, key: &str) -> Option<&'a Value> {
    m.get(key).filter(|v| !v.is_null())
}

/// The names a cached tool result answers: each `<tool_response>` block's
/// JSON `name` (Hermes's layout). Empty when none can be read, which lets
/// any call take the result.
pub fn result_names(content: &Value) -> Vec<String> {
    static RE: std::sync::OnceLock<regex::Regex> = std::sync::OnceLock::new();
    let re = RE.get_or_init(|| regex::Regex::new(r"(?s)<tool_response>\s*(.*?)\s*</tool_response>").expect("valid"));
    let Value::String(s) = content else { return vec![] };
    re.captures_iter(s)
        .filter_map(|c| serde_json::from_str::<Value>(c[1].trim()).ok())
        .filter_map(|v| v.get("name").and_then(|n| n.as_str()).map(String::from))
        .collect()
}

/// A conversation's regeneration: its turns, cached tool results and
/// tools, and the history so far.
#[derive(Clone, Debug)]
pub struct Regeneration {
    /// System and user messages still to come, `{role, content}`.
    turns: VecDeque<Value>,
    /// Cached tool results and the tool names each answers, in order.
    results: VecDeque<(Value, Vec<String>)>,
    /// The row's tools (OpenAI schema), if any.
    pub tools: Option<Value>,
    /// The messages the next prompt renders.
    history: Vec<Value>,
    /// A tool result was spliced in: the next request continues this turn.
    continuing: bool,
    /// Stopped early (see the module doc).
    pub truncated: bool,
    done: bool,
    /// Generations so far.
    pub generations: usize,
}

/// What the server returned for one request: its `message`.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Reply {
    /// `content`: `None` where vLLM returns null.
    pub content: Option<String>,
    /// `tool_calls`: `{id, type, function: {name, arguments}}` each.
    pub tool_calls: Vec<Value>,
}

impl Regeneration {
    /// Reads a row as the tool does (`extract_conversation`, `extract_tools`):
    /// `Err` says why it cannot be regenerated (no user turn, unusable `tools`).
    pub fn parse(row: &Map<String, Value>) -> Result<Self, String> {
        let mut turns = VecDeque::new();
        let mut results = VecDeque::new();
        for m in messages(row) {
            let Value::Object(m) = m else { continue };
            // `m.get("role") or m.get("from")`: a falsy role falls through.
            let role = m.get("role").filter(|v| truthy(v)).or_else(|| m.get("from"));
            let content = get(m, "content").or_else(|| m.get("value")).cloned().unwrap_or(Value::Null);
            let role = match role.and_then(|r| r.as_str()) {
                Some("user" | "human") => "user",
                Some("system") => "system",
                Some("tool") => "tool",
                _ => continue, // assistant turns are regenerated
            };
            if role == "tool" {
                if !content.is_null() {
                    let names = result_names(&content);
                    results.push_back((content, names));
                }
            } else if truthy(&content) {
                turns.push_back(serde_json::json!({"role": role, "content": content}));
            }
        }
        if !turns.iter().any(|t| t["role"] == "user") {
            // The `prompt` field, as one user turn, with no cached results.
            match row.get("prompt") {
                Some(Value::String(p)) if !p.is_empty() => {
                    turns = VecDeque::from([serde_json::json!({"role": "user", "content": p})]);
                    results.clear();
                }
                _ => {
                    return Err(
                        "no user turn: a conversation needs a `messages` or `conversations` list with a non-empty \
                         user turn, or a `prompt` string"
                            .into(),
                    )
                }
            }
        }
        let tools = match row.get("tools") {
            None | Some(Value::Null) => None,
            Some(v) => {
                let parsed = match v {
                    Value::String(s) => serde_json::from_str::<Value>(s).ok(),
                    v => Some(v.clone()),
                };
                match parsed {
                    Some(Value::Array(a)) if !a.is_empty() => Some(vllm_tools(&a)?),
                    _ if matches!(v, Value::String(s) if s.is_empty()) => None,
                    _ if matches!(v, Value::Array(a) if a.is_empty()) => None,
                    _ if matches!(v, Value::Object(o) if o.is_empty()) => None,
                    _ => return Err("a tools field is present but not a usable list".into()),
                }
            }
        };
        Ok(Regeneration {
            turns,
            results,
            tools,
            history: vec![],
            continuing: false,
            truncated: false,
            done: false,
            generations: 0,
        })
    }

    /// The messages of the next request, in vLLM's form for the template (a
    /// tool call's `arguments` parsed to an object, as vLLM's
    /// `_postprocess_messages` does); `None` when the conversation is over.
    pub fn next_request(&mut self) -> Option<Value> {
        if self.done {
            return None;
        }
        if !self.continuing {
            loop {
                let Some(turn) = self.turns.pop_front() else {
                    self.done = true;
                    return None;
                };
                let user = turn["role"] == "user";
                self.history.push(turn);
                if user {
                    break;
                }
            }
        }
        Some(Value::Array(self.history.iter().map(for_template).collect()))
    }

    /// Takes the reply to the last request: `total` is its prompt and
    /// completion tokens, `max_tokens` the request's. `Err` when the reply is
    /// wholly empty (no content, no call): the tool then fails the whole
    /// conversation, its rows included.
    pub fn answer(&mut self, reply: Reply, total: usize, max_tokens: usize) -> Result<(), String> {
        let has_content = reply.content.as_deref().is_some_and(|c| !c.is_empty());
        if !has_content && reply.tool_calls.is_empty() {
            return Err(format!("empty assistant generation (sample {})", self.generations));
        }
        self.generations += 1;
        self.continuing = false;
        let calls = reply.tool_calls;
        let mut msg = Map::new();
        msg.insert("role".into(), "assistant".into());
        msg.insert("content".into(), reply.content.unwrap_or_default().into());
        if !calls.is_empty() {
            msg.insert("tool_calls".into(), Value::Array(calls.clone()));
        }
        self.history.push(Value::Object(msg));
        if total > max_tokens {
            return self.stop();
        }
        if calls.is_empty() {
            return Ok(());
        }
        if calls.len() != 1 || self.results.is_empty() {
            return self.stop();
        }
        let (content, names) = self.results.pop_front().expect("checked above");
        let name = calls[0].pointer("/function/name").and_then(|n| n.as_str());
        if !names.is_empty() && !name.is_some_and(|n| names.iter().any(|x| x == n)) {
            return self.stop();
        }
        let mut tool = Map::new();
        tool.insert("role".into(), "tool".into());
        tool.insert("content".into(), content);
        if let Some(id) = calls[0].get("id").filter(|v| truthy(v)) {
            tool.insert("tool_call_id".into(), id.clone());
        }
        self.history.push(Value::Object(tool));
        self.continuing = true;
        Ok(())
    }

    /// Ends the conversation early, its rows kept.
    fn stop(&mut self) -> Result<(), String> {
        self.truncated = true;
        self.done = true;
        Ok(())
    }
}

/// The tools as vLLM's chat endpoint hands them to the template: each
/// checked against its `ChatCompletionToolsParam` (a `"function"` type, a
/// `function` object with a string `name`, a string or null `description`,
/// an object or null `parameters`) and rendered as its `model_dump()`:
/// `type`, then `function` {`name`, `description`, `parameters`, then any
/// other keys}, then the tool's other keys, nulls written out. `Err` where
/// vLLM answers 400 (and the tool fails the conversation).
fn vllm_tools(tools: &[Value]) -> Result<Value, String> {
    let bad = |i: usize, why: &str| format!("tools[{i}] is not a tool vLLM's chat endpoint takes: {why}");
    let mut out = Vec::with_capacity(tools.len());
    for (i, t) in tools.iter().enumerate() {
        let t = t.as_object().ok_or_else(|| bad(i, "not an object"))?;
        match t.get("type") {
            None => {}
            Some(Value::String(s)) if s == "function" => {}
            Some(_) => return Err(bad(i, "`type` must be \"function\"")),
        }
        let f = t.get("function").and_then(|f| f.as_object()).ok_or_else(|| bad(i, "no `function` object"))?;
        let name = f.get("name").filter(|n| n.is_string()).ok_or_else(|| bad(i, "no string `function.name`"))?;
        let description = match f.get("description") {
            None | Some(Value::Null) => Value::Null,
            Some(d @ Value::String(_)) => d.clone(),
            Some(_) => return Err(bad(i, "`function.description` must be a string")),
        };
        let parameters = match f.get("parameters") {
            None | Some(Value::Null) => Value::Null,
            Some(p @ Value::Object(_)) => p.clone(),
            Some(_) => return Err(bad(i, "`function.parameters` must be an object")),
        };
        let mut function = Map::new();
        function.insert("name".into(), name.clone());
        function.insert("description".into(), description);
        function.insert("parameters".into(), parameters);
        for (k, v) in f {
            if !matches!(k.as_str(), "name" | "description" | "parameters") {
                function.insert(k.clone(), v.clone());
            }
        }
        let mut tool = Map::new();
        tool.insert("type".into(), "function".into());
        tool.insert("function".into(), Value::Object(function));
        for (k, v) in t {
            if !matches!(k.as_str(), "type" | "function") {
                tool.insert(k.clone(), v.clone());
            }
        }
        out.push(Value::Object(tool));
    }
    Ok(Value::Array(out))
}

/// A history message as vLLM hands it to the template: text parts of a
/// list content joined by newlines (the "string" content format), a tool
/// call's `arguments` parsed from JSON text to an object (empty: `{}`).
fn for_template(m: &Value) -> Value {
    let mut m = m.clone();
    if let Some(Value::Array(parts)) = m.get("content") {
        let texts: Vec<&str> = parts
            .iter()
            .filter_map(|p| match p {
                Value::String(s) => Some(s.as_str()),
                p if p.get("type").and_then(|t| t.as_str()) == Some("text") => p.get("text")?.as_str(),
                _ => None,
            })
            .collect();
        m["content"] = texts.join("\n").into();
    }
    if let Some(Value::Array(calls)) = m.get_mut("tool_calls") {
        for call in calls {
            if let Some(f) = call.get_mut("function").and_then(|f| f.as_object_mut()) {
                let args = match f.get("arguments") {
                    Some(Value::String(s)) if !s.is_empty() => {
                        serde_json::from_str(s).unwrap_or_else(|_| Value::String(s.clone()))
                    }
                    Some(v @ (Value::Object(_) | Value::Array(_))) if truthy(v) => v.clone(),
                    _ => Value::Object(Map::new()),
                };
                f.insert("arguments".into(), args);
            }
        }
    }
    m
}

/// The tool-call parsers `--tool-call-parser` takes (vLLM's names).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ToolParser {
    /// `hermes`: `<tool_call>{"name": ..., "arguments": ...}</tool_call>` (Qwen, Hermes).
    Hermes,
}

/// The reasoning parsers `--reasoning-parser` takes (vLLM's names).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReasoningParser {
    /// `qwen3`: `<think>...</think>`; with `enable_thinking` false, text without `</think>` is content.
    Qwen3,
    /// `deepseek_r1`: `<think>...</think>`; text without `</think>` is reasoning.
    DeepSeekR1,
}

impl ToolParser {
    /// vLLM's name.
    pub fn name(self) -> &'static str {
        match self {
            ToolParser::Hermes => "hermes",
        }
    }

    /// The parser named `name`; `Err` lists those supported.
    pub fn named(name: &str) -> Result<Self, String> {
        match name {
            "hermes" => Ok(ToolParser::Hermes),
            _ => Err(format!("--tool-call-parser {name}: not supported (supported: hermes)")),
        }
    }

    /// vLLM's `Hermes2ProToolParser.extract_tool_calls` on the (reasoning-free)
    /// text: the calls, and the text before the first `<tool_call>` (`None`
    /// if empty). A call that does not parse leaves the whole text as content.
    /// `id_of(i)` names call `i` (vLLM draws a random id; Strata derives one
    /// from the draw key, so that a history renders the same every run).
    pub fn extract(self, text: &str, id_of: impl Fn(usize) -> String) -> (Option<String>, Vec<Value>) {
        const START: &str = "<tool_call>";
        let Some(first) = text.find(START) else { return (Some(text.to_string()), vec![]) };
        static RE: std::sync::OnceLock<regex::Regex> = std::sync::OnceLock::new();
        let re =
            RE.get_or_init(|| regex::Regex::new(r"(?s)<tool_call>(.*?)</tool_call>|<tool_call>(.*)").expect("valid"));
        let mut calls = Vec::new();
        for (i, c) in re.captures_iter(text).enumerate() {
            let body = c.get(1).filter(|m| !m.as_str().is_empty()).or_else(|| c.get(2)).map_or("", |m| m.as_str());
            let Some(call) = python_json(body) else { return (Some(text.to_string()), vec![]) };
            let (Some(name), Some(args)) = (call.get("name"), call.get("arguments")) else {
                return (Some(text.to_string()), vec![]);
            };
            let name = match name {
                Value::String(s) => s.clone(),
                _ => return (Some(text.to_string()), vec![]),
            };
            calls.push(serde_json::json!({
                "id": id_of(i),
                "type": "function",
                "function": {"name": name, "arguments": python_dumps(args)},
            }));
        }
        // vLLM's serving layer then drops a content of whitespace alone.
        let content = &text[..first];
        (if content.trim().is_empty() { None } else { Some(content.to_string()) }, calls)
    }
}

impl ReasoningParser {
    /// vLLM's name.
    pub fn name(self) -> &'static str {
        match self {
            ReasoningParser::Qwen3 => "qwen3",
            ReasoningParser::DeepSeekR1 => "deepseek_r1",
        }
    }

    /// The parser named `name`; `Err` lists those supported.
    pub fn named(name: &str) -> Result<Self, String> {
        match name {
            "qwen3" => Ok(ReasoningParser::Qwen3),
            "deepseek_r1" => Ok(ReasoningParser::DeepSeekR1),
            _ => Err(format!("--reasoning-parser {name}: not supported (supported: qwen3, deepseek_r1)")),
        }
    }

    /// vLLM's `extract_reasoning`: (reasoning, content), each `None` when
    /// empty or absent. `thinking` is `chat_template_kwargs.enable_thinking`
    /// (default true), read by `qwen3` only.
    pub fn split(self, text: &str, thinking: bool) -> (Option<String>, Option<String>) {
        let text = match text.split_once("<think>") {
            Some((_, after)) => after,
            None => text,
        };
        match text.split_once("</think>") {
            None if self == ReasoningParser::Qwen3 && !thinking => (None, Some(text.to_string())),
            None => (Some(text.to_string()), None),
            Some((r, c)) => (Some(r.to_string()), (!c.is_empty()).then(|| c.to_string())),
        }
    }
}

/// Python's `json.loads` on a call body: JSON with whitespace around it.
fn python_json(s: &str) -> Option<Map<String, Value>> {
    match serde_json::from_str::<Value>(s.trim_matches(|c: char| matches!(c, ' ' | '\t' | '\n' | '\r'))) {
        Ok(Value::Object(m)) => Some(m),
        _ => None,
    }
}

/// A formatter writing JSON as Python's `json.dumps` does by default
/// (`", "` and `": "` between items and after keys).
struct PythonFormatter;

impl serde_json::ser::Formatter for PythonFormatter {
    fn begin_array_value<W: ?Sized + std::io::Write>(&mut self, w: &mut W, first: bool) -> std::io::Result<()> {
        if first {
            Ok(())
        } else {
            w.write_all(b", ")
        }
    }
    fn begin_object_key<W: ?Sized + std::io::Write>(&mut self, w: &mut W, first: bool) -> std::io::Result<()> {
        if first {
            Ok(())
        } else {
            w.write_all(b", ")
        }
    }
    fn begin_object_value<W: ?Sized + std::io::Write>(&mut self, w: &mut W) -> std::io::Result<()> {
        w.write_all(b": ")
    }
}

/// `json.dumps(v, ensure_ascii=False)`: keys in their order, Python's separators.
pub fn python_dumps(v: &Value) -> String {
    let mut out = Vec::new();
    let mut ser = serde_json::Serializer::with_formatter(&mut out, PythonFormatter);
    serde::Serialize::serialize(v, &mut ser).expect("a Value serializes");
    String::from_utf8(out).expect("JSON is UTF-8")
}

/// Keys sorted, recursively (`sort_keys=True`).
fn sorted(v: &Value) -> Value {
    match v {
        Value::Object(m) => {
            let mut keys: Vec<&String> = m.keys().collect();
            keys.sort();
            Value::Object(keys.into_iter().map(|k| (k.clone(), sorted(&m[k]))).collect())
        }
        Value::Array(a) => Value::Array(a.iter().map(sorted).collect()),
        v => v.clone(),
    }
}

/// The tool's `_primary_identifier`: the row's `id`, else its `uuid` (as
/// Python's `str` writes a string or an integer), else `hash_` and the
/// SHA-256 of `json.dumps(row, sort_keys=True, ensure_ascii=False)`.
pub fn primary_id(row: &Map<String, Value>) -> String {
    for key in ["id", "uuid"] {
        match row.get(key) {
            None | Some(Value::Null) => {}
            Some(Value::String(s)) if s.is_empty() => {}
            Some(Value::String(s)) => return s.clone(),
            Some(Value::Bool(b)) => return if *b { "True" } else { "False" }.into(),
            Some(v) => return python_dumps(v),
        }
    }
    use sha2::Digest;
    let text = python_dumps(&sorted(&Value::Object(row.clone())));
    format!("hash_{:x}", sha2::Sha256::digest(text.as_bytes()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn row(v: Value) -> Map<String, Value> {
        v.as_object().unwrap().clone()
    }

    fn call(name: &str) -> Value {
        json!({"id": format!("call-{name}"), "type": "function", "function": {"name": name, "arguments": "{\"x\": 1}"}})
    }

    fn text(s: &str) -> Reply {
        Reply { content: Some(s.into()), tool_calls: vec![] }
    }

    #[test]
    fn turns_results_and_the_prompt_fallback_are_read_as_the_tool_reads_them() {
        let r = Regeneration::parse(&row(json!({"conversations": [
            {"from": "system", "value": "be brief"}, {"from": "human", "value": "hi"},
            {"from": "gpt", "value": "old"}, {"from": "human", "value": ""},
            {"role": "tool", "content": "<tool_response>\n{\"name\": \"f\", \"content\": 1}\n</tool_response>"},
        ]})))
        .unwrap();
        assert_eq!(r.turns.len(), 2, "the empty user turn and the assistant turn are dropped");
        assert_eq!(r.results[0].1, vec!["f".to_string()]);
        let r = Regeneration::parse(&row(json!({"messages": [], "prompt": "write a poem"}))).unwrap();
        assert_eq!(r.turns[0], json!({"role": "user", "content": "write a poem"}));
        let e = Regeneration::parse(&row(json!({"messages": [{"role": "assistant", "content": "x"}]}))).unwrap_err();
        assert!(e.starts_with("no user turn"), "{e}");
        let e = Regeneration::parse(&row(json!({"prompt": "p", "tools": "not json"}))).unwrap_err();
        assert_eq!(e, "a tools field is present but not a usable list");
        let tools = "[{\"function\": {\"parameters\": {}, \"name\": \"f\", \"strict\": true}, \"x\": 1}]";
        let r = Regeneration::parse(&row(json!({"prompt": "p", "tools": tools}))).unwrap();
        // vLLM's model_dump(): declared fields first, nulls written out, other keys after.
        let want = json!([{"type": "function", "function": {"name": "f", "description": null, "parameters": {},
            "strict": true}, "x": 1}]);
        assert_eq!(serde_json::to_string(&r.tools).unwrap(), serde_json::to_string(&Some(want)).unwrap());
        for bad in [
            json!([{"type": "function"}]),
            json!([{"name": "f", "parameters": {}}]),
            json!([{"type": "x", "function": {"name": "f"}}]),
        ] {
            let e = Regeneration::parse(&row(json!({"prompt": "p", "tools": bad}))).unwrap_err();
            assert!(e.starts_with("tools[0] is not a tool vLLM's chat endpoint takes"), "{e}");
        }
        assert!(Regeneration::parse(&row(json!({"prompt": "p", "tools": ""}))).unwrap().tools.is_none());
    }

    #[test]
    fn a_conversation_runs_turn_by_turn_and_splices_cached_results() {
        let mut r = Regeneration::parse(&row(json!({"messages": [
            {"role": "system", "content": "s"}, {"role": "user", "content": "u1"},
            {"role": "assistant", "content": "old"},
            {"role": "tool", "content": "<tool_response>{\"name\": \"f\"}</tool_response>"},
            {"role": "user", "content": "u2"},
        ], "tools": [{"type": "function", "function": {"name": "f"}}]})))
        .unwrap();
        let first = r.next_request().unwrap();
        assert_eq!(first, json!([{"role": "system", "content": "s"}, {"role": "user", "content": "u1"}]));
        r.answer(Reply { content: None, tool_calls: vec![call("f")] }, 10, 100).unwrap();
        let second = r.next_request().unwrap();
        assert_eq!(second[2]["tool_calls"][0]["function"]["arguments"], json!({"x": 1}), "parsed for the template");
        assert_eq!(second[2]["content"], "");
        assert_eq!(second[3]["role"], "tool");
        assert_eq!(second[3]["tool_call_id"], "call-f");
        assert_eq!(second.as_array().unwrap().len(), 4, "the same user turn continues");
        r.answer(text("done"), 20, 100).unwrap();
        let third = r.next_request().unwrap();
        assert_eq!(third.as_array().unwrap().last().unwrap(), &json!({"role": "user", "content": "u2"}));
        r.answer(text("bye"), 30, 100).unwrap();
        assert!(r.next_request().is_none());
        assert!(!r.truncated);
        assert_eq!(r.generations, 3);
    }

    #[test]
    fn the_conversation_stops_where_the_tool_stops_it() {
        let base = json!({"messages": [{"role": "user", "content": "u1"}, {"role": "user", "content": "u2"},
            {"role": "tool", "content": "<tool_response>{\"name\": \"f\"}</tool_response>"}]});
        // Prompt + completion past max_tokens (a cut turn always is).
        let mut r = Regeneration::parse(&row(base.clone())).unwrap();
        r.next_request().unwrap();
        r.answer(text("cut"), 101, 100).unwrap();
        assert!(r.next_request().is_none() && r.truncated);
        // A parallel call; a call for another tool; no result left.
        for calls in [vec![call("f"), call("f")], vec![call("g")]] {
            let mut r = Regeneration::parse(&row(base.clone())).unwrap();
            r.next_request().unwrap();
            r.answer(Reply { content: None, tool_calls: calls }, 10, 100).unwrap();
            assert!(r.next_request().is_none() && r.truncated);
        }
        let mut r = Regeneration::parse(&row(base.clone())).unwrap();
        r.next_request().unwrap();
        r.answer(Reply { content: None, tool_calls: vec![call("f")] }, 10, 100).unwrap();
        r.next_request().unwrap();
        r.answer(Reply { content: None, tool_calls: vec![call("f")] }, 10, 100).unwrap();
        assert!(r.next_request().is_none() && r.truncated && r.generations == 2);
        // A wholly empty reply fails the conversation.
        let mut r = Regeneration::parse(&row(base)).unwrap();
        r.next_request().unwrap();
        assert!(r.answer(Reply { content: Some(String::new()), tool_calls: vec![] }, 5, 100).is_err());
    }

    #[test]
    fn hermes_calls_and_reasoning_split_as_vllm_does() {
        let p = ToolParser::Hermes;
        let id = |i: usize| format!("id{i}");
        assert_eq!(p.extract("plain", id), (Some("plain".into()), vec![]));
        let (c, calls) =
            p.extract("pre<tool_call>\n{\"name\": \"f\", \"arguments\": {\"b\": 1, \"a\": \"é\"}}\n</tool_call>", id);
        assert_eq!(c.as_deref(), Some("pre"));
        assert_eq!(calls[0]["function"], json!({"name": "f", "arguments": "{\"b\": 1, \"a\": \"é\"}"}));
        assert_eq!(calls[0]["id"], "id0");
        let (c, calls) = p.extract("<tool_call>{\"name\": \"f\", \"arguments\": {}}</tool_call><tool_call>{\"name\": \"g\", \"arguments\": {}}", id);
        assert_eq!((c, calls.len()), (None, 2), "an unclosed call at the end counts");
        let (c, _) = p.extract("\n\n<tool_call>{\"name\": \"f\", \"arguments\": {}}</tool_call>", id);
        assert_eq!(c, None, "whitespace before a call is no content");
        assert_eq!(p.extract("<tool_call>{bad</tool_call>", id), (Some("<tool_call>{bad</tool_call>".into()), vec![]));
        let q = ReasoningParser::Qwen3;
        assert_eq!(q.split("<think>r</think>c", true), (Some("r".into()), Some("c".into())));
        assert_eq!(q.split("r</think>", true), (Some("r".into()), None));
        assert_eq!(q.split("all", true), (Some("all".into()), None));
        assert_eq!(q.split("all", false), (None, Some("all".into())));
        assert_eq!(ReasoningParser::DeepSeekR1.split("all", false), (Some("all".into()), None));
    }

    #[test]
    fn primary_ids_follow_the_tool() {
        assert_eq!(primary_id(&row(json!({"id": "a", "uuid": "b"}))), "a");
        assert_eq!(primary_id(&row(json!({"id": "", "uuid": 7}))), "7");
        // hashlib.sha256(json.dumps({"b": [1, {"d": "é", "c": null}], "a": 1.5}, sort_keys=True,
        // ensure_ascii=False).encode()).hexdigest(), computed with Python 3.
        let h = primary_id(&row(json!({"b": [1, {"d": "é", "c": null}], "a": 1.5})));
        assert_eq!(
            python_dumps(&sorted(&json!({"b": [1, {"d": "é", "c": null}], "a": 1.5}))),
            r#"{"a": 1.5, "b": [1, {"c": null, "d": "é"}]}"#
        );
        assert!(h.starts_with("hash_") && h.len() == 5 + 64, "{h}");
        assert_eq!(h, format!("hash_{}", PY_HASH));
    }

    /// The digest Python gives for the row in `primary_ids_follow_the_tool`.
    const PY_HASH: &str = "bb75f64e8dbb70e3ee13d6fc976e257a699d19bc9497759c539e6d9fcb3b608b";
}
