//! The states directory of `strata serve`: each served file written whole
//! under a temporary name and renamed before its reply, named unguessably,
//! and accounted for until its reader deletes it. Bytes are reserved when a
//! request is admitted, so the files served, not yet deleted, and being made
//! stay within `--max-pending-bytes`; `--pending-ttl` removes what no reader
//! claimed.
//!
//! One server per directory: the server holds an exclusive lock on
//! [`RECORD`] for its life, and a second one is refused. The same file
//! records the runs (server starts) whose files may still lie here, so a
//! file is deleted only when its name is a served name of a recorded run:
//! `strata-{run}-{128 random bits}.safetensors` (or `.strata-{run}-....tmp`).
//! The directory may be shared (`/dev/shm`, a home directory): any other
//! file, whatever its name or age, is never touched.

use super::metrics::Metrics;
use crate::files::Dir;
use std::collections::{HashMap, HashSet};
use std::fs::File;
use std::io::{self, Read, Seek, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering::Relaxed;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

/// Served names: `strata-{run}-{32 hex}.safetensors`. Never
/// `hs_{i}.safetensors`, which the trainer takes for its own cache.
const PREFIX: &str = "strata-";
const SUFFIX: &str = ".safetensors";
/// Temporary names: `.strata-{run}-{32 hex}.tmp`, hidden, never a final name.
const TMP_PREFIX: &str = ".strata-";
const TMP_SUFFIX: &str = ".tmp";
/// Hex digits of a run id (64 bits) and of a file's random part (128 bits).
const RUN_HEX: usize = 16;
const FILE_HEX: usize = 32;

/// The lock a server holds on its directory, and the record of the runs
/// that wrote there (kept across restarts: a restarted server removes what
/// a dead one left, and nothing else).
pub const RECORD: &str = ".strata-serve.lock";
/// The largest record read.
const RECORD_MAX: u64 = 1 << 20;

/// Why the states directory cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// Another server holds the directory.
    #[error(
        "another strata serve{pid} is serving --hidden-states-dir {dir} (it holds the lock on {lock}); \
         each server needs a directory of its own: give this one another --hidden-states-dir"
    )]
    Busy {
        /// The directory.
        dir: PathBuf,
        /// Its lock file.
        lock: PathBuf,
        /// ` (pid N)` when the record names the holder.
        pid: String,
    },
    /// A file-system error, with what was being done.
    #[error("--hidden-states-dir {}: {what}: {cause}", dir.display())]
    Io {
        /// The directory.
        dir: PathBuf,
        /// What was being done.
        what: String,
        /// The OS error.
        cause: io::Error,
    },
}

/// What a served or temporary name says: its run, and whether it is temporary.
fn parse_name(name: &str) -> Option<(&str, bool)> {
    let hex = |s: &str, n: usize| s.len() == n && s.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'));
    let (middle, tmp) = if let Some(m) = name.strip_prefix(PREFIX).and_then(|n| n.strip_suffix(SUFFIX)) {
        (m, false)
    } else {
        (name.strip_prefix(TMP_PREFIX).and_then(|n| n.strip_suffix(TMP_SUFFIX))?, true)
    };
    let (run, file) = middle.split_once('-')?;
    (hex(run, RUN_HEX) && hex(file, FILE_HEX)).then_some((run, tmp))
}

/// The runs a record lists, and the pid of the server that wrote it.
fn parse_record(text: &str) -> (Vec<String>, Option<u32>) {
    let mut runs = Vec::new();
    let mut pid = None;
    for line in text.lines() {
        if let Some(r) = line.strip_prefix("run ") {
            let r = r.trim();
            if r.len() == RUN_HEX
                && r.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
                && !runs.iter().any(|x| x == r)
            {
                runs.push(r.to_string());
            }
        } else if let Some(p) = line.strip_prefix("pid ") {
            pid = p.trim().parse().ok();
        }
    }
    (runs, pid)
}

fn record_text(runs: &[String]) -> String {
    let mut s = String::from(
        "# strata serve holds a lock on this file while it serves this directory (one server per directory).\n\
         # The runs below wrote files here. A server deletes only files named strata-RUN-<32 hex>.safetensors\n\
         # or .strata-RUN-<32 hex>.tmp of a run listed here; removing this file keeps their leftovers forever.\n",
    );
    s += &format!("pid {}\n", std::process::id());
    for r in runs {
        s += &format!("run {r}\n");
    }
    s
}

/// `n` random bytes as lowercase hex: from getrandom, else (old kernels)
/// from the clock and a counter, which still make names that do not collide.
fn random_hex(n: usize) -> String {
    let mut b = vec![0u8; n];
    let mut filled = 0;
    while filled < b.len() {
        match rustix::rand::getrandom(&mut b[filled..], rustix::rand::GetRandomFlags::empty()) {
            Ok(k) => filled += k,
            Err(rustix::io::Errno::INTR) => {}
            Err(_) => {
                static N: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
                for (i, chunk) in b.chunks_mut(16).enumerate() {
                    let t = SystemTime::now().duration_since(SystemTime::UNIX_EPOCH).unwrap_or_default();
                    let seed = [
                        t.as_nanos().to_le_bytes().as_slice(),
                        &N.fetch_add(1, Relaxed).to_le_bytes(),
                        &(i as u64).to_le_bytes(),
                        &std::process::id().to_le_bytes(),
                    ]
                    .concat();
                    let v = xxhash_rust::xxh3::xxh3_128(&seed).to_le_bytes();
                    chunk.copy_from_slice(&v[..chunk.len()]);
                }
                break;
            }
        }
    }
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// The directory served files go to, and the account of their bytes.
#[derive(Debug)]
pub struct Store {
    dir: Dir,
    /// Absolute: the path replies carry.
    path: PathBuf,
    /// Held for the server's life: the advisory lock lives as long as the descriptor.
    _lock: File,
    /// This run's id: every name it writes carries it.
    run: String,
    /// Runs of earlier servers whose files may still lie here (their servers are gone: the lock is ours).
    earlier: Vec<String>,
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
    writing: HashSet<String>,
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
    /// Opens (creating it if missing) the directory at `path` for this
    /// server alone: locks it (another server's lock is refused), removes
    /// the temporary files earlier runs left, and records this run.
    pub fn open(path: &Path, cap: u64, ttl: Duration, metrics: Arc<Metrics>) -> Result<Arc<Store>, StoreError> {
        let io = |what: &str| {
            let (dir, what) = (path.to_path_buf(), what.to_string());
            move |cause| StoreError::Io { dir, what, cause }
        };
        let dir = Dir::create(path).map_err(io("cannot create or open it"))?;
        let path = std::fs::canonicalize(path).map_err(io("cannot resolve it"))?;
        let lock_path = dir.join(RECORD);
        let mut lock =
            dir.open_rw(RECORD, false).map_err(io(&format!("{} cannot be its lock file", lock_path.display())))?;
        let mut text = String::new();
        match lock.try_lock() {
            Ok(()) => {}
            Err(std::fs::TryLockError::WouldBlock) => {
                let _ = (&lock).take(RECORD_MAX).read_to_string(&mut text);
                let pid = parse_record(&text).1.map_or(String::new(), |p| format!(" (pid {p})"));
                return Err(StoreError::Busy { dir: path, lock: lock_path, pid });
            }
            Err(std::fs::TryLockError::Error(e)) => return Err(io("cannot lock it")(e)),
        }
        (&lock)
            .take(RECORD_MAX)
            .read_to_string(&mut text)
            .map_err(io(&format!("cannot read {}", lock_path.display())))?;
        let (recorded, _) = parse_record(&text);
        // Earlier runs are dead (the lock is ours): their temporary files go
        // now; their served files stay until --pending-ttl, since a reader
        // answered just before they died may still read them.
        let names = dir.names().map_err(io("cannot list it"))?;
        let mut live: HashSet<&str> = HashSet::new();
        let mut removed = 0usize;
        for name in &names {
            let Some((run, tmp)) = parse_name(name).filter(|(r, _)| recorded.iter().any(|x| x == r)) else { continue };
            if tmp && matches!(dir.kind(name), Ok(Some(crate::files::Kind::File(_)))) {
                if dir.remove(name).unwrap_or(false) {
                    removed += 1;
                }
            } else {
                live.insert(run);
            }
        }
        if removed > 0 {
            tracing::info!("removed {removed} temporary files an earlier server left in {}", path.display());
        }
        let earlier: Vec<String> = recorded.iter().filter(|r| live.contains(r.as_str())).cloned().collect();
        let run = random_hex(RUN_HEX / 2);
        let runs: Vec<String> = earlier.iter().cloned().chain([run.clone()]).collect();
        let r = lock.set_len(0).and_then(|()| {
            lock.seek(io::SeekFrom::Start(0))?;
            lock.write_all(record_text(&runs).as_bytes())?;
            lock.sync_data()
        });
        r.map_err(io(&format!("cannot write {}", lock_path.display())))?;
        dir.sync();
        Ok(Arc::new(Store {
            dir,
            path,
            _lock: lock,
            run,
            earlier,
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
    /// `--pending-ttl` to remove them) until the bytes fit; `None` when they
    /// did not within `wait`.
    pub async fn reserve(self: &Arc<Self>, bytes: u64, wait: Duration) -> Option<Reservation> {
        let until = tokio::time::Instant::now() + wait;
        loop {
            let woken = self.room.notified();
            if let Some(r) = self.try_reserve(bytes) {
                return Some(r);
            }
            let now = tokio::time::Instant::now();
            if now >= until {
                return None;
            }
            // A reader's delete is seen by the server's sweep (every second),
            // which wakes this; the timeout only guards against a missed wake.
            let _ = tokio::time::timeout((until - now).min(Duration::from_secs(1)), woken).await;
        }
    }

    /// Writes `lead` then `body` as a new file under a temporary name, then
    /// renames it into place: a reader never sees a part of a file. The
    /// reservation becomes the file's account, at its true size. Not fsynced:
    /// a served file lives seconds, and one lost to a crash is asked for again.
    /// On any failure (a full disk, a file-size limit) nothing is left behind.
    pub fn write(&self, mut reservation: Reservation, lead: &[u8], body: &[u8]) -> io::Result<Served> {
        let hex = random_hex(FILE_HEX / 2);
        let tmp = format!("{TMP_PREFIX}{}-{hex}{TMP_SUFFIX}", self.run);
        let name = format!("{PREFIX}{}-{hex}{SUFFIX}", self.run);
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

    /// Whether `name` is a file some recorded run of a server here wrote:
    /// its exact name form, with this run's id or an earlier recorded one.
    fn provably_ours(&self, name: &str) -> bool {
        parse_name(name).is_some_and(|(run, _)| run == self.run || self.earlier.iter().any(|r| r == run))
    }

    /// Removes, once older than the TTL, the files recorded runs wrote that
    /// nothing accounts for (a server that died; a removal that failed).
    /// Nothing else in the directory is touched, whatever its name or age.
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
            if !self.provably_ours(&name) {
                continue;
            }
            {
                let a = self.account();
                if a.files.contains_key(&name) || a.writing.contains(&name) {
                    continue;
                }
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_exact_served_name_forms_parse() {
        let run = "0123456789abcdef";
        let file = "00112233445566778899aabbccddeeff";
        assert_eq!(parse_name(&format!("strata-{run}-{file}.safetensors")), Some((run, false)));
        assert_eq!(parse_name(&format!(".strata-{run}-{file}.tmp")), Some((run, true)));
        for bad in [
            "strata-mynotes.safetensors".to_string(),
            "strata-llama-8b-eagle3.safetensors".into(),
            ".strata-backup.tmp".into(),
            format!("strata-{file}.safetensors"),
            format!("strata-{run}-{file}x.safetensors"),
            format!("strata-{}-{file}.safetensors", run.to_uppercase()),
            format!("strata-{run}-{file}.safetensors.bak"),
            format!("strata-{run}{file}.safetensors"),
        ] {
            assert_eq!(parse_name(&bad), None, "{bad}");
        }
        let other = "fedcba9876543210".to_string();
        let (runs, pid) = parse_record(&record_text(&[run.to_string(), other.clone(), run.to_string()]));
        assert_eq!((runs, pid), (vec![run.to_string(), other], Some(std::process::id())));
        let (runs, _) = parse_record("run xxxxxxxxxxxxxxxx\nrun 0123\n");
        assert!(runs.is_empty());
    }
}
