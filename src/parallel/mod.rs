//! Tensor parallelism's machinery, independent of any model: ranks as
//! threads driven by a typed RPC ([`executor`]), the collectives between them
//! ([`collective`]), and the shape arithmetic of splitting a width over `TP`
//! ranks (typenum, so a split that does not divide fails to compile).
//!
//! How a model is split is the model's own business (each linear layer's
//! [`crate::backend::Parallel`] kind); how a split model is driven is
//! [`crate::model::TpModel`].

pub mod barrier;
pub mod collective;
pub mod executor;

pub use barrier::{AbortableBarrier, Aborted};
pub use collective::{Collective, LocalGroup};
pub use executor::{Executor, PerRank, RpcError};

use crate::shape::{ConstDim, Dim, ShapeError};
use std::marker::PhantomData;
use std::ops::{Div, Rem};
use typenum::{NonZero, Quot, Unsigned, U0};

/// A tensor-parallel size: `usize` when chosen at run time, [`Tp<U>`] when typed.
pub trait TpSize: Copy + Send + Sync + std::fmt::Debug + 'static {
    /// Number of ranks.
    fn get(&self) -> usize;
}

impl TpSize for usize {
    fn get(&self) -> usize {
        *self
    }
}

/// A tensor-parallel size known at compile time (`Tp<U8>`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Tp<U: Unsigned + NonZero>(PhantomData<U>);

impl<U: Unsigned + NonZero + Copy + Send + Sync + std::fmt::Debug + Default + 'static> TpSize for Tp<U> {
    fn get(&self) -> usize {
        U::USIZE
    }
}

/// A hidden width as a typenum number, for type-level shard arithmetic
/// (`HiddenU<Prod<U7, U1024>>` is 7168). Const generics cannot divide on stable.
#[derive(Debug, Default, PartialEq, Eq, Hash)]
pub struct HiddenU<N: Unsigned>(PhantomData<N>);

impl<N: Unsigned> Clone for HiddenU<N> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<N: Unsigned> Copy for HiddenU<N> {}

impl<N: Unsigned + Default + Send + Sync + std::fmt::Debug + Eq + 'static> Dim for HiddenU<N> {
    fn size(&self) -> usize {
        N::USIZE
    }
    fn from_size(size: usize) -> Option<Self> {
        (size == N::USIZE).then_some(HiddenU(PhantomData))
    }
}

impl<N: Unsigned + Default + Send + Sync + std::fmt::Debug + Eq + 'static> ConstDim for HiddenU<N> {
    const SIZE: usize = N::USIZE;
}

/// The width one rank holds when a dim is split over `TP` ranks.
#[diagnostic::on_unimplemented(
    message = "`{Self}` does not split evenly over `{TP}` tensor-parallel ranks",
    label = "the hidden size must be a multiple of the TP size",
    note = "a split that does not divide leaves ranks with unequal shards; choose a TP size that divides it"
)]
pub trait ShardDim<TP: TpSize>: Dim {
    /// The shard's dim.
    type Shard: Dim;
    /// The shard's dim value; an error for run-time sizes that do not divide.
    fn shard(self, tp: TP) -> Result<Self::Shard, ShapeError>;
}

impl ShardDim<usize> for usize {
    type Shard = usize;
    fn shard(self, tp: usize) -> Result<usize, ShapeError> {
        if tp == 0 || !self.is_multiple_of(tp) {
            return Err(ShapeError::new(
                format!("hidden {self} split over {tp} ranks"),
                "hidden",
                self.next_multiple_of(tp.max(1)),
                self,
            ));
        }
        Ok(self / tp)
    }
}

impl<N, T> ShardDim<Tp<T>> for HiddenU<N>
where
    N: Unsigned + Default + Send + Sync + std::fmt::Debug + Eq + 'static + Div<T> + Rem<T, Output = U0>,
    T: Unsigned + NonZero + Copy + Send + Sync + std::fmt::Debug + Default + 'static,
    Quot<N, T>: Unsigned + Default + Send + Sync + std::fmt::Debug + Eq + 'static,
{
    type Shard = HiddenU<Quot<N, T>>;
    fn shard(self, _: Tp<T>) -> Result<Self::Shard, ShapeError> {
        Ok(HiddenU(PhantomData))
    }
}

/// One rank's slice of captured states along hidden: `[L, T, H/TP]`. A
/// different type from `CapturedStates<L, H>`: it cannot be written or
/// captured until [`gather`](ShardedStates::gather)ed from every rank.
#[derive(Clone, Debug, PartialEq)]
pub struct ShardedStates<L: Dim, HS: Dim> {
    layers: L,
    tokens: usize,
    shard: HS,
    data: Vec<f32>,
}

impl<L: Dim, HS: Dim> ShardedStates<L, HS> {
    /// Rank `rank`'s slice of `states` when its hidden dim is split over `tp` ranks.
    pub fn split<H: ShardDim<TP, Shard = HS>, TP: TpSize>(
        states: &crate::shape::CapturedStates<L, H>,
        tp: TP,
        rank: usize,
    ) -> Result<Self, ShapeError> {
        let shard = states.hidden().shard(tp)?;
        let (w, h) = (shard.size(), states.hidden().size());
        let mut data = Vec::with_capacity(states.as_slice().len() / tp.get());
        for row in states.as_slice().chunks_exact(h) {
            data.extend_from_slice(&row[rank * w..(rank + 1) * w]);
        }
        Ok(ShardedStates { layers: states.layers(), tokens: states.tokens(), shard, data })
    }

    /// `[L, T, H/TP]` as run-time sizes.
    pub fn shape(&self) -> [usize; 3] {
        [self.layers.size(), self.tokens, self.shard.size()]
    }

    /// Joins every rank's slice (rank order) into full `[L, T, H]` states.
    pub fn gather<H, TP>(
        parts: PerRank<Self>,
        hidden: H,
        tp: TP,
    ) -> Result<crate::shape::CapturedStates<L, H>, ShapeError>
    where
        H: ShardDim<TP, Shard = HS>,
        TP: TpSize,
    {
        if parts.len() != tp.get() {
            return Err(ShapeError::new("gather: replies", "ranks", tp.get(), parts.len()));
        }
        let shard = hidden.shard(tp)?;
        let first = parts.rank(0);
        let (l, t, w) = (first.layers, first.tokens, shard.size());
        for p in parts.iter() {
            crate::shape::check_dim("gather: rank shard", "hidden", shard, p.shard.size())?;
            crate::shape::check_dim("gather: rank shard", "tokens", t, p.tokens)?;
            crate::shape::check_dim("gather: rank shard", "layers", l, p.layers.size())?;
        }
        let mut data = Vec::with_capacity(l.size() * t * hidden.size());
        for row in 0..l.size() * t {
            for p in parts.iter() {
                data.extend_from_slice(&p.data[row * w..(row + 1) * w]);
            }
        }
        crate::shape::CapturedStates::try_from_vec(data, l, t, hidden)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::shape::{CapturedStates, Layers};
    use typenum::{Prod, U1024, U7, U8};

    #[test]
    fn typed_split_and_gather_round_trip() {
        type H = HiddenU<Prod<U7, U1024>>; // 7168
        let h = H::default();
        assert_eq!(h.size(), 7168);
        let data: Vec<f32> = (0..2 * 3 * 7168).map(|i| i as f32).collect();
        let s = CapturedStates::<Layers<2>, H>::try_from_vec(data, Layers, 3, h).unwrap();
        let tp = Tp::<U8>::default();
        let parts: Vec<_> = (0..8).map(|r| ShardedStates::split(&s, tp, r).unwrap()).collect();
        assert_eq!(parts[3].shape(), [2, 3, 896]);
        let back = ShardedStates::gather(PerRank::from_vec(parts), h, tp).unwrap();
        assert_eq!(back, s);
    }

    #[test]
    fn run_time_splits_are_checked() {
        let e = 7168usize.shard(3usize).unwrap_err();
        assert_eq!(e.axis, "hidden");
    }
}
