//! Property tests: packing invariance of the forward, GEMM against a naive
//! reference, and slice/concat round trips of captured states.

use proptest::prelude::*;
use std::path::Path;
use std::sync::OnceLock;
use strata::batch::PackedBatch;
use strata::capture::{CapturePoint, CaptureSet};
use strata::cpu::PackedLinear;
use strata::model::Llama;
use strata::shape::{CapturedStates, TokenAxis};

fn model() -> &'static Llama {
    static M: OnceLock<Llama> = OnceLock::new();
    M.get_or_init(|| Llama::load(&Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/mistral-swa")).unwrap())
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
        let mut rng = strata::synth::Rng::new(seed);
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
        use strata::gather::Gatherer;
        use strata::model::KvCache;
        use strata::schedule::Scheduler;
        use strata::source::Sample;
        let m = model();
        let vocab = m.config().vocab_size as u64;
        let mut rng = strata::synth::Rng::new(seed);
        let samples: Vec<Sample> = lens
            .iter()
            .enumerate()
            .map(|(i, &n)| Sample {
                index: i,
                line: i + 1,
                id: i.to_string(),
                input_ids: (0..n).map(|_| rng.below(vocab) as u32).collect(),
                loss_mask: None,
            })
            .collect();
        let set = CaptureSet::<usize>::try_new(vec![CapturePoint::LayerInput(2), CapturePoint::FinalPreNorm]).unwrap();
        let mut source = samples.clone().into_iter().map(Ok::<_, ()>);
        let mut scheduler = Scheduler::new(budget);
        let mut cache = KvCache::default();
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

    /// The packed GEMM agrees with a naive f64 product on any shape.
    #[test]
    fn gemm_matches_naive(m in 1usize..150, n in 1usize..100, k in 1usize..600, seed in any::<u64>()) {
        let mut rng = strata::synth::Rng::new(seed);
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
