//! The CPU backend: a packed f32 GEMM over f32 or quantised weight panels
//! (AVX-512 or AVX2 micro-kernels chosen at run time, a portable fallback),
//! rayon across rows and heads, ranks as threads joined by a [`LocalGroup`].
//!
//! Every reduction runs in an order fixed by the data's absolute positions,
//! never by how samples were packed or how work was split, so outputs are
//! bitwise independent of the batch.

pub mod alloc;
pub mod attention;
pub mod delta;
pub mod gemm;
pub mod linear;
pub mod moe;
pub mod ops;
pub mod panels;
pub mod quant_panels;

pub use alloc::CacheAligned;
/// The bf16 paths, as `cpu::bf16` (`has_native_bf16`, `kernel_override`).
pub use gemm::bf16;
pub use gemm::f32::gemm_packed;
pub use gemm::Init;
pub use linear::PackedLinear;
pub use panels::{pack_b, MR, NR};

use super::host;
use super::{
    AttentionOps, AttnShape, BackendError, Cols, Compute, ComputeDtype, DeltaCache, DeltaGates, DeltaRule, DeltaShape,
    DeviceOps, FusedOps, GatedLinear, Gating, Glu, HeadSpan, HeadSums, KvCache, LayerState, LinearInfo, MoeOps,
    Parallel, Qkv, RecurrentOps, Resident, RopeInfo, Router, RowOps, Temperature, Tensor, Weights, F32,
};
use crate::hf::quant::{LinearWeight, QuantKind};
use crate::hf::RopeFreqs;
use crate::parallel::{Collective, LocalGroup};
use crate::pipeline::batch::PackedBatch;
use crate::shape::Dim;
use attention::{varlen_attention, AttnSegment, KvRef};
use rayon::prelude::*;
use std::marker::PhantomData;
use std::sync::Mutex;

/// A raw pointer into an output buffer shared by parallel tasks that write
/// disjoint parts of it (GEMM tiles, attention heads).
#[derive(Clone, Copy)]
pub(crate) struct SharedMut(*mut f32);

// SAFETY: every user hands each task a disjoint region of the buffer.
unsafe impl Send for SharedMut {}
unsafe impl Sync for SharedMut {}

impl SharedMut {
    pub(crate) fn new(p: *mut f32) -> Self {
        SharedMut(p)
    }
    // A method, so closures capture the Sync wrapper rather than the raw field.
    pub(crate) fn get(self) -> *mut f32 {
        self.0
    }
}

/// The CPU backend of one rank, computing in `C` ([`F32`] or [`super::Bf16`]).
pub struct Cpu<C = F32> {
    /// The rank's communicator; `None` for a model run whole.
    comm: Option<LocalGroup>,
    /// A row-parallel layer's partial output before the all-reduce.
    partial: Mutex<Vec<f32>>,
    _compute: PhantomData<C>,
}

impl<C: ComputeDtype> Default for Cpu<C> {
    fn default() -> Self {
        Cpu { comm: None, partial: Mutex::new(Vec::new()), _compute: PhantomData }
    }
}

/// A linear layer: packed panels, and for a row-parallel layer split over
/// ranks the bias added once after the all-reduce.
pub struct Linear {
    packed: PackedLinear,
    kind: Parallel,
    post_bias: Option<Vec<f32>>,
}

impl Resident for Linear {
    fn resident_bytes(&self) -> usize {
        self.packed.resident_bytes() + self.post_bias.as_ref().map_or(0, |b| b.len() * 4)
    }
}

impl LinearInfo for Linear {
    fn out_features(&self) -> usize {
        self.packed.out_features()
    }
    fn in_features(&self) -> usize {
        self.packed.in_features()
    }
    fn held_as(&self) -> Option<QuantKind> {
        self.packed.held_as()
    }
}

/// cos/sin (times the RoPE scale) of every position of a step, `[len, half]` each.
pub struct RopeTable {
    cos: Vec<f32>,
    sin: Vec<f32>,
    half: usize,
}

impl RopeInfo for RopeTable {
    fn half(&self) -> usize {
        self.half
    }
}

impl RopeTable {
    fn at(&self, pos: usize) -> (&[f32], &[f32]) {
        let h = self.half;
        (&self.cos[pos * h..(pos + 1) * h], &self.sin[pos * h..(pos + 1) * h])
    }
}

impl<C: ComputeDtype> host::Host for Cpu<C> {}

impl<C: ComputeDtype> DeviceOps for Cpu<C> {
    type Compute = C;

    const NAME: &'static str = "cpu";

    fn native_bf16() -> bool {
        bf16::has_native_bf16()
    }

    fn kernel(&self) -> &'static str {
        linear::kernel_name_for(C::COMPUTE)
    }

    fn rank(&self) -> usize {
        self.comm.as_ref().map_or(0, |c| c.rank())
    }

    fn world_size(&self) -> usize {
        self.comm.as_ref().map_or(1, |c| c.world_size())
    }

    fn group(&self, n: usize) -> Result<Vec<Self>, BackendError> {
        if n == 0 {
            return Err(BackendError::Unsupported("--tp must be at least 1".into()));
        }
        Ok(LocalGroup::new(n)
            .into_iter()
            .map(|g| Cpu { comm: Some(g), partial: Mutex::new(Vec::new()), _compute: PhantomData })
            .collect())
    }

    fn abort_group(&self, why: &str) {
        if let Some(c) = &self.comm {
            c.abort(why);
        }
    }

    fn all_reduce<W: Dim>(&self, x: &mut Tensor<Self, W>) {
        if let Some(comm) = &self.comm {
            comm.all_reduce_sum(x.storage_mut());
        }
    }
}

impl<C: ComputeDtype> Weights for Cpu<C> {
    type Linear = Linear;

    fn linear(&self, w: LinearWeight, bias: Option<Vec<f32>>, kind: Parallel) -> Linear {
        self.linear_in(w, bias, kind, C::COMPUTE)
    }

    fn linear_f32(&self, w: LinearWeight, bias: Option<Vec<f32>>, kind: Parallel) -> Linear {
        self.linear_in(w, bias, kind, Compute::F32)
    }

    fn build_many<T: Send, E: Send>(
        &self,
        n: usize,
        f: impl Fn(usize) -> Result<T, E> + Sync + Send,
    ) -> Result<Vec<T>, E> {
        // Reading and repacking experts (decoding INT4 nibbles, transposing
        // into panels) is most of a MoE model's load time.
        (0..n).into_par_iter().map(f).collect()
    }
}

impl<C: ComputeDtype> RowOps for Cpu<C> {
    type RopeTable = RopeTable;

    fn embed_unchecked<H: Dim>(&self, table: &host::Embedding, batch: &PackedBatch, out: &mut Tensor<Self, H>) {
        table.lookup(batch.token_ids(), out.storage_mut());
    }

    fn rms_norm_unchecked<W: Dim>(&self, x: Cols<'_, Self>, w: &Vec<f32>, eps: f32, out: &mut Tensor<Self, W>) {
        if x.offset == 0 && x.width == x.stride {
            ops::rms_norm(&x.storage[..x.rows * x.stride], w, eps, out.storage_mut());
        } else {
            let rows = x.storage.chunks_exact(x.stride).zip(out.storage_mut().chunks_exact_mut(x.width));
            for (row, dst) in rows {
                ops::rms_norm(&row[x.offset..x.offset + x.width], w, eps, dst);
            }
        }
    }

    fn rms_norm_heads_unchecked(&self, x: &mut Tensor<Self>, heads: HeadSpan, w: &Vec<f32>, eps: f32) {
        let stride = x.width();
        for row in x.storage_mut().chunks_exact_mut(stride) {
            for i in 0..heads.count {
                let o = heads.offset + i * heads.stride;
                ops::rms_norm_heads_inplace(&mut row[o..o + heads.width], w, eps);
            }
        }
    }

    fn sum_squares_heads_unchecked(&self, x: &Tensor<Self>, heads: HeadSpan, out: &mut Tensor<Self>, col: usize) {
        let (xw, ow) = (x.width(), out.width());
        for (row, o) in x.storage().chunks_exact(xw).zip(out.storage_mut().chunks_exact_mut(ow)) {
            for h in 0..heads.count {
                let s = heads.offset + h * heads.stride;
                o[col + h] = ops::sum_squares(&row[s..s + heads.width]);
            }
        }
    }

    fn scale_heads_rms_unchecked(
        &self,
        x: &mut Tensor<Self>,
        heads: HeadSpan,
        sums: HeadSums<'_, Self>,
        w: &Vec<f32>,
        eps: f32,
    ) {
        let HeadSums { sums, col, n } = sums;
        let (xw, sw) = (x.width(), sums.width());
        for (row, s) in x.storage_mut().chunks_exact_mut(xw).zip(sums.storage().chunks_exact(sw)) {
            for h in 0..heads.count {
                // As rms_norm_heads: the mean, then 1/sqrt of it plus eps.
                let inv = 1.0 / (s[col + h] / n as f32 + eps).sqrt();
                let o = heads.offset + h * heads.stride;
                for (v, w) in row[o..o + heads.width].iter_mut().zip(w) {
                    *v = w * (*v * inv);
                }
            }
        }
    }

    fn rope_table(&self, freqs: &RopeFreqs, len: usize) -> RopeTable {
        let half = freqs.inv_freq.len();
        let mut cos = vec![0f32; len * half];
        let mut sin = vec![0f32; len * half];
        for p in 0..len {
            for (i, f) in freqs.inv_freq.iter().enumerate() {
                let a = p as f32 * f;
                cos[p * half + i] = a.cos() * freqs.scale;
                sin[p * half + i] = a.sin() * freqs.scale;
            }
        }
        RopeTable { cos, sin, half }
    }

    fn rope_unchecked(
        &self,
        x: &mut Tensor<Self>,
        heads: HeadSpan,
        interleave: bool,
        table: &RopeTable,
        batch: &PackedBatch,
    ) {
        let stride = x.width();
        // Rows are independent: blocks of them run on every thread.
        const ROWS: usize = 32;
        let rotate = |tmp: &mut Vec<f32>, row: &mut [f32], pos: usize| {
            let (cs, sn) = table.at(pos);
            if heads.stride == heads.width && !interleave {
                // Contiguous heads (Llama's q and k): one pass over the block.
                let block = &mut row[heads.offset..heads.offset + heads.count * heads.width];
                block.chunks_exact_mut(heads.width).for_each(|head| ops::rope_head(head, cs, sn));
                return;
            }
            tmp.resize(heads.width, 0.0);
            for h in 0..heads.count {
                let o = heads.offset + h * heads.stride;
                let head = &mut row[o..o + heads.width];
                if interleave {
                    ops::rope_interleaved(head, cs, sn, tmp);
                } else {
                    ops::rope_head(head, cs, sn);
                }
            }
        };
        let mut tmp = Vec::new();
        for (s, seg) in batch.segments().iter().enumerate() {
            let r = batch.range(s);
            let rows = &mut x.storage_mut()[r.start * stride..r.end * stride];
            if r.len() <= ROWS {
                // A short segment stays on this thread: handing it to the pool costs more.
                for (i, row) in rows.chunks_exact_mut(stride).enumerate() {
                    rotate(&mut tmp, row, seg.pos0 + i);
                }
                continue;
            }
            rows.par_chunks_mut(ROWS * stride).enumerate().for_each_init(Vec::new, |tmp, (c, rows)| {
                for (i, row) in rows.chunks_exact_mut(stride).enumerate() {
                    rotate(tmp, row, seg.pos0 + c * ROWS + i);
                }
            });
        }
    }

    fn glu_unchecked(&self, act: Glu, gate_up: &Tensor<Self>, out: &mut Tensor<Self>) {
        let inter = out.width();
        ops::glu(act, gate_up.storage(), inter, out.storage_mut());
    }

    fn attn_temperature_unchecked(&self, x: &mut Tensor<Self>, heads: HeadSpan, t: Temperature, batch: &PackedBatch) {
        let width = x.width();
        let rows = x.storage_mut();
        for (s, seg) in batch.segments().iter().enumerate() {
            for (i, row) in batch.range(s).enumerate() {
                let f = t.at(seg.pos0 + i);
                let row = &mut rows[row * width..(row + 1) * width];
                for h in 0..heads.count {
                    let o = heads.offset + h * heads.stride;
                    row[o..o + heads.width].iter_mut().for_each(|v| *v *= f);
                }
            }
        }
    }

    fn scale<W: Dim>(&self, x: &mut Tensor<Self, W>, s: f32) {
        x.storage_mut().iter_mut().for_each(|x| *x *= s);
    }

    fn add_unchecked<W: Dim>(&self, x: &mut Tensor<Self, W>, y: &Tensor<Self, W>) {
        x.storage_mut().iter_mut().zip(y.storage()).for_each(|(x, y)| *x += y);
    }

    fn copy_heads_unchecked(&self, src: &Tensor<Self>, from: HeadSpan, dst: &mut Tensor<Self>, to: HeadSpan) {
        let (ss, ds) = (src.width(), dst.width());
        for (s, d) in src.storage().chunks_exact(ss).zip(dst.storage_mut().chunks_exact_mut(ds)) {
            for i in 0..to.count {
                let (a, b) = (from.offset + i * from.stride, to.offset + i * to.stride);
                d[b..b + to.width].copy_from_slice(&s[a..a + to.width]);
            }
        }
    }

    fn gather_rows_unchecked<W: Dim>(&self, x: &Tensor<Self, W>, rows: &[usize], out: &mut Tensor<Self, W>) {
        let w = x.width().size();
        for (&r, dst) in rows.iter().zip(out.storage_mut().chunks_exact_mut(w)) {
            dst.copy_from_slice(&x.storage()[r * w..(r + 1) * w]);
        }
    }

    fn linear_forward_unchecked<W: Dim, V: Dim>(&self, l: &Linear, x: &Tensor<Self, W>, out: &mut Tensor<Self, V>) {
        l.packed.forward(x.storage(), x.rows(), out.storage_mut(), false);
        if l.kind == Parallel::Row {
            self.all_reduce(out);
            if let Some(b) = &l.post_bias {
                add_bias(out.storage_mut(), b);
            }
        }
    }

    fn linear_add_unchecked<W: Dim, V: Dim>(&self, l: &Linear, x: &Tensor<Self, W>, residual: &mut Tensor<Self, V>) {
        let (Some(comm), Parallel::Row) = (&self.comm, l.kind) else {
            // One rank: the residual add is fused into the GEMM.
            l.packed.forward(x.storage(), x.rows(), residual.storage_mut(), true);
            return;
        };
        let mut partial = self.partial.lock().expect("partial buffer");
        partial.resize(x.rows() * l.packed.out_features(), 0.0);
        l.packed.forward(x.storage(), x.rows(), &mut partial, false);
        comm.all_reduce_sum(&mut partial);
        residual.storage_mut().iter_mut().zip(partial.iter()).for_each(|(x, p)| *x += p);
        if let Some(b) = &l.post_bias {
            add_bias(residual.storage_mut(), b);
        }
    }

    fn sigmoid_mul_unchecked<W: Dim>(&self, x: &mut Tensor<Self, W>, gate: Cols<'_, Self>) {
        let w = x.width().size().max(1);
        for (r, row) in x.storage_mut().chunks_exact_mut(w).enumerate() {
            let g = &gate.storage[r * gate.stride + gate.offset..][..gate.width];
            for (i, v) in row.iter_mut().enumerate() {
                let gi = if gate.width == 1 { g[0] } else { g[i] };
                *v *= 1.0 / (1.0 + ops::exp(-gi));
            }
        }
    }
}

impl<C: ComputeDtype> AttentionOps for Cpu<C> {
    type KvCache = KvCache;

    fn attention_unchecked(
        &self,
        qkv: Qkv<'_, Self>,
        shape: AttnShape,
        sinks: Option<&Vec<f32>>,
        batch: &PackedBatch,
        kv: LayerState<'_, KvCache>,
        out: &mut Tensor<Self>,
    ) {
        let (Qkv { q, k, v }, LayerState { state: cache, layer }) = (qkv, kv);
        // Chunks of longer samples add their keys/values to the cache and read
        // all earlier positions from it; whole samples read their own rows.
        let (kw, vw) = (k.width, v.width);
        for (s, seg) in batch.segments().iter().enumerate().filter(|(_, g)| g.uses_cache()) {
            let entry = cache.layer_mut(seg.key, layer, kw, vw);
            for row in batch.range(s) {
                entry.k.extend_from_slice(&k.storage[row * k.stride + k.offset..][..kw]);
                entry.v.extend_from_slice(&v.storage[row * v.stride + v.offset..][..vw]);
            }
        }
        let segments: Vec<AttnSegment> = batch
            .segments()
            .iter()
            .enumerate()
            .map(|(s, seg)| {
                let rows = batch.range(s);
                let kv = if seg.uses_cache() {
                    let e = cache.layer(seg.key, layer);
                    KvRef { k: &e.k, v: &e.v, stride: kw, v_stride: vw }
                } else {
                    KvRef {
                        k: &k.storage[rows.start * k.stride + k.offset..],
                        v: &v.storage[rows.start * v.stride + v.offset..],
                        stride: k.stride,
                        v_stride: v.stride,
                    }
                };
                AttnSegment { rows, pos0: seg.pos0, kv }
            })
            .collect();
        let (q0, sinks) = (&q.storage[q.offset..], sinks.map(|s| s.as_slice()));
        varlen_attention(q0, q.stride, &segments, shape, sinks, C::COMPUTE, out.storage_mut());
    }
}

impl<C: ComputeDtype> MoeOps for Cpu<C> {
    type Routes = moe::Routes;

    fn moe_route_unchecked(
        &self,
        logits: &Tensor<Self>,
        router: &Router,
        correction: Option<&Vec<f32>>,
    ) -> moe::Routes {
        moe::route(logits.storage(), logits.width(), router, correction.map(|c| c.as_slice()))
    }

    fn moe_experts_unchecked<H: Dim>(
        &self,
        experts: &[GatedLinear<Self>],
        shared: Option<&GatedLinear<Self>>,
        x: &Tensor<Self, H>,
        routes: &moe::Routes,
        gating: Gating,
        out: &mut Tensor<Self, H>,
    ) {
        // A down bias held outside the GEMM (several ranks) is added by rank 0
        // alone, weighted like the rest of its expert's output: the
        // all-reduce then adds it once (gpt-oss's `down_proj_bias`).
        fn pair<C: ComputeDtype>(m: &GatedLinear<Cpu<C>>, first: bool) -> moe::Expert<'_> {
            let post = m.down_proj.post_bias.as_deref().filter(|_| first);
            (&m.gate_up_proj.packed, &m.down_proj.packed, m.act, post)
        }
        let first = self.rank() == 0;
        let routed: Vec<_> = experts.iter().map(|m| pair(m, first)).collect();
        let (shared, h) = (shared.map(|m| pair(m, first)), x.width().size());
        moe::experts(&routed, shared, x.storage(), h, routes, gating, out.storage_mut());
        // Every rank ran its slice of every expert: one all-reduce for the whole block.
        self.all_reduce(out);
    }
}

impl<C: ComputeDtype> RecurrentOps for Cpu<C> {
    type DeltaState = DeltaCache<delta::DeltaLayer>;

    fn causal_conv1d_unchecked(
        &self,
        x: Cols<'_, Self>,
        w: &Vec<f32>,
        shape: DeltaShape,
        batch: &PackedBatch,
        state: LayerState<'_, Self::DeltaState>,
        out: &mut Tensor<Self>,
    ) {
        let LayerState { state, layer } = state;
        let x = delta::ColsRef { data: x.storage, stride: x.stride, offset: x.offset };
        delta::conv1d(x, w, shape, batch, state, layer, out.storage_mut());
    }

    fn gated_delta_rule_unchecked(
        &self,
        qkv: &Tensor<Self>,
        gates: DeltaGates<'_, Self>,
        rule: &DeltaRule<'_, Self>,
        batch: &PackedBatch,
        state: LayerState<'_, Self::DeltaState>,
        out: &mut Tensor<Self>,
    ) {
        let (DeltaGates { z, ba }, LayerState { state, layer }) = (gates, state);
        let sh = rule.shape;
        let z = delta::ColsRef { data: z.storage, stride: z.stride, offset: z.offset };
        let ba = delta::ColsRef { data: ba.storage, stride: ba.stride, offset: ba.offset };
        let w = delta::RuleWeights { a_log: rule.a_log, dt_bias: rule.dt_bias, norm: rule.norm, eps: rule.eps };
        delta::delta_rule(qkv.storage(), z, ba, &w, sh, batch, state, layer, out.storage_mut());
    }
}

impl<C: ComputeDtype> FusedOps for Cpu<C> {
    fn norm_linear_forward_unchecked<W: Dim, V: Dim>(
        &self,
        l: &Linear,
        x: &Tensor<Self, W>,
        w: &Vec<f32>,
        eps: f32,
        _normed: &mut Tensor<Self, W>,
        out: &mut Tensor<Self, V>,
    ) {
        // The norm is fused into the GEMM's packing of A: `normed` is never written.
        l.packed.forward_norm(x.storage(), x.rows(), w, eps, out.storage_mut(), false);
        if l.kind == Parallel::Row {
            self.all_reduce(out);
            if let Some(b) = &l.post_bias {
                add_bias(out.storage_mut(), b);
            }
        }
    }

    fn swiglu_linear_add_unchecked<V: Dim>(
        &self,
        l: &Linear,
        gate_up: &Tensor<Self>,
        act: &mut Tensor<Self>,
        residual: &mut Tensor<Self, V>,
    ) {
        if self.comm.is_some() && l.kind == Parallel::Row {
            // Split rows: the partial sums go through the all-reduce first.
            self.glu_unchecked(Glu::Silu, gate_up, act);
            return self.linear_add_unchecked(l, act, residual);
        }
        // One rank: the SwiGLU is fused into the GEMM's packing of A, and the
        // residual add into its output; the `[T, inter]` activations are never written.
        l.packed.forward_swiglu(gate_up.storage(), gate_up.rows(), residual.storage_mut(), true);
    }
}

impl<C: ComputeDtype> Cpu<C> {
    fn linear_in(&self, w: LinearWeight, bias: Option<Vec<f32>>, kind: Parallel, compute: Compute) -> Linear {
        // One rank keeps its bias inside the GEMM; with several, a row-parallel
        // bias is added once, after the all-reduce.
        let split_rows = kind == Parallel::Row && self.world_size() > 1;
        let (inner, post_bias) = if split_rows { (None, bias) } else { (bias, None) };
        Linear { packed: PackedLinear::from_weight_for(w, inner, compute), kind, post_bias }
    }
}

/// Adds a per-column bias to every row.
fn add_bias(x: &mut [f32], b: &[f32]) {
    for row in x.chunks_exact_mut(b.len()) {
        row.iter_mut().zip(b).for_each(|(x, b)| *x += b);
    }
}
