//! The LM head's output: the logits of the rows a step samples, on the
//! host in f32. One rank computes a block of vocabulary columns
//! ([`LogitShard`]); the sampler sees them gathered over the ranks
//! ([`Logits`], the whole vocabulary), as vLLM's `colwise_gather_output` head does.

use crate::parallel::PerRank;
use crate::shape::ShapeError;
use std::ops::Range;

/// Logits `[S, V]` of `S` sampled rows over the whole vocabulary `V`, row-major.
#[derive(Clone, Debug, PartialEq)]
pub struct Logits {
    rows: usize,
    vocab: usize,
    /// `[S, V]`.
    values: Vec<f32>,
}

impl Logits {
    /// `values` as `[rows, vocab]`, checking their count.
    pub fn new(rows: usize, vocab: usize, values: Vec<f32>) -> Result<Self, ShapeError> {
        if values.len() != rows * vocab {
            return Err(ShapeError::new("logits", "elements", rows * vocab, values.len()));
        }
        Ok(Logits { rows, vocab, values })
    }

    /// Sampled rows.
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Vocabulary size.
    pub fn vocab(&self) -> usize {
        self.vocab
    }

    /// Row `i`'s logits `[V]`.
    pub fn row(&self, i: usize) -> &[f32] {
        &self.values[i * self.vocab..(i + 1) * self.vocab]
    }

    /// Every value, `[S, V]` row-major.
    pub fn as_slice(&self) -> &[f32] {
        &self.values
    }

    /// The whole vocabulary from each rank's block of it, in rank order:
    /// the blocks must tile `0..V` and agree on the rows.
    pub fn gather(shards: PerRank<LogitShard>) -> Result<Self, ShapeError> {
        let shards = shards.into_vec();
        let first = shards.first().ok_or_else(|| ShapeError::new("logits gather", "ranks", 1, 0))?;
        let (rows, vocab) = (first.rows, first.of);
        let mut next = 0;
        for s in &shards {
            if s.vocab.start != next || s.of != vocab {
                return Err(ShapeError::new("logits gather", "vocabulary block start", next, s.vocab.start));
            }
            if s.rows != rows {
                return Err(ShapeError::new("logits gather", "rows", rows, s.rows));
            }
            next = s.vocab.end;
        }
        if next != vocab {
            return Err(ShapeError::new("logits gather", "vocabulary", vocab, next));
        }
        let mut values = vec![0f32; rows * vocab];
        for s in &shards {
            let w = s.vocab.len();
            for (r, row) in values.chunks_exact_mut(vocab).enumerate() {
                row[s.vocab.clone()].copy_from_slice(&s.values[r * w..(r + 1) * w]);
            }
        }
        Ok(Logits { rows, vocab, values })
    }
}

/// One rank's logits: columns `vocab` of the whole `[S, of]`.
#[derive(Clone, Debug, PartialEq)]
pub struct LogitShard {
    rows: usize,
    vocab: Range<usize>,
    of: usize,
    /// `[S, vocab.len()]`.
    values: Vec<f32>,
}

impl LogitShard {
    /// `values` `[rows, vocab.len()]`, the columns `vocab` of an `of`-wide vocabulary.
    pub fn new(rows: usize, vocab: Range<usize>, of: usize, values: Vec<f32>) -> Result<Self, ShapeError> {
        if vocab.end > of || vocab.start > vocab.end {
            return Err(ShapeError::new("logit shard", "vocabulary", of, vocab.end));
        }
        if values.len() != rows * vocab.len() {
            return Err(ShapeError::new("logit shard", "elements", rows * vocab.len(), values.len()));
        }
        Ok(LogitShard { rows, vocab, of, values })
    }

    /// The whole vocabulary, from a rank that computes all of it (one rank).
    pub fn whole(self) -> Result<Logits, ShapeError> {
        Logits::gather(PerRank::from_vec(vec![self]))
    }

    /// The block of vocabulary rank `rank` of `ranks` computes: even blocks
    /// of `⌈V / ranks⌉`, the last one shorter.
    pub fn block(vocab: usize, rank: usize, ranks: usize) -> Range<usize> {
        let per = vocab.div_ceil(ranks.max(1));
        (rank * per).min(vocab)..((rank + 1) * per).min(vocab)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gather_tiles_the_vocabulary_in_rank_order() {
        let (rows, vocab) = (3, 11);
        let whole: Vec<f32> = (0..rows * vocab).map(|i| i as f32).collect();
        for ranks in 1..=4 {
            let shards = (0..ranks)
                .map(|r| {
                    let v = LogitShard::block(vocab, r, ranks);
                    let vals = (0..rows).flat_map(|i| whole[i * vocab..][v.clone()].to_vec()).collect();
                    LogitShard::new(rows, v, vocab, vals).unwrap()
                })
                .collect();
            let got = Logits::gather(PerRank::from_vec(shards)).unwrap();
            assert_eq!(got.as_slice(), &whole[..], "{ranks} ranks");
            assert_eq!(got.row(2), &whole[22..33]);
        }
    }

    #[test]
    fn gather_refuses_blocks_that_do_not_tile() {
        let s = |v: Range<usize>| LogitShard::new(1, v.clone(), 10, vec![0.0; v.len()]).unwrap();
        let e = Logits::gather(PerRank::from_vec(vec![s(5..10), s(0..5)])).unwrap_err().to_string();
        assert!(e.contains("vocabulary block start"), "{e}");
        let e = Logits::gather(PerRank::from_vec(vec![s(0..4)])).unwrap_err().to_string();
        assert!(e.contains("vocabulary"), "{e}");
        assert!(LogitShard::new(2, 0..3, 10, vec![0.0; 5]).is_err());
    }
}
