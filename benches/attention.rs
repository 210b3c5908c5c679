//! Causal attention alone, on the bench model's shape: 8 samples × 512
//! tokens, 16 query heads over 4 kv heads of width 64, in each compute dtype.
//! Prints the median of `--runs` calls and the GFLOP/s of the two products
//! the causal mask leaves (`Q·Kᵀ` and `P·V` over the lower triangle).
//!
//!     cargo bench --bench attention -- --runs 9 [--compute f32|bf16]

/// Large buffers on cache lines, as the `strata` binary has them.
#[global_allocator]
static ALLOC: strata::backend::cpu::CacheAligned = strata::backend::cpu::CacheAligned;

use std::time::Instant;
use strata::backend::cpu::attention::{varlen_attention, AttnSegment, KvRef};
use strata::backend::{AttnShape, Compute, Mask};
use strata_testkit::bench::flag_or;

fn main() {
    let runs: usize = flag_or("--runs", 7);
    let (samples, len, heads, kv_heads, hd) = (8, 512, 16, 4, 64);
    let rows = samples * len;
    // Rows of q | k | v, as the fused qkv projection lays them out.
    let stride = (heads + 2 * kv_heads) * hd;
    let mut seed = 0x9e37_79b9_7f4a_7c15u64;
    let qkv: Vec<f32> = (0..rows * stride)
        .map(|_| {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            (seed >> 40) as f32 / (1u64 << 24) as f32 - 0.5
        })
        .collect();
    let s = AttnShape { heads, kv_heads, head_dim: hd, v_dim: hd, mask: Mask::Causal, scale: (hd as f32).powf(-0.5) };
    let segments: Vec<AttnSegment> = (0..samples)
        .map(|i| {
            let base = &qkv[i * len * stride..];
            AttnSegment {
                rows: i * len..(i + 1) * len,
                pos0: 0,
                kv: KvRef { k: &base[heads * hd..], v: &base[(heads + kv_heads) * hd..], stride, v_stride: stride },
            }
        })
        .collect();
    let mut out = vec![0f32; rows * heads * hd];
    // Two products of 2·hd flops per (query, visible key) pair, per head.
    let pairs = samples * len * (len + 1) / 2;
    let flops = (2 * 2 * hd * pairs * heads) as f64;
    println!("threads {}, {samples} × {len} tokens, {heads}/{kv_heads} heads × {hd}", rayon::current_num_threads());
    let only = std::env::args().skip_while(|a| a != "--compute").nth(1);
    for compute in Compute::ALL.into_iter().filter(|c| only.as_deref().is_none_or(|o| o == c.to_string())) {
        varlen_attention(&qkv, stride, &segments, s, None, compute, &mut out);
        let mut times: Vec<f64> = (0..runs)
            .map(|_| {
                let t = Instant::now();
                varlen_attention(&qkv, stride, &segments, s, None, compute, &mut out);
                t.elapsed().as_secs_f64()
            })
            .collect();
        times.sort_by(f64::total_cmp);
        let med = times[times.len() / 2];
        println!("{compute:>4} attention: median {:7.2} ms, {:6.1} GFLOP/s", med * 1e3, flops / med / 1e9);
    }
}
