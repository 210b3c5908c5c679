//! Causal self-attention over a packed batch of variable-length segments,
//! flash-style: keys and values are visited in blocks of [`KB`] positions
//! with an online softmax, so no score row longer than a block is ever held.
//!
//! Each segment attends only within its own sample, optionally within a
//! sliding window; no padding is computed. A segment that continues a sample
//! (chunked prefill) reads the earlier positions' keys and values from a cache.
//! Work is split into tasks of (segment, kv head, query block), so K and V
//! blocks are packed once per GQA group.
//!
//! Both GEMMs (`Q·Kᵀ` and `P·V`) run on the compute dtype's path: with bf16,
//! Q, K, V and the probabilities are rounded to bf16; the scores, the
//! softmax's max and sum and the output stay f32.
//!
//! Results are bitwise independent of how samples are packed and chunked:
//! key blocks start at absolute positions that are multiples of [`KB`], a
//! query row skips every block in which it sees no key, and masked terms
//! are exact zeros, so each row goes through the same arithmetic however its
//! sample was cut.

use super::gemm::bf16::{self, with_bf16_path};
use super::gemm::f32::F32Path;
use super::gemm::{gemm_prepacked, gemm_tiles, pack_rows, ARows, Init, Path};
use super::panels::{InPlace, NR};
use super::SharedMut;
use crate::backend::{AttnShape, Compute};
use rayon::prelude::*;
use std::ops::Range;

/// Query rows per task.
const QB: usize = 64;
/// Key positions per block; blocks start at multiples of it.
pub const KB: usize = 256;

/// Keys and values of one sample by absolute position: position `p`, kv head
/// `g` starts at `k[p * stride + g * head_dim]` and `v[p * v_stride + g * v_dim]`.
#[derive(Clone, Copy, Debug)]
pub struct KvRef<'a> {
    /// Keys.
    pub k: &'a [f32],
    /// Values.
    pub v: &'a [f32],
    /// Floats between consecutive positions of `k`.
    pub stride: usize,
    /// Floats between consecutive positions of `v`.
    pub v_stride: usize,
}

/// One segment's queries and the keys/values it attends to.
#[derive(Clone, Debug)]
pub struct AttnSegment<'a> {
    /// Query rows in the packed q/k/v and output buffers.
    pub rows: Range<usize>,
    /// Absolute position of the first query row within its sample.
    pub pos0: usize,
    /// Keys/values of positions `0..pos0 + rows.len()` of the sample.
    pub kv: KvRef<'a>,
}

/// One task's buffers, reused across the tasks a thread runs. A task's
/// rows are its kv head's `group` query heads stacked: row `hg · qlen + ri`
/// is query `ri` of head `hg` of the group.
struct Scratch<P: Path> {
    apack: Vec<P::A>,
    bbuf: Vec<P::B>,
    /// The stacked queries, packed once for every key block.
    qpack: Vec<P::A>,
    /// `[group · qlen, kb]` scores, then probabilities.
    scores: Vec<f32>,
    /// `[group · qlen, vd]` this block's `P·V`.
    pv: Vec<f32>,
    /// `[group · qlen, vd]` unnormalised outputs.
    acc: Vec<f32>,
    /// `[group · qlen]` running max and sum of each row.
    max: Vec<f32>,
    sum: Vec<f32>,
    /// `[group · qlen]` this block's factor for a row's earlier sum, or
    /// `None` where the row sees no key in the block.
    rescale: Vec<Option<f32>>,
}

impl<P: Path> Default for Scratch<P> {
    fn default() -> Self {
        Scratch {
            apack: Vec::new(),
            bbuf: Vec::new(),
            qpack: Vec::new(),
            scores: Vec::new(),
            pv: Vec::new(),
            acc: Vec::new(),
            max: Vec::new(),
            sum: Vec::new(),
            rescale: Vec::new(),
        }
    }
}

/// `out[rows, heads·v_dim]` = softmax(q·kᵀ·scale + causal mask)·v for every
/// segment, with GEMM inputs in `compute`. `q` holds the queries with row
/// stride `q_stride` (head `h` at column `h·head_dim`). `sinks` (one logit
/// per head) start each row's running max and sum, so `exp(sink)` is in
/// every denominator.
pub fn varlen_attention(
    q: &[f32],
    q_stride: usize,
    segments: &[AttnSegment],
    s: AttnShape,
    sinks: Option<&[f32]>,
    compute: Compute,
    out: &mut [f32],
) {
    match compute {
        Compute::F32 => attend(F32Path::detect(), q, q_stride, segments, s, sinks, out),
        Compute::Bf16 => with_bf16_path!(bf16::detect(), p => attend(p, q, q_stride, segments, s, sinks, out)),
    }
}

fn attend<P: Path>(
    path: P,
    q: &[f32],
    q_stride: usize,
    segments: &[AttnSegment],
    s: AttnShape,
    sinks: Option<&[f32]>,
    out: &mut [f32],
) {
    let (nh, nkv, hd, vd) = (s.heads, s.kv_heads, s.head_dim, s.v_dim);
    assert!(sinks.is_none_or(|k| k.len() == nh), "attention: one sink per head");
    let ostride = nh * vd;
    let rows: usize = segments.iter().map(|g| g.rows.end).max().unwrap_or(0);
    assert!(rows == 0 || q.len() >= (rows - 1) * q_stride + nh * hd, "attention: q size");
    assert!(out.len() >= rows * ostride, "attention: out size");
    for seg in segments {
        let kv_rows = seg.pos0 + seg.rows.len();
        assert!(kv_rows == 0 || seg.kv.k.len() >= (kv_rows - 1) * seg.kv.stride + nkv * hd, "attention: k size");
        assert!(kv_rows == 0 || seg.kv.v.len() >= (kv_rows - 1) * seg.kv.v_stride + nkv * vd, "attention: v size");
    }
    let mut tasks = Vec::new();
    for (si, seg) in segments.iter().enumerate() {
        for g in 0..nkv {
            for r0 in (0..seg.rows.len()).step_by(QB) {
                tasks.push((si, g, r0));
            }
        }
    }
    let parallel = rows > QB;
    // Every (segment, kv head)'s keys and values packed once, for all its query blocks.
    let heads: Vec<(usize, usize)> = (0..segments.len()).flat_map(|si| (0..nkv).map(move |g| (si, g))).collect();
    let pack = |&(si, g): &(usize, usize)| KvPack::new(path, &segments[si], &s, g);
    let packs: Vec<KvPack<P::B>> =
        if parallel { heads.par_iter().map(pack).collect() } else { heads.iter().map(pack).collect() };
    let optr = SharedMut::new(out.as_mut_ptr());
    let run = |scratch: &mut Scratch<P>, &(si, g, r0): &(usize, usize, usize)| {
        let seg = &segments[si];
        let r1 = (r0 + QB).min(seg.rows.len());
        // SAFETY: this task owns rows [start+r0, start+r1) × the columns of
        // kv head g's query heads of `out`; no other task writes them.
        unsafe { block(path, q, q_stride, seg, &packs[si * nkv + g], s, sinks, g, r0..r1, optr, scratch) };
    };
    if parallel {
        tasks.par_iter().for_each_init(Scratch::<P>::default, run);
    } else {
        let mut scratch = Scratch::default();
        tasks.iter().for_each(|t| run(&mut scratch, t));
    }
}

/// The keys and values one (segment, kv head) attends to, packed as GEMM B
/// panels from the first key block any of its queries sees.
struct KvPack<B> {
    /// `[positions / NR][hd][NR]` (f32) or pair panels: keys as the columns of `Q·Kᵀ`.
    k: Vec<B>,
    /// `[vd / NR][positions][NR]`: positions as the depth of `P·V`.
    v: Vec<B>,
    /// The first packed position, a multiple of `KB`.
    from: usize,
    /// Packed depths per K panel (`hd` padded) and per V panel (positions padded).
    k_kpad: usize,
    v_kpad: usize,
}

impl<B> KvPack<B> {
    fn new<P: Path<B = B>>(path: P, seg: &AttnSegment, s: &AttnShape, g: usize) -> Self {
        let (hd, vd, kv) = (s.head_dim, s.v_dim, seg.kv);
        let from = s.mask.first_key(seg.pos0) / KB * KB;
        let len = seg.pos0 + seg.rows.len() - from;
        let (mut k, mut v) = (Vec::new(), Vec::new());
        if len > 0 {
            path.pack_b(&kv.k[from * kv.stride + g * hd..], len, hd, kv.stride, 1, &mut k);
            path.pack_b(&kv.v[from * kv.v_stride + g * vd..], vd, len, 1, kv.v_stride, &mut v);
        }
        KvPack { k, v, from, k_kpad: hd.next_multiple_of(P::STEP), v_kpad: len.next_multiple_of(P::STEP) }
    }

    /// The keys of the block at `b0` as B panels (`kb` columns of depth `hd`).
    fn keys(&self, b0: usize) -> InPlace<B> {
        // b0 - from is a multiple of KB, so of NR: the block starts a panel.
        let offset = (b0 - self.from) / NR * self.k_kpad * NR;
        InPlace { ptr: self.k[offset..].as_ptr(), kpad: self.k_kpad }
    }

    /// The values of the block at `b0` as B panels (`vd` columns of depth `kb`).
    fn values(&self, b0: usize) -> InPlace<B> {
        // An even depth offset: pair panels start a pair there.
        InPlace { ptr: self.v[(b0 - self.from) * NR..].as_ptr(), kpad: self.v_kpad }
    }
}

/// Query rows `r` (relative to the segment) of kv head `g`'s query heads.
///
/// # Safety
/// The caller owns those rows and heads of `out`.
#[allow(clippy::too_many_arguments)]
unsafe fn block<P: Path>(
    path: P,
    q: &[f32],
    q_stride: usize,
    seg: &AttnSegment,
    kv: &KvPack<P::B>,
    s: AttnShape,
    sinks: Option<&[f32]>,
    g: usize,
    r: Range<usize>,
    out: SharedMut,
    sc: &mut Scratch<P>,
) {
    let (hd, vd) = (s.head_dim, s.v_dim);
    let group = s.heads / s.kv_heads;
    let qlen = r.len();
    // The group's heads share every key and value block, so their queries
    // go through the two products together, one GEMM each per key block
    // (each row's arithmetic is the same as alone: rows never mix).
    let m = group * qlen;
    // Absolute positions of this block's queries; key blocks from the one
    // holding the first key the first query sees.
    let (qa0, qa1) = (seg.pos0 + r.start, seg.pos0 + r.end);
    let heads = ARows::Heads {
        a: &q[(seg.rows.start + r.start) * q_stride + g * group * hd..],
        lda: q_stride,
        width: hd,
        per: qlen,
        first: 0,
    };
    pack_rows::<P, InPlace<P::B>>(path, heads, m, hd, &mut sc.qpack);
    sc.acc.clear();
    sc.acc.resize(m * vd, 0.0);
    sc.max.clear();
    sc.max.resize(m, f32::NEG_INFINITY);
    sc.sum.clear();
    sc.sum.resize(m, 0.0);
    if let Some(sinks) = sinks {
        // The sink as a key seen before all others: max `sink`, sum `e^0`, no value.
        for (row_i, (max, sum)) in sc.max.iter_mut().zip(sc.sum.iter_mut()).enumerate() {
            (*max, *sum) = (sinks[g * group + row_i / qlen], 1.0);
        }
    }
    sc.rescale.resize(m, None);
    let mut b0 = s.mask.first_key(qa0) / KB * KB;
    while b0 < qa1 {
        let kb = KB.min(qa1 - b0);
        let (kpanels, vpanels) = (kv.keys(b0), kv.values(b0));
        sc.scores.resize(m * kb, 0.0);
        sc.pv.resize(m * vd, 0.0);
        // scores[m, kb] = Q · K_blockᵀ
        gemm_prepacked(
            path,
            &sc.qpack,
            m,
            hd,
            &kpanels,
            kb,
            0..kb.div_ceil(NR),
            sc.scores.as_mut_ptr(),
            kb,
            Init::Zero,
            &mut sc.bbuf,
        );
        // Online softmax: each row's probabilities against its running max.
        for (row_i, row) in sc.scores.chunks_exact_mut(kb).enumerate() {
            let i = qa0 + row_i % qlen;
            let lo = s.mask.first_key(i).max(b0) - b0;
            let hi = (i + 1).min(b0 + kb).saturating_sub(b0);
            if lo >= hi {
                row.fill(0.0);
                sc.rescale[row_i] = None;
                continue;
            }
            let (max, sum) = (&mut sc.max[row_i], &mut sc.sum[row_i]);
            let (mx, z, alpha) = softmax_terms(&mut row[lo..hi], s.scale, *max);
            row[..lo].fill(0.0);
            row[hi..].fill(0.0);
            sc.rescale[row_i] = Some(alpha);
            *sum = *sum * alpha + z;
            *max = mx;
        }
        // pv[m, vd] = P · V_block
        gemm_tiles(
            path,
            ARows::Plain(&sc.scores, kb),
            m,
            kb,
            &vpanels,
            vd,
            0..vd.div_ceil(NR),
            sc.pv.as_mut_ptr(),
            vd,
            Init::Zero,
            &mut sc.apack,
            &mut sc.bbuf,
        );
        for ((o, pv), alpha) in sc.acc.chunks_exact_mut(vd).zip(sc.pv.chunks_exact(vd)).zip(&sc.rescale) {
            match *alpha {
                None => {}
                // The row's first visible block: nothing earlier to scale.
                Some(0.0) => o.copy_from_slice(pv),
                Some(alpha) => o.iter_mut().zip(pv).for_each(|(o, p)| *o = *o * alpha + p),
            }
        }
        b0 += kb;
    }
    let ostride = s.heads * vd;
    for (row_i, (o, sum)) in sc.acc.chunks_exact(vd).zip(&sc.sum).enumerate() {
        let (hg, ri) = (row_i / qlen, row_i % qlen);
        let h = g * group + hg;
        let inv = 1.0 / sum;
        let dst = out.get().add((seg.rows.start + r.start + ri) * ostride + h * vd);
        for (d, v) in o.iter().enumerate() {
            *dst.add(d) = v * inv;
        }
    }
}

// The softmax row loops run `LANES` interleaved partial sums, then a fixed
// tree, so every CPU (and vector width) gives the same bits.
use super::ops::LANES;

/// Scales `row` by `scale`, then replaces each score `x` with `exp(x - m)`,
/// where `m` is the larger of `max0` and the row's largest scaled score.
/// Returns `m`, the sum of the new row, and `exp(max0 - m)`, the factor
/// for the row's earlier terms (0 when `max0` is `-inf`: nothing earlier).
fn softmax_terms(row: &mut [f32], scale: f32, max0: f32) -> (f32, f32, f32) {
    #[cfg(target_arch = "x86_64")]
    {
        if std::is_x86_feature_detected!("avx512f") {
            // SAFETY: the CPU has AVX-512F, checked just above.
            return unsafe { softmax_terms_avx512(row, scale, max0) };
        }
        if std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma") {
            // SAFETY: the CPU has AVX2 and FMA, checked just above.
            return unsafe { softmax_terms_avx2(row, scale, max0) };
        }
    }
    softmax_terms_body(row, scale, max0)
}

/// [`softmax_terms`] compiled for AVX2 and FMA: the same operations in the
/// same order, eight lanes to a register.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn softmax_terms_avx2(row: &mut [f32], scale: f32, max0: f32) -> (f32, f32, f32) {
    softmax_terms_body(row, scale, max0)
}

/// [`softmax_terms`] in AVX-512 registers: lane `l` of the sum takes values
/// `l`, `l + 16`, … as the plain loop's lanes do, and the row's tail goes
/// through masked lanes instead of a scalar loop (the same bits).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn softmax_terms_avx512(row: &mut [f32], scale: f32, max0: f32) -> (f32, f32, f32) {
    use std::arch::x86_64::*;
    let (n, p) = (row.len(), row.as_mut_ptr());
    let (full, tail) = (n / LANES, n % LANES);
    let tail_mask: __mmask16 = ((1u32 << tail) - 1) as u16;
    let vs = _mm512_set1_ps(scale);
    // Rounding is monotonic, so the largest scaled score is found without
    // storing the scaled row (the exp pass scales again, to the same bits).
    let mut mx = _mm512_set1_ps(max0);
    for c in 0..full {
        // `(v > l) ? v : l`, operand order as in the plain loop.
        mx = _mm512_max_ps(_mm512_mul_ps(_mm512_loadu_ps(p.add(c * LANES)), vs), mx);
    }
    if tail > 0 {
        let v = _mm512_mul_ps(_mm512_maskz_loadu_ps(tail_mask, p.add(full * LANES)), vs);
        mx = _mm512_mask_max_ps(mx, tail_mask, v, mx);
    }
    // The maximum is exact in any order.
    let m = _mm512_reduce_max_ps(mx);
    let vm = _mm512_set1_ps(m);
    let mut sums = _mm512_setzero_ps();
    for c in 0..full {
        let x = _mm512_sub_ps(_mm512_mul_ps(_mm512_loadu_ps(p.add(c * LANES)), vs), vm);
        let e = super::ops::exp16(x);
        _mm512_storeu_ps(p.add(c * LANES), e);
        sums = _mm512_add_ps(sums, e);
    }
    if tail > 0 {
        let x = _mm512_sub_ps(_mm512_mul_ps(_mm512_maskz_loadu_ps(tail_mask, p.add(full * LANES)), vs), vm);
        let e = super::ops::exp16(x);
        _mm512_mask_storeu_ps(p.add(full * LANES), tail_mask, e);
        sums = _mm512_mask_add_ps(sums, tail_mask, sums, e);
    }
    let mut lanes = [0f32; LANES];
    _mm512_storeu_ps(lanes.as_mut_ptr(), sums);
    (m, super::ops::lanes_sum(lanes), rescale(max0, m))
}

/// `exp(max0 - m)`, 0 for a row with nothing before (`max0 = -inf`).
#[inline(always)]
fn rescale(max0: f32, m: f32) -> f32 {
    if max0 == f32::NEG_INFINITY {
        0.0
    } else {
        super::ops::exp(max0 - m)
    }
}

#[inline(always)]
fn softmax_terms_body(row: &mut [f32], scale: f32, max0: f32) -> (f32, f32, f32) {
    // The maximum is exact in any order.
    let mut lanes = [max0; LANES];
    let mut chunks = row.chunks_exact(LANES);
    for c in &mut chunks {
        for (l, v) in lanes.iter_mut().zip(c) {
            let v = v * scale;
            *l = if v > *l { v } else { *l };
        }
    }
    for (l, v) in lanes.iter_mut().zip(chunks.remainder()) {
        let v = v * scale;
        *l = if v > *l { v } else { *l };
    }
    let m = lanes.iter().fold(max0, |a, &b| if b > a { b } else { a });
    let mut sums = [0f32; LANES];
    let mut chunks = row.chunks_exact_mut(LANES);
    for c in &mut chunks {
        for (acc, v) in sums.iter_mut().zip(c.iter_mut()) {
            *v = super::ops::exp(*v * scale - m);
            *acc += *v;
        }
    }
    for (acc, v) in sums.iter_mut().zip(chunks.into_remainder()) {
        *v = super::ops::exp(*v * scale - m);
        *acc += *v;
    }
    (m, super::ops::lanes_sum(sums), rescale(max0, m))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::Mask;

    #[test]
    fn softmax_terms_match_a_plain_loop_and_every_isa() {
        for len in [1, 5, 16, 17, 100, 256] {
            let row: Vec<f32> = (0..len).map(|i| ((i * 37 % 23) as f32 - 11.0) * 0.7).collect();
            // A running max below, inside and above the row's scores.
            for max0 in [f32::NEG_INFINITY, -9.0, 0.5, 3.0] {
                let (mut a, mut b) = (row.clone(), row.clone());
                let (m, z, alpha) = softmax_terms(&mut a, 0.125, max0);
                let (m2, z2, alpha2) = softmax_terms_body(&mut b, 0.125, max0);
                assert_eq!(
                    (m.to_bits(), z.to_bits(), alpha.to_bits()),
                    (m2.to_bits(), z2.to_bits(), alpha2.to_bits()),
                    "len {len}"
                );
                assert_eq!(a, b);
                let want_m = row.iter().map(|v| v * 0.125).fold(max0, f32::max);
                assert_eq!(m, want_m);
                let want: f64 = row.iter().map(|v| ((v * 0.125 - want_m) as f64).exp()).sum();
                assert!((z as f64 - want).abs() < 1e-5 * want, "len {len}: {z} vs {want}");
            }
        }
    }

    /// Direct transcription of the definition, in f64.
    fn reference(qkv: &[f32], cu: &[usize], s: AttnShape, sinks: Option<&[f32]>) -> Vec<f32> {
        let (nh, nkv, hd) = (s.heads, s.kv_heads, s.head_dim);
        let stride = (nh + 2 * nkv) * hd;
        let total = *cu.last().unwrap();
        let mut out = vec![0f32; total * nh * hd];
        for w in cu.windows(2) {
            for i in w[0]..w[1] {
                for h in 0..nh {
                    let g = h / (nh / nkv);
                    let lo = w[0] + s.mask.first_key(i - w[0]);
                    let scores: Vec<f64> = (lo..=i)
                        .map(|j| {
                            (0..hd)
                                .map(|d| {
                                    qkv[i * stride + h * hd + d] as f64 * qkv[j * stride + (nh + g) * hd + d] as f64
                                })
                                .sum::<f64>()
                                * s.scale as f64
                        })
                        .collect();
                    // A sink: one more logit in the denominator, with no value (gpt-oss).
                    let sink = sinks.map(|k| k[h] as f64);
                    let max = scores.iter().cloned().chain(sink).fold(f64::MIN, f64::max);
                    let e: Vec<f64> = scores.iter().map(|v| (v - max).exp()).collect();
                    let z: f64 = e.iter().sum::<f64>() + sink.map_or(0.0, |k| (k - max).exp());
                    for d in 0..hd {
                        let v: f64 = (lo..=i)
                            .zip(&e)
                            .map(|(j, p)| p / z * qkv[j * stride + (nh + nkv + g) * hd + d] as f64)
                            .sum();
                        out[i * nh * hd + h * hd + d] = v as f32;
                    }
                }
            }
        }
        out
    }

    #[test]
    fn matches_reference_with_gqa_masks_and_ragged_lengths() {
        let cu = [0usize, 1, 70, 75, 205];
        let masks = [Mask::Causal, Mask::Sliding(5), Mask::Sliding(100), Mask::Chunked(8), Mask::Chunked(64)];
        for mask in masks {
            let s = AttnShape { heads: 4, kv_heads: 2, head_dim: 24, v_dim: 24, mask, scale: 24f32.powf(-0.5) };
            let stride = (4 + 4) * 24;
            let qkv: Vec<f32> = (0..205 * stride).map(|i| ((i * 7919 % 1000) as f32 / 500.0) - 1.0).collect();
            let mut out = vec![f32::NAN; 205 * 4 * 24];
            let segs: Vec<AttnSegment> = cu
                .windows(2)
                .map(|w| AttnSegment {
                    rows: w[0]..w[1],
                    pos0: 0,
                    kv: KvRef {
                        k: &qkv[w[0] * stride + 4 * 24..],
                        v: &qkv[w[0] * stride + 6 * 24..],
                        stride,
                        v_stride: stride,
                    },
                })
                .collect();
            // Sinks above, among and below the scores (which lie within ±3).
            let sinks = [2.5f32, -0.7, 0.0, -6.0];
            for sinks in [None, Some(&sinks[..])] {
                let want = reference(&qkv, &cu, s, sinks);
                // bf16 rounds q, k, v and the probabilities: 2^-8 relative each.
                for (compute, tol) in [(Compute::F32, 1e-5), (Compute::Bf16, 2e-2)] {
                    varlen_attention(&qkv, stride, &segs, s, sinks, compute, &mut out);
                    for (i, (a, b)) in out.iter().zip(&want).enumerate() {
                        let what = format!("{compute} {mask:?} sinks {}", sinks.is_some());
                        assert!((a - b).abs() < tol, "{what} at {i}: {a} vs {b}");
                    }
                }
            }
        }
    }

    #[test]
    fn chunks_equal_whole_bitwise_in_both_computes() {
        // Positions over many key blocks, with a window or attention chunks
        // (of 700: not a multiple of KB): blocks start at absolute multiples
        // of KB, so chunk boundaries cannot change the rounding.
        for (compute, mask) in
            Compute::ALL.into_iter().flat_map(|c| [(c, Mask::Sliding(1500)), (c, Mask::Chunked(700))])
        {
            let (t, hd) = (4000usize, 8usize);
            let s = AttnShape { heads: 2, kv_heads: 1, head_dim: hd, v_dim: hd, mask, scale: 0.3 };
            let stride = 4 * hd;
            let qkv: Vec<f32> = (0..t * stride).map(|i| ((i * 7919 % 1013) as f32 / 500.0) - 1.0).collect();
            let kv = KvRef { k: &qkv[2 * hd..], v: &qkv[3 * hd..], stride, v_stride: stride };
            let mut whole = vec![0f32; t * 2 * hd];
            varlen_attention(&qkv, stride, &[AttnSegment { rows: 0..t, pos0: 0, kv }], s, None, compute, &mut whole);
            let mut chunked = vec![0f32; t * 2 * hd];
            for (a, b) in [(0, 1000), (1000, 1037), (1037, 2900), (2900, 4000)] {
                // The chunk's queries are its own rows; K/V cover positions 0..b.
                let mut out = vec![0f32; (b - a) * 2 * hd];
                let seg = AttnSegment { rows: 0..b - a, pos0: a, kv };
                varlen_attention(&qkv[a * stride..], stride, &[seg], s, None, compute, &mut out);
                chunked[a * 2 * hd..b * 2 * hd].copy_from_slice(&out);
            }
            assert!(whole == chunked, "{compute} {mask:?}: chunked attention differs from whole");
        }
    }
}
