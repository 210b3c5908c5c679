//! Gated DeltaNet at real head sizes (k_dim = v_dim = 128), op by op: the
//! CPU backend's chunked delta rule against the reference backend's
//! token-by-token recurrence in f64, on sequences that end before, at and
//! after chunk edges; and the same sequences cut into steps anywhere give the
//! whole sequence's bits. With `--features cuda`, the CUDA kernels too, run
//! on the CPU through the emulator (`tests/cuda_emu`): not verified on a GPU.

use crate::common;
#[cfg(feature = "cuda")]
use crate::cuda_emu;

use common::max_err;
use strata::backend::prelude::*;
use strata::backend::{Bf16, Cpu, DeltaGates, DeltaRule, DeltaShape, LayerState, Reference, Tensor, F32};
use strata::pipeline::batch::{PackedBatch, Segment};

/// Two value heads over one key head, 128 wide each: the recurrent state of a layer is 2 × 128 × 128.
const SHAPE: DeltaShape = DeltaShape { k_heads: 1, v_heads: 2, k_dim: 128, v_dim: 128, conv_kernel: 4 };

/// A layer's inputs: `[T, C]` before the conv, `[T, v_heads·v_dim]` z, `[T, 2·v_heads]` [b | a],
/// and the weights (conv `[C, K]`, A_log, dt_bias, norm), from a fixed pseudo-random sequence.
struct Inputs {
    t: usize,
    x: Vec<f32>,
    z: Vec<f32>,
    ba: Vec<f32>,
    conv: Vec<f32>,
    a_log: Vec<f32>,
    dt_bias: Vec<f32>,
    norm: Vec<f32>,
}

fn noise(n: usize, seed: u64, scale: f32) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            // Sum of four uniforms: roughly normal, mean 0, variance 1/3.
            let u: f32 = (0..4).map(|k| ((s >> (16 * k)) & 0xffff) as f32 / 65535.0 - 0.5).sum();
            u * scale * 1.7
        })
        .collect()
}

impl Inputs {
    fn new(t: usize, seed: u64) -> Self {
        let (c, nv) = (SHAPE.channels(), SHAPE.v_heads);
        Inputs {
            t,
            x: noise(t * c, 10 * seed + 1, 1.0),
            z: noise(t * nv * SHAPE.v_dim, 10 * seed + 2, 1.0),
            ba: noise(t * 2 * nv, 10 * seed + 3, 1.0),
            conv: noise(c * SHAPE.conv_kernel, 4, 0.5),
            // Decays of e^-0.001 .. e^-0.1 per token: state reaches across chunks.
            a_log: vec![0.02f32.ln(), 0.3f32.ln()],
            dt_bias: vec![-2.0, -1.0],
            norm: noise(SHAPE.v_dim, 5, 0.3).iter().map(|w| 1.0 + w).collect(),
        }
    }

    /// The layer's output `[T, v_heads·v_dim]` on backend `b` over `batch` (whose tokens are rows `rows` of the inputs).
    fn run<B: Backend>(
        &self,
        b: &B,
        batch: &PackedBatch,
        rows: std::ops::Range<usize>,
        state: &mut B::DeltaState,
    ) -> Vec<f32> {
        let (c, nv, vd) = (SHAPE.channels(), SHAPE.v_heads, SHAPE.v_dim);
        let t = rows.len();
        let x = Tensor::<B>::from_host(b, &self.x[rows.start * c..rows.end * c], t, c).unwrap();
        let z = Tensor::<B>::from_host(b, &self.z[rows.start * nv * vd..rows.end * nv * vd], t, nv * vd).unwrap();
        let ba = Tensor::<B>::from_host(b, &self.ba[rows.start * 2 * nv..rows.end * 2 * nv], t, 2 * nv).unwrap();
        let (conv, a_log, dt_bias, norm) = (
            b.vector(self.conv.clone()),
            b.vector(self.a_log.clone()),
            b.vector(self.dt_bias.clone()),
            b.vector(self.norm.clone()),
        );
        let mut mixed = Tensor::<B>::zeros(b, t, c);
        let mut out = Tensor::<B>::zeros(b, t, nv * vd);
        state.begin(batch).unwrap();
        b.causal_conv1d(x.all(), &conv, SHAPE, batch, LayerState::new(state, 0), &mut mixed);
        let rule = DeltaRule { shape: SHAPE, a_log: &a_log, dt_bias: &dt_bias, norm: &norm, eps: 1e-6 };
        let gates = DeltaGates { z: z.all(), ba: ba.all() };
        b.gated_delta_rule(&mixed, gates, &rule, batch, LayerState::new(state, 0), &mut out);
        state.retire(batch);
        b.end_step().unwrap();
        out.to_host(b)
    }

    /// The whole sequence as one step.
    fn whole<B: Backend>(&self, b: &B) -> Vec<f32> {
        let mut batch = PackedBatch::new();
        batch.push_segment(&vec![0; self.t], Segment { key: 7, pos0: 0, keep: false });
        self.run(b, &batch, 0..self.t, &mut B::DeltaState::default())
    }

    /// The sequence in steps ending at each of `cuts`, its state carried between them.
    fn in_steps<B: Backend>(&self, b: &B, cuts: &[usize]) -> Vec<f32> {
        let mut state = B::DeltaState::default();
        let mut out = Vec::new();
        let mut start = 0;
        for &end in cuts.iter().chain([&self.t]) {
            let mut batch = PackedBatch::new();
            let seg = Segment { key: 7, pos0: start, keep: end < self.t };
            batch.push_segment(&vec![0; end - start], seg);
            out.extend(self.run(b, &batch, start..end, &mut state));
            start = end;
        }
        assert!(state.is_empty(), "the last step retires the sample");
        out
    }
}

#[test]
fn chunked_delta_rule_agrees_with_the_f64_recurrence() {
    for t in [1, 63, 64, 65, 1000] {
        let inputs = Inputs::new(t, 0);
        let want = inputs.whole(&Reference);
        let got = inputs.whole(&Cpu::<F32>::default());
        let err = max_err(&got, &want);
        println!("T = {t}: cpu chunked f32 vs reference recurrent f64: {err:.2e}");
        assert!(err <= 1e-4, "T = {t}: chunked f32 differs from the recurrence by {err:e}");
        // bf16 compute keeps the recurrence in f32: the same bits.
        assert_eq!(inputs.whole(&Cpu::<Bf16>::default()), got, "T = {t}: bf16 compute changed the recurrence");
    }
}

#[test]
fn steps_cut_anywhere_give_the_whole_sequences_bits() {
    let inputs = Inputs::new(300, 0);
    let cpu = Cpu::<F32>::default();
    let whole = inputs.whole(&cpu);
    // Cuts inside chunks, at their edges, one token from them, and a step within one chunk.
    for cuts in [&[1usize, 63, 64, 65, 130][..], &[7, 14, 21, 200], &[64, 128, 192, 256], &[100, 101, 299]] {
        assert!(inputs.in_steps(&cpu, cuts) == whole, "cpu: steps ending at {cuts:?} change the bits");
    }
    // The reference backend's recurrence carries its state as well.
    let reference = inputs.whole(&Reference);
    let err = max_err(&inputs.in_steps(&Reference, &[1, 63, 64, 65, 130]), &reference);
    assert!(err <= 1e-6, "reference in steps: {err:e}");
}

#[test]
fn packed_samples_do_not_share_state() {
    // Two samples in one step: each equals itself alone.
    let (a, b) = (Inputs::new(70, 1), Inputs::new(70, 2));
    let cpu = Cpu::<F32>::default();
    let alone = a.whole(&cpu);
    let mut joined = Inputs::new(140, 1);
    joined.x = [a.x.clone(), b.x.clone()].concat();
    joined.z = [a.z.clone(), b.z.clone()].concat();
    joined.ba = [a.ba.clone(), b.ba.clone()].concat();
    let mut batch = PackedBatch::new();
    batch.push_segment(&[0; 70], Segment { key: 1, pos0: 0, keep: false });
    batch.push_segment(&[0; 70], Segment { key: 2, pos0: 0, keep: false });
    let both = joined.run(&cpu, &batch, 0..140, &mut Default::default());
    let w = SHAPE.v_heads * SHAPE.v_dim;
    assert!(both[..70 * w] == alone[..], "the first sample changed when packed");
    assert!(both[70 * w..] == b.whole(&cpu)[..], "the second sample changed when packed");
}

#[test]
fn the_run_summary_counts_the_sequence_state() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("out");
    let name = "qwen3-next";
    let (fx, data) = (common::fixture(name), common::fixture(name).join("data.jsonl"));
    let (ok, stdout, err) = common::strata(&[
        "extract".as_ref(),
        "--model".as_ref(),
        fx.as_os_str(),
        "--data".as_ref(),
        data.as_os_str(),
        "--out".as_ref(),
        out.as_os_str(),
    ]);
    assert!(ok, "{err}");
    // 4 DeltaNet layers × (4 × 64 × 32 recurrent + 3 × 384 conv + 64 × (384 + 8) rows) × 4 bytes = 0.53 MiB.
    let text = format!("{stdout}{err}");
    assert!(text.contains("state       0.53 MiB per sample split across steps"), "{text}");
}

/// The CUDA conv1d and chunked delta-rule kernels through the CUDA backend on
/// the emulated device (no GPU), at d = 128 with 2 value heads and 130
/// tokens: against the f64 recurrence, and cut into steps (the state and the
/// unfinished chunk's rows kept on the device) with the whole sequence's bits.
#[cfg(feature = "cuda")]
#[test]
fn the_cuda_kernels_agree_with_the_recurrence_in_the_emulator() {
    use strata::backend::cuda::Cuda;
    if !cuda_emu::gxx_or_skip("the_cuda_kernels_agree_with_the_recurrence_in_the_emulator") {
        return;
    }
    let gpu = Cuda::<F32, cuda_emu::Emulated>::new(cuda_emu::Emulated::default(), vec![0]);
    let inputs = Inputs::new(130, 0);
    let want = inputs.whole(&Reference);
    let got = inputs.whole(&gpu);
    let err = max_err(&got, &want);
    println!("cuda (emulated) chunked vs reference recurrent f64, 130 tokens: {err:.2e}");
    assert!(err <= 1e-4, "cuda chunked differs from the recurrence by {err:e}");
    for cuts in [&[1usize, 63, 64, 65, 100][..], &[7, 129]] {
        assert!(inputs.in_steps(&gpu, cuts) == got, "cuda: steps ending at {cuts:?} change the bits");
    }
}
