//! The output directory both formats write into, and the rules that keep it
//! sound under crashes, full disks, hostile neighbours and a second run:
//!
//! - an advisory lock on `OUT/.strata.lock`: one run per directory; the lock
//!   file records the nonce of the run that holds (or last held) it;
//! - every file is written under `.NAME.NONCE.tmp`, created exclusively
//!   without following links, fsynced, journaled, and only then renamed to
//!   its final name, so a final name never holds a partial file and every
//!   final name a run creates was listed first;
//! - `--resume` deletes only files the manifest or journal lists and
//!   temporary files carrying a nonce the manifest or lock file records; it redoes
//!   listed files that are missing or truncated, and never calls a
//!   directory with a hole complete;
//! - `--overwrite` removes the old manifest first, so nothing half-deleted
//!   looks complete, then every file of either format;
//! - the directory is opened once ([`files::Dir`]) and every file is created,
//!   renamed or removed through that handle; a part directory or
//!   `hidden_states/` is entered without following a link, so a link planted
//!   there (before or during the run) is refused, and nothing lands outside
//!   `--out` (which itself may be a link).

use super::draft_vocab::is_trainer_file;
use super::{io_err, OpenMode, SinkError};
use crate::files::{Dir, Kind};
use crate::format::manifest::{
    Entry, InputInfo, JournalEntry, Manifest, ManifestError, ReadEachError, SampleInfo, ShardInfo, SkippedInfo, JOURNAL,
};
use crate::format::manifest::{InputPos, MANIFEST};
use crate::pipeline::source::Sample;
use std::fs::File;
use std::io::{Read, Seek, Write};
use std::path::{Path, PathBuf};

/// Where an output directory lies: `--out` (which may be a link, and is
/// created when missing) and, for one part of a split input, the part's
/// directory inside it (never a link).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OutLoc {
    /// `--out`.
    pub root: PathBuf,
    /// The part directory's name inside it.
    pub part: Option<String>,
}

impl OutLoc {
    /// The directory's path, for messages.
    pub fn path(&self) -> PathBuf {
        match &self.part {
            Some(p) => self.root.join(p),
            None => self.root.clone(),
        }
    }

    /// Opens the directory, creating it when `create`; `None` when it is
    /// missing and not created. The part directory is entered without following a link.
    pub fn open(&self, create: bool) -> Result<Option<Dir>, SinkError> {
        let root = if create {
            Dir::create(&self.root).map_err(io_err(&self.root))?
        } else {
            match Dir::open(&self.root) {
                Ok(d) => d,
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
                Err(e) if self.root.exists() && !self.root.is_dir() => {
                    return Err(dir_err(format!("{} is not a directory ({e})", self.root.display())))
                }
                Err(e) => return Err(io_err(&self.root)(e)),
            }
        };
        match &self.part {
            None => Ok(Some(root)),
            Some(p) => match root.sub(p, create) {
                Ok(d) => Ok(Some(d)),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
                Err(e) => Err(io_err(&self.path())(e)),
            },
        }
    }
}

impl From<&Path> for OutLoc {
    fn from(p: &Path) -> Self {
        OutLoc { root: p.to_path_buf(), part: None }
    }
}

impl From<PathBuf> for OutLoc {
    fn from(p: PathBuf) -> Self {
        OutLoc { root: p, part: None }
    }
}

impl From<&PathBuf> for OutLoc {
    fn from(p: &PathBuf) -> Self {
        OutLoc { root: p.clone(), part: None }
    }
}

/// A temporary file at the top of an output directory, named by the run's
/// nonce; it derefs to its path, for messages.
#[derive(Clone, Debug)]
pub struct Temp {
    /// Its name in the directory.
    pub name: String,
    path: PathBuf,
}

impl Temp {
    /// The temporary file `name` at `path`.
    pub(crate) fn new(name: String, path: PathBuf) -> Self {
        Temp { name, path }
    }
}

impl std::ops::Deref for Temp {
    type Target = Path;
    fn deref(&self) -> &Path {
        &self.path
    }
}

/// A fsynced temporary file to become a shard: see [`Output::commit`].
pub struct Commit {
    /// The temporary file.
    pub tmp: Temp,
    /// The shard it becomes (`file` is its final name).
    pub info: ShardInfo,
    /// The samples it holds.
    pub samples: Vec<SampleInfo>,
    /// The input position after its last sample.
    pub end: InputPos,
}

/// Creates this run's temporary files, as [`OutputDir::create_temp`] does,
/// on whichever thread holds it.
pub struct Temps {
    dir: Dir,
    nonce: String,
}

impl Temps {
    /// See [`OutputDir::create_temp`].
    pub fn create(&self, name: &str) -> Result<(Temp, File), SinkError> {
        create_temp(&self.dir, &self.nonce, name)
    }
}

fn create_temp(dir: &Dir, nonce: &str, name: &str) -> Result<(Temp, File), SinkError> {
    let base = name.rsplit('/').next().unwrap_or(name);
    let tmp = format!(".{base}.{nonce}.tmp");
    let path = dir.join(&tmp);
    let f = dir.create_new(&tmp).map_err(io_err(&path))?;
    Ok((Temp::new(tmp, path), f))
}

/// The lock file's name.
pub const LOCK: &str = ".strata.lock";

/// Aborts the process at a named write stage when `STRATA_FAILPOINT` says
/// so (`STAGE` or `STAGE:N` for its N-th hit): how the tests kill a run at
/// every stage. Debug builds only (the tests'); a release build ignores it.
#[cfg(not(debug_assertions))]
pub(crate) fn failpoint(_stage: &str) {}

/// See the release version above.
#[cfg(debug_assertions)]
pub(crate) fn failpoint(stage: &str) {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::OnceLock;
    static SPEC: OnceLock<Option<(String, usize)>> = OnceLock::new();
    static HITS: AtomicUsize = AtomicUsize::new(0);
    let spec = SPEC.get_or_init(|| {
        let v = std::env::var("STRATA_FAILPOINT").ok()?;
        let (name, n) = v.split_once(':').map_or((v.as_str(), "1"), |(a, b)| (a, b));
        Some((name.to_string(), n.parse().unwrap_or(1)))
    });
    if let Some((name, n)) = spec {
        if name == stage && HITS.fetch_add(1, Ordering::Relaxed) + 1 >= *n {
            tracing::error!("STRATA_FAILPOINT: aborting at {stage}");
            std::process::abort();
        }
    }
}

/// A fresh nonce: 16 hex digits from the clock, the pid and an address.
fn new_nonce() -> String {
    let t = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos());
    let local = 0u8;
    let seed = format!("{t}:{}:{:p}", std::process::id(), &local);
    format!("{:016x}", xxhash_rust::xxh3::xxh3_64(seed.as_bytes()))
}

/// Whether `name` is a temporary file of the run with `nonce`.
fn temp_of(name: &str, nonce: &str) -> bool {
    is_nonce(nonce) && name.starts_with('.') && name.ends_with(&format!(".{nonce}.tmp"))
}

/// A nonce as [`new_nonce`] makes them: a recorded one that is not cannot name our files.
fn is_nonce(s: &str) -> bool {
    s.len() == 16 && s.bytes().all(|b| b.is_ascii_hexdigit())
}

/// Whether `name` is a file some Strata run writes at the top of a directory
/// (what `--overwrite` removes even when no manifest lists it).
fn strata_named(name: &str) -> bool {
    let digits = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
    let temp = name.strip_prefix('.').and_then(|n| n.strip_suffix(".tmp")).and_then(|n| n.rsplit_once('.'));
    name == MANIFEST
        || name == JOURNAL
        || name.strip_prefix("shard-").and_then(|n| n.strip_suffix(".safetensors")).is_some_and(digits)
        || name.strip_prefix("hs_").and_then(|n| n.strip_suffix(".safetensors")).is_some_and(digits)
        || name == super::hf_dataset::DATA_FILE
        || name == super::hf_dataset::INFO_FILE
        || name == super::hf_dataset::STATE_FILE
        || temp.is_some_and(|(_, nonce)| is_nonce(nonce))
}

/// The nonce `.strata.lock` records (empty when none).
fn recorded_nonce(dir: &Dir) -> String {
    let mut s = String::new();
    if let Ok(f) = dir.open_file(LOCK) {
        let _ = f.take(64).read_to_string(&mut s);
    }
    s.trim().to_string()
}

fn dir_err(msg: String) -> SinkError {
    SinkError::Directory(msg)
}

fn not_empty(dir: &Path) -> SinkError {
    dir_err(format!(
        "output directory {} is not empty; pass --resume to continue an interrupted run or --overwrite to replace it",
        dir.display()
    ))
}

/// Removes a file that must be ours; absent is fine.
fn remove(dir: &Dir, name: &str) -> Result<(), SinkError> {
    dir.remove(name).map(|_| ()).map_err(io_err(&dir.join(name)))
}

/// What an output directory lists so far: the counts a run needs. The
/// listing itself (every shard and sample) is in the journal on disk, never
/// in memory: a million samples would hold a gigabyte.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Listed {
    /// Shards (files) listed.
    pub shards: usize,
    /// Samples they hold.
    pub samples: usize,
    /// Samples left out (non-finite states).
    pub skipped: usize,
    /// The input position after the last listed shard's samples.
    pub input: Option<InputPos>,
}

/// An output directory, locked, with its job and what it lists so far.
pub struct OutputDir {
    dir: Dir,
    // Held for the run: the advisory lock lives as long as the descriptor.
    lock: File,
    nonce: String,
    // The job: its listing (shards, samples, skipped) is empty; see `listed`.
    manifest: Manifest,
    listed: Listed,
    journal: Option<File>,
    // Subdirectories (`hidden_states/`) whose entry this run has made durable.
    durable_subs: Vec<PathBuf>,
    // Samples skipped since the last journaled file, and the input position after them.
    skipped: Vec<SkippedInfo>,
    skipped_end: Option<InputPos>,
}

/// What opening a directory will do, worked out without changing it: the
/// directory is locked and read, and nothing is deleted or rewritten until
/// [`Plan::apply`], so that a `--resume` refused on the input (checked while
/// its head streams past) leaves the output exactly as it was.
pub struct Plan {
    dir: Dir,
    lock: File,
    mode: OpenMode,
    // Every entry but the lock file.
    names: Vec<String>,
    // Nonces whose temporary files are ours: the lock's and the old manifest's.
    nonces: Vec<String>,
    // The manifest the run continues (the job's for a fresh run).
    manifest: Manifest,
    // Listed files to delete and redo (from the first hole on), as the manifest names them
    // (a handle each would be a descriptor per file: a speculators output lists one per row).
    redo: Vec<String>,
}

impl Plan {
    /// Locks `dir` and works out how to open it for `job` (its `shards` and
    /// `samples` empty). With [`OpenMode::Resume`] an existing manifest must
    /// describe the same job; its sound files are kept.
    pub fn new(loc: &OutLoc, mode: OpenMode, job: Manifest) -> Result<Self, SinkError> {
        let _s = tracing::info_span!("plan_output", dir = %loc.path().display()).entered();
        let dir = loc.open(true)?.expect("created");
        let (lock, last) = OutputDir::lock(&dir)?;
        let names: Vec<String> = dir.names().map_err(io_err(dir.path()))?.into_iter().filter(|n| n != LOCK).collect();
        let shown = dir.path().display().to_string();
        // Parts of a split input live in subdirectories; a one-process run there
        // would mix with them (a resume of a merged dataset is refused below, more precisely).
        let merged_resume = mode == OpenMode::Resume && names.iter().any(|n| n == MANIFEST);
        if job.part.is_none() && !merged_resume {
            if let Some(n) = names.iter().find(|n| crate::format::parts::parse_dir_name(n).is_some()) {
                return Err(dir_err(format!(
                    "{shown} holds the parts of a split input ({n}, ...): run the parts with --part-index/--num-parts \
                     or under their launcher, join them with `strata merge`, or give this run another --out"
                )));
            }
        }
        let mut nonces = vec![last];
        let mut redo = Vec::new();
        let theirs = |nonces: &[String], n: &str| !nonces.iter().any(|x| temp_of(n, x));
        let manifest = match mode {
            OpenMode::Create if names.iter().any(|n| theirs(&nonces, n)) => return Err(not_empty(dir.path())),
            OpenMode::Create | OpenMode::Overwrite => job,
            OpenMode::Resume if !names.iter().any(|n| n == MANIFEST) => {
                if let Some(n) = names.iter().find(|n| strata_named(n) && theirs(&nonces, n)) {
                    return Err(dir_err(format!(
                        "cannot resume in {shown}: it holds {} but no {MANIFEST} (written by another tool or an \
                         older strata); use --overwrite to start over",
                        crate::quote(n)
                    )));
                }
                job
            }
            OpenMode::Resume => {
                let (old, files) = Self::resume(&dir, job)?;
                nonces.push(old.nonce.clone());
                redo = files;
                old
            }
        };
        Ok(Plan { dir, lock, mode, names, nonces, manifest, redo })
    }

    /// The manifest the run continues.
    pub fn manifest(&self) -> &Manifest {
        &self.manifest
    }

    /// `--resume`: the old manifest (with its journal) must describe the
    /// same job. Listed files are checked in order; from the first missing
    /// or truncated one on, the listing is cut back (those files are redone).
    fn resume(dir: &Dir, job: Manifest) -> Result<(Manifest, Vec<String>), SinkError> {
        let shown = dir.path().display().to_string();
        let refuse = |e: String| dir_err(format!("cannot resume in {shown}: {e}; use --overwrite to start over"));
        let mut old = Manifest::read_in(dir).map_err(|e: ManifestError| refuse(e.to_string()))?;
        if !old.merged.is_empty() {
            return Err(dir_err(format!(
                "cannot resume in {shown}: it is a merged dataset of {} parts. Rerun a part in it with \
                    --part-index/--num-parts and --resume, then `strata merge` again",
                old.merged.len()
            )));
        }
        old.same_job(&job).map_err(|d| {
            dir_err(format!(
                "cannot resume in {shown}: {d}. To continue it, run with {} as it did; or start over with \
                 --overwrite (which deletes its files)",
                d.remedy
            ))
        })?;
        // What does not change the files comes from this run: the sizes of
        // the trainer's draft-vocabulary files it writes at the end, and what
        // an older manifest did not record (layer ids, vocabulary size).
        old.draft_vocab_sizes = job.draft_vocab_sizes.clone();
        if old.model.vocab_size == 0 {
            old.model.vocab_size = job.model.vocab_size;
        }
        for (o, j) in old.capture.iter_mut().zip(&job.capture) {
            o.layer_id = o.layer_id.or(j.layer_id);
        }
        let mut keep = old.shards.len();
        // A listed file, without following links; a subdirectory not created.
        // `None`: missing (its subdirectory too).
        let find = |i: usize, file: &str| -> Result<Option<(Dir, String, Option<Kind>)>, SinkError> {
            let (sub, name) = match dir.walk(file, false) {
                Ok(x) => x,
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
                Err(e) => return Err(refuse(format!("manifest lists shard {i} as {}: {e}", crate::quote(file)))),
            };
            let kind = sub.kind(&name).map_err(io_err(&sub.join(&name)))?;
            Ok(Some((sub, name, kind)))
        };
        for (i, s) in old.shards.iter().enumerate() {
            let kind = find(i, &s.file)?.and_then(|f| f.2);
            let problem = match kind {
                None => Some("is missing".to_string()),
                Some(Kind::File(len)) if len != s.bytes => {
                    Some(format!("has {len} bytes, the manifest says {}", s.bytes))
                }
                Some(Kind::File(_)) => None,
                Some(k) => {
                    return Err(refuse(format!(
                        "{} is {}, not a regular file; move it away",
                        dir.join(&s.file).display(),
                        k.describe()
                    )))
                }
            };
            if let Some(problem) = problem {
                tracing::warn!(
                    "{} {problem}: it and the {} listed after it are written again",
                    crate::quote(&s.file),
                    old.shards.len() - i - 1
                );
                keep = i;
                break;
            }
        }
        let mut redo = Vec::new();
        if keep < old.shards.len() {
            for (i, s) in old.shards.iter().enumerate().skip(keep) {
                let Some((_, name, Some(_))) = find(i, &s.file)? else { continue };
                // Only a name Strata writes is ever deleted, whatever a manifest says.
                if !strata_named(&name) {
                    return Err(refuse(format!(
                        "the manifest lists {}, which is not a name Strata writes",
                        crate::quote(&s.file)
                    )));
                }
                redo.push(s.file.clone());
            }
            old.shards.truncate(keep);
            old.samples.retain(|s| s.shard < keep);
            old.complete = false;
            old.input = None;
        }
        let consumed = old.consumed();
        old.skipped.retain(|s| s.index < consumed);
        Ok((old, redo))
    }

    /// Carries the plan out: removes what an earlier run left (temporary
    /// files of its nonce; shards to redo; for `--overwrite`, the old output,
    /// manifest first), records this run's nonce in the lock file and the
    /// manifest (compacted with any journal), before any temporary file exists.
    pub fn apply(self) -> Result<OutputDir, SinkError> {
        let Plan { dir, mut lock, mode, names, nonces, mut manifest, redo } = self;
        if mode == OpenMode::Overwrite {
            OutputDir::clear(&dir, &names)?;
        }
        if mode != OpenMode::Create {
            // The trainer's own files (its draft-vocabulary cache, or ours from
            // an earlier run) were counted from the rows as they were; this run
            // changes them, and writes its own at the end where asked.
            let mut trainer: Vec<&String> = names.iter().filter(|n| is_trainer_file(n)).collect();
            trainer.sort();
            for n in &trainer {
                if matches!(dir.kind(n), Ok(Some(Kind::File(_) | Kind::Link))) {
                    remove(&dir, n)?;
                }
            }
            if !trainer.is_empty() {
                tracing::warn!(
                    "removed {} from {}: the trainer's vocabulary files describe the rows before this run \
                     (--draft-vocab-size writes them anew at its end)",
                    trainer.iter().map(|n| n.as_str()).collect::<Vec<_>>().join(", "),
                    dir.path().display()
                );
            }
        }
        for n in names.iter().filter(|n| nonces.iter().any(|x| temp_of(n, x))) {
            remove(&dir, n)?;
        }
        for file in &redo {
            match dir.walk(file, false) {
                Ok((sub, name)) => remove(&sub, &name)?,
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => return Err(io_err(&dir.join(file))(e)),
            }
        }
        let nonce = new_nonce();
        let path = dir.join(LOCK);
        let r = lock.set_len(0).and_then(|()| {
            lock.seek(std::io::SeekFrom::Start(0))?;
            lock.write_all(nonce.as_bytes())?;
            lock.sync_data()
        });
        r.map_err(io_err(&path))?;
        manifest.complete = false;
        manifest.input = None;
        manifest.nonce = nonce.clone();
        // The listing a resume keeps moves to the journal (replacing the old
        // one whole), and the manifest keeps the job alone: the run holds
        // counts, never the listing. A crash between the two leaves the old
        // manifest with a journal that only repeats (a prefix of) its listing.
        let shards = std::mem::take(&mut manifest.shards);
        let samples = std::mem::take(&mut manifest.samples);
        let skipped = std::mem::take(&mut manifest.skipped);
        let listed = Listed {
            shards: shards.len(),
            samples: samples.len(),
            skipped: skipped.len(),
            input: shards.last().and_then(|s| s.input.clone()),
        };
        let mut out = OutputDir {
            dir,
            lock,
            nonce,
            manifest,
            listed,
            journal: None,
            durable_subs: vec![],
            skipped: vec![],
            skipped_end: None,
        };
        if shards.is_empty() {
            remove(&out.dir, JOURNAL)?;
        } else {
            out.rewrite_journal(shards, samples, skipped)?;
        }
        out.write_manifest()?;
        out.dir.sync();
        Ok(out)
    }
}

impl OutputDir {
    /// Locks and prepares `dir` at once; see [`Plan`].
    pub fn open(dir: impl Into<OutLoc>, mode: OpenMode, job: Manifest) -> Result<Self, SinkError> {
        Plan::new(&dir.into(), mode, job)?.apply()
    }

    /// Locks `dir`; returns the lock and the nonce the last holder recorded.
    /// The lock file must be a regular file: opened without following a link
    /// and without blocking on a FIFO.
    pub(crate) fn lock(dir: &Dir) -> Result<(File, String), SinkError> {
        let path = dir.join(LOCK);
        let f = match dir.open_rw(LOCK, false) {
            Ok(f) => f,
            Err(e) if e.kind() == std::io::ErrorKind::InvalidInput => {
                return Err(dir_err(format!("{} cannot be the lock file: {e}; remove it", path.display())))
            }
            Err(e) => return Err(io_err(&path)(e)),
        };
        match f.try_lock() {
            Ok(()) => {
                let mut old = String::new();
                let _ = (&f).take(64).read_to_string(&mut old);
                Ok((f, old.trim().to_string()))
            }
            Err(std::fs::TryLockError::WouldBlock) => Err(dir_err(format!(
                "another strata run is writing {} (it holds the lock on {}); wait for it to finish, \
                 or choose another --out",
                dir.path().display(),
                path.display()
            ))),
            Err(std::fs::TryLockError::Error(e)) => Err(io_err(&path)(e)),
        }
    }

    /// `--overwrite`: the manifest goes first, so that an interruption never
    /// leaves old files under a manifest; then the journal, the files the
    /// old manifest lists (inside the directory, with names Strata writes),
    /// and every Strata-named file.
    fn clear(dir: &Dir, names: &[String]) -> Result<(), SinkError> {
        // Opened before their names go: the old listing is then read from the
        // open files one entry at a time, never whole in memory.
        let manifest = names.iter().any(|n| n == MANIFEST).then(|| dir.open_file(MANIFEST).ok()).flatten();
        let journal = names.iter().any(|n| n == JOURNAL).then(|| dir.open_file(JOURNAL).ok()).flatten();
        remove(dir, MANIFEST)?;
        dir.sync();
        failpoint("overwrite-cleared");
        remove(dir, JOURNAL)?;
        if let Some(f) = manifest {
            // A merged dataset's shards belong to its parts: only its own links go.
            let mut each = |e: Entry| {
                let Entry::Shard(s) = e else { return Ok(()) };
                if s.file.starts_with("part-") {
                    return Ok(());
                }
                if let Ok((sub, name)) = dir.walk(&s.file, false) {
                    if strata_named(&name) && matches!(sub.kind(&name), Ok(Some(Kind::File(_)))) {
                        remove(&sub, &name)?;
                    }
                }
                Ok(())
            };
            // An unreadable old manifest lists nothing to delete: its Strata-named files go below.
            match Manifest::read_each_from(f, journal, dir.path(), &mut each) {
                Err(ReadEachError::Each(e)) => return Err(e),
                Err(ReadEachError::Manifest(e)) => tracing::debug!("the old manifest of {}: {e}", dir.path().display()),
                Ok(_) => {}
            }
        }
        for n in names.iter().filter(|n| strata_named(n)) {
            if matches!(dir.kind(n), Ok(Some(Kind::File(_) | Kind::Link))) {
                remove(dir, n)?;
            }
        }
        dir.sync();
        Ok(())
    }

    /// The manifest as written so far.
    pub fn manifest(&self) -> &Manifest {
        &self.manifest
    }

    /// The directory.
    pub fn dir(&self) -> &Dir {
        &self.dir
    }

    /// Creates the temporary file that will become `name` (which may lie in
    /// a subdirectory: the temporary file is at the top, where a resume finds it).
    pub fn create_temp(&self, name: &str) -> Result<(Temp, File), SinkError> {
        create_temp(&self.dir, &self.nonce, name)
    }

    /// A handle that creates this run's temporary files from another thread.
    pub fn temps(&self) -> Result<Temps, SinkError> {
        let dir = self.dir.try_clone().map_err(io_err(self.dir.path()))?;
        Ok(Temps { dir, nonce: self.nonce.clone() })
    }

    /// Removes a temporary file of this run (a failed write's); errors are ignored: a resume removes it.
    pub fn discard(&self, tmp: &Temp) {
        let _ = self.dir.remove(&tmp.name);
    }

    /// Writes the job as `manifest.json` (its listing is in the journal).
    fn write_manifest(&self) -> Result<(), SinkError> {
        let (tmp, f) = self.create_temp(MANIFEST)?;
        persist_manifest_streamed(&self.manifest, &NoListing, f, &tmp, &self.dir)
    }

    /// Replaces the journal with one line per listed shard (its samples;
    /// the skipped samples ride on the first), fsynced before it is renamed in.
    fn rewrite_journal(
        &mut self,
        shards: Vec<ShardInfo>,
        samples: Vec<SampleInfo>,
        mut skipped: Vec<SkippedInfo>,
    ) -> Result<(), SinkError> {
        let (tmp, f) = self.create_temp(JOURNAL)?;
        let r = (|| -> Result<(), SinkError> {
            let mut w = std::io::BufWriter::with_capacity(1 << 20, f);
            let mut samples = samples.into_iter().peekable();
            for (index, shard) in shards.into_iter().enumerate() {
                let mut mine = Vec::with_capacity(shard.samples);
                while let Some(s) = samples.next_if(|s| s.shard == index) {
                    mine.push(s);
                }
                let entry = JournalEntry { index, shard, samples: mine, skipped: std::mem::take(&mut skipped) };
                serde_json::to_writer(&mut w, &entry).map_err(|e| dir_err(format!("journal: {e}")))?;
                w.write_all(b"\n").map_err(io_err(&tmp))?;
            }
            if let Some(s) = samples.next() {
                return Err(dir_err(format!(
                    "the manifest lists sample {:?} in shard {}, which it does not list",
                    s.id, s.shard
                )));
            }
            let f = w.into_inner().map_err(|e| io_err(&tmp)(e.into_error()))?;
            f.sync_all().map_err(io_err(&tmp))
        })();
        if let Err(e) = r {
            self.discard(&tmp);
            return Err(e);
        }
        self.dir.rename(&tmp.name, &self.dir, JOURNAL).map_err(io_err(&self.dir.join(JOURNAL)))?;
        self.dir.sync();
        Ok(())
    }

    /// What the directory lists so far (the listing itself is in the journal).
    pub fn listed(&self) -> &Listed {
        &self.listed
    }

    /// Reads the journal's entries in order (the listing so far), one at a time.
    pub fn journal_entries(&self) -> Result<JournalEntries, SinkError> {
        JournalEntries::open(&self.dir)
    }

    /// Records a sample left out for non-finite states; `end` is the input position after it.
    pub fn skip(&mut self, info: SkippedInfo, end: InputPos) {
        self.skipped.push(info);
        self.skipped_end = Some(end);
    }

    /// Makes the fsynced temporary file `tmp` the shard `info.file` holding
    /// `samples`: journaled first, then renamed. `end` is the input position
    /// after its last sample.
    pub fn commit(
        &mut self,
        tmp: Temp,
        info: ShardInfo,
        samples: Vec<SampleInfo>,
        end: InputPos,
    ) -> Result<(), SinkError> {
        self.commit_all(vec![Commit { tmp, info, samples, end }])
    }

    /// [`commit`](Self::commit) for several fsynced files, in order, at the
    /// cost of one journal sync and one directory sync: their lines are
    /// journaled together, then the files renamed. A crash in between leaves
    /// listed files missing, and `--resume` redoes the listing from the first
    /// missing one, as it does for a single file.
    pub fn commit_all(&mut self, commits: Vec<Commit>) -> Result<(), SinkError> {
        let mut lines = String::new();
        let mut entries = Vec::with_capacity(commits.len());
        for (i, mut c) in commits.into_iter().enumerate() {
            let path = self.dir.join(&c.info.file);
            // The file's directory (`hidden_states/`), created here, never entered through a link.
            let (sub, name) = match self.dir.walk(&c.info.file, true) {
                Ok(x) => x,
                Err(e) => {
                    self.discard(&c.tmp);
                    return Err(io_err(&path)(e));
                }
            };
            if sub.kind(&name).map_err(io_err(&path))?.is_some() {
                self.discard(&c.tmp);
                return Err(dir_err(format!(
                    "{} exists but no manifest lists it: it is not this run's to replace; move it away and --resume",
                    path.display()
                )));
            }
            failpoint("shard-synced");
            let end = match self.skipped_end.take() {
                Some(s) if s.samples > c.end.samples => s,
                _ => c.end,
            };
            c.info.input = Some(end);
            let entry = JournalEntry {
                index: self.listed.shards + i,
                shard: c.info,
                samples: c.samples,
                skipped: std::mem::take(&mut self.skipped),
            };
            lines.push_str(&serde_json::to_string(&entry).map_err(|e| dir_err(format!("journal: {e}")))?);
            lines.push('\n');
            entries.push((c.tmp, (sub, name, path), entry));
        }
        if entries.is_empty() {
            return Ok(());
        }
        let jpath = self.dir.join(JOURNAL);
        if self.journal.is_none() {
            let f = self.dir.open_rw(JOURNAL, true).map_err(io_err(&jpath))?;
            // The journal's directory entry must be durable before any rename it lists.
            self.dir.sync();
            self.journal = Some(f);
        }
        let j = self.journal.as_mut().expect("opened above");
        j.write_all(lines.as_bytes()).and_then(|()| j.sync_data()).map_err(io_err(&jpath))?;
        entries.iter().for_each(|_| failpoint("journaled"));
        // A subdirectory's entry must be durable before the renames into it:
        // synced at its first use in this run (it may have just been created).
        let top = self.dir.path();
        let new_subs: Vec<PathBuf> = entries
            .iter()
            .map(|(_, (sub, _, _), _)| sub.path())
            .filter(|p| *p != top && !self.durable_subs.iter().any(|d| d == p))
            .map(Path::to_path_buf)
            .collect();
        if !new_subs.is_empty() {
            self.dir.sync();
            self.durable_subs.extend(new_subs);
        }
        // Then each directory renamed into is synced once. The temporary
        // names' removal from the top need not be durable: a resume removes
        // what is left of this run's temporary names (a second link to a
        // listed file, at worst), so only the top's own renames sync it.
        let mut targets: Vec<&Dir> = Vec::new();
        for (tmp, (sub, name, path), _) in &entries {
            self.dir.rename(&tmp.name, sub, name).map_err(io_err(path))?;
            failpoint("renamed");
            if !targets.iter().any(|d| d.path() == sub.path()) {
                targets.push(sub);
            }
        }
        targets.iter().for_each(|d| d.sync());
        for (_, _, entry) in entries {
            self.listed.shards += 1;
            self.listed.samples += entry.samples.len();
            self.listed.skipped += entry.skipped.len();
            self.listed.input = entry.shard.input;
        }
        Ok(())
    }

    /// Makes the fsynced temporary file `tmp` the file `name` at the top of
    /// the directory, replacing one an earlier try of this run left: files
    /// derived from the listed ones (the dataset table), not listed themselves.
    pub fn place(&self, tmp: &Temp, name: &str) -> Result<(), SinkError> {
        self.dir.rename(&tmp.name, &self.dir, name).map_err(io_err(&self.dir.join(name)))?;
        self.dir.sync();
        Ok(())
    }

    /// Marks the output complete: the journal is compacted into the manifest,
    /// which records the whole input.
    pub fn finish(&mut self, input: InputInfo) -> Result<(), SinkError> {
        self.skipped_end = None;
        self.manifest.input = Some(input);
        self.manifest.complete = true;
        // Nothing of this run is temporary any more.
        self.manifest.nonce.clear();
        // The listing streams from the journal into the manifest: never whole in memory.
        self.journal = None;
        let (tmp, f) = self.create_temp(MANIFEST)?;
        let journal = self.dir.kind(JOURNAL).map_err(io_err(&self.dir.join(JOURNAL)))?.is_some();
        let listing = JournalListing { dir: &self.dir, journal, more_skipped: &self.skipped };
        persist_manifest_streamed(&self.manifest, &listing, f, &tmp, &self.dir)?;
        self.listed.skipped += self.skipped.len();
        self.skipped.clear();
        failpoint("compacted");
        remove(&self.dir, JOURNAL)?;
        // No temporary file is left to find by its nonce.
        self.lock.set_len(0).map_err(io_err(&self.dir.join(LOCK)))?;
        self.dir.sync();
        Ok(())
    }

    /// This run's nonce.
    pub fn nonce(&self) -> &str {
        &self.nonce
    }
}

/// The entries of a journal, read one line at a time. A torn last line
/// (never made durable) ends it, as [`Manifest::read`] takes it.
pub struct JournalEntries {
    lines: std::iter::Peekable<std::io::Split<std::io::BufReader<File>>>,
    path: PathBuf,
    line: usize,
}

impl JournalEntries {
    fn open(dir: &Dir) -> Result<Self, SinkError> {
        let path = dir.join(JOURNAL);
        let f = dir.open_file(JOURNAL).map_err(io_err(&path))?;
        use std::io::BufRead;
        Ok(JournalEntries {
            lines: std::io::BufReader::with_capacity(1 << 20, f).split(b'\n').peekable(),
            path,
            line: 0,
        })
    }
}

impl Iterator for JournalEntries {
    type Item = Result<JournalEntry, SinkError>;

    fn next(&mut self) -> Option<Self::Item> {
        let line = match self.lines.next()? {
            Ok(l) => l,
            Err(e) => return Some(Err(io_err(&self.path)(e))),
        };
        self.line += 1;
        match serde_json::from_slice::<JournalEntry>(&line) {
            Ok(e) => Some(Ok(e)),
            // `split` drops the newline: a last line is torn when the file does not end with one,
            // which only a crash leaves (this run's own lines are whole).
            Err(_) if self.lines.peek().is_none() => None,
            Err(e) => Some(Err(dir_err(format!("{}:{}: malformed journal line: {e}", self.path.display(), self.line)))),
        }
    }
}

/// A manifest's listing, given one kind at a time and in order: what
/// [`persist_manifest_streamed`] writes without ever holding it.
pub(crate) trait ListingSource {
    /// Gives every listed shard to `f`, in order.
    fn shards(&self, f: &mut dyn FnMut(&ShardInfo) -> Result<(), SinkError>) -> Result<(), SinkError>;
    /// Gives every listed sample to `f`, in order.
    fn samples(&self, f: &mut dyn FnMut(&SampleInfo) -> Result<(), SinkError>) -> Result<(), SinkError>;
    /// Gives every sample left out to `f`, in order.
    fn skipped(&self, f: &mut dyn FnMut(&SkippedInfo) -> Result<(), SinkError>) -> Result<(), SinkError>;
}

/// The listing of a manifest that lists nothing yet.
struct NoListing;

impl ListingSource for NoListing {
    fn shards(&self, _: &mut dyn FnMut(&ShardInfo) -> Result<(), SinkError>) -> Result<(), SinkError> {
        Ok(())
    }

    fn samples(&self, _: &mut dyn FnMut(&SampleInfo) -> Result<(), SinkError>) -> Result<(), SinkError> {
        Ok(())
    }

    fn skipped(&self, _: &mut dyn FnMut(&SkippedInfo) -> Result<(), SinkError>) -> Result<(), SinkError> {
        Ok(())
    }
}

/// A run's listing: its journal's entries (read anew for each kind), then
/// the samples skipped since its last file.
struct JournalListing<'a> {
    dir: &'a Dir,
    journal: bool,
    more_skipped: &'a [SkippedInfo],
}

impl JournalListing<'_> {
    fn each(&self, f: &mut dyn FnMut(JournalEntry) -> Result<(), SinkError>) -> Result<(), SinkError> {
        if self.journal {
            JournalEntries::open(self.dir)?.try_for_each(|e| f(e?))?;
        }
        Ok(())
    }
}

impl ListingSource for JournalListing<'_> {
    fn shards(&self, f: &mut dyn FnMut(&ShardInfo) -> Result<(), SinkError>) -> Result<(), SinkError> {
        self.each(&mut |e| f(&e.shard))
    }

    fn samples(&self, f: &mut dyn FnMut(&SampleInfo) -> Result<(), SinkError>) -> Result<(), SinkError> {
        self.each(&mut |e| e.samples.iter().try_for_each(&mut *f))
    }

    fn skipped(&self, f: &mut dyn FnMut(&SkippedInfo) -> Result<(), SinkError>) -> Result<(), SinkError> {
        self.each(&mut |e| e.skipped.iter().try_for_each(&mut *f))?;
        self.more_skipped.iter().try_for_each(f)
    }
}

/// Writes `m`, whose own listing is empty, with the listing `listing` gives,
/// to the fresh temporary file `f` at `tmp`; fsyncs it and renames it to
/// `dir/manifest.json` (the temporary file goes on failure). The bytes are
/// those of the whole manifest written at once; the listing is never in memory.
pub(crate) fn persist_manifest_streamed(
    m: &Manifest,
    listing: &dyn ListingSource,
    f: File,
    tmp: &Temp,
    dir: &Dir,
) -> Result<(), SinkError> {
    use serde::ser::{Error as _, SerializeMap, SerializeSeq};
    use std::cell::RefCell;
    debug_assert!(m.shards.is_empty() && m.samples.is_empty() && m.skipped.is_empty());
    // The job's fields in the struct's order (serde_json keeps it), the listing's streamed in place.
    let job = match serde_json::to_value(m) {
        Ok(serde_json::Value::Object(map)) => map,
        _ => return Err(dir_err("the manifest does not serialize as an object".into())),
    };
    #[derive(Clone, Copy)]
    enum Part {
        Shards,
        Samples,
        Skipped,
    }
    // The first error of the listing's source (serde's errors carry only text).
    let failed: RefCell<Option<SinkError>> = RefCell::new(None);
    /// Writes one element, keeping the serializer's own error.
    fn put<T: serde::Serialize, Q: SerializeSeq>(
        seq: &mut Q,
        x: &T,
        err: &mut Option<Q::Error>,
    ) -> Result<(), SinkError> {
        seq.serialize_element(x).map_err(|e| {
            let text = e.to_string();
            *err = Some(e);
            dir_err(text)
        })
    }
    struct Listing<'a> {
        part: Part,
        source: &'a dyn ListingSource,
        failed: &'a RefCell<Option<SinkError>>,
    }
    impl serde::Serialize for Listing<'_> {
        fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
            let mut seq = s.serialize_seq(None)?;
            let mut err = None;
            let r = match self.part {
                Part::Shards => self.source.shards(&mut |x| put(&mut seq, x, &mut err)),
                Part::Samples => self.source.samples(&mut |x| put(&mut seq, x, &mut err)),
                Part::Skipped => self.source.skipped(&mut |x| put(&mut seq, x, &mut err)),
            };
            if let Some(e) = err {
                return Err(e);
            }
            if let Err(e) = r {
                let text = e.to_string();
                *self.failed.borrow_mut() = Some(e);
                return Err(S::Error::custom(text));
            }
            seq.end()
        }
    }
    struct Whole<'a> {
        job: &'a serde_json::Map<String, serde_json::Value>,
        source: &'a dyn ListingSource,
        failed: &'a RefCell<Option<SinkError>>,
    }
    impl serde::Serialize for Whole<'_> {
        fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
            let mut map = s.serialize_map(Some(self.job.len()))?;
            for (k, v) in self.job {
                let part = match k.as_str() {
                    "shards" => Part::Shards,
                    "samples" => Part::Samples,
                    "skipped" => Part::Skipped,
                    _ => {
                        map.serialize_entry(k, v)?;
                        continue;
                    }
                };
                map.serialize_entry(k, &Listing { part, source: self.source, failed: self.failed })?;
            }
            map.end()
        }
    }
    let whole = Whole { job: &job, source: listing, failed: &failed };
    let path = dir.join(MANIFEST);
    let r = (|| {
        let mut w = std::io::BufWriter::with_capacity(1 << 20, f);
        serde_json::to_writer_pretty(&mut w, &whole)?;
        let f = w.into_inner().map_err(|e| e.into_error())?;
        f.sync_all()?;
        failpoint("manifest-temp");
        dir.rename(&tmp.name, dir, MANIFEST)
    })();
    if let Err(e) = r {
        let _ = dir.remove(&tmp.name);
        return Err(failed.into_inner().unwrap_or_else(|| io_err(&path)(e)));
    }
    dir.sync();
    Ok(())
}

/// An output directory opened when first needed: a run whose input fails
/// before its first sample is written leaves no trace. `--resume` opens at
/// once (it must know what to skip); a plain run checks up front that the
/// directory is empty, without writing.
pub enum Output {
    /// Not touched yet.
    Pending {
        /// The directory.
        dir: OutLoc,
        /// How to open it.
        mode: OpenMode,
        /// The job.
        job: Box<Manifest>,
    },
    /// `--resume`: locked and read, unchanged until the first write.
    Planned(Box<Plan>),
    /// Locked and prepared.
    Open(Box<OutputDir>),
    /// Opening failed: the run is over.
    Gone,
}

impl Output {
    /// Prepares to write `dir`; see [`OutputDir::open`].
    pub fn new(dir: impl Into<OutLoc>, mode: OpenMode, job: Manifest) -> Result<Self, SinkError> {
        let dir = dir.into();
        match mode {
            OpenMode::Resume => return Ok(Output::Planned(Box::new(Plan::new(&dir, mode, job)?))),
            OpenMode::Create => {
                if let Some(d) = dir.open(false)? {
                    let nonce = recorded_nonce(&d);
                    let names = d.names().map_err(io_err(d.path()))?;
                    if names.iter().any(|n| n != LOCK && !temp_of(n, &nonce)) {
                        return Err(not_empty(d.path()));
                    }
                }
            }
            // Checked now too, so a link in place of a part directory is refused before any work.
            OpenMode::Overwrite => {
                dir.open(false)?;
            }
        }
        Ok(Output::Pending { dir, mode, job: Box::new(job) })
    }

    /// The directory, opened now if it was not yet.
    pub fn get(&mut self) -> Result<&mut OutputDir, SinkError> {
        let open = match std::mem::replace(self, Output::Gone) {
            // The job has no samples yet: a small clone.
            Output::Pending { dir, mode, job } => OutputDir::open(dir, mode, *job)?,
            Output::Planned(plan) => plan.apply()?,
            Output::Open(o) => *o,
            Output::Gone => return Err(dir_err("the output failed to open earlier".into())),
        };
        *self = Output::Open(Box::new(open));
        match self {
            Output::Open(o) => Ok(o),
            _ => Err(dir_err("the output failed to open earlier".into())),
        }
    }

    /// Records `sample` as left out (its states are not written), with why.
    pub fn skip_sample(&mut self, sample: &Sample, reason: String) -> Result<(), SinkError> {
        let info = SkippedInfo { index: sample.index, id: sample.id.clone(), tokens: sample.len(), reason };
        self.get()?.skip(info, sample.end.clone());
        Ok(())
    }

    /// The manifest as written so far (the job's, before the directory is opened).
    pub fn manifest(&self) -> &Manifest {
        match self {
            Output::Pending { job, .. } => job,
            Output::Planned(plan) => plan.manifest(),
            Output::Open(o) => o.manifest(),
            Output::Gone => {
                static EMPTY: std::sync::LazyLock<Manifest> = std::sync::LazyLock::new(Manifest::default);
                &EMPTY
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_link_planted_at_this_runs_temporary_name_is_not_followed() {
        let tmp = tempfile::tempdir().unwrap();
        let victim = tmp.path().join("victim");
        std::fs::write(&victim, "precious").unwrap();
        let dir = tmp.path().join("out");
        let out = OutputDir::open(&dir, OpenMode::Create, Manifest::default()).unwrap();
        let name = format!(".shard-00000.safetensors.{}.tmp", out.nonce());
        std::os::unix::fs::symlink(&victim, dir.join(&name)).unwrap();
        let e = out.create_temp("shard-00000.safetensors").expect_err("refused");
        assert!(e.to_string().contains(&name), "{e}");
        assert_eq!(std::fs::read_to_string(&victim).unwrap(), "precious");
    }

    /// A run of `shards` shards of `per` samples each (every third sample
    /// skipped instead), resumed once half-way when `resume`.
    fn run(dir: &Path, shards: usize, per: usize, resume: bool) -> Manifest {
        let job = Manifest {
            schema_version: crate::format::manifest::SCHEMA_VERSION,
            format: "strata".into(),
            capture: vec![crate::format::manifest::CaptureInfo {
                point: "final".into(),
                hf_index: None,
                layer_id: Some(4),
            }],
            ..Default::default()
        };
        let mut index = 0;
        let mut out = OutputDir::open(dir, OpenMode::Create, job.clone()).unwrap();
        for i in 0..shards {
            if resume && i == shards / 2 {
                drop(out);
                out = Plan::new(&dir.into(), OpenMode::Resume, job.clone()).unwrap().apply().unwrap();
                assert_eq!(out.listed().shards, i);
                assert!(out.manifest().shards.is_empty() && out.manifest().samples.is_empty());
            }
            let name = format!("shard-{i:05}.safetensors");
            let (tmp, mut f) = out.create_temp(&name).unwrap();
            f.write_all(b"bytes").unwrap();
            f.sync_all().unwrap();
            let mut samples = Vec::new();
            for _ in 0..per {
                let end = InputPos {
                    samples: index + 1,
                    bytes: 10 * index as u64 + 10,
                    digest: format!("xxh3:{index:016x}"),
                };
                if index % 3 == 2 {
                    out.skip(
                        SkippedInfo { index, id: format!("s{index}"), tokens: 3, reason: "NaN \"x\"\n".into() },
                        end,
                    );
                } else {
                    samples.push(SampleInfo {
                        id: format!("s{index} \u{e9}"),
                        shard: i,
                        tokens: index + 1,
                        checksum: format!("xxh3:{index:016x}"),
                        index: Some(index),
                        finish: vec![],
                    });
                }
                index += 1;
            }
            let end = InputPos { samples: index, bytes: 10 * index as u64, digest: format!("xxh3:{index:016x}") };
            let info = ShardInfo { file: name, samples: samples.len(), bytes: 5, input: None };
            out.commit(tmp, info, samples, end).unwrap();
        }
        out.skip(SkippedInfo { index, id: "last".into(), tokens: 1, reason: "Inf".into() }, InputPos::default());
        let whole = InputPos { samples: index + 1, bytes: 1234, digest: "xxh3:00".into() };
        out.finish(InputInfo { path: "data.jsonl".into(), whole }).unwrap();
        Manifest::read(dir).unwrap()
    }

    #[test]
    fn a_run_holds_no_listing_in_memory() {
        // (On dcadd6d every committed shard and sample stayed in `manifest()` until finish.)
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("out");
        let mut out = OutputDir::open(&dir, OpenMode::Create, Manifest::default()).unwrap();
        for i in 0..3 {
            let name = format!("shard-{i:05}.safetensors");
            let (tmp, f) = out.create_temp(&name).unwrap();
            f.sync_all().unwrap();
            let samples: Vec<SampleInfo> = (0..100)
                .map(|k| SampleInfo {
                    id: format!("s{i}-{k}"),
                    shard: i,
                    tokens: 1,
                    checksum: String::new(),
                    index: Some(100 * i + k),
                    finish: vec![],
                })
                .collect();
            let end = InputPos { samples: 100 * (i + 1), bytes: 0, digest: String::new() };
            out.commit(tmp, ShardInfo { file: name, samples: 100, bytes: 0, input: None }, samples, end).unwrap();
            assert!(out.manifest().shards.is_empty() && out.manifest().samples.is_empty(), "shard {i}");
        }
    }

    #[test]
    fn the_listing_streams_from_the_journal_into_the_manifest_byte_for_byte() {
        for (shards, per, resume) in [(0, 0, false), (1, 1, false), (3, 4, false), (6, 5, true), (4, 1, true)] {
            let tmp = tempfile::tempdir().unwrap();
            let dir = tmp.path().join("out");
            let m = run(&dir, shards, per, resume);
            assert_eq!(m.shards.len(), shards);
            assert_eq!(m.samples.len() + m.skipped.len(), shards * per + 1, "every sample is listed once");
            assert!(m.complete && !dir.join(JOURNAL).exists());
            // What serde writes for the whole manifest at once, byte for byte.
            let whole = serde_json::to_string_pretty(&m).unwrap();
            assert_eq!(
                std::fs::read_to_string(dir.join(MANIFEST)).unwrap(),
                whole,
                "{shards} x {per}, resume {resume}"
            );
        }
    }

    #[test]
    fn names() {
        assert!(strata_named("shard-00012.safetensors") && strata_named("hs_7.safetensors"));
        assert!(strata_named(".shard-00001.safetensors.0123456789abcdef.tmp"));
        assert!(
            !strata_named("shard-notes.safetensors") && !strata_named(".my.tmp") && !strata_named("hs_.safetensors")
        );
        assert!(temp_of(".manifest.json.00000000000000aa.tmp", "00000000000000aa"));
        assert!(!temp_of(".manifest.json.00000000000000aa.tmp", "") && !temp_of(".x.tmp", "bb"));
    }
}
