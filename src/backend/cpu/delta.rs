//! Gated DeltaNet on the CPU: the depthwise causal conv1d and the gated
//! delta rule in chunks of [`DELTA_CHUNK`] positions (the WY form of
//! transformers' `torch_chunk_gated_delta_rule`), in f32 whatever the
//! compute dtype.
//!
//! The chunk grid is fixed to positions within the sample: chunk `c` covers
//! positions `64c .. 64c + 63`. A step that ends inside a chunk leaves the
//! state at the chunk's start and the chunk's prepared inputs in the cache;
//! the next step computes the whole chunk again from them. Every value of row
//! `i` of a chunk is computed from rows `0 ..= i` alone, by the same loops
//! whatever the chunk's fill, so the output of a position does not depend on
//! where steps cut its sample (bitwise). Heads run in parallel; each head's
//! arithmetic is sequential in a fixed order.

use super::ops::{self, exp};
use super::SharedMut;
use crate::backend::{DeltaCache, DeltaShape, DELTA_CHUNK};
use crate::pipeline::batch::PackedBatch;
use rayon::prelude::*;

const CH: usize = DELTA_CHUNK;

/// What a Gated DeltaNet layer keeps of a chunked sample between steps.
#[derive(Default, Debug)]
pub struct DeltaLayer {
    /// The inputs of the `K - 1` positions before the next step, `[K - 1, C]`
    /// (empty before the first step: zeros).
    conv: Vec<f32>,
    /// The recurrent state at the start of the unfinished chunk, `[v_heads,
    /// k_dim, v_dim]` (empty before the first step: zeros).
    s: Vec<f32>,
    /// The prepared rows (see [`Prepared`]) of the unfinished chunk's
    /// positions a step has run, `[pos0 mod 64, width]`.
    pending: Vec<f32>,
}

impl crate::backend::kv_cache::Held for DeltaLayer {
    fn held_bytes(&self) -> usize {
        (self.conv.capacity() + self.s.capacity() + self.pending.capacity()) * 4
    }
}

/// A block of columns of a row-major buffer: row `r` starts at `r · stride + offset`.
#[derive(Clone, Copy)]
pub struct ColsRef<'a> {
    /// The buffer.
    pub data: &'a [f32],
    /// Its row length.
    pub stride: usize,
    /// The block's first column.
    pub offset: usize,
}

impl ColsRef<'_> {
    fn row(&self, r: usize, width: usize) -> &[f32] {
        &self.data[r * self.stride + self.offset..][..width]
    }
}

/// `silu(Σ_j w[c, j] · x[p - K + 1 + j, c])` of every token and channel,
/// the conv's history read from and left in `store`.
#[allow(clippy::too_many_arguments)]
pub fn conv1d(
    x: ColsRef<'_>,
    w: &[f32],
    shape: DeltaShape,
    batch: &PackedBatch,
    store: &mut DeltaCache<DeltaLayer>,
    layer: usize,
    out: &mut [f32],
) {
    let (c, k) = (shape.channels(), shape.conv_kernel);
    // [K, C]: tap j of every channel contiguous, so the loop over channels vectorises.
    let mut taps = vec![0f32; k * c];
    for ch in 0..c {
        for j in 0..k {
            taps[j * c + ch] = w[ch * k + j];
        }
    }
    for (si, seg) in batch.segments().iter().enumerate() {
        let rows = batch.range(si);
        let mut history = vec![0f32; (k - 1) * c]; // positions pos0 - K + 1 .. pos0
        if seg.uses_cache() {
            let held = &store.0.layer_mut(seg.key, layer).conv;
            if !held.is_empty() {
                history.copy_from_slice(held);
            }
        }
        let input = |i: usize| -> &[f32] {
            // Index i of the window: history rows first, then the segment's.
            if i < k - 1 {
                &history[i * c..][..c]
            } else {
                x.row(rows.start + i - (k - 1), c)
            }
        };
        let seg_out = &mut out[rows.start * c..rows.end * c];
        seg_out.par_chunks_mut(c).enumerate().for_each(|(i, o)| {
            o.fill(0.0);
            for j in 0..k {
                axpy_row(o, &taps[j * c..][..c], input(i + j));
            }
            silu_row(o);
        });
        if seg.uses_cache() {
            let n = rows.len();
            let mut tail = vec![0f32; (k - 1) * c];
            for (i, t) in tail.chunks_exact_mut(c).enumerate() {
                t.copy_from_slice(input(n + i));
            }
            store.0.layer_mut(seg.key, layer).conv = tail;
        }
    }
}

/// `o[c] += w[c] · x[c]`, element by element (the same bits on every ISA).
fn axpy_row(o: &mut [f32], w: &[f32], x: &[f32]) {
    #[inline(always)]
    fn body(o: &mut [f32], w: &[f32], x: &[f32]) {
        for ((o, w), x) in o.iter_mut().zip(w).zip(x) {
            *o = w.mul_add(*x, *o);
        }
    }
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f")]
    unsafe fn avx512(o: &mut [f32], w: &[f32], x: &[f32]) {
        body(o, w, x)
    }
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn avx2(o: &mut [f32], w: &[f32], x: &[f32]) {
        body(o, w, x)
    }
    #[cfg(target_arch = "x86_64")]
    {
        if std::is_x86_feature_detected!("avx512f") {
            // SAFETY: the CPU has AVX-512F, checked just above.
            return unsafe { avx512(o, w, x) };
        }
        if std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma") {
            // SAFETY: the CPU has AVX2 and FMA, checked just above.
            return unsafe { avx2(o, w, x) };
        }
    }
    body(o, w, x)
}

/// In place: `silu(x) = x / (1 + e^-x)`.
fn silu_row(o: &mut [f32]) {
    #[inline(always)]
    fn body(o: &mut [f32]) {
        for v in o {
            *v /= 1.0 + exp(-*v);
        }
    }
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f")]
    unsafe fn avx512(o: &mut [f32]) {
        body(o)
    }
    #[cfg(target_arch = "x86_64")]
    if std::is_x86_feature_detected!("avx512f") {
        // SAFETY: the CPU has AVX-512F, checked just above.
        return unsafe { avx512(o) };
    }
    body(o)
}

/// The per-token inputs of the recurrence, as a step prepares them from the
/// conv's output and `b`, `a`: a row of `[q̂ | k̂ | v | g | β]` with
/// `q̂ = q·rsqrt(Σq² + 1e-6)/√k_dim`, `k̂ = k·rsqrt(Σk² + 1e-6)`,
/// `g = -exp(A_log)·softplus(a + dt_bias)`, `β = σ(b)`.
#[derive(Clone, Copy)]
struct Prepared {
    nk: usize,
    nv: usize,
    dk: usize,
    dv: usize,
}

impl Prepared {
    fn width(&self) -> usize {
        2 * self.nk * self.dk + self.nv * self.dv + 2 * self.nv
    }
    fn q(&self, hk: usize) -> usize {
        hk * self.dk
    }
    fn k(&self, hk: usize) -> usize {
        (self.nk + hk) * self.dk
    }
    fn v(&self, h: usize) -> usize {
        2 * self.nk * self.dk + h * self.dv
    }
    fn g(&self, h: usize) -> usize {
        2 * self.nk * self.dk + self.nv * self.dv + h
    }
    fn beta(&self, h: usize) -> usize {
        self.g(h) + self.nv
    }
}

/// `ln(1 + e^x)`, as PyTorch's `softplus` (the input itself above 20).
fn softplus(x: f32) -> f32 {
    if x > 20.0 {
        x
    } else {
        x.exp().ln_1p()
    }
}

/// The weights [`delta_rule`] reads, this rank's heads.
pub struct RuleWeights<'a> {
    /// `[v_heads]`.
    pub a_log: &'a [f32],
    /// `[v_heads]`.
    pub dt_bias: &'a [f32],
    /// The gated norm's `[v_dim]`.
    pub norm: &'a [f32],
    /// Its epsilon.
    pub eps: f32,
}

/// The gated delta rule and gated norm of every token (see
/// [`crate::backend::RecurrentOps::gated_delta_rule`]), into `out` `[T, v_heads·v_dim]`.
#[allow(clippy::too_many_arguments)]
pub fn delta_rule(
    qkv: &[f32],
    z: ColsRef<'_>,
    ba: ColsRef<'_>,
    wts: &RuleWeights<'_>,
    shape: DeltaShape,
    batch: &PackedBatch,
    store: &mut DeltaCache<DeltaLayer>,
    layer: usize,
    out: &mut [f32],
) {
    let (nk, nv, dk, dv) = (shape.k_heads, shape.v_heads, shape.k_dim, shape.v_dim);
    let p = Prepared { nk, nv, dk, dv };
    let pw = p.width();
    // Each segment's state and cached rows, taken out of the store (zeros for a new sample).
    let segs: Vec<(Vec<f32>, Vec<f32>, bool)> = batch
        .segments()
        .iter()
        .map(|seg| {
            if !seg.uses_cache() {
                return (vec![0f32; nv * dk * dv], Vec::new(), false);
            }
            let l = store.0.layer_mut(seg.key, layer);
            match (std::mem::take(&mut l.s), std::mem::take(&mut l.pending)) {
                (s, pending) if !s.is_empty() => (s, pending, true),
                _ => (vec![0f32; nv * dk * dv], Vec::new(), true),
            }
        })
        .collect();
    let jobs: Vec<Job<'_>> = segs
        .iter()
        .enumerate()
        .map(|(si, (_, pending, _))| {
            let (done, seg) = (pending.len() / pw, &batch.segments()[si]);
            assert_eq!(done, seg.pos0 % CH, "the cached chunk does not end where the segment starts");
            let rows = batch.range(si);
            Job { p, qkv, ba, z, wts, pending, done, row0: rows.start, n: rows.len() }
        })
        .collect();
    // Every (segment, value head) pair in parallel: a head's chunks in order,
    // its state carried between them; each writes its own columns of its rows.
    let out_ptr = SharedMut::new(out.as_mut_ptr());
    let states: Vec<Vec<f32>> = (0..jobs.len() * nv)
        .into_par_iter()
        .map(|e| {
            let (si, h) = (e / nv, e % nv);
            let mut s = segs[si].0[h * dk * dv..][..dk * dv].to_vec();
            jobs[si].head(h, &mut s, out_ptr);
            s
        })
        .collect();
    for (si, (seg, job)) in batch.segments().iter().zip(&jobs).enumerate() {
        if !segs[si].2 {
            continue;
        }
        // The unfinished chunk's rows, prepared, and the state at its start.
        let kept = (job.done + job.n) % CH;
        let mut pending = vec![0f32; kept * pw];
        for (i, dst) in pending.chunks_exact_mut(pw).enumerate() {
            job.prepared_row(job.done + job.n - kept + i, dst);
        }
        let l = store.0.layer_mut(seg.key, layer);
        l.pending = pending;
        l.s = states[si * nv..(si + 1) * nv].concat();
    }
}

/// One segment's inputs to the recurrence: the prepared rows its sample's
/// unfinished chunk left in the cache (`done` of them), then its own tokens
/// (rows `row0 .. row0 + n` of the step), prepared as they are read. A row's
/// prepared values are the same bits whichever way they are reached.
struct Job<'a> {
    p: Prepared,
    qkv: &'a [f32],
    ba: ColsRef<'a>,
    z: ColsRef<'a>,
    wts: &'a RuleWeights<'a>,
    pending: &'a [f32],
    done: usize,
    row0: usize,
    n: usize,
}

impl Job<'_> {
    /// Value head `h` over every chunk the segment reaches, from state `s`
    /// (left at the start of its unfinished chunk), its rows of the output
    /// written through `out`.
    fn head(&self, h: usize, s: &mut [f32], out: SharedMut) {
        #[cfg(target_arch = "x86_64")]
        {
            if std::is_x86_feature_detected!("avx512f") {
                // SAFETY: the CPU has AVX-512F, checked just above.
                return unsafe { self.head_avx512(h, s, out) };
            }
            if std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma") {
                // SAFETY: the CPU has AVX2 and FMA, checked just above.
                return unsafe { self.head_avx2(h, s, out) };
            }
        }
        self.head_body(h, s, out)
    }

    /// [`Self::head`] compiled for AVX-512: every product and sum is one
    /// `mul_add` or one rounding, in the same order, so the bits are the same on every path.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f")]
    unsafe fn head_avx512(&self, h: usize, s: &mut [f32], out: SharedMut) {
        self.head_body(h, s, out)
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn head_avx2(&self, h: usize, s: &mut [f32], out: SharedMut) {
        self.head_body(h, s, out)
    }

    #[inline(always)]
    fn head_body(&self, h: usize, s: &mut [f32], out: SharedMut) {
        let Prepared { nv, dk, dv, .. } = self.p;
        let width = nv * dv;
        let total = self.done + self.n;
        let mut w = Work::new(dk, dv);
        let mut c0 = 0; // the chunk's first row, counted from the unfinished chunk's start
        while c0 < total {
            let rows_in = (total - c0).min(CH);
            let first = if c0 == 0 { self.done } else { 0 }; // rows to emit from
            for i in 0..rows_in {
                self.load_row(h, c0 + i, &mut w, i);
            }
            w.chunk_body(s, rows_in, first, rows_in == CH);
            for i in first..rows_in {
                let r = self.row0 + c0 + i - self.done;
                // SAFETY: head h writes only its columns of its rows.
                let o = unsafe { std::slice::from_raw_parts_mut(out.get().add(r * width + h * dv), dv) };
                gated_norm(&w.out[i * dv..][..dv], &self.z.row(r, width)[h * dv..][..dv], self.wts, o);
            }
            c0 += rows_in;
        }
    }

    /// Head `h`'s inputs of row `idx` into row `i` of `w`.
    #[inline(always)]
    fn load_row(&self, h: usize, idx: usize, w: &mut Work, i: usize) {
        let p = self.p;
        let (dk, dv, hk) = (p.dk, p.dv, h / (p.nv / p.nk));
        let (g, beta) = if idx < self.done {
            let src = &self.pending[idx * p.width()..][..p.width()];
            w.q[i * dk..][..dk].copy_from_slice(&src[p.q(hk)..][..dk]);
            w.k[i * dk..][..dk].copy_from_slice(&src[p.k(hk)..][..dk]);
            w.vb[i * dv..][..dv].copy_from_slice(&src[p.v(h)..][..dv]);
            (src[p.g(h)], src[p.beta(h)])
        } else {
            let r = self.row0 + idx - self.done;
            let c = 2 * p.nk * dk + p.nv * dv;
            let src = &self.qkv[r * c..][..c];
            self.normed(&src[hk * dk..][..dk], true, &mut w.q[i * dk..][..dk]);
            self.normed(&src[(p.nk + hk) * dk..][..dk], false, &mut w.k[i * dk..][..dk]);
            w.vb[i * dv..][..dv].copy_from_slice(&src[2 * p.nk * dk + h * dv..][..dv]);
            self.gates(r, h)
        };
        for v in &mut w.vb[i * dv..][..dv] {
            *v *= beta;
        }
        for (d, &v) in w.kb[i * dk..][..dk].iter_mut().zip(&w.k[i * dk..][..dk]) {
            *d = v * beta;
        }
        w.g[i] = g;
        w.beta[i] = beta;
    }

    /// `x·rsqrt(Σx² + 1e-6)`, times `1/√k_dim` for a query.
    #[inline(always)]
    fn normed(&self, x: &[f32], query: bool, dst: &mut [f32]) {
        let inv = 1.0 / (ops::sum_squares_body(x) + 1e-6).sqrt();
        let scale = (self.p.dk as f32).powf(-0.5);
        for (d, &v) in dst.iter_mut().zip(x) {
            *d = if query { v * inv * scale } else { v * inv };
        }
    }

    /// `(g, β)` of head `h` at step row `r`: `-exp(A_log)·softplus(a + dt_bias)` and `σ(b)`.
    #[inline(always)]
    fn gates(&self, r: usize, h: usize) -> (f32, f32) {
        let nv = self.p.nv;
        let bar = self.ba.row(r, 2 * nv);
        let g = -self.wts.a_log[h].exp() * softplus(bar[nv + h] + self.wts.dt_bias[h]);
        (g, 1.0 / (1.0 + (-bar[h]).exp()))
    }

    /// Row `idx` (counted from the unfinished chunk's start) in the prepared
    /// form the cache keeps, every head: `[q̂ | k̂ | v | g | β]`.
    fn prepared_row(&self, idx: usize, dst: &mut [f32]) {
        let p = self.p;
        if idx < self.done {
            dst.copy_from_slice(&self.pending[idx * p.width()..][..p.width()]);
            return;
        }
        let r = self.row0 + idx - self.done;
        let (dk, dv) = (p.dk, p.dv);
        let c = 2 * p.nk * dk + p.nv * dv;
        let src = &self.qkv[r * c..][..c];
        for hk in 0..p.nk {
            self.normed(&src[hk * dk..][..dk], true, &mut dst[p.q(hk)..][..dk]);
            self.normed(&src[(p.nk + hk) * dk..][..dk], false, &mut dst[p.k(hk)..][..dk]);
        }
        dst[p.v(0)..][..p.nv * dv].copy_from_slice(&src[2 * p.nk * dk..][..p.nv * dv]);
        for h in 0..p.nv {
            (dst[p.g(h)], dst[p.beta(h)]) = self.gates(r, h);
        }
    }
}

/// `out = (o · rsqrt(mean(o²) + eps)) · w · silu(z)`.
#[inline(always)]
fn gated_norm(o: &[f32], z: &[f32], wts: &RuleWeights<'_>, out: &mut [f32]) {
    let inv = 1.0 / (ops::sum_squares_body(o) / o.len() as f32 + wts.eps).sqrt();
    for (((d, &v), &w), &g) in out.iter_mut().zip(o).zip(wts.norm).zip(z) {
        *d = v * inv * w * (g / (1.0 + exp(-g)));
    }
}

/// One head's buffers for one chunk (`CH` rows at most).
struct Work {
    dk: usize,
    dv: usize,
    /// `[CH, dk]` each: q̂, k̂, β·k̂.
    q: Vec<f32>,
    k: Vec<f32>,
    kb: Vec<f32>,
    /// `[CH, dv]`: β·v.
    vb: Vec<f32>,
    /// `[CH]`: g, its cumulative sum over the chunk, β.
    g: Vec<f32>,
    cum: Vec<f32>,
    beta: Vec<f32>,
    /// `[CH, CH]`: the UT system's strictly lower part `L`, and `P = (q̂·k̂) ⊙ decay`.
    l: Vec<f32>,
    pq: Vec<f32>,
    /// `[CH, dv]`: `U = (I + L)⁻¹ β v`, then `v_new = U - W·S`.
    u: Vec<f32>,
    /// `[CH, dk]`: `W = (I + L)⁻¹ (β k̂ e^G)`.
    wk: Vec<f32>,
    /// `[CH, dv]`: the rows' outputs before the gated norm.
    out: Vec<f32>,
    /// `[dk, CH]`: k̂ transposed (decayed to the chunk's end for the state update).
    kt: Vec<f32>,
    /// `[CH, dk]`: q̂ e^G.
    qe: Vec<f32>,
}

impl Work {
    fn new(dk: usize, dv: usize) -> Self {
        Work {
            dk,
            dv,
            q: vec![0.0; CH * dk],
            k: vec![0.0; CH * dk],
            kb: vec![0.0; CH * dk],
            vb: vec![0.0; CH * dv],
            g: vec![0.0; CH],
            cum: vec![0.0; CH],
            beta: vec![0.0; CH],
            l: vec![0.0; CH * CH],
            pq: vec![0.0; CH * CH],
            u: vec![0.0; CH * dv],
            wk: vec![0.0; CH * dk],
            out: vec![0.0; CH * dv],
            kt: vec![0.0; dk * CH],
            qe: vec![0.0; CH * dk],
        }
    }

    #[inline(always)]
    fn chunk_body(&mut self, s: &mut [f32], rows: usize, first: usize, full: bool) {
        let (dk, dv) = (self.dk, self.dv);
        let mut acc = 0f32;
        for i in 0..rows {
            acc += self.g[i];
            self.cum[i] = acc;
        }
        // k̂ transposed, [dk, CH]: the columns of the chunk's key products.
        for j in 0..rows {
            for a in 0..dk {
                self.kt[a * CH + j] = self.k[j * dk + a];
            }
        }
        // L[i, j] = (β k̂_i · k̂_j) e^(G_i - G_j), j < i; P[i, j] = (q̂_i · k̂_j) e^(G_i - G_j), j ≤ i.
        self.l[..rows * CH].fill(0.0);
        self.pq[..rows * CH].fill(0.0);
        mac(&mut self.l, CH, 0..rows, &self.kb, (dk, 1), 1.0, dk, &self.kt, CH, rows);
        mac(&mut self.pq, CH, 0..rows, &self.q, (dk, 1), 1.0, dk, &self.kt, CH, rows);
        for i in 0..rows {
            for j in 0..=i {
                let decay = exp(self.cum[i] - self.cum[j]);
                self.l[i * CH + j] *= decay;
                self.pq[i * CH + j] *= decay;
            }
        }
        // Forward substitution, a row at a time: U_i = β v_i - Σ_{j<i} L[i, j] U_j,
        // W_i = β k̂_i e^(G_i) - Σ_{j<i} L[i, j] W_j.
        self.u[..rows * dv].copy_from_slice(&self.vb[..rows * dv]);
        for i in 0..rows {
            let e = exp(self.cum[i]);
            for (d, &v) in self.wk[i * dk..][..dk].iter_mut().zip(&self.kb[i * dk..][..dk]) {
                *d = v * e;
            }
            let (done, row) = self.u.split_at_mut(i * dv);
            mac(row, dv, 0..1, &self.l[i * CH..], (CH, 1), -1.0, i, done, dv, dv);
            let (done, row) = self.wk.split_at_mut(i * dk);
            mac(row, dk, 0..1, &self.l[i * CH..], (CH, 1), -1.0, i, done, dk, dk);
        }
        // v_new = U - W·S, in `u`.
        mac(&mut self.u, dv, 0..rows, &self.wk, (dk, 1), -1.0, dk, s, dv, dv);
        // The output of every row from `first`: o_i = (q̂_i e^(G_i))·S + Σ_{j≤i} P[i, j] v_new_j.
        for i in first..rows {
            let e = exp(self.cum[i]);
            for (d, &v) in self.qe[i * dk..][..dk].iter_mut().zip(&self.q[i * dk..][..dk]) {
                *d = v * e;
            }
        }
        self.out[first * dv..rows * dv].fill(0.0);
        mac(&mut self.out, dv, first..rows, &self.qe, (dk, 1), 1.0, dk, s, dv, dv);
        // Rows in fours share the products with v_new_j for j up to the first's
        // index; each then adds its own last few, in the same order of j.
        let mut i0 = first;
        while i0 < rows {
            let r = (rows - i0).min(4);
            mac(&mut self.out, dv, i0..i0 + r, &self.pq, (CH, 1), 1.0, i0 + 1, &self.u, dv, dv);
            for i in i0 + 1..i0 + r {
                let (from, to) = (i0 + 1, i + 1);
                mac(
                    &mut self.out[i * dv..],
                    dv,
                    0..1,
                    &self.pq[i * CH + from..],
                    (CH, 1),
                    1.0,
                    to - from,
                    &self.u[from * dv..],
                    dv,
                    dv,
                );
            }
            i0 += r;
        }
        if full {
            // S ← e^(G_last) S + Σ_j (k̂_j e^(G_last - G_j)) ⊗ v_new_j.
            let last = self.cum[CH - 1];
            let decay = exp(last);
            s.iter_mut().for_each(|x| *x *= decay);
            for j in 0..CH {
                let e = exp(last - self.cum[j]);
                for a in 0..dk {
                    self.kt[a * CH + j] *= e;
                }
            }
            mac(s, dv, 0..dk, &self.kt, (CH, 1), 1.0, CH, &self.u, dv, dv);
        }
    }
}

/// `out[i·os + c] += Σ_{a<k} sign · x[i·xr + a·xc] · m[a·ms + c]` for the rows `rows` and
/// the columns `c < n`: for each element one chain of fused multiply-adds from its
/// value in `out`, in the order of `a`. Tiles of 4 rows × 64 columns keep their sums in
/// registers; an element's bits are the same whichever tile computes it.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn mac(
    out: &mut [f32],
    os: usize,
    rows: std::ops::Range<usize>,
    x: &[f32],
    (xr, xc): (usize, usize),
    sign: f32,
    k: usize,
    m: &[f32],
    ms: usize,
    n: usize,
) {
    #[inline(always)]
    #[allow(clippy::too_many_arguments)]
    fn tile<const R: usize, const C: usize>(
        out: &mut [f32],
        os: usize,
        (i0, c0): (usize, usize),
        x: &[f32],
        (xr, xc): (usize, usize),
        sign: f32,
        k: usize,
        m: &[f32],
        ms: usize,
    ) {
        let mut acc = [[0f32; C]; R];
        for (r, a) in acc.iter_mut().enumerate() {
            a.copy_from_slice(&out[(i0 + r) * os + c0..][..C]);
        }
        for a in 0..k {
            let mrow: &[f32; C] = m[a * ms + c0..][..C].try_into().expect("C columns");
            for (r, acc) in acc.iter_mut().enumerate() {
                let xv = sign * x[(i0 + r) * xr + a * xc];
                for c in 0..C {
                    acc[c] = xv.mul_add(mrow[c], acc[c]);
                }
            }
        }
        for (r, a) in acc.iter().enumerate() {
            out[(i0 + r) * os + c0..][..C].copy_from_slice(a);
        }
    }
    #[inline(always)]
    #[allow(clippy::too_many_arguments)]
    fn row_block<const R: usize>(
        out: &mut [f32],
        os: usize,
        i0: usize,
        x: &[f32],
        xs: (usize, usize),
        sign: f32,
        k: usize,
        m: &[f32],
        ms: usize,
        n: usize,
    ) {
        let mut c = 0;
        while c + 64 <= n {
            tile::<R, 64>(out, os, (i0, c), x, xs, sign, k, m, ms);
            c += 64;
        }
        while c + 16 <= n {
            tile::<R, 16>(out, os, (i0, c), x, xs, sign, k, m, ms);
            c += 16;
        }
        while c < n {
            tile::<R, 1>(out, os, (i0, c), x, xs, sign, k, m, ms);
            c += 1;
        }
    }
    let mut i = rows.start;
    while i + 4 <= rows.end {
        row_block::<4>(out, os, i, x, (xr, xc), sign, k, m, ms, n);
        i += 4;
    }
    while i < rows.end {
        row_block::<1>(out, os, i, x, (xr, xc), sign, k, m, ms, n);
        i += 1;
    }
}
