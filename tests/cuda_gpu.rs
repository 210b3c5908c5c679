//! The CUDA backend on a real GPU: the driver, NVRTC's PTX loaded by the
//! driver, cuBLAS and NCCL, which `tests/cuda_backend.rs` (on the emulated
//! device) cannot reach. `scripts/gpu-check.sh` runs this binary on a GPU
//! machine with `STRATA_REQUIRE_GPU=1`, which turns "no GPU" into a failure.
//! Elsewhere each test prints why it skipped.
//!
//! - f32 compute (no TF32) agrees with the reference backend at the parity
//!   tolerance on every fixture; bf16 compute is at least as close to HF's
//!   f32 states as PyTorch's own bf16 run (the CPU bf16 issue's bar).
//! - Chunked prefill reads the GPU's KV cache back correctly.
//! - Batch invariance: the largest difference between a sample run alone
//!   and inside a packed batch is measured and printed (cuBLAS may pick its
//!   kernels by row count; the manifest records the budget for that reason).
//! - NCCL: the all-reduce at world size 1 (one GPU), and over two GPUs with
//!   `--tp 2` where there are two.
#![cfg(feature = "cuda")]

use crate::common;
use crate::cuda_shapes;

use common::*;
use strata::backend::cuda::{probe, Device, Driver};
use strata::backend::Compute;
use strata::model::{AnyCache, AnyModel, BackendKind, LoadOptions, Model};
use strata::pipeline::batch::{PackedBatch, Segment};
use strata::pipeline::capture::CaptureSet;
use strata::shape::CapturedStates;

/// True when the machine has `want` GPUs; otherwise says why the test
/// skipped (or fails, under `STRATA_REQUIRE_GPU=1`, for the one-GPU tests).
fn gpus_or_skip(test: &str, want: usize) -> bool {
    let why = match probe::device_count() {
        Ok(n) if n >= want => return true,
        Ok(n) => format!("this machine has {n} GPU(s), the test needs {want}"),
        Err(e) => e.to_string(),
    };
    if want == 1 && std::env::var_os("STRATA_REQUIRE_GPU").is_some() {
        panic!("{test}: STRATA_REQUIRE_GPU is set, but {why}");
    }
    eprintln!("SKIPPED {test}: {why}");
    false
}

fn load(name: &str, backend: BackendKind, compute: Compute, tp: usize) -> AnyModel {
    let devices = if backend == BackendKind::Cuda { (0..tp).collect() } else { Vec::new() };
    let opts = LoadOptions { backend, compute, tp, devices, lm_head: false };
    strata::model::load(&fixture(name), opts).unwrap_or_else(|e| panic!("{name} on {backend:?}: {e}"))
}

fn forward(m: &AnyModel, name: &str, batches: &[PackedBatch]) -> Vec<CapturedStates<usize, usize>> {
    let set = CaptureSet::<usize>::try_new(all_points(num_layers(name))).unwrap();
    let mut cache = AnyCache::default();
    batches.iter().map(|b| m.forward_step(b, &set, &mut cache).unwrap()).collect()
}

#[test]
fn every_fixture_on_the_gpu_matches_the_reference_in_f32_and_pytorch_in_bf16() {
    if !gpus_or_skip("every_fixture_on_the_gpu_matches_the_reference_in_f32_and_pytorch_in_bf16", 1) {
        return;
    }
    println!("{:22} {:>12} {:>12} {:>14} {:>16}", "fixture", "f32 vs ref", "f32 vs HF", "bf16 rel L2", "bar");
    for name in all_fixtures() {
        let batch = whole(name);
        let one = std::slice::from_ref(&batch);
        let reference = forward(&load(name, BackendKind::Reference, Compute::F32, 1), name, one).remove(0);
        let gpu = forward(&load(name, BackendKind::Cuda, Compute::F32, 1), name, one).remove(0);
        let vs_ref = max_err(gpu.as_slice(), reference.as_slice());
        let (vs_hf, _) = errors(name, &gpu, &batch);
        let bf16 = forward(&load(name, BackendKind::Cuda, Compute::Bf16, 1), name, one).remove(0);
        let (_, ours) = errors(name, &bf16, &batch);
        let (bar, what) = if fixture(name).join("expected_bf16.safetensors").exists() {
            (torch_bf16_error(name, &batch), "PyTorch bf16")
        } else {
            // FP8/INT4 fixtures have no PyTorch bf16 run: the CPU bf16 path is the bar.
            let cpu = forward(&load(name, BackendKind::Cpu, Compute::Bf16, 1), name, one).remove(0);
            (1.5 * errors(name, &cpu, &batch).1 + 1e-4, "1.5 x CPU bf16")
        };
        println!("{name:22} {vs_ref:>12.2e} {vs_hf:>12.2e} {ours:>14.3e} {bar:>9.3e} {what}");
        assert!(vs_ref <= tol(name), "{name}: cuda f32 differs from the reference backend by {vs_ref:e}");
        assert!(vs_hf <= tol(name), "{name}: cuda f32 differs from HF by {vs_hf:e}");
        assert!(ours <= bar, "{name}: cuda bf16 error {ours:e} exceeds the bar {bar:e} ({what})");
    }
}

/// A sample split over two steps (its keys read back from the GPU's KV
/// cache) gives the whole sample's states; a sample alone and inside the
/// packed batch are compared bit for bit, and the largest difference printed.
#[test]
fn chunked_prefill_and_batch_invariance_on_the_gpu() {
    if !gpus_or_skip("chunked_prefill_and_batch_invariance_on_the_gpu", 1) {
        return;
    }
    for name in ["qwen3", "mistral-swa", "deepseek-v3", "kimi-k2-int4", "qwen3-next"] {
        for compute in [Compute::F32, Compute::Bf16] {
            let m = load(name, BackendKind::Cuda, compute, 1);
            let batch = whole(name);
            let packed = forward(&m, name, std::slice::from_ref(&batch)).remove(0);
            let (mut worst, mut rel) = (0f32, 0f32);
            let mut differing = 0usize;
            for (i, s) in samples(name).iter().enumerate() {
                let alone = forward(&m, name, &[PackedBatch::from_samples([s.as_slice()])]).remove(0);
                let inside = packed.slice_tokens(batch.range(i)).unwrap();
                for slot in 0..alone.layers() {
                    let (a, b) = (alone.layer(slot), inside.layer(slot));
                    differing += a.iter().zip(b).filter(|(x, y)| x.to_bits() != y.to_bits()).count();
                    worst = worst.max(a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max));
                    rel = rel.max(max_err(a, b));
                }
                // f32 only: bf16 tolerances would hide an indexing bug.
                if i == 0 && compute == Compute::F32 {
                    let cut = s.len() / 2;
                    let mut first = PackedBatch::new();
                    first.push_segment(&s[..cut], Segment { key: 7, pos0: 0, keep: true });
                    let mut second = PackedBatch::new();
                    second.push_segment(&s[cut..], Segment { key: 7, pos0: cut, keep: false });
                    let got = forward(&m, name, &[first, second]);
                    for slot in 0..alone.layers() {
                        let joined: Vec<f32> = got.iter().flat_map(|st| st.layer(slot).to_vec()).collect();
                        let d = max_err(&joined, alone.layer(slot));
                        assert!(d <= tol(name), "{name}: chunked differs from whole by {d:e} at slot {slot}");
                    }
                }
            }
            println!(
                "{name:14} {compute:?}: alone vs packed: {differing} values differ, largest |difference| {worst:.3e}"
            );
            // Dense models only: on MoE ones a different GEMM kernel can flip
            // a router near-tie, a difference of the routing, not of indexing.
            if compute == Compute::F32 && !name.starts_with("deepseek") && !name.starts_with("kimi") {
                assert!(rel <= tol(name), "{name}: f32 alone vs packed differ by {rel:e} (relative)");
            }
        }
    }
}

#[test]
fn nccl_all_reduce_at_world_size_one() {
    if !gpus_or_skip("nccl_all_reduce_at_world_size_one", 1) {
        return;
    }
    let ranks = Driver::nccl_group(&[0]).unwrap();
    let d = &ranks[0];
    assert_eq!(d.rank(), (0, 1));
    let v: Vec<f32> = (0..4099).map(|i| i as f32 * 0.5 - 7.0).collect();
    let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
    let mem = d.alloc(bytes.len()).unwrap();
    d.upload(d.ptr(&mem), &bytes).unwrap();
    d.all_reduce(d.ptr(&mem), v.len()).unwrap();
    let mut back = vec![0u8; bytes.len()];
    d.download(d.ptr(&mem), &mut back).unwrap();
    assert_eq!(back, bytes, "an all-reduce over one rank must leave the buffer as it was");
}

#[test]
fn tensor_parallel_over_two_gpus_matches_one() {
    if !gpus_or_skip("tensor_parallel_over_two_gpus_matches_one", 2) {
        return;
    }
    for name in ["qwen3", "deepseek-v3", "kimi-k2-int4", "qwen3-next"] {
        let batch = whole(name);
        let one = std::slice::from_ref(&batch);
        let want = forward(&load(name, BackendKind::Cuda, Compute::F32, 1), name, one).remove(0);
        let got = forward(&load(name, BackendKind::Cuda, Compute::F32, 2), name, one).remove(0);
        let d = max_err(got.as_slice(), want.as_slice());
        println!("{name:14} --tp 2 vs one GPU: {d:.2e}");
        assert!(d <= tol(name), "{name}: --tp 2 differs from one GPU by {d:e}");
    }
}

/// The tensor-core attention kernel against the exact one on the GPU, at the
/// head dims real models use (see `tests/cuda_shapes`), 256/256 being the one
/// above 48 KiB of shared memory; the emulator runs the same check in CI.
#[test]
fn the_bf16_attention_kernel_matches_the_f32_one_at_real_head_dims_on_the_gpu() {
    if !gpus_or_skip("the_bf16_attention_kernel_matches_the_f32_one_at_real_head_dims_on_the_gpu", 1) {
        return;
    }
    let dev = Driver::open(0).unwrap();
    for (hd, vd) in cuda_shapes::HEAD_DIMS {
        let (worst, largest) = cuda_shapes::bf16_against_f32(&dev, hd, vd);
        println!(
            "head dims {hd}/{vd}: bf16 kernel vs f32 kernel on the GPU, worst {worst:.2e} (outputs up to {largest:.2})"
        );
        assert!(worst <= 2e-2 * largest.max(0.1), "head dims {hd}/{vd}: the bf16 kernel is off by {worst:e}");
    }
}

/// What the first GPU run must report before anything else: the library
/// versions, how the kernels loaded (a cubin unless NVRTC could not make one),
/// and the MoE experts' GEMM path (the grouped call, if the probe passed).
#[test]
fn versions_kernel_image_and_gemm_path() {
    println!("CUDA libraries: {}", probe::versions());
    if !gpus_or_skip("versions_kernel_image_and_gemm_path", 1) {
        return;
    }
    let dev = Driver::open(0).unwrap();
    println!("kernels loaded as {}; MoE experts' bf16 GEMMs: {:?}", dev.image.name(), dev.gemm_path());
    assert_eq!(dev.image, strata::backend::cuda::nvrtc::ImageKind::Cubin, "the kernels fell back to PTX (see the log)");
}
