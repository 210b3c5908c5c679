//! The attention kernels at the head dims real models use, through any
//! [`Device`]: the emulated one (`tests/cuda_backend.rs`, in CI) and a GPU
//! (`tests/cuda_gpu.rs`, by `scripts/gpu-check.sh`). The parity fixtures
//! reach head dim 32 at most; Llama and Qwen use 128, DeepSeek's MLA 192
//! for keys and 128 for values, Gemma 3 and Qwen3-Next 256 (the only one
//! whose tiles need more than 48 KiB of shared memory).
#![allow(dead_code)] // each test file uses part of it

use strata::backend::cuda::device::{Arg, Device, Launch};

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
    // attention.cu's `Seg`: k, v (u64), then k_stride, v_stride, q_row0, q_len, pos0, kv_len (i32).
    let mut seg = Vec::new();
    seg.extend_from_slice(&dev.ptr(&km).to_le_bytes());
    seg.extend_from_slice(&dev.ptr(&vm).to_le_bytes());
    for x in [hd, vd, 0, T, 0, T] {
        seg.extend_from_slice(&(x as i32).to_le_bytes());
    }
    let segm = put(&seg);
    let seg_of = put(bytemuck::cast_slice(&[0u32; T]));
    let tiles = put(bytemuck::cast_slice(&[0i32, 0, 0, 64]));
    let scale = 1.0 / (hd as f32).sqrt();
    let run = |name: &str, table: u64, cfg: Launch| {
        let out = dev.alloc(T * HEADS * vd * 4).unwrap();
        let args = [
            Arg::Ptr(dev.ptr(&qm)),
            Arg::int(HEADS * hd),
            Arg::Ptr(dev.ptr(&segm)),
            Arg::Ptr(table),
            Arg::int(HEADS),
            Arg::int(1),
            Arg::int(hd),
            Arg::int(vd),
            Arg::I32(0),
            Arg::F32(scale),
            Arg::Ptr(dev.ptr(&out)),
        ];
        dev.launch(name, cfg, &args).unwrap_or_else(|e| panic!("{name} at {hd}/{vd}: {e}"));
        let mut host = vec![0f32; T * HEADS * vd];
        dev.download(dev.ptr(&out), bytemuck::cast_slice_mut(&mut host)).unwrap();
        host
    };
    let exact = run("attention_f32", dev.ptr(&seg_of), Launch { grid: (T as u32, 1), block: 128, smem: 0 });
    let n = [16, 32, 64, 128, 256].into_iter().find(|&n| n >= vd).unwrap();
    let dp = hd.div_ceil(16) * 16;
    let smem = ((64 * dp + 32 * dp + 32 * n) * 2) as u32;
    let tc =
        run(&format!("attention_bf16_v{n}"), dev.ptr(&tiles), Launch { grid: (2, HEADS as u32), block: 128, smem });
    assert!(tc.iter().chain(&exact).all(|x| x.is_finite()), "{hd}/{vd}: a value was not written (NaN)");
    let worst = exact.iter().zip(&tc).map(|(a, b)| (a - b).abs()).fold(0.0f32, f32::max);
    (worst, exact.iter().fold(0.0f32, |m, x| m.max(x.abs())))
}
