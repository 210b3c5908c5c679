//! What every decoder's forward shares: input checks, the embedding lookup,
//! the RoPE table, and filling the capture points as the residual stream passes.

use super::ModelError;
use crate::batch::PackedBatch;
use crate::capture::{CaptureSet, Tap};
use crate::checkpoint::{Checkpoint, CheckpointError};
use crate::cpu::ops::rms_norm;
use crate::cpu::PackedLinear;
use crate::shape::{CapturedStates, DType, Dim};
use crate::tp::Collective;

/// `x += input · Wᵀ (+ b)` for a row-parallel weight: one rank (`comm = None`)
/// fuses the residual add into the GEMM; several sum their partial products
/// (in `partial`, `[t, out]`) with an all-reduce, then add the bias once.
pub(crate) fn row_parallel(
    comm: Option<&dyn Collective<Buf = [f32]>>,
    w: &PackedLinear,
    bias: Option<&[f32]>,
    input: &[f32],
    t: usize,
    x: &mut [f32],
    partial: &mut Vec<f32>,
) {
    let Some(comm) = comm else {
        w.forward(input, t, x, true);
        return;
    };
    partial.resize(t * w.out_features(), 0.0);
    w.forward(input, t, partial, false);
    comm.all_reduce_sum(partial);
    x.iter_mut().zip(partial.iter()).for_each(|(x, p)| *x += p);
    if let Some(b) = bias {
        for row in x.chunks_exact_mut(b.len()) {
            row.iter_mut().zip(b).for_each(|(x, b)| *x += b);
        }
    }
}

/// Checks a batch: no empty segment, no position past `max_positions`, token ids below `vocab`.
pub(crate) fn check_batch(batch: &PackedBatch, vocab: usize, max_positions: usize) -> Result<(), ModelError> {
    for (s, seg) in batch.segments().iter().enumerate() {
        let r = batch.range(s);
        let err = |problem: String| ModelError::Input { sample: s, problem };
        if r.is_empty() {
            return Err(err("empty sample (no tokens)".into()));
        }
        if seg.pos0 + r.len() > max_positions {
            return Err(err(format!("{} tokens exceed max_position_embeddings {max_positions}", seg.pos0 + r.len())));
        }
        if let Some((pos, &t)) = batch.token_ids()[r].iter().enumerate().find(|(_, &t)| t as usize >= vocab) {
            return Err(err(format!(
                "token id {t} at position {} is out of range (vocab_size {vocab})",
                seg.pos0 + pos
            )));
        }
    }
    Ok(())
}

/// The embedding table `[vocab, h]`, held in its checkpoint dtype (a row is
/// decoded when a token looks it up), so a bf16 table is not doubled in memory.
pub(crate) struct Embedding {
    bytes: Vec<u8>,
    dtype: DType,
    h: usize,
}

impl Embedding {
    /// Reads `model.embed_tokens.weight`.
    pub(crate) fn read(ckpt: &Checkpoint, vocab: usize, h: usize) -> Result<Self, CheckpointError> {
        let (bytes, dtype) = ckpt.read_bytes("model.embed_tokens.weight", &[vocab, h])?;
        Ok(Embedding { bytes, dtype, h })
    }

    /// The stored dtype.
    pub(crate) fn dtype(&self) -> DType {
        self.dtype
    }

    /// Bytes held.
    pub(crate) fn resident_bytes(&self) -> usize {
        self.bytes.len()
    }

    /// The residual stream's start: each token's row of the table.
    pub(crate) fn embed(&self, batch: &PackedBatch) -> Vec<f32> {
        let (h, es) = (self.h, self.dtype.size());
        let mut x = vec![0f32; batch.num_tokens() * h];
        for (row, &id) in x.chunks_exact_mut(h).zip(batch.token_ids()) {
            let id = id as usize;
            self.dtype.decode_into(&self.bytes[id * h * es..(id + 1) * h * es], row);
        }
        x
    }
}

/// cos/sin (times `scale`) of every position below `len`, `[len, inv_freq.len()]` each.
pub(crate) fn rope_table(inv_freq: &[f32], len: usize, scale: f32) -> (Vec<f32>, Vec<f32>) {
    let half = inv_freq.len();
    let mut cos = vec![0f32; len * half];
    let mut sin = vec![0f32; len * half];
    for p in 0..len {
        for (i, f) in inv_freq.iter().enumerate() {
            let a = p as f32 * f;
            cos[p * half + i] = a.cos() * scale;
            sin[p * half + i] = a.sin() * scale;
        }
    }
    (cos, sin)
}

/// The capture side of one forward: which taps fill which slots, how deep the
/// forward must go, and the `[L, T, H]` buffer (only on a capturing rank).
pub(crate) struct Captures<L: Dim, H: Dim> {
    taps: Vec<Tap>,
    /// Layers to run: none past the deepest capture point.
    pub depth: usize,
    post_norm: bool,
    out: Option<CapturedStates<L, H>>,
}

impl<L: Dim, H: Dim> Captures<L, H> {
    /// Resolves the capture points against `num_layers`; allocates the buffer if `capture`.
    pub fn new(
        captures: &CaptureSet<L>,
        num_layers: usize,
        tokens: usize,
        hidden: H,
        capture: bool,
    ) -> Result<Self, ModelError> {
        let taps = captures.taps(num_layers)?;
        let post_norm = taps.contains(&Tap::PostNorm);
        let depth = if post_norm {
            num_layers
        } else {
            taps.iter().map(|tap| if let Tap::Residual(k) = tap { *k } else { 0 }).max().unwrap_or(0)
        };
        let out = capture.then(|| CapturedStates::zeros(captures.layers(), tokens, hidden));
        Ok(Captures { taps, depth, post_norm, out })
    }

    /// Copies `src` (whole `[T, H]` residual states) into every slot that reads `tap`.
    pub fn record(&mut self, tap: Tap, src: &[f32]) {
        let Some(out) = &mut self.out else { return };
        for (slot, _) in self.taps.iter().enumerate().filter(|(_, &x)| x == tap) {
            out.layer_mut(slot).copy_from_slice(src);
        }
    }

    /// Records the residual after the last layer run and, if asked for (on a
    /// capturing rank), the final norm of it; returns the filled buffer
    /// (`None` on a non-capturing rank). `scratch` is `[T, H]` working space.
    pub fn finish(mut self, x: &[f32], norm: &[f32], eps: f32, scratch: &mut Vec<f32>) -> Option<CapturedStates<L, H>> {
        self.record(Tap::Residual(self.depth), x);
        if self.post_norm && self.out.is_some() {
            scratch.resize(x.len(), 0.0);
            rms_norm(x, norm, eps, scratch);
            self.record(Tap::PostNorm, scratch);
        }
        self.out
    }
}
