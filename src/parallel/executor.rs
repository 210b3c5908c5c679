//! The driver/worker executor: one thread per rank holding its state (its
//! weight shard, its KV cache), driven by typed remote calls.
//!
//! [`Executor::collective_rpc`] runs a call on every rank and returns
//! [`PerRank<R>`], one reply per rank; [`Executor::rpc_unique`] runs it on
//! every rank (collectives need all of them) and returns one rank's `R`
//! itself. The two are different types, so unwrapping a reply one level too
//! deep (the seed's bug) does not compile. Replies move through a channel:
//! a rank's captured states reach the writer without being copied or serialised.

use std::any::Any;
use std::sync::mpsc::{channel, Receiver, Sender};
use std::thread::JoinHandle;

/// One reply per rank, in rank order.
#[derive(Clone, Debug, PartialEq)]
pub struct PerRank<R>(Vec<R>);

impl<R> PerRank<R> {
    /// Number of ranks.
    pub fn len(&self) -> usize {
        self.0.len()
    }
    /// Whether there are no ranks (never, for an executor's reply).
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
    /// Rank `i`'s reply.
    pub fn rank(&self, i: usize) -> &R {
        &self.0[i]
    }
    /// Takes rank `i`'s reply, dropping the others.
    pub fn into_rank(mut self, i: usize) -> R {
        self.0.swap_remove(i)
    }
    /// The replies, in rank order.
    pub fn iter(&self) -> std::slice::Iter<'_, R> {
        self.0.iter()
    }
    /// The replies as a vector.
    pub fn into_vec(self) -> Vec<R> {
        self.0
    }
    /// Builds from replies in rank order.
    pub fn from_vec(v: Vec<R>) -> Self {
        PerRank(v)
    }
}

impl<R> std::ops::Index<usize> for PerRank<R> {
    type Output = R;
    fn index(&self, i: usize) -> &R {
        &self.0[i]
    }
}

/// A worker that stopped (it panicked, or could not be built).
#[derive(Debug, Clone, thiserror::Error)]
#[error("tensor-parallel rank {rank}: {problem}")]
pub struct RpcError {
    /// The rank.
    pub rank: usize,
    /// What happened.
    pub problem: String,
}

type Job<W> = Box<dyn FnOnce(&mut W) -> Box<dyn Any + Send> + Send>;

/// Runs one worker per rank on its own thread.
pub struct Executor<W> {
    senders: Vec<Sender<Job<W>>>,
    replies: Vec<Receiver<Box<dyn Any + Send>>>,
    threads: Vec<JoinHandle<()>>,
}

impl<W: 'static> Executor<W> {
    /// Starts `n` ranks; rank `r` builds its worker with `build(r)` on its own
    /// thread (so ranks load their shards in parallel). Fails if any rank fails.
    pub fn spawn<E, F>(n: usize, build: F) -> Result<Self, E>
    where
        F: Fn(usize) -> Result<W, E> + Send + Sync + 'static,
        E: Send + 'static,
    {
        let build = std::sync::Arc::new(build);
        let mut senders = Vec::new();
        let mut replies = Vec::new();
        let mut threads = Vec::new();
        let (ready_tx, ready_rx) = channel::<(usize, Result<(), E>)>();
        for rank in 0..n {
            let (job_tx, job_rx) = channel::<Job<W>>();
            let (reply_tx, reply_rx) = channel::<Box<dyn Any + Send>>();
            let build = build.clone();
            let ready = ready_tx.clone();
            let t = std::thread::Builder::new()
                .name(format!("strata-rank-{rank}"))
                .spawn(move || {
                    let mut worker = match build(rank) {
                        Ok(w) => {
                            let _ = ready.send((rank, Ok(())));
                            w
                        }
                        Err(e) => {
                            let _ = ready.send((rank, Err(e)));
                            return;
                        }
                    };
                    drop(ready);
                    while let Ok(job) = job_rx.recv() {
                        if reply_tx.send(job(&mut worker)).is_err() {
                            break;
                        }
                    }
                })
                .expect("spawn rank thread");
            senders.push(job_tx);
            replies.push(reply_rx);
            threads.push(t);
        }
        drop(ready_tx);
        let mut first_err = None;
        for (_, r) in ready_rx.iter() {
            if let Err(e) = r {
                first_err.get_or_insert(e);
            }
        }
        let exec = Executor { senders, replies, threads };
        match first_err {
            Some(e) => Err(e),
            None => Ok(exec),
        }
    }

    /// Number of ranks.
    pub fn world_size(&self) -> usize {
        self.senders.len()
    }

    /// Runs `f` on every rank; one reply per rank.
    pub fn collective_rpc<R, F>(&self, f: F) -> Result<PerRank<R>, RpcError>
    where
        R: Send + 'static,
        F: Fn(&mut W) -> R + Send + Sync + 'static,
    {
        let f = std::sync::Arc::new(f);
        for (rank, tx) in self.senders.iter().enumerate() {
            let f = f.clone();
            tx.send(Box::new(move |w: &mut W| Box::new(f(w)) as Box<dyn Any + Send>))
                .map_err(|_| RpcError { rank, problem: "the rank's thread has stopped".into() })?;
        }
        let mut out = Vec::with_capacity(self.replies.len());
        for (rank, rx) in self.replies.iter().enumerate() {
            let reply = rx.recv().map_err(|_| RpcError { rank, problem: "the rank stopped (panicked?)".into() })?;
            out.push(*reply.downcast::<R>().expect("reply type is fixed by the call"));
        }
        Ok(PerRank(out))
    }

    /// Runs `f` on every rank and returns rank `rank`'s reply itself.
    pub fn rpc_unique<R, F>(&self, rank: usize, f: F) -> Result<R, RpcError>
    where
        R: Send + 'static,
        F: Fn(&mut W) -> R + Send + Sync + 'static,
    {
        Ok(self.collective_rpc(f)?.into_rank(rank))
    }
}

impl<W> Drop for Executor<W> {
    fn drop(&mut self) {
        self.senders.clear(); // closes the job channels: the rank threads exit
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn per_rank_and_unique_replies() {
        let exec = Executor::spawn(3, |rank| Ok::<_, ()>(vec![rank; 2])).unwrap();
        let all: PerRank<usize> = exec.collective_rpc(|w: &mut Vec<usize>| w[0] * 10).unwrap();
        assert_eq!(all.into_vec(), vec![0, 10, 20]);
        let one: Vec<usize> = exec.rpc_unique(2, |w: &mut Vec<usize>| w.clone()).unwrap();
        assert_eq!(one, vec![2, 2]);
        assert_eq!(exec.world_size(), 3);
    }

    #[test]
    fn build_errors_surface() {
        let r = Executor::spawn(2, |rank| if rank == 1 { Err(format!("rank {rank} failed")) } else { Ok(()) });
        assert_eq!(r.err().unwrap(), "rank 1 failed");
    }
}
