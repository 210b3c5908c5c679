//! The model's tokenizer: `tokenizer.json` (the `tokenizers` crate), or a
//! tiktoken BPE file as Kimi-K2 ships it (`tiktoken.model` plus
//! `tokenizer_config.json`).

use super::tiktoken::{kimi_specials, Tiktoken, KIMI_PATTERN};
use super::ChatError;
use std::collections::HashMap;
use std::path::Path;

/// A loaded tokenizer.
pub enum Tokenizer {
    /// `tokenizer.json`.
    Hf(Box<Hf>),
    /// A tiktoken BPE.
    Tiktoken(Box<Tiktoken>),
}

/// A `tokenizer.json` tokenizer, with what tokenizing in pieces needs.
pub struct Hf {
    /// The `tokenizers` crate's tokenizer.
    pub inner: tokenizers::Tokenizer,
    // The added tokens `tokenizers` splits out of the raw text first
    // (those not normalized), matched as it matches them (leftmost-longest),
    // and for each whether a match starts a segment whose tokens depend on
    // nothing before it (not lstrip, which eats the spaces before it, and
    // not single_word, which looks at its neighbours).
    specials: Option<(aho_corasick::AhoCorasick, Vec<bool>)>,
    // The longest of them, in bytes.
    longest_special: usize,
    // What `add_special` puts before and after a text (a BOS, an EOS).
    around: (Vec<u32>, Vec<u32>),
}

impl Hf {
    fn new(inner: tokenizers::Tokenizer, name: &str) -> Result<Self, ChatError> {
        let mut added: Vec<tokenizers::AddedToken> =
            inner.get_added_tokens_decoder().into_values().filter(|t| !t.normalized).collect();
        // The crate lists special tokens first, then the others; a content twice matches as one.
        added.sort_by(|a, b| b.special.cmp(&a.special).then(a.content.cmp(&b.content)));
        added.dedup_by(|a, b| a.content == b.content);
        let longest_special = added.iter().map(|t| t.content.len()).max().unwrap_or(0);
        let specials = if added.is_empty() {
            None
        } else {
            let ac = aho_corasick::AhoCorasick::builder()
                .match_kind(aho_corasick::MatchKind::LeftmostLongest)
                .build(added.iter().map(|t| t.content.as_str()))
                .map_err(|e| ChatError::Tokenizer(format!("{name}: added tokens: {e}")))?;
            Some((ac, added.iter().map(|t| !t.lstrip && !t.single_word).collect()))
        };
        // The tokens add_special adds around a text: those around a probe's own.
        let enc = |add| {
            inner
                .encode("a", add)
                .map(|e| e.get_ids().to_vec())
                .map_err(|e| ChatError::Tokenizer(format!("{name}: {e}")))
        };
        let (plain, with) = (enc(false)?, enc(true)?);
        let at = with.windows(plain.len().max(1)).position(|w| w == plain.as_slice());
        let around = match at {
            Some(i) if !plain.is_empty() => (with[..i].to_vec(), with[i + plain.len()..].to_vec()),
            _ => (Vec::new(), Vec::new()),
        };
        Ok(Hf { inner, specials, longest_special, around })
    }
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Tokenizer::Hf(_) => "Tokenizer::Hf",
            Tokenizer::Tiktoken(_) => "Tokenizer::Tiktoken",
        })
    }
}

/// Token ids with the byte range of `text` each came from.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Encoded {
    /// Token ids.
    pub ids: Vec<u32>,
    /// `[start, end)` bytes of the text per token.
    pub spans: Vec<(usize, usize)>,
}

impl Encoded {
    /// The first token whose span holds byte `pos` (transformers' `char_to_token`).
    /// Spans run in text order, so a binary search finds it.
    pub fn token_at(&self, pos: usize) -> Option<usize> {
        let i = self.spans.partition_point(|&(_, e)| e <= pos);
        self.spans.get(i).filter(|&&(s, e)| s <= pos && pos < e).map(|_| i)
    }
}

/// The files a model directory's tokenizer is read from, in the order they are tried.
pub const FILES: [&str; 2] = ["tokenizer.json", "tiktoken.model"];

impl Tokenizer {
    /// Loads the tokenizer of a model directory: `tokenizer.json`, else `tiktoken.model`
    /// (with the special tokens of `tokenizer_config.json`).
    pub fn load(dir: &Path, config: &serde_json::Value) -> Result<Self, ChatError> {
        Ok(Self::load_digest(dir, config)?.0)
    }

    /// [`Tokenizer::load`], with an `xxh3` digest of the file's bytes as read.
    pub fn load_digest(dir: &Path, config: &serde_json::Value) -> Result<(Self, u64), ChatError> {
        let json = dir.join(FILES[0]);
        if json.is_file() {
            let raw = read(&json)?;
            let digest = xxhash_rust::xxh3::xxh3_64(raw.as_bytes());
            let text = checked_json(&raw, &json.display().to_string())?;
            let mut t = tokenizers::Tokenizer::from_bytes(text.as_bytes())
                .map_err(|e| ChatError::Tokenizer(format!("{}: {e}", json.display())))?;
            // transformers tokenizes chat text without the file's truncation or padding.
            t.with_padding(None);
            t.with_truncation(None).map_err(|e| ChatError::Tokenizer(format!("{}: {e}", json.display())))?;
            return Ok((Tokenizer::Hf(Box::new(Hf::new(t, &json.display().to_string())?)), digest));
        }
        let bpe = dir.join(FILES[1]);
        if bpe.is_file() {
            let text = read(&bpe)?;
            let digest = xxhash_rust::xxh3::xxh3_64(text.as_bytes());
            return Ok((Self::tiktoken(&text, &bpe.display().to_string(), config)?, digest));
        }
        Err(ChatError::Tokenizer(format!(
            "{} has neither {} nor {}: conversations and text need the model's tokenizer",
            dir.display(),
            FILES[0],
            FILES[1]
        )))
    }

    /// A tiktoken BPE from its file's text and `tokenizer_config.json`: special tokens from
    /// `added_tokens_decoder` (Kimi's reserved block after the ranks), the pattern from
    /// `pat_str` where the config has one, else Kimi-K2's.
    pub fn tiktoken(text: &str, name: &str, config: &serde_json::Value) -> Result<Self, ChatError> {
        let mut named = HashMap::new();
        if let Some(m) = config.get("added_tokens_decoder").and_then(|v| v.as_object()) {
            for (id, tok) in m {
                let id: u32 = id
                    .parse()
                    .map_err(|_| ChatError::Tokenizer(format!("added_tokens_decoder: id {id:?} is not an integer")))?;
                let content = tok.get("content").and_then(|c| c.as_str()).ok_or_else(|| {
                    ChatError::Tokenizer(format!("added_tokens_decoder[{id}] has no string `content`"))
                })?;
                if content.is_empty() {
                    return Err(empty_special(&format!("tokenizer_config.json: added_tokens_decoder[{id}]")));
                }
                named.insert(id, content.to_string());
            }
        }
        let pattern = config.get("pat_str").and_then(|p| p.as_str()).unwrap_or(KIMI_PATTERN);
        // The ranks come first; the reserved specials follow them.
        let base = text.lines().filter(|l| !l.trim().is_empty()).count();
        let t = Tiktoken::new(text, name, pattern, kimi_specials(base, &named))?;
        Ok(Tokenizer::Tiktoken(Box::new(t)))
    }

    /// One past the largest id the tokenizer can produce.
    pub fn vocab_size(&self) -> usize {
        match self {
            Tokenizer::Hf(t) => t.inner.get_vocab_size(true),
            Tokenizer::Tiktoken(t) => t.vocab_size(),
        }
    }

    /// The text of `ids` with special tokens kept (transformers'
    /// `decode(ids, skip_special_tokens=False)`).
    pub fn decode(&self, ids: &[u32]) -> Result<String, ChatError> {
        match self {
            Tokenizer::Hf(t) => {
                t.inner.decode(ids, false).map_err(|e| ChatError::Tokenizer(format!("cannot decode: {e}")))
            }
            Tokenizer::Tiktoken(t) => {
                t.decode(ids).ok_or_else(|| ChatError::Tokenizer("cannot decode: an id without a token".into()))
            }
        }
    }

    /// The text of the reply `ids` to `prompt` as vLLM (0.19.1) returns its
    /// `content`: special tokens dropped when `skip_special` (transformers'
    /// `skip_special_tokens`; a tiktoken model's special tokens are those it
    /// lists as special).
    ///
    /// A `tokenizer.json` model's reply is detokenized as vLLM's
    /// `FastIncrementalDetokenizer` does it: a `DecodeStream` primed with the
    /// prompt's ids, stepped one id at a time, so a first token's leading
    /// space (SentencePiece) is the one the prompt gives it, and bytes of a
    /// character the reply never finishes are dropped, not written as U+FFFD.
    /// A tiktoken model's reply is decoded whole (vLLM's slow detokenizer
    /// differs from that around special tokens; not emulated).
    pub fn decode_content(&self, prompt: &[u32], ids: &[u32], skip_special: bool) -> Result<String, ChatError> {
        match self {
            Tokenizer::Hf(t) => {
                let tk: &tokenizers::Tokenizer = &t.inner;
                let err = |e: tokenizers::Error| ChatError::Tokenizer(format!("cannot decode: {e}"));
                let (mut window, mut prefix, mut at) = (prompt.to_vec(), String::new(), 0usize);
                let mut out = String::new();
                for &id in ids {
                    let step = |w: &mut Vec<u32>, p: &mut String, a: &mut usize| {
                        tokenizers::step_decode_stream(tk, vec![id], skip_special, w, p, a)
                    };
                    let text = match step(&mut window, &mut prefix, &mut at) {
                        // vLLM starts a fresh stream where the text stops extending its
                        // prefix (tokenizers' "Invalid prefix"), and steps the id again.
                        Err(e) if e.to_string().starts_with("Invalid prefix encountered") => {
                            (window, prefix, at) = (Vec::new(), String::new(), 0);
                            step(&mut window, &mut prefix, &mut at).map_err(err)?
                        }
                        r => r.map_err(err)?,
                    };
                    out.push_str(text.as_deref().unwrap_or(""));
                }
                Ok(out)
            }
            Tokenizer::Tiktoken(t) if skip_special => {
                let kept: Vec<u32> = ids.iter().copied().filter(|&id| !t.is_special(id)).collect();
                t.decode(&kept).ok_or_else(|| ChatError::Tokenizer("cannot decode: an id without a token".into()))
            }
            Tokenizer::Tiktoken(_) => self.decode(ids),
        }
    }

    /// Tokenizes the whole of `text` at once; special tokens written in it
    /// are recognised. `add_special` adds what the tokenizer's
    /// post-processor adds (a BOS): `false` for rendered chat text, which
    /// carries its own. Memory grows with the text (about 170 bytes a byte
    /// for `tokenizer.json`): [`Tokenizer::encode_limited`] is what runs on input.
    pub fn encode(&self, text: &str, add_special: bool, out: &mut Encoded) -> Result<(), ChatError> {
        out.ids.clear();
        out.spans.clear();
        match self {
            Tokenizer::Hf(t) => {
                let e = t
                    .inner
                    .encode(text, add_special)
                    .map_err(|e| ChatError::Text(format!("the tokenizer fails on this text: {e}")))?;
                out.ids.extend_from_slice(e.get_ids());
                out.spans.extend_from_slice(e.get_offsets());
                Ok(())
            }
            Tokenizer::Tiktoken(t) => t.encode(text, &mut out.ids, &mut out.spans),
        }
    }

    /// Appends the tokens of `text` (no added BOS or EOS) to `out`, their
    /// spans moved by `at`: one piece of a longer text.
    pub(crate) fn append(&self, text: &str, at: usize, out: &mut Encoded) -> Result<(), ChatError> {
        let (ids, spans) = (out.ids.len(), out.spans.len());
        match self {
            Tokenizer::Hf(t) => {
                let e = t
                    .inner
                    .encode(text, false)
                    .map_err(|e| ChatError::Text(format!("the tokenizer fails on this text: {e}")))?;
                out.ids.extend_from_slice(e.get_ids());
                out.spans.extend(e.get_offsets().iter().map(|&(s, e)| (s + at, e + at)));
            }
            Tokenizer::Tiktoken(t) => {
                t.encode(text, &mut out.ids, &mut out.spans)?;
                out.spans[spans..].iter_mut().for_each(|(s, e)| (*s, *e) = (*s + at, *e + at));
            }
        }
        debug_assert_eq!(out.ids.len() - ids, out.spans.len() - spans);
        Ok(())
    }

    /// Where special tokens start in `text`: places where it splits into
    /// parts tokenized independently of each other (the tokens before one
    /// depend on nothing after it), in order.
    pub(crate) fn special_starts<'t>(&'t self, text: &'t str) -> Box<dyn Iterator<Item = usize> + 't> {
        match self {
            Tokenizer::Hf(t) => match &t.specials {
                Some((ac, anchor)) => Box::new(
                    ac.find_iter(text).filter(|m| anchor[m.pattern().as_usize()]).map(|m| m.start()).filter(|&s| s > 0),
                ),
                None => Box::new(std::iter::empty()),
            },
            Tokenizer::Tiktoken(t) => t.special_starts(text),
        }
    }

    /// The pre-tokenizer's pieces of `text` as byte ranges of it, in order
    /// (the tokenizer's normalizer and pre-tokenizer, or the tiktoken
    /// pattern): tokens never span two pieces, and text the normalizer
    /// deletes lies in no piece.
    pub(crate) fn pieces(&self, text: &str) -> Result<Vec<(usize, usize)>, ChatError> {
        use tokenizers::{Normalizer, OffsetReferential, OffsetType, PreTokenizedString, PreTokenizer};
        match self {
            Tokenizer::Hf(t) => {
                let fail = |e: tokenizers::Error| ChatError::Text(format!("the tokenizer fails on this text: {e}"));
                let mut pts = PreTokenizedString::from(text);
                if let Some(n) = t.inner.get_normalizer() {
                    pts.normalize(|s| n.normalize(s)).map_err(fail)?;
                }
                if let Some(p) = t.inner.get_pre_tokenizer() {
                    p.pre_tokenize(&mut pts).map_err(fail)?;
                }
                let splits = pts.get_splits(OffsetReferential::Original, OffsetType::Byte);
                Ok(splits.iter().map(|s| s.1).filter(|(s, e)| e > s).collect())
            }
            Tokenizer::Tiktoken(t) => t.pieces(text),
        }
    }

    /// The longest special token, in bytes: how far past a special token's
    /// start two texts must agree for it to be a special token in both.
    pub(crate) fn longest_special(&self) -> usize {
        match self {
            Tokenizer::Hf(t) => t.longest_special,
            Tokenizer::Tiktoken(t) => t.longest_special(),
        }
    }

    /// The tokens `add_special` puts before and after a text.
    pub(crate) fn around(&self) -> (&[u32], &[u32]) {
        match self {
            Tokenizer::Hf(t) => (&t.around.0, &t.around.1),
            Tokenizer::Tiktoken(_) => (&[], &[]),
        }
    }
}

/// An added token whose text is empty: it would match between every two
/// characters, putting its id between them.
fn empty_special(at: &str) -> ChatError {
    ChatError::Tokenizer(format!(
        "{at} has an empty `content`: an empty special token would match between every two characters of \
         the text; remove the entry"
    ))
}

/// `tokenizer.json` checked before the `tokenizers` crate reads it: no
/// empty added token, and no BPE dropout. transformers applies dropout at
/// every encode, so two runs (or a run and its resume) would tokenize the
/// same text differently: it is turned off, with one warning naming the value.
fn checked_json(text: &str, name: &str) -> Result<String, ChatError> {
    let mut v: serde_json::Value =
        serde_json::from_str(text).map_err(|e| ChatError::Tokenizer(format!("{name}: {e}")))?;
    if let Some(list) = v.get("added_tokens").and_then(|a| a.as_array()) {
        for (i, t) in list.iter().enumerate() {
            if t.get("content").and_then(|c| c.as_str()) == Some("") {
                let id = t.get("id").map_or_else(|| "?".to_string(), |id| id.to_string());
                return Err(empty_special(&format!("{name}: added_tokens[{i}] (id {id})")));
            }
        }
    }
    let dropout = v.pointer_mut("/model/dropout");
    match dropout {
        Some(d) if d.as_f64().is_some_and(|p| p > 0.0) => {
            tracing::warn!(
                "{name}: the BPE model sets dropout {d}, which makes tokenization random; Strata ignores it \
                 (an extraction must be reproducible, and a resume must not splice two tokenizations)"
            );
            *d = serde_json::Value::Null;
            Ok(v.to_string())
        }
        _ => Ok(text.to_string()),
    }
}

fn read(path: &Path) -> Result<String, ChatError> {
    // Tokenizer files are tens of MB at most; a larger one is not a tokenizer.
    crate::files::read_text(path, 1 << 30).map_err(|e| ChatError::Tokenizer(format!("{}: {e}", path.display())))
}
