//! Causal self-attention over a packed batch of variable-length segments.
//!
//! Each segment attends only within its own sample, optionally within a
//! sliding window; no padding is computed. A segment that continues a sample
//! (chunked prefill) reads the earlier positions' keys and values from a cache.
//! Work is split into tasks of (segment, kv head, query block), so K and V are
//! packed once per GQA group.
//!
//! Results are bitwise independent of how samples are packed and chunked:
//! every reduction runs in an order fixed by absolute positions (the P·V sum
//! starts at a multiple of [`KV_ALIGN`]; masked terms are exact zeros).

use super::gemm::{gemm_raw, Init};
use super::panels::{pack_b, KC, NR};
use super::SharedMut;
use crate::backend::AttnShape;
use rayon::prelude::*;
use std::ops::Range;

/// Query rows per task.
const QB: usize = 64;
/// The P·V reduction starts at a multiple of this absolute position, so its
/// GEMM k-blocks (of `KC`) fall on the same positions however the sample is chunked.
pub const KV_ALIGN: usize = KC;

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

#[derive(Default)]
struct Scratch {
    kpack: Vec<f32>,
    vpack: Vec<f32>,
    scores: Vec<f32>,
    apack: Vec<f32>,
}

/// `out[rows, heads·v_dim]` = softmax(q·kᵀ·scale + causal mask)·v for every segment.
/// `q` holds the queries with row stride `q_stride` (head `h` at column `h·head_dim`).
pub fn varlen_attention(q: &[f32], q_stride: usize, segments: &[AttnSegment], s: AttnShape, out: &mut [f32]) {
    let (nh, nkv, hd, vd) = (s.heads, s.kv_heads, s.head_dim, s.v_dim);
    let ostride = nh * vd;
    let rows: usize = segments.iter().map(|g| g.rows.end).max().unwrap_or(0);
    assert!(rows == 0 || q.len() >= (rows - 1) * q_stride + nh * hd, "attention: q size");
    assert!(out.len() >= rows * ostride, "attention: out size");
    for seg in segments {
        let kv_rows = seg.pos0 + seg.rows.len();
        assert!(kv_rows == 0 || seg.kv.k.len() >= (kv_rows - 1) * seg.kv.stride + nkv * hd, "attention: k size");
        assert!(kv_rows == 0 || seg.kv.v.len() >= (kv_rows - 1) * seg.kv.v_stride + nkv * vd, "attention: v size");
    }
    let group = nh / nkv;
    let mut tasks = Vec::new();
    for (si, seg) in segments.iter().enumerate() {
        for g in 0..nkv {
            for r0 in (0..seg.rows.len()).step_by(QB) {
                tasks.push((si, g, r0));
            }
        }
    }
    let optr = SharedMut::new(out.as_mut_ptr());
    let run = |scratch: &mut Scratch, &(si, g, r0): &(usize, usize, usize)| {
        let seg = &segments[si];
        let r1 = (r0 + QB).min(seg.rows.len());
        let qlen = r1 - r0;
        // Absolute positions of this block's queries and of the keys they may see.
        let (qa0, qa1) = (seg.pos0 + r0, seg.pos0 + r1);
        let lo0 = s.window.map_or(0, |w| (qa0 + 1).saturating_sub(w));
        let kv0 = lo0 - lo0 % KV_ALIGN;
        let kv_len = qa1 - kv0;
        let kv = seg.kv;
        pack_b(&kv.k[kv0 * kv.stride + g * hd..], kv_len, hd, kv.stride, 1, &mut scratch.kpack);
        pack_b(&kv.v[kv0 * kv.v_stride + g * vd..], vd, kv_len, 1, kv.v_stride, &mut scratch.vpack);
        scratch.scores.resize(qlen * kv_len, 0.0);
        for h in g * group..(g + 1) * group {
            let qoff = (seg.rows.start + r0) * q_stride + h * hd;
            // SAFETY: scores holds qlen × kv_len floats; kpack was packed for kv_len × hd.
            unsafe {
                gemm_raw(
                    &q[qoff..],
                    q_stride,
                    qlen,
                    hd,
                    scratch.kpack.as_ptr(),
                    kv_len,
                    0..kv_len.div_ceil(NR),
                    scratch.scores.as_mut_ptr(),
                    kv_len,
                    Init::Zero,
                    &mut scratch.apack,
                );
            }
            for (r, row) in scratch.scores.chunks_exact_mut(kv_len).enumerate() {
                let i = qa0 + r; // absolute position of the query
                let lo = s.window.map_or(0, |w| (i + 1).saturating_sub(w)) - kv0;
                let hi = i + 1 - kv0;
                let mut max = f32::NEG_INFINITY;
                for v in &mut row[lo..hi] {
                    *v *= s.scale;
                    max = max.max(*v);
                }
                let mut sum = 0f32;
                for v in &mut row[lo..hi] {
                    *v = (*v - max).exp();
                    sum += *v;
                }
                let inv = 1.0 / sum;
                row[..lo].fill(0.0);
                row[lo..hi].iter_mut().for_each(|v| *v *= inv);
                row[hi..].fill(0.0);
            }
            // SAFETY: this task owns rows [start+r0, start+r1) × columns [h·vd, (h+1)·vd) of out.
            unsafe {
                gemm_raw(
                    &scratch.scores,
                    kv_len,
                    qlen,
                    kv_len,
                    scratch.vpack.as_ptr(),
                    vd,
                    0..vd.div_ceil(NR),
                    optr.get().add((seg.rows.start + r0) * ostride + h * vd),
                    ostride,
                    Init::Zero,
                    &mut scratch.apack,
                );
            }
        }
    };
    if rows > QB {
        tasks.par_iter().for_each_init(Scratch::default, run);
    } else {
        let mut scratch = Scratch::default();
        tasks.iter().for_each(|t| run(&mut scratch, t));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Direct transcription of the definition, in f64.
    fn reference(qkv: &[f32], cu: &[usize], s: AttnShape) -> Vec<f32> {
        let (nh, nkv, hd) = (s.heads, s.kv_heads, s.head_dim);
        let stride = (nh + 2 * nkv) * hd;
        let total = *cu.last().unwrap();
        let mut out = vec![0f32; total * nh * hd];
        for w in cu.windows(2) {
            for i in w[0]..w[1] {
                for h in 0..nh {
                    let g = h / (nh / nkv);
                    let lo = s.window.map_or(w[0], |win| (i + 1).saturating_sub(win).max(w[0]));
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
                    let max = scores.iter().cloned().fold(f64::MIN, f64::max);
                    let e: Vec<f64> = scores.iter().map(|v| (v - max).exp()).collect();
                    let z: f64 = e.iter().sum();
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
    fn matches_reference_with_gqa_window_and_ragged_lengths() {
        let cu = [0usize, 1, 70, 75, 205];
        for window in [None, Some(5), Some(100)] {
            let s = AttnShape { heads: 4, kv_heads: 2, head_dim: 24, v_dim: 24, window, scale: 24f32.powf(-0.5) };
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
            varlen_attention(&qkv, stride, &segs, s, &mut out);
            let want = reference(&qkv, &cu, s);
            for (i, (a, b)) in out.iter().zip(&want).enumerate() {
                assert!((a - b).abs() < 1e-5, "window {window:?} at {i}: {a} vs {b}");
            }
        }
    }

    #[test]
    fn chunks_equal_whole_bitwise_past_the_alignment_block() {
        // Positions beyond KV_ALIGN with a window: the P·V sum starts at an aligned
        // position, so chunk boundaries cannot change the rounding.
        let (t, hd) = (4000usize, 8usize);
        let s = AttnShape { heads: 2, kv_heads: 1, head_dim: hd, v_dim: hd, window: Some(1500), scale: 0.3 };
        let stride = 4 * hd;
        let qkv: Vec<f32> = (0..t * stride).map(|i| ((i * 7919 % 1013) as f32 / 500.0) - 1.0).collect();
        let kv = KvRef { k: &qkv[2 * hd..], v: &qkv[3 * hd..], stride, v_stride: stride };
        let mut whole = vec![0f32; t * 2 * hd];
        varlen_attention(&qkv, stride, &[AttnSegment { rows: 0..t, pos0: 0, kv }], s, &mut whole);
        let mut chunked = vec![0f32; t * 2 * hd];
        for (a, b) in [(0, 1000), (1000, 1037), (1037, 2900), (2900, 4000)] {
            // The chunk's queries are its own rows; K/V cover positions 0..b.
            let mut out = vec![0f32; (b - a) * 2 * hd];
            let seg = AttnSegment { rows: 0..b - a, pos0: a, kv };
            varlen_attention(&qkv[a * stride..], stride, &[seg], s, &mut out);
            chunked[a * 2 * hd..b * 2 * hd].copy_from_slice(&out);
        }
        assert!(whole == chunked, "chunked attention differs from whole");
    }
}
