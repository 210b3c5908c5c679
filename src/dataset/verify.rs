//! `strata verify`: every sample of a native dataset against its manifest,
//! and optionally the dataset's layout against an expected one.

use super::stats::Stats;
use super::{Dataset, DatasetError, MappedFile};
use serde_json::Value;
use std::collections::BTreeSet;
use std::path::Path;

/// The layout a dataset is expected to have (all fields optional). Read from
/// a JSON file such as `{"capture": ["input:2", "final"], "hidden_size": 4096,
/// "dtype": "bf16"}`, or from another dataset's `manifest.json`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Layout {
    /// Capture points, in order.
    pub capture: Option<Vec<String>>,
    /// Hidden width.
    pub hidden_size: Option<usize>,
    /// Storage dtype.
    pub dtype: Option<String>,
}

impl Layout {
    /// Reads a layout file.
    pub fn read(path: &Path) -> Result<Self, String> {
        let text = std::fs::read_to_string(path).map_err(|e| format!("cannot read {}: {e}", path.display()))?;
        let v: Value = serde_json::from_str(&text).map_err(|e| format!("malformed {}: {e}", path.display()))?;
        let capture = match v.get("capture") {
            None => None,
            Some(Value::Array(items)) => Some(
                items
                    .iter()
                    .map(|i| match i {
                        Value::String(s) => Ok(s.clone()),
                        Value::Object(o) => o
                            .get("point")
                            .and_then(Value::as_str)
                            .map(str::to_string)
                            .ok_or_else(|| format!("{}: capture entry {i} has no \"point\"", path.display())),
                        other => Err(format!("{}: capture entry {other} is not a string", path.display())),
                    })
                    .collect::<Result<_, _>>()?,
            ),
            Some(other) => return Err(format!("{}: `capture` must be an array, got {other}", path.display())),
        };
        let hidden_size = v
            .get("hidden_size")
            .or_else(|| v.get("model").and_then(|m| m.get("hidden_size")))
            .map(|h| {
                h.as_u64()
                    .map(|h| h as usize)
                    .ok_or_else(|| format!("{}: hidden_size {h} is not a number", path.display()))
            })
            .transpose()?;
        let dtype = v
            .get("dtype")
            .map(|d| {
                d.as_str().map(str::to_string).ok_or_else(|| format!("{}: dtype {d} is not a string", path.display()))
            })
            .transpose()?;
        if capture.is_none() && hidden_size.is_none() && dtype.is_none() {
            return Err(format!("{}: no capture, hidden_size or dtype to check", path.display()));
        }
        Ok(Layout { capture, hidden_size, dtype })
    }
}

/// Checks every sample; returns the problems found (empty = the dataset is sound).
pub fn verify(dir: &Path, layout: Option<&Layout>) -> Result<Vec<String>, DatasetError> {
    let _s = tracing::info_span!("verify", dir = %dir.display()).entered();
    let ds = Dataset::open(dir)?;
    let m = &ds.manifest;
    let mut problems = Vec::new();
    if let Some(want) = layout {
        let have: Vec<String> = m.capture.iter().map(|c| c.point.clone()).collect();
        if let Some(c) = &want.capture {
            if *c != have {
                problems.push(format!("layout: capture is [{}], expected [{}]", have.join(", "), c.join(", ")));
            }
        }
        if let Some(h) = want.hidden_size {
            if h != m.model.hidden_size {
                problems.push(format!("layout: hidden_size is {}, expected {h}", m.model.hidden_size));
            }
        }
        if let Some(d) = &want.dtype {
            if *d != m.dtype {
                problems.push(format!("layout: dtype is {}, expected {d}", m.dtype));
            }
        }
    }
    if !m.complete {
        problems
            .push("manifest: the run did not finish (complete = false); `strata extract --resume` continues it".into());
    }
    let mut scratch = Vec::new();
    for (si, shard_info) in m.shards.iter().enumerate() {
        let path = dir.join(&shard_info.file);
        let listed: Vec<_> = m.samples.iter().filter(|s| s.shard == si).collect();
        if listed.len() != shard_info.samples {
            problems.push(format!(
                "{}: manifest lists {} samples in it but says {}",
                shard_info.file,
                listed.len(),
                shard_info.samples
            ));
        }
        let shard = match MappedFile::open(&path) {
            Ok(f) => f,
            Err(e) => {
                problems.push(format!("{e} ({} samples unreadable)", listed.len()));
                continue;
            }
        };
        if shard.len() as u64 != shard_info.bytes {
            problems.push(format!("{}: {} bytes, manifest says {}", shard_info.file, shard.len(), shard_info.bytes));
        }
        let mut names: BTreeSet<&str> = shard.tensors.keys().map(String::as_str).collect();
        for s in listed {
            for suffix in ["input_ids", "loss_mask", "hidden_states"] {
                names.remove(format!("{}.{suffix}", s.id).as_str());
            }
            let sample = match ds.sample(&shard, &s.id, s.tokens) {
                Ok(x) => x,
                Err(p) => {
                    problems.push(format!("sample {:?} ({}): {p}", s.id, shard_info.file));
                    continue;
                }
            };
            let sum = shard.sample_checksum(&s.id).expect("read above");
            if sum != s.checksum {
                problems.push(format!(
                    "sample {:?} ({}): checksum {sum}, manifest says {}",
                    s.id, shard_info.file, s.checksum
                ));
            }
            if sample.loss_mask.iter().any(|&b| b > 1) {
                problems.push(format!("sample {:?}: loss_mask holds values other than 0 and 1", s.id));
            }
            let per = sample.hidden.len() / sample.shape[0].max(1);
            for (l, c) in m.capture.iter().enumerate() {
                let mut st = Stats::default();
                st.add_bytes(&sample.hidden[l * per..(l + 1) * per], sample.dtype, &mut scratch);
                if st.nan + st.inf > 0 {
                    problems.push(format!("sample {:?} layer {}: {} NaN, {} Inf", s.id, c.point, st.nan, st.inf));
                }
            }
        }
        names.remove("__metadata__");
        for n in names {
            problems.push(format!("{}: tensor {n:?} is not in the manifest", shard_info.file));
        }
    }
    Ok(problems)
}
