//! A Llama-family model run as `TP` tensor-parallel ranks (threads on the
//! CPU), driven through the typed RPC of [`Executor`].

use super::{KvCache, Llama, Model, ModelError};
use crate::batch::PackedBatch;
use crate::capture::CaptureSet;
use crate::checkpoint::Checkpoint;
use crate::config::LlamaConfig;
use crate::shape::{dim_from_size, CapturedStates, DType, Dim};
use crate::tp::{Collective, Executor, LocalGroup, PerRank, RpcError, ShardDim, ShardedStates, TpPlan, TpSize};
use std::path::Path;
use std::sync::{Arc, Mutex};

/// One rank: its weight shard and the KV cache of its heads.
pub struct RankWorker<H: Dim> {
    rank: usize,
    model: Llama<H>,
    cache: KvCache,
}

impl<H: Dim> RankWorker<H> {
    /// This rank's index.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Runs a step; this rank fills and returns the captured states (whole `[L, T, H]`).
    pub fn capture<L: Dim>(
        &mut self,
        batch: &PackedBatch,
        captures: &CaptureSet<L>,
    ) -> Result<CapturedStates<L, H>, ModelError> {
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

/// A model split over `tp` ranks; `H` its hidden dim, `TP` the TP size's type
/// (`usize`, or `Tp<U8>` for a split checked at compile time).
pub struct TpLlama<H: ShardDim<TP>, TP: TpSize = usize> {
    exec: Executor<RankWorker<H>>,
    config: LlamaConfig,
    hidden: H,
    tp: TP,
    dtype: DType,
}

impl<H, TP> TpLlama<H, TP>
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
        open: impl Fn() -> Result<Checkpoint, crate::checkpoint::CheckpointError> + Send + Sync + 'static,
    ) -> Result<Self, ModelError> {
        let plan = TpPlan::new(&config, tp.get()).map_err(ModelError::Parallel)?;
        let hidden: H = dim_from_size("config.json hidden_size", "hidden", config.hidden_size)?;
        hidden.shard(tp)?;
        let groups: Vec<Mutex<Option<LocalGroup>>> =
            LocalGroup::new(tp.get()).into_iter().map(|g| Mutex::new(Some(g))).collect();
        let cfg = config.clone();
        let exec = Executor::spawn(tp.get(), move |rank| {
            let comm = groups[rank].lock().expect("rank group").take().expect("each rank built once");
            let comm: Arc<dyn Collective<Buf = [f32]>> = Arc::new(comm);
            let ckpt = open()?;
            let model = Llama::<H>::from_checkpoint_rank(cfg.clone(), &ckpt, plan, Some(comm))?;
            Ok::<_, ModelError>(RankWorker { rank, model, cache: KvCache::default() })
        })?;
        let dtype = exec.rpc_unique(0, |w: &mut RankWorker<H>| w.model.dtype())?;
        Ok(TpLlama { exec, config, hidden, tp, dtype })
    }

    /// The normalised config.
    pub fn config(&self) -> &LlamaConfig {
        &self.config
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
        f: impl Fn(&mut RankWorker<H>) -> R + Send + Sync + 'static,
    ) -> Result<PerRank<R>, RpcError> {
        self.exec.collective_rpc(f)
    }

    /// Runs `f` on every rank and returns rank `rank`'s reply itself.
    pub fn rpc_unique<R: Send + 'static>(
        &self,
        rank: usize,
        f: impl Fn(&mut RankWorker<H>) -> R + Send + Sync + 'static,
    ) -> Result<R, RpcError> {
        self.exec.rpc_unique(rank, f)
    }

    /// Runs a step on every rank and returns each rank's `[L, T, H/TP]` slice
    /// of the captured states, for [`ShardedStates::gather`].
    pub fn forward_sharded<L: Dim>(
        &self,
        batch: &PackedBatch,
        captures: &CaptureSet<L>,
    ) -> Result<PerRank<ShardedStates<L, H::Shard>>, ModelError> {
        let (batch, captures, tp) = (Arc::new(batch.clone()), captures.clone(), self.tp);
        let replies = self.exec.collective_rpc(move |w: &mut RankWorker<H>| {
            let states = w.capture(&batch, &captures)?;
            ShardedStates::split(&states, tp, w.rank).map_err(ModelError::from)
        })?;
        Ok(PerRank::from_vec(replies.into_vec().into_iter().collect::<Result<_, _>>()?))
    }
}

impl<H, TP> Model for TpLlama<H, TP>
where
    H: ShardDim<TP> + Default,
    TP: TpSize,
{
    type Hidden = H;

    fn hidden(&self) -> H {
        self.hidden
    }

    fn num_layers(&self) -> usize {
        self.config.num_layers
    }

    /// Every rank runs the step (each keeps its own KV cache, so `_cache` is
    /// unused); rank 0 alone captures, and its states move to the caller.
    fn forward_step<L: Dim>(
        &self,
        batch: &PackedBatch,
        captures: &CaptureSet<L>,
        _cache: &mut KvCache,
    ) -> Result<CapturedStates<L, H>, ModelError> {
        let (batch, captures) = (Arc::new(batch.clone()), captures.clone());
        let reply = self.exec.rpc_unique(0, move |w: &mut RankWorker<H>| {
            if w.rank == 0 {
                w.capture(&batch, &captures).map(Some)
            } else {
                w.run(&batch, &captures).map(|()| None)
            }
        })?;
        Ok(reply?.expect("rank 0 captures"))
    }
}
