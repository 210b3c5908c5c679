//! Collectives between tensor-parallel ranks.
//!
//! Model code calls these on its rank's handle and never knows the transport:
//! [`LocalGroup`] runs ranks as threads of one process (the CPU backend and
//! tests); the CUDA backend implements the same trait over NCCL with device
//! buffers as `Buf`, so model code does not change.

use super::barrier::AbortableBarrier;
use std::sync::{Arc, Mutex};

/// One rank's view of a communicator.
pub trait Collective: Send + Sync {
    /// The buffer type the collectives act on (`[f32]` on the CPU, a device slice on GPUs).
    type Buf: ?Sized;
    /// This rank's index.
    fn rank(&self) -> usize;
    /// Number of ranks.
    fn world_size(&self) -> usize;
    /// Sums `buf` over all ranks, in place; every rank gets the same result.
    fn all_reduce_sum(&self, buf: &mut Self::Buf);
    /// Concatenates every rank's `local` (same length everywhere) into `out`, in rank order.
    fn all_gather(&self, local: &Self::Buf, out: &mut Self::Buf);
    /// Copies `root`'s `buf` into every rank's `buf`.
    fn broadcast(&self, buf: &mut Self::Buf, root: usize);
    /// Waits until every rank arrives.
    fn barrier(&self);
    /// Stops the group: every rank waiting in a collective, or entering one
    /// later, stops instead of waiting for a rank that will never come.
    fn abort(&self, why: &str);
}

struct Shared {
    barrier: AbortableBarrier,
    slots: Vec<Mutex<Vec<f32>>>,
}

/// A rank of an in-process group: ranks are threads, buffers are host memory.
pub struct LocalGroup {
    rank: usize,
    shared: Arc<Shared>,
}

impl LocalGroup {
    /// Handles for `n` ranks, one per rank thread.
    pub fn new(n: usize) -> Vec<LocalGroup> {
        assert!(n > 0, "a group needs at least one rank");
        let shared = Arc::new(Shared {
            barrier: AbortableBarrier::new(n),
            slots: (0..n).map(|_| Mutex::new(Vec::new())).collect(),
        });
        (0..n).map(|rank| LocalGroup { rank, shared: shared.clone() }).collect()
    }

    /// Waits for the group. The CPU collectives return nothing, so an abort
    /// unwinds this rank's step (without the panic hook's message) to the
    /// executor, which turns it into the rank's error.
    fn wait(&self) {
        if let Err(e) = self.shared.barrier.wait() {
            std::panic::resume_unwind(Box::new(e.to_string()));
        }
    }

    fn deposit(&self, data: &[f32]) {
        let mut slot = self.shared.slots[self.rank].lock().expect("collective slot");
        slot.clear();
        slot.extend_from_slice(data);
    }
}

impl Collective for LocalGroup {
    type Buf = [f32];

    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.shared.slots.len()
    }

    fn all_reduce_sum(&self, buf: &mut [f32]) {
        if self.world_size() == 1 {
            return;
        }
        self.deposit(buf);
        self.wait();
        // Sum in rank order on every rank: all ranks get bitwise the same result.
        buf.copy_from_slice(&self.shared.slots[0].lock().expect("collective slot"));
        for slot in &self.shared.slots[1..] {
            let s = slot.lock().expect("collective slot");
            assert_eq!(s.len(), buf.len(), "all_reduce: ranks disagree on the buffer size");
            buf.iter_mut().zip(s.iter()).for_each(|(b, v)| *b += v);
        }
        self.wait();
    }

    fn all_gather(&self, local: &[f32], out: &mut [f32]) {
        assert_eq!(out.len(), local.len() * self.world_size(), "all_gather: output size");
        self.deposit(local);
        self.wait();
        for (slot, dst) in self.shared.slots.iter().zip(out.chunks_exact_mut(local.len().max(1))) {
            dst.copy_from_slice(&slot.lock().expect("collective slot"));
        }
        self.wait();
    }

    fn broadcast(&self, buf: &mut [f32], root: usize) {
        if self.rank == root {
            self.deposit(buf);
        }
        self.wait();
        if self.rank != root {
            buf.copy_from_slice(&self.shared.slots[root].lock().expect("collective slot"));
        }
        self.wait();
    }

    fn barrier(&self) {
        self.wait();
    }

    fn abort(&self, why: &str) {
        self.shared.barrier.abort(why);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn collectives_over_threads() {
        let n = 3;
        let results: Vec<(Vec<f32>, Vec<f32>, Vec<f32>)> = std::thread::scope(|s| {
            let handles: Vec<_> = LocalGroup::new(n)
                .into_iter()
                .map(|g| {
                    s.spawn(move || {
                        let r = g.rank() as f32;
                        let mut sum = vec![r, 10.0 * r];
                        g.all_reduce_sum(&mut sum);
                        let mut gathered = vec![0.0; 2 * n];
                        g.all_gather(&[r, -r], &mut gathered);
                        let mut b = vec![r; 2];
                        g.broadcast(&mut b, 2);
                        g.barrier();
                        (sum, gathered, b)
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for (sum, gathered, b) in results {
            assert_eq!(sum, vec![3.0, 30.0]);
            assert_eq!(gathered, vec![0.0, -0.0, 1.0, -1.0, 2.0, -2.0]);
            assert_eq!(b, vec![2.0, 2.0]);
        }
    }
}
