//! The table half of a Hugging Face `datasets` directory, as `save_to_disk`
//! writes it and `load_from_disk` (the speculators trainer's `ArrowDataset`)
//! reads it: `data-00000-of-00001.arrow` (an Arrow IPC stream) with
//! `input_ids` and `loss_mask` (int64 lists) and `seq_len` (int64), plus
//! `dataset_info.json` and `state.json` with the torch format set.

use arrow_array::builder::{Int64Builder, ListBuilder};
use arrow_array::{ArrayRef, RecordBatch};
use arrow_schema::{ArrowError, DataType, Field, Schema};
use std::io::Write;
use std::sync::Arc;

/// The one table file.
pub const DATA_FILE: &str = "data-00000-of-00001.arrow";
/// Its description: features.
pub const INFO_FILE: &str = "dataset_info.json";
/// Its state: files, format, fingerprint.
pub const STATE_FILE: &str = "state.json";
/// Rows per record batch (datasets writes 1000 by default)...
const BATCH_ROWS: usize = 1000;
/// ...or fewer, when they hold this many tokens (16 bytes each in the batch).
const BATCH_TOKENS: usize = 4 << 20;

fn features() -> serde_json::Value {
    let list = serde_json::json!({"feature": {"dtype": "int64", "_type": "Value"}, "_type": "List"});
    serde_json::json!({
        "input_ids": list,
        "loss_mask": list,
        "seq_len": {"dtype": "int64", "_type": "Value"},
    })
}

fn schema() -> Schema {
    let list = DataType::List(Arc::new(Field::new("item", DataType::Int64, true)));
    let meta = serde_json::json!({"info": {"features": features()}}).to_string();
    Schema::new(vec![
        Field::new("input_ids", list.clone(), true),
        Field::new("loss_mask", list, true),
        Field::new("seq_len", DataType::Int64, true),
    ])
    .with_metadata([("huggingface", meta)])
}

/// Writes rows to the table file as an Arrow IPC stream, a batch at a time.
pub struct TableWriter<W: Write> {
    out: arrow_ipc::writer::StreamWriter<W>,
    // The batch being built.
    ids: ListBuilder<Int64Builder>,
    mask: ListBuilder<Int64Builder>,
    seq: Int64Builder,
    pending: usize,
    pending_tokens: usize,
    rows: usize,
    hasher: xxhash_rust::xxh3::Xxh3,
}

impl<W: Write> TableWriter<W> {
    /// Starts the stream (its schema) on `w`.
    pub fn new(w: W) -> Result<Self, ArrowError> {
        Ok(TableWriter {
            out: arrow_ipc::writer::StreamWriter::try_new(w, &schema())?,
            ids: ListBuilder::new(Int64Builder::new()),
            mask: ListBuilder::new(Int64Builder::new()),
            seq: Int64Builder::new(),
            pending: 0,
            pending_tokens: 0,
            rows: 0,
            hasher: xxhash_rust::xxh3::Xxh3::new(),
        })
    }

    /// Appends one row.
    pub fn push(
        &mut self,
        ids: impl ExactSizeIterator<Item = i64>,
        mask: impl Iterator<Item = i64>,
    ) -> Result<(), ArrowError> {
        let n = ids.len();
        for v in ids {
            self.ids.values().append_value(v);
            self.hasher.update(&v.to_le_bytes());
        }
        self.ids.append(true);
        for v in mask {
            self.mask.values().append_value(v);
            self.hasher.update(&[v as u8]);
        }
        self.mask.append(true);
        self.seq.append_value(n as i64);
        self.pending += 1;
        self.pending_tokens += n;
        self.rows += 1;
        if self.pending == BATCH_ROWS || self.pending_tokens >= BATCH_TOKENS {
            self.flush()?;
        }
        Ok(())
    }

    fn flush(&mut self) -> Result<(), ArrowError> {
        if self.pending == 0 {
            return Ok(());
        }
        let cols: Vec<ArrayRef> =
            vec![Arc::new(self.ids.finish()), Arc::new(self.mask.finish()), Arc::new(self.seq.finish())];
        let batch = RecordBatch::try_new(Arc::new(schema()), cols)?;
        self.out.write(&batch)?;
        self.pending = 0;
        self.pending_tokens = 0;
        Ok(())
    }

    /// Ends the stream; returns the writer and the table's fingerprint (16 hex digits).
    pub fn finish(mut self) -> Result<(W, String), ArrowError> {
        self.flush()?;
        self.out.finish()?;
        let fp = format!("{:016x}", self.hasher.digest());
        Ok((self.out.into_inner()?, fp))
    }
}

/// `dataset_info.json` of the run `manifest` describes: with FP8 storage its
/// description says the files hold codes and scales (the trainer must read
/// them with its FP8 backend); a `strata` entry records the capture points
/// and their speculators layer ids.
pub fn info_json(manifest: &crate::format::manifest::Manifest) -> String {
    let fp8 = manifest.dtype == "fp8";
    let description = match fp8 {
        false => "Token rows of a Strata extraction; hidden states in hidden_states/hs_{i}.safetensors",
        true => {
            "Token rows of a Strata extraction; hidden states in hidden_states/hs_{i}.safetensors as FP8: \
             F8_E4M3 hidden_states [T, L, H] with F32 hidden_states_scales [T, L, 1]. Read them with the \
             speculators FP8 hidden-states backend (hidden_states * hidden_states_scales); the default \
             reader does not dequantise"
        }
    };
    let info = serde_json::json!({
        "citation": "",
        "description": description,
        "features": features(),
        "homepage": "",
        "license": "",
        // The layer ids of the `[T, L, H]` axis, for the trainer's
        // --target-layer-ids (datasets ignores keys it does not know).
        "strata": {
            "capture": manifest.capture.iter().map(|c| c.point.as_str()).collect::<Vec<_>>(),
            "layer_ids": manifest.capture.iter().map(|c| c.layer_id).collect::<Vec<_>>(),
            "target_layer_ids": manifest.target_layer_ids().ok(),
        },
    });
    serde_json::to_string_pretty(&info).expect("JSON values serialize")
}

/// `state.json`, with the torch format set (as the speculators prepare step leaves it).
pub fn state_json(fingerprint: &str) -> String {
    let state = serde_json::json!({
        "_data_files": [{"filename": DATA_FILE}],
        "_fingerprint": fingerprint,
        "_format_columns": ["input_ids", "loss_mask", "seq_len"],
        "_format_kwargs": {},
        "_format_type": "torch",
        "_output_all_columns": false,
        "_split": null,
    });
    serde_json::to_string_pretty(&state).expect("JSON values serialize")
}

#[cfg(test)]
mod tests {
    use super::*;
    use arrow_array::cast::AsArray;
    use arrow_array::types::Int64Type;

    #[test]
    fn rows_round_trip_through_an_ipc_stream() {
        let mut w = TableWriter::new(Vec::new()).unwrap();
        for n in 0..2500usize {
            w.push((0..n % 7 + 1).map(|i| (n * 10 + i) as i64), (0..n % 7 + 1).map(|i| (i % 2) as i64)).unwrap();
        }
        let (bytes, fp) = w.finish().unwrap();
        assert_eq!(fp.len(), 16);
        // A stream, not a file: it opens with the continuation marker.
        assert_eq!(&bytes[..4], &[0xff; 4]);
        let r = arrow_ipc::reader::StreamReader::try_new(&bytes[..], None).unwrap();
        assert!(r.schema().metadata()["huggingface"].contains("\"_type\":\"List\""));
        let mut row = 0usize;
        for b in r {
            let b = b.unwrap();
            let ids = b.column(0).as_list::<i32>();
            let seq = b.column(2).as_primitive::<Int64Type>();
            for i in 0..b.num_rows() {
                let v = ids.value(i);
                let v = v.as_primitive::<Int64Type>();
                assert_eq!(v.len(), row % 7 + 1);
                assert_eq!(v.value(0), (row * 10) as i64);
                assert_eq!(seq.value(i), v.len() as i64);
                row += 1;
            }
        }
        assert_eq!(row, 2500);
    }
}
