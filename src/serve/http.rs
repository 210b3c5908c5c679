//! The HTTP side of `strata serve`: hyper's HTTP/1.1 connections, bounded
//! (connections, header read time, body size and read time), and the five
//! routes. A request's future is dropped by hyper when its client hangs up;
//! its queued job sees that and is dropped before its forward, and a file
//! made for it is removed.

use super::api::{self, ApiError, Limits};
use super::engine::{Engine, Job};
use super::metrics::Metrics;
use super::store::{Served, Store};
use crate::chat::Chat;
use bytes::Bytes;
use http_body::Frame;
use http_body_util::{BodyExt, Limited};
use hyper::body::Incoming;
use hyper::{Method, Request, Response};
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, OnceLock};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};
use tokio::sync::{oneshot, watch};

/// How long a request body may take to arrive once its headers have.
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
    /// Request ids.
    pub next_id: AtomicU64,
}

/// A response body sent once; while it holds a served file, dropping it
/// before the connection took it removes the file (its client is gone).
pub struct Reply {
    data: Option<Bytes>,
    file: Option<(Arc<Store>, Arc<Metrics>, Served)>,
}

impl Reply {
    fn text(data: String) -> Self {
        Reply { data: Some(Bytes::from(data)), file: None }
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
    json(e.status, e.body())
}

/// Answers one request.
pub async fn handle(req: Request<Incoming>, shared: Arc<Shared>) -> Result<Response<Reply>, std::convert::Infallible> {
    let m = &shared.metrics;
    let path = req.uri().path().to_string();
    let method = req.method().clone();
    Ok(match (method.clone(), path.as_str()) {
        (Method::GET, "/health") => match (shared.ready.get(), *shared.stopping.borrow()) {
            (Some(_), false) => json(200, String::new()),
            (None, _) => error(m, ApiError::unavailable("the model is loading")),
            (_, true) => error(m, ApiError::unavailable("the server is stopping")),
        },
        (Method::GET, "/metrics") => Response::builder()
            .status(200)
            .header("content-type", "text/plain; version=0.0.4; charset=utf-8")
            .body(Reply::text(m.render()))
            .expect("a valid response"),
        (Method::GET, "/v1/models") => json(200, api::models_reply(&shared.model_name, shared.max_model_len)),
        (Method::POST, "/v1/completions") => match completion(req, &shared, false).await {
            Ok(r) => r,
            Err(e) => error(m, e),
        },
        (Method::POST, "/v1/chat/completions") => match completion(req, &shared, true).await {
            Ok(r) => r,
            Err(e) => error(m, e),
        },
        (_, "/health" | "/metrics" | "/v1/models" | "/v1/completions" | "/v1/chat/completions") => {
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
    })
}

/// Reads the body within [`BODY_TIMEOUT`] and the size limit.
async fn read_body(req: Request<Incoming>, limit: usize) -> Result<Bytes, ApiError> {
    let body = Limited::new(req.into_body(), limit);
    match tokio::time::timeout(BODY_TIMEOUT, body.collect()).await {
        Err(_) => {
            Err(ApiError::timeout(format!("the request body did not arrive within {} s", BODY_TIMEOUT.as_secs())))
        }
        Ok(Ok(c)) => Ok(c.to_bytes()),
        Ok(Err(e)) if e.downcast_ref::<http_body_util::LengthLimitError>().is_some() => {
            Err(ApiError::too_large(format!(
                "the request body is over {limit} bytes, more than a prompt of the longest length this server takes"
            )))
        }
        Ok(Err(e)) => Err(ApiError::bad(format!("the request body could not be read: {e}"), None)),
    }
}

async fn completion(req: Request<Incoming>, shared: &Arc<Shared>, chat: bool) -> Result<Response<Reply>, ApiError> {
    let admitted = Instant::now();
    let Some(ready) = shared.ready.get() else { return Err(ApiError::unavailable("the model is loading")) };
    if *shared.stopping.borrow() {
        return Err(ApiError::unavailable("the server is stopping"));
    }
    let body = read_body(req, shared.body_limit).await?;
    let id = shared.next_id.fetch_add(1, Relaxed);
    let span = tracing::info_span!("request", id, chat, tokens = tracing::field::Empty);
    let ids = if chat {
        let request = api::parse_chat(&body, &ready.limits)?;
        drop(body);
        let Some(c) = ready.chat.clone() else {
            return Err(ApiError::bad(
                format!("/v1/chat/completions needs the model's chat template: {}", ready.no_chat),
                None,
            ));
        };
        let limits = ready.limits.clone();
        tokio::task::spawn_blocking(move || render(&c, &request, &limits))
            .await
            .map_err(|e| ApiError::internal(format!("the render failed: {e}")))??
    } else {
        api::parse_completion(&body, &ready.limits)?
    };
    span.record("tokens", ids.len());
    let served = run(ready, shared, &ids, span).await?;
    let m = &shared.metrics;
    m.reply(200);
    m.prompt_tokens.fetch_add(ids.len() as u64, Relaxed);
    m.latency(admitted.elapsed().as_secs_f64());
    let path = served.path.to_string_lossy().into_owned();
    let hex = format!("{id:016x}");
    let text = if chat {
        api::chat_reply(&hex, &shared.model_name, &ids, &path)
    } else {
        api::completion_reply(&hex, &shared.model_name, &ids, &path)
    };
    let mut r = json(200, text);
    r.body_mut().file = Some((shared.store.clone(), m.clone(), served));
    Ok(r)
}

/// Queues the prompt and waits for its file.
async fn run(ready: &Ready, shared: &Shared, ids: &[u32], span: tracing::Span) -> Result<Served, ApiError> {
    ready.engine.has_room(ids.len())?;
    let mut stopping = shared.stopping.clone();
    let reservation = tokio::select! {
        r = shared.store.reserve((ready.file_bytes)(ids.len())) => r,
        _ = super::stopped(&mut stopping) => return Err(ApiError::unavailable("the server is stopping")),
    };
    let (tx, rx) = oneshot::channel();
    let job = Job { ids: ids.to_vec(), reservation, reply: tx, admitted: Instant::now(), span };
    ready.engine.submit(job)?;
    match rx.await {
        Ok(outcome) => outcome,
        Err(_) => Err(ApiError::unavailable("the server is stopping")),
    }
}

/// Renders a chat request with the model's template and tokenizes it, as
/// `apply_chat_template(..., tokenize=True)` does (no special tokens added:
/// the template writes them).
fn render(chat: &Chat, req: &api::ChatRequest, limits: &Limits) -> Result<Vec<u32>, ApiError> {
    let Some(template) = &chat.template else {
        return Err(ApiError::bad("the model has no chat template: send token ids to /v1/completions", None));
    };
    let rendered = template
        .render(
            &crate::chat::template::json_value(&req.messages),
            req.tools.as_ref().map(crate::chat::template::json_value).as_ref(),
            req.add_generation_prompt,
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
    let mut enc = crate::chat::tokenizer::Encoded::default();
    let more = chat
        .tokenizer
        .encode_limited(&text, false, limits.max_tokens, &mut enc)
        .map_err(|e| ApiError::bad(format!("the rendered conversation cannot be tokenized: {e}"), Some("messages")))?;
    if more {
        return Err(ApiError::bad(
            format!(
                "the rendered conversation has more than {} tokens, more than the model takes ({})",
                limits.max_tokens, limits.max_tokens_from
            ),
            Some("messages"),
        ));
    }
    api::check_ids(&enc.ids, limits, "rendered conversation")?;
    Ok(enc.ids)
}
