//! Records to samples on a thread of their own: tokenizing and rendering
//! run while the model computes earlier samples.

use super::{InputFormat, Item, Record, Records};
use crate::chat::isolate::{Isolation, RenderProcess};
use crate::chat::{Chat, ChatError, Conversation, LongRows, RowOptions, Rows, RowsError};
use crate::pipeline::source::{InputPos, Sample, Source, SourceError};
use std::sync::mpsc::{Receiver, SyncSender};
use std::sync::{Arc, Mutex};

/// How records become samples.
#[derive(Clone, Debug)]
pub struct PrepareOptions {
    /// Masks, row mode, and the limit for conversations (`max_len`).
    pub rows: RowOptions,
    /// `--max-seq-len`, when given: token and text records are cut or skipped
    /// by it too (without it they must fit the model, or the run stops).
    pub limit_all: bool,
    /// Where the limit comes from, for messages (`max_position_embeddings 4096`).
    pub limit_from: String,
    /// Render and tokenize in a child process (see [`crate::chat::isolate`]);
    /// `None`: in this one, where only the template's fuel bounds a render.
    pub isolation: Option<Isolation>,
    /// Conversations the template may fail on in a row before the run stops
    /// (`--max-template-failures`; 0: never).
    pub max_template_failures: usize,
    /// Records precede this input (it is a part of a larger one): a render
    /// failure on its first conversation is that conversation's, as it would
    /// be for one process, not the template's.
    pub after_start: bool,
}

/// What the preparation did, for the summary.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PrepareStats {
    /// Records read.
    pub records: usize,
    /// Conversations among them.
    pub conversations: usize,
    /// Rows that hold a whole conversation.
    pub rows_per_conversation: usize,
    /// Rows that hold one assistant turn.
    pub rows_per_turn: usize,
    /// Tokens per-turn rows would have held beyond the per-conversation rows.
    pub saved_tokens: usize,
    /// Conversations without messages.
    pub skipped_empty: usize,
    /// Conversations without an assistant turn after the first message.
    pub skipped_no_assistant: usize,
    /// Records that could not be rendered or tokenized (counted, reported, left out).
    pub errors: usize,
    /// The first few of those errors.
    pub first_errors: Vec<String>,
    /// Assistant turns left out because their prompt alone fills the length limit.
    pub long_prompts: usize,
    /// Rows cut to the length limit.
    pub truncated: usize,
    /// Rows left out as longer than the limit (`--skip-long`).
    pub skipped_long: usize,
    /// The first [`NAMED_ROLES`] role names not known (counted as assistant), in input order.
    pub unknown_roles: Vec<String>,
    /// Distinct role names not known, all of them.
    pub unknown_role_count: usize,
}

/// Unknown role names warned about and listed in the summary at most; the rest are counted.
pub const NAMED_ROLES: usize = 20;

/// Why a text or conversation record cannot be tokenized.
fn needs_tokenizer(what: &str, why: &str) -> String {
    format!("the input holds {what}, which needs the model's tokenizer: {why}")
}

enum Msg {
    Sample(Box<Result<Sample, SourceError>>),
    End(InputPos),
}

/// Samples prepared on a thread from a [`Records`] stream.
pub struct Prepared {
    rx: Receiver<Msg>,
    consumed: InputPos,
    stats: Arc<Mutex<PrepareStats>>,
    format: Arc<Mutex<InputFormat>>,
    thread: Option<std::thread::JoinHandle<()>>,
    ended: bool,
}

/// Samples ready ahead of the forward.
const AHEAD: usize = 256;
/// Errors quoted in the summary at most.
const QUOTED_ERRORS: usize = 5;
/// Errors logged as they happen at most (the summary counts them all).
const WARNED_ERRORS: usize = 20;

impl Prepared {
    /// Starts the thread. `chat` is needed for text and conversation records
    /// (`Err` says why there is none, for their message);
    /// `name` (the input path) appears in messages.
    pub fn spawn(
        records: Box<dyn Records>,
        chat: Result<Arc<Chat>, String>,
        opts: PrepareOptions,
        name: String,
    ) -> Result<Self, SourceError> {
        let (tx, rx) = std::sync::mpsc::sync_channel(AHEAD);
        let stats = Arc::new(Mutex::new(PrepareStats::default()));
        let format = Arc::new(Mutex::new(records.format()));
        let (s, f) = (stats.clone(), format.clone());
        let thread = std::thread::Builder::new()
            .name("strata-prepare".into())
            // Templates recurse (macros, nested values): room beyond the 2 MiB default.
            .stack_size(64 << 20)
            .spawn(move || {
                let rendered = opts.after_start;
                let (roles_seen, ids_seen) = Default::default();
                let (process, failures, row) = (None, 0, 0);
                let w = Worker {
                    records,
                    chat,
                    opts,
                    name,
                    stats: s,
                    format: f,
                    tx,
                    roles_seen,
                    ids_seen,
                    process,
                    failures,
                    row,
                    rendered,
                };
                w.run()
            })
            .map_err(|cause| SourceError::Io { path: "(prepare thread)".into(), cause })?;
        Ok(Prepared { rx, consumed: InputPos::default(), stats, format, thread: Some(thread), ended: false })
    }

    /// What the preparation did so far.
    pub fn stats(&self) -> Arc<Mutex<PrepareStats>> {
        self.stats.clone()
    }

    /// The input's format, once detected: shared, so it can be read after the samples are consumed.
    pub fn format_handle(&self) -> Arc<Mutex<InputFormat>> {
        self.format.clone()
    }
}

impl Drop for Prepared {
    fn drop(&mut self) {
        // Unblock the worker (it stops at its next send). One still reading
        // (a quiet pipe) or rendering is left to finish on its own: a run
        // that stops must not wait for its input.
        let (_, rx) = std::sync::mpsc::sync_channel(0);
        drop(std::mem::replace(&mut self.rx, rx));
        if let Some(t) = self.thread.take() {
            if t.is_finished() {
                let _ = t.join();
            }
        }
    }
}

impl Iterator for Prepared {
    type Item = Result<Sample, SourceError>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.ended {
            return None;
        }
        match self.rx.recv() {
            Ok(Msg::Sample(s)) => {
                if let Ok(s) = &*s {
                    self.consumed = s.end.clone();
                }
                Some(*s)
            }
            Ok(Msg::End(pos)) => {
                self.consumed = pos;
                self.ended = true;
                None
            }
            Err(_) => {
                self.ended = true;
                Some(Err(SourceError::Input {
                    path: "(prepare thread)".into(),
                    problem: "the thread preparing samples stopped unexpectedly".into(),
                }))
            }
        }
    }
}

impl Source for Prepared {
    fn consumed(&self) -> InputPos {
        self.consumed.clone()
    }

    fn checks_ids(&self) -> bool {
        true
    }
}

struct Worker {
    records: Box<dyn Records>,
    chat: Result<Arc<Chat>, String>,
    opts: PrepareOptions,
    name: String,
    stats: Arc<Mutex<PrepareStats>>,
    format: Arc<Mutex<InputFormat>>,
    tx: SyncSender<Msg>,
    // Unknown role names seen (128-bit hashes, 16 bytes a name whatever its length).
    roles_seen: std::collections::HashSet<u128>,
    // Record ids seen, and the per-turn rows' (`{id}#{turn}`): every row's id is
    // checked here, so `Checked` keeps no second set (see `Source::checks_ids`).
    ids_seen: crate::pipeline::source::IdSet,
    // The render process, once started.
    process: Option<RenderProcess>,
    // Conversations the template failed on since it last rendered one.
    failures: usize,
    // Rows emitted so far: the next sample's index.
    row: usize,
    // Whether a conversation has rendered yet.
    rendered: bool,
}

impl Worker {
    fn stats(&self) -> std::sync::MutexGuard<'_, PrepareStats> {
        self.stats.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn run(mut self) {
        let _span = tracing::info_span!("prepare").entered();
        loop {
            let item = match self.records.next_record() {
                None => {
                    let mut end = self.records.consumed();
                    end.samples = self.row;
                    let _ = self.tx.send(Msg::End(end));
                    return;
                }
                Some(Err(e)) => {
                    let _ = self.tx.send(Msg::Sample(Box::new(Err(e))));
                    return;
                }
                Some(Ok(item)) => item,
            };
            *self.format.lock().unwrap_or_else(|e| e.into_inner()) = self.records.format();
            self.stats().records += 1;
            match self.samples(item) {
                Ok(samples) => {
                    for s in samples {
                        if self.tx.send(Msg::Sample(Box::new(Ok(s)))).is_err() {
                            return;
                        }
                    }
                }
                Err(e) => {
                    let _ = self.tx.send(Msg::Sample(Box::new(Err(e))));
                    return;
                }
            }
        }
    }

    fn line_err(&self, line: usize, problem: String) -> SourceError {
        SourceError::Line { path: self.name.clone(), line, problem }
    }

    fn sample(&mut self, item: &Item, id: String, input_ids: Vec<u32>, loss_mask: Option<Vec<u8>>) -> Sample {
        let mut end = item.end.clone();
        self.row += 1;
        end.samples = self.row;
        Sample { index: self.row - 1, line: item.line, id, input_ids, loss_mask, end, finish: vec![] }
    }

    /// A record's samples: none (a skipped conversation), one, or one per assistant turn.
    fn samples(&mut self, mut item: Item) -> Result<Vec<Sample>, SourceError> {
        let base = item.id.clone().unwrap_or_else(|| item.index.to_string());
        if !self.ids_seen.insert(xxhash_rust::xxh3::xxh3_128(base.as_bytes())) {
            return Err(self.line_err(item.line, format!("duplicate id {}: ids must be unique", crate::quote(&base))));
        }
        // Token records move on as they are: no copy of their ids.
        let record = std::mem::replace(&mut item.record, Record::Text(String::new()));
        let limit = self.opts.rows.max_len;
        let (mut ids, mut mask) = match record {
            Record::Tokens { input_ids, loss_mask } => (input_ids, loss_mask),
            Record::Text(text) => {
                let chat = self.chat.clone().map_err(|why| self.line_err(item.line, needs_tokenizer("text", &why)))?;
                let mut enc = crate::chat::Encoded::default();
                // In pieces, and no further than one token past the limit.
                let more = match self.encode(&chat, &text, limit.saturating_add(1), &mut enc) {
                    Ok(more) => more,
                    Err(crate::chat::ChatError::Text(m)) => {
                        self.refuse(&item, &base, &m);
                        return Ok(vec![]);
                    }
                    Err(e) => return Err(self.line_err(item.line, e.to_string())),
                };
                if enc.ids.is_empty() {
                    self.refuse(&item, &base, "the text gives no tokens");
                    return Ok(vec![]);
                }
                if (more || enc.ids.len() > limit) && !self.opts.limit_all {
                    let m =
                        format!("the text gives more than {limit} tokens, the limit set by {}", self.opts.limit_from);
                    return Err(self.line_err(item.line, m));
                }
                (enc.ids, None)
            }
            Record::Chat(conv) => return self.conversation(&item, base, conv),
        };
        // Token and text records are held to --max-seq-len only when it is given.
        if self.opts.limit_all && ids.len() > limit {
            if self.opts.rows.long == LongRows::Skip {
                self.stats().skipped_long += 1;
                return Ok(vec![]);
            }
            ids.truncate(limit);
            if let Some(m) = &mut mask {
                m.truncate(limit);
            }
            self.stats().truncated += 1;
        }
        Ok(vec![self.sample(&item, base, ids, mask)])
    }

    /// Counts and reports a record left out (the first few are warned about and quoted).
    fn refuse(&mut self, item: &Item, id: &str, why: &str) {
        let msg = format!("{}:{} (id {}): {why}", self.name, item.line, crate::quote(id));
        let mut st = self.stats();
        st.errors += 1;
        match st.errors {
            n if n <= WARNED_ERRORS => tracing::warn!("{msg}"),
            n if n == WARNED_ERRORS + 1 => {
                tracing::warn!("more records could not be rendered or tokenized; the summary counts them")
            }
            _ => {}
        }
        if st.first_errors.len() < QUOTED_ERRORS {
            st.first_errors.push(msg);
        }
    }

    /// The render process, started when first needed (and again after a request killed it).
    fn process(&mut self, chat: &Chat) -> Option<&mut RenderProcess> {
        let how = self.opts.isolation.clone()?;
        Some(self.process.get_or_insert_with(|| RenderProcess::new(how, chat)))
    }

    /// A text's first `cap` tokens (with BOS), in the render process when there is one; whether it has more.
    fn encode(
        &mut self,
        chat: &Chat,
        text: &str,
        cap: usize,
        out: &mut crate::chat::Encoded,
    ) -> Result<bool, ChatError> {
        match self.process(chat) {
            Some(p) => {
                let (ids, more) = p.encode_limited(text, true, cap)?;
                out.ids = ids;
                out.spans.clear();
                Ok(more)
            }
            None => chat.tokenizer.encode_limited(text, true, cap, out),
        }
    }

    /// A conversation's rows, in the render process when there is one.
    fn rows(&mut self, chat: &Chat, conv: &Conversation) -> Result<Rows, RowsError> {
        let opts = self.opts.rows;
        // What is skipped unrendered is told here, without a round trip.
        if let Some(skip) = crate::chat::rows::skipped(conv, opts.mask) {
            return Err(skip);
        }
        match self.process(chat) {
            Some(p) => p.rows(conv, &opts),
            None => chat.renderer()?.rows(conv, &opts),
        }
    }

    /// A conversation's rows, or none when it is skipped or cannot be rendered.
    fn conversation(&mut self, item: &Item, base: String, conv: Conversation) -> Result<Vec<Sample>, SourceError> {
        let chat = self.chat.clone().map_err(|why| self.line_err(item.line, needs_tokenizer("conversations", &why)))?;
        chat.renderer().map_err(|e| self.line_err(item.line, e.to_string()))?;
        self.stats().conversations += 1;
        for r in &conv.unknown_roles {
            if self.roles_seen.insert(xxhash_rust::xxh3::xxh3_128(r.as_bytes())) {
                let mut st = self.stats();
                st.unknown_role_count += 1;
                match st.unknown_role_count {
                    n if n <= NAMED_ROLES => {
                        tracing::warn!(role = %crate::quote(r), "unknown role, counted as assistant");
                        st.unknown_roles.push(crate::clip(r, crate::QUOTE_MAX).into_owned());
                    }
                    n if n == NAMED_ROLES + 1 => {
                        tracing::warn!("more unknown roles, counted as assistant too; the summary counts them")
                    }
                    _ => {}
                }
            }
        }
        let rows = match self.rows(&chat, &conv) {
            Ok(rows) => rows,
            Err(RowsError::Empty) => {
                self.stats().skipped_empty += 1;
                return Ok(vec![]);
            }
            Err(RowsError::NoAssistant) => {
                self.stats().skipped_no_assistant += 1;
                return Ok(vec![]);
            }
            // Before any conversation rendered, a failure is the template's: it stops the run.
            Err(RowsError::Render(m)) if !self.rendered => {
                let m = format!("{m}; Strata cannot render this template (it failed on the first conversation)");
                return Err(self.line_err(item.line, m));
            }
            Err(RowsError::Conversation(m)) => {
                self.refuse(item, &base, &m);
                return Ok(vec![]);
            }
            Err(RowsError::Refused(m) | RowsError::Render(m)) => {
                // A template that fails on every conversation (each one burning its budget) stops the run.
                self.failures += 1;
                let most = self.opts.max_template_failures;
                if most > 0 && self.failures >= most {
                    let origin = chat.template_origin.clone().unwrap_or_default();
                    return Err(self.line_err(
                        item.line,
                        format!(
                            "the chat template {origin} failed on {} conversations in a row; the last: {m}. Fix \
                             the template or pass another (--chat-template), or raise --max-template-failures \
                             (0: never stop)",
                            self.failures
                        ),
                    ));
                }
                self.refuse(item, &base, &m);
                return Ok(vec![]);
            }
            Err(RowsError::Fatal(e)) => return Err(self.line_err(item.line, e.to_string())),
        };
        self.rendered = true;
        self.failures = 0;
        {
            let mut st = self.stats();
            if rows.per_turn {
                st.rows_per_turn += rows.rows.len();
            } else {
                st.rows_per_conversation += rows.rows.len();
            }
            st.saved_tokens += rows.saved_tokens;
            st.long_prompts += rows.long_prompts;
            st.truncated += rows.truncated;
            st.skipped_long += rows.skipped_long;
        }
        let mut out = Vec::with_capacity(rows.rows.len());
        for r in rows.rows {
            let id = match r.turn {
                // A per-turn row's id is checked too: a record may be named like another's turn.
                Some(t) => {
                    let id = format!("{base}#{t}");
                    if !self.ids_seen.insert(xxhash_rust::xxh3::xxh3_128(id.as_bytes())) {
                        return Err(self.line_err(item.line, format!("duplicate id {}", crate::quote(&id))));
                    }
                    id
                }
                None => base.clone(),
            };
            out.push(self.sample(item, id, r.input_ids, Some(r.loss_mask)));
        }
        Ok(out)
    }
}
