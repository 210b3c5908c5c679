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

/// A line that is not a usable sample.
#[derive(Debug, thiserror::Error)]
pub enum SourceError {
    /// The file cannot be read.
    #[error("cannot read {path}: {cause}")]
    Io {
        /// The file.
        path: String,
        /// The OS error.
        cause: std::io::Error,
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

#[derive(serde::Deserialize)]
struct Line {
    input_ids: Option<Vec<serde_json::Value>>,
    id: Option<serde_json::Value>,
    loss_mask: Option<Vec<serde_json::Value>>,
}

/// The longest id accepted (ids become tensor names).
pub const MAX_ID_LEN: usize = 256;

type Parsed = (Option<String>, Vec<u32>, Option<Vec<u8>>);

/// Streams samples from a JSON Lines reader; memory is bounded by one line.
pub struct JsonlSource<R: BufRead> {
    name: String,
    reader: R,
    line: usize,
    index: usize,
    buf: String,
}

impl JsonlSource<std::io::BufReader<std::fs::File>> {
    /// Opens a file.
    pub fn open(path: &std::path::Path) -> Result<Self, SourceError> {
        let f =
            std::fs::File::open(path).map_err(|cause| SourceError::Io { path: path.display().to_string(), cause })?;
        Ok(Self::new(path.display().to_string(), std::io::BufReader::new(f)))
    }
}

impl<R: BufRead> JsonlSource<R> {
    /// Wraps a reader; `name` appears in messages.
    pub fn new(name: String, reader: R) -> Self {
        JsonlSource { name, reader, line: 0, index: 0, buf: String::new() }
    }

    fn parse(&self, text: &str) -> Result<Parsed, String> {
        let parsed: Line = serde_json::from_str(text).map_err(|e| format!("malformed JSON: {e}"))?;
        let ids = parsed.input_ids.ok_or("no `input_ids` field")?;
        if ids.is_empty() {
            return Err("empty sample: `input_ids` has no tokens".into());
        }
        let ids: Vec<u32> = ids
            .iter()
            .enumerate()
            .map(|(pos, v)| {
                v.as_u64()
                    .and_then(|n| u32::try_from(n).ok())
                    .ok_or_else(|| format!("input_ids[{pos}] = {v} is not a token id (a non-negative integer)"))
            })
            .collect::<Result<_, _>>()?;
        let id = match parsed.id {
            None | Some(serde_json::Value::Null) => None,
            Some(serde_json::Value::String(s)) => {
                if s.is_empty() || s.len() > MAX_ID_LEN || s.chars().any(char::is_control) {
                    return Err(format!("`id` {s:?} must be 1 to {MAX_ID_LEN} bytes without control characters"));
                }
                Some(s)
            }
            Some(other) => return Err(format!("`id` must be a string, got {other}")),
        };
        let mask = match parsed.loss_mask {
            None => None,
            Some(m) => {
                if m.len() != ids.len() {
                    return Err(format!("`loss_mask` has {} entries for {} tokens", m.len(), ids.len()));
                }
                Some(
                    m.iter()
                        .enumerate()
                        .map(|(pos, v)| match v.as_u64() {
                            Some(b @ (0 | 1)) => Ok(b as u8),
                            _ => Err(format!("loss_mask[{pos}] = {v} is not 0 or 1")),
                        })
                        .collect::<Result<_, _>>()?,
                )
            }
        };
        Ok((id, ids, mask))
    }
}

impl<R: BufRead> Iterator for JsonlSource<R> {
    type Item = Result<Sample, SourceError>;

    fn next(&mut self) -> Option<Self::Item> {
        loop {
            self.buf.clear();
            self.line += 1;
            match self.reader.read_line(&mut self.buf) {
                Ok(0) => return None,
                Ok(_) => {}
                Err(cause) => return Some(Err(SourceError::Io { path: self.name.clone(), cause })),
            }
            let text = self.buf.trim();
            if text.is_empty() {
                continue;
            }
            let item = match self.parse(text) {
                Ok((id, input_ids, loss_mask)) => Ok(Sample {
                    index: self.index,
                    line: self.line,
                    id: id.unwrap_or_else(|| self.index.to_string()),
                    input_ids,
                    loss_mask,
                }),
                Err(problem) => Err(SourceError::Line { path: self.name.clone(), line: self.line, problem }),
            };
            self.index += 1;
            return Some(item);
        }
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
