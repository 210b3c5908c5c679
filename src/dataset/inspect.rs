//! `strata inspect`: what an output file or directory holds.

use super::stats::Stats;
use super::{Dataset, DatasetError, MappedFile};
use crate::shape::DType;
use std::fmt::Write as _;
use std::path::Path;

/// Describes a native dataset directory, a directory of speculators files, or
/// one safetensors file; reads at most `max_samples` samples for statistics.
pub fn inspect(path: &Path, max_samples: Option<usize>) -> Result<String, DatasetError> {
    let _s = tracing::info_span!("inspect", path = %path.display()).entered();
    if path.is_dir() {
        if path.join(super::manifest::MANIFEST).exists() {
            inspect_dataset(&Dataset::open(path)?, max_samples)
        } else {
            inspect_speculators_dir(path, max_samples)
        }
    } else {
        inspect_file(path)
    }
}

fn token_line(out: &mut String, lens: &[usize]) {
    let total: usize = lens.iter().sum();
    let (min, max) = (lens.iter().min().copied().unwrap_or(0), lens.iter().max().copied().unwrap_or(0));
    let mean = if lens.is_empty() { 0.0 } else { total as f64 / lens.len() as f64 };
    let _ = writeln!(out, "tokens:      {total} total; per sample min {min}, mean {mean:.1}, max {max}");
}

fn layer_lines(out: &mut String, names: &[String], stats: &[Stats]) {
    let _ = writeln!(out, "per-layer statistics:");
    for (n, s) in names.iter().zip(stats) {
        let _ = writeln!(out, "  {n:<14} {s}");
    }
}

fn inspect_dataset(ds: &Dataset, max_samples: Option<usize>) -> Result<String, DatasetError> {
    let m = &ds.manifest;
    let mut out = String::new();
    let _ = writeln!(out, "dataset:     {} (strata format, schema {})", ds.dir.display(), m.schema_version);
    let _ = writeln!(
        out,
        "model:       {} ({}, {} layers, hidden {})",
        m.model.path, m.model.architecture, m.model.num_layers, m.model.hidden_size
    );
    let _ = writeln!(
        out,
        "complete:    {}",
        if m.complete { "yes" } else { "no (interrupted or running; --resume continues it)" }
    );
    let points: Vec<String> = m
        .capture
        .iter()
        .map(|c| format!("{} (hf {})", c.point, c.hf_index.map_or("-".into(), |i| i.to_string())))
        .collect();
    let _ = writeln!(out, "capture:     {}", points.join(", "));
    let _ = writeln!(
        out,
        "layout:      hidden_states [L={}, T, H={}] {}, input_ids [T] i64, loss_mask [T] u8",
        m.capture.len(),
        m.model.hidden_size,
        m.dtype
    );
    let bytes: u64 = m.shards.iter().map(|s| s.bytes).sum();
    let _ = writeln!(out, "samples:     {} in {} shards, {} bytes", m.samples.len(), m.shards.len(), bytes);
    token_line(&mut out, &m.samples.iter().map(|s| s.tokens).collect::<Vec<_>>());
    let limit = max_samples.unwrap_or(usize::MAX);
    let mut stats = vec![Stats::default(); m.capture.len()];
    let mut scratch = Vec::new();
    let mut open: Option<(usize, MappedFile)> = None;
    for s in m.samples.iter().take(limit) {
        if open.as_ref().map(|(i, _)| *i) != Some(s.shard) {
            open = Some((s.shard, ds.shard(s.shard)?));
        }
        let shard = &open.as_ref().expect("opened").1;
        let sample = ds
            .sample(shard, &s.id, s.tokens)
            .map_err(|p| DatasetError::Manifest(format!("{}: {p}", shard.path.display())))?;
        let per = sample.hidden.len() / sample.shape[0].max(1);
        for (l, st) in stats.iter_mut().enumerate() {
            st.add_bytes(&sample.hidden[l * per..(l + 1) * per], sample.dtype, &mut scratch);
        }
    }
    if m.samples.len() > limit {
        let _ = writeln!(out, "(statistics over the first {limit} samples)");
    }
    layer_lines(&mut out, &m.capture.iter().map(|c| c.point.clone()).collect::<Vec<_>>(), &stats);
    Ok(out)
}

fn inspect_speculators_dir(dir: &Path, max_samples: Option<usize>) -> Result<String, DatasetError> {
    let io = |cause| DatasetError::Io { path: dir.display().to_string(), cause };
    let mut files: Vec<(usize, std::path::PathBuf)> = std::fs::read_dir(dir)
        .map_err(io)?
        .filter_map(|e| e.ok())
        .filter_map(|e| {
            let name = e.file_name().to_string_lossy().to_string();
            let i = name.strip_prefix("hs_")?.strip_suffix(".safetensors")?.parse().ok()?;
            Some((i, e.path()))
        })
        .collect();
    files.sort();
    if files.is_empty() {
        return Err(DatasetError::Manifest(format!(
            "{} holds neither manifest.json nor hs_*.safetensors: not a Strata output directory",
            dir.display()
        )));
    }
    let mut out = String::new();
    let _ = writeln!(out, "dataset:     {} (speculators format: hs_{{i}}.safetensors)", dir.display());
    let _ = writeln!(out, "samples:     {}", files.len());
    let mut lens = Vec::new();
    let mut stats: Vec<Stats> = Vec::new();
    let mut scratch = Vec::new();
    let mut shape_line = None;
    for (n, (_, path)) in files.iter().enumerate() {
        let f = MappedFile::open(path)?;
        let hs = f.tensors.get("hidden_states").ok_or_else(|| DatasetError::BadFile {
            path: path.display().to_string(),
            problem: "no hidden_states tensor".into(),
        })?;
        let dtype = DType::from_safetensors(hs.dtype).ok_or_else(|| DatasetError::BadFile {
            path: path.display().to_string(),
            problem: format!("hidden_states has dtype {}", hs.dtype),
        })?;
        let [t, l, h] = hs.shape[..] else {
            return Err(DatasetError::BadFile {
                path: path.display().to_string(),
                problem: format!("hidden_states has shape {:?}, expected [T, L, H]", hs.shape),
            });
        };
        shape_line.get_or_insert(format!("layout:      hidden_states [T, L={l}, H={h}] {dtype}, token_ids [T] i64"));
        lens.push(t);
        if n < max_samples.unwrap_or(usize::MAX) {
            stats.resize(l, Stats::default());
            let bytes = f.bytes(hs);
            let row = h * dtype.size();
            for (i, r) in bytes.chunks_exact(row).enumerate() {
                stats[i % l].add_bytes(r, dtype, &mut scratch);
            }
        }
    }
    if let Some(s) = shape_line {
        let _ = writeln!(out, "{s}");
    }
    token_line(&mut out, &lens);
    layer_lines(&mut out, &(0..stats.len()).map(|l| format!("layer {l}")).collect::<Vec<_>>(), &stats);
    Ok(out)
}

fn inspect_file(path: &Path) -> Result<String, DatasetError> {
    let f = MappedFile::open(path)?;
    let mut out = String::new();
    let _ = writeln!(out, "file:        {} ({} bytes, {} tensors)", path.display(), f.len(), f.tensors.len());
    let mut scratch = Vec::new();
    for (name, e) in &f.tensors {
        let _ = write!(out, "  {name:<32} {:<5} {:?}", e.dtype.to_string(), e.shape);
        match DType::from_safetensors(e.dtype) {
            Some(dt) if name.ends_with("hidden_states") && e.shape.len() == 3 => {
                // Native files are [L, T, H]; speculators files [T, L, H].
                let native = !name.eq("hidden_states");
                let (l, h) = if native { (e.shape[0], e.shape[2]) } else { (e.shape[1], e.shape[2]) };
                let _ = writeln!(out);
                let mut stats = vec![Stats::default(); l];
                let bytes = f.bytes(e);
                let row = h * dt.size();
                for (i, r) in bytes.chunks_exact(row).enumerate() {
                    let layer = if native { i / e.shape[1].max(1) } else { i % l };
                    stats[layer].add_bytes(r, dt, &mut scratch);
                }
                for (l, s) in stats.iter().enumerate() {
                    let _ = writeln!(out, "      layer {l:<3} {s}");
                }
            }
            Some(dt) => {
                let mut s = Stats::default();
                s.add_bytes(f.bytes(e), dt, &mut scratch);
                let _ = writeln!(out, "  {s}");
            }
            None => {
                let _ = writeln!(out);
            }
        }
    }
    Ok(out)
}
