//! `strata inspect`: what an output file or directory holds.

use super::stats::Stats;
use super::verify::{clip, quote, QUOTE_MAX};
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
            let ds = Dataset::open(path)?;
            if ds.is_speculators() {
                return inspect_speculators_dir(path, max_samples);
            }
            inspect_dataset(&ds, max_samples)
        } else {
            inspect_speculators_dir(path, max_samples)
        }
    } else {
        inspect_file(path)
    }
}

/// More layers than any model captures: a header claiming more (with `T` or
/// `H` of 0 it costs no bytes) is not given a `Stats` per layer.
const MAX_LAYERS: usize = 1 << 16;

fn token_line(out: &mut String, lens: &[usize]) {
    // u128: manifest counts are untrusted; their sum must not overflow.
    let total: u128 = lens.iter().map(|&n| n as u128).sum();
    let (min, max) = (lens.iter().min().copied().unwrap_or(0), lens.iter().max().copied().unwrap_or(0));
    let mean = if lens.is_empty() { 0.0 } else { total as f64 / lens.len() as f64 };
    let _ = writeln!(out, "tokens:      {total} total; per sample min {min}, mean {mean:.1}, max {max}");
}

/// Adds `hidden_states` bytes of shape `[L, T, H]` (`native`) or `[T, L, H]`
/// to per-layer `stats`, growing it to `L`; says why not when it cannot.
fn add_layers(
    stats: &mut Vec<Stats>,
    bytes: &[u8],
    dt: DType,
    shape: [usize; 3],
    native: bool,
    scratch: &mut Vec<f32>,
) -> Result<(), String> {
    let (l, h) = if native { (shape[0], shape[2]) } else { (shape[1], shape[2]) };
    if bytes.is_empty() {
        // A dim is 0: no rows, and a row of 0 bytes cannot be chunked.
        return Err(format!("no values (shape {shape:?})"));
    }
    if l > MAX_LAYERS {
        return Err(format!("{l} layers, more than the {MAX_LAYERS} summarised"));
    }
    if stats.len() < l {
        stats.resize(l, Stats::default());
    }
    // Every dim is at least 1 here (the bytes are not empty), and the parser
    // checked that they hold the whole shape, so `row` neither overflows nor is 0.
    let row = h * dt.size();
    for (i, r) in bytes.chunks_exact(row).enumerate() {
        let layer = if native { i / shape[1] } else { i % l };
        if let Some(st) = stats.get_mut(layer) {
            st.add_bytes(r, dt, scratch);
        }
    }
    Ok(())
}

/// The values of a `hidden_states` tensor as bytes of a plain dtype: FP8
/// codes times their `{name}_scales` (one per row of `H`), others as stored.
fn states_bytes<'a>(
    f: &'a MappedFile,
    name: &str,
    e: &super::TensorEntry,
) -> Result<(std::borrow::Cow<'a, [u8]>, DType), String> {
    let dt = DType::from_stored(e.dtype).ok_or_else(|| format!("dtype {}", e.dtype))?;
    if !dt.scaled() {
        return Ok((f.bytes(e).into(), dt));
    }
    let scales = format!("{name}_scales");
    let s = f.tensors.get(&scales).ok_or_else(|| format!("FP8 codes without {scales}"))?;
    let rows = e.shape[..e.shape.len().saturating_sub(1)].iter().product::<usize>();
    if s.dtype != safetensors::Dtype::F32 || s.shape.iter().product::<usize>() != rows || s.shape.last() != Some(&1) {
        return Err(format!("{scales} is {} {}, expected F32 with one scale per row", s.dtype, super::dims(&s.shape)));
    }
    let h = e.shape.last().copied().unwrap_or(0);
    Ok((super::dequantize(f.bytes(e), f.bytes(s), h)?.into(), DType::F32))
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
        clip(&m.model.path, 4 * QUOTE_MAX),
        clip(&m.model.architecture, QUOTE_MAX),
        m.model.num_layers,
        m.model.hidden_size
    );
    let _ = writeln!(
        out,
        "complete:    {}",
        if m.complete { "yes" } else { "no (interrupted or running; --resume continues it)" }
    );
    let points: Vec<String> = m
        .capture
        .iter()
        .map(|c| format!("{} (hf {})", clip(&c.point, QUOTE_MAX), c.hf_index.map_or("-".into(), |i| i.to_string())))
        .collect();
    let _ = writeln!(out, "capture:     {}", points.join(", "));
    let scales = if m.dtype == "fp8" { ", hidden_states_scales [L, T, 1] f32" } else { "" };
    let _ = writeln!(
        out,
        "layout:      hidden_states [L={}, T, H={}] {}{scales}, input_ids [T] i64, loss_mask [T] u8",
        m.capture.len(),
        m.model.hidden_size,
        clip(&m.dtype, QUOTE_MAX)
    );
    if let Some(p) = &m.part {
        let _ = writeln!(
            out,
            "part:        {} of {} (from {}): input bytes {}..{} of {}",
            p.index,
            p.count,
            clip(&p.source, QUOTE_MAX),
            p.start,
            p.end,
            p.input_bytes
        );
    }
    if !m.merged.is_empty() {
        let _ = writeln!(
            out,
            "merged:      {} parts, in place ({} ... {})",
            m.merged.len(),
            clip(&m.merged[0].dir, QUOTE_MAX),
            clip(&m.merged[m.merged.len() - 1].dir, QUOTE_MAX)
        );
    }
    let bytes: u128 = m.shards.iter().map(|s| s.bytes as u128).sum();
    let _ = writeln!(out, "samples:     {} in {} shards, {} bytes", m.samples.len(), m.shards.len(), bytes);
    token_line(&mut out, &m.samples.iter().map(|s| s.tokens).collect::<Vec<_>>());
    let limit = max_samples.unwrap_or(usize::MAX);
    let mut stats = vec![Stats::default(); m.capture.len()];
    let mut scratch = Vec::new();
    let mut open: Option<(usize, MappedFile)> = None;
    for s in m.samples.iter().take(limit) {
        let shard = match open.take() {
            Some((i, f)) if i == s.shard => open.insert((i, f)),
            _ => {
                let f =
                    ds.shard(s.shard).map_err(|e| DatasetError::Manifest(format!("sample {}: {e}", quote(&s.id))))?;
                open.insert((s.shard, f))
            }
        };
        let shard = &shard.1;
        let sample = ds
            .sample(shard, &s.id, s.tokens)
            .map_err(|p| DatasetError::Manifest(format!("{}: {p}", shard.path.display())))?;
        for (l, st) in stats.iter_mut().enumerate() {
            st.add_bytes(sample.layer(l), sample.dtype, &mut scratch);
        }
    }
    if m.samples.len() > limit {
        let _ = writeln!(out, "(statistics over the first {limit} samples)");
    }
    layer_lines(&mut out, &m.capture.iter().map(|c| c.point.clone()).collect::<Vec<_>>(), &stats);
    Ok(out)
}

fn inspect_speculators_dir(top: &Path, max_samples: Option<usize>) -> Result<String, DatasetError> {
    // The trainer's dataset layout keeps the files in hidden_states/; the older one, at the top.
    let sub = top.join("hidden_states");
    let dir = if sub.is_dir() { sub.as_path() } else { top };
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
    let layout =
        if dir == top { "hs_{i}.safetensors" } else { "a datasets table with hidden_states/hs_{i}.safetensors" };
    let _ = writeln!(out, "dataset:     {} (speculators format: {layout})", top.display());
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
        let dtype = DType::from_stored(hs.dtype).ok_or_else(|| DatasetError::BadFile {
            path: path.display().to_string(),
            problem: format!("hidden_states has dtype {}", hs.dtype),
        })?;
        let [t, l, h] = hs.shape[..] else {
            return Err(DatasetError::BadFile {
                path: path.display().to_string(),
                problem: format!("hidden_states has shape {}, expected [T, L, H]", super::dims(&hs.shape)),
            });
        };
        shape_line.get_or_insert(format!("layout:      hidden_states [T, L={l}, H={h}] {dtype}, token_ids [T] i64"));
        lens.push(t);
        if n < max_samples.unwrap_or(usize::MAX) {
            let r = states_bytes(&f, "hidden_states", hs)
                .and_then(|(b, dt)| add_layers(&mut stats, &b, dt, [t, l, h], false, &mut scratch));
            if let Err(why) = r {
                tracing::debug!(file = %path.display(), "no statistics: {why}");
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
        let _ = write!(out, "  {:<32} {:<5} {}", clip(name, QUOTE_MAX), e.dtype.to_string(), super::dims(&e.shape));
        match DType::from_stored(e.dtype) {
            Some(_) if name.ends_with("hidden_states") && e.shape.len() == 3 => {
                // Native files are [L, T, H]; speculators files [T, L, H].
                let native = !name.eq("hidden_states");
                let shape = [e.shape[0], e.shape[1], e.shape[2]];
                let _ = writeln!(out);
                let mut stats = Vec::new();
                let r = states_bytes(&f, name, e)
                    .and_then(|(b, dt)| add_layers(&mut stats, &b, dt, shape, native, &mut scratch));
                match r {
                    Ok(()) => {
                        for (l, s) in stats.iter().enumerate() {
                            let _ = writeln!(out, "      layer {l:<3} {s}");
                        }
                    }
                    Err(why) => {
                        let _ = writeln!(out, "      ({why})");
                    }
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
