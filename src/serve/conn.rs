//! The connections of `strata serve`. Each accepted socket is registered
//! with what it is doing (handling a request, or idle since when), so that
//! when every `--max-connections` slot is taken the connection idle longest
//! is closed to make room: clients that connect and say nothing cannot lock
//! the others out. The socket is read through [`Watched`], which sees a
//! client close its sending side (a half-close, or a hang-up: TCP cannot
//! tell them apart) before its request is answered, records it, and holds
//! the end back from hyper until the reply is out: hyper would otherwise
//! drop the request with no reply at all. A GET is answered as usual; a
//! completion is dropped (before its forward step when still queued) and
//! answered with a reply that says why.

use std::collections::HashMap;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering::SeqCst};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Instant;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::sync::Notify;

/// One connection's state.
#[derive(Debug)]
pub struct Conn {
    id: u64,
    /// Requests being handled, and replies not yet sent, on it.
    busy: AtomicUsize,
    /// When it last became idle (or was accepted): milliseconds since the registry's start.
    idle_since: AtomicU64,
    /// Bytes were read that no reply has answered yet (a request, or a part of one).
    unanswered: AtomicBool,
    /// Its client closed its sending side before a reply to what it sent.
    closed_by_client: AtomicBool,
    /// Wakes hyper's read once the reply is out, when the end was held back.
    reader: Mutex<Option<std::task::Waker>>,
    /// Woken when `closed_by_client` is set.
    client_closed: Notify,
    /// Woken to close the connection (to make room for another).
    evict: Notify,
    registry: Arc<Registry>,
}

/// Every open connection.
#[derive(Debug)]
pub struct Registry {
    conns: Mutex<HashMap<u64, Arc<Conn>>>,
    next: AtomicU64,
    start: Instant,
}

impl Registry {
    /// An empty registry.
    pub fn new() -> Arc<Self> {
        Arc::new(Registry { conns: Mutex::default(), next: AtomicU64::new(0), start: Instant::now() })
    }

    fn conns(&self) -> std::sync::MutexGuard<'_, HashMap<u64, Arc<Conn>>> {
        self.conns.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn now_ms(&self) -> u64 {
        self.start.elapsed().as_millis() as u64
    }

    /// Registers a connection just accepted (idle from now).
    pub fn add(self: &Arc<Self>) -> Arc<Conn> {
        let id = self.next.fetch_add(1, SeqCst);
        let conn = Arc::new(Conn {
            id,
            busy: AtomicUsize::new(0),
            idle_since: AtomicU64::new(self.now_ms()),
            unanswered: AtomicBool::new(false),
            closed_by_client: AtomicBool::new(false),
            reader: Mutex::new(None),
            client_closed: Notify::new(),
            evict: Notify::new(),
            registry: self.clone(),
        });
        self.conns().insert(id, conn.clone());
        conn
    }

    /// Connections open now.
    pub fn len(&self) -> usize {
        self.conns().len()
    }

    /// Whether none is open.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Closes the connection that has been idle longest (no request in
    /// hand, no reply being sent: a client that connected and said nothing,
    /// or a kept-alive one between requests); `false` when every one is busy.
    pub fn evict_idlest(&self) -> bool {
        let conns = self.conns();
        let idlest = conns
            .values()
            .filter(|c| c.busy.load(SeqCst) == 0)
            .min_by_key(|c| (c.idle_since.load(SeqCst), c.id))
            .cloned();
        drop(conns);
        match idlest {
            Some(c) => {
                self.conns().remove(&c.id);
                c.evict.notify_one();
                true
            }
            None => false,
        }
    }
}

impl Conn {
    /// Marks a request in hand until the guard is dropped (with its reply).
    pub fn busy(self: &Arc<Self>) -> Busy {
        self.busy.fetch_add(1, SeqCst);
        Busy(self.clone())
    }

    /// Resolves when the connection is to be closed to make room.
    pub async fn evicted(&self) {
        self.evict.notified().await
    }

    /// Leaves the registry (the connection is closed).
    pub fn remove(&self) {
        self.registry.conns().remove(&self.id);
    }

    /// Whether the client has closed its sending side before a reply to what it sent.
    pub fn is_closed_by_client(&self) -> bool {
        self.closed_by_client.load(SeqCst)
    }

    /// Resolves once the client has closed its sending side before a reply to what it sent.
    pub async fn closed_by_client(&self) {
        loop {
            let woken = self.client_closed.notified();
            if self.closed_by_client.load(SeqCst) {
                return;
            }
            woken.await;
        }
    }
}

/// A request in hand on a connection (see [`Conn::busy`]).
#[derive(Debug)]
pub struct Busy(Arc<Conn>);

impl Drop for Busy {
    fn drop(&mut self) {
        if self.0.busy.fetch_sub(1, SeqCst) == 1 {
            self.0.idle_since.store(self.0.registry.now_ms(), SeqCst);
            // The reply is out: an end held back is hyper's to see now.
            self.0.unanswered.store(false, SeqCst);
            if let Some(w) = self.0.reader.lock().unwrap_or_else(|e| e.into_inner()).take() {
                w.wake();
            }
        }
    }
}

/// A socket read and written for hyper. The end of the client's sending
/// side (a half-close, or a close: TCP cannot tell them apart) that comes
/// before a reply to what the client sent is recorded and held back from
/// hyper, which would otherwise drop the request with no reply at all;
/// hyper sees it once the reply is out (and closes the connection).
pub struct Watched<T> {
    io: T,
    conn: Arc<Conn>,
}

impl<T> Watched<T> {
    /// Watches `io` for `conn`.
    pub fn new(io: T, conn: Arc<Conn>) -> Self {
        Watched { io, conn }
    }
}

impl<T: AsyncRead + Unpin> AsyncRead for Watched<T> {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<std::io::Result<()>> {
        let before = buf.filled().len();
        let r = Pin::new(&mut self.io).poll_read(cx, buf);
        if !matches!(r, Poll::Ready(Ok(()))) || buf.remaining() == 0 {
            return r;
        }
        let c = &self.conn;
        if buf.filled().len() > before {
            c.unanswered.store(true, SeqCst);
            return r;
        }
        // The end of the client's side: held back while what it sent is unanswered.
        let pending = || c.unanswered.load(SeqCst) || c.busy.load(SeqCst) > 0;
        if !pending() {
            return r;
        }
        if !c.closed_by_client.swap(true, SeqCst) {
            c.client_closed.notify_waiters();
        }
        *c.reader.lock().unwrap_or_else(|e| e.into_inner()) = Some(cx.waker().clone());
        // (The reply may have gone out meanwhile, before the waker was there to be woken.)
        if !pending() {
            return r;
        }
        Poll::Pending
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for Watched<T> {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, data: &[u8]) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.io).poll_write(cx, data)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.io).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.io).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_idlest_connection_goes_first_and_a_busy_one_never() {
        let reg = Registry::new();
        let a = reg.add();
        std::thread::sleep(std::time::Duration::from_millis(3));
        let b = reg.add();
        let held = a.busy();
        assert!(reg.evict_idlest());
        assert_eq!(reg.len(), 1, "b (idle) went, a (busy) stays");
        assert!(b.evict.notified().now_or_never_for_test());
        assert!(!reg.evict_idlest(), "every connection left is busy");
        drop(held);
        assert!(reg.evict_idlest());
        assert!(reg.is_empty());
    }

    trait NowOrNever {
        fn now_or_never_for_test(self) -> bool;
    }

    impl<F: std::future::Future> NowOrNever for F {
        fn now_or_never_for_test(self) -> bool {
            let waker = std::task::Waker::noop();
            let mut cx = Context::from_waker(waker);
            let mut f = std::pin::pin!(self);
            f.as_mut().poll(&mut cx).is_ready()
        }
    }
}
