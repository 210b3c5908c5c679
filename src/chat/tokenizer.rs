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
    Hf(Box<tokenizers::Tokenizer>),
    /// A tiktoken BPE.
    Tiktoken(Box<Tiktoken>),
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
        let json = dir.join(FILES[0]);
        if json.is_file() {
            let text = checked_json(&read(&json)?, &json.display().to_string())?;
            let mut t = tokenizers::Tokenizer::from_bytes(text.as_bytes())
                .map_err(|e| ChatError::Tokenizer(format!("{}: {e}", json.display())))?;
            // transformers tokenizes chat text without the file's truncation or padding.
            t.with_padding(None);
            t.with_truncation(None).map_err(|e| ChatError::Tokenizer(format!("{}: {e}", json.display())))?;
            return Ok(Tokenizer::Hf(Box::new(t)));
        }
        let bpe = dir.join(FILES[1]);
        if bpe.is_file() {
            let text = read(&bpe)?;
            return Self::tiktoken(&text, &bpe.display().to_string(), config);
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
            Tokenizer::Hf(t) => t.get_vocab_size(true),
            Tokenizer::Tiktoken(t) => t.vocab_size(),
        }
    }

    /// Tokenizes `text`; special tokens written in it are recognised.
    /// `add_special` adds what the tokenizer's post-processor adds (a BOS):
    /// `false` for rendered chat text, which carries its own.
    pub fn encode(&self, text: &str, add_special: bool, out: &mut Encoded) -> Result<(), ChatError> {
        out.ids.clear();
        out.spans.clear();
        match self {
            Tokenizer::Hf(t) => {
                let e = t
                    .encode(text, add_special)
                    .map_err(|e| ChatError::Text(format!("the tokenizer fails on this text: {e}")))?;
                out.ids.extend_from_slice(e.get_ids());
                out.spans.extend_from_slice(e.get_offsets());
                Ok(())
            }
            Tokenizer::Tiktoken(t) => t.encode(text, &mut out.ids, &mut out.spans),
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
