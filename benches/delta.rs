//! The Gated DeltaNet recurrence against transformers' `torch_chunk_gated_delta_rule`,
//! on the same cores in one run: one sequence of T = 4096 tokens, 32 value heads over
//! 16 key heads, k_dim = v_dim = 128, f32 (Qwen3-Next's layer shape).
//!
//! Strata: the CPU backend's `gated_delta_rule` op: q/k L2 norm, β and the decay
//! from `b`, `a`, `A_log` and `dt_bias`, the chunked delta rule, and the gated
//! RMSNorm with z (which transformers runs outside the function: Strata times more).
//! PyTorch: `torch_chunk_gated_delta_rule(q, k, v, g, beta, use_qk_l2norm_in_kernel=True)`
//! from transformers' Qwen3-Next model file, in f32, `torch.set_num_threads` equal to
//! rayon's thread count, inputs made once. Medians of `--runs` calls each, alternating.
//!
//!     cargo bench --bench delta -- --runs 5
//!
//! PyTorch runs through `$STRATA_PYTHON`, else `venv/bin/python`, else `python3`;
//! where none imports torch and transformers the bench says so and times Strata alone.

/// Large buffers on cache lines, as the `strata` binary has them.
#[global_allocator]
static ALLOC: strata::backend::cpu::CacheAligned = strata::backend::cpu::CacheAligned;

use std::process::{Command, Stdio};
use std::time::Instant;
use strata::backend::prelude::*;
use strata::backend::{Cpu, DeltaGates, DeltaRule, DeltaShape, LayerState, Tensor, F32};
use strata::pipeline::batch::{PackedBatch, Segment};
use strata_testkit::bench::{flag_or, median};

const T: usize = 4096;
const SHAPE: DeltaShape = DeltaShape { k_heads: 16, v_heads: 32, k_dim: 128, v_dim: 128, conv_kernel: 4 };

/// PyTorch's side: reads the run count, prints one median in seconds per line on request.
const TORCH: &str = r#"
import sys, time, statistics, torch
from transformers.models.qwen3_next.modeling_qwen3_next import torch_chunk_gated_delta_rule
threads, T, nk, nv, d = (int(a) for a in sys.argv[1:6])
torch.set_num_threads(threads)
g = torch.Generator().manual_seed(0)
q, k = (torch.randn(1, T, nk, d, generator=g) for _ in range(2))
v = torch.randn(1, T, nv, d, generator=g)
beta = torch.rand(1, T, nv, generator=g)
decay = -torch.rand(1, T, nv, generator=g) * 0.1
def once():
    t = time.perf_counter()
    with torch.inference_mode():
        torch_chunk_gated_delta_rule(q, k, v, decay, beta, use_qk_l2norm_in_kernel=True)
    return time.perf_counter() - t
once()
print("ready", flush=True)
for line in sys.stdin:
    print(once(), flush=True)
"#;

fn python() -> Option<String> {
    let candidates = [std::env::var("STRATA_PYTHON").ok(), Some("venv/bin/python".into()), Some("python3".into())];
    candidates.into_iter().flatten().find(|p| {
        Command::new(p)
            .args(["-c", "import torch, transformers.models.qwen3_next.modeling_qwen3_next"])
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
    })
}

fn noise(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (s >> 40) as f32 / (1u64 << 24) as f32 - 0.5
        })
        .collect()
}

fn main() {
    use std::io::{BufRead, BufReader, Write};
    let runs: usize = flag_or("--runs", 5);
    let threads = rayon::current_num_threads();
    let b = Cpu::<F32>::default();
    let (c, nv, dv) = (SHAPE.channels(), SHAPE.v_heads, SHAPE.v_dim);
    let qkv = Tensor::<Cpu>::from_host(&b, &noise(T * c, 1), T, c).unwrap();
    let z = Tensor::<Cpu>::from_host(&b, &noise(T * nv * dv, 2), T, nv * dv).unwrap();
    let ba = Tensor::<Cpu>::from_host(&b, &noise(T * 2 * nv, 3), T, 2 * nv).unwrap();
    let (a_log, dt_bias, norm) = (b.vector(vec![-1.0; nv]), b.vector(vec![-2.0; nv]), b.vector(vec![1.0; dv]));
    let rule = DeltaRule { shape: SHAPE, a_log: &a_log, dt_bias: &dt_bias, norm: &norm, eps: 1e-6 };
    let mut batch = PackedBatch::new();
    batch.push_segment(&vec![0; T], Segment { key: 0, pos0: 0, keep: false });
    let mut out = Tensor::<Cpu>::zeros(&b, T, nv * dv);
    let mut strata = || {
        let mut state = <Cpu as RecurrentOps>::DeltaState::default();
        state.begin(&batch).unwrap();
        let t = Instant::now();
        let gates = DeltaGates { z: z.all(), ba: ba.all() };
        b.gated_delta_rule(&qkv, gates, &rule, &batch, LayerState::new(&mut state, 0), &mut out);
        t.elapsed().as_secs_f64()
    };
    println!("threads {threads}, T = {T}, {} value heads over {} key heads, d = {dv}, f32", nv, SHAPE.k_heads);
    strata();
    let mut torch = python().and_then(|py| {
        let args = [threads, T, SHAPE.k_heads, nv, dv].map(|v| v.to_string());
        let mut child = Command::new(py)
            .arg("-c")
            .arg(TORCH)
            .args(args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .ok()?;
        let mut reader = BufReader::new(child.stdout.take()?);
        let mut line = String::new();
        reader.read_line(&mut line).ok()?;
        (line.trim() == "ready").then_some((child, reader))
    });
    if torch.is_none() {
        println!("PyTorch: no python here imports torch and transformers; timing Strata alone");
    }
    let (mut ours, mut theirs) = (Vec::new(), Vec::new());
    for _ in 0..runs {
        ours.push(strata());
        if let Some((child, reader)) = torch.as_mut() {
            writeln!(child.stdin.as_mut().unwrap(), "go").unwrap();
            let mut line = String::new();
            reader.read_line(&mut line).unwrap();
            theirs.push(line.trim().parse::<f64>().expect("a time in seconds"));
        }
    }
    let ours = median(ours);
    println!("strata gated_delta_rule                 median {:8.1} ms", ours * 1e3);
    if !theirs.is_empty() {
        let theirs = median(theirs);
        println!("transformers torch_chunk_gated_delta_rule median {:8.1} ms", theirs * 1e3);
        println!("strata is {:.2}x the speed of PyTorch", theirs / ours);
    }
    if let Some((mut child, _)) = torch {
        drop(child.stdin.take());
        let _ = child.wait();
    }
}
