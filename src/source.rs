//! Samples from JSON Lines: one `{"input_ids": [...]}` object per line.

use std::io::BufRead;

/// One input sample.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Sample {
    /// 0-based index among the file's samples (blank lines are skipped).
    pub index: usize,
    /// 1-based line number in the file, for messages.
    pub line: usize,
    /// Token ids.
    pub input_ids: Vec<u32>,
}

/// A line that is not a usable sample.
#[derive(Debug, thiserror::Error)]
pub enum SourceError {
    /// The file cannot be read.
    #[error("cannot read {path}: {source}")]
    Io {
        /// The file.
        path: String,
        /// The OS error.
        source: std::io::Error,
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
}

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
            std::fs::File::open(path).map_err(|source| SourceError::Io { path: path.display().to_string(), source })?;
        Ok(Self::new(path.display().to_string(), std::io::BufReader::new(f)))
    }
}

impl<R: BufRead> JsonlSource<R> {
    /// Wraps a reader; `name` appears in messages.
    pub fn new(name: String, reader: R) -> Self {
        JsonlSource { name, reader, line: 0, index: 0, buf: String::new() }
    }

    fn parse(&self, text: &str) -> Result<Vec<u32>, String> {
        let parsed: Line = serde_json::from_str(text).map_err(|e| format!("malformed JSON: {e}"))?;
        let ids = parsed.input_ids.ok_or("no `input_ids` field")?;
        if ids.is_empty() {
            return Err("empty sample: `input_ids` has no tokens".into());
        }
        ids.iter()
            .enumerate()
            .map(|(pos, v)| {
                v.as_u64()
                    .and_then(|n| u32::try_from(n).ok())
                    .ok_or_else(|| format!("input_ids[{pos}] = {v} is not a token id (a non-negative integer)"))
            })
            .collect()
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
                Err(source) => return Some(Err(SourceError::Io { path: self.name.clone(), source })),
            }
            let text = self.buf.trim();
            if text.is_empty() {
                continue;
            }
            let item = match self.parse(text) {
                Ok(input_ids) => Ok(Sample { index: self.index, line: self.line, input_ids }),
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
        assert_eq!((s.index, s.line, s.input_ids.clone()), (1, 3, vec![3]));
    }

    #[test]
    fn names_the_line_and_problem() {
        let msg = |t: &str| read(t).pop().unwrap().unwrap_err().to_string();
        assert_eq!(msg("{\"input_ids\":[]}"), "t.jsonl:1: empty sample: `input_ids` has no tokens");
        assert!(msg("{\"input_ids\":[1]}\n{oops").starts_with("t.jsonl:2: malformed JSON"));
        assert!(msg("{\"input_ids\":[1,-4]}").contains("input_ids[1] = -4 is not a token id"));
        assert_eq!(msg("{\"text\":\"hi\"}"), "t.jsonl:1: no `input_ids` field");
    }
}
