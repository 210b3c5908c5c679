//! The OpenAI-compatible requests and replies `strata serve` speaks, as the
//! speculators trainer's client sends and reads them (vLLM's shapes): token
//! ids in, `prompt_token_ids` and `kv_transfer_params.hidden_states_path`
//! out. Every malformed request is a 4xx whose body names the problem.

use serde_json::{json, Value};

/// An error reply: an HTTP status and an OpenAI-style body.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ApiError {
    /// The HTTP status.
    pub status: u16,
    /// The error's `type` (OpenAI's class names, as vLLM sends them).
    pub kind: &'static str,
    /// What is wrong, in a sentence.
    pub message: String,
    /// The request field at fault, if one is.
    pub param: Option<&'static str>,
}

impl ApiError {
    /// 400: the request is wrong.
    pub fn bad(message: impl Into<String>, param: Option<&'static str>) -> Self {
        ApiError { status: 400, kind: "BadRequestError", message: message.into(), param }
    }
    /// 401: `--api-key` is set and the request did not carry it.
    pub fn unauthorized() -> Self {
        ApiError {
            status: 401,
            kind: "AuthenticationError",
            message: "this server requires an API key: send the header `Authorization: Bearer KEY` with the key \
                      strata serve was started with (--api-key or STRATA_API_KEY)"
                .into(),
            param: None,
        }
    }
    /// 400 to a client that closed its sending side before its reply: its
    /// request was dropped (answered in case it can still read).
    pub fn client_closed() -> Self {
        ApiError::bad(
            "the client closed its sending side before the reply (a half-close, or it hung up): strata serve \
             takes that as a client that has gone, as vLLM and nginx do: the request was dropped, its file (if \
             any) removed; keep the connection open until the reply arrives",
            None,
        )
    }
    /// 404.
    pub fn not_found(message: impl Into<String>) -> Self {
        ApiError { status: 404, kind: "NotFoundError", message: message.into(), param: None }
    }
    /// 405.
    pub fn method(message: impl Into<String>) -> Self {
        ApiError { status: 405, kind: "MethodNotAllowed", message: message.into(), param: None }
    }
    /// 408: the body did not arrive in time.
    pub fn timeout(message: impl Into<String>) -> Self {
        ApiError { status: 408, kind: "RequestTimeout", message: message.into(), param: None }
    }
    /// 413: the body is larger than any valid request.
    pub fn too_large(message: impl Into<String>) -> Self {
        ApiError { status: 413, kind: "RequestEntityTooLarge", message: message.into(), param: None }
    }
    /// 500: the server failed this request (and goes on).
    pub fn internal(message: impl Into<String>) -> Self {
        ApiError { status: 500, kind: "InternalServerError", message: message.into(), param: None }
    }
    /// A failed forward step or state collection, `what` in the message,
    /// answered by the error's kind. Every kind is the server's failure, a
    /// 500 that it answers and goes on from: input the model cannot take
    /// (`Input`) was refused with a 400 before the request was queued
    /// (empty, too long, ids outside the vocabulary), so one that reaches a
    /// step is a scheduling fault, and the step's error goes to every
    /// request in it. The match names each kind, so a new one is placed here.
    pub fn from_model(what: &str, e: &crate::model::ModelError) -> Self {
        use crate::model::ModelError;
        let message = format!("{what} failed: {e}");
        match e {
            ModelError::Input { .. }
            | ModelError::Device(_)
            | ModelError::Unsupported(_)
            | ModelError::NoLmHead(_)
            | ModelError::Rank(_)
            | ModelError::Shape(_)
            | ModelError::Split(_)
            | ModelError::Options(_)
            | ModelError::Config(_)
            | ModelError::Checkpoint(_)
            | ModelError::Capture(_) => ApiError::internal(message),
        }
    }
    /// 503: not now (loading, full, stopping).
    pub fn unavailable(message: impl Into<String>) -> Self {
        ApiError { status: 503, kind: "ServiceUnavailableError", message: message.into(), param: None }
    }

    /// The JSON body: `{"error": {"message", "type", "param", "code"}}`.
    pub fn body(&self) -> String {
        json!({"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.status}})
            .to_string()
    }
}

/// What requests are checked against.
#[derive(Clone, Debug)]
pub struct Limits {
    /// The name `/v1/models` lists; a request naming another model is a 404.
    pub model: String,
    /// Token ids must be below this.
    pub vocab_size: usize,
    /// A prompt may have at most this many tokens.
    pub max_tokens: usize,
    /// Where that limit comes from, for messages.
    pub max_tokens_from: String,
}

fn parse_object(body: &[u8]) -> Result<serde_json::Map<String, Value>, ApiError> {
    match serde_json::from_slice::<Value>(body) {
        Ok(Value::Object(m)) => Ok(m),
        Ok(other) => Err(ApiError::bad(format!("the request body must be a JSON object, got {}", kind(&other)), None)),
        Err(e) => Err(ApiError::bad(format!("the request body is not JSON: {e}"), None)),
    }
}

fn kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "a list",
        Value::Object(_) => "an object",
    }
}

/// What a request asks of the engine: its prompt's states (`max_tokens`
/// 1, the speculators trainer's request: a file, nothing drawn), or a
/// generation.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Ask {
    /// `max_tokens` (or `max_completion_tokens`); `None`: not given (a chat
    /// request then runs to the model's last position, as vLLM's does).
    pub max_tokens: Option<usize>,
    /// The sampling fields the request gave; the rest come from the
    /// server's defaults (`generation_config.json`, then vLLM's).
    pub sampling: crate::generate::AskedSampling,
    /// `seed`: the draws are keyed by it (a drawn one when not given).
    pub seed: Option<u64>,
    /// `stop_token_ids`: stop ids besides EOS.
    pub stop_token_ids: Vec<u32>,
    /// `ignore_eos`.
    pub ignore_eos: bool,
    /// `skip_special_tokens` (default true): special tokens out of the text.
    pub skip_special_tokens: bool,
    /// `return_token_ids`: the prompt's and the reply's ids in the reply.
    pub return_token_ids: bool,
    /// `kv_transfer_params.include_output_tokens`: a generation writes the
    /// states of its prompt and of every generated token but the last (vLLM's contract).
    pub include_output_tokens: bool,
}

impl Ask {
    /// Whether this is the trainer's request: the prompt's states, nothing drawn.
    pub fn is_prefill(&self) -> bool {
        self.max_tokens == Some(1)
    }
}

/// Fields that change what a reply holds and that strata serve does not
/// apply: refused by name rather than ignored (vLLM ignores only fields it
/// does not know).
const NOT_APPLIED: &[(&str, &str)] = &[
    ("logit_bias", "logit biases"),
    ("logprobs", "log probabilities"),
    ("top_logprobs", "log probabilities"),
    ("prompt_logprobs", "log probabilities"),
    ("response_format", "structured output"),
    ("structured_outputs", "structured output"),
    ("guided_json", "structured output"),
    ("guided_regex", "structured output"),
    ("guided_choice", "structured output"),
    ("guided_grammar", "structured output"),
    ("bad_words", "banned words"),
    ("allowed_token_ids", "a token allow-list"),
    ("stop", "stop strings (stop_token_ids are applied)"),
    ("min_tokens", "min_tokens"),
    ("include_stop_str_in_output", "include_stop_str_in_output"),
    ("echo", "echo"),
    ("suffix", "a suffix"),
    ("best_of", "best_of"),
    ("use_beam_search", "beam search"),
    ("length_penalty", "beam search"),
];

/// Whether `v` leaves a field at its default (absent, null, false, 0, empty).
fn unset(v: &Value) -> bool {
    match v {
        Value::Null | Value::Bool(false) => true,
        Value::Number(n) => n.as_f64() == Some(0.0),
        Value::String(s) => s.is_empty(),
        Value::Array(a) => a.is_empty(),
        Value::Object(o) => o.is_empty(),
        Value::Bool(true) => false,
    }
}

/// The fields both endpoints check alike: the model, and what is asked
/// (the trainer's `max_tokens: 1`, or a generation: one completion, no stream).
fn check_common(m: &serde_json::Map<String, Value>, limits: &Limits) -> Result<Ask, ApiError> {
    match m.get("model") {
        None | Some(Value::Null) => {}
        Some(Value::String(s)) if *s == limits.model => {}
        Some(Value::String(s)) => {
            return Err(ApiError::not_found(format!(
                "The model `{}` does not exist: this server serves `{}` (its --served-model-name)",
                crate::clip(s, crate::QUOTE_MAX),
                limits.model
            )))
        }
        Some(other) => {
            return Err(ApiError::bad(format!("`model` must be a string, got {}", kind(other)), Some("model")))
        }
    }
    if let Some((field, what)) = NOT_APPLIED.iter().find(|(f, _)| m.get(*f).is_some_and(|v| !unset(v))) {
        return Err(ApiError::bad(
            format!("`{field}` is not applied by strata serve ({what}): leave it out, or use vLLM for it"),
            Some(field),
        ));
    }
    if m.get("stream").is_some_and(|v| v.as_bool() == Some(true)) {
        return Err(ApiError::bad("streaming is not served: send stream false (or leave it out)", Some("stream")));
    }
    if let Some(n) = m.get("n").filter(|v| !v.is_null() && v.as_u64() != Some(1)) {
        return Err(ApiError::bad(format!("n is {n}: one completion per request is served"), Some("n")));
    }
    let number = |k: &'static str| -> Result<Option<f64>, ApiError> {
        match m.get(k) {
            None | Some(Value::Null) => Ok(None),
            Some(Value::Number(n)) => Ok(n.as_f64()),
            Some(other) => Err(ApiError::bad(format!("`{k}` must be a number, got {}", kind(other)), Some(k))),
        }
    };
    let count = |k: &'static str| -> Result<Option<u64>, ApiError> {
        match m.get(k) {
            None | Some(Value::Null) => Ok(None),
            Some(v) => v.as_u64().map(Some).ok_or_else(|| {
                ApiError::bad(
                    format!("`{k}` must be a non-negative integer, got {}", crate::clip(&v.to_string(), 40)),
                    Some(k),
                )
            }),
        }
    };
    let flag = |k: &'static str, default: bool| match m.get(k) {
        None | Some(Value::Null) => Ok(default),
        Some(Value::Bool(b)) => Ok(*b),
        Some(other) => Err(ApiError::bad(format!("`{k}` must be a boolean, got {}", kind(other)), Some(k))),
    };
    let max_tokens = match count("max_tokens")?.or(count("max_completion_tokens")?) {
        Some(0) => return Err(ApiError::bad("max_tokens must be at least 1, got 0", Some("max_tokens"))),
        n => n.map(|n| n.min(usize::MAX as u64) as usize),
    };
    let top_k = match m.get("top_k") {
        None | Some(Value::Null) => None,
        Some(v) => Some(v.as_i64().ok_or_else(|| {
            ApiError::bad(format!("`top_k` must be an integer, got {}", crate::clip(&v.to_string(), 40)), Some("top_k"))
        })?),
    };
    let stop_token_ids = match m.get("stop_token_ids") {
        None | Some(Value::Null) => vec![],
        Some(Value::Array(a)) => a
            .iter()
            .map(|v| v.as_u64().filter(|&id| (id as usize) < limits.vocab_size).map(|id| id as u32))
            .collect::<Option<Vec<u32>>>()
            .ok_or_else(|| {
                ApiError::bad(
                    format!("`stop_token_ids` must be token ids below the vocabulary size {}", limits.vocab_size),
                    Some("stop_token_ids"),
                )
            })?,
        Some(other) => {
            return Err(ApiError::bad(
                format!("`stop_token_ids` must be a list, got {}", kind(other)),
                Some("stop_token_ids"),
            ))
        }
    };
    let include_output_tokens = match m.get("kv_transfer_params").and_then(|p| p.get("include_output_tokens")) {
        None | Some(Value::Null) => false,
        Some(Value::Bool(b)) => *b,
        Some(other) => {
            return Err(ApiError::bad(
                format!("kv_transfer_params.include_output_tokens must be a boolean, got {}", kind(other)),
                Some("kv_transfer_params"),
            ))
        }
    };
    let f32_of = |k| number(k).map(|v| v.map(|x| x as f32));
    Ok(Ask {
        max_tokens,
        sampling: crate::generate::AskedSampling {
            temperature: f32_of("temperature")?,
            top_p: f32_of("top_p")?,
            top_k,
            min_p: f32_of("min_p")?,
            repetition_penalty: f32_of("repetition_penalty")?,
            presence_penalty: f32_of("presence_penalty")?,
            frequency_penalty: f32_of("frequency_penalty")?,
        },
        seed: match m.get("seed") {
            None | Some(Value::Null) => None,
            // vLLM takes any integer; a negative one is its bits.
            Some(v) => Some(v.as_i64().map(|s| s as u64).or(v.as_u64()).ok_or_else(|| {
                ApiError::bad(
                    format!("`seed` must be an integer, got {}", crate::clip(&v.to_string(), 40)),
                    Some("seed"),
                )
            })?),
        },
        stop_token_ids,
        ignore_eos: flag("ignore_eos", false)?,
        skip_special_tokens: flag("skip_special_tokens", true)?,
        return_token_ids: flag("return_token_ids", false)?,
        include_output_tokens,
    })
}

/// Checks token ids against the vocabulary and the length limit.
pub fn check_ids(ids: &[u32], limits: &Limits, field: &'static str) -> Result<(), ApiError> {
    if ids.is_empty() {
        return Err(ApiError::bad(format!("the {field} is empty: send at least one token id"), Some(field)));
    }
    if ids.len() > limits.max_tokens {
        return Err(ApiError::bad(
            format!(
                "the {field} has {} tokens, more than the model takes: at most {} ({})",
                ids.len(),
                limits.max_tokens,
                limits.max_tokens_from
            ),
            Some(field),
        ));
    }
    if let Some((i, id)) = ids.iter().enumerate().find(|(_, &id)| id as usize >= limits.vocab_size) {
        return Err(ApiError::bad(
            format!(
                "token id {id} at {field}[{i}] is outside the vocabulary (vocab_size {}: ids 0 to {})",
                limits.vocab_size,
                limits.vocab_size - 1
            ),
            Some(field),
        ));
    }
    Ok(())
}

/// A completion's prompt: token ids (checked), or text for the model's tokenizer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Prompt {
    /// Token ids.
    Ids(Vec<u32>),
    /// Text, tokenized as vLLM's completions endpoint does (the tokenizer's special tokens added).
    Text(String),
}

/// A `POST /v1/completions` body: its prompt and what it asks (`max_tokens`
/// defaults to 16, OpenAI's and vLLM's default for this endpoint).
pub fn parse_completion(body: &[u8], limits: &Limits) -> Result<(Prompt, Ask), ApiError> {
    let m = parse_object(body)?;
    let mut ask = check_common(&m, limits)?;
    ask.max_tokens.get_or_insert(16);
    let prompt = match m.get("prompt") {
        None | Some(Value::Null) => {
            return Err(ApiError::bad("the request has no prompt: send token ids or text", Some("prompt")))
        }
        Some(Value::String(text)) if text.is_empty() => {
            return Err(ApiError::bad("the prompt is empty: send at least one token id or some text", Some("prompt")))
        }
        Some(Value::String(text)) => return Ok((Prompt::Text(text.clone()), ask)),
        Some(Value::Array(a)) => a,
        Some(other) => {
            return Err(ApiError::bad(
                format!("the prompt must be a list of token ids, got {}", kind(other)),
                Some("prompt"),
            ))
        }
    };
    if let Some(first) = prompt.first().filter(|v| v.is_array() || v.is_string()) {
        return Err(ApiError::bad(
            format!(
                "a batch of prompts ({} {}) is not served: send one prompt of token ids per request",
                prompt.len(),
                if first.is_array() { "lists of token ids" } else { "strings" }
            ),
            Some("prompt"),
        ));
    }
    let mut ids = Vec::with_capacity(prompt.len());
    for (i, v) in prompt.iter().enumerate() {
        match v.as_u64() {
            Some(id) if id <= u32::MAX as u64 => ids.push(id as u32),
            Some(id) => {
                return Err(ApiError::bad(
                    format!(
                        "token id {id} at prompt[{i}] is outside the vocabulary (vocab_size {})",
                        limits.vocab_size
                    ),
                    Some("prompt"),
                ))
            }
            None => {
                return Err(ApiError::bad(
                    format!(
                        "prompt[{i}] is not a token id (a non-negative integer): got {}",
                        crate::clip(&v.to_string(), 40)
                    ),
                    Some("prompt"),
                ))
            }
        }
    }
    check_ids(&ids, limits, "prompt")?;
    Ok((Prompt::Ids(ids), ask))
}

/// A `POST /v1/chat/completions` body, its text parts joined.
#[derive(Clone, Debug)]
pub struct ChatRequest {
    /// `{role, content}` messages with string contents (and any other fields).
    pub messages: Value,
    /// `tools`, when given.
    pub tools: Option<Value>,
    /// `add_generation_prompt` (default true, as vLLM).
    pub add_generation_prompt: bool,
    /// `continue_final_message` (default false).
    pub continue_final_message: bool,
    /// What it asks.
    pub ask: Ask,
    /// The template's variables of this request: `chat_template_kwargs`, and
    /// `reasoning_effort` when given (vLLM passes both to the template).
    pub kwargs: serde_json::Map<String, Value>,
    /// `tools` with `tool_choice` "auto" (the default): a generation's tool calls are parsed.
    pub auto_tools: bool,
}

/// Parses a chat request: text parts only (joined with newlines, as vLLM
/// joins them for a template that takes string contents); an image, audio
/// or video part is a 400 naming its type.
pub fn parse_chat(body: &[u8], limits: &Limits) -> Result<ChatRequest, ApiError> {
    let mut m = parse_object(body)?;
    let ask = check_common(&m, limits)?;
    let flag = |m: &serde_json::Map<String, Value>, k: &'static str, default: bool| match m.get(k) {
        None | Some(Value::Null) => Ok(default),
        Some(Value::Bool(b)) => Ok(*b),
        Some(other) => Err(ApiError::bad(format!("`{k}` must be a boolean, got {}", kind(other)), Some(k))),
    };
    let add_generation_prompt = flag(&m, "add_generation_prompt", true)?;
    let continue_final_message = flag(&m, "continue_final_message", false)?;
    if add_generation_prompt && continue_final_message {
        return Err(ApiError::bad(
            "continue_final_message and add_generation_prompt cannot both be true: a final message is either \
             continued or followed by a new turn's prompt",
            Some("continue_final_message"),
        ));
    }
    let Some(Value::Array(mut messages)) = m.remove("messages") else {
        return Err(ApiError::bad("`messages` must be a list of {role, content} objects", Some("messages")));
    };
    if messages.is_empty() {
        return Err(ApiError::bad("`messages` is empty", Some("messages")));
    }
    for (i, msg) in messages.iter_mut().enumerate() {
        let Value::Object(msg) = msg else {
            return Err(ApiError::bad(format!("messages[{i}] must be an object"), Some("messages")));
        };
        // As vLLM hands history to the template: an empty tool_calls list dropped, each call's
        // `arguments` parsed from its JSON text into an object.
        if msg.get("tool_calls").is_some_and(|c| c.as_array().is_some_and(|a| a.is_empty())) {
            msg.remove("tool_calls");
        }
        if let Some(Value::Array(calls)) = msg.get_mut("tool_calls") {
            for (j, call) in calls.iter_mut().enumerate() {
                let Some(Value::String(text)) = call.get("function").and_then(|f| f.get("arguments")) else { continue };
                let parsed: Value = serde_json::from_str(text).map_err(|e| {
                    ApiError::bad(
                        format!("messages[{i}].tool_calls[{j}].function.arguments is not JSON: {e}"),
                        Some("messages"),
                    )
                })?;
                call["function"]["arguments"] = parsed;
            }
        }
        let text = match msg.get("content") {
            None | Some(Value::Null) | Some(Value::String(_)) => continue,
            Some(Value::Array(parts)) => {
                let mut texts = Vec::with_capacity(parts.len());
                for (j, part) in parts.iter().enumerate() {
                    let ty = part.get("type").and_then(Value::as_str).unwrap_or("");
                    match (ty, part.get("text")) {
                        ("text", Some(Value::String(t))) => texts.push(t.as_str()),
                        ("text", _) => {
                            return Err(ApiError::bad(
                                format!("messages[{i}].content[{j}] is a text part without a string `text`"),
                                Some("messages"),
                            ))
                        }
                        ("", _) => {
                            return Err(ApiError::bad(
                                format!("messages[{i}].content[{j}] has no `type`"),
                                Some("messages"),
                            ))
                        }
                        (other, _) => {
                            return Err(ApiError::bad(
                                format!(
                                    "messages[{i}].content[{j}] is a `{}` part: only text is served (the models \
                                     strata runs read no images, audio or video)",
                                    crate::clip(other, 40)
                                ),
                                Some("messages"),
                            ))
                        }
                    }
                }
                texts.join("\n")
            }
            Some(other) => {
                return Err(ApiError::bad(
                    format!("messages[{i}].content must be a string or a list of parts, got {}", kind(other)),
                    Some("messages"),
                ))
            }
        };
        msg.insert("content".into(), Value::String(text));
    }
    let tools = m.remove("tools").filter(|t| !t.is_null());
    let auto_tools = match m.get("tool_choice") {
        None | Some(Value::Null) => tools.is_some(),
        Some(Value::String(c)) if c == "auto" => tools.is_some(),
        Some(Value::String(c)) if c == "none" => false,
        Some(other) => {
            return Err(ApiError::bad(
                format!(
                    "tool_choice {}: only \"auto\" and \"none\" are applied (a required or named tool choice is \
                     structured output, which strata serve does not apply)",
                    crate::clip(&other.to_string(), 60)
                ),
                Some("tool_choice"),
            ))
        }
    };
    let mut kwargs = match m.remove("chat_template_kwargs") {
        None | Some(Value::Null) => serde_json::Map::new(),
        Some(Value::Object(o)) => o,
        Some(other) => {
            return Err(ApiError::bad(
                format!("`chat_template_kwargs` must be an object, got {}", kind(&other)),
                Some("chat_template_kwargs"),
            ))
        }
    };
    match m.remove("reasoning_effort") {
        None | Some(Value::Null) => {}
        Some(Value::String(e)) => {
            kwargs.insert("reasoning_effort".into(), Value::String(e));
        }
        Some(other) => {
            return Err(ApiError::bad(
                format!("`reasoning_effort` must be a string, got {}", kind(&other)),
                Some("reasoning_effort"),
            ))
        }
    }
    Ok(ChatRequest {
        messages: Value::Array(messages),
        tools,
        add_generation_prompt,
        continue_final_message,
        ask,
        kwargs,
        auto_tools,
    })
}

fn now_secs() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

/// `GET /v1/models`.
pub fn models_reply(model: &str, max_model_len: usize) -> String {
    json!({"object": "list", "data": [{
        "id": model, "object": "model", "created": now_secs(), "owned_by": "strata", "root": model,
        "parent": null, "max_model_len": max_model_len
    }]})
    .to_string()
}

/// A completion's reply: vLLM's shape, with `choices[0].prompt_token_ids`
/// and the file in `kv_transfer_params.hidden_states_path`.
pub fn completion_reply(id: &str, model: &str, ids: &[u32], path: &str) -> String {
    json!({
        "id": format!("cmpl-{id}"), "object": "text_completion", "created": now_secs(), "model": model,
        "choices": [{"index": 0, "text": "", "logprobs": null, "finish_reason": "length", "stop_reason": null,
                     "token_ids": [], "prompt_logprobs": null, "prompt_token_ids": ids}],
        "usage": {"prompt_tokens": ids.len(), "total_tokens": ids.len(), "completion_tokens": 0},
        "kv_transfer_params": {"hidden_states_path": path},
    })
    .to_string()
}

/// A chat completion's reply: `prompt_token_ids` at the top level (where vLLM puts it for chat).
pub fn chat_reply(id: &str, model: &str, ids: &[u32], path: &str) -> String {
    json!({
        "id": format!("chatcmpl-{id}"), "object": "chat.completion", "created": now_secs(), "model": model,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": ""}, "logprobs": null,
                     "finish_reason": "length", "stop_reason": null, "token_ids": []}],
        "usage": {"prompt_tokens": ids.len(), "total_tokens": ids.len(), "completion_tokens": 0},
        "prompt_token_ids": ids,
        "kv_transfer_params": {"hidden_states_path": path},
    })
    .to_string()
}

/// A finished generation, for its reply.
#[derive(Clone, Debug)]
pub struct Generation<'a> {
    /// The request's id (hex).
    pub id: &'a str,
    /// The served model's name.
    pub model: &'a str,
    /// The prompt's ids.
    pub prompt: &'a [u32],
    /// The tokens drawn (a stop token included).
    pub output: &'a [u32],
    /// The reply's text (the stop token left out): a completion's `text`.
    pub text: String,
    /// A chat reply's `content`: the text, less its reasoning and tool calls
    /// where the server's parsers take them (`None`: null).
    pub content: Option<String>,
    /// The reasoning (`--reasoning-parser`): `reasoning` and `reasoning_content`.
    pub reasoning: Option<String>,
    /// Tool calls read (`--tool-call-parser`).
    pub tool_calls: Vec<Value>,
    /// `stop`, `length` or `tool_calls`.
    pub finish: &'static str,
    /// The id of a `stop_token_ids` token that ended it (vLLM's
    /// `stop_reason`; null for EOS and length).
    pub stop_reason: Option<u32>,
    /// `return_token_ids`.
    pub return_token_ids: bool,
    /// The states file (`include_output_tokens`).
    pub path: Option<&'a str>,
}

impl Generation<'_> {
    fn transfer(&self) -> Value {
        self.path.map_or(Value::Null, |p| json!({"hidden_states_path": p}))
    }
    fn usage(&self) -> Value {
        let (p, c) = (self.prompt.len(), self.output.len());
        json!({"prompt_tokens": p, "total_tokens": p + c, "completion_tokens": c, "prompt_tokens_details": null})
    }
    fn ids<'b>(&self, ids: &'b [u32]) -> Option<&'b [u32]> {
        self.return_token_ids.then_some(ids)
    }
}

/// A generation's reply on `/v1/completions`, in vLLM's layout (the ids
/// inside the choice with `return_token_ids`).
pub fn completion_generation_reply(g: &Generation<'_>) -> String {
    json!({
        "id": format!("cmpl-{}", g.id), "object": "text_completion", "created": now_secs(), "model": g.model,
        "choices": [{"index": 0, "text": g.text, "logprobs": null, "finish_reason": g.finish,
                     "stop_reason": g.stop_reason, "token_ids": g.ids(g.output), "prompt_logprobs": null,
                     "prompt_token_ids": g.ids(g.prompt)}],
        "service_tier": null, "system_fingerprint": null, "usage": g.usage(), "kv_transfer_params": g.transfer(),
    })
    .to_string()
}

/// A generation's reply on `/v1/chat/completions`, in vLLM's layout
/// (`prompt_token_ids` at the top level, the reply's in the choice).
pub fn chat_generation_reply(g: &Generation<'_>) -> String {
    json!({
        "id": format!("chatcmpl-{}", g.id), "object": "chat.completion", "created": now_secs(), "model": g.model,
        "choices": [{"index": 0,
                     "message": {"role": "assistant", "content": g.content, "refusal": null, "annotations": null,
                                 "audio": null, "function_call": null, "tool_calls": g.tool_calls,
                                 "reasoning": g.reasoning, "reasoning_content": g.reasoning},
                     "logprobs": null, "finish_reason": g.finish, "stop_reason": g.stop_reason,
                     "token_ids": g.ids(g.output)}],
        "service_tier": null, "system_fingerprint": null, "usage": g.usage(), "prompt_logprobs": null,
        "prompt_token_ids": g.ids(g.prompt), "kv_transfer_params": g.transfer(),
    })
    .to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_model_error_kind_is_the_servers_500_with_its_message() {
        use crate::model::{DeviceError, ModelError};
        let input = ModelError::Input { sample: 0, problem: "positions 4.. do not continue 0..2".into() };
        let e = ApiError::from_model("the forward step", &input);
        assert_eq!(
            (e.status, e.message.as_str()),
            (500, "the forward step failed: sample 0: positions 4.. do not continue 0..2")
        );
        let device = ModelError::Device(DeviceError::Driver { call: "cuMemAlloc".into(), error: "OOM".into() });
        let e = ApiError::from_model("collecting the step's states", &device);
        assert_eq!((e.status, e.message.as_str()), (500, "collecting the step's states failed: cuMemAlloc: OOM"));
        let e = ApiError::from_model("the forward step", &ModelError::Unsupported("no such op".into()));
        assert_eq!(e.status, 500);
    }

    fn limits() -> Limits {
        Limits { model: "m".into(), vocab_size: 100, max_tokens: 8, max_tokens_from: "--max-seq-len 8".into() }
    }

    fn err(body: &str) -> ApiError {
        parse_completion(body.as_bytes(), &limits()).unwrap_err()
    }

    #[test]
    fn completions_are_checked_and_each_error_names_its_problem() {
        let ok =
            parse_completion(br#"{"model":"m","prompt":[1,2,99],"max_tokens":1,"return_token_ids":true}"#, &limits());
        let (prompt, ask) = ok.unwrap();
        assert_eq!(prompt, Prompt::Ids(vec![1, 2, 99]));
        assert!(ask.is_prefill() && ask.return_token_ids);
        // A generation: OpenAI's default of 16 tokens, its fields as given.
        let (prompt, ask) = parse_completion(
            br#"{"prompt":"hi","temperature":0,"seed":-1,"stop_token_ids":[7],"ignore_eos":true,"top_k":-1}"#,
            &limits(),
        )
        .unwrap();
        assert_eq!(prompt, Prompt::Text("hi".into()));
        assert_eq!(
            (ask.max_tokens, ask.sampling.temperature, ask.seed, ask.sampling.top_k),
            (Some(16), Some(0.0), Some(u64::MAX), Some(-1))
        );
        assert_eq!((ask.stop_token_ids, ask.ignore_eos, ask.skip_special_tokens), (vec![7], true, true));
        let cases = [
            ("{", 400, "not JSON"),
            ("[1]", 400, "JSON object"),
            (r#"{"model":"x","prompt":[1],"max_tokens":1}"#, 404, "`x` does not exist"),
            (r#"{"prompt":"","max_tokens":1}"#, 400, "prompt is empty"),
            (r#"{"prompt":[[1],[2]],"max_tokens":1}"#, 400, "batch of prompts"),
            (r#"{"prompt":["a","b"],"max_tokens":1}"#, 400, "batch of prompts"),
            (r#"{"prompt":[1,100],"max_tokens":1}"#, 400, "token id 100 at prompt[1] is outside the vocabulary"),
            (r#"{"prompt":[1,-3],"max_tokens":1}"#, 400, "prompt[1] is not a token id"),
            (r#"{"prompt":[],"max_tokens":1}"#, 400, "empty"),
            (r#"{"prompt":[1,1,1,1,1,1,1,1,1],"max_tokens":1}"#, 400, "9 tokens, more than the model takes: at most 8"),
            (r#"{"prompt":[1],"max_tokens":0}"#, 400, "at least 1"),
            (r#"{"prompt":[1],"max_tokens":1,"stream":true}"#, 400, "streaming"),
            (r#"{"prompt":[1],"n":2}"#, 400, "one completion per request"),
            (r#"{"prompt":[1],"logit_bias":{"5":3}}"#, 400, "`logit_bias` is not applied"),
            (r#"{"prompt":[1],"response_format":{"type":"json_object"}}"#, 400, "`response_format` is not applied"),
            (r#"{"prompt":[1],"stop":["x"]}"#, 400, "`stop` is not applied"),
            (r#"{"prompt":[1],"stop_token_ids":[100]}"#, 400, "below the vocabulary size"),
            (r#"{"prompt":[1],"temperature":"hot"}"#, 400, "`temperature` must be a number"),
            (
                r#"{"prompt":[1],"max_tokens":4,"kv_transfer_params":{"include_output_tokens":1}}"#,
                400,
                "must be a boolean",
            ),
        ];
        for (body, status, words) in cases {
            let e = err(body);
            assert_eq!(e.status, status, "{body}: {e:?}");
            assert!(e.message.contains(words), "{body}: {}", e.message);
            let v: Value = serde_json::from_str(&e.body()).unwrap();
            assert_eq!(v["error"]["code"], status);
            assert_eq!(v["error"]["message"], e.message);
        }
    }

    #[test]
    fn chat_text_parts_are_joined_and_media_parts_refused_by_type() {
        let body = br#"{"model":"m","max_tokens":1,"messages":[{"role":"user","content":[{"type":"text","text":"a"},{"type":"text","text":"b"}]}],"add_generation_prompt":false}"#;
        let c = parse_chat(body, &limits()).unwrap();
        assert_eq!(c.messages[0]["content"], "a\nb");
        assert!(!c.add_generation_prompt && !c.continue_final_message);
        let body = br#"{"max_tokens":1,"messages":[{"role":"user","content":[{"type":"image_url","image_url":{"url":"file:///x.png"}}]}]}"#;
        let e = parse_chat(body, &limits()).unwrap_err();
        assert_eq!(e.status, 400);
        assert!(e.message.contains("`image_url` part"), "{}", e.message);
        let body = br#"{"max_tokens":1,"messages":[{"role":"user","content":"x"}],"add_generation_prompt":true,"continue_final_message":true}"#;
        assert_eq!(parse_chat(body, &limits()).unwrap_err().status, 400);
        // Fields left at their defaults are no refusal; tools on a generation need a parser.
        let body = br#"{"messages":[{"role":"user","content":"x"}],"logprobs":false,"stop":null,"stream":false}"#;
        assert_eq!(parse_chat(body, &limits()).unwrap().ask.max_tokens, None);
        let body =
            br#"{"messages":[{"role":"user","content":"x"}],"tools":[{"type":"function","function":{"name":"f"}}]}"#;
        assert!(parse_chat(body, &limits()).unwrap().auto_tools);
        let body = br#"{"messages":[{"role":"user","content":"x"}],"tools":[],"tool_choice":"required"}"#;
        assert!(parse_chat(body, &limits()).unwrap_err().message.contains("structured output"));
        // History: arguments parsed, an empty tool_calls dropped, malformed arguments named.
        let body = br#"{"messages":[{"role":"user","content":"x"},{"role":"assistant","content":"","tool_calls":[{"id":"a","type":"function","function":{"name":"f","arguments":"{\"c\": 1}"}}]},{"role":"assistant","content":"y","tool_calls":[]}],"chat_template_kwargs":{"enable_thinking":false},"reasoning_effort":"low"}"#;
        let c = parse_chat(body, &limits()).unwrap();
        assert_eq!(c.messages[1]["tool_calls"][0]["function"]["arguments"], json!({"c": 1}));
        assert!(c.messages[2].get("tool_calls").is_none());
        assert_eq!(Value::Object(c.kwargs), json!({"enable_thinking": false, "reasoning_effort": "low"}));
        let body = br#"{"messages":[{"role":"assistant","content":"","tool_calls":[{"function":{"name":"f","arguments":"{oops"}}]}]}"#;
        assert!(parse_chat(body, &limits())
            .unwrap_err()
            .message
            .contains("messages[0].tool_calls[0].function.arguments"));
    }

    #[test]
    fn the_reply_carries_what_the_trainer_reads() {
        let v: Value = serde_json::from_str(&completion_reply("1", "m", &[5, 6], "/d/f.safetensors")).unwrap();
        assert_eq!(v["choices"][0]["prompt_token_ids"], json!([5, 6]));
        assert_eq!(v["choices"][0]["finish_reason"], "length");
        assert_eq!(v["choices"][0]["text"], "");
        assert_eq!(v["usage"]["prompt_tokens"], 2);
        assert_eq!(v["kv_transfer_params"]["hidden_states_path"], "/d/f.safetensors");
        let v: Value = serde_json::from_str(&chat_reply("1", "m", &[5], "/p")).unwrap();
        assert_eq!(v["prompt_token_ids"], json!([5]));
    }
}
