//! `strata merge OUT`: the parts that many processes wrote into
//! `OUT/part-IIII-of-NNNN/` become one dataset, without copying a byte.
//!
//! Every part must be complete and belong to one job (same model and
//! weights, capture points, dtypes, backend, input, and parts that tile the
//! input). Then:
//! - native format: `OUT/manifest.json` indexes every part's shards in place;
//! - speculators format: `OUT/hidden_states/hs_{i}` are hard links to the
//!   parts' files, numbered through in part order, and the dataset table is
//!   built over them, so `OUT` is the directory the trainer loads.
//!
//! The merged manifest is removed first and written last: an interrupted
//! merge leaves no complete-looking dataset, and merging again redoes it.
//! Merging is idempotent; a part rerun later with `--resume` (its own files
//! stay as they are) is picked up by merging again.

use super::output::{persist_manifest, sync_dir, OutputDir};
use super::{hf_dataset, io_err, SinkError};
use crate::dataset::manifest::{
    InputInfo, InputPos, Manifest, MergedPart, PartInfo, SampleInfo, ShardInfo, JOURNAL, MANIFEST,
};
use crate::input::parts;
use std::collections::HashMap;
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
    /// Shard files indexed (native) or linked (speculators).
    pub files: usize,
    /// Bytes those files hold (none copied).
    pub bytes: u64,
}

fn refuse(msg: String) -> SinkError {
    SinkError::Directory(msg)
}

/// Merges the parts in `dir`; see the module documentation.
pub fn merge(dir: &Path) -> Result<MergeReport, SinkError> {
    let _span = tracing::info_span!("merge", dir = %dir.display()).entered();
    if !dir.is_dir() {
        return Err(refuse(format!("{} is not a directory", dir.display())));
    }
    // One writer at a time: a second merge, or a one-process run into OUT.
    let (_lock, _) = OutputDir::lock(dir)?;
    remove_stale_temps(dir)?;
    match Manifest::read(dir) {
        Ok(m) if m.merged.is_empty() => {
            return Err(refuse(format!(
                "{} holds a dataset one process wrote ({MANIFEST} lists no parts): merge joins the parts in the \
                 --out the parts were written into",
                dir.display()
            )))
        }
        Err(e) if dir.join(MANIFEST).exists() => {
            return Err(refuse(format!("{e}: move it away to merge the parts in {}", dir.display())))
        }
        _ => {}
    }
    let (count, found) = list_parts(dir)?;
    let mut problems = Vec::new();
    let mut manifests = Vec::with_capacity(found.len());
    // Each part's lock, held through the merge: a part that is being (re)written is not merged.
    let mut locks = Vec::with_capacity(found.len());
    let mut present = found.iter().copied().peekable();
    for i in 0..count {
        let name = parts::dir_name(i, count);
        let rerun = format!("rerun it with the same command and --part-index {i} --num-parts {count} --resume");
        if present.next_if_eq(&i).is_none() {
            if problems.len() < 20 {
                problems.push(format!("{name} is missing: {rerun}"));
            } else if present.peek().is_none() {
                break;
            }
            continue;
        }
        match OutputDir::lock(&dir.join(&name)) {
            Ok((lock, _)) => locks.push(lock),
            Err(e) => {
                problems.push(format!("{e}"));
                continue;
            }
        }
        match Manifest::read(&dir.join(&name)) {
            Err(e) => problems.push(format!("{name} has no readable manifest ({e}): {rerun}")),
            Ok(m) if !m.complete => {
                problems.push(format!("{name} is incomplete ({} samples written so far): {rerun}", m.samples.len()))
            }
            Ok(m) => manifests.push((name, m)),
        }
    }
    if !problems.is_empty() {
        let missing = count - found.len();
        let shown = problems.len().min(20);
        return Err(refuse(format!(
            "cannot merge {}: of {count} parts, {missing} are missing and {} present ones are not ready \
             (the first {shown} problems):\n  {}",
            dir.display(),
            problems.len().saturating_sub(missing.min(20)),
            problems[..shown].join("\n  ")
        )));
    }
    let infos = check_one_job(&manifests)?;

    // From here on the directory changes: the old merged manifest and the
    // trainer's table go first, so nothing looks complete until the end.
    for f in [MANIFEST, JOURNAL, hf_dataset::DATA_FILE, hf_dataset::INFO_FILE, hf_dataset::STATE_FILE] {
        remove_if_file(&dir.join(f))?;
    }
    sync_dir(dir);

    let first = &manifests[0].1;
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
    let speculators = first.format == "speculators";
    let mut report =
        MergeReport { format: first.format.clone(), dtype: first.dtype.clone(), parts: count, ..Default::default() };
    // Ids are unique across parts: 64-bit digests, with the strings compared on a hit.
    let mut ids: HashMap<u64, usize> = HashMap::new();
    let mut rows = 0usize;
    for ((name, m), part) in manifests.iter().zip(infos) {
        let first_sample = rows;
        let shard_base = merged.shards.len();
        for (k, s) in m.shards.iter().enumerate() {
            let file = if speculators {
                let to = super::SpeculatorsSink::file_name(shard_base + k);
                link(&dir.join(name).join(&s.file), &dir.join(&to))?;
                to
            } else {
                format!("{name}/{}", s.file)
            };
            report.bytes += s.bytes;
            merged.shards.push(ShardInfo { file, samples: s.samples, bytes: s.bytes, input: None });
        }
        for s in &m.samples {
            let at = merged.samples.len();
            if let Some(&other) = ids.get(&xxhash_rust::xxh3::xxh3_64(s.id.as_bytes())) {
                if merged.samples[other].id == s.id {
                    return Err(refuse(format!(
                        "sample id {} is in two parts (the second is {name}): the parts are not one input's",
                        crate::quote(&s.id)
                    )));
                }
            }
            ids.insert(xxhash_rust::xxh3::xxh3_64(s.id.as_bytes()), at);
            merged.samples.push(SampleInfo {
                id: s.id.clone(),
                shard: shard_base + s.shard,
                tokens: s.tokens,
                checksum: s.checksum.clone(),
                index: Some(first_sample + s.index.unwrap_or(0)),
            });
        }
        for s in &m.skipped {
            merged.skipped.push(crate::dataset::manifest::SkippedInfo { index: first_sample + s.index, ..s.clone() });
        }
        let samples = m.consumed();
        rows += samples;
        merged.merged.push(MergedPart { dir: name.clone(), part, samples, first_sample });
    }
    report.samples = merged.samples.len();
    report.skipped = merged.skipped.len();
    report.files = merged.shards.len();
    let input = first.input.as_ref().map_or_else(String::new, |i| i.path.clone());
    let whole = merged.merged.last().map_or(0, |p| p.part.input_bytes);
    // The whole input's digest would need a full read; each part records its own.
    merged.input =
        Some(InputInfo { path: input, whole: InputPos { samples: rows, bytes: whole, digest: String::new() } });
    if speculators {
        // Links an earlier merge with more rows made past the last row go.
        let sub = dir.join("hidden_states");
        std::fs::create_dir_all(&sub).map_err(io_err(&sub))?;
        for e in std::fs::read_dir(&sub).map_err(io_err(&sub))? {
            let name = e.map_err(io_err(&sub))?.file_name().to_string_lossy().to_string();
            let row = name.strip_prefix("hs_").and_then(|n| n.strip_suffix(".safetensors"));
            if row.and_then(|r| r.parse::<usize>().ok()).is_some_and(|r| r >= merged.shards.len()) {
                remove_if_file(&sub.join(&name))?;
            }
        }
        let temp = |name: &str| {
            let tmp = dir.join(format!(".{name}.merge-{}.tmp", std::process::id()));
            let _ = std::fs::remove_file(&tmp);
            let f = crate::files::create_exclusive(&tmp).map_err(io_err(&tmp))?;
            Ok((tmp, f))
        };
        let place = |tmp: &Path, name: &str| {
            let path = dir.join(name);
            std::fs::rename(tmp, &path).map_err(io_err(&path))?;
            Ok(())
        };
        super::speculators::write_table(dir, &merged.shards, merged.dtype == "fp8", temp, place)?;
        sync_dir(&sub);
    }
    write_manifest(dir, &merged)?;
    Ok(report)
}

/// The part directories in `dir`: their count and the indices present.
fn list_parts(dir: &Path) -> Result<(usize, Vec<usize>), SinkError> {
    let mut counts: HashMap<usize, Vec<usize>> = HashMap::new();
    for e in std::fs::read_dir(dir).map_err(io_err(dir))? {
        let e = e.map_err(io_err(dir))?;
        if let Some((i, n)) = parts::parse_dir_name(&e.file_name().to_string_lossy()) {
            if e.file_type().map_err(io_err(&e.path()))?.is_dir() {
                counts.entry(n).or_default().push(i);
            }
        }
    }
    match counts.len() {
        0 => Err(refuse(format!(
            "{} holds no part directories (part-IIII-of-NNNN): nothing to merge. Parts are written by \
             `strata extract --out {} --part-index I --num-parts N` or under a launcher (Slurm, torchrun, Kubernetes)",
            dir.display(),
            dir.display()
        ))),
        1 => {
            let (n, mut found) = counts.into_iter().next().expect("one entry");
            found.sort_unstable();
            if let Some(&i) = found.iter().find(|&&i| i >= n) {
                return Err(refuse(format!("{} is not a part of {n}", parts::dir_name(i, n))));
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
fn check_one_job(manifests: &[(String, Manifest)]) -> Result<Vec<PartInfo>, SinkError> {
    let (name0, first) = &manifests[0];
    let job = |m: &Manifest| Manifest { part: None, ..m.clone_job() };
    let base = job(first);
    let mut infos = Vec::with_capacity(manifests.len());
    let mut at = 0u64;
    for (i, (name, m)) in manifests.iter().enumerate() {
        let p = m.part.clone().ok_or_else(|| {
            refuse(format!("{name}: its manifest records no part of the input; it was not written as part {i}"))
        })?;
        if i > 0 {
            base.same_job(&job(m)).map_err(|e| refuse(format!("{name} is not the same job as {name0}: {e}")))?;
        }
        let f = &first.part.as_ref().expect("checked at i = 0");
        let differs = if p.index != i || p.count != manifests.len() {
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

/// `to` becomes a hard link to `from`, replacing an earlier merge's link
/// at once (a link under a temporary name, renamed over it).
fn link(from: &Path, to: &Path) -> Result<(), SinkError> {
    let parent = to.parent().unwrap_or(Path::new("."));
    std::fs::create_dir_all(parent).map_err(io_err(parent))?;
    let name = to.file_name().map_or_else(String::new, |n| n.to_string_lossy().to_string());
    let tmp = parent.join(format!(".{name}.merge-{}.tmp", std::process::id()));
    remove_if_file(&tmp)?;
    std::fs::hard_link(from, &tmp).map_err(|e| {
        let why = match e.kind() {
            std::io::ErrorKind::NotFound => format!("{} is missing: rerun its part with --resume", from.display()),
            _ => format!(
                "{e}. The merge links the parts' files (it never copies them): the parts must lie on one \
                 filesystem that has hard links"
            ),
        };
        refuse(format!("cannot link {} to {}: {why}", to.display(), from.display()))
    })?;
    std::fs::rename(&tmp, to).map_err(|e| {
        let _ = std::fs::remove_file(&tmp);
        io_err(to)(e)
    })
}

/// Removes the temporary files an interrupted merge left (`.NAME.merge-PID.tmp`).
fn remove_stale_temps(dir: &Path) -> Result<(), SinkError> {
    for d in [dir.to_path_buf(), dir.join("hidden_states")] {
        let Ok(entries) = std::fs::read_dir(&d) else { continue };
        for e in entries {
            let name = e.map_err(io_err(&d))?.file_name().to_string_lossy().to_string();
            let temp = name.starts_with('.') && name.ends_with(".tmp") && name.contains(".merge-");
            if temp {
                remove_if_file(&d.join(&name))?;
            }
        }
    }
    Ok(())
}

/// Removes a regular file (or a link); `Ok(false)` when there was none.
fn remove_if_file(p: &Path) -> Result<bool, SinkError> {
    match std::fs::symlink_metadata(p) {
        Ok(m) if m.is_dir() => Err(refuse(format!("{} is a directory; move it away", p.display()))),
        Ok(_) => {
            std::fs::remove_file(p).map_err(io_err(p))?;
            Ok(true)
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(false),
        Err(e) => Err(io_err(p)(e)),
    }
}

fn write_manifest(dir: &Path, m: &Manifest) -> Result<(), SinkError> {
    let tmp: PathBuf = dir.join(format!(".{MANIFEST}.merge-{}.tmp", std::process::id()));
    remove_if_file(&tmp)?;
    let f = crate::files::create_exclusive(&tmp).map_err(io_err(&tmp))?;
    persist_manifest(m, f, &tmp, dir)
}
