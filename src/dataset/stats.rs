//! Summary statistics of stored states: mean, std, min, max, NaN and Inf counts.

use crate::shape::DType;

/// Running statistics over f32 values (sums in f64).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Stats {
    /// Finite values seen.
    pub count: u64,
    sum: f64,
    sumsq: f64,
    /// Smallest finite value.
    pub min: f32,
    /// Largest finite value.
    pub max: f32,
    /// NaNs seen.
    pub nan: u64,
    /// ±Inf seen.
    pub inf: u64,
}

impl Default for Stats {
    fn default() -> Self {
        Stats { count: 0, sum: 0.0, sumsq: 0.0, min: f32::INFINITY, max: f32::NEG_INFINITY, nan: 0, inf: 0 }
    }
}

impl Stats {
    /// Adds values.
    pub fn add(&mut self, values: &[f32]) {
        for &v in values {
            if v.is_nan() {
                self.nan += 1;
            } else if v.is_infinite() {
                self.inf += 1;
            } else {
                self.count += 1;
                self.sum += v as f64;
                self.sumsq += (v as f64) * (v as f64);
                self.min = self.min.min(v);
                self.max = self.max.max(v);
            }
        }
    }

    /// Adds values stored as little-endian `dtype` bytes, decoding in blocks;
    /// a trailing partial value is ignored.
    pub fn add_bytes(&mut self, bytes: &[u8], dtype: DType, scratch: &mut Vec<f32>) {
        const BLOCK: usize = 1 << 14;
        let size = dtype.size();
        let bytes = &bytes[..bytes.len() - bytes.len() % size];
        for chunk in bytes.chunks(BLOCK * size) {
            scratch.resize(chunk.len() / size, 0.0);
            dtype.decode_into(chunk, scratch);
            self.add(scratch);
        }
    }

    /// Mean of the finite values.
    pub fn mean(&self) -> f64 {
        if self.count == 0 {
            f64::NAN
        } else {
            self.sum / self.count as f64
        }
    }

    /// Population standard deviation of the finite values.
    pub fn std(&self) -> f64 {
        if self.count == 0 {
            return f64::NAN;
        }
        let m = self.mean();
        (self.sumsq / self.count as f64 - m * m).max(0.0).sqrt()
    }
}

impl std::fmt::Display for Stats {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "mean {:>10.4} std {:>9.4} min {:>10.4} max {:>10.4} nan {} inf {}",
            self.mean(),
            self.std(),
            self.min,
            self.max,
            self.nan,
            self.inf
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_and_moments() {
        let mut s = Stats::default();
        s.add(&[1.0, 3.0, f32::NAN, f32::INFINITY, -f32::INFINITY]);
        assert_eq!((s.count, s.nan, s.inf, s.min, s.max), (2, 1, 2, 1.0, 3.0));
        assert_eq!((s.mean(), s.std()), (2.0, 1.0));
    }

    #[test]
    fn empty_and_partial_bytes() {
        let mut s = Stats::default();
        s.add_bytes(&[], DType::F32, &mut Vec::new());
        s.add_bytes(&[0, 0, 128, 63, 7], DType::F32, &mut Vec::new());
        assert_eq!((s.count, s.min, s.max), (1, 1.0, 1.0));
    }
}
