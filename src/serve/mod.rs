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
//! - [`store`]: the states directory: one server's, atomic files, reserved bytes, TTL;
//! - [`http`]: requests, bodies and routes (hyper on tokio), `--api-key`;
//! - [`conn`]: the connections, the idle ones closed to make room;
//! - [`metrics`]: `GET /metrics`.

pub mod api;
pub mod conn;
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
pub use http::ApiKey;
use http::{Bodies, Ready, Shared};
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
    /// `--pending-ttl`: a file not deleted by then is removed (at least [`MIN_PENDING_TTL`]).
    pub pending_ttl: Duration,
    /// `--max-queue-time`: the work the queue holds at the measured speed, and
    /// the longest a request waits for room in the states directory.
    pub max_queue_time: Duration,
    /// `--max-body-bytes`: request bodies held in memory at once, all connections together.
    pub max_body_bytes: u64,
    /// `--api-key`: when set, every route but `/health` and `/metrics` needs `Authorization: Bearer KEY`.
    pub api_key: Option<ApiKey>,
    /// `--shutdown-grace`: how long requests in a step may finish after SIGTERM.
    pub shutdown_grace: Duration,
    /// `--max-connections`.
    pub max_connections: usize,
    /// How long a connection may take to send a request's headers.
    pub header_timeout: Duration,
    /// `--tool-call-parser`: how a chat generation's tool calls are read.
    pub tool_call_parser: Option<crate::generate::conversation::ToolParser>,
    /// `--reasoning-parser`: the reasoning split off a chat generation's content.
    pub reasoning_parser: Option<crate::generate::conversation::ReasoningParser>,
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
    /// `--api-key` set to nothing.
    #[error("--api-key (or STRATA_API_KEY) is empty: an empty key would let every request through")]
    EmptyApiKey,
    /// The states directory: another server's, or unusable.
    #[error(transparent)]
    States(#[from] store::StoreError),
    /// The address, the runtime, a thread.
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

/// The shortest `--pending-ttl`: a trainer reads its file right after the
/// reply, but a busy one may take seconds to get to it.
pub const MIN_PENDING_TTL: Duration = Duration::from_secs(10);

/// Read buffer of a connection at most (hyper's default grows to about
/// 400 KiB): what a connection holds beyond its body's share of
/// `--max-body-bytes`. Headers must fit in it.
pub const CONNECTION_BUFFER: usize = 16 << 10;

/// What the server tells its caller as it runs.
#[derive(Debug)]
pub enum Event<'a> {
    /// Something the operator should know (listening beyond loopback without a key).
    Warning(String),
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
    if opts.pending_ttl < MIN_PENDING_TTL {
        return Err(ServeError::Usage(format!(
            "--pending-ttl {:?} is too short: files would be removed before the trainer reads them; give at least \
             {}s (the default is 300s)",
            opts.pending_ttl,
            MIN_PENDING_TTL.as_secs()
        )));
    }
    if opts.max_queue_time.is_zero() {
        return Err(ServeError::Usage("--max-queue-time must be more than 0s".into()));
    }
    let metrics = Arc::new(Metrics::default());
    let store = Store::open(&opts.states_dir, opts.max_pending_bytes, opts.pending_ttl, metrics.clone())?;
    let addr = format!("{}:{}", opts.host, opts.port);
    let listener = std::net::TcpListener::bind(&addr)
        .map_err(|cause| ServeError::Io { what: format!("cannot listen on {addr}"), cause })?;
    listener.set_nonblocking(true).map_err(|cause| ServeError::Io { what: addr.clone(), cause })?;
    let local = listener.local_addr().map_err(|cause| ServeError::Io { what: addr.clone(), cause })?;
    // std listens with a backlog of 128; a burst of connections beyond it would wait a second per retry.
    // SAFETY: listen(2) on a socket this function owns; calling it again only changes the backlog.
    unsafe { libc::listen(std::os::fd::AsRawFd::as_raw_fd(&listener), 4096) };
    let max_connections = fd_room(opts.max_connections.max(1), &mut events);
    if !local.ip().is_loopback() && opts.api_key.is_none() {
        let w = format!(
            "listening on {local}, beyond loopback, with no --api-key: anyone who can reach the port can run the \
             model and fill --hidden-states-dir. Set STRATA_API_KEY (the speculators trainer cannot send a key: \
             keep it on loopback, or put a proxy that adds the key in front)"
        );
        tracing::warn!("{w}");
        events(Event::Warning(w));
    }

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
        bodies: Bodies::new(opts.max_body_bytes, metrics.clone()),
        api_key: opts.api_key.clone(),
        queue_time: opts.max_queue_time,
        next_id: Default::default(),
    });
    let result: Result<Option<usize>, ServeError> = runtime.block_on(async {
        let listener = tokio::net::TcpListener::from_std(listener)
            .map_err(|cause| ServeError::Io { what: addr.clone(), cause })?;
        let graceful = hyper_util::server::graceful::GracefulShutdown::new();
        let accept = tokio::spawn(accept_loop(listener, shared.clone(), opts.clone(), max_connections, graceful));
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

        // The model loads, and its speed is measured, while /health answers 503; a signal stops the wait.
        let request = opts.model.clone();
        let (budget, vocab) = (opts.max_batch_tokens, info.vocab_size);
        let warm_captures = captures.clone();
        let config_text = checked.text.clone();
        let loading =
            tokio::task::spawn_blocking(move || -> Result<(OpenedModel, f64, Result<(), String>), ModelError> {
                // With its LM head, for generation requests; a checkpoint without one serves prompts' states only.
                let mut with_head = request.clone();
                with_head.lm_head = true;
                let (opened, head) = match with_head.open(checked.clone()) {
                    Ok(opened) => (opened, Ok(())),
                    Err(ModelError::NoLmHead(why)) => (request.open(checked)?, Err(why)),
                    Err(e) => return Err(e),
                };
                let tps = engine::measure(&opened.model, &warm_captures, budget, max_tokens, vocab)?;
                Ok((opened, tps, head))
            });
        let (opened, tps, head) = tokio::select! {
            r = loading => r.map_err(|e| ServeError::Usage(format!("loading the model failed: {e}")))??,
            _ = &mut stop_signal => {
                events(Event::Stopping);
                let _ = stop_tx.send(true);
                return Ok(None);
            }
        };
        let (chat, no_chat) = load_chat(&opts)?;
        let generation = head
            .map_err(|why| format!("this model cannot generate ({why}): send max_tokens 1 for the prompt's states"))
            .and_then(|()| generation_setup(&opts, &config_text, chat.as_deref()));
        let ready_info = start(
            &opts,
            opened,
            tps,
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
            generation,
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
        let errors = [400, 401, 404, 405, 408, 413, 500, 503].iter().map(|&s| m.replies(s)).sum();
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

/// What generation requests take from the checkpoint, as `strata generate`
/// takes it: `generation_config.json`'s sampling defaults and EOS ids (else
/// config.json's), and the tokenizer's EOS.
fn generation_setup(opts: &ServeOptions, config_text: &str, chat: Option<&Chat>) -> Result<http::Generation, String> {
    let defaults = match opts.model.source.dir() {
        Some(dir) => crate::generate::GenerationDefaults::read(dir, config_text).map_err(|e| e.to_string())?,
        None => crate::generate::GenerationDefaults::from_model_config(config_text)?,
    };
    let mut eos = defaults.eos_token_ids.clone();
    let config = opts.model.source.dir().and_then(|dir| {
        let text = crate::files::read_text(&dir.join("tokenizer_config.json"), 256 << 20).ok()?;
        serde_json::from_str::<serde_json::Value>(&text).ok()
    });
    if let Some(id) =
        chat.zip(config.as_ref()).and_then(|(c, config)| crate::job::generate::tokenizer_eos(&c.tokenizer, config))
    {
        if !eos.contains(&id) {
            eos.push(id);
        }
    }
    Ok(http::Generation { defaults, eos })
}

/// Starts the model's and the writer's threads and marks the server ready.
#[allow(clippy::too_many_arguments)]
fn start(
    opts: &ServeOptions,
    opened: OpenedModel,
    throughput: f64,
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
    generation: Result<http::Generation, String>,
) -> Result<ReadyInfo, ServeError> {
    let info = opened.info().clone();
    let dtype = opts.dtype.unwrap_or(opened.model.dtype());
    let engine =
        Arc::new(Engine::new(opts.max_batch_tokens, opts.max_queue_time, throughput, store.clone(), metrics.clone()));
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
        generation,
        tool_call_parser: opts.tool_call_parser,
        reasoning_parser: opts.reasoning_parser,
        default_kwargs: opts.chat.kwargs.clone(),
    };
    let _ = shared.ready.set(ready);
    Ok(ready_info)
}

/// Returns once the server is stopping.
pub(crate) async fn stopped(rx: &mut tokio::sync::watch::Receiver<bool>) {
    let _ = rx.wait_for(|s| *s).await;
}

/// Raises the process's open-file limit to fit `want` connections (and the
/// model's files); returns the connections it fits, warning when fewer.
fn fd_room(want: usize, events: &mut impl FnMut(Event<'_>)) -> usize {
    const RESERVED: u64 = 256;
    let mut lim = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: getrlimit/setrlimit with a valid pointer to a local.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) } != 0 {
        return want;
    }
    let need = want as u64 + RESERVED;
    if lim.rlim_cur < need {
        let raised = libc::rlimit { rlim_cur: need.min(lim.rlim_max), rlim_max: lim.rlim_max };
        // SAFETY: as above.
        if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &raised) } == 0 {
            lim.rlim_cur = raised.rlim_cur;
        }
    }
    let fits = lim.rlim_cur.saturating_sub(RESERVED) as usize;
    if fits < want {
        let w = format!(
            "--max-connections {want} does not fit the open-file limit ({}, ulimit -n, hard limit {}): at most {} \
             connections are kept open",
            lim.rlim_cur,
            lim.rlim_max,
            fits.max(1)
        );
        tracing::warn!("{w}");
        events(Event::Warning(w));
        return fits.max(1);
    }
    want
}

/// Accepts connections until stopping, at most `max_connections` at once:
/// when every slot is taken, the connection idle longest is closed to make
/// room (while every one is busy with a request, the next waits). Returns
/// the handle that shuts the open ones down.
async fn accept_loop(
    listener: tokio::net::TcpListener,
    shared: Arc<Shared>,
    opts: ServeOptions,
    max_connections: usize,
    graceful: hyper_util::server::graceful::GracefulShutdown,
) -> hyper_util::server::graceful::GracefulShutdown {
    let slots = Arc::new(tokio::sync::Semaphore::new(max_connections));
    let registry = conn::Registry::new();
    let mut stopping = shared.stopping.clone();
    loop {
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
        let permit = match slots.clone().try_acquire_owned() {
            Ok(p) => p,
            Err(_) => {
                if registry.evict_idlest() {
                    shared.metrics.evicted.fetch_add(1, Relaxed);
                }
                tokio::select! {
                    p = slots.clone().acquire_owned() => p.expect("never closed"),
                    _ = stopped(&mut stopping) => break,
                }
            }
        };
        let _ = stream.set_nodelay(true);
        let conn = registry.add();
        shared.metrics.connections.fetch_add(1, Relaxed);
        let (for_requests, c) = (shared.clone(), conn.clone());
        let service = hyper::service::service_fn(move |req| http::handle(req, for_requests.clone(), c.clone()));
        let served = hyper::server::conn::http1::Builder::new()
            .timer(hyper_util::rt::TokioTimer::new())
            .header_read_timeout(opts.header_timeout)
            .max_buf_size(CONNECTION_BUFFER)
            .keep_alive(true)
            .serve_connection(hyper_util::rt::TokioIo::new(conn::Watched::new(stream, conn.clone())), service);
        let served = graceful.watch(served);
        let metrics = shared.metrics.clone();
        tokio::spawn(async move {
            tokio::select! {
                r = served => if let Err(e) = r {
                    tracing::debug!("connection: {e}");
                },
                // Dropping the connection closes it.
                _ = conn.evicted() => tracing::debug!("an idle connection closed to make room"),
            }
            conn.remove();
            metrics.connections.fetch_sub(1, Relaxed);
            drop(permit);
        });
    }
    graceful
}
