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

use super::sampling::{DrawKey, History, Sampler, SamplingParams};
use crate::model::{Model, ModelError, Sampled};
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
    /// Most tokens to generate (at least one).
    pub max_tokens: usize,
    /// How each token is chosen.
    pub params: SamplingParams,
    /// Tokens that end the generation (kept as its last token).
    pub stop: Vec<u32>,
    /// What its draws depend on; `position` is set per token.
    pub key: DrawKey,
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
}

/// A sequence in flight.
struct Running {
    /// Its index in the caller's list (also its cache key).
    index: usize,
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

/// A step's segment: which sequence, which positions, whether it samples.
pub struct StepSegment {
    /// The sequence's index in the caller's list.
    pub index: usize,
    /// Position of the segment's first token in the sequence.
    pub pos0: usize,
    /// Tokens.
    pub len: usize,
}

/// Runs `seqs` to completion, `opts.max_num_seqs` at a time in order of
/// arrival, and returns each one's tokens, in the caller's order. After
/// each step, `on_step` gets the step's segments and its captured states
/// `[L, T, H]` (rows in segment order).
pub fn generate<M: Model, L: Dim>(
    model: &M,
    cache: &mut M::Cache,
    captures: &CaptureSet<L>,
    seqs: Vec<Sequence>,
    opts: DecodeOptions,
    mut on_step: impl FnMut(&[StepSegment], CapturedStates<L, M::Hidden>) -> Result<(), ModelError>,
) -> Result<Vec<Generated>, ModelError> {
    let n = seqs.len();
    let _span = info_span!("generate", sequences = n).entered();
    let (budget, width) = (opts.max_batch_tokens.max(1), opts.max_num_seqs.max(1));
    let mut waiting: VecDeque<Running> = seqs
        .into_iter()
        .enumerate()
        .map(|(index, seq)| Running { index, seq, fed: 0, output: Vec::new(), finish: None, retired: false })
        .collect();
    let mut running: Vec<Running> = Vec::new();
    let mut done: Vec<Option<Generated>> = vec![None; n];
    let mut sampler = Sampler::new();
    let (mut batch, mut sample, mut layout) = (PackedBatch::new(), Vec::new(), Vec::new());
    while !(waiting.is_empty() && running.is_empty()) {
        while running.len() < width {
            match waiting.pop_front() {
                Some(r) => running.push(r),
                None => break,
            }
        }
        batch.clear();
        sample.clear();
        layout.clear();
        // `sample[j]` is the batch row of the j-th sampling sequence in `running`.
        let mut samplers = Vec::new();
        for (i, r) in running.iter_mut().enumerate() {
            let room = budget - batch.num_tokens();
            if room == 0 {
                break;
            }
            let key = r.index as u64;
            let (pos0, tokens): (usize, &[u32]) = if r.fed < r.seq.prompt.len() {
                let end = r.seq.prompt.len().min(r.fed + room);
                (r.fed, &r.seq.prompt[r.fed..end])
            } else {
                (r.position(), std::slice::from_ref(r.output.last().expect("a sampled token")))
            };
            let len = tokens.len();
            let keep = r.finish.is_none();
            r.retired = !keep;
            batch.push_segment(tokens, Segment { key, pos0, keep });
            layout.push(StepSegment { index: r.index, pos0, len });
            if r.fed < r.seq.prompt.len() {
                r.fed += len;
            }
            if keep && r.fed == r.seq.prompt.len() {
                sample.push(batch.num_tokens() - 1);
                samplers.push(i);
            }
        }
        let Sampled { states, logits } = model.forward_sample_pending(&batch, captures, cache, Some(&sample))?;
        on_step(&layout, states.wait()?)?;
        let logits = logits.ok_or_else(|| ModelError::NoLmHead("a generation step returned no logits".into()))?;
        for (row, &i) in samplers.iter().enumerate() {
            let r = &mut running[i];
            let history = History { prompt: &r.seq.prompt, output: &r.output };
            let key = DrawKey { position: (r.seq.prompt.len() + r.output.len()) as u32, ..r.seq.key };
            let token = sampler.sample(logits.row(row), &r.seq.params, history, key);
            r.output.push(token);
            if r.seq.stop.contains(&token) {
                r.finish = Some(Finish::Stop);
            } else if r.output.len() >= r.seq.max_tokens {
                r.finish = Some(Finish::Length);
            }
        }
        // Sequences whose last token was fed this step are done.
        let (finished, kept): (Vec<_>, Vec<_>) = std::mem::take(&mut running).into_iter().partition(|r| r.retired);
        running = kept;
        for r in finished {
            done[r.index] = Some(Generated { output: r.output, finish: r.finish.expect("finished") });
        }
    }
    Ok(done.into_iter().map(|g| g.expect("every sequence ends")).collect())
}
