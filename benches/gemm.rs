//! GEMM throughput of each CPU kernel path against this machine's measured
//! FMA peak, on the `small` bench model's layer shapes (2048 rows).
//!
//! The peak is timed here too: every thread runs independent chains of
//! 256-bit (or 512-bit, where the CPU has AVX-512) FMAs, far more than the
//! FMA latency needs to hide, so nothing but the FMA units limits it.
//!
//!     cargo bench --bench gemm [-- --runs N]

/// Large buffers on cache lines, as the `strata` binary has them.
#[global_allocator]
static ALLOC: strata::backend::cpu::CacheAligned = strata::backend::cpu::CacheAligned;

use std::sync::Arc;
use std::time::Instant;
use strata::backend::cpu::linear::{kernel_name, PackedLinear};
use strata::backend::Compute;
use strata::hf::quant::{LinearWeight, MappedRows};
use strata_testkit::bench::{flag_or, median};

fn rand(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed.wrapping_mul(6364136223846793005).wrapping_add(1);
    (0..n)
        .map(|_| {
            s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            ((s >> 40) as f32 / (1u64 << 24) as f32) - 0.5
        })
        .collect()
}

/// GFLOP/s of independent FMA chains on every rayon thread.
fn fma_peak() -> (f64, &'static str) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::*;
        const ITERS: usize = 20_000_000;
        #[target_feature(enable = "avx512f")]
        unsafe fn chains512() -> f32 {
            let mut acc = [_mm512_set1_ps(1.0); 12];
            let (m, a) = (_mm512_set1_ps(0.999_999), _mm512_set1_ps(1e-7));
            for _ in 0..ITERS {
                for x in acc.iter_mut() {
                    *x = _mm512_fmadd_ps(*x, m, a);
                }
            }
            acc.iter().map(|x| _mm512_reduce_add_ps(*x)).sum()
        }
        #[target_feature(enable = "avx2,fma")]
        unsafe fn chains256() -> f32 {
            let mut acc = [_mm256_set1_ps(1.0); 12];
            let (m, a) = (_mm256_set1_ps(0.999_999), _mm256_set1_ps(1e-7));
            for _ in 0..ITERS {
                for x in acc.iter_mut() {
                    *x = _mm256_fmadd_ps(*x, m, a);
                }
            }
            let mut s = [0f32; 8];
            acc.iter().for_each(|x| _mm256_storeu_ps(s.as_mut_ptr(), _mm256_add_ps(_mm256_loadu_ps(s.as_ptr()), *x)));
            s.iter().sum()
        }
        let (lanes, name): (usize, &str) = if std::is_x86_feature_detected!("avx512f") {
            (16, "avx512 fma")
        } else if std::is_x86_feature_detected!("fma") {
            (8, "avx2 fma")
        } else {
            return (f64::NAN, "none");
        };
        let threads = rayon::current_num_threads();
        let runs: Vec<f64> = (0..3)
            .map(|_| {
                let t = Instant::now();
                let s: f32 = rayon::broadcast(|_| unsafe {
                    if lanes == 16 {
                        chains512()
                    } else {
                        chains256()
                    }
                })
                .into_iter()
                .sum();
                std::hint::black_box(s);
                (threads * ITERS * 12 * lanes * 2) as f64 / t.elapsed().as_secs_f64() / 1e9
            })
            .collect();
        (runs.into_iter().fold(0.0, f64::max), name)
    }
    #[cfg(not(target_arch = "x86_64"))]
    (f64::NAN, "unmeasured")
}

fn main() {
    let runs: usize = flag_or("--runs", 5);
    let (peak, peak_kind) = fma_peak();
    println!(
        "threads {}, f32 kernel {}, measured {peak_kind} peak {peak:.1} GFLOP/s",
        rayon::current_num_threads(),
        kernel_name()
    );
    // One task, cache-resident: the micro-kernel alone, against one core's peak.
    for compute in Compute::ALL {
        let (m, n, k) = (96, 32, 256);
        let lin = PackedLinear::new_for(&rand(n * k, 1), n, k, None, compute);
        let (x, mut y) = (rand(m * k, 2), vec![0f32; m * n]);
        let reps = 2000;
        let secs = median(
            (0..runs)
                .map(|_| {
                    let t = Instant::now();
                    for _ in 0..reps {
                        lin.forward(&x, m, &mut y, false);
                    }
                    t.elapsed().as_secs_f64()
                })
                .collect(),
        );
        let gflops = 2.0 * (m * n * k * reps) as f64 / secs / 1e9;
        let core = peak / rayon::current_num_threads() as f64;
        println!("{compute:>4} {:<10} kernel alone [{m}x{k}]·[{n}x{k}]ᵀ, one thread: {gflops:6.1} GFLOP/s, {:5.1}% of one core's peak", lin.kernel(), 100.0 * gflops / core);
    }
    // (name, rows, out, in): the small model's linear layers over 2048 tokens,
    // and one expert of the MoE bench model over the 256 rows top-8 of 64 gives it.
    let shapes = [
        ("qkv", 2048, 1536, 1024),
        ("o", 2048, 1024, 1024),
        ("gate_up", 2048, 5632, 1024),
        ("down", 2048, 1024, 2816),
        ("expert_gu", 256, 1024, 1024),
        ("expert_dn", 256, 1024, 512),
    ];
    // f32 packed once into panels, f32 read in place (as an f32 checkpoint's
    // weights are: each tile transposed from the rows when reached), bf16 panels.
    for (label, compute, in_place) in
        [("f32", Compute::F32, false), ("f32 in place", Compute::F32, true), ("bf16", Compute::Bf16, false)]
    {
        let mut total = (0f64, 0f64);
        for (name, m, n, k) in shapes {
            let w = Arc::new(rand(n * k, 1));
            let x = rand(m * k, 2);
            let lin = if in_place {
                let keep = Some(Arc::clone(&w) as Arc<dyn Send + Sync>);
                // SAFETY: `keep` holds the vector the bytes view.
                let rows = unsafe { MappedRows::new(bytemuck::cast_slice(&w[..]), k, 0..n, 0..k, keep) };
                let rows = rows.expect("a Vec<f32> is f32-aligned");
                PackedLinear::from_weight(LinearWeight::Mapped(rows), None)
            } else {
                PackedLinear::new_for(&w, n, k, None, compute)
            };
            let mut y = vec![0f32; m * n];
            lin.forward(&x, m, &mut y, false);
            let secs = median(
                (0..runs)
                    .map(|_| {
                        let t = Instant::now();
                        lin.forward(&x, m, &mut y, false);
                        t.elapsed().as_secs_f64()
                    })
                    .collect(),
            );
            let flops = 2.0 * (m * n * k) as f64;
            total.0 += flops;
            total.1 += secs;
            println!(
                "{label:>12} {:<10} {name:<9} [{m}x{k}]·[{n}x{k}]ᵀ  {:7.1} GFLOP/s  {:5.1}% of peak",
                lin.kernel(),
                flops / secs / 1e9,
                100.0 * flops / secs / 1e9 / peak
            );
        }
        println!(
            "{label:>12} all layers: {:.1} GFLOP/s, {:.1}% of peak",
            total.0 / total.1 / 1e9,
            100.0 * total.0 / total.1 / 1e9 / peak
        );
    }
}
