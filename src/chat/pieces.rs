//! Long texts tokenized in pieces, up to a limit.
//!
//! A tokenizer holds about 170 bytes of working memory per byte of text
//! (`tokenizer.json`), and the limit on a row's tokens is small next to the
//! texts a hostile or merely large input holds (a 60 MB line, a template
//! that prints 50 MB). So a text is cut into pieces that tokenize
//! independently, tokenized piece after piece, and left once more than
//! the limit's tokens are known:
//!
//! - at special tokens: the tokenizer splits them out before anything else,
//!   so the tokens before one depend on nothing after it;
//! - inside a long stretch between them, every [`CHUNK`] bytes or so, at a
//!   place where cutting leaves the tokens as they were: a candidate cut is
//!   checked by tokenizing [`WINDOW`] bytes on each side of it, together
//!   and apart, and taken only where the two agree.
//!
//! The cuts are kept with the tokens before them ([`Prefix`]), so a second
//! text that starts like the first (the next turn's render of a
//! conversation) reuses the tokens before the last cut inside the shared
//! start and tokenizes only the rest.

use super::tokenizer::{Encoded, Tokenizer};
use super::ChatError;

/// Bytes tokenized at once, about (a piece holds up to `CHUNK + SEARCH`).
pub const CHUNK: usize = 64 << 10;
/// How far past [`CHUNK`] a cut is looked for.
const SEARCH: usize = 64 << 10;
/// Bytes on each side of a cut tokenized to check it.
const WINDOW: usize = 2 << 10;
/// Candidate cuts checked before a stretch is given up on.
const TRIES: usize = 24;
/// A stretch with no place to cut is tokenized at once up to this size
/// (a tokenizer without a pre-tokenizer has no pieces); past it, refused.
const WHOLE_MAX: usize = 2 << 20;

/// A place a text splits at: the tokens before it depend on nothing after it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Mark {
    /// Its byte.
    at: usize,
    /// Tokens before it.
    before: usize,
    /// How many bytes past it a second text must agree with this one for
    /// the split, and the tokens before it, to be the same there.
    margin: usize,
}

/// The first tokens of a text, with the places it splits at.
#[derive(Clone, Debug, Default)]
pub struct Prefix {
    /// The first `cap` tokens and their byte spans.
    pub enc: Encoded,
    /// Whether the text has more than `cap` tokens.
    pub more: bool,
    cap: usize,
    marks: Vec<Mark>,
}

/// The length of the common start of `a` and `b`, in bytes.
pub fn common_start(a: &[u8], b: &[u8]) -> usize {
    let n = a.len().min(b.len());
    // Whole blocks by memcmp, then byte by byte in the block that differs.
    let mut at = 0;
    while at + 4096 <= n && a[at..at + 4096] == b[at..at + 4096] {
        at += 4096;
    }
    at + a[at..n].iter().zip(&b[at..n]).take_while(|(x, y)| x == y).count()
}

fn floor_boundary(s: &str, mut i: usize) -> usize {
    while !s.is_char_boundary(i) {
        i -= 1;
    }
    i
}

fn ceil_boundary(s: &str, mut i: usize) -> usize {
    while !s.is_char_boundary(i) {
        i += 1;
    }
    i
}

impl Tokenizer {
    /// The first `cap` tokens of `text` (no BOS or EOS added), tokenized in
    /// pieces and no further than needed to know whether there are more.
    pub fn prefix(&self, text: &str, cap: usize) -> Result<Prefix, ChatError> {
        self.prefix_in(text, cap, CHUNK)
    }

    /// [`Tokenizer::prefix`] with pieces of about `chunk` bytes (tests make them small).
    pub fn prefix_in(&self, text: &str, cap: usize, chunk: usize) -> Result<Prefix, ChatError> {
        let mut p = Prefix { cap, ..Default::default() };
        let margin = self.longest_special() + 1;
        let mut start = 0;
        for end in self.special_starts(text).chain([text.len()]) {
            if start > 0 {
                p.marks.push(Mark { at: start, before: p.enc.ids.len(), margin });
            }
            if p.enc.ids.len() > cap {
                break;
            }
            self.stretch(text, start, end, cap, chunk.max(1), &mut p)?;
            start = end;
        }
        p.more = p.enc.ids.len() > cap;
        p.enc.ids.truncate(cap);
        p.enc.spans.truncate(cap);
        Ok(p)
    }

    /// Tokenizes `text[start..end]`, a stretch without special tokens, into
    /// `p`, in pieces of about `chunk` bytes; stops past `cap` tokens.
    fn stretch(
        &self,
        text: &str,
        start: usize,
        end: usize,
        cap: usize,
        chunk: usize,
        p: &mut Prefix,
    ) -> Result<(), ChatError> {
        let mut at = start;
        while at < end {
            let search = SEARCH.min(chunk);
            let cut = if end - at <= chunk + search {
                end
            } else {
                match self.find_cut(text, start, end, at + chunk, at + chunk + search) {
                    Ok(q) => q,
                    // Nowhere to cut: the rest at once, when it is not too long for that.
                    Err(_) if end - at <= WHOLE_MAX => end,
                    Err(e) => return Err(e),
                }
            };
            self.append(&text[at..cut], at, &mut p.enc)?;
            at = cut;
            if at < end {
                p.marks.push(Mark { at, before: p.enc.ids.len(), margin: WINDOW });
            }
            if p.enc.ids.len() > cap {
                break;
            }
        }
        Ok(())
    }

    /// A cut in `[from, to)` of the stretch `text[start..end]` that leaves
    /// its tokens as they are: a place no piece of the tokenizer's own
    /// pre-tokenizer spans (tokens never span two pieces), in the pieces of
    /// a region reaching [`WINDOW`] bytes past both ends (so a piece longer
    /// than that, a run of spaces, is never cut; text a normalizer deletes
    /// lies between pieces), where the window around it tokenizes the same
    /// together and apart.
    fn find_cut(&self, text: &str, start: usize, end: usize, from: usize, to: usize) -> Result<usize, ChatError> {
        let lo = floor_boundary(text, from.saturating_sub(WINDOW).max(start));
        let hi = ceil_boundary(text, (to + WINDOW).min(end));
        let pieces = self.pieces(&text[lo..hi])?;
        // Piece boundaries and the starts of the gaps between pieces, in order.
        let mut places = Vec::with_capacity(2 * pieces.len() + 1);
        let mut covered = 0;
        for &(s, e) in &pieces {
            if s > covered {
                places.push(covered);
            }
            places.push(s);
            covered = covered.max(e);
        }
        places.push(covered);
        let inside = |q: usize| {
            // Pieces run in order, apart: only the last one starting before q can span it.
            let i = pieces.partition_point(|&(s, _)| s < q);
            i > 0 && q < pieces[i - 1].1
        };
        let mut scratch = [Encoded::default(), Encoded::default()];
        let mut tried = 0;
        let mut last = 0;
        for r in places {
            let q = ceil_boundary(text, (lo + r).max(from));
            // Places before `from` all come to `from`: each place is tried once.
            if q >= to || q <= start || q <= last || inside(q - lo) {
                continue;
            }
            last = q;
            if self.cut_holds(text, start, end, q, &mut scratch)? {
                return Ok(q);
            }
            tried += 1;
            if tried == TRIES {
                break;
            }
        }
        Err(ChatError::Text(format!(
            "the text has no place between bytes {from} and {to} where it can be cut into pieces that tokenize \
             apart (a single pre-tokenizer piece longer than that, such as a run of spaces, or a tokenizer \
             without a pre-tokenizer), and Strata tokenizes at most {} MiB at once",
            WHOLE_MAX >> 20
        )))
    }

    /// Whether cutting the stretch at `q` changes no token near it: the
    /// window around `q` tokenized whole equals its two halves tokenized apart.
    fn cut_holds(
        &self,
        text: &str,
        start: usize,
        end: usize,
        q: usize,
        scratch: &mut [Encoded; 2],
    ) -> Result<bool, ChatError> {
        let lo = floor_boundary(text, q.saturating_sub(WINDOW).max(start));
        let hi = ceil_boundary(text, (q + WINDOW).min(end));
        let [whole, apart] = scratch;
        whole.ids.clear();
        whole.spans.clear();
        apart.ids.clear();
        apart.spans.clear();
        self.append(&text[lo..hi], lo, whole)?;
        self.append(&text[lo..q], lo, apart)?;
        self.append(&text[q..hi], q, apart)?;
        Ok(whole.ids == apart.ids)
    }

    /// The first `cap` tokens of `text`, BOS and EOS included when
    /// `add_special` (as [`Tokenizer::encode`] gives them, cut to `cap`),
    /// into `out`; whether the text has more.
    pub fn encode_limited(
        &self,
        text: &str,
        add_special: bool,
        cap: usize,
        out: &mut Encoded,
    ) -> Result<bool, ChatError> {
        let (before, after) = if add_special { self.around() } else { (&[][..], &[][..]) };
        let body = self.prefix(text, cap.saturating_sub(before.len()))?;
        out.ids.clear();
        out.spans.clear();
        out.ids.extend_from_slice(before);
        out.spans.extend(before.iter().map(|_| (0, 0)));
        out.ids.extend_from_slice(&body.enc.ids);
        out.spans.extend_from_slice(&body.enc.spans);
        if !body.more {
            out.ids.extend_from_slice(after);
            out.spans.extend(after.iter().map(|_| (text.len(), text.len())));
        }
        let more = body.more || out.ids.len() > cap;
        out.ids.truncate(cap);
        out.spans.truncate(cap);
        Ok(more)
    }
}

/// The first tokens of a text that starts like a base text (see
/// [`Prefix::derive`]): the base's first `shared` tokens, then its own.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Derived {
    /// How many of the base's first tokens it begins with.
    pub shared: usize,
    /// Its tokens after those (spans in its own text).
    pub tail: Encoded,
    /// Whether it has more tokens than the base's limit.
    pub more: bool,
}

impl Derived {
    /// Its tokens kept (at most the limit).
    pub fn len(&self) -> usize {
        self.shared + self.tail.ids.len()
    }

    /// Whether it has no token.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl Prefix {
    /// Where a text that starts like this one has more than the limit's
    /// tokens for sure: once it agrees with this one up to this byte.
    pub fn long_from(&self) -> Option<usize> {
        self.marks.iter().find(|m| m.before > self.cap).map(|m| m.at + m.margin)
    }

    /// This text's own tokens, as a [`Derived`] of itself.
    pub fn whole(&self) -> Derived {
        Derived { shared: self.enc.ids.len(), tail: Encoded::default(), more: self.more }
    }

    /// The first tokens of `other`, a text that may share a start with
    /// `base` (this prefix's text), up to the same limit: the tokens before
    /// the last split inside the shared start are this prefix's; the rest
    /// is tokenized. Memory and work grow with what differs, not with the
    /// shared start.
    pub fn derive(&self, tok: &Tokenizer, base: &str, other: &str) -> Result<Derived, ChatError> {
        let cap = self.cap;
        let same = common_start(base.as_bytes(), other.as_bytes());
        if same == base.len() && same == other.len() {
            return Ok(self.whole());
        }
        // The last split a margin inside the shared start (splits run in byte order).
        let below = self.marks.partition_point(|m| m.at <= same);
        let Some(m) = self.marks[..below].iter().rev().find(|m| m.at + m.margin <= same).copied() else {
            let p = tok.prefix(other, cap)?;
            return Ok(Derived { shared: 0, tail: p.enc, more: p.more });
        };
        if m.before > cap {
            // More than the limit's tokens before the split: the first ones are this prefix's.
            return Ok(Derived { shared: self.enc.ids.len(), tail: Encoded::default(), more: true });
        }
        let rest = tok.prefix(&other[m.at..], cap - m.before)?;
        let mut tail = rest.enc;
        tail.spans.iter_mut().for_each(|(s, e)| (*s, *e) = (*s + m.at, *e + m.at));
        Ok(Derived { shared: m.before, tail, more: rest.more })
    }

    /// Token `i` of `d`.
    fn token(&self, d: &Derived, i: usize) -> u32 {
        if i < d.shared {
            self.enc.ids[i]
        } else {
            d.tail.ids[i - d.shared]
        }
    }

    /// The ids `d` holds.
    pub fn ids(&self, d: &Derived) -> Vec<u32> {
        let mut v = self.enc.ids[..d.shared].to_vec();
        v.extend_from_slice(&d.tail.ids);
        v
    }

    /// How many first tokens `a` and `b` (both derived from this prefix) share.
    pub fn common(&self, a: &Derived, b: &Derived) -> usize {
        let n = a.len().min(b.len());
        let from = a.shared.min(b.shared).min(n);
        (from..n).find(|&i| self.token(a, i) != self.token(b, i)).unwrap_or(n)
    }

    /// Whether `a` starts with `b` (both derived from this prefix).
    pub fn starts_with(&self, a: &Derived, b: &Derived) -> bool {
        b.len() <= a.len() && self.common(a, b) == b.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn common_start_finds_the_first_difference_in_any_block() {
        let a: Vec<u8> = (0..20000u32).map(|i| (i % 251) as u8).collect();
        for at in [0, 1, 4095, 4096, 4097, 12345, 19999] {
            let mut b = a.clone();
            b[at] ^= 1;
            assert_eq!(common_start(&a, &b), at);
        }
        assert_eq!(common_start(&a, &a[..777]), 777);
        assert_eq!(common_start(&a, &a), a.len());
    }
}
