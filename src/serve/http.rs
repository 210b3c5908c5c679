//! The HTTP side of `strata serve`: hyper's HTTP/1.1 connections, bounded
//! (connections, header read time, read buffer, body size, body bytes held
//! in total, body read time), `--api-key`, and the five routes. A request's
//! future is dropped by hyper when its connection fails, and its client
//! closing its side is seen by [`Watched`](super::conn::Watched): either
//! way its queued job is dropped before its forward, and a file made for it
//! is removed.

use super::api::{self, ApiError, Limits};
use super::conn::Conn;
use super::engine::{Answer, Engine, GenJob, Job};
use super::metrics::Metrics;
use super::store::{Served, Store};
use crate::chat::Chat;
use bytes::Bytes;
use http_body::Frame;
use http_body_util::BodyExt;
use hyper::body::Incoming;
use hyper::{Method, Request, Response};
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, OnceLock};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};
use tokio::sync::{oneshot, watch, OwnedSemaphorePermit, Semaphore};

/// How long a request body may take to arrive once its headers have; and,
/// before that, how long it may wait for room among the bodies held.
pub const BODY_TIMEOUT: Duration = Duration::from_secs(30);

/// What a loaded server answers with.
pub struct Ready {
    /// The queue and the threads behind it.
    pub engine: Arc<Engine>,
    /// What requests are checked against.
    pub limits: Limits,
    /// The tokenizer and chat template, for `/v1/chat/completions`.
    pub chat: Option<Arc<Chat>>,
    /// Why there is no chat endpoint, when there is none.
    pub no_chat: String,
    /// The bytes of a file of `t` tokens (what a request reserves).
    pub file_bytes: Box<dyn Fn(usize) -> u64 + Send + Sync>,
    /// What generation requests take from the checkpoint; `Err(why)` when
    /// the model cannot generate (its checkpoint has no LM head).
    pub generation: Result<Generation, String>,
    /// `--tool-call-parser`.
    pub tool_call_parser: Option<crate::generate::conversation::ToolParser>,
    /// `--reasoning-parser`.
    pub reasoning_parser: Option<crate::generate::conversation::ReasoningParser>,
    /// `--chat-template-kwargs`: the template variables a request's own go over.
    pub default_kwargs: serde_json::Map<String, serde_json::Value>,
}

/// What generation requests take from the checkpoint.
#[derive(Clone, Debug)]
pub struct Generation {
    /// `generation_config.json`'s sampling defaults, as vLLM's `--generation-config auto` takes them.
    pub defaults: crate::generate::GenerationDefaults,
    /// The EOS ids (`generation_config.json`'s and the tokenizer's): stop ids unless `ignore_eos`.
    pub eos: Vec<u32>,
}

/// `--api-key`: never printed, compared in constant time.
#[derive(Clone)]
pub struct ApiKey(String);

impl ApiKey {
    /// A key; refused when empty (an empty key would let every request through).
    pub fn new(key: String) -> Result<Self, super::ServeError> {
        if key.is_empty() {
            return Err(super::ServeError::EmptyApiKey);
        }
        Ok(ApiKey(key))
    }

    /// Whether an `Authorization` header carries this key (`Bearer KEY`).
    pub fn admits(&self, header: Option<&hyper::header::HeaderValue>) -> bool {
        use subtle::ConstantTimeEq;
        let given = header.map(|h| h.as_bytes()).unwrap_or_default();
        let given = given.strip_prefix(b"Bearer ").unwrap_or(b"");
        // Equal lengths are compared in constant time; a length is no secret worth hiding.
        given.ct_eq(self.0.as_bytes()).into()
    }
}

impl std::fmt::Debug for ApiKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ApiKey(<not shown>)")
    }
}

/// The request bodies held in memory, all connections together: at most
/// `--max-body-bytes` (a body larger than that is read alone).
pub struct Bodies {
    room: Arc<Semaphore>,
    budget: u32,
    metrics: Arc<Metrics>,
}

/// Bytes of bodies held by one request.
struct Held<'a> {
    bodies: &'a Bodies,
    permits: Vec<OwnedSemaphorePermit>,
    bytes: u64,
}

impl Drop for Held<'_> {
    fn drop(&mut self) {
        self.bodies.metrics.body_bytes.fetch_sub(self.bytes, Relaxed);
    }
}

impl Bodies {
    /// Room for `budget` bytes of bodies at once.
    pub fn new(budget: u64, metrics: Arc<Metrics>) -> Self {
        let budget = budget.clamp(1, u32::MAX as u64) as u32;
        Bodies { room: Arc::new(Semaphore::new(budget as usize)), budget, metrics }
    }

    /// Takes room for `bytes` more into `held`, waiting until `until`; `false` when it did not come.
    async fn take(&self, held: &mut Held<'_>, bytes: u64, until: tokio::time::Instant) -> bool {
        // A body larger than the budget is read alone: it takes all of it.
        let n = bytes.min((self.budget as u64).saturating_sub(held.bytes.min(self.budget as u64))) as u32;
        if n > 0 {
            match tokio::time::timeout_at(until, self.room.clone().acquire_many_owned(n)).await {
                Ok(Ok(p)) => held.permits.push(p),
                _ => return false,
            }
        }
        held.bytes += bytes;
        self.metrics.body_bytes.fetch_add(bytes, Relaxed);
        true
    }
}

/// Bodies from this size on are held in memory mapped for them alone.
const MAPPED_FROM: usize = 64 << 10;

/// A request body as it arrives. A large one lives in an anonymous mapping
/// of its own, returned to the system the moment the body is dropped: the
/// `strata` binary keeps freed heap memory for the next forward step
/// (`mallopt`), and bodies must not leave the server holding what a burst
/// of them took.
enum BodyBuf {
    Heap(Vec<u8>),
    Mapped(memmap2::MmapMut, usize),
}

impl BodyBuf {
    /// Room for `declared` bytes, and at most `limit`.
    fn new(declared: usize, limit: usize) -> std::io::Result<Self> {
        if declared >= MAPPED_FROM {
            return Ok(BodyBuf::Mapped(memmap2::MmapMut::map_anon(declared.min(limit))?, 0));
        }
        Ok(BodyBuf::Heap(Vec::with_capacity(declared)))
    }

    fn len(&self) -> usize {
        match self {
            BodyBuf::Heap(v) => v.len(),
            BodyBuf::Mapped(_, n) => *n,
        }
    }

    /// Appends `data`, moving to a mapping of `limit` bytes once the body is large.
    fn extend(&mut self, data: &[u8], limit: usize) -> std::io::Result<()> {
        let len = self.len() + data.len();
        let room = match self {
            BodyBuf::Heap(v) if len < MAPPED_FROM => {
                v.extend_from_slice(data);
                return Ok(());
            }
            BodyBuf::Heap(_) => 0,
            BodyBuf::Mapped(m, _) => m.len(),
        };
        if len > room {
            let mut grown = memmap2::MmapMut::map_anon(limit.max(len))?;
            grown[..self.len()].copy_from_slice(self.as_slice());
            *self = BodyBuf::Mapped(grown, self.len());
        }
        if let BodyBuf::Mapped(m, n) = self {
            m[*n..len].copy_from_slice(data);
            *n = len;
        }
        Ok(())
    }

    fn as_slice(&self) -> &[u8] {
        match self {
            BodyBuf::Heap(v) => v,
            BodyBuf::Mapped(m, n) => &m[..*n],
        }
    }
}

/// What every connection shares.
pub struct Shared {
    /// Set once the model is loaded.
    pub ready: OnceLock<Ready>,
    /// `true` once the server stops admitting.
    pub stopping: watch::Receiver<bool>,
    /// The counters.
    pub metrics: Arc<Metrics>,
    /// The states directory.
    pub store: Arc<Store>,
    /// The name `/v1/models` lists.
    pub model_name: String,
    /// The longest prompt, for `/v1/models`.
    pub max_model_len: usize,
    /// The largest request body taken.
    pub body_limit: usize,
    /// The bodies held, all connections together.
    pub bodies: Bodies,
    /// `--api-key`: every route but `/health` and `/metrics` needs it.
    pub api_key: Option<ApiKey>,
    /// `--max-queue-time`: the longest a request waits for room in the states directory.
    pub queue_time: Duration,
    /// Request ids.
    pub next_id: AtomicU64,
}

/// A response body sent once; while it holds a served file, dropping it
/// before the connection took it removes the file (its client is gone).
/// It keeps its connection busy until sent.
pub struct Reply {
    data: Option<Bytes>,
    file: Option<(Arc<Store>, Arc<Metrics>, Served)>,
    busy: Option<super::conn::Busy>,
}

impl Reply {
    fn text(data: String) -> Self {
        Reply { data: Some(Bytes::from(data)), file: None, busy: None }
    }
}

impl http_body::Body for Reply {
    type Data = Bytes;
    type Error = std::convert::Infallible;

    fn poll_frame(mut self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        // The reply is handed to the connection whole: from here the file is its reader's.
        self.file = None;
        Poll::Ready(self.data.take().map(|d| Ok(Frame::data(d))))
    }

    fn is_end_stream(&self) -> bool {
        self.data.is_none()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        http_body::SizeHint::with_exact(self.data.as_ref().map_or(0, |d| d.len() as u64))
    }
}

impl Drop for Reply {
    fn drop(&mut self) {
        if let Some((store, metrics, served)) = self.file.take() {
            store.remove(&served.name);
            metrics.removed_unclaimed.fetch_add(1, Relaxed);
        }
    }
}

fn json(status: u16, body: String) -> Response<Reply> {
    Response::builder()
        .status(status)
        .header("content-type", "application/json")
        .body(Reply::text(body))
        .expect("a valid response")
}

fn error(metrics: &Metrics, e: ApiError) -> Response<Reply> {
    metrics.reply(e.status);
    let mut r = json(e.status, e.body());
    if e.status == 401 {
        r.headers_mut().insert(hyper::header::WWW_AUTHENTICATE, hyper::header::HeaderValue::from_static("Bearer"));
    }
    r
}

/// Answers one request on `conn`, which stays busy until the reply is sent.
pub async fn handle(
    req: Request<Incoming>,
    shared: Arc<Shared>,
    conn: Arc<Conn>,
) -> Result<Response<Reply>, std::convert::Infallible> {
    let busy = conn.busy();
    let mut r = route(req, &shared, &conn).await;
    r.body_mut().busy = Some(busy);
    Ok(r)
}

async fn route(req: Request<Incoming>, shared: &Arc<Shared>, conn: &Arc<Conn>) -> Response<Reply> {
    let m = &shared.metrics;
    let path = req.uri().path().to_string();
    let method = req.method().clone();
    // With a key, every route but the two a load balancer or a scraper probes needs it, unknown ones too.
    if let Some(key) = &shared.api_key {
        if !matches!(path.as_str(), "/health" | "/metrics")
            && !key.admits(req.headers().get(hyper::header::AUTHORIZATION))
        {
            return error(m, ApiError::unauthorized());
        }
    }
    // HEAD is GET without the body (hyper sends none).
    let get = method == Method::GET || method == Method::HEAD;
    match (get, method == Method::POST, path.as_str()) {
        (true, _, "/health") => match (shared.ready.get(), *shared.stopping.borrow()) {
            (Some(_), false) => json(200, String::new()),
            (None, _) => error(m, ApiError::unavailable("the model is loading")),
            (_, true) => error(m, ApiError::unavailable("the server is stopping")),
        },
        (true, _, "/metrics") => Response::builder()
            .status(200)
            .header("content-type", "text/plain; version=0.0.4; charset=utf-8")
            .body(Reply::text(m.render()))
            .expect("a valid response"),
        (true, _, "/v1/models") => json(200, api::models_reply(&shared.model_name, shared.max_model_len)),
        (_, true, "/v1/completions") => match completion(req, shared, conn, false).await {
            Ok(r) => r,
            Err(e) => error(m, e),
        },
        (_, true, "/v1/chat/completions") => match completion(req, shared, conn, true).await {
            Ok(r) => r,
            Err(e) => error(m, e),
        },
        (_, _, "/health" | "/metrics" | "/v1/models" | "/v1/completions" | "/v1/chat/completions") => {
            error(m, ApiError::method(format!("{method} is not served on {path}")))
        }
        _ => error(
            m,
            ApiError::not_found(format!(
                "no route {}: strata serve answers GET /health, /metrics, /v1/models and POST /v1/completions, \
                 /v1/chat/completions",
                crate::clip(&path, crate::QUOTE_MAX)
            )),
        ),
    }
}

/// Reads the body: a `Content-Length` over `limit` is refused at once; room
/// among the bodies held is waited for up to [`BODY_TIMEOUT`]; the body must
/// then arrive within [`BODY_TIMEOUT`] more.
async fn read_body<'a>(
    req: Request<Incoming>,
    shared: &'a Shared,
    conn: &Conn,
) -> Result<(BodyBuf, Held<'a>), ApiError> {
    let limit = shared.body_limit;
    let too_large = |what: String| {
        ApiError::too_large(format!(
            "the request body is {what}, over {limit} bytes: more than a prompt of the longest length this server takes"
        ))
    };
    let declared = match req.headers().get(hyper::header::CONTENT_LENGTH) {
        Some(v) => Some(
            v.to_str()
                .ok()
                .and_then(|s| s.trim().parse::<u64>().ok())
                .ok_or_else(|| ApiError::bad("the Content-Length header is not a number", None))?,
        ),
        None => None,
    };
    if let Some(n) = declared.filter(|&n| n > limit as u64) {
        return Err(too_large(format!("declared as {n} bytes (Content-Length)")));
    }
    let bodies = &shared.bodies;
    let mut held = Held { bodies, permits: Vec::new(), bytes: 0 };
    let full = || {
        ApiError::unavailable(format!(
            "the request bodies being received fill --max-body-bytes ({} bytes) and none finished within {} s; \
             try again",
            bodies.budget,
            BODY_TIMEOUT.as_secs()
        ))
    };
    let declared = declared.unwrap_or(0) as usize;
    if !bodies.take(&mut held, declared as u64, tokio::time::Instant::now() + BODY_TIMEOUT).await {
        return Err(full());
    }
    let mut body = req.into_body();
    let no_memory = |e: std::io::Error| ApiError::unavailable(format!("no memory for the request body: {e}"));
    let mut data = BodyBuf::new(declared, limit).map_err(no_memory)?;
    let mut until = tokio::time::Instant::now() + BODY_TIMEOUT;
    let timeout = || ApiError::timeout(format!("the request body did not arrive within {} s", BODY_TIMEOUT.as_secs()));
    loop {
        // Once the client has closed its side, what it sent is already here: a body
        // still short a moment later never ends (its end is held back from hyper).
        if conn.is_closed_by_client() {
            until = until.min(tokio::time::Instant::now() + Duration::from_secs(1));
        }
        let next = tokio::select! {
            f = tokio::time::timeout_at(until, body.frame()) => f,
            _ = conn.closed_by_client(), if !conn.is_closed_by_client() => continue,
        };
        let frame = match next {
            Err(_) if conn.is_closed_by_client() => {
                return Err(ApiError::bad("the client closed its sending side before the request body ended", None))
            }
            Err(_) => return Err(timeout()),
            Ok(None) => break,
            Ok(Some(Err(e))) => return Err(ApiError::bad(format!("the request body could not be read: {e}"), None)),
            Ok(Some(Ok(f))) => f,
        };
        let Ok(chunk) = frame.into_data() else { continue };
        if data.len() + chunk.len() > limit {
            return Err(too_large(format!("more than {limit} bytes")));
        }
        // A body without a Content-Length takes its room as it comes.
        let beyond = (data.len() + chunk.len()).saturating_sub(held.bytes as usize);
        if beyond > 0 && !bodies.take(&mut held, beyond as u64, until).await {
            return Err(full());
        }
        data.extend(&chunk, limit).map_err(no_memory)?;
    }
    Ok((data, held))
}

async fn completion(
    req: Request<Incoming>,
    shared: &Arc<Shared>,
    conn: &Arc<Conn>,
    chat: bool,
) -> Result<Response<Reply>, ApiError> {
    let admitted = Instant::now();
    let Some(ready) = shared.ready.get() else { return Err(ApiError::unavailable("the model is loading")) };
    if *shared.stopping.borrow() {
        return Err(ApiError::unavailable("the server is stopping"));
    }
    let (body, held) = read_body(req, shared, conn).await?;
    // A client that has closed its side (or closes it before the reply) drops its request.
    let m = &shared.metrics;
    let gone = || json(400, ApiError::client_closed().body());
    let id = shared.next_id.fetch_add(1, Relaxed);
    let span = tracing::info_span!("request", id, chat, tokens = tracing::field::Empty);
    // A chat request's reading of its reply: whether tool calls are parsed, and its template variables.
    let mut chat_reply: Option<(bool, serde_json::Map<String, serde_json::Value>)> = None;
    let (ids, ask) = if chat {
        let request = api::parse_chat(body.as_slice(), &ready.limits)?;
        drop((body, held));
        let Some(c) = ready.chat.clone() else {
            return Err(ApiError::bad(
                format!("/v1/chat/completions needs the model's chat template: {}", ready.no_chat),
                None,
            ));
        };
        if request.auto_tools && !request.ask.is_prefill() && ready.tool_call_parser.is_none() {
            // vLLM's answer to "auto" tool choice on a server without a parser.
            return Err(ApiError::bad(
                "\"auto\" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set",
                Some("tool_choice"),
            ));
        }
        let limits = ready.limits.clone();
        let ask = request.ask.clone();
        let mut kwargs = ready.default_kwargs.clone();
        kwargs.extend(request.kwargs.clone());
        chat_reply = Some((request.auto_tools && ready.tool_call_parser.is_some(), kwargs));
        let ids = tokio::task::spawn_blocking(move || render(&c, &request, &limits))
            .await
            .map_err(|e| ApiError::internal(format!("the render failed: {e}")))??;
        (ids, ask)
    } else {
        let (prompt, ask) = api::parse_completion(body.as_slice(), &ready.limits)?;
        drop((body, held));
        match prompt {
            api::Prompt::Ids(ids) => (ids, ask),
            api::Prompt::Text(text) => {
                let Some(c) = ready.chat.clone() else {
                    return Err(ApiError::bad(
                        format!("a text prompt needs the model's tokenizer: {}; send token ids", ready.no_chat),
                        Some("prompt"),
                    ));
                };
                let limits = ready.limits.clone();
                let ids = tokio::task::spawn_blocking(move || tokenize(&c, &text, &limits))
                    .await
                    .map_err(|e| ApiError::internal(format!("tokenizing failed: {e}")))??;
                (ids, ask)
            }
        }
    };
    span.record("tokens", ids.len());
    let generate = if ask.is_prefill() { None } else { Some(gen_job(ready, &ids, &ask)?) };
    // The file's bytes: the prompt's, or a generation's prompt and tokens but the last, at most.
    let bytes = match &generate {
        None => (ready.file_bytes)(ids.len()),
        Some(g) if g.write_states => (ready.file_bytes)(ids.len() + g.max_tokens - 1),
        Some(_) => 0,
    };
    let mut rx = tokio::select! {
        r = submit(ready, shared, &ids, generate, bytes, span) => r?,
        _ = conn.closed_by_client() => {
            m.reply(499);
            return Ok(gone());
        }
    };
    let outcome = tokio::select! {
        o = &mut rx => o,
        _ = conn.closed_by_client() => {
            // The engine sees the closed channel: a queued job is dropped
            // before its forward, a file made after this is removed there.
            rx.close();
            if let Ok(Ok(Answer::File(served) | Answer::Tokens(_, Some(served)))) = rx.try_recv() {
                shared.store.remove(&served.name);
                m.removed_unclaimed.fetch_add(1, Relaxed);
                m.reply(499);
            }
            return Ok(gone());
        }
    };
    let answer = match outcome {
        Ok(outcome) => outcome?,
        Err(_) => return Err(ApiError::unavailable("the server is stopping")),
    };
    m.reply(200);
    m.prompt_tokens.fetch_add(ids.len() as u64, Relaxed);
    m.latency(admitted.elapsed().as_secs_f64());
    let hex = format!("{id:016x}");
    let served = match answer {
        Answer::File(served) => served,
        Answer::Tokens(g, served) => {
            let tools = chat_reply.as_ref().is_some_and(|c| c.0);
            // vLLM's hermes parser keeps special tokens where it reads tool calls.
            let text = reply_text(ready, &ids, &g, ask.skip_special_tokens && !tools)?;
            let (reasoning, content, calls) = match &chat_reply {
                Some((_, kwargs)) => {
                    let thinking = kwargs.get("enable_thinking").and_then(|v| v.as_bool()).unwrap_or(true);
                    let (reasoning, content) = match ready.reasoning_parser {
                        Some(p) => p.split(&text, thinking),
                        None => (None, Some(text.clone())),
                    };
                    match ready.tool_call_parser.filter(|_| tools) {
                        Some(p) => {
                            let id = |_| {
                                let (a, b) = (crate::generate::draw_seed(), crate::generate::draw_seed());
                                format!("chatcmpl-tool-{a:016x}{b:016x}")
                            };
                            let (content, calls) = p.extract(content.as_deref().unwrap_or(""), id);
                            (reasoning, content, calls)
                        }
                        None => (reasoning, content, vec![]),
                    }
                }
                None => (None, Some(text.clone()), vec![]),
            };
            let stopped = g.finish == crate::generate::Finish::Stop;
            let last = g.output.last().copied();
            let eos = ready.generation.as_ref().map(|gen| gen.eos.clone()).unwrap_or_default();
            let reply = api::Generation {
                id: &hex,
                model: &shared.model_name,
                prompt: &ids,
                output: &g.output,
                text,
                content,
                reasoning,
                finish: if !calls.is_empty() {
                    "tool_calls"
                } else if stopped {
                    "stop"
                } else {
                    "length"
                },
                tool_calls: calls,
                // vLLM's stop_reason: the stop_token_ids id that ended it; null for EOS.
                stop_reason: last.filter(|t| stopped && (ask.ignore_eos || !eos.contains(t))),
                return_token_ids: ask.return_token_ids,
                path: served.as_ref().and_then(|s| s.path.to_str()),
            };
            let body = if chat { api::chat_generation_reply(&reply) } else { api::completion_generation_reply(&reply) };
            let mut r = json(200, body);
            if let Some(served) = served {
                r.body_mut().file = Some((shared.store.clone(), m.clone(), served));
            }
            return Ok(r);
        }
    };
    let path = served.path.to_string_lossy().into_owned();
    let text = if chat {
        api::chat_reply(&hex, &shared.model_name, &ids, &path)
    } else {
        api::completion_reply(&hex, &shared.model_name, &ids, &path)
    };
    let mut r = json(200, text);
    r.body_mut().file = Some((shared.store.clone(), m.clone(), served));
    Ok(r)
}

/// A generation request's sequence: its `max_tokens` checked against the
/// model's positions, its sampling fields over the checkpoint's defaults
/// (then vLLM's), checked as vLLM checks them, its stop ids, its draw key.
fn gen_job(ready: &Ready, ids: &[u32], ask: &api::Ask) -> Result<GenJob, ApiError> {
    let generation = ready.generation.as_ref().map_err(|why| ApiError::bad(why.clone(), Some("max_tokens")))?;
    let limits = &ready.limits;
    let room = limits.max_tokens.saturating_sub(ids.len());
    let d = &generation.defaults;
    // Not given: the checkpoint's max_new_tokens, else the room the prompt leaves (vLLM's chat default).
    let max_tokens = ask.max_tokens.unwrap_or_else(|| d.max_tokens.unwrap_or(room).min(room));
    if max_tokens == 0 || max_tokens > room {
        return Err(ApiError::bad(
            format!(
                "this model's maximum context length is {} tokens ({}); this request asks for {} tokens ({} in the \
                 prompt, {max_tokens} in the completion): lower max_tokens",
                limits.max_tokens,
                limits.max_tokens_from,
                ids.len() + max_tokens,
                ids.len()
            ),
            Some("max_tokens"),
        ));
    }
    let (params, _) = d.params(&ask.sampling).map_err(|e| ApiError::bad(e.to_string(), Some(e.name)))?;
    let mut stop = ask.stop_token_ids.clone();
    if !ask.ignore_eos {
        stop.extend(generation.eos.iter().filter(|t| !ask.stop_token_ids.contains(t)));
    }
    // A request's seed keys its draws (the same seed and prompt give the same tokens, whatever
    // else runs beside them); without one, a seed of its own.
    let seed = ask.seed.unwrap_or_else(crate::generate::draw_seed);
    Ok(GenJob {
        max_tokens,
        params,
        stop,
        key: crate::generate::DrawKey { seed, record: 0, generation: 0, position: 0 },
        write_states: ask.include_output_tokens,
    })
}

/// A reply's text as vLLM returns it: the stop token left out, special
/// tokens skipped unless `skip_special_tokens` is false; empty without a tokenizer.
fn reply_text(
    ready: &Ready,
    prompt: &[u32],
    g: &crate::generate::Generated,
    skip_special: bool,
) -> Result<String, ApiError> {
    let Some(chat) = &ready.chat else { return Ok(String::new()) };
    let body = match g.finish {
        crate::generate::Finish::Stop => &g.output[..g.output.len().saturating_sub(1)],
        crate::generate::Finish::Length => &g.output[..],
    };
    chat.tokenizer
        .decode_content(prompt, body, skip_special)
        .map_err(|e| ApiError::internal(format!("the reply cannot be decoded: {e}")))
}

/// A text prompt's tokens, as vLLM's completions endpoint makes them (the
/// tokenizer's special tokens added), checked against the limits.
fn tokenize(chat: &Chat, text: &str, limits: &Limits) -> Result<Vec<u32>, ApiError> {
    tokens_of(chat, text, true, ("prompt", "prompt"), limits)
}

/// The tokens of `text` (`add_special`: the tokenizer's own special tokens
/// added), refused past the limits naming `what` and the request `field`.
fn tokens_of(
    chat: &Chat,
    text: &str,
    add_special: bool,
    (what, field): (&'static str, &'static str),
    limits: &Limits,
) -> Result<Vec<u32>, ApiError> {
    let mut enc = crate::chat::tokenizer::Encoded::default();
    let more = chat
        .tokenizer
        .encode_limited(text, add_special, limits.max_tokens, &mut enc)
        .map_err(|e| ApiError::bad(format!("the {what} cannot be tokenized: {e}"), Some(field)))?;
    if more {
        return Err(ApiError::bad(
            format!(
                "the {what} has more than {} tokens, more than the model takes ({})",
                limits.max_tokens, limits.max_tokens_from
            ),
            Some(field),
        ));
    }
    api::check_ids(&enc.ids, limits, what)?;
    Ok(enc.ids)
}

/// Reserves the prompt's file bytes (waiting up to `--max-queue-time` for
/// readers to delete theirs) and queues it; its outcome comes on the receiver.
async fn submit(
    ready: &Ready,
    shared: &Shared,
    ids: &[u32],
    generate: Option<GenJob>,
    bytes: u64,
    span: tracing::Span,
) -> Result<oneshot::Receiver<super::engine::Outcome>, ApiError> {
    ready.engine.has_room(ids.len())?;
    let mut stopping = shared.stopping.clone();
    let reservation = tokio::select! {
        r = shared.store.reserve(bytes, shared.queue_time) => r.ok_or_else(|| {
            let (files, held) = shared.store.pending();
            ApiError::unavailable(format!(
                "the hidden-states directory is full: {files} files served and not yet deleted hold {held} bytes, \
                 and this prompt's file needs {bytes} more than --max-pending-bytes leaves; none was deleted within \
                 --max-queue-time ({} s). Their readers delete them once read (or --pending-ttl removes them); try again",
                shared.queue_time.as_secs_f64()
            ))
        })?,
        _ = super::stopped(&mut stopping) => return Err(ApiError::unavailable("the server is stopping")),
    };
    let (tx, rx) = oneshot::channel();
    let job = Job { ids: ids.to_vec(), generate, reservation, reply: tx, admitted: Instant::now(), span };
    ready.engine.submit(job)?;
    Ok(rx)
}

/// Renders a chat request with the model's template and tokenizes it, as
/// `apply_chat_template(..., tokenize=True)` does (no special tokens added:
/// the template writes them).
fn render(chat: &Chat, req: &api::ChatRequest, limits: &Limits) -> Result<Vec<u32>, ApiError> {
    let Some(template) = &chat.template else {
        return Err(ApiError::bad("the model has no chat template: send token ids to /v1/completions", None));
    };
    let rendered = template
        .render_with(
            &crate::chat::template::json_value(&req.messages),
            req.tools.as_ref().map(crate::chat::template::json_value).as_ref(),
            req.add_generation_prompt,
            &req.kwargs,
        )
        .map_err(|e| ApiError::bad(format!("the chat template failed on these messages: {e}"), Some("messages")))?;
    let mut text = rendered.text;
    if req.continue_final_message {
        // As transformers: the render is cut after the final message's content.
        let last = req.messages.as_array().and_then(|m| m.last()).and_then(|m| m["content"].as_str()).unwrap_or("");
        let last = last.trim();
        match text.rfind(last).filter(|_| !last.is_empty()) {
            Some(at) => text.truncate(at + last.len()),
            None => {
                return Err(ApiError::bad(
                    "continue_final_message: the final message's content is not in the rendered text",
                    Some("continue_final_message"),
                ))
            }
        }
    }
    tokens_of(chat, &text, false, ("rendered conversation", "messages"), limits)
}
