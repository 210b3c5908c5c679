//! Tensor parallelism applied from outside the model (gpt-fast's `tp.py`):
//! a model run as `TP` ranks, each a thread holding its backend, its weight
//! shard and its KV cache, driven through the typed RPC of [`Executor`].
//! Every decoder gets the same driver; how each layer splits is its own
//! [`crate::backend::Parallel`] kind.

use super::decoder::{read_config_text, Block, Decoder, RankStep};
use super::{Logits, Model, ModelError, PendingStates, Sampled};
use crate::backend::{Backend, SeqState};
use crate::hf::checkpoint::{Checkpoint, CheckpointError};
use crate::parallel::{Executor, PerRank, RpcError, ShardDim, ShardedStates, TpSize};
use crate::pipeline::batch::PackedBatch;
use crate::pipeline::capture::CaptureSet;
use crate::shape::{dim_from_size, CapturedStates, DType, Dim};
use std::path::Path;
use std::sync::{Arc, Mutex};

/// A model that runs as one rank of a tensor-parallel group.
pub trait RankModel: Model + Send + 'static {
    /// Runs a step; every rank must call it in step (the all-reduces need all
    /// of them); only a capturing rank fills and returns the states, and
    /// every rank returns its block of the logits of rows `sample`.
    fn step_rank<L: Dim>(
        &self,
        batch: &PackedBatch,
        captures: &CaptureSet<L>,
        cache: &mut Self::Cache,
        capture: bool,
        sample: Option<&[usize]>,
    ) -> Result<RankStep<L, Self::Hidden>, ModelError>;

    /// Stops the group's collectives after this rank panicked (see [`DeviceOps::abort_group`](crate::backend::DeviceOps::abort_group)).
    fn abort_group(&self, why: &str);
}

impl<B: Backend, L: Block<B>, H: Dim> RankModel for Decoder<B, L, H> {
    fn step_rank<LD: Dim>(
        &self,
        batch: &PackedBatch,
        captures: &CaptureSet<LD>,
        cache: &mut SeqState<B>,
        capture: bool,
        sample: Option<&[usize]>,
    ) -> Result<RankStep<LD, H>, ModelError> {
        Decoder::step_rank(self, batch, captures, cache, capture, sample)
    }

    fn abort_group(&self, why: &str) {
        self.backend().abort_group(why);
    }
}

/// One rank: its weight shard and the KV cache of its heads.
pub struct RankWorker<M: RankModel> {
    rank: usize,
    model: M,
    cache: M::Cache,
}

impl<M: RankModel> RankWorker<M> {
    /// This rank's index.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Runs a step; this rank fills and returns the captured states (whole `[L, T, H]`).
    pub fn capture<L: Dim>(
        &mut self,
        batch: &PackedBatch,
        captures: &CaptureSet<L>,
    ) -> Result<CapturedStates<L, M::Hidden>, ModelError> {
        self.capture_pending(batch, captures)?.wait()
    }

    /// [`capture`](Self::capture), with the device's last copies left pending.
    pub fn capture_pending<L: Dim>(
        &mut self,
        batch: &PackedBatch,
        captures: &CaptureSet<L>,
    ) -> Result<PendingStates<L, M::Hidden>, ModelError> {
        Ok(self.step(batch, captures, true, None)?.states.expect("capturing rank"))
    }

    /// Runs a step as a non-capturing rank (its part of the all-reduces only).
    pub fn run<L: Dim>(&mut self, batch: &PackedBatch, captures: &CaptureSet<L>) -> Result<(), ModelError> {
        self.step(batch, captures, false, None).map(drop)
    }

    /// Runs a step: the states if `capture`, and in a generation step
    /// (`sample` is `Some(rows)`) this rank's block of the logits of `rows`.
    pub fn step<L: Dim>(
        &mut self,
        batch: &PackedBatch,
        captures: &CaptureSet<L>,
        capture: bool,
        sample: Option<&[usize]>,
    ) -> Result<RankStep<L, M::Hidden>, ModelError> {
        self.model.step_rank(batch, captures, &mut self.cache, capture, sample)
    }
}

/// A model split over `tp` ranks; `TP` the TP size's type (`usize`, or
/// `Tp<U8>` for a split checked at compile time).
pub struct TpModel<M: RankModel, TP: TpSize = usize>
where
    M::Hidden: ShardDim<TP>,
{
    exec: Executor<RankWorker<M>>,
    hidden: M::Hidden,
    num_layers: usize,
    tp: TP,
    dtype: DType,
    /// Weight bytes over all ranks, counted at load.
    weight_bytes: usize,
}

/// The hidden dim of one rank's slice of `M`'s states.
pub type ShardOf<M, TP> = <<M as Model>::Hidden as ShardDim<TP>>::Shard;

/// Every rank's `[L, T, H/TP]` slice of captured states.
pub type RankShards<L, M, TP> = PerRank<ShardedStates<L, ShardOf<M, TP>>>;

type Opener = dyn Fn() -> Result<Checkpoint, CheckpointError> + Send + Sync;

impl<B, L, H, TP> TpModel<Decoder<B, L, H>, TP>
where
    B: Backend,
    L: Block<B>,
    H: ShardDim<TP> + Default,
    TP: TpSize,
{
    /// Loads a checkpoint directory as `tp` ranks on the default backend.
    pub fn load(dir: &Path, tp: TP) -> Result<Self, ModelError>
    where
        B: Default,
    {
        Self::load_on(&B::default(), dir, tp)
    }

    /// Loads a checkpoint directory as `tp` ranks of `backend`'s group. The
    /// split is checked against the config before any weight is read; each
    /// rank then reads only its shard from the memory-mapped files.
    pub fn load_on(backend: &B, dir: &Path, tp: TP) -> Result<Self, ModelError> {
        let config = L::parse_config(&read_config_text(dir)?)?;
        let (dir, prefix) = (dir.to_path_buf(), L::frame(&config).tensor_prefix);
        Self::build_on(backend, config, tp, move || Checkpoint::open_scoped(&dir, &prefix))
    }

    /// As [`load_on`](Self::load_on), with the checkpoint opened by `open` on each rank.
    pub fn build_on(
        backend: &B,
        config: L::Config,
        tp: TP,
        open: impl Fn() -> Result<Checkpoint, CheckpointError> + Send + Sync + 'static,
    ) -> Result<Self, ModelError> {
        Self::build_with(backend, config, tp, false, open)
    }

    /// [`build_on`](Self::build_on), each rank with its block of the LM
    /// head if `lm_head` (see [`Decoder::with_lm_head`]).
    pub fn build_with(
        backend: &B,
        config: L::Config,
        tp: TP,
        lm_head: bool,
        open: impl Fn() -> Result<Checkpoint, CheckpointError> + Send + Sync + 'static,
    ) -> Result<Self, ModelError> {
        super::shard::check(&L::splits(&config), tp.get())?;
        let info = L::frame(&config).info;
        let hidden: H = dim_from_size("config.json hidden_size", "hidden", info.hidden_size)?;
        hidden.shard(tp)?;
        let ranks: Vec<Mutex<Option<B>>> = backend.group(tp.get())?.into_iter().map(|b| Mutex::new(Some(b))).collect();
        let open: Arc<Opener> = Arc::new(open);
        let build = move |rank: usize| {
            let b = ranks[rank].lock().expect("rank backend").take().expect("each rank built once");
            let ckpt = open()?;
            let model = Decoder::<B, L, H>::from_checkpoint_on(b, config.clone(), &ckpt)?;
            let model = if lm_head { model.with_lm_head(&ckpt)? } else { model };
            Ok::<_, ModelError>(RankWorker { rank, model, cache: Default::default() })
        };
        // A rank that panics stops the group's collectives, so its peers fail the step instead of waiting.
        let abort = |w: &RankWorker<Decoder<B, L, H>>, why: &str| w.model.abort_group(why);
        let exec = Executor::spawn_with_abort(tp.get(), build, abort)?;
        let dtype = exec.rpc_unique(0, |w: &mut RankWorker<Decoder<B, L, H>>| w.model.dtype())?;
        let weight_bytes = exec
            .collective_rpc(|w: &mut RankWorker<Decoder<B, L, H>>| w.model.resident_bytes())?
            .into_vec()
            .iter()
            .sum();
        Ok(TpModel { exec, hidden, num_layers: info.num_layers, tp, dtype, weight_bytes })
    }
}

impl<M, TP> TpModel<M, TP>
where
    M: RankModel,
    M::Hidden: ShardDim<TP> + Default,
    TP: TpSize,
{
    /// The checkpoint's weight dtype.
    pub fn dtype(&self) -> DType {
        self.dtype
    }
    /// The TP size.
    pub fn tp(&self) -> TP {
        self.tp
    }

    /// Runs `f` on every rank: one reply per rank.
    pub fn collective_rpc<R: Send + 'static>(
        &self,
        f: impl Fn(&mut RankWorker<M>) -> R + Send + Sync + 'static,
    ) -> Result<PerRank<R>, RpcError> {
        self.exec.collective_rpc(f)
    }

    /// Runs `f` on every rank and returns rank `rank`'s reply itself.
    pub fn rpc_unique<R: Send + 'static>(
        &self,
        rank: usize,
        f: impl Fn(&mut RankWorker<M>) -> R + Send + Sync + 'static,
    ) -> Result<R, RpcError> {
        self.exec.rpc_unique(rank, f)
    }

    /// Runs a step on every rank and returns each rank's `[L, T, H/TP]` slice
    /// of the captured states, for [`ShardedStates::gather`].
    pub fn forward_sharded<L: Dim>(
        &self,
        batch: &PackedBatch,
        captures: &CaptureSet<L>,
    ) -> Result<RankShards<L, M, TP>, ModelError> {
        let (batch, captures, tp) = (Arc::new(batch.clone()), captures.clone(), self.tp);
        let replies = self.exec.collective_rpc(move |w: &mut RankWorker<M>| {
            let states = w.capture(&batch, &captures)?;
            ShardedStates::split(&states, tp, w.rank).map_err(ModelError::from)
        })?;
        Ok(PerRank::from_vec(replies.into_vec().into_iter().collect::<Result<_, _>>()?))
    }
}

impl<M, TP> Model for TpModel<M, TP>
where
    M: RankModel,
    M::Hidden: ShardDim<TP> + Default,
    TP: TpSize,
{
    type Hidden = M::Hidden;
    /// Each rank keeps its own KV cache; the caller's is unused.
    type Cache = ();

    fn hidden(&self) -> M::Hidden {
        self.hidden
    }

    fn num_layers(&self) -> usize {
        self.num_layers
    }

    fn dtype(&self) -> DType {
        self.dtype
    }

    fn weight_bytes(&self) -> usize {
        self.weight_bytes
    }

    fn cache_bytes(&self, _cache: &()) -> Result<usize, ModelError> {
        let per_rank = self.exec.collective_rpc(|w: &mut RankWorker<M>| w.model.cache_bytes(&w.cache))?;
        per_rank.into_vec().into_iter().sum()
    }

    /// Every rank runs the step; rank 0 alone captures, and its states move
    /// to the caller; the ranks' blocks of the logits are gathered.
    fn forward_sample_pending<L: Dim>(
        &self,
        batch: &PackedBatch,
        captures: &CaptureSet<L>,
        _cache: &mut (),
        sample: Option<&[usize]>,
    ) -> Result<Sampled<L, M::Hidden>, ModelError> {
        let (batch, captures) = (Arc::new(batch.clone()), captures.clone());
        let sample = Arc::new(sample.map(<[usize]>::to_vec));
        let replies = self.exec.collective_rpc(move |w: &mut RankWorker<M>| {
            let capture = w.rank == 0;
            w.step(&batch, &captures, capture, sample.as_deref())
        })?;
        // Any rank's failure fails the step (the first, in rank order), not only rank 0's.
        let steps = replies.into_vec().into_iter().collect::<Result<Vec<_>, _>>()?;
        let mut states = None;
        let mut shards = Vec::with_capacity(steps.len());
        for step in steps {
            states = states.or(step.states);
            shards.extend(step.logits);
        }
        let logits = if shards.is_empty() { None } else { Some(Logits::gather(PerRank::from_vec(shards))?) };
        Ok(Sampled { states: states.expect("rank 0 captures"), logits })
    }
}
