//! The speculators trainer's dataset directory: the rows as a Hugging Face
//! `datasets` table (`data-00000-of-00001.arrow`, `dataset_info.json`,
//! `state.json`: `input_ids`, `loss_mask`, `seq_len`) and the states as
//! `hidden_states/hs_{i}.safetensors`, file `i` for row `i`, each holding
//! `token_ids` (I64 `[T]`), `loss_mask` (U8 `[T]`) and `hidden_states`
//! (`[T, L, H]`). The same `manifest.json` as the native format lists each
//! file as a one-sample shard, so resume and verify work alike. The table
//! gets a row as each file is handed over (a resumed run's table first reads
//! back the rows of the files earlier runs listed; `merge` reads back every
//! part's) and is put in place when the run finishes.

use super::draft_vocab::{d2t_file, t2d_file, TokenCounts, TOKEN_FREQ_FILE};
use super::output::{Commit, OutLoc, Output, Temp, Temps};
use super::{hf_dataset, io_err, OpenMode, Sink, SinkError};
use crate::files::Dir;
use crate::format::manifest::{hash_hex, InputInfo, Manifest, SampleInfo, ShardInfo};
use crate::format::MappedFile;
use crate::pipeline::source::{InputPos, Sample};
use crate::shape::{DType, Dim, StatesView};
use std::collections::VecDeque;
use std::io::Write;
use std::sync::{mpsc, Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;

/// Writes one file per sample, named by the sample's index. The caller's
/// thread only encodes: each file is created, written and fsynced by one of
/// a fixed set of writer threads while the next samples are encoded, a few
/// files at a time (their fsyncs overlap on the disk), and a committer
/// thread journals and renames them in sample order, each time taking every
/// file whose write is done (one journal sync and one directory sync for the
/// group, paid while the caller goes on encoding).
pub struct SpeculatorsSink {
    // Shared with the committer thread, which holds it only to commit.
    out: Arc<Mutex<Output>>,
    input_path: String,
    // Encoding buffers: a sample's hidden states `[T, L, H]` go to a spare
    // one; a writer thread hands each back once its bytes are in the file
    // (before the fsync), so a few buffers, warm in cache, go round.
    spare: Option<mpsc::Receiver<Vec<u8>>>,
    encoder: SpeculatorsEncoder,
    // The bytes of each file in flight (handed over, not yet settled), oldest first.
    in_flight: VecDeque<u64>,
    // The writer and committer threads, started with the first file.
    threads: Option<Threads>,
    // The row (and file, and manifest shard) index of the next sample.
    next_index: usize,
    // The dataset table, a row pushed as each file is handed over (after
    // the rows of the files earlier runs listed), so that `finish` reads
    // nothing back.
    table: Option<Table>,
    // A write or commit failed: nothing more is committed.
    failed: bool,
    done: usize,
    bytes_written: u64,
}

/// Files in flight at most, and writer threads: their fsyncs overlap on the
/// disk (8 against 4 took the bf16 writer from 0.85 to 1.0 of a plain write;
/// 16 leave files being written while a group commits).
const IN_FLIGHT: usize = 16;
/// Bytes of files in flight at most: their buffers until written, then
/// their dirty pages until fsynced. It also bounds how many large buffers
/// go round (each huge file leaves fewer in flight).
const IN_FLIGHT_BYTES: u64 = 512 << 20;

/// The threads behind the sink.
struct Threads {
    // File `k` goes to writer `k % IN_FLIGHT`, which has handed back file
    // `k - IN_FLIGHT` by then (files settle in order, at most IN_FLIGHT in flight).
    writers: Vec<(mpsc::Sender<Job>, JoinHandle<()>)>,
    submitted: usize,
    // Each file handed to a writer, in order, for the committer.
    flights: Option<mpsc::Sender<Flight>>,
    // One answer per file, in order.
    settled: mpsc::Receiver<Settled>,
    committer: Option<JoinHandle<()>>,
}

/// One file for a writer thread: `lead` then `body`, checksummed from `lead[ids_at..]`.
struct Job {
    name: String,
    lead: Vec<u8>,
    ids_at: usize,
    body: Vec<u8>,
    done: mpsc::SyncSender<Written>,
}

/// A writer thread's answer: the temporary file (when it was created) and
/// the sample's checksum or why there is none.
struct Written {
    tmp: Option<Temp>,
    digest: Result<u64, SinkError>,
}

/// A sample whose file a writer thread is writing, on its way to the committer.
struct Flight {
    shard: ShardInfo,
    sample: SampleInfo,
    end: InputPos,
    done: mpsc::Receiver<Written>,
}

impl Flight {
    /// Waits for the writer's answer.
    fn wait(self) -> (Self, Written) {
        let w = self.done.recv().unwrap_or_else(|_| Written {
            tmp: None,
            digest: Err(SinkError::Directory(format!("{}: the writer thread stopped", self.shard.file))),
        });
        (self, w)
    }
}

/// The committer's answer for one file.
enum Settled {
    /// Journaled and renamed, with its bytes.
    Committed { bytes: u64 },
    /// Given up: with the error for the file that failed, without it for
    /// the files after it (they took their places after it).
    Failed(Option<SinkError>),
}

/// A writer thread: creates, writes and fsyncs each file it is given, and
/// hands the buffer back to `spare` once written.
fn writer(temps: Arc<Temps>, jobs: mpsc::Receiver<Job>, spare: mpsc::Sender<Vec<u8>>) {
    for Job { name, lead, ids_at, body, done } in jobs {
        let written = match temps.create(&name) {
            Err(e) => {
                let _ = spare.send(body);
                Written { tmp: None, digest: Err(e) }
            }
            Ok((tmp, mut f)) => {
                // The checksum (ids, mask, then the states) is taken a chunk
                // at a time just before the chunk is written.
                let digest = (|| {
                    let mut hasher = xxhash_rust::xxh3::Xxh3::new();
                    hasher.update(&lead[ids_at..]);
                    f.write_all(&lead)?;
                    let wrote = body.chunks(1 << 20).try_for_each(|chunk| {
                        hasher.update(chunk);
                        f.write_all(chunk)
                    });
                    // The bytes are in the page cache: the buffer is free.
                    let _ = spare.send(body);
                    wrote?;
                    f.sync_all()?;
                    Ok(hasher.digest())
                })();
                Written { digest: digest.map_err(io_err(&tmp)), tmp: Some(tmp) }
            }
        };
        let _ = done.send(written);
    }
}

/// Locks the output (a panic elsewhere while holding it leaves it as it was).
fn lock(out: &Mutex<Output>) -> MutexGuard<'_, Output> {
    out.lock().unwrap_or_else(|e| e.into_inner())
}

/// The committer thread: takes the files in order as their writes finish and
/// commits each run of finished files as one group. After a failed write or
/// commit, it discards every later file. It ends when the sink closes the
/// channel, having settled every file it was given.
fn committer(out: Arc<Mutex<Output>>, flights: mpsc::Receiver<Flight>, settled: mpsc::Sender<Settled>) {
    let mut failed = false;
    // A file taken from the channel whose write was not done yet.
    let mut next: Option<Flight> = None;
    loop {
        // The oldest file, waited for, then every one behind it already written.
        let Some(first) = next.take().or_else(|| flights.recv().ok()) else { return };
        let mut group = vec![first.wait()];
        while let Ok(f) = flights.try_recv() {
            match f.done.try_recv() {
                Ok(w) => group.push((f, w)),
                Err(_) => {
                    next = Some(f);
                    break;
                }
            }
        }
        let _span = tracing::debug_span!("commit", files = group.len()).entered();
        let mut out = lock(&out);
        let mut answers = Vec::with_capacity(group.len());
        let mut commits = Vec::with_capacity(group.len());
        for (mut f, w) in group {
            let ok = !failed && w.digest.is_ok();
            match (w.digest, w.tmp) {
                (Ok(digest), Some(tmp)) if ok => {
                    f.sample.checksum = hash_hex(digest);
                    answers.push(Settled::Committed { bytes: f.shard.bytes });
                    commits.push(Commit { tmp, info: f.shard, samples: vec![f.sample], end: f.end });
                }
                (digest, tmp) => {
                    if let (Some(tmp), Ok(o)) = (tmp, out.get()) {
                        o.discard(&tmp);
                    }
                    answers.push(Settled::Failed(digest.err().filter(|_| !failed)));
                    failed = true;
                }
            }
        }
        if !commits.is_empty() {
            let n = commits.len();
            if let Err(e) = out.get().and_then(|o| o.commit_all(commits)) {
                // The group is not in the manifest (a resume finds what the
                // journal lists); the error is told with its first file.
                failed = true;
                let mut e = Some(e);
                for a in answers.iter_mut().take(n) {
                    *a = Settled::Failed(e.take());
                }
            }
        }
        drop(out);
        for a in answers {
            let _ = settled.send(a);
        }
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
            out: Arc::new(Mutex::new(out)),
            input_path,
            spare: None,
            encoder: SpeculatorsEncoder::new(dtype),
            in_flight: VecDeque::new(),
            threads: None,
            next_index: 0,
            table: None,
            failed: false,
            done,
            bytes_written: 0,
        })
    }

    /// The file of row `i`, inside the output directory.
    pub fn file_name(i: usize) -> String {
        format!("hidden_states/hs_{i}.safetensors")
    }

    /// Starts the dataset table (once, before this run commits a file)
    /// with the rows of the files earlier runs listed: a resumed run's table
    /// holds the rows of every run that wrote files.
    fn start_table(&mut self) -> Result<&mut Table, SinkError> {
        if self.table.is_none() {
            let mut out = lock(&self.out);
            let out = out.get()?;
            let _span = tracing::info_span!("dataset_table", listed = out.listed().shards).entered();
            let (tmp, f) = out.create_temp(hf_dataset::DATA_FILE)?;
            let mut table = Table::new(tmp.clone(), f, out.manifest()).inspect_err(|_| out.discard(&tmp))?;
            if out.listed().shards > 0 {
                let listed = out.journal_entries().inspect_err(|_| out.discard(&tmp))?;
                let shards = listed.map(|e| e.map(|e| e.shard));
                table.push_listed(out.dir(), shards).inspect_err(|_| out.discard(&tmp))?;
            }
            self.table = Some(table);
        }
        Ok(self.table.as_mut().expect("started above"))
    }

    /// Ends the dataset table and puts it and the files that go with it in place.
    fn write_table(&mut self) -> Result<(), SinkError> {
        self.start_table()?;
        let table = self.table.take().expect("started above");
        let mut out = lock(&self.out);
        let out = &*out.get()?;
        let dir = out.dir();
        table.finish(
            out.manifest(),
            |name| out.create_temp(name),
            |tmp, name| dir.rename(&tmp.name, dir, name).map_err(io_err(&dir.join(name))),
            |tmp| out.discard(tmp),
        )?;
        // The renames are durable before the manifest says the run is complete.
        dir.sync();
        Ok(())
    }

    /// Files (rows) the directory lists: on a resume, those kept.
    pub fn listed_shards(&self) -> Result<usize, SinkError> {
        Ok(lock(&self.out).get()?.listed().shards)
    }

    /// The manifest as written so far.
    pub fn manifest(&self) -> impl std::ops::Deref<Target = Manifest> + '_ {
        ManifestGuard(lock(&self.out))
    }

    /// Starts the writer and committer threads (once).
    fn start_threads(&mut self) -> Result<&mut Threads, SinkError> {
        if self.threads.is_none() {
            let mut out = lock(&self.out);
            let out = out.get()?;
            self.next_index = out.listed().shards;
            let temps = Arc::new(out.temps()?);
            let (spare_tx, spare) = mpsc::channel();
            let spawn = |name: String, f: Box<dyn FnOnce() + Send>| {
                std::thread::Builder::new().name(name).spawn(f).map_err(io_err(out.dir().path()))
            };
            let mut writers = Vec::with_capacity(IN_FLIGHT);
            for i in 0..IN_FLIGHT {
                let (tx, rx) = mpsc::channel();
                let (temps, spare) = (temps.clone(), spare_tx.clone());
                let run = Box::new(move || writer(temps, rx, spare));
                writers.push((tx, spawn(format!("strata-sample-writer-{i}"), run)?));
            }
            let (flights, flights_rx) = mpsc::channel();
            let (settled_tx, settled) = mpsc::channel();
            let shared = self.out.clone();
            let committer =
                spawn("strata-committer".into(), Box::new(move || committer(shared, flights_rx, settled_tx)))?;
            self.spare = Some(spare);
            self.threads =
                Some(Threads { writers, submitted: 0, flights: Some(flights), settled, committer: Some(committer) });
        }
        Ok(self.threads.as_mut().expect("started above"))
    }

    /// Takes the committer's answer for the oldest file in flight, waiting
    /// for it when `wait`; false when there was none to take.
    fn take_settled(&mut self, wait: bool) -> Result<bool, SinkError> {
        let Some(threads) = &self.threads else { return Ok(false) };
        if self.in_flight.is_empty() {
            return Ok(false);
        }
        let answer = if wait {
            threads.settled.recv().map_err(|_| ())
        } else {
            match threads.settled.try_recv() {
                Ok(a) => Ok(a),
                Err(mpsc::TryRecvError::Empty) => return Ok(false),
                Err(mpsc::TryRecvError::Disconnected) => Err(()),
            }
        };
        self.in_flight.pop_front();
        match answer {
            Ok(Settled::Committed { bytes }) => {
                self.bytes_written += bytes;
                Ok(true)
            }
            Ok(Settled::Failed(e)) => {
                self.failed = true;
                Err(e.unwrap_or_else(|| SinkError::Directory("given up after an earlier failed write".into())))
            }
            Err(()) => {
                self.failed = true;
                Err(SinkError::Directory("the committer thread stopped".into()))
            }
        }
    }

    /// Waits until at most `files` files are in flight holding at most
    /// `bytes` between them, and takes the answers already there.
    fn settle(&mut self, files: usize, bytes: u64) -> Result<(), SinkError> {
        while self.take_settled(false)? {}
        while self.in_flight.len() > files || (self.in_flight.iter().sum::<u64>() > bytes && !self.in_flight.is_empty())
        {
            self.take_settled(true)?;
        }
        Ok(())
    }

    /// Fails at once once a write or commit has failed (that error was
    /// returned): the files after it are not this run's to list.
    fn check(&self) -> Result<(), SinkError> {
        if self.failed {
            return Err(SinkError::Directory("an earlier write failed; nothing more is written".into()));
        }
        Ok(())
    }
}

/// The manifest inside the locked output.
struct ManifestGuard<'a>(MutexGuard<'a, Output>);

impl std::ops::Deref for ManifestGuard<'_> {
    type Target = Manifest;
    fn deref(&self) -> &Manifest {
        self.0.manifest()
    }
}

impl Drop for SpeculatorsSink {
    fn drop(&mut self) {
        // A run that stops early (an error elsewhere) still commits the
        // samples it handed over whose files were written, unless a write or
        // commit failed; what is not committed stays a temporary file (resume
        // removes it). No thread is left running, and no unfinished table.
        if let Some(table) = self.table.take() {
            if let Ok(o) = lock(&self.out).get() {
                o.discard(&table.tmp);
            }
        }
        if let Some(mut t) = self.threads.take() {
            drop(t.flights.take());
            if let Some(c) = t.committer.take() {
                let _ = c.join();
            }
            for (jobs, thread) in t.writers.drain(..) {
                drop(jobs);
                let _ = thread.join();
            }
        }
    }
}

impl<L: Dim, H: Dim> Sink<L, H> for SpeculatorsSink {
    fn write_sample(&mut self, sample: &Sample, states: StatesView<'_, L, H>) -> Result<(), SinkError> {
        let _span = tracing::debug_span!("write", index = sample.index).entered();
        self.check()?;
        let t = states.shape()[1];
        self.start_table()?;
        self.start_threads()?;
        // Buffers of files committed meanwhile come back first.
        self.settle(usize::MAX, u64::MAX)?;
        // Encoded while earlier samples' files are still being written.
        let mut body = self.spare.as_ref().and_then(|s| s.try_recv().ok()).unwrap_or_default();
        let (lead, ids_at) = self.encoder.encode(&sample.input_ids, sample.loss_mask.as_deref(), states, &mut body);
        let bytes = (lead.len() + body.len()) as u64;
        // Room for this one: at most IN_FLIGHT files, and IN_FLIGHT_BYTES
        // between them (one file alone may be larger).
        self.settle(IN_FLIGHT - 1, IN_FLIGHT_BYTES.saturating_sub(bytes))?;
        // Row `i` of the table is file `i`, and its place in the manifest.
        let index = self.next_index;
        let name = Self::file_name(index);
        let (done, answer) = mpsc::sync_channel(1);
        let job = Job { name: name.clone(), lead, ids_at, body, done };
        let threads = self.start_threads()?;
        let (jobs, _) = &threads.writers[threads.submitted % IN_FLIGHT];
        let sent = jobs.send(job).is_ok();
        let info = SampleInfo {
            id: sample.id.clone(),
            shard: index,
            tokens: t,
            checksum: String::new(), // set by the committer from the writer's answer
            index: Some(sample.index),
            finish: sample.finish.clone(),
        };
        let shard = ShardInfo { file: name.clone(), samples: 1, bytes, input: None };
        let flight = Flight { shard, sample: info, end: sample.end.clone(), done: answer };
        if !sent || threads.flights.as_ref().is_none_or(|f| f.send(flight).is_err()) {
            self.failed = true;
            return Err(SinkError::Directory(format!("{name}: a writer thread stopped")));
        }
        threads.submitted += 1;
        self.next_index += 1;
        self.in_flight.push_back(bytes);
        // The row, as the file holds it (a mask of ones without one).
        let ones = if sample.loss_mask.is_none() { t } else { 0 };
        let mask = sample.loss_mask.as_deref().unwrap_or_default().iter().map(|&m| m as i64);
        let ids = sample.input_ids.iter().map(|&v| v as i64);
        let pushed = self.start_table()?.push(ids, mask.chain(std::iter::repeat_n(1, ones)));
        self.failed |= pushed.is_err();
        pushed
    }

    fn skip_sample(&mut self, sample: &Sample, reason: String) -> Result<(), SinkError> {
        self.check()?;
        // The skip belongs after the samples in flight.
        self.settle(0, 0)?;
        lock(&self.out).skip_sample(sample, reason)
    }

    fn finish(&mut self, input: InputPos) -> Result<(), SinkError> {
        self.check()?;
        self.settle(0, 0)?;
        self.write_table()?;
        lock(&self.out).get()?.finish(InputInfo { path: self.input_path.clone(), whole: input })
    }

    fn resume_from(&self) -> usize {
        self.done
    }

    fn bytes_written(&self) -> u64 {
        // Counted when a file is committed: those in flight are not yet.
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

/// The dataset table being written, a row per file, with the loss-masked
/// token counts when the run writes the trainer's vocabulary files.
pub(crate) struct Table {
    tmp: Temp,
    rows: hf_dataset::TableWriter<std::io::BufWriter<std::fs::File>>,
    counts: Option<TokenCounts>,
}

impl Table {
    /// A table for `manifest`'s run in the fresh temporary file `tmp`.
    fn new(tmp: Temp, f: std::fs::File, manifest: &Manifest) -> Result<Self, SinkError> {
        let rows = hf_dataset::TableWriter::new(std::io::BufWriter::with_capacity(1 << 20, f))
            .map_err(|e| SinkError::Directory(format!("{}: {e}", tmp.display())))?;
        let counts = (!manifest.draft_vocab_sizes.is_empty()).then(TokenCounts::default);
        Ok(Table { tmp, rows, counts })
    }

    /// Appends a row: token ids and loss mask, as the row's file holds them.
    fn push(
        &mut self,
        ids: impl ExactSizeIterator<Item = i64> + Clone,
        mask: impl Iterator<Item = i64> + Clone,
    ) -> Result<(), SinkError> {
        if let Some(c) = &mut self.counts {
            c.add_row(ids.clone(), mask.clone());
        }
        self.rows.push(ids, mask).map_err(|e| SinkError::Directory(format!("{}: {e}", self.tmp.display())))
    }

    /// Appends the rows of the files `shards` lists, read back from `dir`
    /// (through its handle, links not followed).
    fn push_listed(
        &mut self,
        dir: &Dir,
        shards: impl Iterator<Item = Result<ShardInfo, SinkError>>,
    ) -> Result<(), SinkError> {
        for shard in shards {
            let shard = shard?;
            let path = dir.join(&shard.file);
            let opened = dir.walk(&shard.file, false).and_then(|(sub, name)| sub.open_file(&name));
            let opened = opened.map_err(io_err(&path))?;
            let file = MappedFile::from_file(&opened, &path)?;
            let tensor = |name: &str| {
                file.tensors
                    .get(name)
                    .map(|e| file.bytes(e))
                    .ok_or_else(|| SinkError::Directory(format!("{}: no tensor {name}", path.display())))
            };
            let ids = tensor("token_ids")?;
            let mask = tensor("loss_mask")?;
            let ids = ids.chunks_exact(8).map(|c| i64::from_le_bytes(c.try_into().expect("8 bytes")));
            self.push(ids, mask.iter().map(|&m| m as i64))?;
        }
        Ok(())
    }

    /// Ends the table and writes the files that go with it (`dataset_info.json`,
    /// `state.json` and, with `--draft-vocab-size`, `token_freq.pt` and each
    /// size's `d2t-N.npy`/`t2d-N.npy`), each to a temporary file from `temp`;
    /// they are fsynced together (their syncs overlap on the disk) and then
    /// put in place by `place`, which need not sync the directory: the
    /// caller does, once. On failure every temporary file goes to `discard`.
    fn finish(
        self,
        manifest: &Manifest,
        mut temp: impl FnMut(&str) -> Result<(Temp, std::fs::File), SinkError>,
        mut place: impl FnMut(&Temp, &str) -> Result<(), SinkError>,
        discard: impl Fn(&Temp),
    ) -> Result<(), SinkError> {
        let Table { tmp, rows, counts } = self;
        let table_err = |e: arrow_schema::ArrowError| SinkError::Directory(format!("{}: {e}", tmp.display()));
        let finished = rows
            .finish()
            .map_err(table_err)
            .and_then(|(w, fp)| Ok((w.into_inner().map_err(|e| io_err(&tmp)(e.into_error()))?, fp)));
        let (f, fingerprint) = match finished {
            Ok(x) => x,
            Err(e) => {
                discard(&tmp);
                return Err(e);
            }
        };
        // The temporary files written so far, with their names.
        let mut written: Vec<(Temp, std::fs::File, String)> = vec![(tmp, f, hf_dataset::DATA_FILE.to_string())];
        let r = (|| {
            let mut files = vec![
                (hf_dataset::INFO_FILE.to_string(), hf_dataset::info_json(manifest).into_bytes()),
                (hf_dataset::STATE_FILE.to_string(), hf_dataset::state_json(&fingerprint).into_bytes()),
            ];
            if let Some(counts) = counts {
                let v = manifest.model.vocab_size;
                if v == 0 {
                    return Err(SinkError::Directory(
                        "--draft-vocab-size: the manifest records no vocabulary size (written by an older strata)"
                            .into(),
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
                let w = f.write_all(&bytes).map_err(io_err(&tmp));
                written.push((tmp, f, name));
                w?;
            }
            // Every file fsynced, each on its own thread.
            std::thread::scope(|s| {
                let syncs: Vec<_> =
                    written.iter().map(|(tmp, f, _)| s.spawn(move || f.sync_all().map_err(io_err(tmp)))).collect();
                syncs.into_iter().try_for_each(|h| {
                    h.join().unwrap_or_else(|_| Err(SinkError::Directory("an fsync thread panicked".into())))
                })
            })?;
            written.iter().try_for_each(|(tmp, _, name)| place(tmp, name))
        })();
        if r.is_err() {
            // Those placed already are gone from their temporary names; the rest go.
            written.iter().for_each(|(tmp, _, _)| discard(tmp));
        }
        r
    }
}

/// Writes the dataset table of `dir` for `manifest`'s job from `files`, in
/// row order: each file's `token_ids` and `loss_mask`, read back, and the
/// files that go with it (see [`Table::finish`]).
pub(crate) fn write_table(
    dir: &Dir,
    manifest: &Manifest,
    files: impl Iterator<Item = Result<ShardInfo, SinkError>>,
    mut temp: impl FnMut(&str) -> Result<(Temp, std::fs::File), SinkError>,
    place: impl FnMut(&Temp, &str) -> Result<(), SinkError>,
    discard: impl Fn(&Temp),
) -> Result<(), SinkError> {
    let _span = tracing::info_span!("dataset_table").entered();
    let (tmp, f) = temp(hf_dataset::DATA_FILE)?;
    let mut table = match Table::new(tmp.clone(), f, manifest) {
        Ok(t) => t,
        Err(e) => {
            discard(&tmp);
            return Err(e);
        }
    };
    if let Err(e) = table.push_listed(dir, files) {
        discard(&table.tmp);
        return Err(e);
    }
    table.finish(manifest, temp, place, discard)
}
