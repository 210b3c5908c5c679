//! Packing variable-length samples into one token stream with `cu_seqlens`.

/// Samples packed end to end: sample `i` is `token_ids[cu_seqlens[i]..cu_seqlens[i+1]]`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PackedBatch {
    token_ids: Vec<u32>,
    cu_seqlens: Vec<usize>,
}

impl PackedBatch {
    /// An empty batch.
    pub fn new() -> Self {
        PackedBatch { token_ids: Vec::new(), cu_seqlens: vec![0] }
    }

    /// Packs samples in order.
    pub fn from_samples<'a>(samples: impl IntoIterator<Item = &'a [u32]>) -> Self {
        let mut b = PackedBatch::new();
        for s in samples {
            b.push(s);
        }
        b
    }

    /// Appends one sample.
    pub fn push(&mut self, sample: &[u32]) {
        self.token_ids.extend_from_slice(sample);
        self.cu_seqlens.push(self.token_ids.len());
    }

    /// All tokens, packed.
    pub fn token_ids(&self) -> &[u32] {
        &self.token_ids
    }
    /// Sample boundaries, `num_samples + 1` entries starting at 0.
    pub fn cu_seqlens(&self) -> &[usize] {
        &self.cu_seqlens
    }
    /// Number of samples.
    pub fn num_samples(&self) -> usize {
        self.cu_seqlens.len() - 1
    }
    /// Total tokens.
    pub fn num_tokens(&self) -> usize {
        self.token_ids.len()
    }
    /// Token range of sample `i`.
    pub fn range(&self, i: usize) -> std::ops::Range<usize> {
        self.cu_seqlens[i]..self.cu_seqlens[i + 1]
    }
    /// Longest sample.
    pub fn max_len(&self) -> usize {
        self.cu_seqlens.windows(2).map(|w| w[1] - w[0]).max().unwrap_or(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges() {
        let b = PackedBatch::from_samples([&[1u32, 2, 3][..], &[4], &[5, 6]]);
        assert_eq!(b.cu_seqlens(), &[0, 3, 4, 6]);
        assert_eq!(b.range(1), 3..4);
        assert_eq!(b.max_len(), 3);
        assert_eq!(b.num_samples(), 3);
    }
}
