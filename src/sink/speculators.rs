//! The speculators trainer's dataset directory: the rows as a Hugging Face
//! `datasets` table (`data-00000-of-00001.arrow`, `dataset_info.json`,
//! `state.json`: `input_ids`, `loss_mask`, `seq_len`) and the states as
//! `hidden_states/hs_{i}.safetensors`, file `i` for row `i`, each holding
//! `token_ids` (I64 `[T]`), `loss_mask` (U8 `[T]`) and `hidden_states`
//! (`[T, L, H]`). The same `manifest.json` as the native format lists each
//! file as a one-sample shard, so resume and verify work alike; the table is
//! built from the listed files when the run finishes.

use super::output::{Commit, OutLoc, Output, Temp};
use super::{hf_dataset, io_err, OpenMode, Sink, SinkError};
use crate::dataset::manifest::{hash_hex, InputInfo, Manifest, SampleInfo, ShardInfo};
use crate::dataset::MappedFile;
use crate::files::Dir;
use crate::pipeline::source::{InputPos, Sample};
use crate::shape::{DType, Dim, StatesView};
use std::collections::VecDeque;
use std::io::Write;
use std::thread::JoinHandle;

/// Writes one file per sample, named by the sample's index. Each file is
/// written and fsynced on its own thread while the next samples are encoded,
/// a few files at a time (their fsyncs overlap on the disk), and journaled
/// and renamed in sample order on the caller's thread.
pub struct SpeculatorsSink {
    out: Output,
    dtype: DType,
    input_path: String,
    // Encoding buffers: a sample's hidden states `[T, L, H]` go to a spare
    // one; those in flight come back when their writes are done.
    spare: Vec<Vec<u8>>,
    encoder: SpeculatorsEncoder,
    // Files being written, oldest first.
    pending: VecDeque<Pending>,
    // A write or commit failed: nothing more is committed.
    failed: bool,
    done: usize,
    bytes_written: u64,
}

/// Files written at once at most: their fsyncs overlap on the disk (8
/// against 4 took the bf16 writer from 0.85 to 1.0 of a plain write).
const IN_FLIGHT: usize = 8;
/// Bytes of files in flight at most (bounds the memory held by their buffers).
const IN_FLIGHT_BYTES: u64 = 512 << 20;

/// A sample whose file is being written and fsynced on a thread.
struct Pending {
    tmp: Temp,
    shard: ShardInfo,
    sample: SampleInfo,
    end: InputPos,
    // Gives back the hidden-state buffer and the sample's checksum once the
    // file is written and fsynced.
    write: JoinHandle<std::io::Result<(Vec<u8>, u64)>>,
}

impl SpeculatorsSink {
    /// Opens `dir` for the run `manifest` describes (its dtype is the stored one).
    pub fn open(dir: impl Into<OutLoc>, manifest: Manifest, mode: OpenMode) -> Result<Self, SinkError> {
        let dtype: DType = manifest.dtype.parse().map_err(SinkError::Directory)?;
        let input_path = manifest.input.as_ref().map_or_else(String::new, |i| i.path.clone());
        let job = Manifest { format: "speculators".into(), layout: "TLH".into(), shard_size: 0, ..manifest };
        let out = Output::new(dir, mode, job)?;
        let done = out.manifest().consumed();
        Ok(SpeculatorsSink {
            out,
            dtype,
            input_path,
            spare: Vec::new(),
            encoder: SpeculatorsEncoder::new(dtype),
            pending: VecDeque::new(),
            failed: false,
            done,
            bytes_written: 0,
        })
    }

    /// The file of row `i`, inside the output directory.
    pub fn file_name(i: usize) -> String {
        format!("hidden_states/hs_{i}.safetensors")
    }

    /// Writes the dataset table from the listed files (a resumed run's table
    /// holds the rows of every run that wrote files).
    fn write_table(&mut self) -> Result<(), SinkError> {
        let out = &*self.out.get()?;
        let fp8 = self.dtype.scaled();
        write_table(
            out.dir(),
            &out.manifest().shards,
            fp8,
            |name| out.create_temp(name),
            |tmp, name| out.place(tmp, name),
            |tmp| out.discard(tmp),
        )
    }

    /// The manifest as written so far.
    pub fn manifest(&self) -> &Manifest {
        self.out.manifest()
    }

    /// Waits for the `n` oldest files in flight, then journals and renames
    /// them together (one journal sync and one directory sync for all).
    /// If a write failed, the files before it are still committed, and it
    /// and every later file in flight are given up (they took their places
    /// after it); the error names the failed file.
    fn settle_front(&mut self, n: usize) -> Result<(), SinkError> {
        let r = self.try_settle_front(n);
        self.failed |= r.is_err();
        r
    }

    fn try_settle_front(&mut self, n: usize) -> Result<(), SinkError> {
        let mut commits = Vec::with_capacity(n);
        let mut failed = None;
        for _ in 0..n {
            let Some(mut p) = self.pending.pop_front() else { break };
            let written = p.write.join().unwrap_or_else(|_| Err(std::io::Error::other("the writer thread panicked")));
            match written {
                Ok((buf, digest)) => {
                    p.sample.checksum = hash_hex(digest);
                    // One spare buffer is always kept; more only within the in-flight budget.
                    let kept: usize = self.spare.iter().map(Vec::capacity).sum();
                    if self.spare.is_empty() || (kept + buf.capacity()) as u64 <= IN_FLIGHT_BYTES {
                        self.spare.push(buf);
                    }
                    commits.push(Commit { tmp: p.tmp, info: p.shard, samples: vec![p.sample], end: p.end });
                }
                Err(e) => {
                    let out = self.out.get()?;
                    out.discard(&p.tmp);
                    for later in self.pending.drain(..) {
                        let _ = later.write.join();
                        out.discard(&later.tmp);
                    }
                    failed = Some(io_err(&p.tmp)(e));
                    break;
                }
            }
        }
        let bytes: u64 = commits.iter().map(|c| c.info.bytes).sum();
        self.out.get()?.commit_all(commits)?;
        self.bytes_written += bytes;
        failed.map_or(Ok(()), Err)
    }

    /// Settles files until at most `files` are in flight holding at most
    /// `bytes` between them, taking along those right behind them whose
    /// writes are already done.
    fn settle(&mut self, files: usize, bytes: u64) -> Result<(), SinkError> {
        let mut n = 0;
        let mut held: u64 = self.pending.iter().map(|p| p.shard.bytes).sum();
        while self.pending.len() - n > files || held > bytes {
            held -= self.pending[n].shard.bytes;
            n += 1;
        }
        if n == 0 {
            return Ok(());
        }
        while n < self.pending.len() && self.pending[n].write.is_finished() {
            n += 1;
        }
        self.settle_front(n)
    }
}

impl Drop for SpeculatorsSink {
    fn drop(&mut self) {
        // A run that stops early (an error elsewhere) still commits the
        // samples it handed over whose files were written, unless this sink
        // itself failed; what is not committed stays a temporary file (resume
        // removes it). No writer thread is left running.
        if !self.failed {
            let _ = self.settle_front(self.pending.len());
        }
        for p in self.pending.drain(..) {
            let _ = p.write.join();
        }
    }
}

impl<L: Dim, H: Dim> Sink<L, H> for SpeculatorsSink {
    fn write_sample(&mut self, sample: &Sample, states: StatesView<'_, L, H>) -> Result<(), SinkError> {
        let _span = tracing::debug_span!("write", index = sample.index).entered();
        let t = states.shape()[1];
        // Encoded while earlier samples' files are still being written.
        let mut buf = self.spare.pop().unwrap_or_default();
        let (lead, ids_at) = self.encoder.encode(&sample.input_ids, sample.loss_mask.as_deref(), states, &mut buf);
        let bytes = (lead.len() + buf.len()) as u64;
        let out = self.out.get()?;
        // Row `i` of the table is file `i`: rows are numbered as they are written.
        let row = out.manifest().shards.len() + self.pending.len();
        let name = Self::file_name(row);
        // Room for this one: at most IN_FLIGHT files, and IN_FLIGHT_BYTES
        // between them (one file alone may be larger).
        self.settle(IN_FLIGHT - 1, IN_FLIGHT_BYTES.saturating_sub(bytes))?;
        let out = self.out.get()?;
        let (tmp, f) = out.create_temp(&name)?;
        // The checksum (ids, mask, then the states) is taken on the writer's
        // thread, a chunk at a time just before the chunk is written, so the
        // next sample's encoding overlaps it.
        let write = std::thread::Builder::new().name("strata-sample-writer".into()).spawn(move || {
            let mut f = f;
            let mut hasher = xxhash_rust::xxh3::Xxh3::new();
            hasher.update(&lead[ids_at..]);
            f.write_all(&lead)?;
            for chunk in buf.chunks(1 << 20) {
                hasher.update(chunk);
                f.write_all(chunk)?;
            }
            f.sync_all()?;
            Ok((buf, hasher.digest()))
        });
        let write = match write {
            Ok(w) => w,
            Err(e) => {
                out.discard(&tmp);
                return Err(io_err(&tmp)(e));
            }
        };
        // Its place in the manifest: after the files still in flight, which commit first.
        let index = out.manifest().shards.len() + self.pending.len();
        let info = SampleInfo {
            id: sample.id.clone(),
            shard: index,
            tokens: t,
            checksum: String::new(), // set when the writer thread returns it
            index: Some(sample.index),
        };
        let shard = ShardInfo { file: name, samples: 1, bytes, input: None };
        self.pending.push_back(Pending { tmp, shard, sample: info, end: sample.end.clone(), write });
        Ok(())
    }

    fn skip_sample(&mut self, sample: &Sample, reason: String) -> Result<(), SinkError> {
        // The skip belongs after the samples in flight.
        self.settle(0, 0)?;
        self.out.skip_sample(sample, reason)
    }

    fn finish(&mut self, input: InputPos) -> Result<(), SinkError> {
        self.settle(0, 0)?;
        self.write_table()?;
        self.out.get()?.finish(InputInfo { path: self.input_path.clone(), whole: input })
    }

    fn resume_from(&self) -> usize {
        self.done
    }

    fn bytes_written(&self) -> u64 {
        // Counted when a file is committed: the one in flight is not yet.
        self.bytes_written
    }
}

/// Encodes one sample's file of the speculators format, as the trainer
/// reads it (`safetensors.torch.load_file`): `token_ids` (I64 `[T]`),
/// `loss_mask` (U8 `[T]`, all ones without a mask), `hidden_states`
/// (`[T, L, H]`) and, in FP8, `hidden_states_scales` (F32 `[T, L, 1]`), in
/// that order, the header padded with spaces to 8 bytes. The offline sink and
/// `strata serve` share it, so a served file is byte for byte an offline one.
#[derive(Debug)]
pub struct SpeculatorsEncoder {
    dtype: DType,
    // The sample's token ids (I64) and mask, `[T]` each.
    ids: Vec<u8>,
    // FP8 scales of the sample being encoded, `[T, L]`.
    scales: Vec<f32>,
}

impl SpeculatorsEncoder {
    /// An encoder storing the states as `dtype`.
    pub fn new(dtype: DType) -> Self {
        SpeculatorsEncoder { dtype, ids: Vec::new(), scales: Vec::new() }
    }

    /// Encodes the states (and FP8 scales) into `body` (cleared first) and
    /// returns the file's lead (length, header, ids and mask), which goes
    /// before `body`, with where its ids start (the checksum covers the lead
    /// from there, then `body`).
    pub fn encode<L: Dim, H: Dim>(
        &mut self,
        ids: &[u32],
        mask: Option<&[u8]>,
        states: StatesView<'_, L, H>,
        body: &mut Vec<u8>,
    ) -> (Vec<u8>, usize) {
        let [l, t, h] = states.shape();
        body.clear();
        self.scales.clear();
        states.encode_tlh(self.dtype, body, &mut self.scales);
        // FP8: the scales `[T, L, 1]` follow the codes in the same buffer.
        let n_codes = body.len();
        body.extend_from_slice(bytemuck::cast_slice(&self.scales));
        // token_ids, then loss_mask: the lead of the file.
        self.ids.clear();
        self.ids.extend(ids.iter().flat_map(|&v| (v as i64).to_le_bytes()));
        let n_ids = self.ids.len();
        match mask {
            Some(m) => self.ids.extend_from_slice(m),
            None => self.ids.resize(n_ids + t, 1),
        }
        let (n_lead, n_hs) = (self.ids.len(), body.len());
        let mut header = serde_json::json!({
            "token_ids": {"dtype": "I64", "shape": [t], "data_offsets": [0, n_ids]},
            "loss_mask": {"dtype": "U8", "shape": [t], "data_offsets": [n_ids, n_lead]},
            "hidden_states": {"dtype": self.dtype.to_safetensors().to_string(), "shape": [t, l, h],
                              "data_offsets": [n_lead, n_lead + n_codes]},
        });
        if self.dtype.scaled() {
            // The layout of the speculators stack's FP8 hidden-states reader
            // (hs_connectors' FP8Transfer): `hidden_states * hidden_states_scales`.
            header["hidden_states_scales"] = serde_json::json!({"dtype": "F32", "shape": [t, l, 1], "data_offsets": [n_lead + n_codes, n_lead + n_hs]});
        }
        let mut head = header.to_string().into_bytes();
        // The safetensors header is padded with spaces so the data starts 8-byte aligned.
        head.resize(head.len().next_multiple_of(8), b' ');
        let mut lead = Vec::with_capacity(8 + head.len() + n_lead);
        lead.extend_from_slice(&(head.len() as u64).to_le_bytes());
        lead.extend_from_slice(&head);
        let ids_at = lead.len();
        lead.extend_from_slice(&self.ids);
        (lead, ids_at)
    }

    /// The bytes of a file of `t` tokens of `l` points of width `h`: what a served request reserves.
    pub fn file_bytes(&self, t: usize, l: usize, h: usize) -> u64 {
        let scales = if self.dtype.scaled() { t * l * 4 } else { 0 };
        // The header is at most a few hundred bytes; 512 bounds it.
        (512 + t * 9 + t * l * h * self.dtype.size() + scales) as u64
    }
}

/// Writes the dataset table of `dir` from the files `shards` lists, in row
/// order: each file's `token_ids` and `loss_mask`, read back. Each table
/// file is written to a temporary file from `temp`, fsynced and put in
/// place by `place`.
pub(crate) fn write_table(
    dir: &Dir,
    shards: &[ShardInfo],
    fp8: bool,
    mut temp: impl FnMut(&str) -> Result<(Temp, std::fs::File), SinkError>,
    mut place: impl FnMut(&Temp, &str) -> Result<(), SinkError>,
    discard: impl Fn(&Temp),
) -> Result<(), SinkError> {
    let _span = tracing::info_span!("dataset_table", rows = shards.len()).entered();
    let (tmp, f) = temp(hf_dataset::DATA_FILE)?;
    let table_err = |e: arrow_schema::ArrowError| SinkError::Directory(format!("{}: {e}", tmp.display()));
    let r = (|| {
        let mut table =
            hf_dataset::TableWriter::new(std::io::BufWriter::with_capacity(1 << 20, f)).map_err(table_err)?;
        for shard in shards {
            // Read back through the directory's handle, links not followed.
            let path = dir.join(&shard.file);
            let opened = dir.walk(&shard.file, false).and_then(|(sub, name)| sub.open_file(&name));
            let opened = opened.map_err(io_err(&path))?;
            let file = MappedFile::from_file(&opened, &path).map_err(|e| SinkError::Directory(e.to_string()))?;
            let tensor = |name: &str| {
                file.tensors
                    .get(name)
                    .map(|e| file.bytes(e))
                    .ok_or_else(|| SinkError::Directory(format!("{}: no tensor {name}", path.display())))
            };
            let ids = tensor("token_ids")?;
            let mask = tensor("loss_mask")?;
            let ids = ids.chunks_exact(8).map(|c| i64::from_le_bytes(c.try_into().expect("8 bytes")));
            table.push(ids, mask.iter().map(|&m| m as i64)).map_err(table_err)?;
        }
        let (w, fingerprint) = table.finish().map_err(table_err)?;
        let f = w.into_inner().map_err(|e| io_err(&tmp)(e.into_error()))?;
        f.sync_all().map_err(io_err(&tmp))?;
        Ok(fingerprint)
    })();
    let fingerprint = match r {
        Ok(fp) => fp,
        Err(e) => {
            discard(&tmp);
            return Err(e);
        }
    };
    place(&tmp, hf_dataset::DATA_FILE)?;
    for (name, text) in [
        (hf_dataset::INFO_FILE, hf_dataset::info_json(fp8)),
        (hf_dataset::STATE_FILE, hf_dataset::state_json(&fingerprint)),
    ] {
        let (tmp, mut f) = temp(name)?;
        f.write_all(text.as_bytes()).and_then(|()| f.sync_all()).map_err(io_err(&tmp))?;
        place(&tmp, name)?;
    }
    Ok(())
}
