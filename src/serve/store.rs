//! The states directory of `strata serve`: each served file written whole
//! under a temporary name and renamed before its reply, named unguessably,
//! and accounted for until its reader deletes it. Bytes are reserved when a
//! request is admitted, so the files served, not yet deleted, and being made
//! stay within `--max-pending-bytes`; `--pending-ttl` removes what no reader
//! claimed.

use super::metrics::Metrics;
use crate::files::Dir;
use std::collections::HashMap;
use std::io::{self, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering::Relaxed;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

/// The names of served files: `strata-{32 hex}.safetensors`. Never
/// `hs_{i}.safetensors`, which the trainer takes for its own cache.
const PREFIX: &str = "strata-";
const SUFFIX: &str = ".safetensors";
/// Temporary names: `.strata-{32 hex}.tmp`, hidden, never a final name.
const TMP_PREFIX: &str = ".strata-";
const TMP_SUFFIX: &str = ".tmp";

/// The directory served files go to, and the account of their bytes.
#[derive(Debug)]
pub struct Store {
    dir: Dir,
    /// Absolute: the path replies carry.
    path: PathBuf,
    cap: u64,
    ttl: Duration,
    state: Mutex<Account>,
    /// Woken when bytes are released.
    room: tokio::sync::Notify,
    metrics: Arc<Metrics>,
}

#[derive(Debug, Default)]
struct Account {
    /// Bytes reserved: files served and not yet deleted, and those being made.
    reserved: u64,
    /// Files served and not yet deleted: name → (bytes, when written).
    files: HashMap<String, (u64, Instant)>,
    /// Temporary files being written.
    writing: std::collections::HashSet<String>,
    /// No more files are made (the server is stopping).
    closed: bool,
}

/// Bytes reserved for a file being made; released when dropped unless the file was written.
#[derive(Debug)]
pub struct Reservation {
    store: Arc<Store>,
    bytes: u64,
}

impl Drop for Reservation {
    fn drop(&mut self) {
        if self.bytes > 0 {
            self.store.release(self.bytes);
        }
    }
}

/// A file written and renamed into place.
#[derive(Debug, Clone)]
pub struct Served {
    /// Its name in the directory.
    pub name: String,
    /// Its absolute path.
    pub path: PathBuf,
}

impl Store {
    /// Opens (creating it if missing) the directory at `path`.
    pub fn open(path: &Path, cap: u64, ttl: Duration, metrics: Arc<Metrics>) -> io::Result<Arc<Store>> {
        let dir = Dir::create(path)?;
        let path = std::fs::canonicalize(path)?;
        Ok(Arc::new(Store {
            dir,
            path,
            cap,
            ttl,
            state: Mutex::new(Account::default()),
            room: tokio::sync::Notify::new(),
            metrics,
        }))
    }

    /// The directory's absolute path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    fn account(&self) -> std::sync::MutexGuard<'_, Account> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn release(&self, bytes: u64) {
        let mut a = self.account();
        a.reserved = a.reserved.saturating_sub(bytes);
        self.metrics.pending_bytes.store(a.reserved, Relaxed);
        drop(a);
        self.room.notify_waiters();
    }

    /// Reserves `bytes` if they fit under the cap, or if nothing is reserved
    /// (a file larger than the cap is made alone).
    pub fn try_reserve(self: &Arc<Self>, bytes: u64) -> Option<Reservation> {
        let mut a = self.account();
        if a.reserved > 0 && a.reserved + bytes > self.cap {
            return None;
        }
        a.reserved += bytes;
        self.metrics.pending_bytes.store(a.reserved, Relaxed);
        Some(Reservation { store: self.clone(), bytes })
    }

    /// [`Store::try_reserve`], waiting for readers to delete files (or
    /// `--pending-ttl` to remove them) until the bytes fit.
    pub async fn reserve(self: &Arc<Self>, bytes: u64) -> Reservation {
        loop {
            let woken = self.room.notified();
            if let Some(r) = self.try_reserve(bytes) {
                return r;
            }
            // A reader's delete is seen by the server's sweep (every second),
            // which wakes this; the timeout only guards against a missed wake.
            let _ = tokio::time::timeout(Duration::from_secs(1), woken).await;
        }
    }

    fn random_hex() -> String {
        let mut b = [0u8; 16];
        let mut filled = 0;
        while filled < b.len() {
            match rustix::rand::getrandom(&mut b[filled..], rustix::rand::GetRandomFlags::empty()) {
                Ok(n) => filled += n,
                Err(rustix::io::Errno::INTR) => {}
                // No getrandom (old kernels): the clock and a counter still make names that do not collide.
                Err(_) => {
                    static N: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
                    let t = SystemTime::now().duration_since(SystemTime::UNIX_EPOCH).unwrap_or_default();
                    let v = xxhash_rust::xxh3::xxh3_128(
                        &[t.as_nanos().to_le_bytes().as_slice(), &N.fetch_add(1, Relaxed).to_le_bytes()].concat(),
                    );
                    b = v.to_le_bytes();
                    break;
                }
            }
        }
        b.iter().map(|x| format!("{x:02x}")).collect()
    }

    /// Writes `lead` then `body` as a new file under a temporary name, then
    /// renames it into place: a reader never sees a part of a file. The
    /// reservation becomes the file's account, at its true size. Not fsynced:
    /// a served file lives seconds, and one lost to a crash is asked for again.
    pub fn write(&self, mut reservation: Reservation, lead: &[u8], body: &[u8]) -> io::Result<Served> {
        let hex = Self::random_hex();
        let tmp = format!("{TMP_PREFIX}{hex}{TMP_SUFFIX}");
        let name = format!("{PREFIX}{hex}{SUFFIX}");
        {
            let mut a = self.account();
            if a.closed {
                return Err(io::Error::other("the server is stopping"));
            }
            a.writing.insert(tmp.clone());
        }
        let written = (|| {
            let mut f = self.dir.create_new(&tmp)?;
            f.write_all(lead)?;
            f.write_all(body)?;
            drop(f);
            self.dir.rename(&tmp, &self.dir, &name)
        })();
        if let Err(e) = written {
            let _ = self.dir.remove(&tmp);
            self.account().writing.remove(&tmp);
            return Err(e);
        }
        let bytes = (lead.len() + body.len()) as u64;
        let mut a = self.account();
        a.writing.remove(&tmp);
        // The account holds the file's true size from now on.
        a.reserved = (a.reserved + bytes).saturating_sub(reservation.bytes);
        reservation.bytes = 0;
        a.files.insert(name.clone(), (bytes, Instant::now()));
        self.metrics.pending_bytes.store(a.reserved, Relaxed);
        self.metrics.pending_files.store(a.files.len() as u64, Relaxed);
        drop(a);
        self.room.notify_waiters();
        Ok(Served { path: self.path.join(&name), name })
    }

    /// Removes a served file whose reader will never read it (the client
    /// hung up, the server is stopping), and releases its bytes.
    pub fn remove(&self, name: &str) {
        if let Err(e) = self.dir.remove(name) {
            tracing::warn!("cannot remove {}: {e}", self.path.join(name).display());
        }
        self.forget(name);
    }

    fn forget(&self, name: &str) {
        let mut a = self.account();
        if let Some((bytes, _)) = a.files.remove(name) {
            a.reserved = a.reserved.saturating_sub(bytes);
        }
        self.metrics.pending_bytes.store(a.reserved, Relaxed);
        self.metrics.pending_files.store(a.files.len() as u64, Relaxed);
        drop(a);
        self.room.notify_waiters();
    }

    /// Looks at every file served: one its reader deleted releases its
    /// bytes; one older than the TTL is removed.
    pub fn sweep_tracked(&self) {
        let files: Vec<(String, Instant)> = self.account().files.iter().map(|(n, (_, t))| (n.clone(), *t)).collect();
        for (name, since) in files {
            match self.dir.modified(&name) {
                Ok(None) => self.forget(&name),
                Ok(Some(_)) if since.elapsed() >= self.ttl => {
                    tracing::info!("{name}: not deleted within --pending-ttl {:?}; removed", self.ttl);
                    self.metrics.expired.fetch_add(1, Relaxed);
                    self.remove(&name);
                }
                Ok(Some(_)) => {}
                Err(e) => tracing::debug!("{name}: {e}"),
            }
        }
    }

    /// Removes files of this naming that no server here accounts for (a
    /// server that died, replies no client read) once older than the TTL.
    pub fn sweep_orphans(&self) {
        let names = match self.dir.names() {
            Ok(n) => n,
            Err(e) => {
                tracing::warn!("cannot list {}: {e}", self.path.display());
                return;
            }
        };
        let now = SystemTime::now();
        for name in names {
            let ours = (name.starts_with(PREFIX) && name.ends_with(SUFFIX))
                || (name.starts_with(TMP_PREFIX) && name.ends_with(TMP_SUFFIX));
            if !ours || self.account().files.contains_key(&name) {
                continue;
            }
            if let Ok(Some((at, true))) = self.dir.modified(&name) {
                if now.duration_since(at).is_ok_and(|age| age >= self.ttl) {
                    tracing::info!("{name}: an orphan older than --pending-ttl {:?}; removed", self.ttl);
                    if self.dir.remove(&name).unwrap_or(false) {
                        self.metrics.expired.fetch_add(1, Relaxed);
                    }
                }
            }
        }
    }

    /// Makes no more files: waits up to `wait` for those being written, then
    /// removes any temporary file still there. Served files stay: their
    /// readers were answered and delete them.
    pub fn close(&self, wait: Duration) {
        self.account().closed = true;
        let until = Instant::now() + wait;
        while !self.account().writing.is_empty() && Instant::now() < until {
            std::thread::sleep(Duration::from_millis(10));
        }
        let left: Vec<String> = self.account().writing.drain().collect();
        for tmp in left {
            let _ = self.dir.remove(&tmp);
        }
    }

    /// Files served and not yet deleted, with their bytes.
    pub fn pending(&self) -> (usize, u64) {
        let a = self.account();
        (a.files.len(), a.files.values().map(|(b, _)| b).sum())
    }
}
