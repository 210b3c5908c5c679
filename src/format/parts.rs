//! What a part of a split input is, as the files record it: [`PartInfo`]
//! (where the part lies in the whole input, in its manifest) and the name of
//! its output directory, `OUT/part-IIII-of-NNNN/` ([`dir_name`],
//! [`parse_dir_name`]), which a resume and `strata merge` read. Working out
//! which part a process runs and where its bytes lie is `input::parts`'s.

use serde::{Deserialize, Serialize};

/// Where one part lies in the whole input, as its manifest records it:
/// what a resume must find again and what `strata merge` checks.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PartInfo {
    /// 0-based part index.
    pub index: usize,
    /// Number of parts.
    pub count: usize,
    /// Where the index and count came from (not compared: any launcher may rerun a part).
    pub source: String,
    /// Bytes of the whole input.
    pub input_bytes: u64,
    /// `input::parts::fingerprint` of the whole input.
    pub input_fingerprint: String,
    /// First byte of the part (a line start).
    pub start: u64,
    /// One past its last byte (a line start, or the end).
    pub end: u64,
    /// 1-based number of its first line.
    pub first_line: usize,
    /// Records (non-blank lines) before it: its first record's 0-based index.
    pub first_record: usize,
}

impl PartInfo {
    /// Everything but the launcher: what makes two runs the same part.
    pub fn key(&self) -> String {
        format!(
            "part {} of {}: bytes {}..{} of {} (fingerprint {}), first line {}, first record {}",
            self.index,
            self.count,
            self.start,
            self.end,
            self.input_bytes,
            self.input_fingerprint,
            self.first_line,
            self.first_record
        )
    }
}

/// `part-{index:04}-of-{count:04}`.
pub fn dir_name(index: usize, count: usize) -> String {
    format!("part-{index:04}-of-{count:04}")
}

/// The most parts an input is split into.
pub const MAX_PARTS: usize = 1 << 20;

/// The index and count a part directory's name says: only names
/// [`dir_name`] writes, with a count up to [`MAX_PARTS`].
pub fn parse_dir_name(name: &str) -> Option<(usize, usize)> {
    let (i, n) = name.strip_prefix("part-")?.split_once("-of-")?;
    let digits = |s: &str| (4..=8).contains(&s.len()) && s.bytes().all(|b| b.is_ascii_digit());
    let (i, n): (usize, usize) =
        (digits(i) && digits(n)).then(|| Some((i.parse().ok()?, n.parse().ok()?))).flatten()?;
    (n <= MAX_PARTS && dir_name(i, n) == name).then_some((i, n))
}
