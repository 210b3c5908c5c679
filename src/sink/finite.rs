//! NaN and Inf at the file boundary: a sink wrapper that checks each
//! sample's states as they are written, in the stored dtype (an f32 value
//! past f16's range is Inf once stored), and fails or skips.

use super::{Sink, SinkError};
use crate::pipeline::source::{InputPos, Sample};
use crate::shape::{DType, Dim, StatesView};

/// What to do with a sample whose states hold NaN or Inf.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[cfg_attr(feature = "cli", derive(clap::ValueEnum))]
pub enum OnNonFinite {
    /// Stop the run, naming the sample and capture point (the default).
    #[cfg_attr(feature = "cli", value(help = "Stop with an error naming the sample and capture point"))]
    Fail,
    /// Leave the sample out, count it, and record its id in the manifest.
    #[cfg_attr(
        feature = "cli",
        value(help = "Leave the sample out, count it, and list it in the manifest's `skipped`")
    )]
    Skip,
}

impl OnNonFinite {
    /// The manifest's spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            OnNonFinite::Fail => "fail",
            OnNonFinite::Skip => "skip",
        }
    }
}

/// The smallest magnitude that is not finite once stored as `dtype`
/// (round to nearest even rounds it up to Inf).
fn overflow(dtype: DType) -> f32 {
    match dtype {
        // FP8 rows are scaled to fit: only what f32 cannot hold is out of range.
        DType::F32 | DType::F8E4M3 => f32::INFINITY,
        DType::BF16 => f32::from_bits(0x7f7f_8000),
        DType::F16 => 65520.0,
    }
}

/// The first capture point (index on the `L` axis) of `states` that holds
/// NaN, Inf or a value that is Inf once stored as `dtype`, with its NaN and
/// Inf counts; `None` when every value is finite.
pub fn nonfinite<L: Dim, H: Dim>(states: &StatesView<'_, L, H>, dtype: DType) -> Option<(usize, usize, usize)> {
    first_nonfinite(states, overflow(dtype))
}

fn first_nonfinite<L: Dim, H: Dim>(states: &StatesView<'_, L, H>, limit: f32) -> Option<(usize, usize, usize)> {
    // False for NaN, Inf and what rounds to Inf once stored.
    let fits = |x: &f32| x.abs() < limit;
    // Branch-free within a chunk so it vectorises.
    let bad = |xs: &[f32]| xs.chunks(256).any(|c| c.iter().fold(false, |a, x| a | !fits(x)));
    (0..states.shape()[0]).find(|&l| bad(states.layer(l))).map(|l| {
        let xs = states.layer(l);
        let nan = xs.iter().filter(|x| x.is_nan()).count();
        let inf = xs.iter().filter(|x| !x.is_nan() && !fits(x)).count();
        (l, nan, inf)
    })
}

/// Wraps a sink with the non-finite check.
pub struct FiniteCheck<K> {
    inner: K,
    policy: OnNonFinite,
    points: Vec<String>,
    limit: f32,
    skipped: usize,
}

impl<K> FiniteCheck<K> {
    /// `points` names the `L` axis for messages; `dtype` is the stored dtype.
    pub fn new(inner: K, policy: OnNonFinite, points: Vec<String>, dtype: DType) -> Self {
        FiniteCheck { inner, policy, points, limit: overflow(dtype), skipped: 0 }
    }

    /// Samples skipped so far.
    pub fn skipped(&self) -> usize {
        self.skipped
    }

    /// The wrapped sink.
    pub fn into_inner(self) -> K {
        self.inner
    }
}

impl<L: Dim, H: Dim, K: Sink<L, H>> Sink<L, H> for FiniteCheck<K> {
    fn write_sample(&mut self, sample: &Sample, states: StatesView<'_, L, H>) -> Result<(), SinkError> {
        let Some((l, nan, inf)) = first_nonfinite(&states, self.limit) else {
            return self.inner.write_sample(sample, states);
        };
        let point = self.points.get(l).cloned().unwrap_or_else(|| format!("#{l}"));
        match self.policy {
            OnNonFinite::Fail => Err(SinkError::NonFinite {
                id: crate::clip(&sample.id, 80).into_owned(),
                line: sample.line,
                point,
                nan,
                inf,
            }),
            OnNonFinite::Skip => {
                tracing::warn!(
                    "sample {} (line {}) skipped: {point} holds {nan} NaN and {inf} Inf values",
                    crate::clip(&sample.id, 80),
                    sample.line
                );
                self.skipped += 1;
                self.inner.skip_sample(sample, format!("{point}: {nan} NaN, {inf} Inf"))
            }
        }
    }

    fn skip_sample(&mut self, sample: &Sample, reason: String) -> Result<(), SinkError> {
        self.inner.skip_sample(sample, reason)
    }

    fn finish(&mut self, input: InputPos) -> Result<(), SinkError> {
        self.inner.finish(input)
    }

    fn resume_from(&self) -> usize {
        self.inner.resume_from()
    }

    fn bytes_written(&self) -> u64 {
        self.inner.bytes_written()
    }
}
