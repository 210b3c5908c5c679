//! The CUDA kernels of `kernels/`, run on the CPU and checked against the
//! reference backend's ops, one by one. Each kernel file is compiled with g++
//! after `tests/cuda_emu/shim.h` (GPU threads as OS threads, barriers for
//! `__syncthreads`/`__syncwarp`, warp shuffles through memory, `mma.sync`
//! from the PTX fragment layout; see the header for how this differs from a
//! GPU) and launched from here with the grids the backend uses. Needs g++
//! (C++20), not a GPU; CI (STRATA_REQUIRE_NVRTC) fails instead of skipping
//! when it is missing.
#![cfg(feature = "cuda")]

use crate::cuda_emu;

use cuda_emu::{emulation_source, gxx_accepts, gxx_or_skip, lib};
use strata::backend::cuda::backend::{attention_bf16_smem, pad16, split_chunk, SplitPlan, SPLIT_MAX, SPLIT_MIN_KEYS};
use strata::backend::prelude::*;
use strata::backend::{
    AttnShape, Glu, HeadSpan, HeadSums, KvCache, KvStore, LayerState, Mask, Qkv, Reference, Router, Temperature, Tensor,
};
use strata::hf::moe::{Scoring, TopkMethod};
use strata::hf::quant::{QuantKind, QuantRows};
use strata::hf::RopeFreqs;
use strata::pipeline::batch::{PackedBatch, Segment};

/// A host pointer as the kernels take device pointers.
fn p<T>(v: &[T]) -> usize {
    v.as_ptr() as usize
}
fn pm<T>(v: &mut [T]) -> usize {
    v.as_mut_ptr() as usize
}

/// Deterministic values in [-1, 1).
fn values(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9e3779b97f4a7c15) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect()
}

fn assert_close(what: &str, got: &[f32], want: &[f32], tol: f32) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!((g - w).abs() <= tol * w.abs().max(1.0), "{what}[{i}]: got {g}, want {w}");
    }
}

fn bf16(x: f32) -> f32 {
    half::bf16::from_f32(x).to_f32()
}

fn batch(segs: &[(usize, Segment)]) -> PackedBatch {
    let mut b = PackedBatch::new();
    for (len, s) in segs {
        b.push_segment(&vec![1u32; *len], *s);
    }
    b
}

#[test]
fn rms_norm_kernels_match_the_reference() {
    if !gxx_or_skip("rms_norm_kernels_match_the_reference") {
        return;
    }
    let l = lib("norm");
    let (rows, stride, offset, width) = (5usize, 300usize, 7usize, 200usize);
    let x = values(rows * stride, 1);
    let w = values(width, 2);
    let r = Reference;
    let t = Tensor::<Reference>::from_host(&r, &x, rows, stride).unwrap();
    let mut want = Tensor::<Reference>::zeros(&r, rows, width);
    r.rms_norm(t.cols(offset, width), &w, 1e-6, &mut want);
    let mut got = vec![0f32; rows * width];
    type F = unsafe extern "C" fn(usize, i32, i32, i32, usize, f32, usize);
    let f: F = unsafe { std::mem::transmute(l.sym("rms_norm")) };
    let (xp, wp, op) = (p(&x), p(&w), pm(&mut got));
    l.launch((rows as u32, 1), 128, || unsafe { f(xp, stride as i32, offset as i32, width as i32, wp, 1e-6, op) });
    assert_close("rms_norm", &got, &want.to_host(&r), 1e-5);
    // rms_norm_bf16 (the fused input of a bf16 GEMM): rms_norm's values rounded, bit for bit.
    let mut fused = vec![0u16; rows * width];
    type B = unsafe extern "C" fn(usize, i32, i32, i32, usize, f32, usize);
    let f: B = unsafe { std::mem::transmute(l.sym("rms_norm_bf16")) };
    let bp = pm(&mut fused);
    l.launch((rows as u32, 1), 128, || unsafe { f(xp, stride as i32, offset as i32, width as i32, wp, 1e-6, bp) });
    let rounded: Vec<u16> = got.iter().map(|&v| half::bf16::from_f32(v).to_bits()).collect();
    assert!(fused == rounded, "rms_norm_bf16 is not rms_norm rounded to bf16");

    // Per head, in place: 3 heads of 16 at stride 40 from column 4.
    let span = HeadSpan { offset: 4, count: 3, stride: 40, width: 16 };
    let w = values(16, 3);
    let mut want = Tensor::<Reference>::from_host(&r, &x, rows, stride).unwrap();
    r.rms_norm_heads(&mut want, span, &w, 1e-5);
    let mut got = x.clone();
    type H = unsafe extern "C" fn(usize, i32, i32, i32, i32, usize, f32);
    let f: H = unsafe { std::mem::transmute(l.sym("rms_norm_heads")) };
    let (xp, wp) = (pm(&mut got), p(&w));
    l.launch((rows as u32, 3), 32, || unsafe { f(xp, stride as i32, 4, 40, 16, wp, 1e-5) });
    assert_close("rms_norm_heads", &got, &want.to_host(&r), 1e-5);

    // A norm split over ranks, in two halves: the 3 heads' sums of squares
    // into columns 1..4 of a width-5 buffer, then each head scaled as if its
    // vector were 2·16 wide (the other half on another rank, equal sums).
    let rt = Tensor::<Reference>::from_host(&r, &x, rows, stride).unwrap();
    let mut want_sums = Tensor::<Reference>::zeros(&r, rows, 5);
    r.sum_squares_heads(&rt, span, &mut want_sums, 1);
    let mut sums = vec![0f32; rows * 5];
    type S = unsafe extern "C" fn(usize, i32, i32, i32, i32, usize, i32, i32);
    let f: S = unsafe { std::mem::transmute(l.sym("sum_squares_heads")) };
    let (xp, sp) = (p(&x), pm(&mut sums));
    l.launch((rows as u32, 3), 32, || unsafe { f(xp, stride as i32, 4, 40, 16, sp, 5, 1) });
    assert_close("sum_squares_heads", &sums, &want_sums.to_host(&r), 1e-5);
    let doubled: Vec<f32> = sums.iter().map(|s| 2.0 * s).collect();
    let ds = Tensor::<Reference>::from_host(&r, &doubled, rows, 5).unwrap();
    let mut want = Tensor::<Reference>::from_host(&r, &x, rows, stride).unwrap();
    r.scale_heads_rms(&mut want, span, HeadSums { sums: &ds, col: 1, n: 32 }, &w, 1e-5);
    // A head's own norm is the same: twice the sum over twice the width.
    let mut own = Tensor::<Reference>::from_host(&r, &x, rows, stride).unwrap();
    r.rms_norm_heads(&mut own, span, &w, 1e-5);
    assert_close("scale_heads_rms (reference)", &want.to_host(&r), &own.to_host(&r), 1e-5);
    let mut got = x.clone();
    type C = unsafe extern "C" fn(usize, i32, i32, i32, i32, usize, i32, i32, i32, usize, f32);
    let f: C = unsafe { std::mem::transmute(l.sym("scale_heads_rms")) };
    let (xp, dp, wp) = (pm(&mut got), p(&doubled), p(&w));
    l.launch((rows as u32, 3), 32, || unsafe { f(xp, stride as i32, 4, 40, 16, dp, 5, 1, 32, wp, 1e-5) });
    assert_close("scale_heads_rms", &got, &want.to_host(&r), 1e-5);
}

#[test]
fn rope_kernel_matches_the_reference_in_both_layouts() {
    if !gxx_or_skip("rope_kernel_matches_the_reference_in_both_layouts") {
        return;
    }
    let l = lib("rope");
    let r = Reference;
    let half = 8;
    let freqs =
        RopeFreqs { inv_freq: (0..half).map(|i| 10000f32.powf(-(i as f32) / half as f32)).collect(), scale: 1.1 };
    // A whole sample and a continuing chunk at position 5.
    let b = batch(&[(4, Segment { key: 0, pos0: 0, keep: false }), (3, Segment { key: 1, pos0: 5, keep: true })]);
    let positions: Vec<u32> = b
        .segments()
        .iter()
        .enumerate()
        .flat_map(|(s, g)| (0..b.range(s).len()).map(move |i| (g.pos0 + i) as u32))
        .collect();
    let len = b.max_position();
    let (mut cos, mut sin) = (vec![0f32; len * half], vec![0f32; len * half]);
    for pos in 0..len {
        for (i, f) in freqs.inv_freq.iter().enumerate() {
            let a = pos as f32 * f;
            cos[pos * half + i] = a.cos() * freqs.scale;
            sin[pos * half + i] = a.sin() * freqs.scale;
        }
    }
    let table = r.rope_table(&freqs, len);
    let (rows, width) = (b.num_tokens(), 100);
    let x = values(rows * width, 4);
    type F = unsafe extern "C" fn(usize, i32, i32, i32, i32, i32, i32, usize, usize, usize, i32);
    let f: F = unsafe { std::mem::transmute(l.sym("rope")) };
    for interleave in [false, true] {
        // 5 heads of 16 rotated columns at stride 18 from column 3, two heads per block.
        let span = HeadSpan { offset: 3, count: 5, stride: 18, width: 2 * half };
        let mut want = Tensor::<Reference>::from_host(&r, &x, rows, width).unwrap();
        r.rope(&mut want, span, interleave, &table, &b);
        let mut got = x.clone();
        let (xp, cp, sp, pp) = (pm(&mut got), p(&cos), p(&sin), p(&positions));
        l.launch((rows as u32, 3), 32, || unsafe {
            f(xp, width as i32, 3, 5, 18, half as i32, interleave as i32, cp, sp, pp, 2)
        });
        assert_close(&format!("rope interleave={interleave}"), &got, &want.to_host(&r), 1e-5);
    }
    // Llama 4's attention temperature over the same rows and heads (floor_scale 2,
    // so each position of the continuing chunk has its own factor), against the
    // reference's f64 definition.
    let t = Temperature { floor_scale: 2.0, attn_scale: 0.3 };
    let span = HeadSpan { offset: 3, count: 5, stride: 18, width: 16 };
    let mut want = Tensor::<Reference>::from_host(&r, &x, rows, width).unwrap();
    r.attn_temperature(&mut want, span, t, &b);
    let mut got = x.clone();
    type T = unsafe extern "C" fn(usize, i32, i32, i32, i32, i32, i32, usize, f32, f32);
    let f: T = unsafe { std::mem::transmute(l.sym("attn_temperature")) };
    let (xp, pp) = (pm(&mut got), p(&positions));
    l.launch((2, 1), 32, || unsafe { f(xp, rows as i32, width as i32, 3, 5, 18, 16, pp, 2.0, 0.3) });
    assert_close("attn_temperature", &got, &want.to_host(&r), 1e-6);
    assert!(got != x, "the temperature changed the rows");
}

#[test]
fn elementwise_kernels_compute_their_definitions() {
    if !gxx_or_skip("elementwise_kernels_compute_their_definitions") {
        return;
    }
    let l = lib("elementwise");
    let r = Reference;
    let (rows, inter) = (3usize, 37usize);
    // SwiGLU against the reference.
    let gu = values(rows * 2 * inter, 5);
    let mut want = Tensor::<Reference>::zeros(&r, rows, inter);
    r.glu(strata::backend::Glu::Silu, &Tensor::from_host(&r, &gu, rows, 2 * inter).unwrap(), &mut want);
    let mut got = vec![0f32; rows * inter];
    type Sw = unsafe extern "C" fn(usize, i32, i32, usize);
    let f: Sw = unsafe { std::mem::transmute(l.sym("swiglu")) };
    let (gp, op) = (p(&gu), pm(&mut got));
    l.launch((2, 1), 32, || unsafe { f(gp, rows as i32, inter as i32, op) });
    assert_close("swiglu", &got, &want.to_host(&r), 1e-6);
    // swiglu_to_bf16 (the fused input of the down GEMM): swiglu's values rounded, bit for bit.
    let mut fused = vec![0u16; rows * inter];
    type SwB = unsafe extern "C" fn(usize, i32, i32, usize);
    let f: SwB = unsafe { std::mem::transmute(l.sym("swiglu_to_bf16")) };
    let bp = pm(&mut fused);
    l.launch((2, 1), 32, || unsafe { f(gp, rows as i32, inter as i32, bp) });
    let rounded: Vec<u16> = got.iter().map(|&v| half::bf16::from_f32(v).to_bits()).collect();
    assert!(fused == rounded, "swiglu_to_bf16 is not swiglu rounded to bf16");
    // GELU-tanh GLU (Gemma's MLP) against the reference's tanh form, over a
    // gate range where the tails matter (values × 6: |g| up to 6).
    let gu6: Vec<f32> = gu.iter().map(|v| v * 6.0).collect();
    let mut want = Tensor::<Reference>::zeros(&r, rows, inter);
    r.glu(Glu::GeluTanh, &Tensor::from_host(&r, &gu6, rows, 2 * inter).unwrap(), &mut want);
    let f: Sw = unsafe { std::mem::transmute(l.sym("gelu_tanh_glu")) };
    let (gp6, op) = (p(&gu6), pm(&mut got));
    l.launch((2, 1), 32, || unsafe { f(gp6, rows as i32, inter as i32, op) });
    assert_close("gelu_tanh_glu", &got, &want.to_host(&r), 2e-6);
    // gpt-oss's clamped GLU (limit 4 inside the ±6 range: both clamps bite).
    let act = Glu::Clamped { alpha: 1.702, limit: 4.0 };
    let mut want = Tensor::<Reference>::zeros(&r, rows, inter);
    r.glu(act, &Tensor::from_host(&r, &gu6, rows, 2 * inter).unwrap(), &mut want);
    type Cg = unsafe extern "C" fn(usize, i32, i32, f32, f32, usize);
    let f: Cg = unsafe { std::mem::transmute(l.sym("clamped_glu")) };
    let op = pm(&mut got);
    l.launch((2, 1), 32, || unsafe { f(gp6, rows as i32, inter as i32, 1.702, 4.0, op) });
    assert_close("clamped_glu", &got, &want.to_host(&r), 2e-6);
    // Its bf16 form (the experts' bf16 path): the f32 kernel's value on bf16 inputs, rounded once.
    let gu6b: Vec<u16> = gu6.iter().map(|&v| half::bf16::from_f32(v).to_bits()).collect();
    let gu6r: Vec<f32> = gu6b.iter().map(|&b| f32::from_bits((b as u32) << 16)).collect();
    let (gr, op) = (p(&gu6r), pm(&mut got));
    l.launch((2, 1), 32, || unsafe { f(gr, rows as i32, inter as i32, 1.702, 4.0, op) });
    let mut got16 = vec![0u16; rows * inter];
    let f: Cg = unsafe { std::mem::transmute(l.sym("clamped_glu_bf16")) };
    let (gb, ob) = (p(&gu6b), pm(&mut got16));
    l.launch((2, 1), 32, || unsafe { f(gb, rows as i32, inter as i32, 1.702, 4.0, ob) });
    let rounded: Vec<u16> = got.iter().map(|&v| half::bf16::from_f32(v).to_bits()).collect();
    assert!(got16 == rounded, "clamped_glu_bf16 is not clamped_glu of the bf16 inputs, rounded");
    // Scale (Gemma's embedding scale).
    let mut got = gu.clone();
    type Sc = unsafe extern "C" fn(usize, f32, i32);
    let f: Sc = unsafe { std::mem::transmute(l.sym("scale")) };
    let (xp, n) = (pm(&mut got), gu.len());
    l.launch((1, 1), 64, || unsafe { f(xp, 50.5, n as i32) });
    assert_close("scale", &got, &gu.iter().map(|v| v * 50.5).collect::<Vec<_>>(), 0.0);

    // Head copies against the reference.
    let (from, to) = (HeadSpan { offset: 2, count: 3, stride: 10, width: 4 }, HeadSpan::heads(1, 3, 4));
    let src = values(rows * 40, 6);
    let mut want = Tensor::<Reference>::zeros(&r, rows, 14);
    r.copy_heads(&Tensor::from_host(&r, &src, rows, 40).unwrap(), from, &mut want, to);
    let mut got = vec![0f32; rows * 14];
    type Ch = unsafe extern "C" fn(usize, i32, i32, i32, usize, i32, i32, i32, i32, i32, i32);
    let f: Ch = unsafe { std::mem::transmute(l.sym("copy_heads")) };
    let (sp, dp) = (p(&src), pm(&mut got));
    l.launch((1, 1), 64, || unsafe { f(sp, 40, 2, 10, dp, 14, 1, 4, rows as i32, 3, 4) });
    assert_close("copy_heads", &got, &want.to_host(&r), 0.0);

    // Embedding rows in every table dtype, bf16 rounding, bias and residual adds.
    let (vocab, hidden) = (11usize, 9usize);
    let table = values(vocab * hidden, 7);
    let ids = [3u32, 0, 10, 3];
    let want: Vec<f32> = ids.iter().flat_map(|&i| table[i as usize * hidden..][..hidden].to_vec()).collect();
    let bf: Vec<u16> = table.iter().map(|&v| half::bf16::from_f32(v).to_bits()).collect();
    let hf: Vec<u16> = table.iter().map(|&v| half::f16::from_f32(v).to_bits()).collect();
    type Em = unsafe extern "C" fn(usize, usize, i32, i32, usize);
    for (kernel, tab, tol) in [("embed_f32", p(&table), 0.0), ("embed_bf16", p(&bf), 4e-3), ("embed_f16", p(&hf), 5e-4)]
    {
        let f: Em = unsafe { std::mem::transmute(l.sym(kernel)) };
        let mut got = vec![0f32; ids.len() * hidden];
        let (ip, op) = (p(&ids), pm(&mut got));
        l.launch((1, 1), 32, || unsafe { f(tab, ip, ids.len() as i32, hidden as i32, op) });
        assert_close(kernel, &got, &want, tol);
    }
    let f: Em = unsafe { std::mem::transmute(l.sym("embed_f16")) };
    let mut got = vec![0f32; ids.len() * hidden];
    let (ip, op) = (p(&ids), pm(&mut got));
    l.launch((1, 1), 32, || unsafe { f(p(&hf), ip, ids.len() as i32, hidden as i32, op) });
    let exact: Vec<f32> = ids
        .iter()
        .flat_map(|&i| {
            hf[i as usize * hidden..][..hidden].iter().map(|&h| half::f16::from_bits(h).to_f32()).collect::<Vec<_>>()
        })
        .collect();
    assert_eq!(got, exact, "f16 decode is exact");

    let x = values(rows * 10, 8);
    let mut got = vec![0u16; rows * 6];
    type Tb = unsafe extern "C" fn(usize, i32, i32, i32, i32, usize);
    let f: Tb = unsafe { std::mem::transmute(l.sym("to_bf16")) };
    let (xp, op) = (p(&x), pm(&mut got));
    l.launch((1, 1), 32, || unsafe { f(xp, rows as i32, 10, 3, 6, op) });
    let want: Vec<u16> =
        (0..rows).flat_map(|r| x[r * 10 + 3..r * 10 + 9].iter().map(|&v| half::bf16::from_f32(v).to_bits())).collect();
    assert_eq!(got, want, "to_bf16 rounds to nearest even as half does");

    let (y, bias) = (values(rows * 6, 9), values(6, 10));
    let mut got = values(rows * 6, 11);
    let want: Vec<f32> = got.iter().enumerate().map(|(i, &g)| g + (y[i] + bias[i % 6])).collect();
    type Ab = unsafe extern "C" fn(usize, usize, usize, i32, i32);
    let f: Ab = unsafe { std::mem::transmute(l.sym("add_bias_residual")) };
    let (gp, yp, bp) = (pm(&mut got), p(&y), p(&bias));
    l.launch((1, 1), 32, || unsafe { f(gp, yp, bp, rows as i32, 6) });
    assert_close("add_bias_residual", &got, &want, 0.0);
}

#[test]
fn moe_gather_and_combine_sum_each_tokens_experts_in_order() {
    if !gxx_or_skip("moe_gather_and_combine_sum_each_tokens_experts_in_order") {
        return;
    }
    let l = lib("elementwise");
    let (tokens, top_k, hidden) = (3usize, 2usize, 5usize);
    let x = values(tokens * hidden, 12);
    // Rows grouped by expert: (token 0, token 2) for one expert, (1, 0, 2, 1) for others.
    let src = [0u32, 2, 1, 0, 2, 1];
    let mut xe = vec![0f32; src.len() * hidden];
    type G = unsafe extern "C" fn(usize, usize, i32, i32, usize);
    let f: G = unsafe { std::mem::transmute(l.sym("gather_rows")) };
    let (xp, sp, ep) = (p(&x), p(&src), pm(&mut xe));
    l.launch((1, 1), 32, || unsafe { f(xp, sp, src.len() as i32, hidden as i32, ep) });
    for (r, &s) in src.iter().enumerate() {
        assert_eq!(&xe[r * hidden..][..hidden], &x[s as usize * hidden..][..hidden]);
    }
    // Token t's k-th expert output is row slot[t][k] of ye.
    let slot = [0u32, 3, 2, 5, 1, 4];
    let w = values(tokens * top_k, 13);
    let shared = values(tokens * hidden, 14);
    let want: Vec<f32> = (0..tokens * hidden)
        .map(|i| {
            let (t, c) = (i / hidden, i % hidden);
            let mut acc = 0f32;
            for k in 0..top_k {
                acc += w[t * top_k + k] * xe[slot[t * top_k + k] as usize * hidden + c];
            }
            acc + shared[i]
        })
        .collect();
    let mut got = vec![0f32; tokens * hidden];
    type C = unsafe extern "C" fn(usize, usize, usize, i32, i32, i32, usize, usize);
    let f: C = unsafe { std::mem::transmute(l.sym("moe_combine")) };
    let (ep, sp, wp, hp, op) = (p(&xe), p(&slot), p(&w), p(&shared), pm(&mut got));
    l.launch((1, 1), 32, || unsafe { f(ep, sp, wp, tokens as i32, top_k as i32, hidden as i32, hp, op) });
    assert_eq!(got, want);

    // Input gating (Llama 4): entry e's row goes to grouped row slot[e], times
    // its weight; the combine then takes a null weight as 1 for every row.
    let mut xs = vec![f32::NAN; src.len() * hidden];
    type S = unsafe extern "C" fn(usize, usize, usize, i32, i32, i32, usize);
    let f: S = unsafe { std::mem::transmute(l.sym("scatter_rows_scaled")) };
    let (xp, sp, wp, ep) = (p(&x), p(&slot), p(&w), pm(&mut xs));
    l.launch((1, 1), 32, || unsafe { f(xp, sp, wp, src.len() as i32, top_k as i32, hidden as i32, ep) });
    for (e, &row) in slot.iter().enumerate() {
        let want: Vec<f32> = x[e / top_k * hidden..][..hidden].iter().map(|v| w[e] * v).collect();
        assert_eq!(&xs[row as usize * hidden..][..hidden], &want[..], "entry {e}");
    }
    let mut xs16 = vec![0u16; src.len() * hidden];
    type S16 = unsafe extern "C" fn(usize, usize, usize, i32, i32, i32, usize);
    let f: S16 = unsafe { std::mem::transmute(l.sym("scatter_rows_scaled_bf16")) };
    let ep = pm(&mut xs16);
    l.launch((1, 1), 32, || unsafe { f(xp, sp, wp, src.len() as i32, top_k as i32, hidden as i32, ep) });
    let rounded: Vec<u16> = xs.iter().map(|&v| half::bf16::from_f32(v).to_bits()).collect();
    assert!(xs16 == rounded, "scatter_rows_scaled_bf16 is the f32 rows rounded once");
    let want: Vec<f32> = (0..tokens * hidden)
        .map(|i| {
            let (t, c) = (i / hidden, i % hidden);
            (0..top_k).map(|k| xs[slot[t * top_k + k] as usize * hidden + c]).sum::<f32>()
        })
        .collect();
    let f: C = unsafe { std::mem::transmute(l.sym("moe_combine")) };
    let (ep, sp, op) = (p(&xs), p(&slot), pm(&mut got));
    l.launch((1, 1), 32, || unsafe { f(ep, sp, 0, tokens as i32, top_k as i32, hidden as i32, 0, op) });
    assert_eq!(got, want);
}

#[test]
fn dequant_kernels_give_code_times_scale() {
    if !gxx_or_skip("dequant_kernels_give_code_times_scale") {
        return;
    }
    let l = lib("quant");
    let (rows, cols) = (3usize, 13usize);
    // Segments cut at 5 and 9 (a block that starts inside a global scale block).
    let seg = vec![0usize, 5, 9, cols];
    let colseg: Vec<u32> = (0..cols).map(|c| seg.iter().rposition(|&s| s <= c).unwrap() as u32).collect();
    let scales = values(rows * 3, 15);
    for kind in [QuantKind::Fp8, QuantKind::Int4, QuantKind::Mxfp4] {
        let codes: Vec<u8> = (0..rows * cols)
            .map(|i| match kind {
                QuantKind::Fp8 => ((i * 37 + 11) % 256) as u8 & !0x78 | (((i % 14) as u8) << 3), // no NaN codes
                _ => (i * 7 % 16) as u8,
            })
            .collect();
        let q = QuantRows { kind, rows, cols, codes: codes.clone(), seg: seg.clone(), scales: scales.clone() };
        let want = q.dequantize();
        // Device layout: FP8 one byte a code; INT4 and MXFP4 two a byte, the even column low.
        let dev: Vec<u8> = match kind {
            QuantKind::Fp8 => codes.clone(),
            _ => (0..rows)
                .flat_map(|r| {
                    let row = &codes[r * cols..(r + 1) * cols];
                    row.chunks(2).map(|p| p[0] | (p.get(1).copied().unwrap_or(8) << 4)).collect::<Vec<_>>()
                })
                .collect(),
        };
        let name = match kind {
            QuantKind::Fp8 => "fp8",
            QuantKind::Mxfp4 => "mxfp4",
            _ => "int4",
        };
        type Dq = unsafe extern "C" fn(usize, usize, usize, i32, i32, i32, usize);
        let mut f32_out = vec![0f32; rows * cols];
        let mut bf_out = vec![0u16; rows * cols];
        let f: Dq = unsafe { std::mem::transmute(l.sym(&format!("dequant_{name}_f32"))) };
        let (cp, sp, gp, op) = (p(&dev), p(&scales), p(&colseg), pm(&mut f32_out));
        l.launch((2, 1), 32, || unsafe { f(cp, sp, gp, rows as i32, cols as i32, 3, op) });
        assert_eq!(f32_out, want, "{name} to f32 is exact");
        let f: Dq = unsafe { std::mem::transmute(l.sym(&format!("dequant_{name}_bf16"))) };
        let op = pm(&mut bf_out);
        l.launch((2, 1), 32, || unsafe { f(cp, sp, gp, rows as i32, cols as i32, 3, op) });
        let want_bf: Vec<u16> = want.iter().map(|&v| half::bf16::from_f32(v).to_bits()).collect();
        assert_eq!(bf_out, want_bf, "{name} to bf16 rounds the exact value");
    }
}

#[test]
fn router_kernel_picks_the_references_experts_in_every_mode() {
    if !gxx_or_skip("router_kernel_picks_the_references_experts_in_every_mode") {
        return;
    }
    let l = lib("moe");
    let r = Reference;
    let (tokens, experts) = (9usize, 16usize);
    let mut logits = values(tokens * experts, 16);
    // A tie: experts 3 and 4 of token 0 score the same (the lower index wins).
    logits[4] = logits[3];
    // Logits whose f32 sigmoids all round to 1.0: a plain sigmoid router still
    // ranks them (by the logits, as Llama 4's takes the top-k before the sigmoid).
    logits[experts + 2] = 25.0;
    logits[experts + 5] = 30.0;
    logits[experts + 9] = 20.0;
    let correction = values(experts, 17).iter().map(|v| v * 0.1).collect::<Vec<_>>();
    let modes = [
        (Scoring::Softmax, TopkMethod::Greedy, 1, 1, true),
        (Scoring::Softmax, TopkMethod::GroupLimitedGreedy, 4, 2, false),
        (Scoring::Sigmoid, TopkMethod::NoauxTc, 4, 2, true),
        (Scoring::Sigmoid, TopkMethod::Greedy, 1, 1, false),
    ];
    type F =
        unsafe extern "C" fn(usize, usize, i32, i32, i32, i32, i32, i32, i32, i32, f32, usize, usize, usize, usize);
    let f: F = unsafe { std::mem::transmute(l.sym("moe_route")) };
    for (scoring, method, n_group, topk_group, norm) in modes {
        let router = Router {
            scoring,
            topk_method: method,
            top_k: 3,
            n_group,
            topk_group,
            norm_topk_prob: norm,
            routed_scaling_factor: 2.5,
        };
        let corr = (method == TopkMethod::NoauxTc).then_some(&correction);
        let want = r.moe_route(&Tensor::from_host(&r, &logits, tokens, experts).unwrap(), &router, corr);
        let (mut scores, mut choice) = (vec![0f32; tokens * experts], vec![0f32; tokens * experts]);
        let (mut ids, mut weights) = (vec![0u32; tokens * 3], vec![0f32; tokens * 3]);
        let scoring_i = if scoring == Scoring::Softmax { 0 } else { 1 };
        let method_i = match method {
            TopkMethod::Greedy => 0,
            TopkMethod::GroupLimitedGreedy => 1,
            TopkMethod::NoauxTc => 2,
        };
        let cp = corr.map_or(0, |c| p(c));
        let (lp, sp, chp, ip, wp) = (p(&logits), pm(&mut scores), pm(&mut choice), pm(&mut ids), pm(&mut weights));
        l.launch((1, 1), 32, || unsafe {
            f(
                lp,
                cp,
                tokens as i32,
                experts as i32,
                scoring_i,
                method_i,
                3,
                n_group as i32,
                topk_group as i32,
                norm as i32,
                2.5,
                sp,
                chp,
                ip,
                wp,
            )
        });
        for t in 0..tokens {
            let got: Vec<usize> = ids[t * 3..t * 3 + 3].iter().map(|&i| i as usize).collect();
            let exp: Vec<usize> = want[t].iter().map(|e| e.0).collect();
            assert_eq!(got, exp, "{method:?} token {t}: experts");
            let ew: Vec<f32> = want[t].iter().map(|e| e.1 as f32).collect();
            assert_close(&format!("{method:?} token {t} weights"), &weights[t * 3..t * 3 + 3], &ew, 1e-5);
        }
    }
}

/// One segment as attention.cu's `Seg` (repr(C), same field order).
#[repr(C)]
#[derive(Clone, Copy)]
struct Seg {
    k: u64,
    v: u64,
    k_stride: i32,
    v_stride: i32,
    q_row0: i32,
    q_len: i32,
    pos0: i32,
    kv_len: i32,
}

impl Seg {
    /// The segment of query rows `rows` at position `pos0`, reading keys at `k` and values at `v`
    /// (`ks`, `vs` elements a row apart) over its `pos0 + rows.len()` positions.
    fn new(k: usize, v: usize, ks: usize, vs: usize, rows: &std::ops::Range<usize>, pos0: usize) -> Self {
        Seg {
            k: k as u64,
            v: v as u64,
            k_stride: ks as i32,
            v_stride: vs as i32,
            q_row0: rows.start as i32,
            q_len: rows.len() as i32,
            pos0: pos0 as i32,
            kv_len: (pos0 + rows.len()) as i32,
        }
    }
}

/// Two steps through the reference and the kernel: step 1 packs a whole
/// sample and the first chunk of another, step 2 that sample's next chunk,
/// whose keys come from the cache.
fn attention_case(bf16_kernel: bool, shape: AttnShape, with_sinks: bool) {
    let l = lib("attention");
    let r = Reference;
    let (nh, nkv, hd, vd) = (shape.heads, shape.kv_heads, shape.head_dim, shape.v_dim);
    // gpt-oss's sink logits, one per head, of the scores' size (some above them).
    let sinks: Option<Vec<f32>> = with_sinks.then(|| values(nh, 7).iter().map(|v| 3.0 * v).collect());
    let sink_vec = sinks.clone().map(|s| r.vector(s));
    // The tensor-core kernel's tiles are 64 queries by 32 keys: its segments
    // span several of each. The f32 kernel (a block per token) gets short ones.
    let [a, b1, b2] = if bf16_kernel { [70, 37, 75] } else { [9, 6, 7] };
    let steps = [
        batch(&[(a, Segment { key: 0, pos0: 0, keep: false }), (b1, Segment { key: 1, pos0: 0, keep: true })]),
        batch(&[(b2, Segment { key: 1, pos0: b1, keep: false })]),
    ];
    let mut cache = KvCache::default();
    // The kernel's cache of sample 1: its keys and values so far, per
    // position: [kv heads·dim] f32, or for the bf16 kernel [kv heads, dim
    // padded to 16] bf16 (common.cuh's `Seg`).
    let (mut cache_k, mut cache_v) = (Vec::<f32>::new(), Vec::<f32>::new());
    let (mut cache_k16, mut cache_v16) = (Vec::<u16>::new(), Vec::<u16>::new());
    let (dp, vp) = (pad16(hd), pad16(vd));
    for (step, b) in steps.iter().enumerate() {
        let t = b.num_tokens();
        // q, k, v as column blocks of one [T, width] buffer, as a fused qkv projection gives them.
        let (qw, kw, vw) = (nh * hd, nkv * hd, nkv * vd);
        let width = qw + kw + vw + 3;
        let qkv = values(t * width, 20 + step as u64);
        let qkv = if bf16_kernel { qkv } else { qkv.iter().map(|v| v * 2.0).collect() };
        let mut want = Tensor::<Reference>::zeros(&r, t, nh * vd);
        // The reference sees the bf16-rounded inputs the tensor cores see.
        let rounded: Vec<f32> = if bf16_kernel { qkv.iter().map(|&v| bf16(v)).collect() } else { qkv.clone() };
        let rbuf = Tensor::<Reference>::from_host(&r, &rounded, t, width).unwrap();
        cache.begin(b).unwrap();
        let cols = Qkv { q: rbuf.cols(0, qw), k: rbuf.cols(qw, kw), v: rbuf.cols(qw + kw, vw) };
        r.attention(cols, shape, sink_vec.as_ref(), b, LayerState::new(&mut cache, 0), &mut want);
        // Rows `rows` of the `heads` heads at column `at` (width `w` each), as bf16 padded to `wp`.
        let packed_heads = |rows: std::ops::Range<usize>, at: usize, w: usize, wp: usize, heads: usize| -> Vec<u16> {
            let mut out = Vec::new();
            for row in rows {
                for h in 0..heads {
                    let head = &qkv[row * width + at + h * w..][..w];
                    out.extend(head.iter().map(|&x| half::bf16::from_f32(x).to_bits()));
                    out.resize(out.len() + wp - w, 0);
                }
            }
            out
        };
        let packed = |rows, at, w, wp| packed_heads(rows, at, w, wp, nkv);
        let (step_k16, step_v16) = (packed(0..t, qw, hd, dp), packed(0..t, qw + kw, vd, vp));
        // The bf16 kernel's queries: packed as its keys are (pack_heads_bf16).
        let step_q16 = packed_heads(0..t, 0, hd, dp, nh);
        let mut segs = Vec::new();
        for (s, g) in b.segments().iter().enumerate() {
            let rows = b.range(s);
            let (k, v, ks, vs) = match (g.uses_cache(), bf16_kernel) {
                (true, false) => {
                    for row in rows.clone() {
                        cache_k.extend_from_slice(&qkv[row * width + qw..][..kw]);
                        cache_v.extend_from_slice(&qkv[row * width + qw + kw..][..vw]);
                    }
                    (p(&cache_k), p(&cache_v), kw, vw)
                }
                (true, true) => {
                    cache_k16.extend(packed(rows.clone(), qw, hd, dp));
                    cache_v16.extend(packed(rows.clone(), qw + kw, vd, vp));
                    (p(&cache_k16), p(&cache_v16), nkv * dp, nkv * vp)
                }
                (false, false) => {
                    (p(&qkv[rows.start * width + qw..]), p(&qkv[rows.start * width + qw + kw..]), width, width)
                }
                (false, true) => {
                    (p(&step_k16[rows.start * nkv * dp..]), p(&step_v16[rows.start * nkv * vp..]), nkv * dp, nkv * vp)
                }
            };
            segs.push(Seg::new(k, v, ks, vs, &rows, g.pos0));
        }
        let mut got = vec![f32::NAN; t * nh * vd];
        let (window, chunk) = shape.mask.window_and_chunk();
        let (window, chunk) = (window as i32, chunk as i32);
        type F = unsafe extern "C" fn(usize, i32, usize, usize, i32, i32, i32, i32, i32, i32, f32, usize, usize);
        let (qp, sp, op) = (p(&qkv), p(&segs), pm(&mut got));
        let kp = sinks.as_ref().map_or(0, |s| p(s)); // null: no sinks
        if bf16_kernel {
            let n = [16, 32, 64, 128, 256].into_iter().find(|&n| n >= vd).unwrap();
            let tiles: Vec<i32> = segs
                .iter()
                .enumerate()
                .flat_map(|(s, g)| (0..g.q_len).step_by(64).flat_map(move |q0| [s as i32, q0]))
                .collect();
            let f: F = unsafe { std::mem::transmute(l.sym(&format!("attention_bf16_v{n}"))) };
            let tp = p(&tiles);
            let smem = attention_bf16_smem(hd, vd);
            let (qp, qs) = (p(&step_q16), (nh * dp) as i32);
            l.launch_smem(((tiles.len() / 2) as u32, nh as u32), 128, smem, || unsafe {
                f(qp, qs, sp, tp, nh as i32, nkv as i32, hd as i32, vd as i32, window, chunk, shape.scale, kp, op)
            });
            // Scores and probabilities are rounded to bf16 by the tensor-core path only.
            assert_close(&format!("attention_bf16 step {step}"), &got, &want.to_host(&r), 2e-2);
        } else {
            let seg_of: Vec<u32> = (0..b.num_samples()).flat_map(|s| b.range(s).map(move |_| s as u32)).collect();
            let f: F = unsafe { std::mem::transmute(l.sym("attention_f32")) };
            let gp = p(&seg_of);
            l.launch((t as u32, nh.div_ceil(4) as u32), 128, || unsafe {
                let (nh, nkv, hd, vd) = (nh as i32, nkv as i32, hd as i32, vd as i32);
                f(qp, width as i32, sp, gp, nh, nkv, hd, vd, window, chunk, shape.scale, kp, op)
            });
            assert_close(&format!("attention_f32 step {step}"), &got, &want.to_host(&r), 1e-5);
        }
    }
}

#[test]
fn attention_kernels_match_the_reference_over_packed_chunked_segments() {
    if !gxx_or_skip("attention_kernels_match_the_reference_over_packed_chunked_segments") {
        return;
    }
    // GQA, a head dim that is not a multiple of 16, MLA-like distinct value width.
    let gqa = AttnShape { heads: 6, kv_heads: 2, head_dim: 24, v_dim: 12, mask: Mask::Causal, scale: 0.3 };
    let window = AttnShape { mask: Mask::Sliding(5), ..gqa };
    let mha = AttnShape { heads: 5, kv_heads: 5, head_dim: 16, v_dim: 16, mask: Mask::Causal, scale: 0.25 };
    for shape in [gqa, window, mha] {
        attention_case(false, shape, false);
        attention_case(true, shape, false);
    }
    // Llama 4's attention chunks: several per segment and across the chunked
    // prefill's step boundary (the f32 kernel's segments are 9, 6 and 7
    // positions long, the bf16 kernel's 70, 37 and 75, over 32-key tiles).
    attention_case(false, AttnShape { mask: Mask::Chunked(4), ..gqa }, false);
    attention_case(true, AttnShape { mask: Mask::Chunked(24), ..gqa }, false);
    // gpt-oss's sinks, on full and sliding layers alike.
    for shape in [gqa, window] {
        attention_case(false, shape, true);
        attention_case(true, shape, true);
    }
}

/// Split-K decode (`attention_split_f32`/`_bf16`, then
/// `attention_split_combine`) in a step that mixes a prefill segment with
/// one-token decode rows over caches of `caches` positions, against the
/// reference: the prefill and the short rows through the one-block kernel
/// (which must leave the split rows alone: their outputs start as NaN), the
/// long rows split as the backend's `SplitPlan` cuts them. The caches are
/// filled by a reference step under a narrow window (a cache keeps keys and
/// values whatever the mask), so nothing walks 3000² scores. The bf16
/// kernels get bf16-exact inputs, so only their arithmetic differs. Returns
/// the plan and the split rows' worst error (relative, as `assert_close`).
fn split_decode_case(bf16_kernel: bool, shape: AttnShape, with_sinks: bool, caches: &[usize]) -> (SplitPlan, f32) {
    let l = lib("attention");
    let r = Reference;
    let (nh, nkv, hd, vd) = (shape.heads, shape.kv_heads, shape.head_dim, shape.v_dim);
    let (qw, kw, vw) = (nh * hd, nkv * hd, nkv * vd);
    let width = qw + kw + vw + 3;
    let (dp, vp) = (pad16(hd), pad16(vd));
    let sinks: Option<Vec<f32>> = with_sinks.then(|| values(nh, 7).iter().map(|v| 3.0 * v).collect());
    let sink_vec = sinks.clone().map(|s| r.vector(s));
    let input = |n: usize, seed: u64| -> Vec<f32> {
        let v = values(n, seed);
        v.iter().map(|&x| if bf16_kernel { bf16(x) } else { 2.0 * x }).collect()
    };
    // Step 1: every cached sample's positions (keys 1..), for the caches only.
    let fill = batch(
        &caches
            .iter()
            .enumerate()
            .map(|(i, &n)| (n, Segment { key: i as u64 + 1, pos0: 0, keep: true }))
            .collect::<Vec<_>>(),
    );
    let qkv1 = input(fill.num_tokens() * width, 40);
    let mut cache = KvCache::default();
    cache.begin(&fill).unwrap();
    let t1 = Tensor::<Reference>::from_host(&r, &qkv1, fill.num_tokens(), width).unwrap();
    let cols = Qkv { q: t1.cols(0, qw), k: t1.cols(qw, kw), v: t1.cols(qw + kw, vw) };
    let narrow = AttnShape { mask: Mask::Sliding(16), ..shape };
    let mut sink_out = Tensor::<Reference>::zeros(&r, fill.num_tokens(), nh * vd);
    r.attention(cols, narrow, sink_vec.as_ref(), &fill, LayerState::new(&mut cache, 0), &mut sink_out);
    // Step 2: a 9-token prefill (segment 0), then one new token per sample (segment i + 1).
    let mut segs2 = vec![(9, Segment { key: 0, pos0: 0, keep: false })];
    segs2.extend(caches.iter().enumerate().map(|(i, &n)| (1, Segment { key: i as u64 + 1, pos0: n, keep: false })));
    let b = batch(&segs2);
    let t = b.num_tokens();
    let qkv = input(t * width, 41);
    cache.begin(&b).unwrap();
    let t2 = Tensor::<Reference>::from_host(&r, &qkv, t, width).unwrap();
    let cols = Qkv { q: t2.cols(0, qw), k: t2.cols(qw, kw), v: t2.cols(qw + kw, vw) };
    let mut want = Tensor::<Reference>::zeros(&r, t, nh * vd);
    r.attention(cols, shape, sink_vec.as_ref(), &b, LayerState::new(&mut cache, 0), &mut want);
    let want = want.to_host(&r);

    // The kernels' caches: per sample, its positions' keys and values, then
    // this step's; [kv heads·dim] f32, or [kv heads, dim padded to 16] bf16.
    let packed = |src: &[f32], rows: std::ops::Range<usize>, at: usize, w: usize, wp: usize, heads: usize| {
        let mut out = Vec::new();
        for row in rows {
            for h in 0..heads {
                out.extend(src[row * width + at + h * w..][..w].iter().map(|&x| half::bf16::from_f32(x).to_bits()));
                out.resize(out.len() + wp - w, 0);
            }
        }
        out
    };
    let rows_f32 = |src: &[f32], rows: std::ops::Range<usize>, at: usize, w: usize| -> Vec<f32> {
        rows.flat_map(|row| src[row * width + at..][..w].to_vec()).collect()
    };
    let mut ck: Vec<Vec<f32>> = Vec::new();
    let mut cv: Vec<Vec<f32>> = Vec::new();
    let mut ck16: Vec<Vec<u16>> = Vec::new();
    let mut cv16: Vec<Vec<u16>> = Vec::new();
    for i in 0..caches.len() {
        let (old, new) = (fill.range(i), b.range(i + 1));
        let mut k = rows_f32(&qkv1, old.clone(), qw, kw);
        k.extend(rows_f32(&qkv, new.clone(), qw, kw));
        let mut v = rows_f32(&qkv1, old.clone(), qw + kw, vw);
        v.extend(rows_f32(&qkv, new.clone(), qw + kw, vw));
        let mut k16 = packed(&qkv1, old.clone(), qw, hd, dp, nkv);
        k16.extend(packed(&qkv, new.clone(), qw, hd, dp, nkv));
        let mut v16 = packed(&qkv1, old, qw + kw, vd, vp, nkv);
        v16.extend(packed(&qkv, new, qw + kw, vd, vp, nkv));
        ck.push(k);
        cv.push(v);
        ck16.push(k16);
        cv16.push(v16);
    }
    let (step_k16, step_v16) = (packed(&qkv, 0..t, qw, hd, dp, nkv), packed(&qkv, 0..t, qw + kw, vd, vp, nkv));
    let step_q16 = packed(&qkv, 0..t, 0, hd, dp, nh);
    let segs: Vec<Seg> = b
        .segments()
        .iter()
        .enumerate()
        .map(|(s, g)| {
            let rows = b.range(s);
            let (k, v, ks, vs) = match (s, bf16_kernel) {
                (0, false) => {
                    (p(&qkv[rows.start * width + qw..]), p(&qkv[rows.start * width + qw + kw..]), width, width)
                }
                (0, true) => {
                    (p(&step_k16[rows.start * nkv * dp..]), p(&step_v16[rows.start * nkv * vp..]), nkv * dp, nkv * vp)
                }
                (s, false) => (p(&ck[s - 1]), p(&cv[s - 1]), kw, vw),
                (s, true) => (p(&ck16[s - 1]), p(&cv16[s - 1]), nkv * dp, nkv * vp),
            };
            Seg::new(k, v, ks, vs, &rows, g.pos0)
        })
        .collect();

    // The plan: a row splits exactly when its query sees SPLIT_MIN_KEYS keys or more.
    let plan = SplitPlan::new(&b, shape.mask);
    assert_eq!(plan.splits(0), 0, "the prefill segment is not split");
    for (i, &n) in caches.iter().enumerate() {
        let seen = n + 1 - shape.mask.first_key(n);
        assert_eq!(plan.splits(i + 1) > 0, seen >= SPLIT_MIN_KEYS, "cache {n}: {seen} keys seen");
        assert!(plan.splits(i + 1) <= SPLIT_MAX, "cache {n}: {} splits", plan.splits(i + 1));
    }

    let mut got = vec![f32::NAN; t * nh * vd];
    let (window, chunk) = shape.mask.window_and_chunk();
    let (window, chunk) = (window as i32, chunk as i32);
    let (nhi, nkvi, hdi, vdi) = (nh as i32, nkv as i32, hd as i32, vd as i32);
    let (sp, op) = (p(&segs), pm(&mut got));
    let kp = sinks.as_ref().map_or(0, |s| p(s)); // null: no sinks
    type F = unsafe extern "C" fn(usize, i32, usize, usize, i32, i32, i32, i32, i32, i32, f32, usize, usize);
    if bf16_kernel {
        let n = [16, 32, 64, 128, 256].into_iter().find(|&n| n >= vd).unwrap();
        let tiles: Vec<i32> = (0..segs.len())
            .filter(|&s| plan.splits(s) == 0)
            .flat_map(|s| (0..segs[s].q_len).step_by(64).flat_map(move |q0| [s as i32, q0]))
            .collect();
        let f: F = unsafe { std::mem::transmute(l.sym(&format!("attention_bf16_v{n}"))) };
        let (qp, qs, tp) = (p(&step_q16), (nh * dp) as i32, p(&tiles));
        l.launch_smem(((tiles.len() / 2) as u32, nh as u32), 128, attention_bf16_smem(hd, vd), || unsafe {
            f(qp, qs, sp, tp, nhi, nkvi, hdi, vdi, window, chunk, shape.scale, kp, op)
        });
    } else {
        let seg_of: Vec<u32> = (0..segs.len())
            .flat_map(|s| b.range(s).map(move |_| s as u32))
            .map(|s| if plan.splits(s as usize) > 0 { u32::MAX } else { s })
            .collect();
        let f: F = unsafe { std::mem::transmute(l.sym("attention_f32")) };
        let gp = p(&seg_of);
        l.launch((t as u32, nh.div_ceil(4) as u32), 128, || unsafe {
            f(p(&qkv), width as i32, sp, gp, nhi, nkvi, hdi, vdi, window, chunk, shape.scale, kp, op)
        });
    }
    // The one-block kernel left the split rows unwritten.
    let split_rows: Vec<usize> = plan.rows.iter().map(|r| r[0] as usize).collect();
    for &row in &split_rows {
        assert!(got[row * nh * vd..][..nh * vd].iter().all(|v| v.is_nan()), "row {row} was not left to the split path");
    }
    let items: Vec<i32> = plan.split.iter().flatten().copied().collect();
    let rows: Vec<i32> = plan.rows.iter().flatten().copied().collect();
    let mut part_ml = vec![f32::NAN; plan.split.len() * nh * 2];
    let mut part_o = vec![f32::NAN; plan.split.len() * nh * vd];
    let (ip, mlp, pop) = (p(&items), pm(&mut part_ml), pm(&mut part_o));
    type S = unsafe extern "C" fn(usize, i32, usize, usize, i32, i32, i32, i32, f32, usize, usize);
    let (kernel, qp, qs) = if bf16_kernel {
        ("attention_split_bf16", p(&step_q16), (nh * dp) as i32)
    } else {
        ("attention_split_f32", p(&qkv), width as i32)
    };
    let f: S = unsafe { std::mem::transmute(l.sym(kernel)) };
    l.launch((plan.split.len() as u32, nh.div_ceil(4) as u32), 128, || unsafe {
        f(qp, qs, sp, ip, nhi, nkvi, hdi, vdi, shape.scale, mlp, pop)
    });
    type C = unsafe extern "C" fn(usize, i32, i32, usize, usize, usize, usize);
    let f: C = unsafe { std::mem::transmute(l.sym("attention_split_combine")) };
    let rp = p(&rows);
    l.launch((plan.rows.len() as u32, nh.div_ceil(4) as u32), 128, || unsafe { f(rp, nhi, vdi, kp, mlp, pop, op) });

    // The split rows at the exact path's tolerance, on either kernel; the
    // rest at its kernel's (the tensor cores round probabilities to bf16).
    let mut worst = 0f32;
    for row in 0..t {
        let (g, w) = (&got[row * nh * vd..][..nh * vd], &want[row * nh * vd..][..nh * vd]);
        let what = format!("{kernel} {:?} sinks={with_sinks} row {row}", shape.mask);
        if split_rows.contains(&row) {
            assert_close(&what, g, w, 1e-5);
            worst = g.iter().zip(w).fold(worst, |m, (a, b)| m.max((a - b).abs() / b.abs().max(1.0)));
        } else {
            assert_close(&what, g, w, if bf16_kernel { 2e-2 } else { 1e-5 });
        }
    }
    (plan, worst)
}

#[test]
fn split_decode_kernels_match_the_reference_over_long_caches() {
    if !gxx_or_skip("split_decode_kernels_match_the_reference_over_long_caches") {
        return;
    }
    // Around the threshold (254 positions and the new one: 255 keys, not
    // split; 255: 256, split), a long cache, and one long enough that the
    // splits grow past SPLIT_MIN_CHUNK to stay SPLIT_MAX.
    let caches = [1, 254, 255, 256, 257, 1000, 3000, 5000];
    // GQA (4 query heads a kv head), a head dim that is not a multiple of 16, a distinct value width.
    let gqa = AttnShape { heads: 8, kv_heads: 2, head_dim: 40, v_dim: 24, mask: Mask::Causal, scale: 0.2 };
    for bf16_kernel in [false, true] {
        for sinks in [false, true] {
            let (plan, worst) = split_decode_case(bf16_kernel, gqa, sinks, &caches);
            println!("split decode bf16={bf16_kernel} causal sinks={sinks}: worst {worst:.2e}");
            let splits: Vec<usize> = (1..=caches.len()).map(|s| plan.splits(s)).collect();
            // 256..=258 keys: two splits of 128 (and one key over); 1001: 8;
            // 3001: 24 of 128; 5001: 32 of 160.
            assert_eq!(splits, [0, 0, 2, 3, 3, 8, 24, 32], "the causal plan");
            assert_eq!(split_chunk(5001), 160);
        }
        // A sliding window: a long cache's row sees the last 700 keys (split),
        // a short one all of its own. gpt-oss's sinks on it as on its full layers.
        let window = AttnShape { mask: Mask::Sliding(700), ..gqa };
        let (plan, worst) = split_decode_case(bf16_kernel, window, true, &caches);
        println!("split decode bf16={bf16_kernel} sliding 700 sinks: worst {worst:.2e}");
        assert_eq!(plan.splits(8), 6, "700 keys in splits of 128");
        // Llama 4's attention chunks: 3000 and 5000 see 953 and 905 keys of theirs.
        let chunked = AttnShape { mask: Mask::Chunked(1024), ..gqa };
        let (_, worst) = split_decode_case(bf16_kernel, chunked, false, &caches);
        println!("split decode bf16={bf16_kernel} chunked 1024: worst {worst:.2e}");
        // MQA at the widest head dims the kernels take (256/256: every lane's 8 columns).
        let wide = AttnShape { heads: 4, kv_heads: 1, head_dim: 256, v_dim: 256, mask: Mask::Causal, scale: 0.0625 };
        let (plan, worst) = split_decode_case(bf16_kernel, wide, true, &[3, 300, 700]);
        println!("split decode bf16={bf16_kernel} 256/256 MQA sinks: worst {worst:.2e}");
        assert_eq!((plan.splits(1), plan.splits(2), plan.splits(3)), (0, 3, 6));
    }
}

/// The emulation compiles each kernel against the prototypes build.rs
/// generated from the kernels' declarations, as NVRTC does: g++ refuses a
/// definition that disagrees with its declaration.
#[test]
fn gxx_refuses_a_definition_that_disagrees_with_its_declaration() {
    if !gxx_or_skip("gxx_refuses_a_definition_that_disagrees_with_its_declaration") {
        return;
    }
    let good = strata::backend::cuda::nvrtc::source("norm").unwrap();
    let decl = "extern \"C\" __global__ void rms_norm(const float* x, int stride,";
    let at = good.rfind(decl).expect("rms_norm's definition moved: update this test");
    let bad = format!("{}{}{}", &good[..at], decl.replace("int stride", "float stride"), &good[at + decl.len()..]);
    gxx_accepts(&emulation_source("norm", &good)).unwrap();
    let err = gxx_accepts(&emulation_source("norm", &bad)).expect_err("g++ took a definition that disagrees");
    assert!(err.contains("rms_norm"), "{err}");
}
