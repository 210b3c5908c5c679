//! Property tests: packing invariance of the forward, GEMM against a naive
//! reference, and slice/concat round trips of captured states.

use proptest::prelude::*;
use std::path::Path;
use std::sync::OnceLock;
use strata::backend::cpu::PackedLinear;
use strata::model::Llama;
use strata::pipeline::batch::PackedBatch;
use strata::pipeline::capture::{CapturePoint, CaptureSet};
use strata::shape::{CapturedStates, TokenAxis};

fn model() -> &'static Llama {
    static M: OnceLock<Llama> = OnceLock::new();
    M.get_or_init(|| Llama::load(&Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/mistral-swa")).unwrap())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(6))]

    /// On random small Llama configs (GQA ratios, widths), TP ranks give the
    /// states of the whole model up to the order of the all-reduced sums.
    #[test]
    fn tp_matches_single_rank_on_random_configs(
        kv in prop::sample::select(vec![1usize, 2, 4]),
        group in 1usize..3,
        head_dim in prop::sample::select(vec![4usize, 6, 8]),
        inter_per in 1usize..5,
        layers in 1usize..3,
        tp in prop::sample::select(vec![2usize, 4]),
        seed in any::<u64>(),
    ) {
        use strata::model::{Model, TpLlama};
        use strata_testkit::{write_llama, LlamaSpec};
        let heads = 4 * group; // divisible by every tp tried and by every kv
        let spec = LlamaSpec {
            hidden_size: heads * head_dim,
            num_layers: layers,
            num_heads: heads,
            num_kv_heads: kv,
            intermediate_size: 4 * inter_per * 4,
            vocab_size: 50,
        };
        prop_assume!(heads % kv == 0 && (kv % tp == 0 || tp % kv == 0));
        let dir = tempfile::tempdir().unwrap();
        write_llama(dir.path(), &spec, strata::shape::DType::F32, seed).unwrap();
        let mut rng = strata_testkit::Rng::new(seed ^ 1);
        let samples: Vec<Vec<u32>> = [5usize, 17, 1].iter().map(|&n| (0..n).map(|_| rng.below(50) as u32).collect()).collect();
        let batch = PackedBatch::from_samples(samples.iter().map(|s| s.as_slice()));
        let set = CaptureSet::<usize>::try_new(vec![CapturePoint::LayerInput(layers - 1), CapturePoint::FinalPostNorm]).unwrap();
        let whole = Llama::<usize>::load(dir.path()).unwrap().forward(&batch, &set).unwrap();
        let split = TpLlama::<usize, usize>::load(dir.path(), tp).unwrap().forward_step(&batch, &set, &mut Default::default()).unwrap();
        for (a, b) in split.as_slice().iter().zip(whole.as_slice()) {
            prop_assert!((a - b).abs() <= 2e-5 * b.abs().max(1.0), "tp {}: {} vs {}", tp, a, b);
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(24))]

    /// A sample's states do not depend on what it is packed with or where:
    /// bitwise equal to running it alone.
    #[test]
    fn packing_does_not_change_states(
        lens in prop::collection::vec(1usize..70, 1..6),
        seed in any::<u64>(),
    ) {
        let m = model();
        let vocab = m.config().vocab_size as u64;
        let mut rng = strata_testkit::Rng::new(seed);
        let samples: Vec<Vec<u32>> = lens.iter().map(|&n| (0..n).map(|_| rng.below(vocab) as u32).collect()).collect();
        let set = CaptureSet::<usize>::try_new(vec![CapturePoint::LayerInput(1), CapturePoint::FinalPostNorm]).unwrap();
        let batch = PackedBatch::from_samples(samples.iter().map(|s| s.as_slice()));
        let packed = m.forward(&batch, &set).unwrap();
        for (i, s) in samples.iter().enumerate() {
            let alone = m.forward(&PackedBatch::from_samples([s.as_slice()]), &set).unwrap();
            prop_assert_eq!(packed.slice_tokens(batch.range(i)).unwrap(), alone);
        }
    }

    /// Scheduling with any token budget (chunking samples across steps with
    /// the KV cache) and gathering gives each sample the states it gets alone, bitwise.
    #[test]
    fn chunked_prefill_matches_whole_samples(
        lens in prop::collection::vec(1usize..90, 1..5),
        budget in 1usize..80,
        seed in any::<u64>(),
    ) {
        use strata::pipeline::gather::Gatherer;
        use strata::backend::{KvStore, SeqState};
        use strata::pipeline::schedule::Scheduler;
        use strata::pipeline::source::Sample;
        let m = model();
        let vocab = m.config().vocab_size as u64;
        let mut rng = strata_testkit::Rng::new(seed);
        let samples: Vec<Sample> = lens
            .iter()
            .enumerate()
            .map(|(i, &n)| Sample {
                index: i,
                line: i + 1,
                id: i.to_string(),
                input_ids: (0..n).map(|_| rng.below(vocab) as u32).collect(),
                loss_mask: None,
                end: Default::default(),
                finish: vec![],
            })
            .collect();
        let set = CaptureSet::<usize>::try_new(vec![CapturePoint::LayerInput(2), CapturePoint::FinalPreNorm]).unwrap();
        let mut source = samples.clone().into_iter().map(Ok::<_, ()>);
        let mut scheduler = Scheduler::new(budget);
        let mut cache = SeqState::default();
        let mut gatherer = Gatherer::default();
        let mut got = Vec::new();
        while let Some(step) = scheduler.next_step(&mut source).unwrap() {
            prop_assert!(step.batch.num_tokens() <= budget);
            let states = m.forward_step(&step.batch, &set, &mut cache).unwrap();
            gatherer
                .gather(&step, &states, |s, v| -> Result<(), strata::shape::ShapeError> {
                    got.push((s.index, v.to_owned()));
                    Ok(())
                })
                .unwrap();
        }
        prop_assert!(cache.is_empty() && !gatherer.has_partial());
        prop_assert_eq!(got.len(), samples.len());
        for (s, (index, states)) in samples.iter().zip(got) {
            prop_assert_eq!(index, s.index);
            let alone = m.forward(&PackedBatch::from_samples([s.input_ids.as_slice()]), &set).unwrap();
            prop_assert_eq!(states, alone);
        }
    }

    /// Splitting captured states over TP ranks along hidden and gathering the
    /// rank replies back is the identity.
    #[test]
    fn tp_shard_then_gather_round_trip(l in 1usize..4, t in 0usize..9, per in 1usize..7, tp in 1usize..6, seed in any::<u64>()) {
        use strata::parallel::{PerRank, ShardedStates};
        let h = per * tp;
        let mut rng = strata_testkit::Rng::new(seed);
        let s = CapturedStates::<usize, usize>::try_from_vec((0..l * t * h).map(|_| rng.uniform()).collect(), l, t, h).unwrap();
        let parts: Vec<_> = (0..tp).map(|r| ShardedStates::split(&s, tp, r).unwrap()).collect();
        prop_assert!(parts.iter().all(|p| p.shape() == [l, t, per]));
        prop_assert_eq!(ShardedStates::gather(PerRank::from_vec(parts), h, tp).unwrap(), s);
        // A width that does not divide is an error, not a silent truncation.
        prop_assert!(ShardedStates::<usize, usize>::split(&CapturedStates::zeros(l, t, h + 1), h + 2, 0).is_err());
    }

    /// The packed GEMM agrees with a naive f64 product on any shape.
    #[test]
    fn gemm_matches_naive(m in 1usize..150, n in 1usize..100, k in 1usize..600, seed in any::<u64>()) {
        let mut rng = strata_testkit::Rng::new(seed);
        let x: Vec<f32> = (0..m * k).map(|_| rng.uniform()).collect();
        let w: Vec<f32> = (0..n * k).map(|_| rng.uniform()).collect();
        let mut y = vec![0f32; m * n];
        PackedLinear::new(&w, n, k, None).forward(&x, m, &mut y, false);
        for i in 0..m {
            for j in 0..n {
                let want: f64 = (0..k).map(|p| x[i * k + p] as f64 * w[j * k + p] as f64).sum();
                prop_assert!((y[i * n + j] as f64 - want).abs() <= 1e-5 * (k as f64).sqrt() * 4.0,
                    "({}, {}): {} vs {}", i, j, y[i * n + j], want);
            }
        }
    }

    /// A quantised weight (FP8 blocks or INT4 groups, any block offset, as a
    /// TP rank's slice has) gives bit for bit the product of its exact f32 dequantisation.
    #[test]
    fn quantized_gemm_is_the_dequantized_gemm(
        m in 1usize..200, n in 1usize..80, k in 1usize..1200, c0 in 0usize..300,
        int4 in any::<bool>(), block in prop::sample::select(vec![32usize, 128]), seed in any::<u64>(),
    ) {
        use strata::hf::quant::{LinearWeight, QuantKind, QuantRows};
        let mut rng = strata_testkit::Rng::new(seed);
        let kind = if int4 { QuantKind::Int4 } else { QuantKind::Fp8 };
        let seg = QuantRows::segments(c0, k, block);
        // Any INT4 value; any FP8 code but the two NaNs (0x7f, 0xff), subnormals included.
        let code = |c: u64| if int4 { (c & 0xf) as u8 } else if c & 0x7f == 0x7f { (c as u8) ^ 1 } else { c as u8 };
        let codes = (0..n * k).map(|_| code(rng.below(256))).collect();
        let scales = (0..n * (seg.len() - 1)).map(|_| rng.uniform() + 0.6).collect();
        let q = QuantRows { kind, rows: n, cols: k, codes, seg, scales };
        let x: Vec<f32> = (0..m * k).map(|_| rng.uniform()).collect();
        let (mut a, mut b) = (vec![0f32; m * n], vec![0f32; m * n]);
        PackedLinear::new(&q.dequantize(), n, k, None).forward(&x, m, &mut a, false);
        PackedLinear::from_weight(LinearWeight::Quant(q), None).forward(&x, m, &mut b, false);
        prop_assert!(a.iter().zip(&b).all(|(p, q)| p.to_bits() == q.to_bits()));
    }

    /// Cutting states at arbitrary token boundaries and joining them back is the identity.
    #[test]
    fn slice_concat_round_trip(l in 1usize..5, h in 1usize..20, cuts in prop::collection::vec(0usize..40, 0..6)) {
        let t = 40;
        let data: Vec<f32> = (0..l * t * h).map(|v| v as f32).collect();
        let s = CapturedStates::<usize, usize>::try_from_vec(data, l, t, h).unwrap();
        let mut bounds: Vec<usize> = cuts;
        bounds.push(0);
        bounds.push(t);
        bounds.sort_unstable();
        let parts: Vec<_> = bounds.windows(2).map(|w| s.slice_tokens(w[0]..w[1]).unwrap()).collect();
        prop_assert_eq!(CapturedStates::concat::<TokenAxis>(&parts).unwrap(), s);
    }
}
