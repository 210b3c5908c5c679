//! `strata verify`: every sample of a native dataset against its manifest,
//! and optionally the dataset's layout against an expected one.

use super::manifest::{Manifest, SampleInfo};
use super::stats::Stats;
use super::{Dataset, DatasetError, MappedFile};
use crate::files;
use serde_json::Value;
use std::collections::{BTreeSet, HashMap, HashSet};
use std::path::Path;

pub use crate::{clip, quote, QUOTE_MAX};

/// A message that may hold `s` verbatim (in a path, or `{:?}`-quoted), with
/// a long `s` replaced by its [`quote`].
pub(super) fn scrub(msg: impl ToString, s: &str) -> String {
    let msg = msg.to_string();
    if s.chars().nth(QUOTE_MAX).is_none() {
        return msg;
    }
    msg.replace(&format!("{s:?}"), &quote(s)).replace(s, &quote(s))
}

/// The largest layout file read.
const LAYOUT_MAX: u64 = 1 << 30;

/// A JSON value in a message, cut to [`QUOTE_MAX`] characters.
fn show(v: &Value) -> String {
    clip(&v.to_string(), QUOTE_MAX).into_owned()
}

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
    pub fn read(path: &Path) -> Result<Self, LayoutError> {
        let p = || path.display().to_string();
        // Any size a manifest may have: another dataset's manifest.json is a layout too.
        let text = files::read_text(path, LAYOUT_MAX).map_err(|cause| LayoutError::Io { path: p(), cause })?;
        let v: Value = serde_json::from_str(&text).map_err(|cause| LayoutError::Malformed { path: p(), cause })?;
        let field = |problem: String| LayoutError::Field { path: p(), problem };
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
                            .ok_or_else(|| field(format!("capture entry {} has no \"point\"", show(i)))),
                        other => Err(field(format!("capture entry {} is not a string", show(other)))),
                    })
                    .collect::<Result<_, _>>()?,
            ),
            Some(other) => return Err(field(format!("`capture` must be an array, got {}", show(other)))),
        };
        let hidden_size = v
            .get("hidden_size")
            .or_else(|| v.get("model").and_then(|m| m.get("hidden_size")))
            .map(|h| {
                h.as_u64().map(|h| h as usize).ok_or_else(|| field(format!("hidden_size {} is not a number", show(h))))
            })
            .transpose()?;
        let dtype = v
            .get("dtype")
            .map(|d| d.as_str().map(str::to_string).ok_or_else(|| field(format!("dtype {} is not a string", show(d)))))
            .transpose()?;
        if capture.is_none() && hidden_size.is_none() && dtype.is_none() {
            return Err(LayoutError::Empty { path: p() });
        }
        Ok(Layout { capture, hidden_size, dtype })
    }
}

/// Why a layout file (`strata verify --expect`) cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum LayoutError {
    /// The file cannot be read.
    #[error("cannot read {path}: {cause}")]
    Io {
        /// The file.
        path: String,
        /// The OS error.
        cause: std::io::Error,
    },
    /// Not JSON.
    #[error("malformed {path}: {cause}")]
    Malformed {
        /// The file.
        path: String,
        /// What the parser said.
        cause: serde_json::Error,
    },
    /// A field of the wrong kind.
    #[error("{path}: {problem}")]
    Field {
        /// The file.
        path: String,
        /// Which field, and what it holds.
        problem: String,
    },
    /// Nothing to check.
    #[error("{path}: no capture, hidden_size or dtype to check")]
    Empty {
        /// The file.
        path: String,
    },
}

/// Checks every sample; returns the problems found (empty = the dataset is sound).
///
/// Only files inside `dir` are opened: a shard named by an absolute path, a
/// `..` or a link that leads out is reported, not read.
pub fn verify(dir: &Path, layout: Option<&Layout>) -> Result<Vec<String>, DatasetError> {
    let _s = tracing::info_span!("verify", dir = %dir.display()).entered();
    let ds = Dataset::open(dir)?;
    let m = &ds.manifest;
    let mut problems = Vec::new();
    if let Some(want) = layout {
        layout_problems(m, want, &mut problems);
    }
    if !m.complete {
        problems
            .push("manifest: the run did not finish (complete = false); `strata extract --resume` continues it".into());
    }
    // Samples by shard, in manifest order; one past the end is reported by `structure`.
    let mut by_shard: Vec<Vec<&SampleInfo>> = vec![Vec::new(); m.shards.len()];
    for s in &m.samples {
        if let Some(v) = by_shard.get_mut(s.shard) {
            v.push(s);
        }
    }
    structure(m, &by_shard, &mut problems);
    let mut scratch = Vec::new();
    for (si, (info, listed)) in m.shards.iter().zip(&by_shard).enumerate() {
        let file = clip(&info.file, QUOTE_MAX);
        let path = match files::inside(dir, &info.file) {
            Ok(p) => p,
            Err(e) => {
                let e = scrub(e, &info.file);
                problems.push(format!("shard {si} ({file}): {e}; not opened ({} samples unchecked)", listed.len()));
                continue;
            }
        };
        let shard = match MappedFile::open(&path) {
            Ok(f) => f,
            Err(e) => {
                problems.push(format!("{} ({} samples unreadable)", scrub(e.to_string(), &info.file), listed.len()));
                continue;
            }
        };
        if shard.len() as u64 != info.bytes {
            problems.push(format!("{file}: {} bytes, manifest says {}", shard.len(), info.bytes));
        }
        let mut names: BTreeSet<&str> = shard.tensors.keys().map(String::as_str).collect();
        for s in listed {
            let tensors = ds.tensor_names(&s.id);
            for n in &tensors {
                names.remove(n.as_str());
            }
            let id = quote(&s.id);
            let sample = match ds.sample(&shard, &s.id, s.tokens) {
                Ok(x) => x,
                Err(p) => {
                    problems.push(format!("sample {id} ({file}): {p}"));
                    continue;
                }
            };
            match shard.sample_checksum(&tensors) {
                Ok(sum) if sum == s.checksum => {}
                Ok(sum) => problems.push(format!(
                    "sample {id} ({file}): checksum {sum}, manifest says {}",
                    clip(&s.checksum, QUOTE_MAX)
                )),
                Err(p) => problems.push(format!("sample {id} ({file}): {p}")),
            }
            if sample.loss_mask.iter().any(|&b| b > 1) {
                problems.push(format!("sample {id}: loss_mask holds values other than 0 and 1"));
            }
            for (l, c) in m.capture.iter().enumerate() {
                let mut st = Stats::default();
                st.add_bytes(sample.layer(l), sample.dtype, &mut scratch);
                if st.nan + st.inf > 0 {
                    let point = clip(&c.point, QUOTE_MAX);
                    problems.push(format!("sample {id} layer {point}: {} NaN, {} Inf", st.nan, st.inf));
                }
            }
        }
        names.remove("__metadata__");
        for n in names {
            problems.push(format!("{file}: tensor {} is not in the manifest", quote(n)));
        }
    }
    if ds.is_speculators() && m.schema_version >= 3 && m.complete {
        table(&ds, &mut problems);
    }
    Ok(problems)
}

/// A finished speculators directory's `datasets` table: one row per listed
/// file, in order, holding the file's `token_ids` and `loss_mask`; `seq_len` their length.
fn table(ds: &Dataset, problems: &mut Vec<String>) {
    use arrow_array::cast::AsArray;
    use arrow_array::types::Int64Type;
    let name = "data-00000-of-00001.arrow";
    let path = ds.dir.join(name);
    let reader = files::open_regular(&path).map_err(|e| e.to_string()).and_then(|f| {
        arrow_ipc::reader::StreamReader::try_new(std::io::BufReader::new(f), None).map_err(|e| e.to_string())
    });
    let reader = match reader {
        Ok(r) => r,
        Err(e) => return problems.push(format!("{name}: {e} (the dataset table the trainer loads)")),
    };
    let mut row = 0usize;
    let shards = &ds.manifest.shards;
    for batch in reader {
        let batch = match batch {
            Ok(b) => b,
            Err(e) => return problems.push(format!("{name}: after row {row}: {e}")),
        };
        let col = |n: &str| batch.schema().index_of(n).ok().map(|i| batch.column(i).clone());
        let (Some(ids), Some(mask), Some(seq)) = (col("input_ids"), col("loss_mask"), col("seq_len")) else {
            return problems.push(format!("{name}: the table lacks input_ids, loss_mask or seq_len"));
        };
        let int64s = |c: &arrow_array::ArrayRef| {
            c.as_list_opt::<i32>().filter(|l| l.value_type() == arrow_schema::DataType::Int64).cloned()
        };
        let (Some(ids), Some(mask), Some(seq)) = (int64s(&ids), int64s(&mask), seq.as_primitive_opt::<Int64Type>())
        else {
            return problems.push(format!(
                "{name}: input_ids is {}, loss_mask {}, seq_len {}: expected lists of int64 and int64",
                ids.data_type(),
                mask.data_type(),
                seq.data_type()
            ));
        };
        for r in 0..batch.num_rows() {
            let Some(shard) = shards.get(row) else {
                return problems.push(format!("{name}: {} rows or more, for {} files", row + 1, shards.len()));
            };
            let file = MappedFile::open(&ds.dir.join(&shard.file));
            let get = |f: &MappedFile, t: &str| f.tensors.get(t).map(|e| f.bytes(e).to_vec());
            let (want_ids, want_mask) = match &file {
                Ok(f) => (get(f, "token_ids").unwrap_or_default(), get(f, "loss_mask").unwrap_or_default()),
                Err(_) => (vec![], vec![]), // reported above
            };
            let want_ids: Vec<i64> =
                want_ids.chunks_exact(8).map(|c| i64::from_le_bytes(c.try_into().expect("8 bytes"))).collect();
            let (i, m) = (ids.value(r), mask.value(r));
            let (i, m) = (i.as_primitive_opt::<Int64Type>(), m.as_primitive_opt::<Int64Type>());
            let same = match (i, m) {
                (Some(i), Some(m)) => {
                    i.values()[..] == want_ids[..]
                        && m.values().iter().map(|&v| v as u8).eq(want_mask.iter().copied())
                        && m.len() == want_mask.len()
                        && seq.value(r) as usize == want_ids.len()
                }
                _ => false,
            };
            if !same {
                problems
                    .push(format!("{name}: row {row} does not hold the token ids and mask of {}", quote(&shard.file)));
            }
            row += 1;
        }
    }
    if row != shards.len() {
        problems.push(format!("{name}: {row} rows for {} files", shards.len()));
    }
}

/// Schema 2 records each sample's input row: every row of a finished run's
/// input is written or skipped exactly once, in order.
fn rows(m: &Manifest, problems: &mut Vec<String>) {
    let indexed: Vec<(usize, &str)> = m
        .samples
        .iter()
        .filter_map(|s| s.index.map(|i| (i, s.id.as_str())))
        .chain(m.skipped.iter().map(|s| (s.index, s.id.as_str())))
        .collect();
    if indexed.is_empty() {
        return; // schema 1: rows not recorded
    }
    if indexed.len() != m.samples.len() + m.skipped.len() {
        problems.push("manifest: some samples record their input row and some do not".into());
        return;
    }
    let mut first: HashMap<usize, &str> = HashMap::new();
    for &(i, id) in &indexed {
        if let Some(other) = first.insert(i, id) {
            problems.push(format!("input row {i} is listed twice (samples {} and {})", quote(other), quote(id)));
        }
    }
    if let (true, Some(input)) = (m.complete, &m.input) {
        let n = input.whole.samples;
        if let Some(&(i, id)) = indexed.iter().find(|(i, _)| *i >= n) {
            problems.push(format!("sample {}: input row {i} is past the input's {n} samples", quote(id)));
        } else if first.len() != n {
            let missing = (0..n).find(|i| !first.contains_key(i)).unwrap_or(0);
            problems.push(format!(
                "manifest: the input had {n} samples but {} are written or skipped (row {missing} is in neither)",
                first.len()
            ));
        }
    }
    if m.samples.windows(2).any(|w| w[0].index >= w[1].index) {
        problems.push("manifest: samples are not in input order".into());
    }
}

/// The manifest's layout against the expected one.
fn layout_problems(m: &Manifest, want: &Layout, problems: &mut Vec<String>) {
    let have: Vec<&str> = m.capture.iter().map(|c| c.point.as_str()).collect();
    let list = |points: &[&str]| points.iter().map(|p| clip(p, QUOTE_MAX)).collect::<Vec<_>>().join(", ");
    if let Some(c) = &want.capture {
        if c.iter().map(String::as_str).ne(have.iter().copied()) {
            let c: Vec<&str> = c.iter().map(String::as_str).collect();
            problems.push(format!("layout: capture is [{}], expected [{}]", list(&have), list(&c)));
        }
    }
    if let Some(h) = want.hidden_size {
        if h != m.model.hidden_size {
            problems.push(format!("layout: hidden_size is {}, expected {h}", m.model.hidden_size));
        }
    }
    if let Some(d) = &want.dtype {
        if *d != m.dtype {
            problems.push(format!("layout: dtype is {}, expected {}", clip(&m.dtype, QUOTE_MAX), clip(d, QUOTE_MAX)));
        }
    }
}

/// What the manifest says of itself, before any shard is opened: shard
/// indices in range, unique ids, per-shard counts that add up, no shard
/// file listed twice.
fn structure(m: &Manifest, by_shard: &[Vec<&SampleInfo>], problems: &mut Vec<String>) {
    let n = m.shards.len();
    for s in m.samples.iter().filter(|s| s.shard >= n) {
        problems.push(format!(
            "sample {}: shard {} is past the end of the shard list ({n} shards)",
            quote(&s.id),
            s.shard
        ));
    }
    let mut seen: HashMap<&str, usize> = HashMap::new();
    for s in &m.samples {
        *seen.entry(s.id.as_str()).or_default() += 1;
    }
    let mut told = HashSet::new();
    for s in &m.samples {
        let times = seen.get(s.id.as_str()).copied().unwrap_or(0);
        if times > 1 && told.insert(s.id.as_str()) {
            problems.push(format!("sample id {} appears {times} times", quote(&s.id)));
        }
    }
    for (info, listed) in m.shards.iter().zip(by_shard) {
        if listed.len() != info.samples {
            problems.push(format!(
                "{}: manifest lists {} samples in it but says {}",
                clip(&info.file, QUOTE_MAX),
                listed.len(),
                info.samples
            ));
        }
    }
    // u128: a hostile count near usize::MAX must not overflow the sum.
    let total: u128 = m.shards.iter().map(|s| s.samples as u128).sum();
    if total != m.samples.len() as u128 {
        problems.push(format!(
            "manifest: its shards say they hold {total} samples in all, but it lists {}",
            m.samples.len()
        ));
    }
    rows(m, problems);
    let mut by_file: HashMap<&str, usize> = HashMap::new();
    for (si, info) in m.shards.iter().enumerate() {
        let first = *by_file.entry(info.file.as_str()).or_insert(si);
        if first != si {
            problems.push(format!("shard {si} ({}): shard {first} names the same file", clip(&info.file, QUOTE_MAX)));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn long_strings_are_cut_on_a_char_boundary() {
        assert_eq!(quote("a\"b"), "\"a\\\"b\"");
        assert_eq!(clip("short", QUOTE_MAX), "short");
        let long = "é".repeat(1000);
        let q = quote(&long);
        assert!(q.starts_with("\"éé") && q.ends_with("…\" (2000 bytes)"), "{q}");
        assert_eq!(q.matches('é').count(), QUOTE_MAX);
        assert_eq!(clip(&long, 3), "ééé… (2000 bytes)");
        let msg = format!("path {long:?} has a `..` component, see {long}");
        let s = scrub(msg, &long);
        assert!(s.len() < 600 && s.matches("(2000 bytes)").count() == 2, "{s}");
    }
}
