//! Causal self-attention over a packed batch of variable-length samples.
//!
//! Each sample attends only within itself (`cu_seqlens`), optionally within a
//! sliding window; no padding is computed. Work is split into tasks of
//! (sample, kv head, query block), so K and V are packed once per GQA group.

use super::gemm::{gemm_raw, pack_b, Init, NR};
use rayon::prelude::*;

/// Query rows per task.
const QB: usize = 64;

/// Layout of the fused q/k/v activations: `[T, (heads + 2·kv_heads) · head_dim]`.
#[derive(Clone, Copy, Debug)]
pub struct AttnShape {
    /// Query heads.
    pub heads: usize,
    /// Key/value heads.
    pub kv_heads: usize,
    /// Per-head width.
    pub head_dim: usize,
    /// `Some(w)`: a query sees itself and the `w - 1` positions before it.
    pub window: Option<usize>,
    /// Score scale, `head_dim^-0.5`.
    pub scale: f32,
}

#[derive(Clone, Copy)]
struct OutPtr(*mut f32);
// SAFETY: tasks write disjoint (rows, head columns) tiles of the output.
unsafe impl Send for OutPtr {}
unsafe impl Sync for OutPtr {}

impl OutPtr {
    // A method, so closures capture the Sync wrapper rather than the raw field.
    fn get(self) -> *mut f32 {
        self.0
    }
}

#[derive(Default)]
struct Scratch {
    kpack: Vec<f32>,
    vpack: Vec<f32>,
    scores: Vec<f32>,
    apack: Vec<f32>,
}

/// `out[T, heads·head_dim]` = softmax(q·kᵀ·scale + causal mask)·v per sample and head.
pub fn varlen_attention(qkv: &[f32], cu_seqlens: &[usize], s: AttnShape, out: &mut [f32]) {
    let (nh, nkv, hd) = (s.heads, s.kv_heads, s.head_dim);
    let stride = (nh + 2 * nkv) * hd;
    let ostride = nh * hd;
    let total = *cu_seqlens.last().unwrap_or(&0);
    assert_eq!(qkv.len(), total * stride, "attention: qkv size");
    assert_eq!(out.len(), total * ostride, "attention: out size");
    let group = nh / nkv;
    let mut tasks = Vec::new();
    for (si, w) in cu_seqlens.windows(2).enumerate() {
        let len = w[1] - w[0];
        for g in 0..nkv {
            for q0 in (0..len).step_by(QB) {
                tasks.push((si, g, q0));
            }
        }
    }
    let optr = OutPtr(out.as_mut_ptr());
    let run = |scratch: &mut Scratch, &(si, g, q0): &(usize, usize, usize)| {
        let base = cu_seqlens[si];
        let len = cu_seqlens[si + 1] - base;
        let q1 = (q0 + QB).min(len);
        let qlen = q1 - q0;
        let kv0 = s.window.map_or(0, |w| q0.saturating_sub(w - 1));
        let kv_len = q1 - kv0;
        let koff = (base + kv0) * stride + (nh + g) * hd;
        let voff = (base + kv0) * stride + (nh + nkv + g) * hd;
        pack_b(&qkv[koff..], kv_len, hd, stride, 1, &mut scratch.kpack);
        pack_b(&qkv[voff..], hd, kv_len, 1, stride, &mut scratch.vpack);
        scratch.scores.resize(qlen * kv_len, 0.0);
        for h in g * group..(g + 1) * group {
            let qoff = (base + q0) * stride + h * hd;
            // SAFETY: scores holds qlen × kv_len floats; kpack was packed for kv_len × hd.
            unsafe {
                gemm_raw(
                    &qkv[qoff..],
                    stride,
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
                let i = q0 + r; // position of the query in its sample
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
            // SAFETY: this task owns rows [base+q0, base+q1) × columns [h·hd, (h+1)·hd) of out.
            unsafe {
                gemm_raw(
                    &scratch.scores,
                    kv_len,
                    qlen,
                    kv_len,
                    scratch.vpack.as_ptr(),
                    hd,
                    0..hd.div_ceil(NR),
                    optr.get().add((base + q0) * ostride + h * hd),
                    ostride,
                    Init::Zero,
                    &mut scratch.apack,
                );
            }
        }
    };
    if total > QB {
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
            let s = AttnShape { heads: 4, kv_heads: 2, head_dim: 24, window, scale: 24f32.powf(-0.5) };
            let stride = (4 + 4) * 24;
            let qkv: Vec<f32> = (0..205 * stride).map(|i| ((i * 7919 % 1000) as f32 / 500.0) - 1.0).collect();
            let mut out = vec![f32::NAN; 205 * 4 * 24];
            varlen_attention(&qkv, &cu, s, &mut out);
            let want = reference(&qkv, &cu, s);
            for (i, (a, b)) in out.iter().zip(&want).enumerate() {
                assert!((a - b).abs() < 1e-5, "window {window:?} at {i}: {a} vs {b}");
            }
        }
    }
}
