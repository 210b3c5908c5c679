//! The speculators trainer's draft-vocabulary files, written into the data
//! directory next to the table: `token_freq.pt` (the loss-masked token
//! counts, as `torch.save` writes a `dict[int, int]`) and, for each
//! `--draft-vocab-size N`, `d2t-N.npy` and `t2d-N.npy`, exactly what
//! speculators' `build_vocab_mappings_from_distribution` builds from those
//! counts (`speculators/train/vocab_mapping.py`, 0.9). With them the trainer
//! needs no `prepare-data` step: it loads `d2t-N.npy`/`t2d-N.npy` for
//! `--draft-vocab-size N`, or builds any other N from `token_freq.pt`.

use std::collections::HashMap;
use std::io::Write;

/// The trainer's counts file.
pub const TOKEN_FREQ_FILE: &str = "token_freq.pt";

/// `d2t-N.npy`: int64 `[N]`, `target_id - draft_index` for each draft index.
pub fn d2t_file(n: usize) -> String {
    format!("d2t-{n}.npy")
}

/// `t2d-N.npy`: bool `[V]`, which target ids the draft vocabulary holds.
pub fn t2d_file(n: usize) -> String {
    format!("t2d-{n}.npy")
}

/// Whether `name` (a file at the top of a data directory) is one of the
/// trainer's own files: `token_freq.pt`, `d2t-N.npy` or `t2d-N.npy`. The
/// trainer writes them there itself (it caches the mappings it builds), so
/// every command that looks at a data directory must know them.
pub fn is_trainer_file(name: &str) -> bool {
    let sized = |prefix: &str| {
        name.strip_prefix(prefix)
            .and_then(|r| r.strip_suffix(".npy"))
            .is_some_and(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
    };
    name == TOKEN_FREQ_FILE || sized("d2t-") || sized("t2d-")
}

/// Loss-masked token counts: how often each token id appears where the loss
/// mask is 1, over every row of the dataset (speculators'
/// `save_token_frequency_distribution`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TokenCounts {
    counts: HashMap<i64, u64>,
}

impl TokenCounts {
    /// Adds one row: its token ids and loss mask (equal lengths).
    pub fn add_row(&mut self, ids: impl Iterator<Item = i64>, mask: impl Iterator<Item = i64>) {
        for (id, m) in ids.zip(mask) {
            if m != 0 {
                *self.counts.entry(id).or_insert(0) += 1;
            }
        }
    }

    /// Distinct tokens seen.
    pub fn len(&self) -> usize {
        self.counts.len()
    }

    /// No token was seen.
    pub fn is_empty(&self) -> bool {
        self.counts.is_empty()
    }

    /// The largest token id seen.
    pub fn max_id(&self) -> Option<i64> {
        self.counts.keys().copied().max()
    }

    /// `(id, count)` by id.
    pub fn sorted(&self) -> Vec<(i64, u64)> {
        let mut v: Vec<(i64, u64)> = self.counts.iter().map(|(&k, &c)| (k, c)).collect();
        v.sort_unstable();
        v
    }

    /// The draft vocabulary of `n` tokens out of a target vocabulary of `v`:
    /// the `n` most frequent ids (ties by id), filled up with the lowest
    /// unused ids when fewer were seen, in id order. `n` must be in `1..=v`
    /// and every id seen below `v`.
    pub fn draft_vocab(&self, n: usize, v: usize) -> Result<Vec<i64>, String> {
        if n == 0 || n > v {
            return Err(format!("--draft-vocab-size {n} must be between 1 and the vocabulary size {v}"));
        }
        if let Some(id) = self.counts.keys().find(|&&id| id < 0 || id as u64 >= v as u64) {
            return Err(format!("token id {id} is outside the model's vocabulary of {v}"));
        }
        let mut by_freq = self.sorted();
        by_freq.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
        let mut chosen: Vec<i64> = by_freq.iter().take(n).map(|&(id, _)| id).collect();
        if chosen.len() < n {
            let taken: std::collections::HashSet<i64> = chosen.iter().copied().collect();
            let missing = n - chosen.len();
            chosen.extend((0..n as i64).filter(|id| !taken.contains(id)).take(missing));
        }
        chosen.sort_unstable();
        Ok(chosen)
    }

    /// `d2t-N.npy` and `t2d-N.npy` for a draft vocabulary of `n` out of `v`.
    pub fn mapping_files(&self, n: usize, v: usize) -> Result<(Vec<u8>, Vec<u8>), String> {
        let chosen = self.draft_vocab(n, v)?;
        let d2t: Vec<i64> = chosen.iter().enumerate().map(|(i, &id)| id - i as i64).collect();
        let mut t2d = vec![false; v];
        chosen.iter().for_each(|&id| t2d[id as usize] = true);
        Ok((npy_i64(&d2t), npy_bool(&t2d)))
    }

    /// `token_freq.pt`: what `torch.save` writes for the `dict[int, int]` of
    /// the counts (keys in id order), in the smallest archive `torch.load`
    /// accepts (`data.pkl` and `version`; `weights_only=True` loads it, as
    /// the trainer does).
    pub fn token_freq_pt(&self) -> Vec<u8> {
        let mut w = zip::ZipWriter::new(std::io::Cursor::new(Vec::new()));
        let stored = zip::write::SimpleFileOptions::default()
            .compression_method(zip::CompressionMethod::Stored)
            .last_modified_time(zip::DateTime::default());
        let entries = [("token_freq/data.pkl", pickle_counts(&self.sorted())), ("token_freq/version", b"3\n".to_vec())];
        for (name, bytes) in entries {
            // Writing into memory cannot fail but for a bug.
            w.start_file(name, stored).expect("a zip entry in memory");
            w.write_all(&bytes).expect("a zip entry in memory");
        }
        w.finish().expect("a zip archive in memory").into_inner()
    }
}

/// A pickle (protocol 2, as `torch.save` uses) of a `dict` of int to int.
fn pickle_counts(items: &[(i64, u64)]) -> Vec<u8> {
    let mut p = vec![0x80, 2, b'}']; // PROTO 2, EMPTY_DICT
                                     // SETITEMS in batches of 1000, as Python's pickler writes them.
    for batch in items.chunks(1000) {
        p.push(b'('); // MARK
        for &(k, v) in batch {
            pickle_int(&mut p, k as i128);
            pickle_int(&mut p, v as i128);
        }
        p.push(b'u'); // SETITEMS
    }
    p.push(b'.'); // STOP
    p
}

/// An int in the shortest opcode Python's pickler would use.
fn pickle_int(p: &mut Vec<u8>, v: i128) {
    if (0..=0xff).contains(&v) {
        p.extend([b'K', v as u8]); // BININT1
    } else if (0..=0xffff).contains(&v) {
        p.push(b'M'); // BININT2
        p.extend((v as u16).to_le_bytes());
    } else if (i32::MIN as i128..=i32::MAX as i128).contains(&v) {
        p.push(b'J'); // BININT
        p.extend((v as i32).to_le_bytes());
    } else {
        // LONG1: little-endian two's complement, as few bytes as keep the sign.
        let bytes = v.to_le_bytes();
        let mut n = bytes.len();
        while n > 1 {
            let (top, next) = (bytes[n - 1], bytes[n - 2]);
            if (top == 0 && next & 0x80 == 0) || (top == 0xff && next & 0x80 != 0) {
                n -= 1;
            } else {
                break;
            }
        }
        p.extend([0x8a, n as u8]);
        p.extend(&bytes[..n]);
    }
}

/// A `.npy` file (format 1.0, as `numpy.save` writes it) of a 1-D array.
fn npy(descr: &str, len: usize, data: &[u8]) -> Vec<u8> {
    let mut header = format!("{{'descr': '{descr}', 'fortran_order': False, 'shape': ({len},), }}");
    // Padded with spaces and ended by a newline, so the data starts on a 64-byte boundary.
    let total = (10 + header.len() + 1).next_multiple_of(64);
    while 10 + header.len() + 1 < total {
        header.push(' ');
    }
    header.push('\n');
    let mut out = Vec::with_capacity(total + data.len());
    out.extend(b"\x93NUMPY\x01\x00");
    out.extend((header.len() as u16).to_le_bytes());
    out.extend(header.as_bytes());
    out.extend(data);
    out
}

/// `.npy` of int64 values.
fn npy_i64(v: &[i64]) -> Vec<u8> {
    let data: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
    npy("<i8", v.len(), &data)
}

/// `.npy` of bools.
fn npy_bool(v: &[bool]) -> Vec<u8> {
    let data: Vec<u8> = v.iter().map(|&b| b as u8).collect();
    npy("|b1", v.len(), &data)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn counts(rows: &[(&[i64], &[i64])]) -> TokenCounts {
        let mut c = TokenCounts::default();
        rows.iter().for_each(|(ids, mask)| c.add_row(ids.iter().copied(), mask.iter().copied()));
        c
    }

    #[test]
    fn only_loss_masked_tokens_count() {
        let c = counts(&[(&[1, 2, 3, 2], &[0, 1, 1, 1]), (&[2, 9], &[1, 0])]);
        assert_eq!(c.sorted(), vec![(2, 3), (3, 1)]);
    }

    #[test]
    fn names_of_the_trainers_files() {
        for ok in ["token_freq.pt", "d2t-32000.npy", "t2d-1.npy"] {
            assert!(is_trainer_file(ok), "{ok}");
        }
        for no in ["d2t-.npy", "d2t-x.npy", "t2d-12.npy.tmp", "token_freq.pt2", "hs_0.safetensors", "d2t-1.npz"] {
            assert!(!is_trainer_file(no), "{no}");
        }
    }

    #[test]
    fn pickled_ints_use_the_shortest_opcode() {
        let mut p = Vec::new();
        for v in [0i128, 255, 256, 65535, 65536, -1, i32::MAX as i128, 1 << 31, 1 << 40, u64::MAX as i128] {
            pickle_int(&mut p, v);
        }
        let want: Vec<u8> = [
            &b"K\x00"[..],
            b"K\xff",
            b"M\x00\x01",
            b"M\xff\xff",
            b"J\x00\x00\x01\x00",
            b"J\xff\xff\xff\xff",
            b"J\xff\xff\xff\x7f",
            b"\x8a\x05\x00\x00\x00\x80\x00",
            b"\x8a\x06\x00\x00\x00\x00\x00\x01",
            b"\x8a\x09\xff\xff\xff\xff\xff\xff\xff\xff\x00",
        ]
        .concat();
        assert_eq!(p, want);
    }

    #[test]
    fn npy_data_starts_on_64_bytes() {
        let f = npy_i64(&[1, -2]);
        assert_eq!(&f[..8], b"\x93NUMPY\x01\x00");
        let hlen = u16::from_le_bytes([f[8], f[9]]) as usize;
        assert_eq!((10 + hlen) % 64, 0);
        assert_eq!(f.len(), 10 + hlen + 16);
        assert!(std::str::from_utf8(&f[10..10 + hlen]).unwrap().ends_with('\n'));
    }

    #[test]
    fn draft_vocab_refuses_sizes_outside_the_vocabulary() {
        let c = counts(&[(&[1, 2], &[1, 1])]);
        assert!(c.draft_vocab(0, 10).is_err());
        assert!(c.draft_vocab(11, 10).is_err());
        assert!(counts(&[(&[12], &[1])]).draft_vocab(2, 10).is_err());
        assert_eq!(c.draft_vocab(10, 10).unwrap(), (0..10).collect::<Vec<_>>());
    }
}
