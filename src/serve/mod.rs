//! `strata serve`: the hidden-states server the speculators trainer talks to
//! when it trains online (`--on-missing generate`), in place of a vLLM
//! server. The trainer asks `POST /v1/completions` for a prompt's states
//! (token ids, `max_tokens: 1`); the server runs the prompt through the
//! model with whatever else is queued, writes the file `extract --format
//! speculators` would write for it into `--hidden-states-dir`, and replies
//! with its path in `kv_transfer_params.hidden_states_path`. The trainer
//! loads the file and deletes it.
//!
//! - [`api`]: requests and replies (OpenAI's and vLLM's shapes), errors;
//! - [`engine`]: the queue and continuous batching (one model thread, one writer thread);
//! - [`store`]: the states directory: atomic files, reserved bytes, TTL;
//! - [`http`]: connections and routes (hyper on tokio);
//! - [`metrics`]: `GET /metrics`.

pub mod api;
pub mod engine;
pub mod http;
pub mod metrics;
pub mod store;

use crate::chat::{Chat, ChatOptions};
use crate::job::{ModelRequest, OpenedModel};
use crate::model::{Model, ModelError};
use crate::pipeline::capture::{CaptureError, CapturePoint};
use crate::shape::DType;
use crate::sink::SpeculatorsEncoder;
use engine::Engine;
use http::{Ready, Shared};
use metrics::Metrics;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};
use store::Store;

/// Everything `strata serve` needs.
#[derive(Clone, Debug)]
pub struct ServeOptions {
    /// The model, and where and how it runs.
    pub model: ModelRequest,
    /// `--capture`: must end with `final` (the trainer's last slot).
    pub capture: String,
    /// Storage dtype; `None` keeps the checkpoint's.
    pub dtype: Option<DType>,
    /// Tokens per forward step.
    pub max_batch_tokens: usize,
    /// The longest prompt taken (default: the model's `max_position_embeddings`).
    pub max_seq_len: Option<usize>,
    /// The chat template and its variables, for `/v1/chat/completions`.
    pub chat: ChatOptions,
    /// `--hidden-states-dir`.
    pub states_dir: PathBuf,
    /// `--host`.
    pub host: String,
    /// `--port` (0: any free port).
    pub port: u16,
    /// `--served-model-name`: what `/v1/models` lists and requests name.
    pub served_model_name: String,
    /// `--max-pending-bytes`: files served and not deleted, and those being made, at most.
    pub max_pending_bytes: u64,
    /// `--pending-ttl`: a file not deleted by then is removed.
    pub pending_ttl: Duration,
    /// `--shutdown-grace`: how long requests in a step may finish after SIGTERM.
    pub shutdown_grace: Duration,
    /// `--max-connections`.
    pub max_connections: usize,
    /// How long a connection may take to send a request's headers.
    pub header_timeout: Duration,
}

/// Why the server could not start.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    /// The model.
    #[error(transparent)]
    Model(#[from] ModelError),
    /// The tokenizer or template given explicitly.
    #[error(transparent)]
    Chat(#[from] crate::chat::ChatError),
    /// Options that do not go together.
    #[error("{0}")]
    Usage(String),
    /// The address or the states directory.
    #[error("{what}: {cause}")]
    Io {
        /// What was being done.
        what: String,
        /// The OS error.
        cause: std::io::Error,
    },
}

impl From<CaptureError> for ServeError {
    fn from(e: CaptureError) -> Self {
        ServeError::Model(ModelError::Capture(e))
    }
}

/// What the server tells its caller as it runs.
#[derive(Debug)]
pub enum Event<'a> {
    /// Bound: answering `/health` (503 until loaded).
    Listening(SocketAddr),
    /// Loaded and serving.
    Ready(&'a ReadyInfo),
    /// Every 10 s: what the last period did.
    Progress(&'a Period),
    /// SIGTERM or SIGINT: stopping.
    Stopping,
    /// Stopped: requests answered 503 at the end, files removed.
    Stopped {
        /// Requests in a step when the grace ran out, answered 503.
        abandoned: usize,
    },
}

/// What the server serves, once loaded.
#[derive(Debug, Clone)]
pub struct ReadyInfo {
    /// The name requests must give.
    pub served_model_name: String,
    /// The capture points, in the file's `L` order.
    pub points: Vec<CapturePoint>,
    /// Their speculators layer ids (`input:K` is K, `final` is N).
    pub layer_ids: Vec<usize>,
    /// The ids the trainer's `--target-layer-ids` takes: all but the final layer's.
    pub target_layer_ids: Vec<usize>,
    /// Storage dtype.
    pub dtype: DType,
    /// Compute dtype.
    pub compute: String,
    /// The backend.
    pub backend: String,
    /// Time to load.
    pub load_time: Duration,
    /// The states directory (absolute).
    pub states_dir: PathBuf,
    /// The longest prompt taken, and why.
    pub max_tokens: usize,
    /// Bytes of sequence state each request split across steps holds
    /// between them (Gated DeltaNet layers; 0 for attention-only models).
    pub state_bytes: usize,
    /// Why chat requests cannot be served, when they cannot.
    pub no_chat: Option<String>,
}

/// One progress period.
#[derive(Debug, Clone, Default)]
pub struct Period {
    /// Seconds it covers.
    pub secs: f64,
    /// Requests served (200).
    pub served: u64,
    /// Prompt tokens served.
    pub tokens: u64,
    /// Forward steps run.
    pub steps: u64,
    /// Their mean fill (tokens over the budget).
    pub fill: f64,
    /// Requests queued now.
    pub queued: u64,
    /// Files served and not yet deleted, and their bytes.
    pub pending: (usize, u64),
    /// Requests answered 4xx and 5xx in the period.
    pub errors: u64,
}

/// `--served-model-name`'s default: `--model` as given (as vLLM does).
pub fn default_model_name(model: &ModelRequest) -> String {
    model.source.name()
}

/// Runs the server until SIGTERM or SIGINT; `events` hears what happens.
pub fn serve(opts: ServeOptions, mut events: impl FnMut(Event<'_>)) -> Result<(), ServeError> {
    let _span = tracing::info_span!("serve", model = %opts.served_model_name).entered();
    let checked = opts.model.check()?;
    let info = checked.info();
    let (points, captures) = crate::job::captures(&opts.capture, info.num_layers)?;
    let ids = crate::job::speculators_layer_ids(&points, info.num_layers);
    if points.last() != Some(&CapturePoint::FinalPreNorm) {
        return Err(ServeError::Usage(format!(
            "--capture {} does not end with `final`: the speculators trainer reads the last slot of every file as \
             the final layer's output before its norm (it applies the norm itself); end the list with final, e.g. \
             eagle3 = input:2,input:{},input:{},final",
            opts.capture,
            info.num_layers / 2,
            info.num_layers.saturating_sub(3)
        )));
    }
    let Some(layer_ids) = ids.into_iter().collect::<Option<Vec<usize>>>() else {
        return Err(ServeError::Usage(format!(
            "--capture {}: every point but the last must be input:K or output:K (layer ids the trainer names); \
             embeddings is input:0, final-norm has no id",
            opts.capture
        )));
    };
    let max = info.max_position_embeddings;
    if let Some(n) = opts.max_seq_len.filter(|&n| n > max) {
        return Err(ServeError::Usage(format!(
            "--max-seq-len {n} is more than the model takes: max_position_embeddings {max}"
        )));
    }
    let max_tokens = opts.max_seq_len.unwrap_or(max);
    let max_tokens_from = match opts.max_seq_len {
        Some(n) => format!("--max-seq-len {n}"),
        None => format!("the model's max_position_embeddings {max}"),
    };
    if opts.max_batch_tokens == 0 {
        return Err(ServeError::Usage("--max-batch-tokens must be at least 1".into()));
    }
    let metrics = Arc::new(Metrics::default());
    let store =
        Store::open(&opts.states_dir, opts.max_pending_bytes, opts.pending_ttl, metrics.clone()).map_err(|cause| {
            ServeError::Io { what: format!("--hidden-states-dir {}", opts.states_dir.display()), cause }
        })?;
    let addr = format!("{}:{}", opts.host, opts.port);
    let listener = std::net::TcpListener::bind(&addr)
        .map_err(|cause| ServeError::Io { what: format!("cannot listen on {addr}"), cause })?;
    listener.set_nonblocking(true).map_err(|cause| ServeError::Io { what: addr.clone(), cause })?;
    let local = listener.local_addr().map_err(|cause| ServeError::Io { what: addr.clone(), cause })?;

    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .thread_name("strata-http")
        .enable_all()
        .build()
        .map_err(|cause| ServeError::Io { what: "cannot start the HTTP runtime".into(), cause })?;
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    // A token id takes at most 11 bytes (`4294967295,`); allow spaces and the rest of the body.
    let body_limit = max_tokens.saturating_mul(16).saturating_add(1 << 20);
    let shared = Arc::new(Shared {
        ready: OnceLock::new(),
        stopping: stop_rx,
        metrics: metrics.clone(),
        store: store.clone(),
        model_name: opts.served_model_name.clone(),
        max_model_len: max_tokens,
        body_limit,
        next_id: Default::default(),
    });
    let result: Result<Option<usize>, ServeError> = runtime.block_on(async {
        let listener = tokio::net::TcpListener::from_std(listener)
            .map_err(|cause| ServeError::Io { what: addr.clone(), cause })?;
        let graceful = hyper_util::server::graceful::GracefulShutdown::new();
        let accept = tokio::spawn(accept_loop(listener, shared.clone(), opts.clone(), graceful));
        events(Event::Listening(local));
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
            .map_err(|cause| ServeError::Io { what: "cannot handle SIGTERM".into(), cause })?;
        let stop_signal = async move {
            tokio::select! {
                _ = term.recv() => {}
                _ = tokio::signal::ctrl_c() => {}
            }
        };
        tokio::pin!(stop_signal);

        // The model loads while /health answers 503; a signal stops the wait.
        let request = opts.model.clone();
        let loading = tokio::task::spawn_blocking(move || request.open(checked));
        let opened = tokio::select! {
            r = loading => r.map_err(|e| ServeError::Usage(format!("loading the model failed: {e}")))??,
            _ = &mut stop_signal => {
                events(Event::Stopping);
                let _ = stop_tx.send(true);
                return Ok(None);
            }
        };
        let (chat, no_chat) = load_chat(&opts)?;
        let ready_info = start(
            &opts,
            opened,
            &captures,
            &points,
            layer_ids,
            &shared,
            &store,
            &metrics,
            chat,
            no_chat,
            max_tokens,
            max_tokens_from,
        )?;
        events(Event::Ready(&ready_info));

        let mut tick = tokio::time::interval(Duration::from_secs(1));
        let mut last = Snapshot::take(&metrics);
        let mut last_at = Instant::now();
        let mut seconds = 0u64;
        loop {
            tokio::select! {
                _ = tick.tick() => {
                    seconds += 1;
                    let s = store.clone();
                    let orphans = seconds.is_multiple_of(10);
                    let _ = tokio::task::spawn_blocking(move || {
                        s.sweep_tracked();
                        if orphans { s.sweep_orphans(); }
                    }).await;
                    if seconds.is_multiple_of(10) {
                        let now = Snapshot::take(&metrics);
                        let period = now.since(&last, last_at.elapsed().as_secs_f64(), &metrics, &store);
                        events(Event::Progress(&period));
                        last = now;
                        last_at = Instant::now();
                    }
                }
                _ = &mut stop_signal => break,
            }
        }
        events(Event::Stopping);
        let _ = stop_tx.send(true);
        let engine = shared.ready.get().map(|r| r.engine.clone()).expect("ready");
        engine.close();
        let deadline = Instant::now() + opts.shutdown_grace;
        while !engine.drained() && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let abandoned = engine.running_count();
        engine.abandon_running();
        let graceful = accept.await.map_err(|e| ServeError::Usage(format!("the accept loop failed: {e}")))?;
        // Replies already made are sent; idle connections are closed.
        let _ = tokio::time::timeout(Duration::from_secs(1), graceful.shutdown()).await;
        store.close(Duration::from_secs(2));
        Ok(Some(abandoned))
    });
    runtime.shutdown_timeout(Duration::from_millis(200));
    if let Some(abandoned) = result? {
        events(Event::Stopped { abandoned });
    }
    Ok(())
}

/// The counters a period is measured between.
#[derive(Clone, Copy)]
struct Snapshot {
    served: u64,
    tokens: u64,
    steps: u64,
    step_tokens: u64,
    errors: u64,
}

impl Snapshot {
    fn take(m: &Metrics) -> Self {
        let errors = [400, 404, 405, 408, 413, 500, 503].iter().map(|&s| m.replies(s)).sum();
        Snapshot {
            served: m.replies(200),
            tokens: m.prompt_tokens.load(Relaxed),
            steps: m.steps.load(Relaxed),
            step_tokens: m.step_tokens.load(Relaxed),
            errors,
        }
    }

    fn since(&self, before: &Snapshot, secs: f64, m: &Metrics, store: &Store) -> Period {
        let steps = self.steps - before.steps;
        let budget = m.budget.load(Relaxed).max(1) as f64;
        Period {
            secs,
            served: self.served - before.served,
            tokens: self.tokens - before.tokens,
            steps,
            fill: if steps == 0 { 0.0 } else { (self.step_tokens - before.step_tokens) as f64 / steps as f64 / budget },
            queued: m.queue_depth.load(Relaxed),
            pending: store.pending(),
            errors: self.errors - before.errors,
        }
    }
}

/// The tokenizer and chat template for `/v1/chat/completions`, when the model has them.
fn load_chat(opts: &ServeOptions) -> Result<(Option<Arc<Chat>>, Option<String>), ServeError> {
    let Some(dir) = opts.model.source.dir() else {
        return Ok((None, Some("the model has no tokenizer (an embedded model)".into())));
    };
    let has_tokenizer = crate::chat::tokenizer::FILES.iter().any(|f| dir.join(f).is_file());
    if !has_tokenizer {
        if opts.chat.template_file.is_some() {
            return Err(ServeError::Usage(format!(
                "--chat-template needs the model's tokenizer, and {} has neither tokenizer.json nor tiktoken.model",
                dir.display()
            )));
        }
        return Ok((None, Some(format!("{} has neither tokenizer.json nor tiktoken.model", dir.display()))));
    }
    match Chat::load(dir, &opts.chat) {
        Ok(c) if c.template.is_some() => Ok((Some(Arc::new(c)), None)),
        Ok(_) => Ok((None, Some("the model has no chat template (pass --chat-template FILE)".into()))),
        // Token ids need neither: a broken template matters only to chat requests, unless asked for.
        Err(e) if opts.chat.template_file.is_none() => {
            tracing::warn!("the chat endpoint is off: {e}");
            Ok((None, Some(e.to_string())))
        }
        Err(e) => Err(e.into()),
    }
}

/// Starts the model's and the writer's threads and marks the server ready.
#[allow(clippy::too_many_arguments)]
fn start(
    opts: &ServeOptions,
    opened: OpenedModel,
    captures: &crate::pipeline::capture::CaptureSet<usize>,
    points: &[CapturePoint],
    layer_ids: Vec<usize>,
    shared: &Arc<Shared>,
    store: &Arc<Store>,
    metrics: &Arc<Metrics>,
    chat: Option<Arc<Chat>>,
    no_chat: Option<String>,
    max_tokens: usize,
    max_tokens_from: String,
) -> Result<ReadyInfo, ServeError> {
    let info = opened.info().clone();
    let dtype = opts.dtype.unwrap_or(opened.model.dtype());
    let engine = Arc::new(Engine::new(opts.max_batch_tokens, store.clone(), metrics.clone()));
    let encoder = SpeculatorsEncoder::new(dtype);
    let (l, h) = (points.len(), info.hidden_size);
    let ready_info = ReadyInfo {
        served_model_name: opts.served_model_name.clone(),
        points: points.to_vec(),
        target_layer_ids: layer_ids[..layer_ids.len() - 1].to_vec(),
        layer_ids,
        dtype,
        compute: opened.model.compute().to_string(),
        backend: opts.model.backend.name().to_string(),
        load_time: opened.load_time,
        states_dir: store.path().to_path_buf(),
        max_tokens,
        state_bytes: opened.config.sequence_state_bytes(),
        no_chat: no_chat.clone(),
    };
    let limits =
        api::Limits { model: opts.served_model_name.clone(), vocab_size: info.vocab_size, max_tokens, max_tokens_from };
    let (to_writer, from_model) = std::sync::mpsc::sync_channel(1);
    let names: Vec<String> = points.iter().map(|p| p.to_string()).collect();
    let e = engine.clone();
    let spawn_err = |cause| ServeError::Io { what: "cannot start a thread".into(), cause };
    std::thread::Builder::new()
        .name("strata-writer".into())
        .spawn(move || e.run_writer(from_model, dtype, &names))
        .map_err(spawn_err)?;
    let e = engine.clone();
    let captures = captures.clone();
    std::thread::Builder::new()
        .name("strata-model".into())
        .spawn(move || e.run_model(&opened.model, &captures, to_writer))
        .map_err(spawn_err)?;
    let ready = Ready {
        engine,
        limits,
        chat,
        no_chat: no_chat.unwrap_or_default(),
        file_bytes: Box::new(move |t| encoder.file_bytes(t, l, h)),
    };
    let _ = shared.ready.set(ready);
    Ok(ready_info)
}

/// Returns once the server is stopping.
pub(crate) async fn stopped(rx: &mut tokio::sync::watch::Receiver<bool>) {
    let _ = rx.wait_for(|s| *s).await;
}

/// Accepts connections until stopping, at most `--max-connections` at once;
/// returns the handle that shuts the open ones down.
async fn accept_loop(
    listener: tokio::net::TcpListener,
    shared: Arc<Shared>,
    opts: ServeOptions,
    graceful: hyper_util::server::graceful::GracefulShutdown,
) -> hyper_util::server::graceful::GracefulShutdown {
    let slots = Arc::new(tokio::sync::Semaphore::new(opts.max_connections.max(1)));
    let mut stopping = shared.stopping.clone();
    loop {
        let permit = tokio::select! {
            p = slots.clone().acquire_owned() => p.expect("never closed"),
            _ = stopped(&mut stopping) => break,
        };
        let stream = tokio::select! {
            a = listener.accept() => match a {
                Ok((s, _)) => s,
                Err(e) => {
                    // Out of file descriptors and kin: wait, then take connections again.
                    tracing::warn!("accept: {e}");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            },
            _ = stopped(&mut stopping) => break,
        };
        let _ = stream.set_nodelay(true);
        let shared = shared.clone();
        let service = hyper::service::service_fn(move |req| http::handle(req, shared.clone()));
        let conn = hyper::server::conn::http1::Builder::new()
            .timer(hyper_util::rt::TokioTimer::new())
            .header_read_timeout(opts.header_timeout)
            .keep_alive(true)
            .serve_connection(hyper_util::rt::TokioIo::new(stream), service);
        let conn = graceful.watch(conn);
        tokio::spawn(async move {
            if let Err(e) = conn.await {
                tracing::debug!("connection: {e}");
            }
            drop(permit);
        });
    }
    graceful
}
