//! How a layer's weights split over tensor-parallel ranks: which block of
//! rows (column-parallel) or columns (row-parallel) this rank reads. A model
//! file names its splits (heads, kv heads, the MLP width) and asks each for
//! its block on the backend's rank; the arithmetic lives here once.

use crate::backend::Backend;
use std::ops::Range;

/// Why a layer's sizes do not split over the ranks asked for.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum SplitError {
    /// No ranks.
    #[error("--tp must be at least 1")]
    NoRanks,
    /// A size that must divide evenly and does not.
    #[error("--tp {ranks}: {what} {units} is not divisible by {ranks}; choose a TP size that divides it")]
    NotDivisible {
        /// The config field.
        what: &'static str,
        /// Its value.
        units: usize,
        /// The ranks asked for.
        ranks: usize,
    },
    /// A replicable size (kv heads) that neither divides the ranks nor is divided by them.
    #[error("--tp {ranks}: {what} {units} neither divides nor is divisible by {ranks}")]
    NeitherWay {
        /// The config field.
        what: &'static str,
        /// Its value.
        units: usize,
        /// The ranks asked for.
        ranks: usize,
    },
}

/// Checks that every one of `splits` divides over `ranks`, in order: the
/// one split check, run before any weight is read.
pub fn check(splits: &[Split], ranks: usize) -> Result<(), SplitError> {
    for split in splits {
        split.per_rank(ranks)?;
    }
    Ok(())
}

/// A dimension cut into `units` (heads, or single rows of an MLP width)
/// shared out over ranks in contiguous blocks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Split {
    /// The config field it comes from, for messages.
    what: &'static str,
    /// Units in the whole layer.
    units: usize,
    /// With fewer units than ranks, each unit is held by `ranks / units` ranks
    /// (GQA's kv heads) instead of the split being refused.
    replicable: bool,
}

impl Split {
    /// `units` that must divide evenly over the ranks (query heads, an MLP width).
    pub fn even(what: &'static str, units: usize) -> Self {
        Split { what, units, replicable: false }
    }

    /// `units` that divide over the ranks, or are each replicated on
    /// `ranks / units` of them (key/value heads).
    pub fn replicable(what: &'static str, units: usize) -> Self {
        Split { what, units, replicable: true }
    }

    /// Units each of `size` ranks holds; an error naming the field if the split does not fit.
    pub fn per_rank(&self, size: usize) -> Result<usize, SplitError> {
        let (units, what, ranks) = (self.units, self.what, size);
        if size == 0 {
            return Err(SplitError::NoRanks);
        }
        if units.is_multiple_of(size) {
            Ok(units / size)
        } else if !self.replicable {
            Err(SplitError::NotDivisible { what, units, ranks })
        } else if units > 0 && size.is_multiple_of(units) {
            Ok(1) // each unit replicated on size / units ranks
        } else {
            Err(SplitError::NeitherWay { what, units, ranks })
        }
    }

    /// The first unit rank `rank` of `size` holds.
    fn first(&self, rank: usize, size: usize) -> usize {
        if self.units.is_multiple_of(size) {
            rank * (self.units / size)
        } else {
            rank * self.units / size
        }
    }

    /// Rank `rank` of `size`'s rows (or columns) when each unit is `width` wide.
    ///
    /// # Panics
    /// If the split does not fit `size` ranks: [`per_rank`](Self::per_rank) is checked before loading.
    pub fn block_of(&self, rank: usize, size: usize, width: usize) -> Range<usize> {
        let per = self.per_rank(size).expect("the split was checked before any weight was read");
        let first = self.first(rank, size);
        first * width..(first + per) * width
    }

    /// This backend's rank's rows (or columns) when each unit is `width` wide.
    pub fn block<B: Backend>(&self, b: &B, width: usize) -> Range<usize> {
        self.block_of(b.rank(), b.world_size(), width)
    }

    /// Units in the whole layer.
    pub fn units(&self) -> usize {
        self.units
    }

    /// Units on this backend's rank.
    pub fn local<B: Backend>(&self, b: &B) -> usize {
        self.per_rank(b.world_size()).expect("the split was checked before any weight was read")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocks_and_messages() {
        let heads = Split::even("num_attention_heads", 14);
        assert_eq!(
            heads.per_rank(4).unwrap_err().to_string(),
            "--tp 4: num_attention_heads 14 is not divisible by 4; choose a TP size that divides it"
        );
        assert_eq!(heads.block_of(1, 2, 64), 7 * 64..14 * 64);
        // Two kv heads over four ranks: ranks 0, 1 hold head 0 and ranks 2, 3 head 1.
        let kv = Split::replicable("num_key_value_heads", 2);
        let blocks: Vec<_> = (0..4).map(|r| kv.block_of(r, 4, 8)).collect();
        assert_eq!(blocks, vec![0..8, 0..8, 8..16, 8..16]);
        assert_eq!(
            Split::replicable("num_key_value_heads", 3).per_rank(4).unwrap_err().to_string(),
            "--tp 4: num_key_value_heads 3 neither divides nor is divisible by 4"
        );
        assert_eq!(
            Split::even("intermediate_size", 96).per_rank(0).unwrap_err().to_string(),
            "--tp must be at least 1"
        );
    }
}
