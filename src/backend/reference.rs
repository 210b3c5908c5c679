//! The reference backend: every op as a plain loop over its definition,
//! accumulating in f64, on one thread, for one rank. It is the in-repo oracle
//! (in the spirit of llama2.c): slow, short, and obviously what it says.
//!
//! - Weights are held as stored, like the CPU backend's; a row is decoded to
//!   its exact f32 values (`code · scale`) each time it is used.
//! - Every op computes in f64 and rounds its output once, to the f32 buffers
//!   the model passes between ops (the MoE op rounds each expert's steps the
//!   same way, and sums the experts in f64).

use super::host;
use super::{
    AttentionOps, AttnShape, BackendError, Cols, DeltaCache, DeltaGates, DeltaRule, DeltaShape, DeviceOps, FusedOps,
    GatedLinear, Gating, Glu, HeadSpan, HeadSums, KvCache, LayerState, LinearInfo, MoeOps, Parallel, Qkv, RecurrentOps,
    Resident, RopeInfo, Router, RoutesInfo, RowOps, Temperature, Tensor, Weights, F32,
};
use crate::hf::moe::{Scoring, TopkMethod};
use crate::hf::quant::{LinearWeight, QuantKind};
use crate::hf::RopeFreqs;
use crate::pipeline::batch::PackedBatch;
use crate::shape::Dim;

/// The reference backend (one rank).
#[derive(Clone, Copy, Debug, Default)]
pub struct Reference;

/// A linear layer: its weight as stored (f32, bf16, FP8 or INT4 codes, each
/// row decoded exactly when it is used) and its bias.
pub struct Linear {
    w: LinearWeight,
    bias: Option<Vec<f32>>,
}

impl Resident for Linear {
    fn resident_bytes(&self) -> usize {
        let w = match &self.w {
            LinearWeight::Dense { w, .. } => w.len() * 4,
            LinearWeight::Mapped(m) => m.rows * m.cols * 4,
            LinearWeight::MappedBf16(m) => m.rows * m.cols * 2,
            LinearWeight::Quant(q) => q.codes.len() + q.scales.len() * 4,
        };
        w + self.bias.as_ref().map_or(0, Vec::len) * 4
    }
}

impl LinearInfo for Linear {
    fn out_features(&self) -> usize {
        self.w.rows()
    }
    fn in_features(&self) -> usize {
        self.w.cols()
    }
    fn held_as(&self) -> Option<QuantKind> {
        match &self.w {
            LinearWeight::Dense { .. } | LinearWeight::Mapped(_) => None,
            LinearWeight::MappedBf16(_) => Some(QuantKind::Bf16),
            LinearWeight::Quant(q) => Some(q.kind),
        }
    }
}

impl Linear {
    /// `y = x·Wᵀ + b` of every row of `x` (`[T, in]`), in f64: `[T][out]`.
    fn apply(&self, x: &[f32]) -> Vec<Vec<f64>> {
        let (out, inp) = (self.w.rows(), self.w.cols());
        let rows: Vec<Vec<f64>> = x.chunks_exact(inp).map(widen).collect();
        let mut y = vec![vec![0f64; out]; rows.len()];
        let mut w = vec![0f32; inp];
        for j in 0..out {
            self.w.row(j, &mut w);
            let b = self.bias.as_ref().map_or(0.0, |b| b[j] as f64);
            for (x, y) in rows.iter().zip(&mut y) {
                y[j] = w.iter().zip(x).map(|(w, x)| *w as f64 * x).sum::<f64>() + b;
            }
        }
        y
    }
}

/// cos/sin (times the RoPE scale) of every position, `[len][half]`, in f64.
pub struct RopeTable {
    cos: Vec<f64>,
    sin: Vec<f64>,
    half: usize,
}

impl RopeInfo for RopeTable {
    fn half(&self) -> usize {
        self.half
    }
}

fn widen(x: &[f32]) -> Vec<f64> {
    x.iter().map(|&v| v as f64).collect()
}

fn silu(g: f64) -> f64 {
    g / (1.0 + (-g).exp())
}

/// `act(gate, up)` in f64, each written as its model's code writes it.
fn glu_f64(act: Glu, g: f64, u: f64) -> f64 {
    match act {
        Glu::Silu => silu(g) * u,
        Glu::GeluTanh => {
            let k = (2.0 / std::f64::consts::PI).sqrt();
            0.5 * g * (1.0 + (k * (g + 0.044715 * g * g * g)).tanh()) * u
        }
        Glu::Clamped { alpha, limit } => {
            let (g, u) = (g.min(limit as f64), u.clamp(-limit as f64, limit as f64));
            (u + 1.0) * (g / (1.0 + (-(alpha as f64) * g).exp()))
        }
    }
}

/// `x / rms(x) · w`, in f64.
fn rms_norm_row(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    let ss: f64 = x.iter().map(|&v| v as f64 * v as f64).sum::<f64>() / x.len() as f64;
    let inv = 1.0 / (ss + eps as f64).sqrt();
    for ((o, &v), &w) in out.iter_mut().zip(x).zip(w) {
        *o = (w as f64 * (v as f64 * inv)) as f32;
    }
}

/// A gated MLP of the rows of `x`: `down(silu(gate) · up)`, each step's
/// output rounded to f32 as the dense path's buffers are.
fn gated_rows(m: &GatedLinear<Reference>, x: &[f32]) -> Vec<Vec<f64>> {
    let gu = m.gate_up_proj.apply(x);
    let inter = gu.first().map_or(0, |r| r.len() / 2);
    let act: Vec<f32> = gu
        .iter()
        .flat_map(|g| (0..inter).map(move |i| glu_f64(m.act, g[i] as f32 as f64, g[inter + i] as f32 as f64) as f32))
        .collect();
    m.down_proj.apply(&act).into_iter().map(|r| r.into_iter().map(|v| v as f32 as f64).collect()).collect()
}

/// What a Gated DeltaNet layer keeps of a chunked sample: the conv's last
/// inputs and the recurrent state, in f64.
#[derive(Default, Debug)]
pub struct DeltaLayer {
    /// The inputs of the `K - 1` positions before the next chunk, `[K - 1, C]`
    /// (empty before the first chunk: zeros).
    conv: Vec<f32>,
    /// `[v_heads, k_dim, v_dim]` (empty before the first chunk: zeros).
    s: Vec<f64>,
}

impl crate::backend::kv_cache::Held for DeltaLayer {
    fn held_bytes(&self) -> usize {
        self.conv.capacity() * 4 + self.s.capacity() * 8
    }
}

/// `ln(1 + e^x)`, as PyTorch's `softplus` (the input itself above 20).
fn softplus(x: f64) -> f64 {
    if x > 20.0 {
        x
    } else {
        x.exp().ln_1p()
    }
}

fn sigmoid(x: f64) -> f64 {
    1.0 / (1.0 + (-x).exp())
}

impl host::Host for Reference {}

/// The reference's routes: per token, its experts and weights.
impl RoutesInfo for Vec<Vec<(usize, f64)>> {
    fn tokens(&self) -> usize {
        self.len()
    }
}

impl DeviceOps for Reference {
    type Compute = F32;

    const NAME: &'static str = "reference";

    fn native_bf16() -> bool {
        false
    }

    fn kernel(&self) -> &'static str {
        "reference"
    }

    fn rank(&self) -> usize {
        0
    }

    fn world_size(&self) -> usize {
        1
    }

    fn group(&self, n: usize) -> Result<Vec<Self>, BackendError> {
        match n {
            1 => Ok(vec![Reference]),
            _ => Err(BackendError::Unsupported(format!(
                "the reference backend runs one rank; use --tp 1 with --backend reference (got --tp {n})"
            ))),
        }
    }

    fn all_reduce<W: Dim>(&self, _x: &mut Tensor<Self, W>) {
        // One rank: the sum over ranks is the rank's own buffer.
    }
}

impl Weights for Reference {
    type Linear = Linear;

    fn linear(&self, w: LinearWeight, bias: Option<Vec<f32>>, _kind: Parallel) -> Linear {
        Linear { w, bias }
    }
}

impl RowOps for Reference {
    type RopeTable = RopeTable;

    fn embed_unchecked<H: Dim>(&self, table: &host::Embedding, batch: &PackedBatch, out: &mut Tensor<Self, H>) {
        table.lookup(batch.token_ids(), out.storage_mut());
    }

    fn rms_norm_unchecked<W: Dim>(&self, x: Cols<'_, Self>, w: &Vec<f32>, eps: f32, out: &mut Tensor<Self, W>) {
        for (row, dst) in x.storage.chunks_exact(x.stride).zip(out.storage_mut().chunks_exact_mut(x.width)) {
            rms_norm_row(&row[x.offset..x.offset + x.width], w, eps, dst);
        }
    }

    fn rms_norm_heads_unchecked(&self, x: &mut Tensor<Self>, heads: HeadSpan, w: &Vec<f32>, eps: f32) {
        let stride = x.width();
        for row in x.storage_mut().chunks_exact_mut(stride) {
            for i in 0..heads.count {
                let o = heads.offset + i * heads.stride;
                let head = row[o..o + heads.width].to_vec();
                rms_norm_row(&head, w, eps, &mut row[o..o + heads.width]);
            }
        }
    }

    fn sum_squares_heads_unchecked(&self, x: &Tensor<Self>, heads: HeadSpan, out: &mut Tensor<Self>, col: usize) {
        let (xw, ow) = (x.width(), out.width());
        for (row, o) in x.storage().chunks_exact(xw).zip(out.storage_mut().chunks_exact_mut(ow)) {
            for h in 0..heads.count {
                let s = heads.offset + h * heads.stride;
                o[col + h] = row[s..s + heads.width].iter().map(|&v| v as f64 * v as f64).sum::<f64>() as f32;
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
                let inv = 1.0 / (s[col + h] as f64 / n as f64 + eps as f64).sqrt();
                let o = heads.offset + h * heads.stride;
                for (v, &w) in row[o..o + heads.width].iter_mut().zip(w) {
                    *v = (w as f64 * (*v as f64 * inv)) as f32;
                }
            }
        }
    }

    fn rope_table(&self, freqs: &RopeFreqs, len: usize) -> RopeTable {
        let half = freqs.inv_freq.len();
        let (mut cos, mut sin) = (Vec::with_capacity(len * half), Vec::with_capacity(len * half));
        for p in 0..len {
            for &f in &freqs.inv_freq {
                // The angle as HF forms it (an f32 product), its cos/sin in f64.
                let a = (p as f32 * f) as f64;
                cos.push(a.cos() * freqs.scale as f64);
                sin.push(a.sin() * freqs.scale as f64);
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
        let (stride, half) = (x.width(), table.half);
        for (s, seg) in batch.segments().iter().enumerate() {
            for (i, row) in batch.range(s).enumerate() {
                let pos = seg.pos0 + i;
                let (cos, sin) = (&table.cos[pos * half..][..half], &table.sin[pos * half..][..half]);
                for h in 0..heads.count {
                    let o = row * stride + heads.offset + h * heads.stride;
                    let head = &mut x.storage_mut()[o..o + 2 * half];
                    // Pair i is (a, b): (i, i + half), or (2i, 2i + 1) when interleaved.
                    let pair = |i: usize| if interleave { (2 * i, 2 * i + 1) } else { (i, i + half) };
                    let src = widen(head);
                    for i in 0..half {
                        let (a, b) = (src[pair(i).0], src[pair(i).1]);
                        // Output is [rotated a's | rotated b's] in both layouts.
                        head[i] = (a * cos[i] - b * sin[i]) as f32;
                        head[half + i] = (b * cos[i] + a * sin[i]) as f32;
                    }
                }
            }
        }
    }

    fn glu_unchecked(&self, act: Glu, gate_up: &Tensor<Self>, out: &mut Tensor<Self>) {
        let inter = out.width();
        for (gu, o) in gate_up.storage().chunks_exact(2 * inter).zip(out.storage_mut().chunks_exact_mut(inter)) {
            for i in 0..inter {
                o[i] = glu_f64(act, gu[i] as f64, gu[inter + i] as f64) as f32;
            }
        }
    }

    fn attn_temperature_unchecked(&self, x: &mut Tensor<Self>, heads: HeadSpan, t: Temperature, batch: &PackedBatch) {
        let width = x.width();
        for (s, seg) in batch.segments().iter().enumerate() {
            for (i, row) in batch.range(s).enumerate() {
                // The definition in f64: ln(1 + floor((p + 1) / floor_scale)) · attn_scale + 1.
                let p = (seg.pos0 + i) as f64;
                let f = ((p + 1.0) / t.floor_scale as f64).floor().ln_1p() * t.attn_scale as f64 + 1.0;
                for h in 0..heads.count {
                    let o = row * width + heads.offset + h * heads.stride;
                    for v in &mut x.storage_mut()[o..o + heads.width] {
                        *v = (*v as f64 * f) as f32;
                    }
                }
            }
        }
    }

    fn scale<W: Dim>(&self, x: &mut Tensor<Self, W>, s: f32) {
        for x in x.storage_mut() {
            *x = (*x as f64 * s as f64) as f32;
        }
    }

    fn add_unchecked<W: Dim>(&self, x: &mut Tensor<Self, W>, y: &Tensor<Self, W>) {
        for (x, y) in x.storage_mut().iter_mut().zip(y.storage()) {
            *x = (*x as f64 + *y as f64) as f32;
        }
    }

    fn copy_heads_unchecked(&self, src: &Tensor<Self>, from: HeadSpan, dst: &mut Tensor<Self>, to: HeadSpan) {
        let (ss, ds) = (src.width(), dst.width());
        for r in 0..src.rows() {
            for i in 0..to.count {
                for c in 0..to.width {
                    dst.storage_mut()[r * ds + to.offset + i * to.stride + c] =
                        src.storage()[r * ss + from.offset + i * from.stride + c];
                }
            }
        }
    }

    fn gather_rows_unchecked<W: Dim>(&self, x: &Tensor<Self, W>, rows: &[usize], out: &mut Tensor<Self, W>) {
        let w = x.width().size();
        for (i, &r) in rows.iter().enumerate() {
            for c in 0..w {
                out.storage_mut()[i * w + c] = x.storage()[r * w + c];
            }
        }
    }

    fn linear_forward_unchecked<W: Dim, V: Dim>(&self, l: &Linear, x: &Tensor<Self, W>, out: &mut Tensor<Self, V>) {
        for (y, dst) in l.apply(x.storage()).into_iter().zip(out.storage_mut().chunks_exact_mut(l.out_features())) {
            dst.iter_mut().zip(y).for_each(|(d, y)| *d = y as f32);
        }
    }

    fn linear_add_unchecked<W: Dim, V: Dim>(&self, l: &Linear, x: &Tensor<Self, W>, residual: &mut Tensor<Self, V>) {
        let rows = residual.storage_mut().chunks_exact_mut(l.out_features());
        for (y, dst) in l.apply(x.storage()).into_iter().zip(rows) {
            dst.iter_mut().zip(y).for_each(|(d, y)| *d = (*d as f64 + y) as f32);
        }
    }

    fn sigmoid_mul_unchecked<W: Dim>(&self, x: &mut Tensor<Self, W>, gate: Cols<'_, Self>) {
        let w = x.width().size();
        for (r, row) in x.storage_mut().chunks_exact_mut(w.max(1)).enumerate() {
            let g = &gate.storage[r * gate.stride + gate.offset..][..gate.width];
            for (i, v) in row.iter_mut().enumerate() {
                let gi = if gate.width == 1 { g[0] } else { g[i] };
                *v = (*v as f64 * sigmoid(gi as f64)) as f32;
            }
        }
    }
}

impl AttentionOps for Reference {
    type KvCache = KvCache;

    fn attention_unchecked(
        &self,
        qkv: Qkv<'_, Self>,
        s: AttnShape,
        sinks: Option<&Vec<f32>>,
        batch: &PackedBatch,
        kv: LayerState<'_, KvCache>,
        out: &mut Tensor<Self>,
    ) {
        let (Qkv { q, k, v }, LayerState { state: cache, layer }) = (qkv, kv);
        let (nh, nkv, hd, vd) = (s.heads, s.kv_heads, s.head_dim, s.v_dim);
        let (kw, vw, ow) = (nkv * hd, nkv * vd, nh * vd);
        for (si, seg) in batch.segments().iter().enumerate() {
            let rows = batch.range(si);
            // Keys and values of positions 0..pos0 + len, as rows of kw / vw values.
            let (keys, values): (Vec<f32>, Vec<f32>) = if seg.uses_cache() {
                let e = cache.layer_mut(seg.key, layer, kw, vw);
                for r in rows.clone() {
                    e.k.extend_from_slice(&k.storage[r * k.stride + k.offset..][..kw]);
                    e.v.extend_from_slice(&v.storage[r * v.stride + v.offset..][..vw]);
                }
                (e.k.clone(), e.v.clone())
            } else {
                let pick = |c: &Cols<'_, Self>, w: usize| -> Vec<f32> {
                    rows.clone().flat_map(|r| c.storage[r * c.stride + c.offset..][..w].to_vec()).collect()
                };
                (pick(&k, kw), pick(&v, vw))
            };
            for (i, row) in rows.enumerate() {
                let p = seg.pos0 + i; // the query's position within its sample
                let lo = s.mask.first_key(p);
                for h in 0..nh {
                    let g = h / (nh / nkv);
                    let qh = &q.storage[row * q.stride + q.offset + h * hd..][..hd];
                    let scores: Vec<f64> = (lo..=p)
                        .map(|j| {
                            let kj = &keys[j * kw + g * hd..][..hd];
                            qh.iter().zip(kj).map(|(a, b)| *a as f64 * *b as f64).sum::<f64>() * s.scale as f64
                        })
                        .collect();
                    // A sink is one more logit in the softmax, with no value.
                    let sink = sinks.map(|k| k[h] as f64);
                    let max = scores.iter().cloned().chain(sink).fold(f64::NEG_INFINITY, f64::max);
                    let e: Vec<f64> = scores.iter().map(|x| (x - max).exp()).collect();
                    let z: f64 = e.iter().sum::<f64>() + sink.map_or(0.0, |k| (k - max).exp());
                    for d in 0..vd {
                        let o: f64 = (lo..=p).zip(&e).map(|(j, w)| w / z * values[j * vw + g * vd + d] as f64).sum();
                        out.storage_mut()[row * ow + h * vd + d] = o as f32;
                    }
                }
            }
        }
    }
}

impl MoeOps for Reference {
    /// Per token, its experts and weights.
    type Routes = Vec<Vec<(usize, f64)>>;

    fn moe_route_unchecked(&self, logits: &Tensor<Self>, r: &Router, correction: Option<&Vec<f32>>) -> Self::Routes {
        let e = logits.width();
        let per_group = e / r.n_group;
        logits
            .storage()
            .chunks_exact(e)
            .map(|l| {
                let scores: Vec<f64> = match r.scoring {
                    Scoring::Sigmoid => l.iter().map(|&x| 1.0 / (1.0 + (-(x as f64)).exp())).collect(),
                    Scoring::Softmax => {
                        let max = l.iter().map(|&x| x as f64).fold(f64::NEG_INFINITY, f64::max);
                        let z: f64 = l.iter().map(|&x| (x as f64 - max).exp()).sum();
                        l.iter().map(|&x| (x as f64 - max).exp() / z).collect()
                    }
                };
                // What experts are chosen by: the scores (noaux_tc adds the
                // correction bias), or the logits of a plain sigmoid router.
                let by_logit = r.ranks_by_logit(correction.is_some());
                let mut choice: Vec<f64> = if by_logit {
                    l.iter().map(|&x| x as f64).collect()
                } else {
                    (0..e).map(|i| scores[i] + correction.map_or(0.0, |c| c[i] as f64)).collect()
                };
                if r.topk_method != TopkMethod::Greedy && r.n_group > 1 {
                    // A group's score: its best expert, or (noaux_tc) the sum of its two best.
                    let mut groups: Vec<(usize, f64)> = (0..r.n_group)
                        .map(|g| {
                            let mut v = choice[g * per_group..(g + 1) * per_group].to_vec();
                            v.sort_by(|a, b| b.total_cmp(a));
                            (g, if r.topk_method == TopkMethod::NoauxTc { v[0] + v[1] } else { v[0] })
                        })
                        .collect();
                    groups.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
                    for &(g, _) in &groups[r.topk_group..] {
                        let fill = if r.topk_method == TopkMethod::NoauxTc { f64::NEG_INFINITY } else { 0.0 };
                        choice[g * per_group..(g + 1) * per_group].fill(fill);
                    }
                }
                let mut order: Vec<usize> = (0..e).collect();
                order.sort_by(|&a, &b| choice[b].total_cmp(&choice[a]).then(a.cmp(&b)));
                let picked = &order[..r.top_k];
                let weight =
                    |i: usize| if r.topk_method == TopkMethod::NoauxTc || by_logit { scores[i] } else { choice[i] };
                let denom = if r.norm_topk_prob { picked.iter().map(|&i| weight(i)).sum::<f64>() + 1e-20 } else { 1.0 };
                picked.iter().map(|&i| (i, weight(i) / denom * r.routed_scaling_factor as f64)).collect()
            })
            .collect()
    }

    fn moe_experts_unchecked<H: Dim>(
        &self,
        experts: &[GatedLinear<Self>],
        shared: Option<&GatedLinear<Self>>,
        x: &Tensor<Self, H>,
        routes: &Self::Routes,
        gating: Gating,
        out: &mut Tensor<Self, H>,
    ) {
        let (t, h) = (x.rows(), x.width().size());
        // Σ_k w_k · expert_k(x) + shared(x), summed in f64 and rounded once.
        let mut acc = vec![vec![0f64; h]; t];
        for (e, expert) in experts.iter().enumerate() {
            let picked: Vec<(usize, f64)> = routes
                .iter()
                .enumerate()
                .flat_map(|(tok, r)| r.iter().filter(|(i, _)| *i == e).map(move |(_, w)| (tok, *w)))
                .collect();
            if picked.is_empty() {
                continue;
            }
            // Input gating scales each row, rounded to f32 as the expert's input is.
            let input = gating == Gating::Input;
            let rows: Vec<f32> = picked
                .iter()
                .flat_map(|&(tok, w)| {
                    let row = &x.storage()[tok * h..(tok + 1) * h];
                    row.iter().map(move |&v| if input { (v as f64 * w) as f32 } else { v })
                })
                .collect();
            for (y, &(tok, w)) in gated_rows(expert, &rows).into_iter().zip(&picked) {
                let w = if input { 1.0 } else { w };
                acc[tok].iter_mut().zip(y).for_each(|(a, y)| *a += w * y);
            }
        }
        if let Some(sh) = shared {
            for (a, y) in acc.iter_mut().zip(gated_rows(sh, x.storage())) {
                a.iter_mut().zip(y).for_each(|(a, y)| *a += y);
            }
        }
        for (dst, a) in out.storage_mut().chunks_exact_mut(h).zip(acc) {
            dst.iter_mut().zip(a).for_each(|(d, a)| *d = a as f32);
        }
    }
}

/// The fused ops as the ops they are made of (their defaults).
impl FusedOps for Reference {}

impl RecurrentOps for Reference {
    type DeltaState = DeltaCache<DeltaLayer>;

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
        let (c, k) = (shape.channels(), shape.conv_kernel);
        for (si, seg) in batch.segments().iter().enumerate() {
            let rows = batch.range(si);
            // The inputs of positions pos0 - (K - 1) .. end, zeros before position 0.
            let mut inputs = vec![0f32; (k - 1) * c];
            if seg.uses_cache() {
                let held = &state.0.layer_mut(seg.key, layer).conv;
                if !held.is_empty() {
                    inputs.copy_from_slice(held);
                }
            }
            for r in rows.clone() {
                inputs.extend_from_slice(&x.storage[r * x.stride + x.offset..][..c]);
            }
            for (i, r) in rows.clone().enumerate() {
                for ch in 0..c {
                    let acc: f64 = (0..k).map(|j| w[ch * k + j] as f64 * inputs[(i + j) * c + ch] as f64).sum();
                    out.storage_mut()[r * c + ch] = silu(acc) as f32;
                }
            }
            if seg.uses_cache() {
                let tail = inputs[inputs.len() - (k - 1) * c..].to_vec();
                state.0.layer_mut(seg.key, layer).conv = tail;
            }
        }
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
        let (nk, nv, dk, dv) = (sh.k_heads, sh.v_heads, sh.k_dim, sh.v_dim);
        let (c, per) = (sh.channels(), nv / nk);
        let l2 = |x: &[f32]| -> Vec<f64> {
            let inv = 1.0 / (x.iter().map(|&v| v as f64 * v as f64).sum::<f64>() + 1e-6).sqrt();
            x.iter().map(|&v| v as f64 * inv).collect()
        };
        for (si, seg) in batch.segments().iter().enumerate() {
            // The recurrent state of every value head, [v_heads, k_dim, v_dim].
            let mut s = vec![0f64; nv * dk * dv];
            if seg.uses_cache() {
                let held = &state.0.layer_mut(seg.key, layer).s;
                if !held.is_empty() {
                    s.copy_from_slice(held);
                }
            }
            for r in batch.range(si) {
                let row = &qkv.storage()[r * c..][..c];
                let (zr, bar) =
                    (&z.storage[r * z.stride + z.offset..][..nv * dv], &ba.storage[r * ba.stride + ba.offset..]);
                for h in 0..nv {
                    let hk = h / per;
                    let q: Vec<f64> = l2(&row[hk * dk..][..dk]).iter().map(|v| v / (dk as f64).sqrt()).collect();
                    let k = l2(&row[nk * dk + hk * dk..][..dk]);
                    let v = &row[2 * nk * dk + h * dv..][..dv];
                    let beta = sigmoid(bar[h] as f64);
                    let g = -(rule.a_log[h] as f64).exp() * softplus(bar[nv + h] as f64 + rule.dt_bias[h] as f64);
                    let sh = &mut s[h * dk * dv..][..dk * dv]; // [k_dim, v_dim]
                    let decay = g.exp();
                    sh.iter_mut().for_each(|x| *x *= decay);
                    for d in 0..dv {
                        let mem: f64 = (0..dk).map(|a| sh[a * dv + d] * k[a]).sum();
                        let delta = (v[d] as f64 - mem) * beta;
                        (0..dk).for_each(|a| sh[a * dv + d] += k[a] * delta);
                    }
                    let o: Vec<f64> = (0..dv).map(|d| (0..dk).map(|a| sh[a * dv + d] * q[a]).sum()).collect();
                    // The gated RMSNorm of the head's output.
                    let inv = 1.0 / (o.iter().map(|x| x * x).sum::<f64>() / dv as f64 + rule.eps as f64).sqrt();
                    for d in 0..dv {
                        let gate = silu(zr[h * dv + d] as f64);
                        out.storage_mut()[r * nv * dv + h * dv + d] = (o[d] * inv * rule.norm[d] as f64 * gate) as f32;
                    }
                }
            }
            if seg.uses_cache() {
                state.0.layer_mut(seg.key, layer).s = s;
            }
        }
    }
}
