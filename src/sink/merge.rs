//! `strata merge OUT`: the parts that many processes wrote into
//! `OUT/part-IIII-of-NNNN/` become one dataset, without copying a byte.
//!
//! Every part must be complete and belong to one job (same model and
//! weights, capture points, dtypes, backend, input, and parts that tile the
//! input). Every file a part lists must lie inside that part, reached
//! without following a link, and be a regular file of the listed size (the
//! checksums of its contents are `strata verify`'s job). Where the input can
//! be read, each part's byte range is read again and must have the digest
//! the part recorded. All of this is checked before anything in `OUT`
//! changes. Then:
//! - native format: `OUT/manifest.json` indexes every part's shards in place;
//! - speculators format: `OUT/hidden_states/hs_{i}` are hard links to the
//!   parts' files, numbered through in part order, and the dataset table is
//!   built over them, so `OUT` is the directory the trainer loads.
//!
//! The merged manifest is removed first and written last: an interrupted
//! merge leaves no complete-looking dataset, and merging again redoes it.
//! Merging is idempotent; a part rerun later with `--resume` (its own files
//! stay as they are) is picked up by merging again.

use super::output::{persist_manifest_streamed, ListingSource, OutputDir, Temp};
use super::{hf_dataset, io_err, SinkError};
use crate::files::{Dir, Kind};
use crate::format::manifest::{
    Entry, InputInfo, InputPos, Manifest, MergedPart, PartInfo, ReadEachError, SampleInfo, ShardInfo, SkippedInfo,
    JOURNAL, MANIFEST,
};
use crate::format::parts;
use std::collections::HashMap;
use std::io::Read;
use std::path::{Path, PathBuf};

/// What a merge did.
#[derive(Clone, Debug, Default)]
pub struct MergeReport {
    /// `strata` or `speculators`.
    pub format: String,
    /// The storage dtype.
    pub dtype: String,
    /// Parts merged.
    pub parts: usize,
    /// Samples (rows) in all.
    pub samples: usize,
    /// Samples the parts left out (non-finite states).
    pub skipped: usize,
    /// Shard files indexed (native) or linked (speculators); each was checked
    /// to be a regular file of its listed size (not its checksum).
    pub files: usize,
    /// Bytes those files hold (none copied).
    pub bytes: u64,
    /// How the parts were checked against the input.
    pub input: InputCheck,
}

/// Whether the parts' byte ranges were read again from the input.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum InputCheck {
    /// Every part's range has the digest the part recorded; this many bytes were read.
    Checked {
        /// The input read.
        path: String,
        /// Its bytes.
        bytes: u64,
    },
    /// The input could not be read here: why.
    Unchecked(String),
    /// Not looked at (nothing merged).
    #[default]
    NotRun,
}

fn refuse(msg: String) -> SinkError {
    SinkError::Directory(msg)
}

/// Problems quoted at most in one refusal.
const QUOTED: usize = 20;

/// A part as merge holds it: its job (the manifest without its listing,
/// which is read from the part's files again, one entry at a time, each
/// time it is needed) and the counts of its listing.
struct Part {
    name: String,
    dir: Dir,
    job: Manifest,
    /// Files (shards) it lists.
    files: usize,
    /// Samples and samples left out it lists.
    samples: usize,
    skipped: usize,
}

impl Part {
    /// Gives every entry the part lists to `each`, in order.
    fn each(&self, each: &mut dyn FnMut(Entry) -> Result<(), SinkError>) -> Result<(), SinkError> {
        match Manifest::read_each(&self.dir, each) {
            Err(ReadEachError::Each(e)) => Err(e),
            Err(ReadEachError::Manifest(e)) => Err(refuse(format!("{}: {e}", self.name))),
            Ok(_) => Ok(()),
        }
    }
}

/// Merges the parts in `dir`; `input` is where the input lies now (default:
/// the path the parts recorded). See the module documentation. No part's
/// listing is ever whole in memory: each is read again, an entry at a time,
/// for each check and for each list the merged manifest holds.
pub fn merge(dir: &Path, input: Option<&Path>) -> Result<MergeReport, SinkError> {
    let _span = tracing::info_span!("merge", dir = %dir.display()).entered();
    if !dir.is_dir() {
        return Err(refuse(format!("{} is not a directory", dir.display())));
    }
    // OUT itself may be a link; nothing inside it is followed.
    let root = Dir::open(dir).map_err(io_err(dir))?;
    // One writer at a time: a second merge, or a one-process run into OUT.
    let (_lock, _) = OutputDir::lock(&root)?;
    remove_stale_temps(&root)?;
    match Manifest::read_each(&root, &mut |_| Ok::<(), std::convert::Infallible>(())) {
        Ok(m) if m.merged.is_empty() => {
            return Err(refuse(format!(
                "{} holds a dataset one process wrote ({MANIFEST} lists no parts): merge joins the parts in the \
                 --out the parts were written into",
                dir.display()
            )))
        }
        Err(e) if root.kind(MANIFEST).ok().flatten().is_some() => {
            return Err(refuse(format!("{e}: move it away to merge the parts in {}", dir.display())))
        }
        _ => {}
    }
    let (count, found) = list_parts(&root)?;
    let mut problems = Vec::new();
    let mut parts = Vec::with_capacity(found.len());
    // Each part's lock, held through the merge: a part that is being (re)written is not merged.
    let mut locks = Vec::with_capacity(found.len());
    let mut present = found.iter().peekable();
    let mut missing = 0;
    for i in 0..count {
        let name = parts::dir_name(i, count);
        let rerun = format!("rerun it with the same command and --part-index {i} --num-parts {count} --resume");
        let kind = match present.next_if(|(j, _)| *j == i) {
            Some((_, kind)) => *kind,
            None => {
                missing += 1;
                if problems.len() < QUOTED {
                    problems.push(format!("{name} is missing: {rerun}"));
                } else if present.peek().is_none() {
                    break;
                }
                continue;
            }
        };
        if kind != Kind::Dir {
            problems.push(format!(
                "{name} is {}, not a directory: merge reads only part directories that lie inside {} (links are \
                 not followed); put the part's directory itself there",
                kind.describe(),
                dir.display()
            ));
            continue;
        }
        let part = match root.sub(&name, false) {
            Ok(p) => p,
            Err(e) => {
                problems.push(format!("{name}: {e}"));
                continue;
            }
        };
        match OutputDir::lock(&part) {
            Ok((lock, _)) => locks.push(lock),
            Err(e) => {
                problems.push(format!("{e}"));
                continue;
            }
        }
        let (mut files, mut samples, mut skipped) = (0, 0, 0);
        let read = Manifest::read_each(&part, &mut |e| {
            match e {
                Entry::Shard(_) => files += 1,
                Entry::Sample(_) => samples += 1,
                Entry::Skipped(_) => skipped += 1,
            }
            Ok::<(), std::convert::Infallible>(())
        });
        match read {
            Err(e) => problems.push(format!("{name} has no readable manifest ({e}): {rerun}")),
            Ok(m) if !m.complete => {
                problems.push(format!("{name} is incomplete ({samples} samples written so far): {rerun}"))
            }
            Ok(job) => parts.push(Part { name, dir: part, job, files, samples, skipped }),
        }
    }
    if !problems.is_empty() {
        let shown = problems.len().min(QUOTED);
        return Err(refuse(format!(
            "cannot merge {}: of {count} parts, {missing} are missing and {} present ones are not ready \
             (the first {shown} problems):\n  {}",
            dir.display(),
            problems.len() - missing.min(problems.len()),
            problems[..shown].join("\n  ")
        )));
    }
    let infos = check_one_job(&parts)?;
    // Every listed file, and every id, before anything changes.
    let speculators = parts[0].job.format == "speculators";
    let found = check_files(dir, &parts, speculators)?;
    let input_check = check_input(&parts, &infos, input)?;

    let total_files: usize = parts.iter().map(|p| p.files).sum();
    // The speculators rows' directory, entered (never through a link) before anything changes;
    // a directory where a row's link goes would stop the merge half-way: refused now.
    let hidden = match speculators {
        true => Some(root.sub("hidden_states", true).map_err(io_err(&dir.join("hidden_states")))?),
        false => None,
    };
    if let Some(hs) = &hidden {
        for row in 0..total_files {
            let name = super::SpeculatorsSink::file_name(row);
            let name = name.rsplit('/').next().unwrap_or(&name);
            if hs.kind(name).map_err(io_err(&hs.join(name)))? == Some(Kind::Dir) {
                return Err(refuse(format!("{} is a directory; move it away", hs.join(name).display())));
            }
        }
    }

    // From here on the directory changes: the old merged manifest and the
    // trainer's table go first, so nothing looks complete until the end.
    for f in [MANIFEST, JOURNAL, hf_dataset::DATA_FILE, hf_dataset::INFO_FILE, hf_dataset::STATE_FILE] {
        remove_if_file(&root, f)?;
    }
    // The trainer's vocabulary files (its cache, or an earlier merge's) were
    // counted from the rows as they were: they go too, and are written anew
    // from every part's rows where the parts asked for them.
    for name in root.names().map_err(io_err(root.path()))? {
        if super::draft_vocab::is_trainer_file(&name) {
            remove_if_file(&root, &name)?;
        }
    }
    root.sync();

    let first = &parts[0].job;
    let mut merged = Manifest {
        part: None,
        nonce: String::new(),
        complete: true,
        shards: Vec::new(),
        samples: Vec::new(),
        skipped: Vec::new(),
        merged: Vec::with_capacity(count),
        ..first.clone_job()
    };
    // Every size a part asked for (`--draft-vocab-size` does not change the files).
    let mut sizes: Vec<usize> = parts.iter().flat_map(|p| p.job.draft_vocab_sizes.iter().copied()).collect();
    sizes.sort_unstable();
    sizes.dedup();
    merged.draft_vocab_sizes = sizes;
    let report = MergeReport {
        format: first.format.clone(),
        dtype: first.dtype.clone(),
        parts: count,
        input: input_check,
        samples: parts.iter().map(|p| p.samples).sum(),
        skipped: parts.iter().map(|p| p.skipped).sum(),
        files: total_files,
        bytes: found.bytes,
    };
    // Where each part's rows and files start in the merged lists.
    let mut rows = 0usize;
    let mut bases = Vec::with_capacity(parts.len());
    let mut files_before = 0usize;
    for (p, info) in parts.iter().zip(infos) {
        let samples = p.job.consumed();
        bases.push((files_before, rows));
        merged.merged.push(MergedPart { dir: p.name.clone(), part: info, samples, first_sample: rows });
        rows = rows.saturating_add(samples);
        files_before += p.files;
    }
    let input = first.input.as_ref().map_or_else(String::new, |i| i.path.clone());
    let whole = merged.merged.last().map_or(0, |p| p.part.input_bytes);
    // The whole input's digest would need a full read; each part records its own.
    merged.input =
        Some(InputInfo { path: input, whole: InputPos { samples: rows, bytes: whole, digest: String::new() } });
    if let Some(hs) = &hidden {
        // Row i of the merged table is file i: a hard link to the part's file, checked to be the one checked.
        let mut row = 0usize;
        for p in &parts {
            let mut dirs: HashMap<String, Dir> = HashMap::new();
            p.each(&mut |e| {
                let Entry::Shard(s) = e else { return Ok(()) };
                let (parent, file) = s.file.rsplit_once('/').map_or(("", s.file.as_str()), |(d, f)| (d, f));
                if !dirs.contains_key(parent) {
                    let (sub, _) = p.dir.walk(&s.file, false).map_err(io_err(&p.dir.join(&s.file)))?;
                    dirs.insert(parent.to_string(), sub);
                }
                let to = super::SpeculatorsSink::file_name(row);
                link(&dirs[parent], file, found.identities[row], hs, to.rsplit('/').next().unwrap_or(&to))?;
                row += 1;
                Ok(())
            })?;
        }
        // Links an earlier merge with more rows made past the last row go.
        for name in hs.names().map_err(io_err(hs.path()))? {
            let row = name.strip_prefix("hs_").and_then(|n| n.strip_suffix(".safetensors"));
            if row.and_then(|r| r.parse::<usize>().ok()).is_some_and(|r| r >= total_files) {
                remove_if_file(hs, &name)?;
            }
        }
        let temp = |name: &str| {
            let tmp = format!(".{name}.merge-{}.tmp", std::process::id());
            remove_if_file(&root, &tmp)?;
            let path = root.join(&tmp);
            let f = root.create_new(&tmp).map_err(io_err(&path))?;
            Ok((Temp::new(tmp, path), f))
        };
        let place = |tmp: &Temp, name: &str| root.rename(&tmp.name, &root, name).map_err(io_err(&root.join(name)));
        let discard = |tmp: &Temp| {
            let _ = root.remove(&tmp.name);
        };
        let files = (0..total_files)
            .map(|i| Ok(ShardInfo { file: super::SpeculatorsSink::file_name(i), samples: 1, bytes: 0, input: None }));
        super::speculators::write_table(&root, &merged, files, temp, place, discard)?;
        hs.sync();
    }
    let listing = PartsListing { parts: &parts, bases: &bases, speculators };
    write_manifest(&root, &merged, &listing)?;
    Ok(report)
}

/// The merged listing, read from the parts as it is written: each part's
/// files (linked rows `hidden_states/hs_{i}` in the speculators format,
/// else `part-IIII-of-NNNN/FILE`), its samples and its samples left out,
/// renumbered from where the part starts.
struct PartsListing<'a> {
    parts: &'a [Part],
    /// Per part: the files and the rows before it.
    bases: &'a [(usize, usize)],
    speculators: bool,
}

impl ListingSource for PartsListing<'_> {
    fn shards(&self, f: &mut dyn FnMut(&ShardInfo) -> Result<(), SinkError>) -> Result<(), SinkError> {
        let mut row = 0usize;
        for p in self.parts {
            p.each(&mut |e| {
                let Entry::Shard(s) = e else { return Ok(()) };
                let file = match self.speculators {
                    true => super::SpeculatorsSink::file_name(row),
                    false => format!("{}/{}", p.name, s.file),
                };
                row += 1;
                f(&ShardInfo { file, samples: s.samples, bytes: s.bytes, input: None })
            })?;
        }
        Ok(())
    }

    fn samples(&self, f: &mut dyn FnMut(&SampleInfo) -> Result<(), SinkError>) -> Result<(), SinkError> {
        for (p, &(files, rows)) in self.parts.iter().zip(self.bases) {
            p.each(&mut |e| {
                let Entry::Sample(s) = e else { return Ok(()) };
                f(&SampleInfo {
                    shard: files.saturating_add(s.shard),
                    index: Some(rows.saturating_add(s.index.unwrap_or(0))),
                    ..s
                })
            })?;
        }
        Ok(())
    }

    fn skipped(&self, f: &mut dyn FnMut(&SkippedInfo) -> Result<(), SinkError>) -> Result<(), SinkError> {
        for (p, &(_, rows)) in self.parts.iter().zip(self.bases) {
            p.each(&mut |e| {
                let Entry::Skipped(s) = e else { return Ok(()) };
                f(&SkippedInfo { index: rows.saturating_add(s.index), ..s })
            })?;
        }
        Ok(())
    }
}

/// The part directories in `root` (their index and what each name is, links
/// not followed), and the count of parts they say.
fn list_parts(root: &Dir) -> Result<(usize, Vec<(usize, Kind)>), SinkError> {
    let mut counts: HashMap<usize, Vec<(usize, Kind)>> = HashMap::new();
    for name in root.names().map_err(io_err(root.path()))? {
        if let Some((i, n)) = parts::parse_dir_name(&name) {
            if let Some(kind) = root.kind(&name).map_err(io_err(&root.join(&name)))? {
                counts.entry(n).or_default().push((i, kind));
            }
        }
    }
    let dir = root.path();
    match counts.len() {
        0 => Err(refuse(format!(
            "{} holds no part directories (part-IIII-of-NNNN): nothing to merge. Parts are written by \
             `strata extract --out {} --part-index I --num-parts N` or under a launcher (Slurm, torchrun, Kubernetes)",
            dir.display(),
            dir.display()
        ))),
        1 => {
            let (n, mut found) = counts.into_iter().next().expect("one entry");
            found.sort_unstable_by_key(|(i, _)| *i);
            if let Some((i, _)) = found.iter().find(|(i, _)| *i >= n) {
                return Err(refuse(format!("{} is not a part of {n}", parts::dir_name(*i, n))));
            }
            Ok((n, found))
        }
        _ => {
            let mut ns: Vec<usize> = counts.keys().copied().collect();
            ns.sort_unstable();
            Err(refuse(format!(
                "{} holds parts of {} different splits (into {} parts): one output directory per split",
                dir.display(),
                ns.len(),
                ns.iter().map(usize::to_string).collect::<Vec<_>>().join(", ")
            )))
        }
    }
}

/// Every part describes the same job, and the parts tile one input in order.
fn check_one_job(parts: &[Part]) -> Result<Vec<PartInfo>, SinkError> {
    let (name0, first) = (&parts[0].name, &parts[0].job);
    let job = |m: &Manifest| Manifest { part: None, ..m.clone_job() };
    let base = job(first);
    let mut infos = Vec::with_capacity(parts.len());
    let mut at = 0u64;
    for (i, Part { name, job: m, .. }) in parts.iter().enumerate() {
        let p = m.part.clone().ok_or_else(|| {
            refuse(format!("{name}: its manifest records no part of the input; it was not written as part {i}"))
        })?;
        if i > 0 {
            base.same_job(&job(m)).map_err(|d| {
                refuse(format!(
                    "{name} is not the same job as {name0}: {}. Rerun {name} with {} like {name0} and \
                     --overwrite (or rerun every part that differs so)",
                    d.between(name0, name),
                    d.remedy
                ))
            })?;
        }
        let f = &first.part.as_ref().expect("checked at i = 0");
        let differs = if !(p.start <= p.end && p.end <= p.input_bytes) {
            Some(format!("its bytes {}..{} are not a range of the input's {}", p.start, p.end, p.input_bytes))
        } else if p.index != i || p.count != parts.len() {
            Some(format!("it is part {} of {}", p.index, p.count))
        } else if (p.input_bytes, &p.input_fingerprint) != (f.input_bytes, &f.input_fingerprint) {
            Some(format!(
                "its input has {} bytes (fingerprint {}), {name0}'s {} ({})",
                p.input_bytes, p.input_fingerprint, f.input_bytes, f.input_fingerprint
            ))
        } else if p.start != at {
            Some(format!("it starts at byte {} of the input, but the part before it ends at {at}", p.start))
        } else if m.input.as_ref().is_some_and(|i| i.whole.bytes != p.end - p.start) {
            Some(format!(
                "it read {} bytes of its {}-byte slice",
                m.input.as_ref().map_or(0, |i| i.whole.bytes),
                p.end - p.start
            ))
        } else {
            None
        };
        if let Some(d) = differs {
            return Err(refuse(format!("{name} does not fit the split: {d}")));
        }
        at = p.end;
        infos.push(p);
    }
    let last = infos.last().expect("at least one part");
    if at != last.input_bytes {
        return Err(refuse(format!("the parts end at byte {at} of the input's {}", last.input_bytes)));
    }
    Ok(infos)
}

/// What checking the parts' files found: the identity (device, inode) of
/// each file, in order, when the files are to be linked (speculators), and
/// the bytes of them all.
struct Found {
    identities: Vec<(u64, u64)>,
    bytes: u64,
}

/// Each file every part lists, in order: it must lie inside its part (no
/// absolute path, no `..`, no link on the way or at the end) and be a
/// regular file of the listed size. And every sample id is listed once in
/// all the parts (kept as 128-bit digests keyed by a random seed, so that
/// ids cannot be chosen to collide).
fn check_files(dir: &Path, parts: &[Part], keep_identities: bool) -> Result<Found, SinkError> {
    let mut found = Found { identities: Vec::new(), bytes: 0 };
    let mut problems = Vec::new();
    let mut bad = 0usize;
    let seed = {
        let mut b = [0u8; 8];
        let t = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos());
        if rustix::rand::getrandom(&mut b, rustix::rand::GetRandomFlags::empty()).is_err() {
            b = (t as u64 ^ std::process::id() as u64).to_le_bytes();
        }
        u64::from_le_bytes(b)
    };
    let mut ids = crate::pipeline::source::IdSet::default();
    for (i, p) in parts.iter().enumerate() {
        let name = &p.name;
        let rerun = format!("rerun the part with --part-index {i} --num-parts {} --resume", parts.len());
        // Directory path inside the part -> its handle (one per directory, not per file).
        let mut opened: HashMap<String, Dir> = HashMap::new();
        p.each(&mut |e| {
            let s = match e {
                Entry::Shard(s) => s,
                Entry::Sample(s) => {
                    if !ids.insert(xxhash_rust::xxh3::xxh3_128_with_seed(s.id.as_bytes(), seed)) {
                        return Err(refuse(format!(
                            "sample id {} is in two parts (the second is {name}): the parts are not one input's",
                            crate::quote(&s.id)
                        )));
                    }
                    return Ok(());
                }
                Entry::Skipped(_) => return Ok(()),
            };
            let shown = format!("{name}/{}", crate::clip(&s.file, 2 * crate::QUOTE_MAX));
            let parent = s.file.rsplit_once('/').map_or("", |(d, _)| d).to_string();
            let file = s.file.rsplit('/').next().unwrap_or_default().to_string();
            let at = match opened.get(&parent).filter(|_| !s.file.starts_with('/')) {
                Some(_) => Ok(()),
                None => p.dir.walk(&s.file, false).map(|(sub, _)| {
                    opened.insert(parent.clone(), sub);
                }),
            };
            let problem = match at {
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => Some(format!("{shown} is missing: {rerun}")),
                Err(e) => Some(format!("{shown}: {e}")),
                Ok(()) => {
                    let sub = &opened[&parent];
                    match sub.kind(&file) {
                        Err(e) => Some(format!("{shown}: {e}")),
                        Ok(None) => Some(format!("{shown} is missing: {rerun}")),
                        Ok(Some(Kind::File(len))) if len == s.bytes => match sub.identity(&file) {
                            Ok(Some(id)) => {
                                found.bytes += s.bytes;
                                if keep_identities {
                                    found.identities.push(id);
                                }
                                None
                            }
                            Ok(None) => Some(format!("{shown} is missing: {rerun}")),
                            Err(e) => Some(format!("{shown}: {e}")),
                        },
                        Ok(Some(Kind::File(len))) => Some(format!(
                            "{shown} has {len} bytes, but the part's manifest lists {} (truncated or replaced): \
                             {rerun}",
                            s.bytes
                        )),
                        Ok(Some(k)) => Some(format!(
                            "{shown} is {}, not a regular file: merge takes only the part's own files, never \
                             through a link; move it away and {rerun}",
                            k.describe()
                        )),
                    }
                }
            };
            if let Some(p) = problem {
                bad += 1;
                if problems.len() < QUOTED {
                    problems.push(p);
                }
            }
            Ok(())
        })?;
    }
    if bad > 0 {
        return Err(refuse(format!(
            "cannot merge {}: {bad} of the files the parts list are not there as listed (the first {}):\n  {}",
            dir.display(),
            problems.len(),
            problems.join("\n  ")
        )));
    }
    Ok(found)
}

/// Reads the input once and checks each part's byte range against the
/// digest the part recorded of what it read (its manifest's `input`).
fn check_input(parts: &[Part], infos: &[PartInfo], input: Option<&Path>) -> Result<InputCheck, SinkError> {
    let recorded = parts[0].job.input.as_ref().map(|i| i.path.clone()).unwrap_or_default();
    let path: PathBuf = input.map_or_else(|| PathBuf::from(&recorded), Path::to_path_buf);
    let total = infos.last().map_or(0, |p| p.input_bytes);
    let unchecked = |why: String| {
        tracing::warn!("{why}");
        Ok(InputCheck::Unchecked(why))
    };
    let f = match crate::files::open_regular(&path) {
        Ok(f) => f,
        Err(e) => {
            return unchecked(format!(
                "could not check the parts against their input: {} cannot be read here ({e}); pass --data FILE \
                 to say where it is",
                crate::clip(&path.display().to_string(), 4 * crate::QUOTE_MAX)
            ))
        }
    };
    let len = f.metadata().map_err(io_err(&path))?.len();
    if len != total {
        return Err(refuse(format!(
            "the input {} is {len} bytes now, but the parts were made from {total} bytes: it changed after the \
             parts ran (rerun them with --overwrite), or pass --data with the input they were made from",
            path.display()
        )));
    }
    let mut r = std::io::BufReader::with_capacity(1 << 20, f);
    let mut buf = vec![0u8; 1 << 20];
    let mut unrecorded = Vec::new();
    for (Part { name, job: m, .. }, p) in parts.iter().zip(infos) {
        // Every range is read, so the next one starts where it should.
        let mut h = xxhash_rust::xxh3::Xxh3::new();
        let mut left = p.end - p.start;
        while left > 0 {
            let n = (left as usize).min(buf.len());
            r.read_exact(&mut buf[..n]).map_err(io_err(&path))?;
            h.update(&buf[..n]);
            left -= n as u64;
        }
        let Some(want) = m.input.as_ref().map(|i| &i.whole.digest).filter(|d| !d.is_empty()) else {
            unrecorded.push(name.as_str());
            continue;
        };
        let got = format!("xxh3:{:016x}", h.digest());
        if &got != want {
            return Err(refuse(format!(
                "{name} was made from other bytes than the input holds now: bytes {}..{} of {} have digest {got}, \
                 the part read {want}. The input changed after that part ran: rerun it with --overwrite (or \
                 pass --data with the input the parts were made from)",
                p.start,
                p.end,
                path.display()
            )));
        }
    }
    if !unrecorded.is_empty() {
        return unchecked(format!(
            "could not check {} against the input: their manifests record no digest of what they read \
             (written by an older strata)",
            unrecorded.join(", ")
        ));
    }
    Ok(InputCheck::Checked { path: path.display().to_string(), bytes: len })
}

/// `to` in `dir` becomes a hard link to `from` in `from_dir`, replacing an
/// earlier merge's link at once (a link under a temporary name, renamed
/// over it); nothing is done when it is that file already.
fn link(from_dir: &Dir, from: &str, checked: (u64, u64), dir: &Dir, to: &str) -> Result<(), SinkError> {
    if dir.identity(to).ok().flatten() == Some(checked) {
        return Ok(());
    }
    let tmp = format!(".{to}.merge-{}.tmp", std::process::id());
    remove_if_file(dir, &tmp)?;
    from_dir.hard_link(from, dir, &tmp).map_err(|e| {
        let why = match e.kind() {
            std::io::ErrorKind::NotFound => {
                format!("{} is missing: rerun its part with --resume", from_dir.join(from).display())
            }
            _ => format!(
                "{e}. The merge links the parts' files (it never copies them): the parts must lie on one \
                 filesystem that has hard links"
            ),
        };
        refuse(format!("cannot link {} to {}: {why}", dir.join(to).display(), from_dir.join(from).display()))
    })?;
    // What was linked must be the file checked, not one put in its place since.
    if dir.identity(&tmp).ok().flatten() != Some(checked) {
        let _ = dir.remove(&tmp);
        return Err(refuse(format!(
            "{} changed after merge checked it (another file, or a link, was put in its place); merge again",
            from_dir.join(from).display()
        )));
    }
    let r = dir.rename(&tmp, dir, to).map_err(io_err(&dir.join(to)));
    // A rename between two links to one file does nothing: the temporary name would stay.
    let _ = dir.remove(&tmp);
    r
}

/// Removes the temporary files an interrupted merge left (`.NAME.merge-PID.tmp`).
fn remove_stale_temps(root: &Dir) -> Result<(), SinkError> {
    let hidden = match root.kind("hidden_states") {
        Ok(Some(Kind::Dir)) => Some(root.sub("hidden_states", false).map_err(io_err(&root.join("hidden_states")))?),
        _ => None,
    };
    for d in std::iter::once(root).chain(hidden.as_ref()) {
        for name in d.names().map_err(io_err(d.path()))? {
            if name.starts_with('.') && name.ends_with(".tmp") && name.contains(".merge-") {
                remove_if_file(d, &name)?;
            }
        }
    }
    Ok(())
}

/// Removes a regular file (or a link); `Ok(false)` when there was none.
fn remove_if_file(dir: &Dir, name: &str) -> Result<bool, SinkError> {
    let path = dir.join(name);
    match dir.kind(name).map_err(io_err(&path))? {
        Some(Kind::Dir) => Err(refuse(format!("{} is a directory; move it away", path.display()))),
        Some(_) => dir.remove(name).map_err(io_err(&path)),
        None => Ok(false),
    }
}

fn write_manifest(dir: &Dir, m: &Manifest, listing: &dyn ListingSource) -> Result<(), SinkError> {
    let tmp = format!(".{MANIFEST}.merge-{}.tmp", std::process::id());
    remove_if_file(dir, &tmp)?;
    let path = dir.join(&tmp);
    let f = dir.create_new(&tmp).map_err(io_err(&path))?;
    persist_manifest_streamed(m, listing, f, &Temp::new(tmp, path), dir)
}
