//! The records `strata generate` reads: token-id prompts, text prompts and
//! conversations (speculators' layouts), one JSON object a line.

use crate::generate::conversation::{primary_id, Regeneration};
use crate::pipeline::source::{JsonlSource, Sample, Source, SourceError};
use serde_json::Value;
use std::io::BufRead;

/// What a record asks to regenerate.
#[derive(Debug)]
pub enum Prompt {
    /// `{"input_ids": [...]}`: the prompt as given, one generation.
    Tokens,
    /// `{"text": "..."}`: tokenized as vLLM's completions endpoint does (the
    /// tokenizer's special tokens added), one generation.
    Text(String),
    /// `messages`, `conversations` or a `prompt`: regenerated turn by turn.
    Chat(Box<Regeneration>),
    /// A record that cannot be regenerated, and why (refused alone).
    Bad(String),
}

/// Prompt records from JSON Lines. Each yields a [`Sample`] (its index,
/// line, id, input position; token ids for a token prompt) and leaves its
/// [`Prompt`] in [`Prompts::take_prompt`].
pub struct Prompts<R: BufRead> {
    src: JsonlSource<R>,
    last: Option<Prompt>,
}

impl<R: BufRead> Prompts<R> {
    /// Reads `src`.
    pub fn new(src: JsonlSource<R>) -> Self {
        Prompts { src, last: None }
    }

    /// The prompt of the record last yielded.
    pub fn take_prompt(&mut self) -> Option<Prompt> {
        self.last.take()
    }

    fn parse(&self, text: &[u8]) -> Result<(Option<String>, Vec<u32>, Prompt), String> {
        let v: Value = serde_json::from_slice(text).map_err(|e| format!("malformed JSON: {e}"))?;
        let Value::Object(m) = v else { return Err("a record must be a JSON object".into()) };
        if m.contains_key("input_ids") {
            let (id, ids, _) = self.src.parse(text)?;
            return Ok((id, ids, Prompt::Tokens));
        }
        if ["messages", "conversations", "prompt"].iter().any(|k| m.contains_key(*k)) {
            let prompt = match Regeneration::parse(&m) {
                Ok(r) => Prompt::Chat(Box::new(r)),
                Err(why) => Prompt::Bad(why),
            };
            return Ok((Some(primary_id(&m)), vec![], prompt));
        }
        if let Some(t) = m.get("text") {
            let prompt = match t {
                Value::String(s) if !s.is_empty() => Prompt::Text(s.clone()),
                Value::String(_) => Prompt::Bad("`text` is empty".into()),
                _ => return Err("`text` must be a string".into()),
            };
            let id = match m.get("id") {
                None | Some(Value::Null) => None,
                Some(Value::String(s)) => Some(s.clone()),
                Some(v) => Some(v.to_string()),
            };
            return Ok((id, vec![], prompt));
        }
        Err("no `input_ids`, `messages`, `conversations`, `prompt` or `text` field: strata generate reads token-id \
             prompts, text prompts and conversations"
            .into())
    }
}

impl<R: BufRead> Iterator for Prompts<R> {
    type Item = Result<Sample, SourceError>;

    fn next(&mut self) -> Option<Self::Item> {
        let (line, buf, range) = match self.src.next_text()? {
            Ok(t) => t,
            Err(e) => return Some(Err(e)),
        };
        let parsed = self.parse(&buf[range]);
        self.src.restore(buf);
        let end = self.src.consumed();
        let index = end.samples - 1;
        Some(match parsed {
            Ok((id, input_ids, prompt)) => {
                self.last = Some(prompt);
                let id = id.unwrap_or_else(|| (self.src.first_record() + index).to_string());
                Ok(Sample { index, line, id, input_ids, loss_mask: None, end, finish: vec![] })
            }
            Err(problem) => Err(SourceError::Line { path: self.src.name().to_string(), line, problem }),
        })
    }
}

impl<R: BufRead> Source for Prompts<R> {
    fn consumed(&self) -> crate::pipeline::source::InputPos {
        self.src.consumed()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_layout_is_read_and_a_bad_record_is_refused_alone() {
        let text = concat!(
            "{\"input_ids\": [1, 2], \"id\": \"t\"}\n",
            "{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}], \"id\": 5}\n",
            "{\"text\": \"once upon\"}\n",
            "{\"messages\": [{\"role\": \"assistant\", \"content\": \"x\"}]}\n",
            "[1]\n",
        );
        let mut p = Prompts::new(JsonlSource::new("t.jsonl".into(), text.as_bytes()));
        let s = p.next().unwrap().unwrap();
        assert_eq!((s.id.as_str(), s.input_ids.as_slice()), ("t", &[1u32, 2][..]));
        assert!(matches!(p.take_prompt(), Some(Prompt::Tokens)));
        let s = p.next().unwrap().unwrap();
        assert_eq!(s.id, "5");
        assert!(matches!(p.take_prompt(), Some(Prompt::Chat(_))));
        let s = p.next().unwrap().unwrap();
        assert_eq!(s.id, "2");
        assert!(matches!(p.take_prompt(), Some(Prompt::Text(t)) if t == "once upon"));
        let s = p.next().unwrap().unwrap();
        assert!(s.id.starts_with("hash_"));
        assert!(matches!(p.take_prompt(), Some(Prompt::Bad(why)) if why.starts_with("no user turn")));
        let e = p.next().unwrap().unwrap_err().to_string();
        assert!(e.contains("t.jsonl:5: a record must be a JSON object"), "{e}");
    }
}
