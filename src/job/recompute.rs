//! `strata verify --recompute N`: runs N randomly chosen samples of a dataset
//! through the model again and compares the stored states with the fresh
//! ones, per capture point. It is the one check of the states themselves,
//! not just of their bytes: a dataset written from other weights, or with a
//! value changed after the fact, fails it.

use crate::backend::Compute;
use crate::dataset::{Dataset, DatasetError, MappedFile};
use crate::model::{Model, ModelError};
use crate::pipeline::batch::PackedBatch;
use crate::pipeline::capture::{CapturePoint, CaptureSet};
use crate::shape::{fp8, CapturedStates, DType};

/// Why a recomputation could not run (a failed comparison is not an error: see [`Recompute::passed`]).
#[derive(Debug, thiserror::Error)]
pub enum RecomputeError {
    /// The dataset cannot be read.
    #[error(transparent)]
    Dataset(#[from] DatasetError),
    /// The model cannot run.
    #[error(transparent)]
    Model(#[from] ModelError),
    /// The model does not have the dataset's layout.
    #[error("the model does not fit the dataset: {0}")]
    Layout(String),
    /// Nothing to compare.
    #[error("no samples to recompute: {0}")]
    Empty(&'static str),
    /// A sample that cannot be read back.
    #[error("sample {id:?}: {problem}")]
    Sample {
        /// The sample's id.
        id: String,
        /// What is wrong.
        problem: String,
    },
}

/// The largest differences at one capture point, between the stored states
/// and the fresh ones rounded to the stored dtype.
#[derive(Clone, Debug, PartialEq)]
pub struct PointDiff {
    /// The point, as in the manifest.
    pub point: String,
    /// Largest `|fresh − stored|`.
    pub max_abs: f32,
    /// Largest `|fresh − stored| / max(1, |stored|)`.
    pub max_rel: f32,
    /// Largest ratio of a difference to what [`Tolerance`] allows that value; above 1 fails.
    pub worst: f32,
}

impl PointDiff {
    /// Whether every value is within the tolerance.
    pub fn passed(&self) -> bool {
        self.worst <= 1.0
    }
    /// Whether every fresh value, rounded to the stored dtype, is the stored one.
    pub fn identical(&self) -> bool {
        self.max_abs == 0.0
    }
}

/// How far a fresh value (rounded to the stored dtype) may be from a stored
/// one `b` in a sound dataset: `storage · |b| + compute · max(1, |b|)`.
///
/// - `storage`: one unit in the last place of the stored dtype, relative
///   (2^-7 for bf16, 2^-10 for f16, 0 for f32): a fresh value a hair from a
///   rounding boundary may round to the neighbour of the stored one.
/// - `compute`: what the compute dtype and a different backend or TP size may
///   change: the parity tolerance, 1e-4, for f32 compute; 1e-1 when either
///   side computed in bf16, whose GEMM inputs carry 8 bits.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Tolerance {
    /// Relative to `|b|`.
    pub storage: f32,
    /// Relative to `max(1, |b|)`.
    pub compute: f32,
}

impl Tolerance {
    /// The tolerance of states stored in `stored` and recomputed in `compute`.
    pub fn new(stored: DType, compute: Compute) -> Self {
        let storage = if stored == DType::F32 { 0.0 } else { stored.ulp() };
        let compute = match compute {
            Compute::F32 => 1e-4,
            // bf16 inputs to every GEMM: 2^-8 per rounding, grown over the
            // layers and by the norms. Loose: it tells other weights or a
            // corrupted value from rounding, no more; recomputing in the
            // dataset's own compute and kernel gives the stored bytes.
            Compute::Bf16 => 1e-1,
        };
        Tolerance { storage, compute }
    }

    /// The largest difference allowed from a stored value `b`.
    pub fn allowed(&self, b: f32) -> f32 {
        self.storage * b.abs() + self.compute * b.abs().max(1.0)
    }

    /// The same, for a value of an FP8 row with scale `scale` (0 for other
    /// dtypes): one subnormal step, `2^-9 scale`, more, where the relative
    /// step does not hold.
    pub fn allowed_in_row(&self, b: f32, scale: f32) -> f32 {
        self.allowed(b) + scale / 512.0
    }
}

/// What a recomputation found.
#[derive(Clone, Debug, PartialEq)]
pub struct Recompute {
    /// Ids of the samples run again, in dataset order.
    pub samples: Vec<String>,
    /// Their tokens.
    pub tokens: usize,
    /// Per capture point, in the dataset's order.
    pub points: Vec<PointDiff>,
    /// What a difference is measured against.
    pub tolerance: Tolerance,
}

impl Recompute {
    /// Whether every point is within the tolerance.
    pub fn passed(&self) -> bool {
        self.points.iter().all(PointDiff::passed)
    }
}

/// `n` distinct indices below `total`, chosen by `seed`, ascending.
pub fn choose(total: usize, n: usize, seed: u64) -> Vec<usize> {
    let mut state = seed;
    let mut next = || {
        // splitmix64
        state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = state;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    };
    let mut all: Vec<usize> = (0..total).collect();
    let n = n.min(total);
    for i in 0..n {
        let j = i + (next() % (total - i) as u64) as usize; // partial Fisher-Yates
        all.swap(i, j);
    }
    let mut picked = all[..n].to_vec();
    picked.sort_unstable();
    picked
}

/// Runs `n` samples of `ds` chosen by `seed` through `model` (compute dtype
/// `compute`) and compares them with the stored states; `progress(done, n)`
/// after each sample.
pub fn recompute<M: Model<Hidden = usize>>(
    ds: &Dataset,
    model: &M,
    compute: Compute,
    n: usize,
    seed: u64,
    mut progress: impl FnMut(usize, usize),
) -> Result<Recompute, RecomputeError> {
    let _s = tracing::info_span!("recompute", dir = %ds.dir.display(), n, seed).entered();
    let m = &ds.manifest;
    let layout = |what: String| RecomputeError::Layout(what);
    if model.num_layers() != m.model.num_layers {
        return Err(layout(format!("{} layers, the dataset's model {}", model.num_layers(), m.model.num_layers)));
    }
    if model.hidden() != m.model.hidden_size {
        return Err(layout(format!("hidden size {}, the dataset's {}", model.hidden(), m.model.hidden_size)));
    }
    let points: Vec<CapturePoint> = m
        .capture
        .iter()
        .map(|c| c.point.parse().map_err(|e| layout(format!("capture point {:?}: {e}", c.point))))
        .collect::<Result<_, _>>()?;
    let set = CaptureSet::<usize>::try_new(points).map_err(|e| layout(e.to_string()))?;
    let dtype: DType = m.dtype.parse().map_err(|e: String| layout(e))?;
    let (l, h) = (m.capture.len(), m.model.hidden_size);
    let mut fresh = vec![0f32; h];
    let mut codes = Vec::with_capacity(h);
    if n == 0 {
        return Err(RecomputeError::Empty("asked for 0 samples"));
    }
    if m.samples.is_empty() {
        return Err(RecomputeError::Empty("the dataset holds none"));
    }
    let chosen = choose(m.samples.len(), n, seed);
    let tolerance = Tolerance::new(dtype, compute);
    let mut report = Recompute {
        samples: Vec::with_capacity(chosen.len()),
        tokens: 0,
        points: m
            .capture
            .iter()
            .map(|c| PointDiff { point: c.point.clone(), max_abs: 0.0, max_rel: 0.0, worst: 0.0 })
            .collect(),
        tolerance,
    };
    let mut shard: Option<(usize, MappedFile)> = None;
    for (done, &i) in chosen.iter().enumerate() {
        let info = &m.samples[i];
        let bad = |problem: String| RecomputeError::Sample { id: info.id.clone(), problem };
        if shard.as_ref().is_none_or(|(s, _)| *s != info.shard) {
            shard = Some((info.shard, ds.shard(info.shard)?));
        }
        let file = &shard.as_ref().expect("opened above").1;
        let stored = ds.sample(file, &info.id, info.tokens).map_err(bad)?;
        let ids: Vec<u32> = stored
            .input_ids
            .iter()
            .map(|&t| u32::try_from(t).map_err(|_| bad(format!("input id {t} is not a token id"))))
            .collect::<Result<_, _>>()?;
        let want = CapturedStates::<usize, usize>::try_from_bytes(
            "stored states",
            &stored.hidden,
            stored.dtype,
            &stored.shape,
            l,
            h,
        )
        .map_err(|e| bad(e.to_string()))?;
        let batch = PackedBatch::from_samples([ids.as_slice()]);
        let got = model.forward_step(&batch, &set, &mut M::Cache::default())?;
        for (slot, diff) in report.points.iter_mut().enumerate() {
            let rows = got.layer(slot).chunks_exact(h.max(1)).zip(want.layer(slot).chunks_exact(h.max(1)));
            for (a_row, b_row) in rows {
                // Compared as stored: identical bytes give exactly 0. FP8
                // rows are quantised with their own scale, as the sink does.
                let scale = match dtype {
                    DType::F8E4M3 => {
                        codes.clear();
                        let s = fp8::quantize_row(a_row, &mut codes);
                        fp8::dequantize_row(&codes, s, &mut fresh);
                        fp8::row_scale(b_row)
                    }
                    _ => {
                        fresh.iter_mut().zip(a_row).for_each(|(f, &a)| *f = dtype.round(a));
                        0.0
                    }
                };
                for (&a, &b) in fresh.iter().zip(b_row) {
                    let abs = (a - b).abs();
                    let rel = abs / b.abs().max(1.0);
                    let ratio = abs / tolerance.allowed_in_row(b, scale);
                    // A NaN or Inf on either side is a failure, not a skipped value.
                    let bad = !(abs.is_finite() && ratio.is_finite());
                    diff.max_abs = if bad { f32::INFINITY } else { diff.max_abs.max(abs) };
                    diff.max_rel = if bad { f32::INFINITY } else { diff.max_rel.max(rel) };
                    diff.worst = if bad { f32::INFINITY } else { diff.worst.max(ratio) };
                }
            }
        }
        report.samples.push(info.id.clone());
        report.tokens += ids.len();
        progress(done + 1, chosen.len());
    }
    Ok(report)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn choice_is_distinct_sorted_and_seeded() {
        let a = choose(100, 10, 7);
        assert_eq!(a.len(), 10);
        assert!(a.windows(2).all(|w| w[0] < w[1]));
        assert_eq!(a, choose(100, 10, 7));
        assert_ne!(a, choose(100, 10, 8));
        assert_eq!(choose(5, 50, 1), vec![0, 1, 2, 3, 4]);
        assert!(choose(0, 3, 1).is_empty());
    }

    #[test]
    fn tolerance_follows_the_stored_value() {
        let f = Tolerance::new(DType::F32, Compute::F32);
        assert_eq!(f.allowed(0.001), 1e-4);
        assert!((f.allowed(1000.0) - 0.1).abs() < 1e-6);
        let b = Tolerance::new(DType::BF16, Compute::F32);
        // Small values get little beyond the compute part: a sign flip of 0.01 is seen.
        assert!(b.allowed(0.01) < 2.0 * 0.01);
        // One bf16 ulp of a large value is allowed; two are not.
        let v = 300.0f32;
        assert!(v * 2f32.powi(-7) <= b.allowed(v) && 2.0 * v * 2f32.powi(-7) > b.allowed(v));
        assert!(Tolerance::new(DType::F16, Compute::F32).allowed(5.0) < b.allowed(5.0));
    }
}
