//! The attention kernels at the head dims real models use, through any
//! [`Device`]: the emulated one (`tests/cuda_backend.rs`, in CI) and a GPU
//! (`tests/cuda_gpu.rs`, by `scripts/gpu-check.sh`). The parity fixtures
//! reach head dim 32 at most; Llama and Qwen use 128, DeepSeek's MLA 192
//! for keys and 128 for values, Gemma 3 and Qwen3-Next 256 (the only one
//! whose tiles need more than 48 KiB of shared memory).
#![allow(dead_code)] // each test file uses part of it

use strata::backend::cuda::backend::{attention_bf16_kernel, attention_bf16_smem, pad16, AttentionLaunch};
use strata::backend::cuda::device::{Device, Launch};
use strata::backend::cuda::kernels as launch;

/// (key head dim, value head dim) of the real models above, and 64.
pub const HEAD_DIMS: [(usize, usize); 4] = [(64, 64), (128, 128), (192, 128), (256, 256)];

/// Tokens of the one segment: 2 query tiles of 64 and 3 key tiles of 32 for
/// the last (small enough for the emulator, and every tile edge is crossed).
const T: usize = 90;
const HEADS: usize = 2;

fn values(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            // bf16-exact, so both kernels see the same inputs.
            half::bf16::from_f32(((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0).to_f32()
        })
        .collect()
}

/// Runs `attention_f32` and `attention_bf16_vN` on the same causal segment
/// (2 query heads sharing 1 KV head) of head dims `(hd, vd)`, and returns the
/// largest difference between their outputs, and the largest output.
pub fn bf16_against_f32<D: Device>(dev: &D, hd: usize, vd: usize) -> (f32, f32) {
    let (q, k, v) = (values(T * HEADS * hd, 1), values(T * hd, 2), values(T * vd, 3));
    let put = |x: &[u8]| {
        let m = dev.alloc(x.len()).unwrap();
        dev.upload(dev.ptr(&m), x).unwrap();
        m
    };
    let (qm, km, vm) = (put(bytemuck::cast_slice(&q)), put(bytemuck::cast_slice(&k)), put(bytemuck::cast_slice(&v)));
    // The bf16 kernels read queries, keys and values as bf16, each head padded to 16 columns (common.cuh's `Seg`).
    let to_bf16 = |x: &[f32], w: usize| -> Vec<u16> {
        x.chunks(w)
            .flat_map(|row| {
                let mut r: Vec<u16> = row.iter().map(|&v| half::bf16::from_f32(v).to_bits()).collect();
                r.resize(pad16(w), 0);
                r
            })
            .collect()
    };
    let (k16, v16) = (put(bytemuck::cast_slice(&to_bf16(&k, hd))), put(bytemuck::cast_slice(&to_bf16(&v, vd))));
    let q16 = put(bytemuck::cast_slice(&to_bf16(&q, hd)));
    // common.cuh's `Seg`: k, v (u64), then k_stride, v_stride, q_row0, q_len, pos0, kv_len (i32).
    let seg = |k: u64, v: u64, ks: usize, vs: usize| {
        let mut seg = Vec::new();
        seg.extend_from_slice(&k.to_le_bytes());
        seg.extend_from_slice(&v.to_le_bytes());
        for x in [ks, vs, 0, T, 0, T] {
            seg.extend_from_slice(&(x as i32).to_le_bytes());
        }
        put(&seg)
    };
    let seg32 = seg(dev.ptr(&km), dev.ptr(&vm), hd, vd);
    let seg16 = seg(dev.ptr(&k16), dev.ptr(&v16), pad16(hd), pad16(vd));
    let seg_of = put(bytemuck::cast_slice(&[0u32; T]));
    let tiles = put(bytemuck::cast_slice(&[0i32, 0, 0, 64]));
    let scale = 1.0 / (hd as f32).sqrt();
    let run =
        |name: &str, kernel: AttentionLaunch<D>, (q, qs): (u64, usize), segs: &D::Mem, table: u64, cfg: Launch| {
            let out = dev.alloc(T * HEADS * vd * 4).unwrap();
            let (qs, segs, o) = (qs as i32, dev.ptr(segs), dev.ptr(&out));
            kernel(dev, cfg, q, qs, segs, table, HEADS as i32, 1, hd as i32, vd as i32, 0, 0, scale, 0, o)
                .unwrap_or_else(|e| panic!("{name} at {hd}/{vd}: {e}"));
            let mut host = vec![0f32; T * HEADS * vd];
            dev.download(dev.ptr(&out), bytemuck::cast_slice_mut(&mut host)).unwrap();
            host
        };
    let cfg = Launch { grid: (T as u32, 1), block: 128, smem: 0 };
    let exact = run("attention_f32", launch::attention_f32, (dev.ptr(&qm), HEADS * hd), &seg32, dev.ptr(&seg_of), cfg);
    let cfg = Launch { grid: (2, HEADS as u32), block: 128, smem: attention_bf16_smem(hd, vd) };
    let q16 = (dev.ptr(&q16), HEADS * pad16(hd));
    let tc = run("attention_bf16", attention_bf16_kernel(vd), q16, &seg16, dev.ptr(&tiles), cfg);
    assert!(tc.iter().chain(&exact).all(|x| x.is_finite()), "{hd}/{vd}: a value was not written (NaN)");
    let worst = exact.iter().zip(&tc).map(|(a, b)| (a - b).abs()).fold(0.0f32, f32::max);
    (worst, exact.iter().fold(0.0f32, |m, x| m.max(x.abs())))
}
