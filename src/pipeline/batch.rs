//! Packing samples (or chunks of samples) into one token stream with `cu_seqlens`.
//!
//! A segment is a whole sample or one chunk of a long one (chunked prefill):
//! `pos0` is the position of its first token within its sample, and `keep`
//! says that later chunks follow, so its keys/values must be kept.

/// Where a segment sits in its sample.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Segment {
    /// Identifies the sample across steps (the key of its KV cache entry).
    pub key: u64,
    /// Position of the segment's first token within its sample.
    pub pos0: usize,
    /// More chunks of this sample follow in later steps.
    pub keep: bool,
}

impl Segment {
    /// Whether attention reads earlier positions from (or stores them into) a KV cache.
    pub fn uses_cache(&self) -> bool {
        self.pos0 > 0 || self.keep
    }
}

/// Segments packed end to end: segment `i` is `token_ids[cu_seqlens[i]..cu_seqlens[i+1]]`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PackedBatch {
    token_ids: Vec<u32>,
    cu_seqlens: Vec<usize>,
    segments: Vec<Segment>,
    /// `(key, positions)`: the most positions a sequence that starts in
    /// this step will hold, so its cache is allocated once (generation).
    reservations: Vec<(u64, usize)>,
    /// `(key, positions)`: cached samples cut back to their first
    /// `positions` before the step runs (0 drops the sample): a generation
    /// continuing the cache of an earlier one that shares only a prefix.
    rewinds: Vec<(u64, usize)>,
}

impl Default for PackedBatch {
    fn default() -> Self {
        Self::new()
    }
}

impl PackedBatch {
    /// An empty batch.
    pub fn new() -> Self {
        PackedBatch {
            token_ids: Vec::new(),
            cu_seqlens: vec![0],
            segments: Vec::new(),
            reservations: Vec::new(),
            rewinds: Vec::new(),
        }
    }

    /// Packs whole samples in order (keys 0, 1, ...).
    pub fn from_samples<'a>(samples: impl IntoIterator<Item = &'a [u32]>) -> Self {
        let mut b = PackedBatch::new();
        for s in samples {
            b.push(s);
        }
        b
    }

    /// Appends a whole sample.
    pub fn push(&mut self, sample: &[u32]) {
        let key = self.segments.len() as u64;
        self.push_segment(sample, Segment { key, pos0: 0, keep: false });
    }

    /// Appends a segment (a whole sample or a chunk of one).
    pub fn push_segment(&mut self, tokens: &[u32], segment: Segment) {
        self.token_ids.extend_from_slice(tokens);
        self.cu_seqlens.push(self.token_ids.len());
        self.segments.push(segment);
    }

    /// Says that sample `key`, which starts in this batch, will hold at most
    /// `positions` positions: a cache allocates them at once instead of
    /// growing (a generation's prompt and its longest output).
    pub fn reserve(&mut self, key: u64, positions: usize) {
        self.reservations.push((key, positions));
    }

    /// The reservations of the samples starting in this batch.
    pub fn reservations(&self) -> &[(u64, usize)] {
        &self.reservations
    }

    /// Says that cached sample `key` keeps only its first `positions`
    /// before this step runs; 0 drops it. A cache refuses to rewind what it
    /// cannot (a recurrent state, or past the positions it holds).
    pub fn rewind(&mut self, key: u64, positions: usize) {
        self.rewinds.push((key, positions));
    }

    /// The rewinds this batch applies before it runs.
    pub fn rewinds(&self) -> &[(u64, usize)] {
        &self.rewinds
    }

    /// Empties the batch, keeping its allocations.
    pub fn clear(&mut self) {
        self.token_ids.clear();
        self.cu_seqlens.truncate(1);
        self.segments.clear();
        self.reservations.clear();
        self.rewinds.clear();
    }

    /// All tokens, packed.
    pub fn token_ids(&self) -> &[u32] {
        &self.token_ids
    }
    /// Segment boundaries, `num_segments + 1` entries starting at 0.
    pub fn cu_seqlens(&self) -> &[usize] {
        &self.cu_seqlens
    }
    /// The segments.
    pub fn segments(&self) -> &[Segment] {
        &self.segments
    }
    /// Number of segments.
    pub fn num_samples(&self) -> usize {
        self.segments.len()
    }
    /// Total tokens.
    pub fn num_tokens(&self) -> usize {
        self.token_ids.len()
    }
    /// Rows of segment `i`.
    pub fn range(&self, i: usize) -> std::ops::Range<usize> {
        self.cu_seqlens[i]..self.cu_seqlens[i + 1]
    }
    /// One past the largest position any segment reaches.
    pub fn max_position(&self) -> usize {
        (0..self.segments.len()).map(|i| self.segments[i].pos0 + self.range(i).len()).max().unwrap_or(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_and_positions() {
        let mut b = PackedBatch::from_samples([&[1u32, 2, 3][..], &[4]]);
        b.push_segment(&[5, 6], Segment { key: 9, pos0: 10, keep: true });
        assert_eq!(b.cu_seqlens(), &[0, 3, 4, 6]);
        assert_eq!(b.range(1), 3..4);
        assert_eq!(b.max_position(), 12);
        assert!(b.segments()[2].uses_cache() && !b.segments()[0].uses_cache());
        b.clear();
        assert_eq!(b.num_tokens(), 0);
        assert_eq!(b.cu_seqlens(), &[0]);
    }
}
