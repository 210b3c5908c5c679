//! The driver/worker executor: one thread per rank holding its state (its
//! weight shard, its KV cache), driven by typed remote calls.
//!
//! [`Executor::collective_rpc`] runs a call on every rank and returns
//! [`PerRank<R>`], one reply per rank; [`Executor::rpc_unique`] runs it on
//! every rank (collectives need all of them) and returns one rank's `R`
//! itself. The two are different types, so unwrapping a reply one level too
//! deep (the seed's bug) does not compile. Replies move through a channel:
//! a rank's captured states reach the writer without being copied or serialised.
//!
//! A rank that panics must not leave its peers waiting in a collective for
//! it: the executor catches the panic, calls the abort hook
//! ([`Executor::spawn_with_abort`]) so the group's collectives stop, and the
//! call fails on every rank. The executor is then dead: later calls fail at
//! once, rather than read a stale reply of the failed call.

use std::any::Any;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, Ordering};
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
    /// Set when a rank stopped: the ranks no longer run in step.
    dead: AtomicBool,
    /// The first rank that panicked, and its message.
    first_panic: std::sync::Arc<std::sync::Mutex<Option<RpcError>>>,
}

/// What a panic said.
fn panic_message(p: &(dyn Any + Send)) -> String {
    p.downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| p.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a panic with no message".into())
}

impl<W: 'static> Executor<W> {
    /// Starts `n` ranks; rank `r` builds its worker with `build(r)` on its own
    /// thread (so ranks load their shards in parallel). Fails if any rank fails.
    pub fn spawn<E, F>(n: usize, build: F) -> Result<Self, E>
    where
        F: Fn(usize) -> Result<W, E> + Send + Sync + 'static,
        E: Send + 'static,
    {
        Self::spawn_with_abort(n, build, |_: &W, _: &str| {})
    }

    /// As [`spawn`](Self::spawn); when a rank's call panics, `abort(worker,
    /// why)` runs on that rank's thread to stop the group's collectives (its
    /// peers may be waiting in one for it), and the rank's thread ends.
    pub fn spawn_with_abort<E, F, A>(n: usize, build: F, abort: A) -> Result<Self, E>
    where
        F: Fn(usize) -> Result<W, E> + Send + Sync + 'static,
        A: Fn(&W, &str) + Send + Sync + 'static,
        E: Send + 'static,
    {
        let build = std::sync::Arc::new(build);
        let abort = std::sync::Arc::new(abort);
        let first_panic = std::sync::Arc::new(std::sync::Mutex::new(None::<RpcError>));
        let mut senders = Vec::new();
        let mut replies = Vec::new();
        let mut threads = Vec::new();
        let (ready_tx, ready_rx) = channel::<(usize, Result<(), E>)>();
        for rank in 0..n {
            let (job_tx, job_rx) = channel::<Job<W>>();
            let (reply_tx, reply_rx) = channel::<Box<dyn Any + Send>>();
            let build = build.clone();
            let abort = abort.clone();
            let first_panic = first_panic.clone();
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
                        match catch_unwind(AssertUnwindSafe(|| job(&mut worker))) {
                            Ok(reply) => {
                                if reply_tx.send(reply).is_err() {
                                    break;
                                }
                            }
                            Err(p) => {
                                let problem = panic_message(p.as_ref());
                                let why = format!("rank {rank} panicked: {problem}");
                                // Recorded before the abort wakes the peers, whose own
                                // unwinding (from the aborted collective) comes second.
                                first_panic
                                    .lock()
                                    .unwrap_or_else(|e| e.into_inner())
                                    .get_or_insert(RpcError { rank, problem: format!("panicked: {problem}") });
                                abort(&worker, &why);
                                // No reply: the caller sees this rank stopped.
                                break;
                            }
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
        let exec = Executor { senders, replies, threads, dead: AtomicBool::new(false), first_panic };
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
        if self.dead.load(Ordering::Relaxed) {
            return Err(RpcError { rank: 0, problem: "an earlier call stopped a rank: the group cannot run".into() });
        }
        let f = std::sync::Arc::new(f);
        // Sent to every live rank, and every reply awaited, so no stale reply
        // is left for a later call to read.
        let sent: Vec<bool> = self
            .senders
            .iter()
            .map(|tx| {
                let f = f.clone();
                tx.send(Box::new(move |w: &mut W| Box::new(f(w)) as Box<dyn Any + Send>)).is_ok()
            })
            .collect();
        let mut out = Vec::with_capacity(self.replies.len());
        let mut first_err = None;
        for (rank, (rx, sent)) in self.replies.iter().zip(sent).enumerate() {
            match sent.then(|| rx.recv().ok()).flatten() {
                Some(reply) => out.push(*reply.downcast::<R>().expect("reply type is fixed by the call")),
                None => {
                    self.dead.store(true, Ordering::Relaxed);
                    let problem = "the rank's thread stopped (it panicked: see the log)".into();
                    first_err.get_or_insert(RpcError { rank, problem });
                }
            }
        }
        match first_err {
            // The rank that panicked first, and why, over whichever stopped first in rank order.
            Some(e) => Err(self.first_panic.lock().unwrap_or_else(|e| e.into_inner()).clone().unwrap_or(e)),
            None => Ok(PerRank(out)),
        }
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
    fn a_panicking_rank_aborts_its_peers_and_fails_the_call() {
        use crate::parallel::{Collective, LocalGroup};
        let groups = std::sync::Mutex::new(LocalGroup::new(3).into_iter().map(Some).collect::<Vec<_>>());
        let exec = Executor::spawn_with_abort(
            3,
            move |rank| Ok::<_, ()>(groups.lock().unwrap()[rank].take().unwrap()),
            |g: &LocalGroup, why: &str| g.abort(why),
        )
        .unwrap();
        let (tx, rx) = channel();
        std::thread::spawn(move || {
            let r = exec.collective_rpc(|g: &mut LocalGroup| {
                if g.rank() == 1 {
                    panic!("planted");
                }
                let mut x = vec![1.0f32];
                g.all_reduce_sum(&mut x); // would wait for rank 1 forever
                x[0]
            });
            let again = exec.collective_rpc(|g: &mut LocalGroup| g.rank());
            let _ = tx.send((r.map(PerRank::into_vec), again.map(PerRank::into_vec)));
        });
        let (r, again) = rx.recv_timeout(std::time::Duration::from_secs(30)).expect("the panic hung its peers");
        let e = r.unwrap_err();
        assert_eq!(e.rank, 1, "{e}");
        assert!(e.to_string().contains("panicked: planted"), "{e}");
        assert!(again.is_err(), "a dead group must refuse later calls");
    }

    #[test]
    fn build_errors_surface() {
        let r = Executor::spawn(2, |rank| if rank == 1 { Err(format!("rank {rank} failed")) } else { Ok(()) });
        assert_eq!(r.err().unwrap(), "rank 1 failed");
    }
}
