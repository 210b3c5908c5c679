//! The speculators trainer's dataset directory: the rows as a Hugging Face
//! `datasets` table (`data-00000-of-00001.arrow`, `dataset_info.json`,
//! `state.json`: `input_ids`, `loss_mask`, `seq_len`) and the states as
//! `hidden_states/hs_{i}.safetensors`, file `i` for row `i`, each holding
//! `token_ids` (I64 `[T]`), `loss_mask` (U8 `[T]`) and `hidden_states`
//! (`[T, L, H]`). The same `manifest.json` as the native format lists each
//! file as a one-sample shard, so resume and verify work alike; the table is
//! built from the listed files when the run finishes.

use super::draft_vocab::{d2t_file, t2d_file, TokenCounts, TOKEN_FREQ_FILE};
use super::output::{Commit, OutLoc, Output, Temp, Temps};
use super::{hf_dataset, io_err, OpenMode, Sink, SinkError};
use crate::dataset::manifest::{hash_hex, InputInfo, Manifest, SampleInfo, ShardInfo};
use crate::dataset::MappedFile;
use crate::files::Dir;
use crate::pipeline::source::{InputPos, Sample};
use crate::shape::{DType, Dim, StatesView};
use std::collections::VecDeque;
use std::io::Write;
use std::sync::{mpsc, Arc};
use std::thread::JoinHandle;

/// Writes one file per sample, named by the sample's index. The caller's
/// thread only encodes: each file is created, written and fsynced by one of
/// a fixed set of writer threads while the next samples are encoded, a few
/// files at a time (their fsyncs overlap on the disk), and journaled and
/// renamed in sample order, in groups, on the caller's thread.
pub struct SpeculatorsSink {
    out: Output,
    input_path: String,
    // Encoding buffers: a sample's hidden states `[T, L, H]` go to a spare
    // one; those in flight come back when their writes are done.
    spare: Vec<Vec<u8>>,
    encoder: SpeculatorsEncoder,
    // Files being written, oldest first.
    pending: VecDeque<Pending>,
    // The writer threads, started with the first file. File `k` goes to
    // thread `k % IN_FLIGHT`, which has handed back file `k - IN_FLIGHT`
    // by then (files settle in order, at most IN_FLIGHT in flight).
    writers: Vec<(mpsc::Sender<Job>, JoinHandle<()>)>,
    submitted: usize,
    // A write or commit failed: nothing more is committed.
    failed: bool,
    done: usize,
    bytes_written: u64,
}

/// Files written at once at most, and writer threads: their fsyncs overlap
/// on the disk (8 against 4 took the bf16 writer from 0.85 to 1.0 of a
/// plain write; 16 leave 8 in flight while a group commits).
const IN_FLIGHT: usize = 16;
/// When `IN_FLIGHT` files are in flight, the oldest are committed until this
/// many are left: files are journaled and renamed in groups of at least
/// `IN_FLIGHT - COMMIT_DOWN_TO`, so the four syncs of a commit, which run on
/// the caller's thread between encodings, are paid once per group (the fp8
/// bench spent 2.6 times as long in commits with groups of one or two).
const COMMIT_DOWN_TO: usize = 8;
/// Bytes of files in flight at most (bounds the memory held by their buffers).
const IN_FLIGHT_BYTES: u64 = 512 << 20;

/// One file for a writer thread: `lead` then `body`, checksummed from `lead[ids_at..]`.
struct Job {
    name: String,
    lead: Vec<u8>,
    ids_at: usize,
    body: Vec<u8>,
    done: mpsc::SyncSender<Written>,
}

/// A writer thread's answer: the temporary file (when it was created), the
/// body buffer for reuse, and the sample's checksum or why there is none.
struct Written {
    tmp: Option<Temp>,
    body: Vec<u8>,
    digest: Result<u64, SinkError>,
}

/// A sample whose file a writer thread is writing.
struct Pending {
    shard: ShardInfo,
    sample: SampleInfo,
    end: InputPos,
    done: mpsc::Receiver<Written>,
    // The answer, once polled.
    written: Option<Written>,
}

impl Pending {
    /// Whether the file is written (or failed).
    fn is_finished(&mut self) -> bool {
        if self.written.is_none() {
            self.written = self.done.try_recv().ok();
        }
        self.written.is_some()
    }

    /// Waits for the writer's answer.
    fn wait(mut self) -> (Self, Written) {
        let w = self.written.take().unwrap_or_else(|| {
            self.done.recv().unwrap_or_else(|_| Written {
                tmp: None,
                body: Vec::new(),
                digest: Err(SinkError::Directory(format!("{}: the writer thread stopped", self.shard.file))),
            })
        });
        (self, w)
    }
}

/// A writer thread: creates, writes and fsyncs each file it is given.
fn writer(temps: Arc<Temps>, jobs: mpsc::Receiver<Job>) {
    for Job { name, lead, ids_at, body, done } in jobs {
        let written = match temps.create(&name) {
            Err(e) => Written { tmp: None, body, digest: Err(e) },
            Ok((tmp, mut f)) => {
                // The checksum (ids, mask, then the states) is taken a chunk
                // at a time just before the chunk is written.
                let digest = (|| {
                    let mut hasher = xxhash_rust::xxh3::Xxh3::new();
                    hasher.update(&lead[ids_at..]);
                    f.write_all(&lead)?;
                    for chunk in body.chunks(1 << 20) {
                        hasher.update(chunk);
                        f.write_all(chunk)?;
                    }
                    f.sync_all()?;
                    Ok(hasher.digest())
                })();
                Written { digest: digest.map_err(io_err(&tmp)), tmp: Some(tmp), body }
            }
        };
        let _ = done.send(written);
    }
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
            input_path,
            spare: Vec::new(),
            encoder: SpeculatorsEncoder::new(dtype),
            pending: VecDeque::new(),
            writers: Vec::new(),
            submitted: 0,
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
        write_table(
            out.dir(),
            out.manifest(),
            |name| out.create_temp(name),
            |tmp, name| out.place(tmp, name),
            |tmp| out.discard(tmp),
        )
    }

    /// The manifest as written so far.
    pub fn manifest(&self) -> &Manifest {
        self.out.manifest()
    }

    /// Starts the writer threads (once).
    fn start_writers(&mut self) -> Result<(), SinkError> {
        if !self.writers.is_empty() {
            return Ok(());
        }
        let out = self.out.get()?;
        let temps = Arc::new(out.temps()?);
        for i in 0..IN_FLIGHT {
            let (tx, rx) = mpsc::channel();
            let temps = temps.clone();
            let spawned = std::thread::Builder::new()
                .name(format!("strata-sample-writer-{i}"))
                .spawn(move || writer(temps, rx))
                .map_err(io_err(out.dir().path()))?;
            self.writers.push((tx, spawned));
        }
        Ok(())
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
            let Some(p) = self.pending.pop_front() else { break };
            let (mut p, written) = p.wait();
            match written.digest {
                Ok(digest) => {
                    p.sample.checksum = hash_hex(digest);
                    let buf = written.body;
                    // One spare buffer is always kept; more only within the in-flight budget.
                    let kept: usize = self.spare.iter().map(Vec::capacity).sum();
                    if self.spare.is_empty() || (kept + buf.capacity()) as u64 <= IN_FLIGHT_BYTES {
                        self.spare.push(buf);
                    }
                    let tmp = written.tmp.expect("a written file has its temporary file");
                    commits.push(Commit { tmp, info: p.shard, samples: vec![p.sample], end: p.end });
                }
                Err(e) => {
                    let out = self.out.get()?;
                    written.tmp.iter().for_each(|t| out.discard(t));
                    for later in self.pending.drain(..) {
                        let (_, w) = later.wait();
                        w.tmp.iter().for_each(|t| out.discard(t));
                    }
                    failed = Some(e);
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
        while self.pending.len() - n > files.min(self.pending.len()) || held > bytes {
            held -= self.pending[n].shard.bytes;
            n += 1;
        }
        if n == 0 {
            return Ok(());
        }
        while n < self.pending.len() && self.pending[n].is_finished() {
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
            let _ = p.wait();
        }
        for (jobs, thread) in self.writers.drain(..) {
            drop(jobs);
            let _ = thread.join();
        }
    }
}

impl<L: Dim, H: Dim> Sink<L, H> for SpeculatorsSink {
    fn write_sample(&mut self, sample: &Sample, states: StatesView<'_, L, H>) -> Result<(), SinkError> {
        let _span = tracing::debug_span!("write", index = sample.index).entered();
        let t = states.shape()[1];
        self.start_writers()?;
        // Encoded while earlier samples' files are still being written.
        let mut body = self.spare.pop().unwrap_or_default();
        let (lead, ids_at) = self.encoder.encode(&sample.input_ids, sample.loss_mask.as_deref(), states, &mut body);
        let bytes = (lead.len() + body.len()) as u64;
        // Room for this one: at most IN_FLIGHT files, and IN_FLIGHT_BYTES
        // between them (one file alone may be larger).
        let files = if self.pending.len() >= IN_FLIGHT { COMMIT_DOWN_TO } else { usize::MAX };
        self.settle(files, IN_FLIGHT_BYTES.saturating_sub(bytes))?;
        // Row `i` of the table is file `i`, and its place in the manifest:
        // rows are numbered as they are written, after the files still in
        // flight, which commit first.
        let index = self.out.get()?.manifest().shards.len() + self.pending.len();
        let name = Self::file_name(index);
        let (done, answer) = mpsc::sync_channel(1);
        let job = Job { name: name.clone(), lead, ids_at, body, done };
        let (jobs, _) = &self.writers[self.submitted % IN_FLIGHT];
        if jobs.send(job).is_err() {
            self.failed = true;
            return Err(SinkError::Directory(format!("{name}: a writer thread stopped")));
        }
        self.submitted += 1;
        let info = SampleInfo {
            id: sample.id.clone(),
            shard: index,
            tokens: t,
            checksum: String::new(), // set when the writer thread returns it
            index: Some(sample.index),
        };
        let shard = ShardInfo { file: name, samples: 1, bytes, input: None };
        self.pending.push_back(Pending { shard, sample: info, end: sample.end.clone(), done: answer, written: None });
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

/// Writes the dataset table of `dir` from the files `manifest` lists, in
/// row order: each file's `token_ids` and `loss_mask`, read back. With
/// `--draft-vocab-size`, the loss-masked tokens of those rows are counted on
/// the way, and the trainer's `token_freq.pt` and each size's
/// `d2t-N.npy`/`t2d-N.npy` follow the table. Each file is written to a
/// temporary file from `temp`, fsynced and put in place by `place`.
pub(crate) fn write_table(
    dir: &Dir,
    manifest: &Manifest,
    mut temp: impl FnMut(&str) -> Result<(Temp, std::fs::File), SinkError>,
    mut place: impl FnMut(&Temp, &str) -> Result<(), SinkError>,
    discard: impl Fn(&Temp),
) -> Result<(), SinkError> {
    let shards = &manifest.shards;
    let _span = tracing::info_span!("dataset_table", rows = shards.len()).entered();
    let count = !manifest.draft_vocab_sizes.is_empty();
    let mut counts = TokenCounts::default();
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
            let ids = || ids.chunks_exact(8).map(|c| i64::from_le_bytes(c.try_into().expect("8 bytes")));
            if count {
                counts.add_row(ids(), mask.iter().map(|&m| m as i64));
            }
            table.push(ids(), mask.iter().map(|&m| m as i64)).map_err(table_err)?;
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
    let mut files = vec![
        (hf_dataset::INFO_FILE.to_string(), hf_dataset::info_json(manifest).into_bytes()),
        (hf_dataset::STATE_FILE.to_string(), hf_dataset::state_json(&fingerprint).into_bytes()),
    ];
    if count {
        let v = manifest.model.vocab_size;
        if v == 0 {
            return Err(SinkError::Directory(
                "--draft-vocab-size: the manifest records no vocabulary size (written by an older strata)".into(),
            ));
        }
        let _span = tracing::info_span!("draft_vocab", tokens = counts.len()).entered();
        files.push((TOKEN_FREQ_FILE.to_string(), counts.token_freq_pt()));
        for &n in &manifest.draft_vocab_sizes {
            let (d2t, t2d) = counts.mapping_files(n, v).map_err(SinkError::Directory)?;
            files.push((d2t_file(n), d2t));
            files.push((t2d_file(n), t2d));
        }
    }
    for (name, bytes) in files {
        let (tmp, mut f) = temp(&name)?;
        f.write_all(&bytes).and_then(|()| f.sync_all()).map_err(io_err(&tmp))?;
        place(&tmp, &name)?;
    }
    Ok(())
}
