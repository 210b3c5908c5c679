//! The CUDA backend's own code (weights, launches, GEMM operands, segment
//! tables, KV cache, MoE grouping, all-reduce) run without a GPU: its
//! [`Device`](strata::backend::cuda::Device) is `cuda_emu::Emulated`, which
//! runs the kernel sources of `kernels/` on the CPU and GEMMs as loops with
//! cuBLAS's column-major semantics. Every parity fixture must match HF in
//! f32 compute at the parity tolerance, and in bf16 compute be at least as
//! close to HF's f32 states as HF's own bf16 run is (the CPU bf16 issue's
//! bar). What this cannot check: cuBLAS, NCCL and the driver themselves,
//! which only a run on a GPU can.
#![cfg(feature = "cuda")]

use crate::common;
use crate::cuda_emu;
use crate::cuda_shapes;

use common::*;
use cuda_emu::{gxx_or_skip, Emulated, Faults};
use std::sync::atomic::AtomicUsize;
use strata::backend::cuda::backend::SplitPlan;
use strata::backend::cuda::Cuda;
use strata::backend::prelude::*;
use strata::backend::{
    AttnShape, Bf16, Compute, ComputeDtype, KvCache, KvStore, LayerState, Mask, Qkv, Reference, Tensor, F32,
};
use strata::hf::checkpoint::Checkpoint;
use strata::model::{AnyCache, LoadOptions, Model};
use strata::model::{AnyConfig, Deepseek, GptOss, Llama};
use strata::pipeline::batch::{PackedBatch, Segment};
use strata::pipeline::capture::CaptureSet;
use strata::shape::CapturedStates;

type Emu<C> = Cuda<C, Emulated>;

/// Runs `batches` in order through fixture `name` on the emulated CUDA
/// backend over `tp` ranks; returns each step's states.
fn run<C: ComputeDtype>(name: &str, tp: usize, batches: &[PackedBatch]) -> Vec<CapturedStates<usize, usize>> {
    let dir = fixture(name);
    let config = AnyConfig::read(&dir).unwrap();
    let prefix = config.tensor_prefix();
    let set = CaptureSet::<usize>::try_new(all_points(num_layers(name))).unwrap();
    let b = Emu::<C>::new(Emulated::default(), vec![0]);
    let open = move || Checkpoint::open_scoped(&dir, &prefix);
    fn steps<M: Model<Hidden = usize>>(
        m: M,
        set: &CaptureSet<usize>,
        batches: &[PackedBatch],
    ) -> Vec<CapturedStates<usize, usize>> {
        let mut cache = M::Cache::default();
        batches.iter().map(|b| m.forward_step(b, set, &mut cache).unwrap()).collect()
    }
    steps(config.load_on(b, tp, open).unwrap(), &set, batches)
}

#[test]
fn every_fixture_matches_hf_through_the_cuda_backend_in_f32_and_bf16() {
    if !gxx_or_skip("every_fixture_matches_hf_through_the_cuda_backend_in_f32_and_bf16") {
        return;
    }
    for name in all_fixtures() {
        let batch = whole(name);
        let f32_states = run::<F32>(name, 1, std::slice::from_ref(&batch)).remove(0);
        let (worst, _) = errors(name, &f32_states, &batch);
        assert!(worst <= tol(name), "{name}: cuda f32 differs from HF by {worst:e}");
        let bf16_states = run::<Bf16>(name, 1, std::slice::from_ref(&batch)).remove(0);
        let (_, ours) = errors(name, &bf16_states, &batch);
        if fixture(name).join("expected_bf16.safetensors").exists() {
            let theirs = torch_bf16_error(name, &batch);
            println!("{name:22} f32 worst {worst:.1e}   bf16 rel L2 {ours:.2e} (PyTorch bf16 {theirs:.2e})");
            assert!(ours <= theirs, "{name}: cuda bf16 error {ours:e} exceeds PyTorch bf16's {theirs:e}");
        } else {
            // FP8/INT4 fixtures have no PyTorch bf16 run (HF dequantises them
            // itself): the CPU backend's bf16 path, which rounds the same
            // inputs to bf16, is the bar.
            let opts = LoadOptions { compute: Compute::Bf16, ..Default::default() };
            let cpu = strata::model::load(&fixture(name), opts).unwrap();
            let set = CaptureSet::<usize>::try_new(all_points(num_layers(name))).unwrap();
            let cpu_states = cpu.forward_step(&batch, &set, &mut AnyCache::default()).unwrap();
            let (_, cpu_err) = errors(name, &cpu_states, &batch);
            println!("{name:22} f32 worst {worst:.1e}   bf16 rel L2 {ours:.2e} (CPU bf16 {cpu_err:.2e})");
            assert!(ours <= 1.5 * cpu_err + 1e-4, "{name}: cuda bf16 error {ours:e}, CPU bf16's {cpu_err:e}");
        }
    }
}

/// Chunked prefill (a sample split over steps, its keys read back from the
/// CUDA backend's KV cache) gives the states of the whole sample, and so
/// does tensor parallelism over two emulated GPUs (the NCCL all-reduce's place).
#[test]
fn chunks_and_tensor_parallel_ranks_give_the_whole_samples_states() {
    if !gxx_or_skip("chunks_and_tensor_parallel_ranks_give_the_whole_samples_states") {
        return;
    }
    // (minimax-m2: its q/k norms sum squares across the two ranks; gemma3-text
    // chunks its local and global layers, each with its own RoPE table.)
    // (qwen3-next: its 150-token sample is cut at 75, inside its second DeltaNet chunk.)
    for name in [
        "qwen3",
        "minimax-m2",
        "gemma3-text",
        "gpt-oss-mxfp4",
        "llama4-text",
        "deepseek-v3",
        "kimi-k2-int4",
        "qwen3-next",
    ] {
        let samples = samples(name);
        let s = samples.iter().max_by_key(|s| s.len()).unwrap();
        let batch = PackedBatch::from_samples([s.as_slice()]);
        let want = run::<F32>(name, 1, std::slice::from_ref(&batch)).remove(0);
        let cut = s.len() / 2;
        let mut first = PackedBatch::new();
        first.push_segment(&s[..cut], Segment { key: 7, pos0: 0, keep: true });
        let mut second = PackedBatch::new();
        second.push_segment(&s[cut..], Segment { key: 7, pos0: cut, keep: false });
        let got = run::<F32>(name, 1, &[first.clone(), second.clone()]);
        for (slot, _) in all_points(num_layers(name)).iter().enumerate() {
            let joined: Vec<f32> = got.iter().flat_map(|st| st.layer(slot).to_vec()).collect();
            let d = max_err(&joined, want.layer(slot));
            assert!(d <= tol(name), "{name}: chunked differs from whole by {d:e} at slot {slot}");
        }
        // bf16: the second chunk's keys come from the bf16 cache, in the
        // layout the step's own keys are packed in, and the kernel walks the
        // same key tiles in the same order: the states are the same bits.
        let want = run::<Bf16>(name, 1, std::slice::from_ref(&batch)).remove(0);
        let got = run::<Bf16>(name, 1, &[first, second]);
        for (slot, _) in all_points(num_layers(name)).iter().enumerate() {
            let joined: Vec<f32> = got.iter().flat_map(|st| st.layer(slot).to_vec()).collect();
            assert!(joined == want.layer(slot), "{name}: bf16 chunked differs from whole at slot {slot}");
        }
        let want = run::<F32>(name, 1, std::slice::from_ref(&batch)).remove(0);
        let tp = run::<F32>(name, 2, std::slice::from_ref(&batch)).remove(0);
        let d = max_err(tp.as_slice(), want.as_slice());
        assert!(d <= tol(name), "{name}: --tp 2 differs from one rank by {d:e}");
    }
}

/// A weight that does not fit in device memory fails the load with the
/// device's message, rather than the first step after an output was opened.
#[test]
fn a_failed_weight_upload_fails_the_load() {
    let name = "qwen3";
    let dir = fixture(name);
    let AnyConfig::Llama(c) = AnyConfig::read(&dir).unwrap() else { panic!("{name} is a Llama-family fixture") };
    let faults = Faults { memory: Some(AtomicUsize::new(64 << 10)), ..Default::default() };
    let b = Emu::<F32>::new(Emulated::with_faults(faults), vec![0]);
    let err = match Llama::<usize, Emu<F32>>::from_checkpoint_on(b, c, &Checkpoint::open(&dir).unwrap()) {
        Ok(_) => panic!("a model larger than the device loaded"),
        Err(e) => e.to_string(),
    };
    assert!(err.contains("OUT_OF_MEMORY"), "{err}");
}

/// A rank whose kernel fails mid-step still joins its peers' all-reduces
/// (NCCL would otherwise wait for it forever): the step fails with the
/// failing rank's message, in bounded time.
#[test]
fn a_rank_failing_mid_step_does_not_hang_its_peers() {
    if !gxx_or_skip("a_rank_failing_mid_step_does_not_hang_its_peers") {
        return;
    }
    for (name, kernel, failing) in [("qwen3", "swiglu", 0), ("qwen3", "swiglu", 1), ("deepseek-v3", "gather_rows", 1)] {
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let dir = fixture(name);
            let faults = Faults { kernel: Some((failing, kernel)), ..Default::default() };
            let b = Emu::<F32>::new(Emulated::with_faults(faults), vec![0, 1]);
            let set = CaptureSet::<usize>::try_new(all_points(num_layers(name))).unwrap();
            let batch = whole(name);
            let open = move || Checkpoint::open(&dir);
            let m = AnyConfig::read(&fixture(name)).unwrap().load_on(b, 2, open).unwrap();
            let r = m.forward_step(&batch, &set, &mut AnyCache::default()).map(drop);
            let _ = tx.send(r.map_err(|e| e.to_string()));
        });
        match rx.recv_timeout(std::time::Duration::from_secs(120)) {
            Ok(r) => {
                let err = r.expect_err("a failed kernel must fail the step");
                assert!(err.contains(&format!("planted failure on rank {failing}")), "{name} rank {failing}: {err}");
            }
            Err(_) => panic!("{name}: a failure on rank {failing} hung the step (its peers waited in an all-reduce)"),
        }
    }
}

/// A rank that panics mid-step (a bug, not a device error) cannot join its
/// peers' next all-reduce: the executor catches the panic and aborts the
/// group's collectives (on GPUs `ncclCommAbort`; here the emulated NCCL's
/// abortable barrier), so the step ends with an error naming the panic, the
/// model drops, and nothing hangs. A watchdog bounds the whole of it.
#[test]
fn a_rank_panicking_mid_step_ends_the_step_with_an_error() {
    if !gxx_or_skip("a_rank_panicking_mid_step_ends_the_step_with_an_error") {
        return;
    }
    for (name, kernel, panicking) in
        [("qwen3", "swiglu", 1), ("qwen3", "rms_norm", 0), ("deepseek-v3", "moe_combine", 1)]
    {
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let dir = fixture(name);
            let faults = Faults { panic: Some((panicking, kernel)), ..Default::default() };
            let b = Emu::<F32>::new(Emulated::with_faults(faults), vec![0, 1]);
            let set = CaptureSet::<usize>::try_new(all_points(num_layers(name))).unwrap();
            let batch = whole(name);
            let open = move || Checkpoint::open(&dir);
            let (first, second) = {
                let m = AnyConfig::read(&fixture(name)).unwrap().load_on(b, 2, open).unwrap();
                let mut cache = AnyCache::default();
                (m.forward_step(&batch, &set, &mut cache).map(drop), m.forward_step(&batch, &set, &mut cache).map(drop))
            }; // the model (and its rank threads) dropped here, inside the watchdog's bound
            let _ = tx.send((first.map_err(|e| e.to_string()), second.map_err(|e| e.to_string())));
        });
        match rx.recv_timeout(std::time::Duration::from_secs(120)) {
            Ok((first, second)) => {
                let err = first.expect_err("a panic must fail the step");
                let want = format!("planted panic on rank {panicking} in {kernel}");
                assert!(err.contains(&want) && err.contains(&format!("rank {panicking}")), "{name}: {err}");
                assert!(second.is_err(), "{name}: a group with a dead rank ran another step");
            }
            Err(_) => panic!("{name}: a panic on rank {panicking} hung the step or the teardown"),
        }
    }
}

/// Experts run in chunks bounded by scratch memory: one expert per chunk (a
/// budget of one byte) gives the same bits as all in one grouped launch.
#[test]
fn expert_chunks_do_not_change_the_states() {
    if !gxx_or_skip("expert_chunks_do_not_change_the_states") {
        return;
    }
    for name in ["deepseek-v3", "kimi-k2-int4"] {
        let dir = fixture(name);
        let set = CaptureSet::<usize>::try_new(all_points(num_layers(name))).unwrap();
        let batch = whole(name);
        let states = |budget: usize| {
            let AnyConfig::Deepseek(c) = AnyConfig::read(&dir).unwrap() else { panic!("{name} is a DeepSeek fixture") };
            let b = Emu::<Bf16>::new(Emulated::default(), vec![0]).moe_scratch(budget);
            let ckpt = Checkpoint::open_scoped(&dir, &AnyConfig::read(&dir).unwrap().tensor_prefix()).unwrap();
            let m = Deepseek::<usize, Emu<Bf16>>::from_checkpoint_on(b, c, &ckpt).unwrap();
            m.forward_step(&batch, &set, &mut Default::default()).unwrap()
        };
        let (one, each) = (states(1 << 30), states(1));
        assert!(one.as_slice() == each.as_slice(), "{name}: chunking the experts changed the states");
    }
}

/// The MoE experts' bf16 GEMMs take `cublasGemmGroupedBatchedEx` on a device
/// whose cuBLAS has it (the emulated one, unless told otherwise) and one call
/// each elsewhere; f32 compute (pedantic, which the grouped call does not
/// take) always runs one call each. The emulator computes both paths with the
/// same loops, so the states agree here; on a GPU they can differ in the last
/// bits, which is why the manifest's kernel field names the path.
#[test]
fn the_experts_take_the_grouped_gemm_where_cublas_has_it() {
    use strata::backend::cuda::device::GemmPath;
    if !gxx_or_skip("the_experts_take_the_grouped_gemm_where_cublas_has_it") {
        return;
    }
    fn run_on<C: ComputeDtype>(name: &str, dev: Emulated) -> (CapturedStates<usize, usize>, usize, &'static str) {
        let dir = fixture(name);
        let AnyConfig::Deepseek(c) = AnyConfig::read(&dir).unwrap() else { panic!("{name} is a DeepSeek fixture") };
        let kernel = strata::backend::cuda::Device::gemm_path(&dev).kernel(C::COMPUTE);
        let ckpt = Checkpoint::open_scoped(&dir, &AnyConfig::read(&dir).unwrap().tensor_prefix()).unwrap();
        let m = Deepseek::<usize, Emu<C>>::from_checkpoint_on(Emu::<C>::new(dev, vec![0]), c, &ckpt).unwrap();
        let set = CaptureSet::<usize>::try_new(all_points(num_layers(name))).unwrap();
        let states = m.forward_step(&whole(name), &set, &mut Default::default()).unwrap();
        (states, m.backend().device().count("cublasGemmGroupedBatchedEx"), kernel)
    }
    for name in ["deepseek-v3", "kimi-k2-int4"] {
        let (grouped, calls, kernel) = run_on::<Bf16>(name, Emulated::default());
        assert!(calls > 0, "{name}: bf16 experts never took the grouped call");
        assert_eq!(kernel, "cublas-grouped");
        let (each, calls, kernel) = run_on::<Bf16>(name, Emulated::default().per_expert());
        assert_eq!((calls, kernel), (0, "cublas"), "{name}: the per-expert path");
        assert!(grouped.as_slice() == each.as_slice(), "{name}: the two paths differ in the emulator");
        let (_, calls, kernel) = run_on::<F32>(name, Emulated::default());
        assert_eq!((calls, kernel), (0, "cublas"), "{name}: f32 (pedantic) GEMMs are never grouped");
    }
    assert_ne!(GemmPath::Grouped.kernel(Compute::Bf16), GemmPath::PerExpert.kernel(Compute::Bf16));
}

/// The tensor-core attention kernel against the exact one at the head dims
/// real models use (64, 128, MLA's 192/128, 256/256), on inputs both see
/// alike (bf16-exact): the only difference left is the bf16 rounding of the
/// probabilities before P·V. Any output left unwritten is NaN (the emulated
/// device fills new memory with it).
#[test]
fn the_bf16_attention_kernel_matches_the_f32_one_at_real_head_dims() {
    if !gxx_or_skip("the_bf16_attention_kernel_matches_the_f32_one_at_real_head_dims") {
        return;
    }
    let dev = Emulated::default();
    for (hd, vd) in cuda_shapes::HEAD_DIMS {
        let (worst, largest) = cuda_shapes::bf16_against_f32(&dev, hd, vd);
        println!("head dims {hd}/{vd}: bf16 kernel vs f32 kernel, worst {worst:.2e} (outputs up to {largest:.2})");
        assert!(worst <= 2e-2 * largest.max(0.1), "head dims {hd}/{vd}: the bf16 kernel is off by {worst:e}");
    }
}

/// The RoPE table is built once per frequency set and kept: a later step
/// within its positions gets the same device table (no host rebuild, no
/// upload); a longer step rebuilds it at least twice as long, with the same
/// values at the earlier positions.
#[test]
fn the_rope_table_is_built_once_and_grown_geometrically() {
    use strata::backend::cuda::device::Device;
    use strata::hf::RopeFreqs;
    let b = Emu::<F32>::new(Emulated::default(), vec![0]);
    let freqs = RopeFreqs { inv_freq: vec![1.0, 0.1, 0.01], scale: 1.0 };
    let first = b.rope_table(&freqs, 100);
    let again = b.rope_table(&freqs, 60);
    assert_eq!(first.cos_ptr(), again.cos_ptr(), "a shorter step rebuilt the table");
    let longer = b.rope_table(&freqs, 150);
    assert_ne!(longer.cos_ptr(), first.cos_ptr());
    assert_eq!(longer.len(), 200, "grown to twice the old length");
    let other = b.rope_table(&RopeFreqs { inv_freq: vec![1.0, 0.1, 0.02], scale: 1.0 }, 10);
    assert_ne!(other.cos_ptr(), longer.cos_ptr(), "another frequency set shares a table");
    assert_eq!(b.rope_table(&freqs, 200).cos_ptr(), longer.cos_ptr());
    // The same values where the tables overlap.
    let read = |t: &strata::backend::cuda::backend::RopeTable<Emulated>, n: usize| {
        let mut v = vec![0f32; n * 3];
        b.device().download(t.cos_ptr(), bytemuck::cast_slice_mut(&mut v)).unwrap();
        v
    };
    assert_eq!(read(&first, 100), read(&longer, 100));
}

/// Under bf16 compute the norm before a projection and the SwiGLU before the
/// down projection write their rows as bf16 straight into the GEMM's input
/// (`rms_norm_bf16`, `swiglu_to_bf16`): no f32 copy written, read and
/// rounded by `to_bf16`. The results are the unfused ops' bits.
#[test]
fn the_fused_bf16_norm_and_swiglu_give_the_unfused_bits() {
    if !gxx_or_skip("the_fused_bf16_norm_and_swiglu_give_the_unfused_bits") {
        return;
    }
    use strata::backend::prelude::*;
    use strata::backend::{MlpBufs, Parallel, Tensor};
    use strata::hf::quant::LinearWeight;
    let b = Emu::<Bf16>::new(Emulated::default(), vec![0]);
    let (rows, h, inter) = (5usize, 48usize, 40usize);
    let vals = |n: usize, seed: u64| -> Vec<f32> {
        let mut rng = strata_testkit::Rng::new(seed);
        (0..n).map(|_| rng.uniform()).collect()
    };
    let dense = |r: usize, c: usize, seed: u64| LinearWeight::Dense { rows: r, cols: c, w: vals(r * c, seed) };
    let gate_up = b.linear(dense(2 * inter, h, 1), Some(vals(2 * inter, 2)), Parallel::Replicated);
    let down = b.linear(dense(h, inter, 3), Some(vals(h, 4)), Parallel::Replicated);
    let norm = b.vector(vals(h, 5));
    let x = Tensor::<Emu<Bf16>, usize>::from_host(&b, &vals(rows * h, 6), rows, h).unwrap();
    let host = |t: &Tensor<Emu<Bf16>, usize>| t.to_host(&b);

    // Fused: norm → gate/up, then SwiGLU → down added into a residual.
    let (mut normed, mut gu) = (Tensor::zeros(&b, rows, h), Tensor::zeros(&b, rows, 2 * inter));
    b.norm_linear_forward(&gate_up, &x, &norm, 1e-6, &mut normed, &mut gu);
    let (mut act, mut res) = (Tensor::zeros(&b, rows, inter), Tensor::from_host(&b, &host(&x), rows, h).unwrap());
    b.swiglu_linear_add(&down, &gu, &mut act, &mut res);
    // Unfused: each op on its own.
    let (mut normed2, mut gu2) = (Tensor::zeros(&b, rows, h), Tensor::zeros(&b, rows, 2 * inter));
    b.rms_norm(x.all(), &norm, 1e-6, &mut normed2);
    b.linear_forward(&gate_up, &normed2, &mut gu2);
    let (mut act2, mut res2) = (Tensor::zeros(&b, rows, inter), Tensor::from_host(&b, &host(&x), rows, h).unwrap());
    b.glu(strata::backend::Glu::Silu, &gu2, &mut act2);
    b.linear_add(&down, &act2, &mut res2);
    b.end_step().unwrap();
    assert!(host(&gu) == host(&gu2), "the fused norm changed the projection's bits");
    assert!(host(&res) == host(&res2), "the fused SwiGLU changed the residual's bits");
    let dev = b.device();
    assert_eq!((dev.count("rms_norm_bf16"), dev.count("swiglu_to_bf16")), (1, 1), "the fused kernels were not taken");
    assert_eq!(dev.count("to_bf16"), 2, "only the unfused ops round an f32 copy");

    // The whole MLP in bf16 (norm_gated_mlp_add): the gate/up GEMM writes
    // bf16 and SwiGLU reads it, as PyTorch's bf16 run does; not the bits
    // above, but within bf16's rounding of them.
    let mut x3 = Tensor::from_host(&b, &host(&x), rows, h).unwrap();
    let (mut n3, mut gu3, mut act3) =
        (Tensor::zeros(&b, rows, h), Tensor::zeros(&b, rows, 2 * inter), Tensor::zeros(&b, rows, inter));
    let bufs = MlpBufs { normed: &mut n3, gate_up: &mut gu3, act: &mut act3 };
    b.norm_gated_mlp_add(&gate_up, &down, &norm, 1e-6, &mut x3, bufs);
    b.end_step().unwrap();
    let (got, want) = (host(&x3), host(&res));
    let scale = want.iter().fold(0f32, |m, v| m.max(v.abs()));
    let worst = got.iter().zip(&want).fold(0f32, |m, (a, b)| m.max((a - b).abs()));
    assert!(worst <= 2e-2 * scale, "bf16 MLP differs from the f32-activation one by {worst} (scale {scale})");
    assert!(got != want, "the gate/up activations were not kept in bf16");
    assert_eq!(dev.count("swiglu_bf16"), 1, "SwiGLU did not read bf16 gate/up activations");
    assert_eq!(dev.count("rms_norm_bf16"), 2);
}

/// FP8 and INT4 weights are expanded once and kept when device memory has
/// room to spare (above the reserve for larger steps): a second step
/// launches no dequantising kernel. A device without that room expands them
/// every forward. Both give the same states, bit for bit.
#[test]
fn expanded_weights_are_kept_when_memory_allows() {
    if !gxx_or_skip("expanded_weights_are_kept_when_memory_allows") {
        return;
    }
    fn two_steps(name: &str, dev: Emulated) -> (Vec<f32>, [usize; 2]) {
        let dir = fixture(name);
        let AnyConfig::Deepseek(c) = AnyConfig::read(&dir).unwrap() else { panic!("{name} is a DeepSeek fixture") };
        let ckpt = Checkpoint::open_scoped(&dir, &AnyConfig::read(&dir).unwrap().tensor_prefix()).unwrap();
        let m = Deepseek::<usize, Emu<Bf16>>::from_checkpoint_on(Emu::<Bf16>::new(dev, vec![0]), c, &ckpt).unwrap();
        let set = CaptureSet::<usize>::try_new(all_points(num_layers(name))).unwrap();
        let dequants = |m: &Deepseek<usize, Emu<Bf16>>| {
            let d = m.backend().device();
            ["dequant_fp8_bf16", "dequant_fp8_f32", "dequant_int4_bf16", "dequant_int4_f32"]
                .iter()
                .map(|k| d.count(k))
                .sum::<usize>()
        };
        let mut states = m.forward_step(&whole(name), &set, &mut Default::default()).unwrap().as_slice().to_vec();
        let first = dequants(&m);
        states.extend_from_slice(m.forward_step(&whole(name), &set, &mut Default::default()).unwrap().as_slice());
        (states, [first, dequants(&m) - first])
    }
    for name in ["deepseek-v3-fp8", "kimi-k2-int4"] {
        let (kept, [first, second]) = two_steps(name, Emulated::default());
        assert!(first > 0, "{name}: no quantised weight was expanded");
        assert_eq!(second, 0, "{name}: the second step expanded its weights again");
        // 1 GiB: the fixture loads, but the 8 GiB reserve leaves no room to keep.
        let tight = Emulated::with_faults(Faults { memory: Some(AtomicUsize::new(1 << 30)), ..Default::default() });
        let (each, [first_t, second_t]) = two_steps(name, tight);
        assert_eq!((first_t, second_t), (first, first), "{name}: a device without room kept expansions");
        assert!(kept == each, "{name}: kept expansions changed the states");
    }
}

/// gpt-oss's MXFP4 experts go to the device packed: at load, the resident
/// bytes (as the extract summary reports them) are within 1.25x of the
/// file at both compute dtypes. After a forward the backend keeps their
/// expansions when memory allows (as above), and says so in the count.
#[test]
fn mxfp4_weights_are_uploaded_packed() {
    if !gxx_or_skip("mxfp4_weights_are_uploaded_packed") {
        return;
    }
    fn resident<C: ComputeDtype>() -> (f64, f64, usize) {
        let dir = fixture("gpt-oss-mxfp4");
        let file = std::fs::metadata(dir.join("model.safetensors")).unwrap().len() as f64;
        let AnyConfig::GptOss(c) = AnyConfig::read(&dir).unwrap() else { panic!("a gpt-oss fixture") };
        let ckpt = Checkpoint::open_scoped(&dir, "").unwrap();
        let m =
            GptOss::<usize, Emu<C>>::from_checkpoint_on(Emu::<C>::new(Emulated::default(), vec![0]), c, &ckpt).unwrap();
        let at_load = m.weight_bytes() as f64 / file;
        let set = CaptureSet::<usize>::try_new(all_points(num_layers("gpt-oss-mxfp4"))).unwrap();
        m.forward_step(&whole("gpt-oss-mxfp4"), &set, &mut Default::default()).unwrap();
        let d = m.backend().device();
        (at_load, m.weight_bytes() as f64 / file, d.count("dequant_mxfp4_bf16") + d.count("dequant_mxfp4_f32"))
    }
    for (compute, (at_load, after, dequants)) in [("f32", resident::<F32>()), ("bf16", resident::<Bf16>())] {
        println!("gpt-oss-mxfp4 cuda {compute}: {at_load:.3}x the file at load, {after:.3}x after a forward that kept its expansions");
        assert!(at_load <= 1.25, "{compute}: resident {at_load:.3}x the file size at load");
        assert!(dequants > 0, "{compute}: no MXFP4 weight went through the dequantising kernel");
    }
}

/// Double-buffered staging: a step's captures are still in flight when it
/// returns, and are read after the next step ran (as the pipeline's writer
/// does while the model runs the next step), out of order here; each
/// step's states are the bits a step collected at once gives. A backend
/// that left a step's staged copies on the device would hand them to the
/// next step's collection (refused: more captures collected than staged).
#[test]
fn a_steps_captures_are_collected_while_the_next_step_runs() {
    if !gxx_or_skip("a_steps_captures_are_collected_while_the_next_step_runs") {
        return;
    }
    let name = "qwen3";
    let samples = samples(name);
    let batches = [
        PackedBatch::from_samples([samples[0].as_slice()]),
        PackedBatch::from_samples(samples.iter().map(Vec::as_slice)),
    ];
    let want = run::<Bf16>(name, 1, &batches);
    let dir = fixture(name);
    let AnyConfig::Llama(c) = AnyConfig::read(&dir).unwrap() else { panic!("{name} is a Llama-family fixture") };
    let set = CaptureSet::<usize>::try_new(all_points(num_layers(name))).unwrap();
    let ckpt = Checkpoint::open_scoped(&dir, "").unwrap();
    let m = Llama::<usize, Emu<Bf16>>::from_checkpoint_on(Emu::new(Emulated::default(), vec![0]), c, &ckpt).unwrap();
    let mut cache = Default::default();
    let first = m.forward_step_pending(&batches[0], &set, &mut cache).unwrap();
    let second = m.forward_step_pending(&batches[1], &set, &mut cache).unwrap();
    assert!(first.is_pending() && second.is_pending(), "the emulated device stages its captures");
    let second = second.wait().unwrap();
    let first = first.wait().unwrap();
    assert!(first.as_slice() == want[0].as_slice(), "step 1's states changed when collected after step 2");
    assert!(second.as_slice() == want[1].as_slice(), "step 2's states changed when collected before step 1's");
}

/// The emulated device holds staged copies to a GPU's rule: they have landed
/// only once a sync issued after them completed. A collection before it is
/// refused, so a backend that read its captures before the step's sync
/// fails the tests here as it would read garbage on a GPU.
#[test]
fn staged_copies_are_read_only_after_a_sync() {
    use strata::backend::cuda::Device;
    let dev = Emulated::default();
    let src = dev.alloc_zeroed(64).unwrap();
    let p = dev.ptr(&src);
    dev.stage(p, 64).unwrap();
    let early = dev.take_staged().unwrap().collect(&mut |_| {});
    assert!(early.is_err(), "a collection before the sync was accepted");
    dev.stage(p, 64).unwrap();
    let taken = dev.take_staged().unwrap();
    dev.sync().unwrap();
    let mut sizes = Vec::new();
    taken.collect(&mut |parts| sizes = parts.iter().map(|p| p.len()).collect()).unwrap();
    assert_eq!(sizes, [64], "the copy staged after the first take");
}

/// Under bf16 compute the attention block keeps q, k and v in bf16 from the
/// qkv GEMM to the attention kernel (`norm_attention_add`): the GEMM writes
/// bf16, the q/k norms, RoPE and the packing read and write bf16 rows, and
/// no f32 `[T, (heads + 2·kv heads)·hd]` is written. The states are within
/// bf16's rounding of the op-by-op block's (f32 q, k, v), not its bits. At
/// head dim 128 with GQA, a q/k norm and a bias, over two packed samples.
#[test]
fn the_bf16_attention_block_keeps_q_k_v_in_bf16() {
    if !gxx_or_skip("the_bf16_attention_block_keeps_q_k_v_in_bf16") {
        return;
    }
    use strata::backend::prelude::*;
    use strata::backend::{attention_block_ops, AttnBlock, AttnBufs, AttnShape, LayerState, Parallel, QkNorm, Tensor};
    use strata::hf::quant::LinearWeight;
    use strata::hf::RopeFreqs;
    let b = Emu::<Bf16>::new(Emulated::default(), vec![0]);
    let (h, nh, nkv, hd) = (64usize, 2usize, 1usize, 128usize);
    let batch = PackedBatch::from_samples([&[1u32; 70][..], &[2u32; 9][..]]);
    let rows = batch.num_tokens();
    let vals = |n: usize, seed: u64| -> Vec<f32> {
        let mut rng = strata_testkit::Rng::new(seed);
        (0..n).map(|_| rng.uniform()).collect()
    };
    let dense = |r: usize, c: usize, seed: u64| LinearWeight::Dense { rows: r, cols: c, w: vals(r * c, seed) };
    let width = (nh + 2 * nkv) * hd;
    let qkv_proj = b.linear(dense(width, h, 1), Some(vals(width, 2)), Parallel::Column);
    let o_proj = b.linear(dense(h, nh * hd, 3), None, Parallel::Row);
    let (norm, qn, kn) = (b.vector(vals(h, 4)), b.vector(vals(hd, 5)), b.vector(vals(hd, 6)));
    let inv_freq = (0..hd / 2).map(|i| 10000f32.powf(-2.0 * i as f32 / hd as f32)).collect();
    let rope = b.rope_table(&RopeFreqs { inv_freq, scale: 1.0 }, batch.max_position());
    let shape = AttnShape { heads: nh, kv_heads: nkv, head_dim: hd, v_dim: hd, mask: Mask::Causal, scale: 0.088 };
    let block = AttnBlock {
        qkv_proj: &qkv_proj,
        o_proj: &o_proj,
        norm: (&norm, 1e-6),
        qk_norm: Some(QkNorm { q: &qn, k: &kn, eps: 1e-6, all_heads: false }),
        shape,
        sinks: None,
        rotary_dim: hd,
    };
    let x0 = vals(rows * h, 7);
    let run = |fused: bool| {
        let mut x = Tensor::<Emu<Bf16>, usize>::from_host(&b, &x0, rows, h).unwrap();
        let (mut normed, mut qkv, mut out) =
            (Tensor::zeros(&b, rows, h), Tensor::zeros(&b, rows, width), Tensor::zeros(&b, rows, nh * hd));
        let mut cache = Default::default();
        KvStore::begin(&mut cache, &batch).unwrap();
        if fused {
            let bufs = AttnBufs { normed: &mut normed, qkv: &mut qkv, out: &mut out };
            b.norm_attention_add(&block, &mut x, bufs, &rope, &batch, LayerState::new(&mut cache, 0));
        } else {
            let bufs = AttnBufs { normed: &mut normed, qkv: &mut qkv, out: &mut out };
            attention_block_ops(&b, &block, &mut x, bufs, &rope, &batch, LayerState::new(&mut cache, 0));
        }
        b.end_step().unwrap();
        x.to_host(&b)
    };
    let got = run(true);
    let dev = b.device();
    let counts = |names: &[&str]| names.iter().map(|n| dev.count(n)).collect::<Vec<_>>();
    let bf16_ops = ["rms_norm_heads_bf16", "rope_bf16", "pack_heads_bf16_from_bf16"];
    let f32_ops = ["rms_norm_heads", "rope", "pack_heads_bf16", "to_bf16"];
    assert_eq!(counts(&bf16_ops), [2, 1, 3], "q, k and v did not stay in bf16");
    // (o_proj's input, the attention's f32 output, is the one rounding left.)
    assert_eq!(counts(&f32_ops), [0, 0, 0, 1], "an f32 q, k or v was written");
    let want = run(false);
    assert_eq!(counts(&f32_ops), [2, 1, 3, 2], "the op-by-op block");
    let scale = want.iter().fold(0f32, |m, v| m.max(v.abs()));
    let worst = got.iter().zip(&want).fold(0f32, |m, (a, b)| m.max((a - b).abs()));
    assert!(got.iter().all(|v| v.is_finite()), "a value was left unwritten (NaN)");
    assert!(worst <= 2e-2 * scale, "the bf16 block differs from the f32-qkv one by {worst} (scale {scale})");
    assert!(got != want, "q, k and v were not kept in bf16");
}

/// Split-K decode through the backend: a step that mixes a prefill segment
/// with one-token decode rows over KV caches of 1 to 3000 positions (left by
/// an earlier step of the backend's own) matches the reference, and the long
/// rows took the split kernels (the plan, and one launch of each split
/// kernel) while the rest took the one-block kernel. The caches are filled
/// under a narrow window (a cache keeps keys and values whatever the mask),
/// so the emulation walks no 3000² scores. bf16 compute gets bf16-exact
/// inputs: its split rows (f32 arithmetic on bf16 values) match at the exact
/// path's tolerance, its tensor-core rows at bf16's. Returns the split rows'
/// worst error (relative to max(|want|, 1)).
fn split_decode_through_the_backend<C: ComputeDtype>(shape: AttnShape, with_sinks: bool) -> f32 {
    let b = Emu::<C>::new(Emulated::default(), vec![0]);
    let r = Reference;
    let bf16 = C::COMPUTE == Compute::Bf16;
    let caches = [1usize, 255, 256, 257, 1000, 3000];
    let (nh, nkv, hd, vd) = (shape.heads, shape.kv_heads, shape.head_dim, shape.v_dim);
    let (qw, kw, vw) = (nh * hd, nkv * hd, nkv * vd);
    let width = qw + kw + vw;
    let vals = |n: usize, seed: u64| -> Vec<f32> {
        let mut rng = strata_testkit::Rng::new(seed);
        let v = (0..n).map(|_| 2.0 * rng.uniform());
        v.map(|x| if bf16 { half::bf16::from_f32(x).to_f32() } else { x }).collect()
    };
    let sinks = with_sinks.then(|| vals(nh, 9).iter().map(|v| 1.5 * v).collect::<Vec<f32>>());
    let (sinks_b, sinks_r) = (sinks.clone().map(|s| b.vector(s)), sinks.map(|s| r.vector(s)));
    let mut fill = PackedBatch::new();
    for (i, &n) in caches.iter().enumerate() {
        fill.push_segment(&vec![1u32; n], Segment { key: i as u64 + 1, pos0: 0, keep: true });
    }
    // Step 2: a 9-token prefill between the decode rows (segment 3).
    let mut step = PackedBatch::new();
    for (i, &n) in caches.iter().enumerate() {
        if i == 3 {
            step.push_segment(&[1u32; 9], Segment { key: 0, pos0: 0, keep: false });
        }
        step.push_segment(&[1u32], Segment { key: i as u64 + 1, pos0: n, keep: false });
    }
    let (mut cache_b, mut cache_r) = (Default::default(), KvCache::default());
    let mut worst = 0f32;
    let narrow = AttnShape { mask: Mask::Sliding(16), ..shape };
    for (k, (batch, shape)) in [(&fill, narrow), (&step, shape)].into_iter().enumerate() {
        let t = batch.num_tokens();
        let qkv = vals(t * width, 20 + k as u64);
        let tb = Tensor::<Emu<C>, usize>::from_host(&b, &qkv, t, width).unwrap();
        let tr = Tensor::<Reference, usize>::from_host(&r, &qkv, t, width).unwrap();
        let (mut ob, mut or) = (Tensor::zeros(&b, t, nh * vd), Tensor::zeros(&r, t, nh * vd));
        KvStore::begin(&mut cache_b, batch).unwrap();
        cache_r.begin(batch).unwrap();
        let before =
            ["attention_split_f32", "attention_split_bf16", "attention_split_combine"].map(|n| b.device().count(n));
        let cols = Qkv { q: tb.cols(0, qw), k: tb.cols(qw, kw), v: tb.cols(qw + kw, vw) };
        b.attention(cols, shape, sinks_b.as_ref(), batch, LayerState::new(&mut cache_b, 0), &mut ob);
        b.end_step().unwrap();
        let cols = Qkv { q: tr.cols(0, qw), k: tr.cols(qw, kw), v: tr.cols(qw + kw, vw) };
        r.attention(cols, shape, sinks_r.as_ref(), batch, LayerState::new(&mut cache_r, 0), &mut or);
        let (got, want) = (ob.to_host(&b), or.to_host(&r));
        let after =
            ["attention_split_f32", "attention_split_bf16", "attention_split_combine"].map(|n| b.device().count(n));
        let launched: Vec<usize> = after.iter().zip(before).map(|(a, b)| a - b).collect();
        let plan = SplitPlan::new(batch, shape.mask);
        if k == 0 {
            assert!(plan.is_empty() && launched == [0, 0, 0], "the prefill step split: {launched:?}");
        } else {
            // Decode rows of 256 keys and more (caches from 255) split: 2, 3
            // and 3 splits of 128 (the prefill, segment 3, not), then 8 and 24
            // under the causal mask; the sliding window's 700 keys, 6.
            let splits: Vec<usize> = (0..batch.num_samples()).map(|s| plan.splits(s)).collect();
            let want_splits: &[usize] = match shape.mask {
                Mask::Sliding(700) => &[0, 2, 3, 0, 3, 6, 6],
                _ => &[0, 2, 3, 0, 3, 8, 24],
            };
            assert_eq!(splits, want_splits, "{:?}: the plan", shape.mask);
            let kernel = usize::from(bf16);
            assert_eq!(launched[kernel], 1, "{:?}: the split kernel was not launched", shape.mask);
            assert_eq!((launched[1 - kernel], launched[2]), (0, 1), "{:?}: split launches", shape.mask);
        }
        let split_rows: Vec<usize> = plan.rows.iter().map(|r| r[0] as usize).collect();
        for row in 0..t {
            let (g, w) = (&got[row * nh * vd..][..nh * vd], &want[row * nh * vd..][..nh * vd]);
            let split = split_rows.contains(&row);
            let tol = if bf16 && !split { 2e-2 } else { 1e-5 };
            for (c, (g, w)) in g.iter().zip(w).enumerate() {
                let e = (g - w).abs() / w.abs().max(1.0);
                assert!(e <= tol, "{:?} step {k} row {row} (split: {split}) [{c}]: got {g}, want {w}", shape.mask);
                if split {
                    worst = worst.max(e);
                }
            }
        }
    }
    worst
}

#[test]
fn decode_rows_over_long_caches_take_the_split_kernels() {
    if !gxx_or_skip("decode_rows_over_long_caches_take_the_split_kernels") {
        return;
    }
    // GQA: 8 query heads on 2 kv heads, at head dim 64.
    let gqa = AttnShape { heads: 8, kv_heads: 2, head_dim: 64, v_dim: 64, mask: Mask::Causal, scale: 0.125 };
    let window = AttnShape { mask: Mask::Sliding(700), ..gqa };
    for (shape, sinks) in [(gqa, false), (gqa, true), (window, true)] {
        let worst = split_decode_through_the_backend::<F32>(shape, sinks);
        println!("f32 compute, {:?}, sinks {sinks}: split rows' worst {worst:.2e}", shape.mask);
        let worst = split_decode_through_the_backend::<Bf16>(shape, sinks);
        println!("bf16 compute, {:?}, sinks {sinks}: split rows' worst {worst:.2e}", shape.mask);
    }
}

/// MoE rows are grouped by expert on the device (`moe_group`), in the order
/// the host's counting sort gave them: each expert's rows hold its tokens in
/// order, every entry's slot names its row. 3 experts of 64 get every entry
/// of 700 (more than one per thread), the rest none; an expert index out of
/// range shows in the last start, which the backend checks.
#[test]
fn moe_rows_are_grouped_on_the_device_as_the_host_grouped_them() {
    if !gxx_or_skip("moe_rows_are_grouped_on_the_device_as_the_host_grouped_them") {
        return;
    }
    use strata::backend::cuda::device::{Device, Launch};
    use strata::backend::cuda::kernels as launch;
    let dev = Emulated::default();
    let (top_k, experts) = (2usize, 64usize);
    let mut rng = strata_testkit::Rng::new(9);
    let mut ids: Vec<u32> = (0..700).map(|_| [3u32, 17, 63][(rng.uniform().abs() * 3.0) as usize % 3]).collect();
    let group = |ids: &[u32]| {
        let n = ids.len();
        let idm = dev.alloc(n * 4).unwrap();
        dev.upload(dev.ptr(&idm), bytemuck::cast_slice(ids)).unwrap();
        let out = dev.alloc((experts + 1 + 2 * n) * 4).unwrap();
        let p = dev.ptr(&out);
        let (starts, src, slot) = (p, p + ((experts + 1) * 4) as u64, p + ((experts + 1 + n) * 4) as u64);
        let cfg = Launch { grid: (experts as u32, 1), block: 256, smem: 0 };
        launch::moe_group(&dev, cfg, dev.ptr(&idm), n as i32, top_k as i32, experts as i32, starts, src, slot).unwrap();
        let mut host = vec![0u32; experts + 1 + 2 * n];
        dev.download(p, bytemuck::cast_slice_mut(&mut host)).unwrap();
        let (starts, rest) = host.split_at(experts + 1);
        let (src, slot) = rest.split_at(n);
        (starts.to_vec(), src.to_vec(), slot.to_vec())
    };
    let (starts, src, slot) = group(&ids);
    // The host's counting sort, as the backend did it before.
    let mut want_starts = vec![0u32; experts + 1];
    for &e in &ids {
        want_starts[e as usize + 1] += 1;
    }
    for e in 0..experts {
        want_starts[e + 1] += want_starts[e];
    }
    let (mut next, mut want_src, mut want_slot) = (want_starts.clone(), vec![0u32; ids.len()], vec![0u32; ids.len()]);
    for (i, &e) in ids.iter().enumerate() {
        let row = next[e as usize];
        next[e as usize] += 1;
        want_src[row as usize] = (i / top_k) as u32;
        want_slot[i] = row;
    }
    assert_eq!(starts, want_starts, "expert starts");
    assert_eq!(src, want_src, "the tokens of the grouped rows");
    assert_eq!(slot, want_slot, "each entry's row");
    ids[123] = experts as u32; // out of range: in no expert's rows
    let (starts, _, _) = group(&ids);
    assert_eq!(starts[experts] as usize, ids.len() - 1, "the last start counts the entries in range");
}
