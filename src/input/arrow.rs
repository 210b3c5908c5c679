//! Records from a Hugging Face `datasets` directory written by
//! `save_to_disk` (such as the speculators prepare step's output): the Arrow
//! IPC stream files `state.json` lists, in order, with an `input_ids` list
//! column (int32 or int64) and optional `loss_mask` and `id` columns.

use super::{InputFormat, Item, Record, Records};
use crate::pipeline::source::{check_id, InputPos, SourceError};
use arrow_array::cast::AsArray;
use arrow_array::types::{Int32Type, Int64Type, Int8Type, UInt32Type, UInt8Type};
use arrow_array::{Array, ArrayRef, RecordBatch};
use arrow_schema::DataType;
use std::path::{Path, PathBuf};

/// Whether `dir` is a `datasets` directory (`state.json` and `dataset_info.json`).
pub fn is_dataset_dir(dir: &Path) -> bool {
    dir.is_dir() && dir.join("state.json").is_file()
}

/// Why `dir`, a directory, is not an input: a `DatasetDict` (name its
/// splits), or not a `datasets` directory at all.
pub fn not_a_dataset(dir: &Path) -> String {
    if dir.join("dataset_dict.json").is_file() {
        let mut splits: Vec<String> = std::fs::read_dir(dir)
            .map(|rd| {
                rd.filter_map(|e| e.ok())
                    .filter(|e| is_dataset_dir(&e.path()))
                    .map(|e| e.file_name().to_string_lossy().into_owned())
                    .collect()
            })
            .unwrap_or_default();
        splits.sort();
        let example = splits.first().map_or("train".to_string(), |s| s.clone());
        return format!(
            "{} is a DatasetDict (save_to_disk of several splits: {}): give one split's directory, e.g. --data {}",
            dir.display(),
            if splits.is_empty() { "none found".to_string() } else { splits.join(", ") },
            dir.join(example).display()
        );
    }
    format!(
        "{} is a directory, but not a datasets directory (it has no state.json): --data takes a JSON Lines file, \
         a pipe, - for stdin, or a directory written by datasets' save_to_disk",
        dir.display()
    )
}

/// Rows of a `datasets` directory as token records.
pub struct DatasetRecords {
    name: String,
    files: Vec<PathBuf>,
    next_file: usize,
    reader: Option<arrow_ipc::reader::StreamReader<std::io::BufReader<std::fs::File>>>,
    batch: Option<RecordBatch>,
    row_in_batch: usize,
    index: usize,
    bytes: u64,
    hasher: xxhash_rust::xxh3::Xxh3,
    max_tokens: usize,
    failed: bool,
}

impl DatasetRecords {
    /// Opens `dir`: reads `state.json` for its files; rows longer than `max_tokens` are an error.
    pub fn open(dir: &Path, max_tokens: usize) -> Result<Self, SourceError> {
        let name = dir.display().to_string();
        let bad = |problem: String| SourceError::Input { path: name.clone(), problem };
        let state_path = dir.join("state.json");
        let text = crate::files::read_text(&state_path, 16 << 20)
            .map_err(|cause| SourceError::Io { path: state_path.display().to_string(), cause })?;
        let state: serde_json::Value =
            serde_json::from_str(&text).map_err(|e| bad(format!("state.json is not JSON: {e}")))?;
        let list = state
            .get("_data_files")
            .and_then(|d| d.as_array())
            .ok_or_else(|| bad("state.json lists no `_data_files`".into()))?;
        let mut files = Vec::new();
        for f in list {
            let file = f
                .get("filename")
                .and_then(|n| n.as_str())
                .ok_or_else(|| bad("state.json: a `_data_files` entry has no `filename`".into()))?;
            files.push(crate::files::inside(dir, file).map_err(|e| bad(format!("state.json lists {e}")))?);
        }
        Ok(DatasetRecords {
            name,
            files,
            next_file: 0,
            reader: None,
            batch: None,
            row_in_batch: 0,
            index: 0,
            bytes: 0,
            hasher: xxhash_rust::xxh3::Xxh3::new(),
            max_tokens,
            failed: false,
        })
    }

    fn err(&self, problem: String) -> SourceError {
        SourceError::Input { path: self.name.clone(), problem }
    }

    /// The next batch with rows; `Ok(false)` at the end of the last file.
    fn advance(&mut self) -> Result<bool, SourceError> {
        loop {
            if let Some(b) = &self.batch {
                if self.row_in_batch < b.num_rows() {
                    return Ok(true);
                }
            }
            self.batch = None;
            self.row_in_batch = 0;
            if let Some(r) = &mut self.reader {
                match r.next() {
                    Some(Ok(b)) => {
                        self.batch = Some(b);
                        continue;
                    }
                    Some(Err(e)) => {
                        let file = self.files[self.next_file - 1].display().to_string();
                        return Err(self.err(format!("{file}: {e}")));
                    }
                    None => self.reader = None,
                }
            }
            let Some(path) = self.files.get(self.next_file).cloned() else { return Ok(false) };
            self.next_file += 1;
            let f = crate::files::open_regular(&path)
                .map_err(|cause| SourceError::Io { path: path.display().to_string(), cause })?;
            let r = arrow_ipc::reader::StreamReader::try_new(std::io::BufReader::with_capacity(1 << 20, f), None)
                .map_err(|e| {
                    self.err(format!("{}: not an Arrow IPC stream (as save_to_disk writes): {e}", path.display()))
                })?;
            self.reader = Some(r);
        }
    }

    fn row(&mut self) -> Result<Item, String> {
        let b = self.batch.as_ref().expect("advance found a batch");
        let r = self.row_in_batch;
        let col = |name: &str| b.schema().index_of(name).ok().map(|i| b.column(i).clone());
        let ids = col("input_ids").ok_or("the table has no `input_ids` column")?;
        let input_ids: Vec<u32> = ints(&ids, r, "input_ids", self.max_tokens)?
            .into_iter()
            .enumerate()
            .map(|(i, v)| u32::try_from(v).map_err(|_| format!("input_ids[{i}] = {v} is not a token id")))
            .collect::<Result<_, _>>()?;
        if input_ids.is_empty() {
            return Err("empty sample: `input_ids` has no tokens".into());
        }
        let loss_mask = match col("loss_mask") {
            None => None,
            Some(m) => {
                let m = ints(&m, r, "loss_mask", self.max_tokens)?;
                if m.len() != input_ids.len() {
                    return Err(format!("`loss_mask` has {} entries for {} tokens", m.len(), input_ids.len()));
                }
                let m: Vec<u8> = m
                    .into_iter()
                    .enumerate()
                    .map(|(i, v)| {
                        u8::try_from(v).ok().filter(|v| *v <= 1).ok_or(format!("loss_mask[{i}] = {v} is not 0 or 1"))
                    })
                    .collect::<Result<_, _>>()?;
                Some(m)
            }
        };
        let id = match col("id") {
            Some(c) if !c.is_valid(r) => None,
            Some(c) if c.data_type() == &DataType::Utf8 => Some(c.as_string::<i32>().value(r).to_string()),
            Some(c) if c.data_type() == &DataType::LargeUtf8 => Some(c.as_string::<i64>().value(r).to_string()),
            Some(c) => return Err(format!("the `id` column is {}, not strings", c.data_type())),
            None => None,
        };
        let id = id.map(check_id).transpose()?;
        // The input's digest covers what the rows hold, as read.
        for v in &input_ids {
            self.hasher.update(&v.to_le_bytes());
        }
        if let Some(m) = &loss_mask {
            self.hasher.update(m);
        }
        self.bytes += (input_ids.len() * 4 + loss_mask.as_ref().map_or(0, Vec::len)) as u64;
        self.index += 1;
        Ok(Item {
            index: self.index - 1,
            line: self.index,
            id,
            record: Record::Tokens { input_ids, loss_mask },
            end: self.consumed_pos(),
        })
    }

    fn consumed_pos(&self) -> InputPos {
        InputPos { samples: self.index, bytes: self.bytes, digest: format!("xxh3:{:016x}", self.hasher.digest()) }
    }
}

/// Row `r` of a list column of integers (or booleans), at most `max` entries.
fn ints(col: &ArrayRef, r: usize, name: &str, max: usize) -> Result<Vec<i64>, String> {
    if !col.is_valid(r) {
        return Err(format!("`{name}` is null"));
    }
    let v = match col.data_type() {
        DataType::List(_) => col.as_list::<i32>().value(r),
        DataType::LargeList(_) => col.as_list::<i64>().value(r),
        t => return Err(format!("`{name}` is {t}, not a list of integers")),
    };
    if v.len() > max {
        return Err(format!("`{name}` has {} entries, more than {max}", v.len()));
    }
    if v.null_count() > 0 {
        return Err(format!("`{name}` holds nulls"));
    }
    Ok(match v.data_type() {
        DataType::Int64 => v.as_primitive::<Int64Type>().values().to_vec(),
        DataType::Int32 => v.as_primitive::<Int32Type>().values().iter().map(|&x| x as i64).collect(),
        DataType::UInt32 => v.as_primitive::<UInt32Type>().values().iter().map(|&x| x as i64).collect(),
        DataType::Int8 => v.as_primitive::<Int8Type>().values().iter().map(|&x| x as i64).collect(),
        DataType::UInt8 => v.as_primitive::<UInt8Type>().values().iter().map(|&x| x as i64).collect(),
        DataType::Boolean => v.as_boolean().iter().map(|x| x.unwrap_or(false) as i64).collect(),
        t => return Err(format!("`{name}` holds {t}, not integers")),
    })
}

impl Records for DatasetRecords {
    fn next_record(&mut self) -> Option<Result<Item, SourceError>> {
        if self.failed {
            return None;
        }
        let r = match self.advance() {
            Ok(false) => return None,
            Ok(true) => self.row().map_err(|p| SourceError::Line {
                path: self.name.clone(),
                line: self.index + 1,
                problem: format!("row {}: {p}", self.index),
            }),
            Err(e) => Err(e),
        };
        self.row_in_batch += 1;
        self.failed = r.is_err();
        Some(r)
    }

    fn consumed(&self) -> InputPos {
        self.consumed_pos()
    }

    fn format(&self) -> InputFormat {
        InputFormat::HfDataset
    }
}
