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

use super::ops::{self, exp, LANES};
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
/// [`crate::backend::Backend::gated_delta_rule`]), into `out` `[T, v_heads·v_dim]`.
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
    let (c, pw) = (shape.channels(), p.width());
    let scale = (dk as f32).powf(-0.5);
    for (si, seg) in batch.segments().iter().enumerate() {
        let rows = batch.range(si);
        let n = rows.len();
        let layer_state = seg.uses_cache().then(|| std::mem::take(store.0.layer_mut(seg.key, layer)));
        let (s0, pending) = match &layer_state {
            Some(l) if !l.s.is_empty() => (l.s.clone(), l.pending.clone()),
            _ => (vec![0f32; nv * dk * dv], Vec::new()),
        };
        let done = pending.len() / pw; // rows of the unfinished chunk run before
        assert_eq!(done, seg.pos0 % CH, "the cached chunk does not end where the segment starts");
        // This segment's rows, prepared, after the pending ones: [done + n, pw].
        let mut prep = pending;
        prep.resize((done + n) * pw, 0.0);
        prep[done * pw..].par_chunks_mut(pw).enumerate().for_each(|(i, dst)| {
            let r = rows.start + i;
            let src = &qkv[r * c..][..c];
            for hk in 0..nk {
                let (q, k) = (&src[hk * dk..][..dk], &src[(nk + hk) * dk..][..dk]);
                let (qi, ki) = (l2_inverse(q), l2_inverse(k));
                dst[p.q(hk)..][..dk].iter_mut().zip(q).for_each(|(d, v)| *d = v * qi * scale);
                dst[p.k(hk)..][..dk].iter_mut().zip(k).for_each(|(d, v)| *d = v * ki);
            }
            dst[p.v(0)..][..nv * dv].copy_from_slice(&src[2 * nk * dk..][..nv * dv]);
            let bar = ba.row(r, 2 * nv);
            for h in 0..nv {
                dst[p.g(h)] = -wts.a_log[h].exp() * softplus(bar[nv + h] + wts.dt_bias[h]);
                dst[p.beta(h)] = 1.0 / (1.0 + (-bar[h]).exp());
            }
        });
        // Each value head: its chunks in order, its state carried between them.
        let out_ptr = SharedMut::new(out.as_mut_ptr());
        let width = nv * dv;
        let states: Vec<Vec<f32>> = (0..nv)
            .into_par_iter()
            .map(|h| {
                let mut s = s0[h * dk * dv..][..dk * dv].to_vec();
                let mut w = Work::new(dk, dv);
                let mut c0 = 0; // the chunk's first row in `prep`
                while c0 < done + n {
                    let rows_in = (done + n - c0).min(CH);
                    let first = if c0 == 0 { done } else { 0 }; // rows to emit from
                    w.load(&prep, pw, &p, h, c0, rows_in);
                    w.chunk(&mut s, rows_in, first, rows_in == CH);
                    for i in first..rows_in {
                        let r = rows.start + c0 + i - done;
                        // SAFETY: head h writes only its columns of its rows.
                        let o = unsafe { std::slice::from_raw_parts_mut(out_ptr.get().add(r * width + h * dv), dv) };
                        gated_norm(&w.out[i * dv..][..dv], z.row(r, width)[h * dv..][..dv].as_ref(), wts, o);
                    }
                    c0 += rows_in;
                }
                s
            })
            .collect();
        if let Some(mut l) = layer_state {
            // The unfinished chunk's rows, and the state at its start.
            let kept = (done + n) % CH;
            l.pending = prep[(done + n - kept) * pw..].to_vec();
            l.s = states.concat();
            *store.0.layer_mut(seg.key, layer) = l;
        }
    }
}

/// `1 / sqrt(Σx² + 1e-6)`, the sum in [`ops::sum_squares`]'s fixed order.
fn l2_inverse(x: &[f32]) -> f32 {
    1.0 / (ops::sum_squares(x) + 1e-6).sqrt()
}

/// `out = (o · rsqrt(mean(o²) + eps)) · w · silu(z)`.
fn gated_norm(o: &[f32], z: &[f32], wts: &RuleWeights<'_>, out: &mut [f32]) {
    let inv = 1.0 / (ops::sum_squares(o) / o.len() as f32 + wts.eps).sqrt();
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
    /// `[dk]` / `[dv]` row scratch.
    row_k: Vec<f32>,
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
            row_k: vec![0.0; dk],
        }
    }

    /// Gathers head `h`'s inputs of `rows` prepared rows from row `c0`.
    fn load(&mut self, prep: &[f32], pw: usize, p: &Prepared, h: usize, c0: usize, rows: usize) {
        let (dk, dv) = (self.dk, self.dv);
        let hk = h / (p.nv / p.nk);
        for i in 0..rows {
            let src = &prep[(c0 + i) * pw..][..pw];
            let beta = src[p.beta(h)];
            self.q[i * dk..][..dk].copy_from_slice(&src[p.q(hk)..][..dk]);
            self.k[i * dk..][..dk].copy_from_slice(&src[p.k(hk)..][..dk]);
            for (d, &v) in self.kb[i * dk..][..dk].iter_mut().zip(&src[p.k(hk)..][..dk]) {
                *d = v * beta;
            }
            for (d, &v) in self.vb[i * dv..][..dv].iter_mut().zip(&src[p.v(h)..][..dv]) {
                *d = v * beta;
            }
            self.g[i] = src[p.g(h)];
            self.beta[i] = beta;
        }
    }

    /// Rows `first .. rows` of the chunk's output from the state `s`
    /// `[dk, dv]` at its start; with `full`, `s` moves to the chunk's end.
    fn chunk(&mut self, s: &mut [f32], rows: usize, first: usize, full: bool) {
        dispatch(|| self.chunk_body(s, rows, first, full))
    }

    #[inline(always)]
    fn chunk_body(&mut self, s: &mut [f32], rows: usize, first: usize, full: bool) {
        let (dk, dv) = (self.dk, self.dv);
        let mut acc = 0f32;
        for i in 0..rows {
            acc += self.g[i];
            self.cum[i] = acc;
        }
        // L[i, j] = (β k̂_i · k̂_j) e^(G_i - G_j) and P[i, j] = (q̂_i · k̂_j) e^(G_i - G_j), j < i (j ≤ i for P).
        for i in 0..rows {
            for j in 0..=i {
                let decay = exp(self.cum[i] - self.cum[j]);
                let kj = &self.k[j * dk..][..dk];
                if j < i {
                    self.l[i * CH + j] = dot(&self.kb[i * dk..][..dk], kj) * decay;
                }
                self.pq[i * CH + j] = dot(&self.q[i * dk..][..dk], kj) * decay;
            }
        }
        // Forward substitution: U_i = β v_i - Σ_{j<i} L[i, j] U_j; W_i = β k̂_i e^(G_i) - Σ_{j<i} L[i, j] W_j.
        for i in 0..rows {
            let e = exp(self.cum[i]);
            let (done_u, rest_u) = self.u.split_at_mut(i * dv);
            let ui = &mut rest_u[..dv];
            ui.copy_from_slice(&self.vb[i * dv..][..dv]);
            let (done_w, rest_w) = self.wk.split_at_mut(i * dk);
            let wi = &mut rest_w[..dk];
            for (d, &v) in wi.iter_mut().zip(&self.kb[i * dk..][..dk]) {
                *d = v * e;
            }
            for j in 0..i {
                let lij = -self.l[i * CH + j];
                axpy(ui, lij, &done_u[j * dv..][..dv]);
                axpy(wi, lij, &done_w[j * dk..][..dk]);
            }
        }
        // v_new_i = U_i - W_i·S (in `u`), and the output of every row from `first`:
        // o_i = (q̂_i e^(G_i))·S + Σ_{j≤i} P[i, j] v_new_j.
        for i in 0..rows {
            let ui = &mut self.u[i * dv..][..dv];
            for (a, &wa) in self.wk[i * dk..][..dk].iter().enumerate() {
                axpy(ui, -wa, &s[a * dv..][..dv]);
            }
        }
        for i in first..rows {
            let e = exp(self.cum[i]);
            let oi = &mut self.out[i * dv..][..dv];
            oi.fill(0.0);
            for (a, &qa) in self.q[i * dk..][..dk].iter().enumerate() {
                axpy(oi, qa * e, &s[a * dv..][..dv]);
            }
            for j in 0..=i {
                axpy(oi, self.pq[i * CH + j], &self.u[j * dv..][..dv]);
            }
        }
        if full {
            // S ← e^(G_last) S + Σ_j (k̂_j e^(G_last - G_j)) ⊗ v_new_j.
            let last = self.cum[CH - 1];
            let decay = exp(last);
            s.iter_mut().for_each(|x| *x *= decay);
            for j in 0..CH {
                let e = exp(last - self.cum[j]);
                for (a, &ka) in self.k[j * dk..][..dk].iter().enumerate() {
                    self.row_k[a] = ka * e;
                }
                for a in 0..dk {
                    axpy(&mut s[a * dv..][..dv], self.row_k[a], &self.u[j * dv..][..dv]);
                }
            }
        }
    }
}

/// Runs `f` compiled for AVX-512 where the CPU has it (the same bits: every
/// product and sum is one `mul_add` or one rounding, in the same order).
fn dispatch<R>(f: impl FnOnce() -> R) -> R {
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f")]
    unsafe fn avx512<R>(f: impl FnOnce() -> R) -> R {
        f()
    }
    #[cfg(target_arch = "x86_64")]
    if std::is_x86_feature_detected!("avx512f") {
        // SAFETY: the CPU has AVX-512F, checked just above.
        return unsafe { avx512(f) };
    }
    f()
}

/// `y += a · x`, element by element in fused multiply-adds.
#[inline(always)]
fn axpy(y: &mut [f32], a: f32, x: &[f32]) {
    for (y, &x) in y.iter_mut().zip(x) {
        *y = a.mul_add(x, *y);
    }
}

/// `a · b` in a fixed order: element `i` into lane `i mod 16`, then the lanes' tree.
#[inline(always)]
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut lanes = [0f32; LANES];
    let (ca, cb) = (a.chunks_exact(LANES), b.chunks_exact(LANES));
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for l in 0..LANES {
            lanes[l] = x[l].mul_add(y[l], lanes[l]);
        }
    }
    for (l, (x, y)) in ra.iter().zip(rb).enumerate() {
        lanes[l] = x.mul_add(*y, lanes[l]);
    }
    ops::lanes_sum(lanes)
}
