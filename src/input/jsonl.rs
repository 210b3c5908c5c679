//! Records from JSON Lines: token ids, text, or conversations in ShareGPT
//! or OpenAI style; the format is fixed by the first record unless chosen.

use super::{InputFormat, Item, Record, Records};
use crate::chat::{Conversation, Style};
use crate::pipeline::source::{parse_id, InputPos, JsonlSource, SourceError};
use serde_json::value::RawValue;
use std::io::BufRead;

#[derive(serde::Deserialize)]
struct Line<'a> {
    #[serde(borrow)]
    id: Option<&'a RawValue>,
    #[serde(borrow)]
    input_ids: Option<&'a RawValue>,
    #[serde(borrow)]
    text: Option<&'a RawValue>,
    #[serde(borrow)]
    conversations: Option<&'a RawValue>,
    #[serde(borrow)]
    messages: Option<&'a RawValue>,
    #[serde(borrow)]
    tools: Option<&'a RawValue>,
}

/// Records from a JSON Lines reader.
pub struct JsonlRecords<R: BufRead> {
    src: JsonlSource<R>,
    format: InputFormat,
    // The line the format was detected from (0: chosen).
    detected: usize,
}

/// The format a record's fields say.
fn detect(parsed: &Line<'_>) -> Result<InputFormat, String> {
    Ok(if parsed.input_ids.is_some() {
        InputFormat::Tokens
    } else if parsed.conversations.is_some() {
        InputFormat::ShareGpt
    } else if parsed.messages.is_some() {
        InputFormat::OpenAi
    } else if parsed.text.is_some() {
        InputFormat::Text
    } else {
        return Err(format!("no `{}` field", InputFormat::Auto.field()));
    })
}

/// The format the first non-blank line of `input` says (at most `max_line`
/// bytes read): what a part of the input must take, so that every part
/// reads the records as one process would. `None` for an empty input.
pub fn detect_first(input: impl BufRead, max_line: usize) -> Result<Option<InputFormat>, String> {
    let mut lines = JsonlSource::new(String::new(), input).max_line(max_line);
    match lines.next_text() {
        None => Ok(None),
        Some(Err(e)) => Err(e.to_string()),
        Some(Ok((line, buf, text))) => {
            let parsed: Line =
                serde_json::from_slice(&buf[text]).map_err(|e| format!("line {line}: malformed JSON: {e}"))?;
            detect(&parsed).map(Some).map_err(|e| format!("line {line}: {e}"))
        }
    }
}

impl<R: BufRead> JsonlRecords<R> {
    /// Reads `src` as `format` (`Auto`: the first record decides).
    pub fn new(src: JsonlSource<R>, format: InputFormat) -> Self {
        JsonlRecords { src, format, detected: 0 }
    }

    fn parse(&mut self, line: usize, text: &[u8]) -> Result<(Option<String>, Record), String> {
        let parsed: Line = serde_json::from_slice(text).map_err(|e| format!("malformed JSON: {e}"))?;
        if self.format == InputFormat::Auto {
            self.format = detect(&parsed)?;
            self.detected = line;
        }
        let missing = || {
            let from = match self.detected {
                0 => "--input-format".to_string(),
                l => format!("line {l}"),
            };
            format!("no `{}` field (the input is {} records, from {from})", self.format.field(), self.format.name())
        };
        let id = parse_id(parsed.id)?;
        let record = match self.format {
            InputFormat::Tokens | InputFormat::HfDataset => {
                if parsed.input_ids.is_none() {
                    return Err(missing());
                }
                let (id, input_ids, loss_mask) = self.src.parse(text)?;
                return Ok((id, Record::Tokens { input_ids, loss_mask }));
            }
            InputFormat::Text => {
                let raw = parsed.text.ok_or_else(missing)?;
                let s: String = serde_json::from_str(raw.get()).map_err(|_| "`text` must be a string".to_string())?;
                if s.is_empty() {
                    return Err("empty sample: `text` is empty".into());
                }
                Record::Text(s)
            }
            InputFormat::ShareGpt | InputFormat::OpenAi => {
                let (style, raw) = match self.format {
                    InputFormat::ShareGpt => (Style::ShareGpt, parsed.conversations),
                    _ => (Style::OpenAi, parsed.messages),
                };
                let raw = raw.ok_or_else(missing)?;
                let messages: serde_json::Value = serde_json::from_str(raw.get()).map_err(|e| e.to_string())?;
                let tools: Option<serde_json::Value> =
                    parsed.tools.map(|t| serde_json::from_str(t.get())).transpose().map_err(|e| e.to_string())?;
                Record::Chat(Conversation::parse(style, &messages, tools.as_ref())?)
            }
            InputFormat::Auto => unreachable!("resolved above"),
        };
        Ok((id, record))
    }
}

impl<R: BufRead + Send> Records for JsonlRecords<R> {
    fn next_record(&mut self) -> Option<Result<Item, SourceError>> {
        let (line, buf, text) = match self.src.next_text()? {
            Ok(t) => t,
            Err(e) => return Some(Err(e)),
        };
        // The whole input's index: a default id is the same in a part.
        let index = self.src.first_record() + self.src.consumed().samples - 1;
        let parsed = self.parse(line, &buf[text]);
        self.src.restore(buf);
        Some(match parsed {
            Ok((id, record)) => Ok(Item { index, line, id, record, end: self.src.consumed() }),
            Err(problem) => Err(SourceError::Line { path: self.src.name().to_string(), line, problem }),
        })
    }

    fn consumed(&self) -> InputPos {
        self.src.consumed()
    }

    fn format(&self) -> InputFormat {
        self.format
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn records(text: &str, format: InputFormat) -> Vec<Result<Item, SourceError>> {
        let mut r = JsonlRecords::new(JsonlSource::new("t.jsonl".into(), text.as_bytes()), format);
        std::iter::from_fn(|| r.next_record()).collect()
    }

    #[test]
    fn detects_the_format_from_the_first_record_and_holds_to_it() {
        let r = records(
            "{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}], \"id\": \"a\"}\n{\"text\": \"x\"}\n",
            InputFormat::Auto,
        );
        assert!(matches!(&r[0], Ok(Item { record: Record::Chat(_), id: Some(id), .. }) if id == "a"));
        let e = r[1].as_ref().unwrap_err().to_string();
        assert_eq!(e, "t.jsonl:2: no `messages` field (the input is openai records, from line 1)");
        let r = records("{\"text\": \"hello\"}", InputFormat::Auto);
        assert!(matches!(&r[0], Ok(Item { record: Record::Text(t), .. }) if t == "hello"));
        let r = records("{\"input_ids\": [1, 2], \"loss_mask\": [0, 1]}", InputFormat::Auto);
        assert!(matches!(&r[0], Ok(Item { record: Record::Tokens { .. }, .. })));
        let e = records("{\"x\": 1}", InputFormat::Auto)[0].as_ref().unwrap_err().to_string();
        assert!(e.contains("no `input_ids`, `text`, `conversations` or `messages` field"), "{e}");
        let e = records("{\"text\": \"a\"}", InputFormat::ShareGpt)[0].as_ref().unwrap_err().to_string();
        assert!(e.contains("from --input-format"), "{e}");
    }
}
