//! Samples from JSON Lines: one `{"input_ids": [...]}` object per line, with
//! optional `"id"` (a string) and `"loss_mask"` (0/1 per token).

use std::io::BufRead;

/// One input sample.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Sample {
    /// 0-based index among the file's samples (blank lines are skipped).
    pub index: usize,
    /// 1-based line number in the file, for messages.
    pub line: usize,
    /// The sample's id: the line's `"id"`, or its index.
    pub id: String,
    /// Token ids.
    pub input_ids: Vec<u32>,
    /// 1 where the token counts for the loss; `None` means all ones.
    pub loss_mask: Option<Vec<u8>>,
    /// The input consumed through this sample's line.
    pub end: InputPos,
    /// A generated row: why each of its generations ended (the manifest
    /// keeps it for `regenerated.jsonl`); empty for input rows.
    pub finish: Vec<FinishReason>,
}

impl Sample {
    /// Number of tokens.
    pub fn len(&self) -> usize {
        self.input_ids.len()
    }
    /// Whether the sample has no tokens (never true for a parsed sample).
    pub fn is_empty(&self) -> bool {
        self.input_ids.is_empty()
    }
}

/// Why a generation ended: vLLM's `finish_reason`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FinishReason {
    /// A stop token was drawn.
    Stop,
    /// `max_tokens` were drawn.
    Length,
    /// A stop token ended a reply that holds tool calls.
    ToolCalls,
}

impl FinishReason {
    /// vLLM's name.
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
            FinishReason::ToolCalls => "tool_calls",
        }
    }
}

/// A line that is not a usable sample, or an input that is not the one expected.
#[derive(Debug, thiserror::Error)]
pub enum SourceError {
    /// The input ended before the samples an earlier run wrote.
    #[error(
        "the input ends after {samples} samples, but the existing output already holds {expected}: \
         this is not the input it was made from"
    )]
    Ended {
        /// Samples the input holds.
        samples: usize,
        /// Samples the output accounts for.
        expected: usize,
    },
    /// The file cannot be read.
    #[error("cannot read {path}: {cause}")]
    Io {
        /// The file.
        path: String,
        /// The OS error.
        cause: std::io::Error,
    },
    /// An input that is not the one expected.
    #[error("{path}: {problem}")]
    Input {
        /// The input.
        path: String,
        /// What differs.
        problem: String,
    },
    /// A line with a problem.
    #[error("{path}:{line}: {problem}")]
    Line {
        /// The file.
        path: String,
        /// 1-based line number.
        line: usize,
        /// What is wrong.
        problem: String,
    },
}

/// A prefix of the input: its first `samples` samples, `bytes` long, with its digest.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct InputPos {
    /// Samples the prefix holds.
    pub samples: usize,
    /// Bytes, through the end of the last sample's line.
    pub bytes: u64,
    /// `xxh3:` of those bytes.
    pub digest: String,
}

#[derive(serde::Deserialize)]
struct Line<'a> {
    #[serde(borrow)]
    input_ids: Option<&'a serde_json::value::RawValue>,
    #[serde(borrow)]
    id: Option<&'a serde_json::value::RawValue>,
    #[serde(borrow)]
    loss_mask: Option<&'a serde_json::value::RawValue>,
}

/// The longest id accepted (ids become tensor names).
pub const MAX_ID_LEN: usize = 256;
/// The longest line read by default; [`JsonlSource::max_line`] changes it.
pub const DEFAULT_MAX_LINE: usize = 64 << 20;

/// A line lent by [`JsonlSource::next_text`]: its number, the buffer, the range of its trimmed text.
pub(crate) type LentLine = (usize, Vec<u8>, std::ops::Range<usize>);

pub(crate) type Parsed = (Option<String>, Vec<u32>, Option<Vec<u8>>);

/// Streams samples from a JSON Lines reader. Memory is bounded by one line
/// (at most [`JsonlSource::max_line`] bytes) and its tokens; the bytes read
/// are hashed as they pass, so each sample knows the input prefix it ends.
pub struct JsonlSource<R: BufRead> {
    name: String,
    reader: R,
    line: usize,
    index: usize,
    // One line, `max_line` bytes at most.
    buf: Vec<u8>,
    max_line: usize,
    max_tokens: usize,
    max_tokens_from: String,
    bytes: u64,
    hasher: xxhash_rust::xxh3::Xxh3,
    done: bool,
    // Records before this reader's first line, in a larger input (a part).
    origin: usize,
}

impl JsonlSource<std::io::BufReader<std::fs::File>> {
    /// Opens a file.
    pub fn open(path: &std::path::Path) -> Result<Self, SourceError> {
        let f =
            std::fs::File::open(path).map_err(|cause| SourceError::Io { path: path.display().to_string(), cause })?;
        Ok(Self::new(path.display().to_string(), std::io::BufReader::new(f)))
    }
}

/// Why a JSON array of integers was refused by [`scan_array`].
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
enum ArrayError {
    /// Not an array.
    #[error("`{field}` must be an array, got {got}")]
    NotArray { field: &'static str, got: String },
    /// More entries than the limit.
    #[error("`{field}` has more than {limit} entries")]
    TooMany { field: &'static str, limit: usize },
    /// An entry that is not what the field holds.
    #[error("{field}[{pos}] = {item} is not {what}")]
    Entry { field: &'static str, pos: usize, item: String, what: &'static str },
}

/// Scans a JSON array of integers without building JSON values: `limit`
/// entries at most, each checked by `check` (`None` when it is not `what`).
fn scan_array<T>(
    raw: &str,
    field: &'static str,
    limit: usize,
    mut check: impl FnMut(u64) -> Option<T>,
    what: &'static str,
) -> Result<Vec<T>, ArrayError> {
    let inner = raw
        .trim()
        .strip_prefix('[')
        .and_then(|r| r.strip_suffix(']'))
        .ok_or_else(|| ArrayError::NotArray { field, got: crate::clip(raw.trim(), 40).into_owned() })?;
    let mut out = Vec::new();
    if inner.trim().is_empty() {
        return Ok(out);
    }
    for (pos, item) in inner.split(',').enumerate() {
        if pos == limit {
            return Err(ArrayError::TooMany { field, limit });
        }
        let item = item.trim();
        match item.parse::<u64>().ok().and_then(&mut check) {
            Some(v) => out.push(v),
            None => return Err(ArrayError::Entry { field, pos, item: crate::clip(item, 40).into_owned(), what }),
        }
    }
    Ok(out)
}

/// An id as given: 1 to [`MAX_ID_LEN`] bytes without control characters (ids become tensor names).
pub(crate) fn check_id(s: String) -> Result<String, String> {
    if s.is_empty() || s.len() > MAX_ID_LEN || s.chars().any(char::is_control) {
        return Err(format!(
            "`id` {} must be 1 to {MAX_ID_LEN} bytes without control characters",
            crate::clip(&format!("{s:?}"), 60)
        ));
    }
    Ok(s)
}

/// A line's `id`: a string of 1 to [`MAX_ID_LEN`] bytes without control
/// characters, or absent (`null`).
pub(crate) fn parse_id(raw: Option<&serde_json::value::RawValue>) -> Result<Option<String>, String> {
    // Only a string is parsed: any other value (an array of a million
    // items) is refused from its raw text, without building it.
    Ok(match raw.map(|r| (r, r.get().trim_start().as_bytes().first().copied())) {
        None => None,
        Some((r, _)) if r.get().trim() == "null" => None,
        Some((r, Some(b'"'))) => {
            let s: String = serde_json::from_str(r.get()).map_err(|e| format!("`id`: {e}"))?;
            Some(check_id(s)?)
        }
        Some((r, _)) => return Err(format!("`id` must be a string, got {}", crate::clip(r.get().trim(), 40))),
    })
}

impl<R: BufRead> JsonlSource<R> {
    /// Wraps a reader; `name` appears in messages.
    pub fn new(name: String, reader: R) -> Self {
        JsonlSource {
            name,
            reader,
            line: 0,
            index: 0,
            buf: Vec::new(),
            max_line: DEFAULT_MAX_LINE,
            max_tokens: usize::MAX,
            max_tokens_from: String::new(),
            bytes: 0,
            hasher: xxhash_rust::xxh3::Xxh3::new(),
            done: false,
            origin: 0,
        }
    }

    /// Numbers lines from `first_line` (1-based) and records from
    /// `first_record` (0-based): the reader holds a part of a larger input,
    /// and default ids and messages must be the ones the whole input gives.
    /// Positions ([`JsonlSource::consumed`]) stay the part's own.
    pub fn origin(mut self, first_line: usize, first_record: usize) -> Self {
        self.line = first_line.saturating_sub(1);
        self.origin = first_record;
        self
    }

    /// The whole input's index of this reader's first record.
    pub fn first_record(&self) -> usize {
        self.origin
    }

    /// The longest line accepted, in bytes: a longer one (or an endless
    /// stream without newlines) is an error, not an ever-growing buffer.
    pub fn max_line(mut self, bytes: usize) -> Self {
        self.max_line = bytes.max(1);
        self
    }

    /// The most tokens a sample may have; parsing stops at the first one
    /// past it. `from` says where the limit comes from, for the message.
    pub fn max_tokens(mut self, n: usize, from: String) -> Self {
        self.max_tokens = n;
        self.max_tokens_from = from;
        self
    }

    /// The input consumed so far.
    pub fn consumed(&self) -> InputPos {
        InputPos { samples: self.index, bytes: self.bytes, digest: format!("xxh3:{:016x}", self.hasher.digest()) }
    }

    /// Reads one line into `buf` (with its newline); `Ok(false)` at the end.
    fn read_line(&mut self) -> Result<bool, SourceError> {
        self.buf.clear();
        loop {
            let avail = match self.reader.fill_buf() {
                Ok(a) => a,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(cause) => return Err(SourceError::Io { path: self.name.clone(), cause }),
            };
            if avail.is_empty() {
                return Ok(!self.buf.is_empty());
            }
            let (take, end) = match avail.iter().position(|&b| b == b'\n') {
                Some(i) => (i + 1, true),
                None => (avail.len(), false),
            };
            if self.buf.len() + take > self.max_line {
                return Err(SourceError::Line {
                    path: self.name.clone(),
                    line: self.line,
                    problem: format!("line is longer than {} bytes, the longest line read", self.max_line),
                });
            }
            self.buf.extend_from_slice(&avail[..take]);
            self.hasher.update(&avail[..take]);
            self.bytes += take as u64;
            self.reader.consume(take);
            if end {
                return Ok(true);
            }
        }
    }

    pub(crate) fn parse(&self, text: &[u8]) -> Result<Parsed, String> {
        let parsed: Line = serde_json::from_slice(text).map_err(|e| format!("malformed JSON: {e}"))?;
        let raw = parsed.input_ids.ok_or("no `input_ids` field")?.get();
        let what = "a token id (an integer from 0 to 4294967295)";
        let ids =
            scan_array(raw, "input_ids", self.max_tokens, |n| u32::try_from(n).ok(), what).map_err(|e| match e {
                ArrayError::TooMany { limit, .. } => {
                    format!("sample has more than {limit} tokens, the limit set by {}", self.max_tokens_from)
                }
                other => other.to_string(),
            })?;
        if ids.is_empty() {
            return Err("empty sample: `input_ids` has no tokens".into());
        }
        let id = parse_id(parsed.id)?;
        let mask = match parsed.loss_mask {
            None => None,
            Some(m) => {
                let m = scan_array(m.get(), "loss_mask", ids.len() + 1, |n| (n <= 1).then_some(n as u8), "0 or 1")
                    .map_err(|e| e.to_string())?;
                if m.len() != ids.len() {
                    return Err(format!("`loss_mask` has {} entries for {} tokens", m.len(), ids.len()));
                }
                Some(m)
            }
        };
        Ok((id, ids, mask))
    }
}

/// A stream of samples, in order, that knows how much input it consumed
/// (the manifest records it, and a resume checks it).
pub trait Source: Iterator<Item = Result<Sample, SourceError>> {
    /// The input consumed so far.
    fn consumed(&self) -> InputPos;

    /// Whether the source refuses a repeated sample id itself: then
    /// [`Checked`] keeps no set of the ids of its own (a million samples'
    /// digests are tens of megabytes).
    fn checks_ids(&self) -> bool {
        false
    }
}

impl<R: BufRead> Source for JsonlSource<R> {
    fn consumed(&self) -> InputPos {
        JsonlSource::consumed(self)
    }
}

impl<R: BufRead> JsonlSource<R> {
    /// The next non-blank line with its 1-based number, counted as a sample
    /// for [`JsonlSource::consumed`]: the line buffer itself and the range of
    /// its trimmed text. Hand the buffer back with [`JsonlSource::restore`].
    pub(crate) fn next_text(&mut self) -> Option<Result<LentLine, SourceError>> {
        loop {
            if self.done {
                return None;
            }
            self.line += 1;
            match self.read_line() {
                Ok(false) => return None,
                Ok(true) => {}
                Err(e) => {
                    self.done = true;
                    return Some(Err(e));
                }
            }
            let start = self.buf.iter().position(|b| !b.is_ascii_whitespace()).unwrap_or(self.buf.len());
            let end = self.buf.iter().rposition(|b| !b.is_ascii_whitespace()).map_or(start, |e| e + 1);
            if start == end {
                continue;
            }
            self.index += 1;
            return Some(Ok((self.line, std::mem::take(&mut self.buf), start..end)));
        }
    }

    /// Gives back the line buffer [`JsonlSource::next_text`] lent (no allocation per line).
    pub(crate) fn restore(&mut self, buf: Vec<u8>) {
        self.buf = buf;
    }

    /// The name given to [`JsonlSource::new`].
    pub fn name(&self) -> &str {
        &self.name
    }
}

impl<R: BufRead> Iterator for JsonlSource<R> {
    type Item = Result<Sample, SourceError>;

    fn next(&mut self) -> Option<Self::Item> {
        let (line, buf, text) = match self.next_text()? {
            Ok(t) => t,
            Err(e) => return Some(Err(e)),
        };
        let parsed = self.parse(&buf[text]);
        self.restore(buf);
        Some(match parsed {
            Ok((id, input_ids, loss_mask)) => Ok(Sample {
                index: self.index - 1,
                line,
                id: id.unwrap_or_else(|| (self.origin + self.index - 1).to_string()),
                input_ids,
                loss_mask,
                end: self.consumed(),
                finish: vec![],
            }),
            Err(problem) => Err(SourceError::Line { path: self.name.clone(), line, problem }),
        })
    }
}

/// What each sample must satisfy before it reaches the model.
#[derive(Clone, Debug)]
pub struct Limits {
    /// Token ids must be below it.
    pub vocab_size: usize,
    /// The most tokens a sample may have.
    pub max_tokens: usize,
    /// Where `max_tokens` comes from, for messages (`max_position_embeddings 4096`).
    pub max_tokens_from: String,
}

/// What a resumed run must find again at the head of its input: the samples
/// the existing output accounts for, and the digest of the bytes they came from.
#[derive(Clone, Debug, Default)]
pub struct Expected {
    /// `(id, tokens)` of input samples `0..len`, written or skipped.
    pub samples: Vec<(String, usize)>,
    /// The input prefix those samples end; `None` when not recorded.
    pub prefix: Option<InputPos>,
    /// For a finished output, the whole input it was made from: the input
    /// must end where it ended, with the same digest.
    pub whole: Option<InputPos>,
}

/// A set of 128-bit id digests in 256 tables chosen by the digest's top
/// byte. One table doubling to hold a million ids would free its old table,
/// megabytes that the allocator keeps (the binary keeps freed memory for
/// the forward): the peak would hold every size it went through. Here each
/// table grows by 1/256 of that, and the tables freed are reused by the next.
#[derive(Default)]
pub(crate) struct IdSet {
    tables: Vec<std::collections::HashSet<u128>>,
}

impl IdSet {
    /// Adds `digest`; `false` when it was there.
    pub(crate) fn insert(&mut self, digest: u128) -> bool {
        if self.tables.is_empty() {
            self.tables.resize_with(256, Default::default);
        }
        self.tables[(digest >> 120) as usize].insert(digest)
    }
}

/// Checks samples as they stream past, so the input is read once (a pipe
/// works): token ids against the vocabulary, lengths, unique ids, and on a
/// resume, that the head of the input is the one the output was made from.
pub struct Checked<S> {
    inner: S,
    name: String,
    limits: Limits,
    // 128-bit hashes of the ids seen: about 20 to 40 bytes a sample, whatever the id's length.
    ids: IdSet,
    // Whether this checks the ids (the source does not).
    own_ids: bool,
    expect: Expected,
    read: std::sync::Arc<std::sync::atomic::AtomicU64>,
    ended: bool,
}

impl<S: Source> Checked<S> {
    /// Wraps `inner`; `name` (the input path) appears in messages.
    pub fn new(inner: S, name: String, limits: Limits, expect: Expected) -> Self {
        let own_ids = !inner.checks_ids();
        Checked {
            inner,
            name,
            limits,
            ids: Default::default(),
            own_ids,
            expect,
            read: Default::default(),
            ended: false,
        }
    }

    /// The wrapped source.
    pub fn inner_mut(&mut self) -> &mut S {
        &mut self.inner
    }

    /// Bytes of input read so far, updated as samples pass (for progress).
    pub fn bytes_read(&self) -> std::sync::Arc<std::sync::atomic::AtomicU64> {
        self.read.clone()
    }

    fn check(&mut self, s: &Sample) -> Result<(), String> {
        let l = &self.limits;
        if s.len() > l.max_tokens {
            return Err(format!(
                "sample has {} tokens, more than {} tokens, the limit set by {}",
                s.len(),
                l.max_tokens,
                l.max_tokens_from
            ));
        }
        if let Some((pos, t)) = s.input_ids.iter().enumerate().find(|(_, &t)| t as usize >= l.vocab_size) {
            return Err(format!("input_ids[{pos}] = {t} is out of range (vocab_size {})", l.vocab_size));
        }
        if self.own_ids && !self.ids.insert(xxhash_rust::xxh3::xxh3_128(s.id.as_bytes())) {
            return Err(format!("duplicate id {}", crate::clip(&format!("{:?}", s.id), 80)));
        }
        if let Some(w) = self.expect.whole.as_ref().filter(|w| s.index >= w.samples) {
            return Err(format!(
                "this is not the input the output was made from: the output is complete with {} samples, \
                 and this input has more",
                w.samples
            ));
        }
        if let Some((id, tokens)) = self.expect.samples.get(s.index) {
            if *id != s.id || *tokens != s.len() {
                return Err(format!(
                    "this is not the input the output was made from: sample {} is {} ({} tokens) here, \
                     but {} ({tokens} tokens) in the output",
                    s.index,
                    crate::clip(&format!("{:?}", s.id), 60),
                    s.len(),
                    crate::clip(&format!("{id:?}"), 60),
                ));
            }
            if s.index + 1 == self.expect.samples.len() {
                if let Some(p) = &self.expect.prefix {
                    if p.bytes != s.end.bytes || p.digest != s.end.digest {
                        return Err(format!(
                            "this is not the input the output was made from: its first {} samples are {} bytes \
                             with digest {}, the output's came from {} bytes with digest {}",
                            p.samples, s.end.bytes, s.end.digest, p.bytes, p.digest
                        ));
                    }
                }
            }
        }
        Ok(())
    }
}

impl<S: Source> Iterator for Checked<S> {
    type Item = Result<Sample, SourceError>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.ended {
            return None;
        }
        let s = match self.inner.next() {
            Some(Ok(s)) => s,
            Some(Err(e)) => return Some(Err(e)),
            None => {
                self.ended = true;
                let end = self.inner.consumed();
                let w = self.expect.whole.as_ref()?;
                if w.bytes == end.bytes && w.digest == end.digest {
                    return None;
                }
                let problem = format!(
                    "this is not the input the output was made from: it is {} bytes with digest {}, \
                     the output's was {} bytes with digest {}",
                    end.bytes, end.digest, w.bytes, w.digest
                );
                return Some(Err(SourceError::Input { path: self.name.clone(), problem }));
            }
        };
        self.read.store(s.end.bytes, std::sync::atomic::Ordering::Relaxed);
        Some(match self.check(&s) {
            Ok(()) => Ok(s),
            Err(problem) => Err(SourceError::Line { path: self.name.clone(), line: s.line, problem }),
        })
    }
}

impl<S: Source> Source for Checked<S> {
    fn consumed(&self) -> InputPos {
        self.inner.consumed()
    }

    fn checks_ids(&self) -> bool {
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn read(text: &str) -> Vec<Result<Sample, SourceError>> {
        JsonlSource::new("t.jsonl".into(), text.as_bytes()).collect()
    }

    #[test]
    fn parses_and_numbers_lines() {
        let r = read("{\"input_ids\":[1,2]}\n\n{\"input_ids\":[3], \"id\":\"x\"}\n");
        assert_eq!(r.len(), 2);
        let s = r[1].as_ref().unwrap();
        assert_eq!((s.index, s.line, s.input_ids.clone(), s.id.as_str()), (1, 3, vec![3], "x"));
        assert_eq!(r[0].as_ref().unwrap().id, "0");
        let m = read("{\"input_ids\":[1,2],\"loss_mask\":[0,1]}");
        assert_eq!(m[0].as_ref().unwrap().loss_mask, Some(vec![0, 1]));
    }

    #[test]
    fn names_the_line_and_problem() {
        let msg = |t: &str| read(t).pop().unwrap().unwrap_err().to_string();
        assert_eq!(msg("{\"input_ids\":[]}"), "t.jsonl:1: empty sample: `input_ids` has no tokens");
        assert!(msg("{\"input_ids\":[1]}\n{oops").starts_with("t.jsonl:2: malformed JSON"));
        assert!(msg("{\"input_ids\":[1,-4]}").contains("input_ids[1] = -4 is not a token id"));
        assert_eq!(msg("{\"text\":\"hi\"}"), "t.jsonl:1: no `input_ids` field");
        assert!(msg("{\"input_ids\":[1,2],\"loss_mask\":[1]}").contains("`loss_mask` has 1 entries for 2 tokens"));
        assert!(msg("{\"input_ids\":[1],\"loss_mask\":[2]}").contains("loss_mask[0] = 2 is not 0 or 1"));
        assert!(msg("{\"input_ids\":[1],\"id\":7}").contains("`id` must be a string"));
    }
}
