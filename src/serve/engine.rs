//! Continuous batching: requests from any number of connections wait in one
//! queue; the model's thread runs them through the decode loop of `strata
//! generate` ([`Decode`]), in forward steps of up to `--max-batch-tokens`
//! (a long prompt is split across steps, as offline), and the writer's
//! thread cuts each finished prompt's states out of its steps, checks and
//! encodes them, writes the file and answers its request.
//!
//! ```text
//! HTTP tasks ─submit─► queue ─► model thread (Scheduler, forward) ─► writer thread (Gatherer, file, reply)
//! ```
//!
//! A request whose client hung up while it waited is dropped before its
//! forward; one whose client hung up during it gets its file removed at once.

use super::api::ApiError;
use super::metrics::Metrics;
use super::store::{Reservation, Served, Store};
use crate::generate::{Decode, DecodeOptions, DrawKey, Generated, SamplingParams, Sequence, StepSegment};
use crate::model::{AnyCache, AnyModel, Model, ModelError, PendingStates};
use crate::pipeline::capture::CaptureSet;
use crate::pipeline::schedule::Scheduler;
use crate::pipeline::source::Sample;
use crate::shape::{CapturedStates, DType, StatesView};
use crate::sink::SpeculatorsEncoder;
use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering::Relaxed};
use std::sync::{mpsc, Arc, Condvar, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::oneshot;

/// What a request gets back: its file or its tokens, or why not.
pub type Outcome = Result<Answer, ApiError>;

/// What a request is answered with.
#[derive(Debug)]
pub enum Answer {
    /// The prompt's states, written (the trainer's `max_tokens: 1`).
    File(Served),
    /// A generation's tokens, and its states file with `include_output_tokens`.
    Tokens(Generated, Option<Served>),
}

/// A file to write: its token ids, what it holds (for messages), its bytes
/// reserved in the store, and whom to answer.
struct File<'a> {
    ids: &'a [u32],
    what: &'a str,
    reservation: Reservation,
    reply: oneshot::Sender<Outcome>,
}

/// What the model thread hands the writer, in step order.
pub enum ToWriter {
    /// A step's segments and its states `[L, T, H]`, copies pending.
    Step(Vec<StepSegment>, PendingStates<usize, usize>),
    /// A generation that writes its states ended with the last step sent.
    Done(usize, Generated),
}

/// A generation to run: a [`Sequence`] but for its prompt (the job's ids).
#[derive(Clone, Debug)]
pub struct GenJob {
    /// Most tokens to draw (at least 1).
    pub max_tokens: usize,
    /// How each is drawn.
    pub params: SamplingParams,
    /// Tokens that end it.
    pub stop: Vec<u32>,
    /// What its draws are keyed by.
    pub key: DrawKey,
    /// Write the states of its prompt and of its tokens but the last (`include_output_tokens`).
    pub write_states: bool,
}

/// A request admitted to the queue.
#[derive(Debug)]
pub struct Job {
    /// The prompt's token ids.
    pub ids: Vec<u32>,
    /// A generation; `None`: the prompt's states only.
    pub generate: Option<GenJob>,
    /// The bytes its file may take, reserved in the states directory.
    pub reservation: Reservation,
    /// Where its outcome goes; closed when its client hung up.
    pub reply: oneshot::Sender<Outcome>,
    /// When it was admitted.
    pub admitted: Instant,
    /// Its request's span.
    pub span: tracing::Span,
}

/// Requests the queue holds at most, whatever their tokens (bounds the
/// memory of their ids and reservations).
pub const QUEUE_REQUESTS: usize = 4096;

/// Tokens of [`measure`]'s first, untimed step (fewer when the budget is smaller).
pub const WARM_UP_TOKENS: usize = 256;

/// Tokens per second of `model`'s forward with `captures`, measured before
/// the server opens so that the queue is bounded from its first request.
/// A step of `min(budget, WARM_UP_TOKENS)` tokens pays for what only the
/// first step pays (kernels compiled, pages faulted in); then a full step of
/// prompts of `min(budget, longest)` tokens is timed, the states' copy
/// included. Attention makes a token of a long prompt dearer than one of a
/// short prompt, so that step is the dearest per token a step of admitted
/// prompts gets, and the queue it bounds errs short. (A 256-token timed
/// step ran 1.4 times faster per token than 4000-token prompts on the bench
/// model: the queue it bounded held 84 s of work for 60.) A prompt split
/// across steps also attends over its earlier ones; real steps correct the
/// figure.
pub fn measure(
    model: &AnyModel,
    captures: &CaptureSet<usize>,
    budget: usize,
    longest: usize,
    vocab: usize,
) -> Result<f64, crate::model::ModelError> {
    let budget = budget.max(1);
    let prompt = budget.min(longest.max(1));
    let mut tokens_per_s = 0.0;
    for (tokens, len) in [(budget.min(WARM_UP_TOKENS), budget.min(WARM_UP_TOKENS).min(prompt)), (budget, prompt)] {
        // Prompts of `len` tokens (the last one shorter) filling `tokens`.
        let mut samples = (0..tokens.div_ceil(len)).map(|p| {
            let n = len.min(tokens - p * len);
            Ok::<_, std::convert::Infallible>(Sample {
                index: p,
                line: p,
                id: format!("warm-up-{p}"),
                input_ids: (0..n).map(|i| (((p * len + i) * 7919 + 13) % vocab.max(1)) as u32).collect(),
                loss_mask: None,
                end: Default::default(),
                finish: vec![],
            })
        });
        let mut scheduler = Scheduler::new(tokens);
        let Ok(Some(step)) = scheduler.next_step(&mut samples) else { continue };
        let mut cache = AnyCache::default();
        let t = Instant::now();
        model.forward_step_pending(&step.batch, captures, &mut cache)?.wait()?;
        tokens_per_s = step.batch.num_tokens() as f64 / t.elapsed().as_secs_f64().max(1e-6);
    }
    Ok(tokens_per_s)
}

#[derive(Debug, Default)]
struct Queue {
    jobs: VecDeque<Job>,
    tokens: usize,
    closed: bool,
}

/// The queue, the requests in steps, and what both threads share.
#[derive(Debug)]
pub struct Engine {
    queue: Mutex<Queue>,
    work: Condvar,
    /// Requests taken into a step, by sample index, until answered.
    running: Mutex<HashMap<usize, Job>>,
    next_index: AtomicUsize,
    budget: usize,
    /// `--max-queue-time`: the work the queue holds at the measured throughput.
    queue_time: Duration,
    /// Tokens per second of forward: measured before the server opened
    /// (see [`measure`]), then by every step.
    throughput: Mutex<f64>,
    /// The model thread is between steps with nothing in flight.
    idle: AtomicBool,
    /// The writer could not collect a step's states: the model thread
    /// drops the prompts it has split across steps, as after a failed step.
    collect_failed: AtomicBool,
    store: Arc<Store>,
    metrics: Arc<Metrics>,
}

impl Engine {
    /// An engine packing steps of `budget` tokens, writing into `store`;
    /// its queue holds `queue_time` of work at `throughput` tokens per
    /// second until steps measure it anew.
    pub fn new(budget: usize, queue_time: Duration, throughput: f64, store: Arc<Store>, metrics: Arc<Metrics>) -> Self {
        metrics.budget.store(budget as u64, Relaxed);
        Engine {
            queue: Mutex::new(Queue::default()),
            work: Condvar::new(),
            running: Mutex::new(HashMap::new()),
            next_index: AtomicUsize::new(0),
            budget,
            queue_time,
            throughput: Mutex::new(throughput),
            idle: AtomicBool::new(true),
            collect_failed: AtomicBool::new(false),
            store,
            metrics,
        }
    }

    fn queue(&self) -> std::sync::MutexGuard<'_, Queue> {
        self.queue.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn running(&self) -> std::sync::MutexGuard<'_, HashMap<usize, Job>> {
        self.running.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Tokens the queue may hold: `--max-queue-time` of the measured
    /// throughput (measured before the server opened, so a cold burst is
    /// bounded too), and never less than one step, so that the next step
    /// can be filled.
    pub fn queue_bound(&self) -> usize {
        let tps = *self.throughput.lock().unwrap_or_else(|e| e.into_inner());
        ((tps * self.queue_time.as_secs_f64()) as usize).max(self.budget)
    }

    /// Whether a request of `tokens` would be admitted now (checked before
    /// its bytes are reserved, so a full queue answers at once).
    pub fn has_room(&self, tokens: usize) -> Result<(), ApiError> {
        let q = self.queue();
        self.room_in(&q, tokens)
    }

    fn room_in(&self, q: &Queue, tokens: usize) -> Result<(), ApiError> {
        if q.closed {
            return Err(ApiError::unavailable("the server is stopping"));
        }
        let bound = self.queue_bound();
        // An empty queue takes any one request (a prompt may be longer than the bound).
        if !q.jobs.is_empty() && (q.tokens.saturating_add(tokens) > bound || q.jobs.len() >= QUEUE_REQUESTS) {
            return Err(ApiError::unavailable(format!(
                "the queue is full ({} requests, {} tokens: about {:.0} s of work, --max-queue-time); try again",
                q.jobs.len(),
                q.tokens,
                self.queue_time.as_secs_f64()
            )));
        }
        Ok(())
    }

    /// Queues a request; a 503 when the queue is full or the server
    /// stopping (the job is dropped: its bytes are released).
    pub fn submit(&self, job: Job) -> Result<(), ApiError> {
        let mut q = self.queue();
        self.room_in(&q, job.ids.len())?;
        q.tokens += job.ids.len();
        q.jobs.push_back(job);
        self.metrics.queue_depth.store(q.jobs.len() as u64, Relaxed);
        self.metrics.queue_tokens.store(q.tokens as u64, Relaxed);
        drop(q);
        self.work.notify_one();
        Ok(())
    }

    /// The next queued request whose client still waits, as a prefill
    /// (`max_tokens` 0: its states, nothing drawn) under a new index; the
    /// others are dropped here, before their forward.
    fn pop_live(&self) -> Option<(usize, Sequence)> {
        let mut q = self.queue();
        while let Some(job) = q.jobs.pop_front() {
            q.tokens -= job.ids.len();
            self.metrics.queue_depth.store(q.jobs.len() as u64, Relaxed);
            self.metrics.queue_tokens.store(q.tokens as u64, Relaxed);
            if job.reply.is_closed() {
                self.metrics.dropped_queued.fetch_add(1, Relaxed);
                self.metrics.reply(499);
                continue;
            }
            let index = self.next_index.fetch_add(1, Relaxed);
            let g = job.generate.clone().unwrap_or(GenJob {
                max_tokens: 0,
                params: SamplingParams::default(),
                stop: Vec::new(),
                key: DrawKey { seed: 0, record: index as u128, generation: 0, position: 0 },
                write_states: false,
            });
            // The job keeps its ids for the file's token_ids and the reply.
            let seq = Sequence {
                prompt: job.ids.clone(),
                max_tokens: g.max_tokens,
                params: g.params,
                stop: g.stop,
                key: g.key,
                park: false,
                continues: None,
            };
            self.running().insert(index, job);
            return Some((index, seq));
        }
        None
    }

    /// Stops admitting: every queued request is answered 503 now.
    pub fn close(&self) {
        let jobs: Vec<Job> = {
            let mut q = self.queue();
            q.closed = true;
            q.tokens = 0;
            self.metrics.queue_depth.store(0, Relaxed);
            self.metrics.queue_tokens.store(0, Relaxed);
            q.jobs.drain(..).collect()
        };
        for job in jobs {
            let _ = job.reply.send(Err(ApiError::unavailable("the server is stopping; ask another")));
        }
        self.work.notify_all();
    }

    /// Whether every request taken into a step has been answered and the model thread is idle.
    pub fn drained(&self) -> bool {
        self.running().is_empty() && self.idle.load(Relaxed)
    }

    /// Requests taken into a step and not yet answered.
    pub fn running_count(&self) -> usize {
        self.running().len()
    }

    /// Answers every request still in a step 503 (the shutdown grace ran out).
    pub fn abandon_running(&self) {
        let jobs: Vec<Job> = self.running().drain().map(|(_, j)| j).collect();
        for job in jobs {
            let _ = job.reply.send(Err(ApiError::unavailable("the server is stopping; ask another")));
        }
    }

    /// Answers requests `indices` with `error` (those still waiting for a reply).
    fn fail(&self, indices: impl IntoIterator<Item = usize>, error: &ApiError) {
        let mut running = self.running();
        for index in indices {
            if let Some(job) = running.remove(&index) {
                let _ = job.reply.send(Err(error.clone()));
            }
        }
    }

    /// The model's loop: waits for requests, runs the decode loop of
    /// `strata generate` over them (continuous batching: a step holds
    /// chunks of several prompts), hands each step's states to the writer.
    /// Returns once closed and drained, or when the writer is gone.
    pub fn run_model(&self, model: &AnyModel, captures: &CaptureSet<usize>, to_writer: mpsc::SyncSender<ToWriter>) {
        // Every sequence takes at least a token of a step: the budget bounds how many share one.
        let opts = DecodeOptions { max_batch_tokens: self.budget, max_num_seqs: self.budget, kv_cache_bytes: None };
        let mut cache = AnyCache::default();
        let mut decode = match Decode::new(model, &mut cache, captures.clone(), opts, usize::MAX) {
            Ok(d) => d,
            Err(e) => {
                // Only a cache budget is measured at start, and there is none.
                tracing::error!("cannot start the decode loop: {e}");
                return;
            }
        };
        loop {
            {
                let mut q = self.queue();
                while q.jobs.is_empty() && decode.is_idle() {
                    if q.closed {
                        self.idle.store(true, Relaxed);
                        return;
                    }
                    self.idle.store(true, Relaxed);
                    q = self.work.wait_timeout(q, Duration::from_millis(500)).unwrap_or_else(|e| e.into_inner()).0;
                }
                self.idle.store(false, Relaxed);
            }
            if self.collect_failed.swap(false, Relaxed) {
                // A prompt split across steps cannot continue without its first chunks' states.
                self.restart(
                    &mut decode,
                    &mut cache,
                    &ApiError::internal("collecting an earlier step's states failed"),
                );
            }
            // Enough prompts to fill the next step.
            // (Counted once, then per prompt added: not a pass over the loop's sequences per prompt.)
            let mut pending = decode.pending_tokens();
            while pending < self.budget {
                let Some((index, seq)) = self.pop_live() else { break };
                pending += seq.prompt.len();
                if let Err(e) = decode.add(index, seq) {
                    self.fail([index], &ApiError::from_model("admitting the prompt", &e));
                }
            }
            // A generation whose client went away frees its place with this step.
            {
                let mut running = self.running();
                let gone: Vec<usize> = running
                    .iter()
                    .filter(|(_, j)| j.generate.is_some() && j.reply.is_closed())
                    .map(|(&i, _)| i)
                    .collect();
                for index in gone {
                    decode.cancel(index);
                    running.remove(&index);
                    self.metrics.reply(499);
                }
            }
            if decode.is_idle() {
                continue;
            }
            let t = Instant::now();
            let mut writer_gone = false;
            let r = decode.step(&mut cache, |segments, states| {
                let tokens: usize = segments.iter().map(|s| s.len).sum();
                let secs = t.elapsed().as_secs_f64();
                let _s = tracing::info_span!("step", tokens, requests = segments.len()).entered();
                self.metrics.step(tokens, (secs * 1e6) as u64);
                {
                    let mut tps = self.throughput.lock().unwrap_or_else(|e| e.into_inner());
                    let now = tokens as f64 / secs.max(1e-6);
                    *tps = if *tps == 0.0 { now } else { 0.8 * *tps + 0.2 * now };
                }
                writer_gone = to_writer.send(ToWriter::Step(segments.to_vec(), states)).is_err();
                Ok::<_, ModelError>(())
            });
            if writer_gone {
                return;
            }
            match r {
                Err(e) => {
                    tracing::error!("forward step failed: {e}");
                    self.restart(&mut decode, &mut cache, &ApiError::from_model("the forward step", &e));
                }
                Ok(finished) => {
                    // Generations are answered here; prefills by the writer, with their files.
                    let mut to_write = Vec::new();
                    {
                        let mut running = self.running();
                        for (index, g) in finished {
                            let Some(gen) = running.get(&index).and_then(|j| j.generate.as_ref()) else { continue };
                            self.metrics.generated_tokens.fetch_add(g.output.len() as u64, Relaxed);
                            if gen.write_states {
                                to_write.push((index, g));
                            } else {
                                let job = running.remove(&index).expect("checked");
                                let _ = job.reply.send(Ok(Answer::Tokens(g, None)));
                            }
                        }
                    }
                    // The writer has their last steps: it writes their files, then answers. (Sent
                    // with the lock released: the writer takes it while the channel is full.)
                    for (index, g) in to_write {
                        if to_writer.send(ToWriter::Done(index, g)).is_err() {
                            return;
                        }
                    }
                }
            }
        }
    }

    /// After a failed step: the prompts in flight are answered `error`
    /// (their chunks cannot continue without their cache), the queued ones
    /// go on in a fresh loop.
    fn restart(&self, decode: &mut Decode<'_, AnyModel, usize>, cache: &mut AnyCache, error: &ApiError) {
        let (running, waiting) = decode.abort();
        self.fail(running, error);
        *cache = AnyCache::default();
        for (index, seq) in waiting {
            if let Err(e) = decode.add(index, seq) {
                self.fail([index], &ApiError::from_model("admitting the prompt", &e));
            }
        }
    }

    /// The writer's loop: each finished prompt's states checked (NaN, Inf),
    /// encoded as the speculators file, written and answered. A prompt fed
    /// whole in one step is passed as a view of the step's states (no copy);
    /// one fed in chunks is copied chunk by chunk into its own buffer.
    pub fn run_writer(&self, from_model: mpsc::Receiver<ToWriter>, dtype: DType, points: &[String]) {
        // `[L, T, H]` of each prompt fed in chunks, until its last.
        let mut partial: HashMap<usize, CapturedStates<usize, usize>> = HashMap::new();
        // Per capture point `[tokens so far, H]` of each generation that writes its states.
        let mut generations: HashMap<usize, (usize, Vec<Vec<f32>>)> = HashMap::new();
        let mut encoder = SpeculatorsEncoder::new(dtype);
        let mut body = Vec::new();
        for message in from_model {
            let (segments, pending) = match message {
                ToWriter::Step(segments, pending) => (segments, pending),
                ToWriter::Done(index, g) => {
                    let (h, layers) = generations.remove(&index).unwrap_or_default();
                    self.emit_generation(index, g, h, layers, dtype, points, &mut encoder, &mut body);
                    continue;
                }
            };
            let t = Instant::now();
            // The device's last copies into host memory, completed here while the next step runs.
            let states = match pending.wait() {
                Ok(states) => states,
                Err(e) => {
                    tracing::error!("collecting a step's states failed: {e}");
                    let error = ApiError::from_model("collecting the step's states", &e);
                    self.fail(segments.iter().map(|s| s.index), &error);
                    partial.clear();
                    generations.clear();
                    self.collect_failed.store(true, Relaxed);
                    continue;
                }
            };
            let mut row = 0;
            for seg in &segments {
                let rows = row..row + seg.len;
                row += seg.len;
                // Prefills' states are written, and generations' that ask.
                let kind =
                    self.running().get(&seg.index).map(|j| (j.ids.len(), j.generate.as_ref().map(|g| g.write_states)));
                let total = match kind {
                    Some((total, None)) => total,
                    Some((_, Some(true))) => {
                        let h = states.hidden();
                        let (_, bufs) =
                            generations.entry(seg.index).or_insert_with(|| (h, vec![Vec::new(); states.layers()]));
                        for (k, buf) in bufs.iter_mut().enumerate() {
                            debug_assert_eq!(buf.len(), seg.pos0 * h, "a generation's rows come in order");
                            buf.extend_from_slice(&states.layer(k)[rows.start * h..rows.end * h]);
                        }
                        continue;
                    }
                    Some((_, Some(false))) => continue,
                    None => {
                        partial.remove(&seg.index);
                        generations.remove(&seg.index);
                        continue;
                    }
                };
                let r = if seg.pos0 == 0 && seg.len == total {
                    states
                        .view_tokens(rows)
                        .map(|view| self.emit(seg.index, view, dtype, points, &mut encoder, &mut body))
                } else {
                    let (l, h) = (states.layers(), states.hidden());
                    states.view_tokens(rows).map(|view| {
                        let buf = partial.entry(seg.index).or_insert_with(|| CapturedStates::zeros(l, total, h));
                        for k in 0..l {
                            buf.layer_mut(k)[seg.pos0 * h..(seg.pos0 + seg.len) * h].copy_from_slice(view.layer(k));
                        }
                        if seg.pos0 + seg.len == total {
                            let buf = partial.remove(&seg.index).expect("just filled");
                            self.emit(seg.index, buf.view(), dtype, points, &mut encoder, &mut body);
                        }
                    })
                };
                if let Err(e) = r {
                    tracing::error!("gathering a step failed: {e}");
                    let error = ApiError::internal(format!("gathering the step's states failed: {e}"));
                    self.fail([seg.index], &error);
                    partial.remove(&seg.index);
                }
            }
            // Prompts failed or cancelled elsewhere leave no buffer behind.
            if !partial.is_empty() || !generations.is_empty() {
                let running = self.running();
                partial.retain(|index, _| running.contains_key(index));
                generations.retain(|index, _| running.contains_key(index));
            }
            self.metrics.write_us.fetch_add(t.elapsed().as_micros() as u64, Relaxed);
        }
    }

    /// Writes the states file of generation `index` (`include_output_tokens`):
    /// its prompt and its tokens but the last, which no step fed before it
    /// was drawn (vLLM's contract; Strata's last feed of it is left out), and answers.
    #[allow(clippy::too_many_arguments)]
    fn emit_generation(
        &self,
        index: usize,
        g: Generated,
        h: usize,
        layers: Vec<Vec<f32>>,
        dtype: DType,
        points: &[String],
        encoder: &mut SpeculatorsEncoder,
        body: &mut Vec<u8>,
    ) {
        let Some(Job { mut ids, reservation, reply, span, .. }) = self.running().remove(&index) else { return };
        let _s = span.enter();
        if reply.is_closed() {
            self.metrics.reply(499);
            return;
        }
        ids.extend_from_slice(&g.output[..g.output.len().saturating_sub(1)]);
        let (n, l) = (ids.len(), layers.len());
        let values: Vec<f32> = layers
            .into_iter()
            .flat_map(|mut layer| {
                layer.truncate(n * h);
                layer
            })
            .collect();
        let states = match CapturedStates::try_from_vec(values, l, n, h) {
            Ok(s) => s,
            Err(e) => {
                let _ = reply.send(Err(ApiError::internal(format!("gathering the generation's states failed: {e}"))));
                return;
            }
        };
        let file = File { ids: &ids, what: "this generation", reservation, reply };
        self.write_answer(file, states.view(), dtype, points, encoder, body, |s| Answer::Tokens(g, Some(s)));
    }

    /// Checks, encodes, writes and answers request `index`'s prompt states `view` `[L, T, H]`.
    fn emit(
        &self,
        index: usize,
        view: StatesView<'_, usize, usize>,
        dtype: DType,
        points: &[String],
        encoder: &mut SpeculatorsEncoder,
        body: &mut Vec<u8>,
    ) {
        let Some(Job { ids, reservation, reply, span, .. }) = self.running().remove(&index) else { return };
        let _s = span.enter();
        if reply.is_closed() {
            // Its client hung up during the forward: no file.
            self.metrics.reply(499);
            return;
        }
        let what = format!("this prompt (of {} tokens)", ids.len());
        let file = File { ids: &ids, what: &what, reservation, reply };
        self.write_answer(file, view, dtype, points, encoder, body, Answer::File);
    }

    /// Checks `view` `[L, T, H]` (NaN, Inf), encodes it with its file's ids,
    /// writes it and answers with `answer` of the file written.
    #[allow(clippy::too_many_arguments)]
    fn write_answer(
        &self,
        file: File<'_>,
        view: StatesView<'_, usize, usize>,
        dtype: DType,
        points: &[String],
        encoder: &mut SpeculatorsEncoder,
        body: &mut Vec<u8>,
        answer: impl FnOnce(Served) -> Answer,
    ) {
        let File { ids, what, reservation, reply } = file;
        if let Some((l, nan, inf)) = crate::sink::nonfinite(&view, dtype) {
            let point = points.get(l).map_or("?", |p| p.as_str());
            let msg =
                format!("capture point {point} holds {nan} NaN and {inf} Inf values for {what}; no file was written");
            tracing::warn!("{msg}");
            let _ = reply.send(Err(ApiError::internal(msg)));
            return;
        }
        let (lead, _) = encoder.encode(ids, None, view, body);
        let outcome = self.store.write(reservation, &lead, body).map_err(|e| {
            tracing::error!("cannot write into {}: {e}", self.store.path().display());
            ApiError::internal(format!("cannot write the hidden states file: {e}"))
        });
        if let Err(Ok(Answer::File(served) | Answer::Tokens(_, Some(served)))) = reply.send(outcome.map(answer)) {
            // Its client hung up while the file was made.
            self.store.remove(&served.name);
            self.metrics.removed_unclaimed.fetch_add(1, Relaxed);
            self.metrics.reply(499);
        }
    }
}
