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

use super::{check, host};
use super::{
    AttnShape, Backend, BackendError, Cols, Compute, ComputeDtype, DeltaCache, DeltaRule, DeltaShape, GatedLinear,
    Gating, Glu, HeadSpan, KvCache, LinearInfo, Parallel, Resident, Router, Temperature, Tensor, F32,
};
use crate::hf::checkpoint::TensorBytes;
use crate::hf::quant::{LinearWeight, QuantKind};
use crate::hf::RopeFreqs;
use crate::parallel::{Collective, LocalGroup};
use crate::pipeline::batch::PackedBatch;
use crate::shape::{CapturedStates, DType, Dim, ShapeError};
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

impl RopeTable {
    fn at(&self, pos: usize) -> (&[f32], &[f32]) {
        let h = self.half;
        (&self.cos[pos * h..(pos + 1) * h], &self.sin[pos * h..(pos + 1) * h])
    }
}

impl<C: ComputeDtype> Backend for Cpu<C> {
    type Compute = C;
    type Storage = Vec<f32>;
    type Vector = Vec<f32>;
    type Embedding = host::Embedding;
    type Linear = Linear;
    type RopeTable = RopeTable;
    type Routes = moe::Routes;
    type KvCache = KvCache;
    type DeltaState = DeltaCache<delta::DeltaLayer>;

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

    fn alloc(&self, len: usize) -> Vec<f32> {
        panels::zeroed(len)
    }

    fn realloc(&self, s: &mut Vec<f32>, len: usize) {
        if len > s.capacity() {
            // A fresh zeroed allocation instead of a fill pass: the kernel maps
            // its pages as they are first written (and never, for a buffer a
            // fused op leaves unused).
            *s = panels::zeroed(len);
        } else {
            s.resize(len, 0.0);
        }
    }

    fn upload(&self, host: &[f32]) -> Vec<f32> {
        host.to_vec()
    }

    fn download(&self, s: &Vec<f32>, out: &mut [f32]) {
        out.copy_from_slice(s);
    }

    fn vector(&self, v: Vec<f32>) -> Vec<f32> {
        v
    }

    fn embedding(&self, bytes: TensorBytes, dtype: DType, hidden: usize) -> host::Embedding {
        host::Embedding::new(bytes, dtype, hidden)
    }

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

    fn embed<H: Dim>(&self, table: &host::Embedding, batch: &PackedBatch, out: &mut Tensor<Self, H>) {
        check::embed(batch, table.hidden(), out);
        table.lookup(batch.token_ids(), out.storage_mut());
    }

    fn rms_norm<W: Dim>(&self, x: Cols<'_, Self>, w: &Vec<f32>, eps: f32, out: &mut Tensor<Self, W>) {
        check::rms_norm(&x, w.len(), (out.rows(), out.width().size()));
        if x.offset == 0 && x.width == x.stride {
            ops::rms_norm(&x.storage[..x.rows * x.stride], w, eps, out.storage_mut());
        } else {
            let rows = x.storage.chunks_exact(x.stride).zip(out.storage_mut().chunks_exact_mut(x.width));
            for (row, dst) in rows {
                ops::rms_norm(&row[x.offset..x.offset + x.width], w, eps, dst);
            }
        }
    }

    fn rms_norm_heads(&self, x: &mut Tensor<Self>, heads: HeadSpan, w: &Vec<f32>, eps: f32) {
        let stride = x.width();
        check::rms_norm_heads(x, heads, w.len());
        for row in x.storage_mut().chunks_exact_mut(stride) {
            for i in 0..heads.count {
                let o = heads.offset + i * heads.stride;
                ops::rms_norm_heads_inplace(&mut row[o..o + heads.width], w, eps);
            }
        }
    }

    fn sum_squares_heads(&self, x: &Tensor<Self>, heads: HeadSpan, out: &mut Tensor<Self>, col: usize) {
        check::sum_squares_heads(x, heads, out, col);
        let (xw, ow) = (x.width(), out.width());
        for (row, o) in x.storage().chunks_exact(xw).zip(out.storage_mut().chunks_exact_mut(ow)) {
            for h in 0..heads.count {
                let s = heads.offset + h * heads.stride;
                o[col + h] = ops::sum_squares(&row[s..s + heads.width]);
            }
        }
    }

    fn scale_heads_rms(
        &self,
        x: &mut Tensor<Self>,
        heads: HeadSpan,
        sums: &Tensor<Self>,
        col: usize,
        n: usize,
        w: &Vec<f32>,
        eps: f32,
    ) {
        check::scale_heads_rms(x, heads, sums, col, n, w.len());
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

    fn rope(&self, x: &mut Tensor<Self>, heads: HeadSpan, interleave: bool, table: &RopeTable, batch: &PackedBatch) {
        let stride = x.width();
        check::rope(x, heads, table.half, batch);
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

    fn glu(&self, act: Glu, gate_up: &Tensor<Self>, out: &mut Tensor<Self>) {
        let inter = out.width();
        check::glu("glu", gate_up, out);
        ops::glu(act, gate_up.storage(), inter, out.storage_mut());
    }

    fn attn_temperature(&self, x: &mut Tensor<Self>, heads: HeadSpan, t: Temperature, batch: &PackedBatch) {
        check::temperature(x, heads, batch);
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

    fn add<W: Dim>(&self, x: &mut Tensor<Self, W>, y: &Tensor<Self, W>) {
        check::add(x, y);
        x.storage_mut().iter_mut().zip(y.storage()).for_each(|(x, y)| *x += y);
    }

    fn copy_heads(&self, src: &Tensor<Self>, from: HeadSpan, dst: &mut Tensor<Self>, to: HeadSpan) {
        let (ss, ds) = (src.width(), dst.width());
        check::copy_heads(src, from, dst, to);
        for (s, d) in src.storage().chunks_exact(ss).zip(dst.storage_mut().chunks_exact_mut(ds)) {
            for i in 0..to.count {
                let (a, b) = (from.offset + i * from.stride, to.offset + i * to.stride);
                d[b..b + to.width].copy_from_slice(&s[a..a + to.width]);
            }
        }
    }

    fn linear_forward<W: Dim, V: Dim>(&self, l: &Linear, x: &Tensor<Self, W>, out: &mut Tensor<Self, V>) {
        check::linear(l, x, out);
        l.packed.forward(x.storage(), x.rows(), out.storage_mut(), false);
        if l.kind == Parallel::Row {
            self.all_reduce(out);
            if let Some(b) = &l.post_bias {
                add_bias(out.storage_mut(), b);
            }
        }
    }

    fn norm_linear_forward<W: Dim, V: Dim>(
        &self,
        l: &Linear,
        x: &Tensor<Self, W>,
        w: &Vec<f32>,
        eps: f32,
        normed: &mut Tensor<Self, W>,
        out: &mut Tensor<Self, V>,
    ) {
        check::rms_norm(&x.all(), w.len(), (normed.rows(), normed.width().size()));
        check::linear(l, normed, out);
        // The norm is fused into the GEMM's packing of A: `normed` is never written.
        l.packed.forward_norm(x.storage(), x.rows(), w, eps, out.storage_mut(), false);
        if l.kind == Parallel::Row {
            self.all_reduce(out);
            if let Some(b) = &l.post_bias {
                add_bias(out.storage_mut(), b);
            }
        }
    }

    fn linear_add<W: Dim, V: Dim>(&self, l: &Linear, x: &Tensor<Self, W>, residual: &mut Tensor<Self, V>) {
        check::linear(l, x, residual);
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

    fn swiglu_linear_add<V: Dim>(
        &self,
        l: &Linear,
        gate_up: &Tensor<Self>,
        act: &mut Tensor<Self>,
        residual: &mut Tensor<Self, V>,
    ) {
        check::swiglu(gate_up, act);
        check::linear(l, act, residual);
        if self.comm.is_some() && l.kind == Parallel::Row {
            // Split rows: the partial sums go through the all-reduce first.
            self.glu(Glu::Silu, gate_up, act);
            return self.linear_add(l, act, residual);
        }
        // One rank: the SwiGLU is fused into the GEMM's packing of A, and the
        // residual add into its output; the `[T, inter]` activations are never written.
        l.packed.forward_swiglu(gate_up.storage(), gate_up.rows(), residual.storage_mut(), true);
    }

    fn attention(
        &self,
        q: Cols<'_, Self>,
        k: Cols<'_, Self>,
        v: Cols<'_, Self>,
        shape: AttnShape,
        sinks: Option<&Vec<f32>>,
        batch: &PackedBatch,
        cache: &mut KvCache,
        layer: usize,
        out: &mut Tensor<Self>,
    ) {
        check::attention(&q, &k, &v, shape, batch, (out.rows(), out.width()));
        check::sinks(sinks.map(Vec::len), shape);
        // Chunks of longer samples add their keys/values to the cache and read
        // all earlier positions from it; whole samples read their own rows.
        let (kw, vw) = (k.width, v.width);
        for (s, seg) in batch.segments().iter().enumerate().filter(|(_, g)| g.uses_cache()) {
            let entry = cache.layer_mut(seg.key, layer);
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

    fn causal_conv1d(
        &self,
        x: Cols<'_, Self>,
        w: &Vec<f32>,
        shape: DeltaShape,
        batch: &PackedBatch,
        state: &mut Self::DeltaState,
        layer: usize,
        out: &mut Tensor<Self>,
    ) {
        check::conv1d(&x, w.len(), shape, batch, out);
        let x = delta::ColsRef { data: x.storage, stride: x.stride, offset: x.offset };
        delta::conv1d(x, w, shape, batch, state, layer, out.storage_mut());
    }

    fn gated_delta_rule(
        &self,
        qkv: &Tensor<Self>,
        z: Cols<'_, Self>,
        ba: Cols<'_, Self>,
        rule: &DeltaRule<'_, Self>,
        batch: &PackedBatch,
        state: &mut Self::DeltaState,
        layer: usize,
        out: &mut Tensor<Self>,
    ) {
        let sh = rule.shape;
        check::delta_rule(qkv, &z, &ba, sh, [rule.a_log.len(), rule.dt_bias.len(), rule.norm.len()], batch, out);
        let z = delta::ColsRef { data: z.storage, stride: z.stride, offset: z.offset };
        let ba = delta::ColsRef { data: ba.storage, stride: ba.stride, offset: ba.offset };
        let w = delta::RuleWeights { a_log: rule.a_log, dt_bias: rule.dt_bias, norm: rule.norm, eps: rule.eps };
        delta::delta_rule(qkv.storage(), z, ba, &w, sh, batch, state, layer, out.storage_mut());
    }

    fn sigmoid_mul<W: Dim>(&self, x: &mut Tensor<Self, W>, gate: Cols<'_, Self>) {
        check::sigmoid_mul(x, &gate);
        let w = x.width().size().max(1);
        for (r, row) in x.storage_mut().chunks_exact_mut(w).enumerate() {
            let g = &gate.storage[r * gate.stride + gate.offset..][..gate.width];
            for (i, v) in row.iter_mut().enumerate() {
                let gi = if gate.width == 1 { g[0] } else { g[i] };
                *v *= 1.0 / (1.0 + ops::exp(-gi));
            }
        }
    }

    fn moe_route(&self, logits: &Tensor<Self>, router: &Router, correction: Option<&Vec<f32>>) -> moe::Routes {
        check::correction(logits, correction);
        moe::route(logits.storage(), logits.width(), router, correction.map(|c| c.as_slice()))
    }

    fn moe_experts<H: Dim>(
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
        check::shape("moe_experts", "experts", experts.len(), routes.len());
        check::shape("moe_experts", "tokens", x.rows(), out.rows());
        let routed: Vec<_> = experts.iter().map(|m| pair(m, first)).collect();
        let (shared, h) = (shared.map(|m| pair(m, first)), x.width().size());
        moe::experts(&routed, shared, x.storage(), h, routes, gating, out.storage_mut());
        // Every rank ran its slice of every expert: one all-reduce for the whole block.
        self.all_reduce(out);
    }

    fn all_reduce<W: Dim>(&self, x: &mut Tensor<Self, W>) {
        if let Some(comm) = &self.comm {
            comm.all_reduce_sum(x.storage_mut());
        }
    }

    fn capture<L: Dim, H: Dim>(
        &self,
        x: &Tensor<Self, H>,
        out: &mut CapturedStates<L, H>,
        slot: usize,
    ) -> Result<(), ShapeError> {
        check::capture(x.rows(), x.width().size(), out, slot)?;
        out.layer_mut(slot).copy_from_slice(x.storage());
        Ok(())
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
