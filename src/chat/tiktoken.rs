//! tiktoken's BPE, as Kimi-K2 ships it: `tiktoken.model` (one `base64 rank`
//! line per token), a pre-tokenisation pattern, and special tokens placed
//! after the ranks (`tokenizer_config.json`'s `added_tokens_decoder`; the
//! rest of the reserved block named `<|reserved_token_{id}|>`).

use super::ChatError;
use base64::Engine as _;
use std::collections::HashMap;

/// Kimi-K2's pre-tokenisation pattern (`tokenization_kimi.py`, `pat_str`).
pub const KIMI_PATTERN: &str = concat!(
    r"[\p{Han}]+",
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"|\p{N}{1,3}",
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*",
    r"|\s*[\r\n]+",
    r"|\s+(?!\S)",
    r"|\s+",
);

/// Pieces up to this many bytes merge by tiktoken's own quadratic scan.
const LINEAR_MERGE_MAX: usize = 256;

/// Special-token ids Kimi's tokenizer reserves after the ranks.
pub const RESERVED_SPECIAL: usize = 256;

/// A tiktoken BPE: byte strings with merge ranks, a pattern, special tokens.
pub struct Tiktoken {
    ranks: HashMap<Vec<u8>, u32>,
    /// Each rank's bytes (decoding).
    by_rank: Vec<Option<Vec<u8>>>,
    pattern: fancy_regex::Regex,
    specials: Vec<(String, u32)>,
    // Matches any special token (longest first at one position).
    special_re: Option<regex::Regex>,
    vocab: usize,
}

impl Tiktoken {
    /// Parses a `tiktoken.model` text; `specials` are `(text, id)`; `pattern` is the pre-tokenisation regex.
    pub fn new(model: &str, name: &str, pattern: &str, specials: Vec<(String, u32)>) -> Result<Self, ChatError> {
        let bad = |line: usize, problem: String| ChatError::Tokenizer(format!("{name}:{line}: {problem}"));
        let mut ranks = HashMap::new();
        let mut vocab = 0usize;
        for (n, line) in model.lines().enumerate() {
            if line.trim().is_empty() {
                continue;
            }
            let (tok, rank) = line.split_once(' ').ok_or_else(|| bad(n + 1, "expected `base64 rank`".into()))?;
            let bytes = base64::engine::general_purpose::STANDARD
                .decode(tok)
                .map_err(|e| bad(n + 1, format!("token is not base64: {e}")))?;
            let rank: u32 = rank.trim().parse().map_err(|_| bad(n + 1, format!("rank {rank:?} is not an integer")))?;
            vocab = vocab.max(rank as usize + 1);
            if ranks.insert(bytes, rank).is_some() {
                return Err(bad(n + 1, "token listed twice".into()));
            }
        }
        if ranks.is_empty() {
            return Err(ChatError::Tokenizer(format!("{name}: no tokens")));
        }
        let pattern = fancy_regex::Regex::new(pattern)
            .map_err(|e| ChatError::Tokenizer(format!("pre-tokenisation pattern: {e}")))?;
        if let Some((_, id)) = specials.iter().find(|(s, _)| s.is_empty()) {
            return Err(ChatError::Tokenizer(format!(
                "special token {id} has an empty text: it would match between every two characters; remove it"
            )));
        }
        let mut specials = specials;
        // Longest first, so that of two specials starting at one place the longer wins.
        specials.sort_by(|a, b| b.0.len().cmp(&a.0.len()).then(a.1.cmp(&b.1)));
        let special_re = if specials.is_empty() {
            None
        } else {
            let alt: Vec<String> = specials.iter().map(|(s, _)| regex::escape(s)).collect();
            Some(regex::Regex::new(&alt.join("|")).map_err(|e| ChatError::Tokenizer(format!("special tokens: {e}")))?)
        };
        for (_, id) in &specials {
            vocab = vocab.max(*id as usize + 1);
        }
        let mut by_rank = vec![None; ranks.values().max().map_or(0, |&r| r as usize + 1)];
        for (bytes, &r) in &ranks {
            by_rank[r as usize] = Some(bytes.clone());
        }
        Ok(Tiktoken { ranks, by_rank, pattern, specials, special_re, vocab })
    }

    /// One past the largest id.
    pub fn vocab_size(&self) -> usize {
        self.vocab
    }

    /// Where special tokens start in `text` (after its first byte), in order.
    pub fn special_starts<'t>(&'t self, text: &'t str) -> Box<dyn Iterator<Item = usize> + 't> {
        match &self.special_re {
            Some(re) => Box::new(re.find_iter(text).map(|m| m.start()).filter(|&s| s > 0)),
            None => Box::new(std::iter::empty()),
        }
    }

    /// The pre-tokenisation pattern's pieces of `text`, as byte ranges.
    pub fn pieces(&self, text: &str) -> Result<Vec<(usize, usize)>, ChatError> {
        let mut out = Vec::new();
        for m in self.pattern.find_iter(text) {
            let m = m.map_err(|e| ChatError::Text(format!("the pre-tokenisation pattern fails on this text: {e}")))?;
            out.push((m.start(), m.end()));
        }
        Ok(out)
    }

    /// The longest special token, in bytes.
    pub fn longest_special(&self) -> usize {
        self.specials.iter().map(|(s, _)| s.len()).max().unwrap_or(0)
    }

    /// The text of `ids`, special tokens written out, invalid UTF-8 replaced
    /// (as tiktoken's `decode` does, `errors="replace"`); `None` for an id it has no token for.
    pub fn decode(&self, ids: &[u32]) -> Option<String> {
        let mut bytes = Vec::new();
        for &id in ids {
            match self.by_rank.get(id as usize).and_then(Option::as_deref) {
                Some(b) => bytes.extend_from_slice(b),
                None => bytes.extend_from_slice(self.specials.iter().find(|(_, s)| *s == id)?.0.as_bytes()),
            }
        }
        Some(String::from_utf8_lossy(&bytes).into_owned())
    }

    /// Whether `id` is one of the special tokens (not a BPE rank).
    pub fn is_special(&self, id: u32) -> bool {
        self.by_rank.get(id as usize).and_then(Option::as_deref).is_none()
            && self.specials.iter().any(|&(_, s)| s == id)
    }

    /// The id of a special token.
    pub fn special_id(&self, text: &str) -> Option<u32> {
        self.specials.iter().find(|(s, _)| s == text).map(|&(_, id)| id)
    }

    /// Encodes `text` with every special token allowed (as Kimi's tokenizer
    /// does for chat text), appending ids and their byte spans in `text`.
    pub fn encode(&self, text: &str, ids: &mut Vec<u32>, spans: &mut Vec<(usize, usize)>) -> Result<(), ChatError> {
        let mut at = 0;
        let mut specials = self.special_re.as_ref().map(|re| re.find_iter(text));
        loop {
            let next = specials.as_mut().and_then(|it| it.next());
            let end = next.as_ref().map_or(text.len(), |m| m.start());
            self.encode_ordinary(text, at, end, ids, spans)?;
            match next {
                Some(m) => {
                    let id = self.special_id(m.as_str()).expect("the special regex matches special tokens only");
                    ids.push(id);
                    spans.push((m.start(), m.end()));
                    at = m.end();
                }
                None => return Ok(()),
            }
        }
    }

    fn encode_ordinary(
        &self,
        text: &str,
        from: usize,
        to: usize,
        ids: &mut Vec<u32>,
        spans: &mut Vec<(usize, usize)>,
    ) -> Result<(), ChatError> {
        let part = &text[from..to];
        let mut parts: Vec<(usize, u32)> = Vec::new();
        // tiktoken drops what its pattern does not match, silently: here the record is refused.
        let uncovered = |at: usize| {
            ChatError::Text(format!(
                "the pre-tokenisation pattern (pat_str) does not match byte {at} of the text ({}), so tiktoken \
                 would drop it silently; the record is refused",
                crate::quote(&part[at - from..].chars().take(12).collect::<String>())
            ))
        };
        let mut covered = from;
        for m in self.pattern.find_iter(part) {
            let m = m.map_err(|e| ChatError::Text(format!("the pre-tokenisation pattern fails on this text: {e}")))?;
            if from + m.start() != covered {
                return Err(uncovered(covered));
            }
            covered = from + m.end();
            let piece = m.as_str().as_bytes();
            let base = from + m.start();
            if let Some(&r) = self.ranks.get(piece) {
                ids.push(r);
                spans.push((base, base + piece.len()));
                continue;
            }
            self.merge(piece, &mut parts)?;
            for w in 0..parts.len() - 1 {
                let (s, e) = (parts[w].0, parts[w + 1].0);
                let r = *self
                    .ranks
                    .get(&piece[s..e])
                    .ok_or_else(|| ChatError::Text(format!("byte {:#04x} has no rank in the BPE file", piece[s])))?;
                ids.push(r);
                spans.push((base + s, base + e));
            }
        }
        if covered != to {
            return Err(uncovered(covered));
        }
        Ok(())
    }

    /// tiktoken's byte-pair merge: `parts` becomes the boundaries of the
    /// piece's tokens (last entry `piece.len()`), merging the lowest-ranked
    /// adjacent pair first (leftmost on ties). Long pieces (a run of spaces
    /// or Han characters can be megabytes) take the heap version.
    fn merge(&self, piece: &[u8], parts: &mut Vec<(usize, u32)>) -> Result<(), ChatError> {
        if piece.len() > LINEAR_MERGE_MAX {
            self.merge_heap(piece, parts);
            return Ok(());
        }
        self.merge_linear(piece, parts)
    }

    /// The same merges in O(n log n): a heap of `(rank, start)` pairs over a
    /// linked list of boundaries; an entry is stale once its pair changed.
    fn merge_heap(&self, piece: &[u8], parts: &mut Vec<(usize, u32)>) {
        use std::cmp::Reverse;
        let n = piece.len();
        // next[i]: the boundary after boundary i (n + 1 past the end); prev likewise; alive: not merged away.
        let mut next: Vec<usize> = (1..=n + 1).collect();
        let mut prev: Vec<usize> = (0..=n).map(|i| i.wrapping_sub(1)).collect();
        let mut alive = vec![true; n + 1];
        let rank_at = |next: &[usize], i: usize| -> Option<u32> {
            let j = next[i];
            let k = *next.get(j)?;
            (k <= n).then(|| self.ranks.get(&piece[i..k]).copied()).flatten()
        };
        let mut heap = std::collections::BinaryHeap::new();
        for i in 0..n.saturating_sub(1) {
            if let Some(r) = rank_at(&next, i) {
                heap.push(Reverse((r, i)));
            }
        }
        while let Some(Reverse((r, i))) = heap.pop() {
            if !alive[i] || rank_at(&next, i) != Some(r) {
                continue;
            }
            // Merge the pair at i: the boundary after i goes.
            let j = next[i];
            alive[j] = false;
            next[i] = next[j];
            if next[j] <= n {
                prev[next[j]] = i;
            }
            if let Some(r) = rank_at(&next, i) {
                heap.push(Reverse((r, i)));
            }
            let p = prev[i];
            if p != usize::MAX {
                if let Some(r) = rank_at(&next, p) {
                    heap.push(Reverse((r, p)));
                }
            }
        }
        parts.clear();
        let mut i = 0;
        while i <= n {
            parts.push((i, 0));
            i = next[i];
        }
    }

    fn merge_linear(&self, piece: &[u8], parts: &mut Vec<(usize, u32)>) -> Result<(), ChatError> {
        let rank = |parts: &[(usize, u32)], i: usize| -> u32 {
            if i + 3 < parts.len() {
                self.ranks.get(&piece[parts[i].0..parts[i + 3].0]).copied().unwrap_or(u32::MAX)
            } else {
                u32::MAX
            }
        };
        parts.clear();
        for i in 0..piece.len() + 1 {
            parts.push((i, u32::MAX));
        }
        for i in 0..parts.len().saturating_sub(2) {
            parts[i].1 = self.ranks.get(&piece[i..i + 2]).copied().unwrap_or(u32::MAX);
        }
        while parts.len() > 1 {
            let (mut min, mut at) = (u32::MAX, usize::MAX);
            for (i, p) in parts[..parts.len() - 1].iter().enumerate() {
                if p.1 < min {
                    (min, at) = (p.1, i);
                }
            }
            if min == u32::MAX {
                break;
            }
            if at > 0 {
                parts[at - 1].1 = rank(parts, at - 1);
            }
            parts[at].1 = rank(parts, at);
            parts.remove(at + 1);
        }
        Ok(())
    }
}

/// Special tokens as Kimi's `TikTokenTokenizer` builds them: ids from `base`
/// to `base + RESERVED_SPECIAL`, named by `added_tokens_decoder` where it
/// names them and `<|reserved_token_{id}|>` elsewhere.
pub fn kimi_specials(base: usize, named: &HashMap<u32, String>) -> Vec<(String, u32)> {
    let mut out: Vec<(String, u32)> = (base..base + RESERVED_SPECIAL)
        .map(|id| {
            let id = id as u32;
            (named.get(&id).cloned().unwrap_or_else(|| format!("<|reserved_token_{id}|>")), id)
        })
        .collect();
    // Named ids outside the reserved block still count.
    for (&id, text) in named {
        if (id as usize) < base || id as usize >= base + RESERVED_SPECIAL {
            out.push((text.clone(), id));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bpe() -> Tiktoken {
        // Bytes a, b, c, then merges "ab" (3), "abc" (4), "cc" (5).
        let b64 = |s: &[u8]| base64::engine::general_purpose::STANDARD.encode(s);
        let lines: Vec<String> = [&b"a"[..], b"b", b"c", b"ab", b"abc", b"cc", b" "]
            .iter()
            .enumerate()
            .map(|(r, t)| format!("{} {r}", b64(t)))
            .collect();
        let specials = vec![("<|x|>".to_string(), 7), ("<|x|>y".to_string(), 8)];
        Tiktoken::new(&lines.join("\n"), "t", KIMI_PATTERN, specials).unwrap()
    }

    #[test]
    fn merges_by_rank_and_keeps_spans() {
        let t = bpe();
        let (mut ids, mut spans) = (vec![], vec![]);
        t.encode("abcc<|x|>ab<|x|>y", &mut ids, &mut spans).unwrap();
        // "abcc": a b c c -> (ab) c c -> (ab)(cc)? ranks: ab=3 < cc=5 -> ab first, then abc=4 < cc=5 -> abc c.
        assert_eq!(ids, vec![4, 2, 7, 3, 8]);
        assert_eq!(spans, vec![(0, 3), (3, 4), (4, 9), (9, 11), (11, 17)]);
        assert_eq!(t.vocab_size(), 9);
    }

    #[test]
    fn the_heap_merge_gives_the_linear_merges() {
        // A BPE over a, b, c with every pair and some triples ranked in a scrambled order.
        let b64 = |s: &[u8]| base64::engine::general_purpose::STANDARD.encode(s);
        let mut toks: Vec<Vec<u8>> = vec![b"a".to_vec(), b"b".to_vec(), b"c".to_vec()];
        for x in [b'a', b'b', b'c'] {
            for y in [b'a', b'b', b'c'] {
                toks.push(vec![x, y]);
            }
        }
        for t in ["aba", "bab", "abc", "cca", "aaaa", "abab", "ccab"] {
            toks.push(t.as_bytes().to_vec());
        }
        let mut order: Vec<usize> = (3..toks.len()).collect();
        order.sort_by_key(|&i| (i * 7919) % 23);
        let mut lines: Vec<String> = (0..3).map(|i| format!("{} {i}", b64(&toks[i]))).collect();
        lines.extend(order.iter().enumerate().map(|(r, &i)| format!("{} {}", b64(&toks[i]), r + 3)));
        let t = Tiktoken::new(&lines.join("\n"), "t", KIMI_PATTERN, vec![]).unwrap();
        let mut s = 12345u64;
        for len in [2, 3, 5, 17, 64, 300, 1000] {
            let piece: Vec<u8> = (0..len)
                .map(|_| {
                    s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                    b"abc"[(s >> 60) as usize % 3]
                })
                .collect();
            let (mut a, mut b) = (vec![], vec![]);
            t.merge_linear(&piece, &mut a).unwrap();
            t.merge_heap(&piece, &mut b);
            let starts = |p: &[(usize, u32)]| p.iter().map(|x| x.0).collect::<Vec<_>>();
            assert_eq!(starts(&a), starts(&b), "{}", String::from_utf8_lossy(&piece));
        }
    }

    #[test]
    fn a_byte_without_rank_is_an_error() {
        let mut ids = vec![];
        let e = bpe().encode("zz", &mut ids, &mut vec![]).unwrap_err().to_string();
        assert!(e.contains("has no rank"), "{e}");
    }
}
