//! A model run as `TP` tensor-parallel ranks (threads on the CPU), driven
//! through the typed RPC of [`Executor`]. Every architecture that can run as
//! one rank of a group ([`RankModel`]) gets the same driver.

use super::deepseek::DeepseekConfig;
use super::{Deepseek, KvCache, Llama, Model, ModelError};
use crate::batch::PackedBatch;
use crate::capture::CaptureSet;
use crate::checkpoint::{Checkpoint, CheckpointError};
use crate::config::LlamaConfig;
use crate::shape::{dim_from_size, CapturedStates, DType, Dim};
use crate::tp::{Collective, Executor, LocalGroup, PerRank, RpcError, ShardDim, ShardedStates, TpPlan, TpSize};
use std::path::Path;
use std::sync::{Arc, Mutex};

/// A model that runs as one rank of a tensor-parallel group.
pub trait RankModel: Model + Send + 'static {
    /// Runs a step; every rank must call it in step (the all-reduces need all
    /// of them); only a capturing rank fills and returns the states.
    fn forward_rank<L: Dim>(
        &self,
        batch: &PackedBatch,
        captures: &CaptureSet<L>,
        cache: &mut KvCache,
        capture: bool,
    ) -> Result<Option<CapturedStates<L, Self::Hidden>>, ModelError>;
}

impl<H: Dim> RankModel for Llama<H> {
    fn forward_rank<L: Dim>(
        &self,
        batch: &PackedBatch,
        captures: &CaptureSet<L>,
        cache: &mut KvCache,
        capture: bool,
    ) -> Result<Option<CapturedStates<L, H>>, ModelError> {
        Llama::forward_rank(self, batch, captures, cache, capture)
    }
}

impl<H: Dim> RankModel for Deepseek<H> {
    fn forward_rank<L: Dim>(
        &self,
        batch: &PackedBatch,
        captures: &CaptureSet<L>,
        cache: &mut KvCache,
        capture: bool,
    ) -> Result<Option<CapturedStates<L, H>>, ModelError> {
        Deepseek::forward_rank(self, batch, captures, cache, capture)
    }
}

/// One rank: its weight shard and the KV cache of its heads.
pub struct RankWorker<M: RankModel> {
    rank: usize,
    model: M,
    cache: KvCache,
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
        Ok(self.model.forward_rank(batch, captures, &mut self.cache, true)?.expect("capturing rank"))
    }

    /// Runs a step as a non-capturing rank (its part of the all-reduces only).
    pub fn run<L: Dim>(&mut self, batch: &PackedBatch, captures: &CaptureSet<L>) -> Result<(), ModelError> {
        self.model.forward_rank(batch, captures, &mut self.cache, false).map(|_| ())
    }
}

impl From<RpcError> for ModelError {
    fn from(e: RpcError) -> Self {
        ModelError::Parallel(e.to_string())
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

/// A Llama-family model over `TP` ranks.
pub type TpLlama<H, TP = usize> = TpModel<Llama<H>, TP>;
/// A DeepSeek V2/V3 / Kimi-K2 model over `TP` ranks.
pub type TpDeepseek<H, TP = usize> = TpModel<Deepseek<H>, TP>;

/// The hidden dim of one rank's slice of `M`'s states.
pub type ShardOf<M, TP> = <<M as Model>::Hidden as ShardDim<TP>>::Shard;

/// Every rank's `[L, T, H/TP]` slice of captured states.
pub type RankShards<L, M, TP> = PerRank<ShardedStates<L, ShardOf<M, TP>>>;

type Opener = dyn Fn() -> Result<Checkpoint, CheckpointError> + Send + Sync;

impl<M, TP> TpModel<M, TP>
where
    M: RankModel,
    M::Hidden: ShardDim<TP> + Default,
    TP: TpSize,
{
    /// Starts `tp` ranks, rank `r` built by `build(r, its communicator)`.
    fn spawn(
        tp: TP,
        hidden_size: usize,
        num_layers: usize,
        build: impl Fn(Arc<dyn Collective<Buf = [f32]>>) -> Result<M, ModelError> + Send + Sync + 'static,
    ) -> Result<Self, ModelError> {
        let hidden: M::Hidden = dim_from_size("config.json hidden_size", "hidden", hidden_size)?;
        hidden.shard(tp)?;
        let groups: Vec<Mutex<Option<LocalGroup>>> =
            LocalGroup::new(tp.get()).into_iter().map(|g| Mutex::new(Some(g))).collect();
        let exec = Executor::spawn(tp.get(), move |rank| {
            let comm = groups[rank].lock().expect("rank group").take().expect("each rank built once");
            let model = build(Arc::new(comm))?;
            Ok::<_, ModelError>(RankWorker { rank, model, cache: KvCache::default() })
        })?;
        let dtype = exec.rpc_unique(0, |w: &mut RankWorker<M>| w.model.dtype())?;
        let weight_bytes = exec.collective_rpc(|w: &mut RankWorker<M>| w.model.weight_bytes())?.into_vec().iter().sum();
        Ok(TpModel { exec, hidden, num_layers, tp, dtype, weight_bytes })
    }

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

impl<H, TP> TpModel<Llama<H>, TP>
where
    H: ShardDim<TP> + Default,
    TP: TpSize,
{
    /// Loads a checkpoint directory as `tp` ranks. The split is checked
    /// against the config before any weight is read; each rank then reads
    /// only its shard from the memory-mapped files.
    pub fn load(dir: &Path, tp: TP) -> Result<Self, ModelError> {
        let config = LlamaConfig::from_file(&dir.join("config.json"))?;
        let dir = dir.to_path_buf();
        Self::build(config, tp, move || Checkpoint::open(&dir))
    }

    /// As [`load`](Self::load), with the checkpoint opened by `open` on each rank.
    pub fn build(
        config: LlamaConfig,
        tp: TP,
        open: impl Fn() -> Result<Checkpoint, CheckpointError> + Send + Sync + 'static,
    ) -> Result<Self, ModelError> {
        let plan = TpPlan::new(&config, tp.get()).map_err(ModelError::Parallel)?;
        let (h, n) = (config.hidden_size, config.num_layers);
        let open: Arc<Opener> = Arc::new(open);
        Self::spawn(tp, h, n, move |comm| Llama::from_checkpoint_rank(config.clone(), &open()?, plan, Some(comm)))
    }
}

impl<H, TP> TpModel<Deepseek<H>, TP>
where
    H: ShardDim<TP> + Default,
    TP: TpSize,
{
    /// Loads a DeepSeek checkpoint directory as `tp` ranks (heads and every
    /// expert's MLP width split; see [`Deepseek::from_checkpoint_rank`]).
    pub fn load(dir: &Path, tp: TP) -> Result<Self, ModelError> {
        let config = DeepseekConfig::from_file(&dir.join("config.json"))?;
        let (dir, prefix) = (dir.to_path_buf(), config.tensor_prefix.clone());
        Self::build(config, tp, move || Checkpoint::open_scoped(&dir, &prefix))
    }

    /// As [`load`](Self::load), with the checkpoint opened by `open` on each rank.
    pub fn build(
        config: DeepseekConfig,
        tp: TP,
        open: impl Fn() -> Result<Checkpoint, CheckpointError> + Send + Sync + 'static,
    ) -> Result<Self, ModelError> {
        config.check_tp(tp.get()).map_err(ModelError::Parallel)?;
        let (h, n, size) = (config.hidden_size, config.num_layers, tp.get());
        let open: Arc<Opener> = Arc::new(open);
        Self::spawn(tp, h, n, move |comm| Deepseek::from_checkpoint_rank(config.clone(), &open()?, size, Some(comm)))
    }
}

impl<M, TP> Model for TpModel<M, TP>
where
    M: RankModel,
    M::Hidden: ShardDim<TP> + Default,
    TP: TpSize,
{
    type Hidden = M::Hidden;

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

    /// Every rank runs the step (each keeps its own KV cache, so `_cache` is
    /// unused); rank 0 alone captures, and its states move to the caller.
    fn forward_step<L: Dim>(
        &self,
        batch: &PackedBatch,
        captures: &CaptureSet<L>,
        _cache: &mut KvCache,
    ) -> Result<CapturedStates<L, M::Hidden>, ModelError> {
        let (batch, captures) = (Arc::new(batch.clone()), captures.clone());
        let reply = self.exec.rpc_unique(0, move |w: &mut RankWorker<M>| {
            if w.rank == 0 {
                w.capture(&batch, &captures).map(Some)
            } else {
                w.run(&batch, &captures).map(|()| None)
            }
        })?;
        Ok(reply?.expect("rank 0 captures"))
    }
}
