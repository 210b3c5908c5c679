//! A barrier that one rank can abort. `std::sync::Barrier` waits forever for
//! a rank that panicked or stopped; this one wakes every waiter, now and
//! later, with the reason, so a failure on one rank ends the step on all of
//! them in bounded time (the in-process analogue of `ncclCommAbort`).

use std::sync::{Condvar, Mutex};

/// Why a group's collectives stopped.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("the tensor-parallel group was aborted: {0}")]
pub struct Aborted(pub String);

#[derive(Default)]
struct State {
    arrived: usize,
    generation: u64,
    aborted: Option<String>,
}

/// A barrier of `n` threads that [`AbortableBarrier::abort`] releases with an error.
pub struct AbortableBarrier {
    n: usize,
    state: Mutex<State>,
    moved: Condvar,
}

impl AbortableBarrier {
    /// A barrier for `n` threads.
    pub fn new(n: usize) -> Self {
        AbortableBarrier { n, state: Mutex::new(State::default()), moved: Condvar::new() }
    }

    /// Waits until all `n` threads arrive, or until the barrier is aborted
    /// (then, and at every later wait, the abort's reason).
    pub fn wait(&self) -> Result<(), Aborted> {
        let mut s = self.state.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(why) = &s.aborted {
            return Err(Aborted(why.clone()));
        }
        s.arrived += 1;
        if s.arrived >= self.n {
            s.arrived = 0;
            s.generation += 1;
            self.moved.notify_all();
            return Ok(());
        }
        let generation = s.generation;
        while s.generation == generation && s.aborted.is_none() {
            s = self.moved.wait(s).unwrap_or_else(|e| e.into_inner());
        }
        match (&s.aborted, s.generation == generation) {
            (Some(why), true) => Err(Aborted(why.clone())),
            _ => Ok(()),
        }
    }

    /// Releases every waiter with `why`; later waits fail at once. The first reason stays.
    pub fn abort(&self, why: &str) {
        let mut s = self.state.lock().unwrap_or_else(|e| e.into_inner());
        s.aborted.get_or_insert_with(|| why.to_string());
        self.moved.notify_all();
    }

    /// The abort's reason, if the barrier was aborted.
    pub fn aborted(&self) -> Option<String> {
        self.state.lock().unwrap_or_else(|e| e.into_inner()).aborted.clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::time::{Duration, Instant};

    #[test]
    fn every_thread_passes_together() {
        let b = Arc::new(AbortableBarrier::new(3));
        let hs: Vec<_> = (0..3)
            .map(|_| {
                let b = b.clone();
                std::thread::spawn(move || (0..100).all(|_| b.wait().is_ok()))
            })
            .collect();
        assert!(hs.into_iter().all(|h| h.join().unwrap()));
    }

    #[test]
    fn an_abort_releases_the_waiters_and_fails_later_waits() {
        let b = Arc::new(AbortableBarrier::new(3));
        let t0 = Instant::now();
        let waiters: Vec<_> = (0..2)
            .map(|_| {
                let b = b.clone();
                std::thread::spawn(move || b.wait())
            })
            .collect();
        std::thread::sleep(Duration::from_millis(50));
        b.abort("rank 2 panicked");
        b.abort("a second reason is not kept");
        for w in waiters {
            assert_eq!(w.join().unwrap(), Err(Aborted("rank 2 panicked".into())));
        }
        assert!(t0.elapsed() < Duration::from_secs(5));
        assert_eq!(b.wait(), Err(Aborted("rank 2 panicked".into())));
        assert_eq!(b.aborted().as_deref(), Some("rank 2 panicked"));
    }
}
