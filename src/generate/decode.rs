//! The decode loop: sequences in flight share forward steps, each step
//! holding prefill chunks and one-token decode segments side by side
//! (continuous batching), and every sequence whose prompt is complete
//! samples its next token from the step's logits.
//!
//! A sequence's tokens are fed once each, in order: its prompt in chunks
//! of the step's spare budget, then each sampled token in the step after
//! it was drawn; the last one is fed once more after the sequence ends
//! (its keys are then dropped), so that every token of the row has its
//! states. The states of a token do not depend on how it was batched
//! (bitwise, on the batch-invariant backends), and a token's draw depends
//! only on its logits and its [`DrawKey`], so the tokens do not either.
//!
//! A conversation's next turn continues the cache of the turn before it
//! (no second prefill of what they share): a [`Sequence`] that `park`s
//! keeps its cache when it ends, and one that `continues` it takes that
//! cache, cut back to their common prefix, and feeds the rest.

use super::sampling::{DrawKey, History, Sampler, SamplingParams};
use crate::model::{Model, ModelError, PendingStates, Sampled};
use crate::pipeline::batch::{PackedBatch, Segment};
use crate::pipeline::capture::CaptureSet;
use crate::shape::{CapturedStates, Dim};
use std::collections::VecDeque;
use tracing::info_span;

/// One generation to run.
#[derive(Clone, Debug)]
pub struct Sequence {
    /// The prompt's tokens (at least one).
    pub prompt: Vec<u32>,
    /// Most tokens to generate; 0: none, the prompt is only prefilled (its
    /// states captured, as a server's `max_tokens: 1` prompt for online
    /// training wants), and it ends with the step that feeds its last token.
    pub max_tokens: usize,
    /// How each token is chosen.
    pub params: SamplingParams,
    /// Tokens that end the generation (kept as its last token).
    pub stop: Vec<u32>,
    /// What its draws depend on; `position` is set per token.
    pub key: DrawKey,
    /// Keep its cache when it ends (parked), for a sequence that
    /// [`continues`](Self::continues) it; a parked cache not taken before
    /// the next step is dropped.
    pub park: bool,
    /// `(index, n)`: the first `n` prompt tokens are the first `n` tokens of
    /// the parked sequence `index` (its prompt and output): its cache holds
    /// them already, and only the rest is fed.
    pub continues: Option<(usize, usize)>,
}

/// Why a generation ended (vLLM's `finish_reason`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Finish {
    /// A stop token was drawn.
    Stop,
    /// `max_tokens` were drawn.
    Length,
}

/// A finished generation.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Generated {
    /// The tokens drawn, a stop token included.
    pub output: Vec<u32>,
    /// Why it ended.
    pub finish: Finish,
}

/// How steps are filled.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DecodeOptions {
    /// Most tokens a step holds (prefill chunks and decode tokens together).
    pub max_batch_tokens: usize,
    /// Most sequences in flight.
    pub max_num_seqs: usize,
    /// Most bytes of cache (keys, values, recurrent state) the sequences in
    /// flight hold together; `None`: no bound but `max_num_seqs`.
    pub kv_cache_bytes: Option<usize>,
}

/// What a sequence costs in cache, measured on the model itself
/// ([`CacheCost::measure`]): `per_position · positions + fixed`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CacheCost {
    /// Bytes per position (keys and values of every attention layer, every rank).
    pub per_position: usize,
    /// Bytes whatever the length (a Gated DeltaNet layer's conv and recurrent
    /// state, and its unfinished chunk's rows at their most).
    pub fixed: usize,
}

/// Keys no sequence uses: the probes of [`CacheCost::measure`].
const PROBE_KEY: u64 = u64::MAX - 1;

impl CacheCost {
    /// Bytes a sequence of `positions` positions holds at most.
    pub fn of(&self, positions: usize) -> usize {
        self.per_position.saturating_mul(positions).saturating_add(self.fixed)
    }

    /// Runs two probe sequences of the same tokens with two reservations
    /// and reads what the cache holds: the difference is the positions'
    /// cost, the rest the fixed state (probed at 63 positions, where an
    /// unfinished 64-token chunk of a Gated DeltaNet layer is longest).
    pub fn measure<M: Model, L: Dim>(
        model: &M,
        cache: &mut M::Cache,
        captures: &CaptureSet<L>,
        max_positions: usize,
    ) -> Result<Self, ModelError> {
        let n = 63.min(max_positions.saturating_sub(1)).max(1);
        let tokens = vec![0u32; n];
        let before = model.cache_bytes(cache)?;
        let mut held = [0usize; 2];
        for (i, reserve) in [n + 1, 2 * n + 2].into_iter().enumerate() {
            let mut batch = PackedBatch::new();
            batch.push_segment(&tokens, Segment { key: PROBE_KEY, pos0: 0, keep: true });
            batch.reserve(PROBE_KEY, reserve);
            model.forward_sample_pending(&batch, captures, cache, Some(&[]))?.states.wait()?;
            held[i] = model.cache_bytes(cache)? - before;
            batch.clear();
            batch.push_segment(&tokens[..1], Segment { key: PROBE_KEY, pos0: n, keep: false });
            model.forward_sample_pending(&batch, captures, cache, Some(&[]))?.states.wait()?;
        }
        let per_position = held[1].saturating_sub(held[0]) / (n + 1);
        Ok(CacheCost { per_position, fixed: held[0].saturating_sub(per_position * (n + 1)) })
    }
}

/// What a run of [`generate`] did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct DecodeStats {
    /// Forward steps.
    pub steps: usize,
    /// Tokens sampled.
    pub generated: usize,
    /// Most sequences in flight at once.
    pub max_in_flight: usize,
    /// Most bytes the cache held after a step (measured on the backend).
    pub cache_high_water: usize,
    /// Most bytes the sequences in flight had reserved.
    pub reserved_high_water: usize,
    /// Prompt tokens not fed again: an earlier turn's cache held them.
    pub reused: usize,
    /// Prompt tokens fed.
    pub prefilled: usize,
}

/// A sequence in flight.
struct Running {
    /// Its index in the caller's list.
    index: usize,
    /// Its cache's key: its index, or that of the sequence whose cache it continues.
    cache_key: u64,
    /// Bytes of cache it reserved (0 without a budget).
    need: usize,
    /// Its reservation has gone to the cache with its first segment.
    reserve_sent: bool,
    /// A prefill whose chunks run only to the capture points' depth (no
    /// generation was in flight when it began): a step that runs every
    /// layer cannot continue it, whose deeper layers hold none of its keys.
    shallow: bool,
    seq: Sequence,
    /// Prompt tokens fed so far.
    fed: usize,
    output: Vec<u32>,
    finish: Option<Finish>,
    /// Its last token was fed (after it finished): its keys are dropped.
    retired: bool,
}

impl Running {
    /// Position of the next token to feed.
    fn position(&self) -> usize {
        self.fed + self.output.len().saturating_sub(1)
    }
}

/// The cache of a sequence that ended and parked, until the next step.
struct Parked {
    cache_key: u64,
    /// Positions its cache holds (its prompt and output).
    positions: usize,
    /// Bytes it reserved.
    need: usize,
}

/// A step's segment: which sequence, and which of its positions the step fed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StepSegment {
    /// The sequence's index in the caller's list.
    pub index: usize,
    /// Position of the segment's first token in the sequence.
    pub pos0: usize,
    /// Tokens.
    pub len: usize,
}

/// The decode loop, one forward step at a time: sequences are added in
/// order of arrival, enter as the cache and `max_num_seqs` allow, and come
/// back finished from the step that fed their last token.
///
/// **Admission reserves.** A sequence enters when the cache its prompt and
/// its longest output need ([`CacheCost`]) fits beside what the sequences
/// in flight reserved, and its cache is allocated at that size at once: the
/// cache never grows past `opts.kv_cache_bytes`, nothing is preempted or
/// recomputed, and a sequence that ends early (a stop token) gives its
/// reservation back when its last token has been fed. Sequences enter in
/// order of arrival (one that does not fit waits, and so do those behind it).
///
/// **A continuation enters at once or starts over.** A sequence that
/// continues a parked cache takes that cache's reservation and enters
/// when [`add`](Self::add)ed, if its own fits there and in `max_num_seqs`;
/// otherwise the parked cache is dropped and it waits as a new sequence
/// (so no parked cache ever waits for room others hold).
pub struct Decode<'m, M: Model, L: Dim> {
    model: &'m M,
    captures: CaptureSet<L>,
    opts: DecodeOptions,
    cost: Option<CacheCost>,
    waiting: VecDeque<Running>,
    running: Vec<Running>,
    reserved: usize,
    /// Caches of sequences that ended this step, which a continuation may take.
    parked: std::collections::HashMap<usize, Parked>,
    /// Cache entries to cut back (or drop, at 0) with the next step.
    rewinds: Vec<(u64, usize)>,
    sampler: Sampler,
    stats: DecodeStats,
    batch: PackedBatch,
    sample: Vec<usize>,
    layout: Vec<StepSegment>,
}

impl<'m, M: Model, L: Dim> Decode<'m, M, L> {
    /// A loop over `model` capturing `captures`; with a cache budget, the
    /// model's [`CacheCost`] is measured first (sequences up to `max_positions`).
    pub fn new(
        model: &'m M,
        cache: &mut M::Cache,
        captures: CaptureSet<L>,
        opts: DecodeOptions,
        max_positions: usize,
    ) -> Result<Self, ModelError> {
        let cost = match opts.kv_cache_bytes {
            Some(_) => Some(CacheCost::measure(model, cache, &captures, max_positions)?),
            None => None,
        };
        Ok(Decode {
            model,
            captures,
            opts,
            cost,
            waiting: VecDeque::new(),
            running: Vec::new(),
            reserved: 0,
            parked: std::collections::HashMap::new(),
            rewinds: Vec::new(),
            sampler: Sampler::new(),
            stats: DecodeStats::default(),
            batch: PackedBatch::new(),
            sample: Vec::new(),
            layout: Vec::new(),
        })
    }

    /// The measured cost of a sequence's cache (with a budget).
    pub fn cost(&self) -> Option<CacheCost> {
        self.cost
    }

    /// Bytes of cache `seq` reserves (0 without a budget).
    pub fn need(&self, seq: &Sequence) -> usize {
        self.cost.map_or(0, |c| c.of(seq.prompt.len().saturating_add(seq.max_tokens)))
    }

    /// Why `seq` can never run here, if it cannot: more cache than the budget.
    pub fn refuse(&self, seq: &Sequence) -> Option<String> {
        let limit = self.opts.kv_cache_bytes?;
        let need = self.need(seq);
        (need > limit).then(|| {
            let (p, m) = (seq.prompt.len(), seq.max_tokens);
            format!("a prompt of {p} tokens and max_tokens {m} need {need} bytes of cache, more than --kv-cache-memory ({limit} bytes)")
        })
    }

    /// Queues `seq`, known to the caller as `index` (unique: it keys its
    /// cache), and returns how many of its prompt tokens a parked cache it
    /// continues holds already (0: none, it is prefilled whole).
    pub fn add(&mut self, index: usize, seq: Sequence) -> Result<usize, ModelError> {
        if let Some(problem) = self.refuse(&seq) {
            return Err(ModelError::Input { sample: index, problem });
        }
        let need = self.need(&seq);
        let continues = seq.continues;
        let mut r = Running {
            index,
            cache_key: index as u64,
            need,
            reserve_sent: false,
            shallow: false,
            seq,
            fed: 0,
            output: Vec::new(),
            finish: None,
            retired: false,
        };
        if let Some(p) = continues.and_then(|(from, _)| self.parked.remove(&from)) {
            // At least the prompt's last token is fed: it gives the first logits.
            let n = continues.map_or(0, |c| c.1).min(p.positions).min(r.seq.prompt.len() - 1);
            let reserved = self.reserved - p.need;
            let fits = self.running.len() < self.opts.max_num_seqs.max(1)
                && self.opts.kv_cache_bytes.is_none_or(|limit| reserved + need <= limit);
            if n > 0 && fits {
                if n < p.positions {
                    self.rewinds.push((p.cache_key, n));
                }
                self.reserved = reserved + need;
                self.stats.reused += n;
                (r.cache_key, r.fed) = (p.cache_key, n);
                self.running.push(r);
                return Ok(n);
            }
            self.rewinds.push((p.cache_key, 0));
            self.reserved = reserved;
        }
        self.waiting.push_back(r);
        Ok(0)
    }

    /// Drops every sequence in flight and queued (after a failed step,
    /// whose cache is then the caller's to drop): the indices of those that
    /// were in flight, and the queued ones, to add again.
    pub fn abort(&mut self) -> (Vec<usize>, Vec<(usize, Sequence)>) {
        let running = self.running.drain(..).map(|r| r.index).collect();
        let waiting = self.waiting.drain(..).map(|r| (r.index, r.seq)).collect();
        self.parked.clear();
        self.rewinds.clear();
        self.reserved = 0;
        (running, waiting)
    }

    /// Drops sequence `index` (its client went away): out of the queue, or
    /// out of flight with its cache dropped and its reservation given back
    /// with the next step. Whether it was there.
    pub fn cancel(&mut self, index: usize) -> bool {
        if let Some(at) = self.waiting.iter().position(|r| r.index == index) {
            self.waiting.remove(at);
            return true;
        }
        let Some(at) = self.running.iter().position(|r| r.index == index) else { return false };
        let r = self.running.remove(at);
        self.rewinds.push((r.cache_key, 0));
        self.reserved -= r.need;
        true
    }

    /// Tokens the next steps have to feed before any sequence is done with
    /// its prompt: the prompts queued and the rest of those in flight, and
    /// one per generation in flight (what a caller keeps above a step's
    /// budget to fill the steps).
    pub fn pending_tokens(&self) -> usize {
        let queued: usize = self.waiting.iter().map(|r| r.seq.prompt.len()).sum();
        let fed: usize = self.running.iter().map(|r| (r.seq.prompt.len() - r.fed).max(1)).sum();
        queued + fed
    }

    /// Sequences queued, not yet in flight.
    pub fn waiting(&self) -> usize {
        self.waiting.len()
    }

    /// Sequences in flight.
    pub fn in_flight(&self) -> usize {
        self.running.len()
    }

    /// Whether nothing is queued or in flight.
    pub fn is_idle(&self) -> bool {
        self.waiting.is_empty() && self.running.is_empty()
    }

    /// Bytes the sequences in flight reserved.
    pub fn reserved(&self) -> usize {
        self.reserved
    }

    /// What the loop has done so far.
    pub fn stats(&self) -> &DecodeStats {
        &self.stats
    }

    /// Runs one forward step: admits what fits, packs a chunk or a token of
    /// each sequence in flight (in order, up to the token budget), hands the
    /// step's segments and states `[L, T, H]` to `on_step` (the device's
    /// copies pending: a caller may complete them on another thread while
    /// the next step runs), samples, and returns the sequences whose last
    /// token this step fed.
    pub fn step<E: From<ModelError>>(
        &mut self,
        cache: &mut M::Cache,
        mut on_step: impl FnMut(&[StepSegment], PendingStates<L, M::Hidden>) -> Result<(), E>,
    ) -> Result<Vec<(usize, Generated)>, E> {
        let (budget, width) = (self.opts.max_batch_tokens.max(1), self.opts.max_num_seqs.max(1));
        // Parked caches no continuation took are dropped with this step.
        for (_, p) in self.parked.drain() {
            self.rewinds.push((p.cache_key, 0));
            self.reserved -= p.need;
        }
        while self.running.len() < width {
            let Some(front) = self.waiting.front() else { break };
            if self.opts.kv_cache_bytes.is_some_and(|limit| self.reserved + front.need > limit) {
                break;
            }
            self.reserved += front.need;
            self.running.push(self.waiting.pop_front().expect("checked"));
        }
        let stats = &mut self.stats;
        stats.max_in_flight = stats.max_in_flight.max(self.running.len());
        stats.reserved_high_water = stats.reserved_high_water.max(self.reserved);
        let (batch, sample, layout) = (&mut self.batch, &mut self.sample, &mut self.layout);
        batch.clear();
        sample.clear();
        layout.clear();
        // A step runs every layer while a generation is in flight (its later steps read every
        // layer's keys), else only to the capture points (a server's prefills alone). A prefill
        // begun at that depth continues there: generations wait out its chunks.
        let shallow_prefill = self.running.iter().any(|r| r.shallow && r.fed > 0);
        let full = !shallow_prefill && self.running.iter().any(|r| r.seq.max_tokens > 0);
        // `sample[j]` is the batch row of the j-th sampling sequence, `samplers[j]` its place in `running`.
        let mut samplers = Vec::new();
        for (i, r) in self.running.iter_mut().enumerate() {
            let room = budget - batch.num_tokens();
            if room == 0 {
                break;
            }
            if !full && r.seq.max_tokens > 0 {
                continue;
            }
            if r.fed == 0 && r.seq.max_tokens == 0 {
                r.shallow = !full;
            }
            let key = r.cache_key;
            let (pos0, tokens): (usize, &[u32]) = if r.fed < r.seq.prompt.len() {
                let end = r.seq.prompt.len().min(r.fed + room);
                (r.fed, &r.seq.prompt[r.fed..end])
            } else {
                (r.position(), std::slice::from_ref(r.output.last().expect("a sampled token")))
            };
            let len = tokens.len();
            if r.seq.max_tokens == 0 && r.fed + len == r.seq.prompt.len() {
                // A prefill: done with its prompt's last chunk.
                r.finish = Some(Finish::Length);
            }
            r.retired = r.finish.is_some();
            // A parking sequence keeps its last token's keys too: a continuation starts after it.
            let keep = !r.retired || r.seq.park;
            batch.push_segment(tokens, Segment { key, pos0, keep });
            if !r.reserve_sent && self.cost.is_some() {
                batch.reserve(key, r.seq.prompt.len().saturating_add(r.seq.max_tokens));
                r.reserve_sent = true;
            }
            layout.push(StepSegment { index: r.index, pos0, len });
            if r.fed < r.seq.prompt.len() {
                r.fed += len;
                stats.prefilled += len;
            }
            if !r.retired && r.fed == r.seq.prompt.len() {
                sample.push(batch.num_tokens() - 1);
                samplers.push(i);
            }
        }
        if batch.num_tokens() == 0 {
            return Ok(Vec::new());
        }
        for &(key, positions) in &self.rewinds {
            batch.rewind(key, positions);
        }
        self.rewinds.clear();
        let rows = full.then_some(&sample[..]);
        let Sampled { states, logits } = self.model.forward_sample_pending(batch, &self.captures, cache, rows)?;
        stats.steps += 1;
        stats.cache_high_water = stats.cache_high_water.max(self.model.cache_bytes(cache)?);
        on_step(layout, states)?;
        let logits = match (samplers.is_empty(), logits) {
            (true, _) => None,
            (false, Some(l)) => Some(l),
            (false, None) => return Err(ModelError::NoLmHead("a generation step returned no logits".into()).into()),
        };
        for (row, &i) in samplers.iter().enumerate() {
            let logits = logits.as_ref().expect("checked above");
            let r = &mut self.running[i];
            let history = History { prompt: &r.seq.prompt, output: &r.output };
            let key = DrawKey { position: (r.seq.prompt.len() + r.output.len()) as u32, ..r.seq.key };
            let token = self.sampler.sample(logits.row(row), &r.seq.params, history, key);
            r.output.push(token);
            stats.generated += 1;
            if r.seq.stop.contains(&token) {
                r.finish = Some(Finish::Stop);
            } else if r.output.len() >= r.seq.max_tokens {
                r.finish = Some(Finish::Length);
            }
        }
        // Sequences whose last token was fed this step are done.
        let (finished, kept): (Vec<_>, Vec<_>) = std::mem::take(&mut self.running).into_iter().partition(|r| r.retired);
        self.running = kept;
        let mut out = Vec::with_capacity(finished.len());
        for r in finished {
            if r.seq.park {
                let positions = r.seq.prompt.len() + r.output.len();
                self.parked.insert(r.index, Parked { cache_key: r.cache_key, positions, need: r.need });
            } else {
                self.reserved -= r.need;
            }
            out.push((r.index, Generated { output: r.output, finish: r.finish.expect("finished") }));
        }
        Ok(out)
    }
}

/// Runs `seqs` to completion through a [`Decode`] loop and returns each
/// one's tokens, in the caller's order, with what the run did. After each
/// step, `on_step` gets the step's segments and its captured states
/// `[L, T, H]` (rows in segment order).
pub fn generate<M: Model, L: Dim>(
    model: &M,
    cache: &mut M::Cache,
    captures: &CaptureSet<L>,
    seqs: Vec<Sequence>,
    opts: DecodeOptions,
    mut on_step: impl FnMut(&[StepSegment], CapturedStates<L, M::Hidden>) -> Result<(), ModelError>,
) -> Result<(Vec<Generated>, DecodeStats), ModelError> {
    let n = seqs.len();
    let _span = info_span!("generate", sequences = n).entered();
    let max_positions = seqs.iter().map(|s| s.prompt.len().saturating_add(s.max_tokens)).max().unwrap_or(1);
    let mut d = Decode::new(model, cache, captures.clone(), opts, max_positions)?;
    for (i, s) in seqs.into_iter().enumerate() {
        d.add(i, s)?;
    }
    let mut done: Vec<Option<Generated>> = vec![None; n];
    while !d.is_idle() {
        for (i, g) in d.step(cache, |segments, states| on_step(segments, states.wait()?))? {
            done[i] = Some(g);
        }
    }
    Ok((done.into_iter().map(|g| g.expect("every sequence ends")).collect(), d.stats().clone()))
}
