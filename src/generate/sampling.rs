//! Sampling as vLLM's V1 sampler does it (vLLM 0.19.1,
//! `vllm/v1/sample/sampler.py` and `ops/topk_topp_sampler.py`'s native path),
//! one row of logits at a time:
//!
//! 1. penalties: repetition on every token of the prompt and the output
//!    (`l / r` where `l > 0`, else `l · r`), then frequency (`l -= f · count`)
//!    and presence (`l -= p` once) on the output's tokens;
//! 2. temperature 0 is greedy: the first largest logit after the penalties;
//! 3. otherwise `l / T`, then min-p (a token whose probability is below
//!    `min_p` times the largest is dropped), then top-k (every token below the
//!    k-th largest logit is dropped: ties at it are kept), then top-p on what
//!    remains, renormalised (a token is kept while the mass ranked above it is
//!    below `p`: the token that crosses `p` is kept);
//! 4. one draw from what is left, with a uniform number that depends only on
//!    (seed, record, generation, position) ([`DrawKey`]): a counter-based
//!    generator, so a token never depends on how requests were batched.
//!
//! The draw is an inverse CDF over the kept tokens in id order (vLLM draws
//! by an exponential race on the GPU: the same distribution, other bits).

use rand_chacha::ChaCha8Rng;
use rand_core::{RngCore, SeedableRng};

/// A sampling parameter out of range, in vLLM's words.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
#[error("{name} must be {range}, got {value}")]
pub struct SamplingError {
    /// The parameter (vLLM's name).
    pub name: &'static str,
    /// What it must be.
    pub range: &'static str,
    /// What it was.
    pub value: String,
}

/// How each token is chosen: vLLM's `SamplingParams` fields that shape the
/// distribution, checked as `SamplingParams._verify_args` checks them.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SamplingParams {
    /// 0: greedy; vLLM raises values in `(0, 0.01)` to 0.01.
    pub temperature: f32,
    /// Keep the `k` largest logits (and any tied with the k-th); `None`: all.
    pub top_k: Option<usize>,
    /// Keep the smallest set of most likely tokens whose mass reaches `p`; 1: all.
    pub top_p: f32,
    /// Drop tokens less likely than `min_p` times the most likely; 0: none.
    pub min_p: f32,
    /// > 1 discourages tokens of the prompt or the output; 1: off.
    pub repetition_penalty: f32,
    /// Subtracted once from each token the output holds, in `[-2, 2]`.
    pub presence_penalty: f32,
    /// Subtracted per occurrence in the output, in `[-2, 2]`.
    pub frequency_penalty: f32,
}

impl Default for SamplingParams {
    /// vLLM's defaults: temperature 1, no truncation, no penalty.
    fn default() -> Self {
        SamplingParams {
            temperature: 1.0,
            top_k: None,
            top_p: 1.0,
            min_p: 0.0,
            repetition_penalty: 1.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
        }
    }
}

/// Below this a temperature is greedy (vLLM's `_SAMPLING_EPS`).
const SAMPLING_EPS: f32 = 1e-5;
/// vLLM raises a positive temperature below this to it (and warns).
pub const MIN_TEMPERATURE: f32 = 0.01;

impl SamplingParams {
    /// Greedy decoding: temperature 0, nothing else.
    pub fn greedy() -> Self {
        SamplingParams { temperature: 0.0, ..Default::default() }
    }

    /// Checks every value as vLLM does and normalises them as it does:
    /// `top_k` of 0 or -1 is off; a temperature in `(0, 0.01)` becomes 0.01;
    /// greedy turns truncation off. Returns the params and whether the
    /// temperature was raised (the caller warns).
    pub fn checked(mut self, top_k: i64) -> Result<(Self, bool), SamplingError> {
        let bad = |name, range, value: String| Err(SamplingError { name, range, value });
        let finite = |v: f32| v.is_finite();
        if !finite(self.presence_penalty) || !(-2.0..=2.0).contains(&self.presence_penalty) {
            return bad("presence_penalty", "in [-2, 2]", self.presence_penalty.to_string());
        }
        if !finite(self.frequency_penalty) || !(-2.0..=2.0).contains(&self.frequency_penalty) {
            return bad("frequency_penalty", "in [-2, 2]", self.frequency_penalty.to_string());
        }
        if !finite(self.repetition_penalty) || self.repetition_penalty <= 0.0 {
            return bad("repetition_penalty", "greater than zero", self.repetition_penalty.to_string());
        }
        if !finite(self.temperature) || self.temperature < 0.0 {
            return bad("temperature", "non-negative", self.temperature.to_string());
        }
        if !finite(self.top_p) || self.top_p <= 0.0 || self.top_p > 1.0 {
            return bad("top_p", "in (0, 1]", self.top_p.to_string());
        }
        if top_k < -1 {
            return bad("top_k", "0 (disable), or at least 1", top_k.to_string());
        }
        if !finite(self.min_p) || !(0.0..=1.0).contains(&self.min_p) {
            return bad("min_p", "in [0, 1]", self.min_p.to_string());
        }
        self.top_k = usize::try_from(top_k).ok().filter(|&k| k > 0);
        let raised = self.temperature > 0.0 && self.temperature < MIN_TEMPERATURE;
        if raised {
            self.temperature = MIN_TEMPERATURE;
        }
        if self.is_greedy() {
            (self.top_p, self.top_k, self.min_p) = (1.0, None, 0.0);
        }
        Ok((self, raised))
    }

    /// Whether the token is the argmax (after the penalties).
    pub fn is_greedy(&self) -> bool {
        self.temperature < SAMPLING_EPS
    }

    fn penalised(&self) -> bool {
        self.repetition_penalty != 1.0 || self.presence_penalty != 0.0 || self.frequency_penalty != 0.0
    }
}

/// What a draw depends on, and nothing else: the run's seed, the record
/// (its digest), which of the record's generations, and the position of
/// the token drawn.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DrawKey {
    /// The run's seed.
    pub seed: u64,
    /// The record's key: a 128-bit digest of its `id` or of its bytes.
    pub record: u128,
    /// The record's generation (turn) index.
    pub generation: u32,
    /// The position, in its sequence, of the token drawn.
    pub position: u32,
}

impl DrawKey {
    /// A uniform number in `[0, 1)` with 53 random bits: ChaCha8 keyed by
    /// (seed, record, generation), its stream the position.
    pub fn uniform(&self) -> f64 {
        let mut key = [0u8; 32];
        key[..8].copy_from_slice(&self.seed.to_le_bytes());
        key[8..24].copy_from_slice(&self.record.to_le_bytes());
        key[24..28].copy_from_slice(&self.generation.to_le_bytes());
        let mut rng = ChaCha8Rng::from_seed(key);
        rng.set_stream(u64::from(self.position));
        (rng.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }
}

/// The tokens a sequence holds so far: the penalties read them.
#[derive(Clone, Copy, Debug)]
pub struct History<'a> {
    /// The prompt's tokens.
    pub prompt: &'a [u32],
    /// The tokens generated so far.
    pub output: &'a [u32],
}

/// Working memory of the sampler, reused from token to token (no
/// allocation per token once it has seen the vocabulary's size).
#[derive(Default)]
pub struct Sampler {
    /// `[V]` the processed logits.
    logits: Vec<f32>,
    /// `[V]` per token: seen in the prompt or output (repetition), output count.
    seen: Vec<bool>,
    counts: Vec<u32>,
    /// The kept tokens `(logit, id)`.
    kept: Vec<(f32, u32)>,
    /// Their logits, for top-k's selection.
    values: Vec<f32>,
}

impl Sampler {
    /// A sampler with no memory yet.
    pub fn new() -> Self {
        Self::default()
    }

    /// The token chosen from `logits` `[V]` under `params`, drawn with `key`.
    pub fn sample(&mut self, logits: &[f32], params: &SamplingParams, history: History<'_>, key: DrawKey) -> u32 {
        self.penalise(logits, params, history);
        if params.is_greedy() {
            return argmax(&self.logits);
        }
        self.truncate(params);
        draw(&self.kept, key.uniform())
    }

    /// The distribution a non-greedy [`sample`](Self::sample) draws from:
    /// each kept token with its probability, in id order.
    pub fn distribution(&mut self, logits: &[f32], params: &SamplingParams, history: History<'_>) -> Vec<(u32, f64)> {
        self.penalise(logits, params, history);
        self.truncate(params);
        let max = self.kept.iter().map(|k| k.0).fold(f32::NEG_INFINITY, f32::max);
        let total: f64 = self.kept.iter().map(|k| f64::from(k.0 - max).exp()).sum();
        self.kept.iter().map(|&(l, id)| (id, f64::from(l - max).exp() / total)).collect()
    }

    /// `self.logits` = `logits` after the penalties.
    fn penalise(&mut self, logits: &[f32], params: &SamplingParams, history: History<'_>) {
        self.logits.clear();
        self.logits.extend_from_slice(logits);
        if !params.penalised() {
            return;
        }
        let v = logits.len();
        if self.seen.len() < v {
            self.seen.resize(v, false);
            self.counts.resize(v, 0);
        }
        let tokens = || history.prompt.iter().chain(history.output).map(|&t| t as usize).filter(|&t| t < v);
        let r = params.repetition_penalty;
        if r != 1.0 {
            for t in tokens() {
                if !std::mem::replace(&mut self.seen[t], true) {
                    let l = &mut self.logits[t];
                    *l = if *l > 0.0 { *l / r } else { *l * r };
                }
            }
            tokens().for_each(|t| self.seen[t] = false);
        }
        let out = || history.output.iter().map(|&t| t as usize).filter(|&t| t < v);
        out().for_each(|t| self.counts[t] += 1);
        let (f, p) = (params.frequency_penalty, params.presence_penalty);
        for t in out() {
            let c = std::mem::take(&mut self.counts[t]);
            if c > 0 {
                self.logits[t] -= f * c as f32;
                self.logits[t] -= p;
            }
        }
    }

    /// `self.kept`: the tokens left by temperature, min-p, top-k and top-p,
    /// with their tempered logits.
    fn truncate(&mut self, params: &SamplingParams) {
        let t = params.temperature;
        self.kept.clear();
        self.kept.extend(self.logits.iter().enumerate().map(|(i, &l)| (l / t, i as u32)));
        self.kept.retain(|k| k.0 > f32::NEG_INFINITY);
        let max = self.kept.iter().map(|k| k.0).fold(f32::NEG_INFINITY, f32::max);
        if params.min_p > 0.0 {
            // p_i < min_p · p_max, with p_i / p_max = exp(l_i - l_max).
            let min_p = f64::from(params.min_p);
            self.kept.retain(|k| f64::from(k.0 - max).exp() >= min_p);
        }
        if let Some(k) = params.top_k.filter(|&k| k < self.kept.len()) {
            let nth = self.kept.len() - k;
            self.values.clear();
            self.values.extend(self.kept.iter().map(|k| k.0));
            let (_, &mut kth, _) = self.values.select_nth_unstable_by(nth, f32::total_cmp);
            self.kept.retain(|k| k.0 >= kth);
        }
        if params.top_p < 1.0 {
            // Most likely first, ties by id: a token is kept while the mass
            // ranked above it is below p.
            self.kept.sort_unstable_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
            let total: f64 = self.kept.iter().map(|k| f64::from(k.0 - max).exp()).sum();
            let (p, mut above, mut keep) = (f64::from(params.top_p), 0.0, 0);
            while keep < self.kept.len() && (keep == 0 || above < p) {
                above += f64::from(self.kept[keep].0 - max).exp() / total;
                keep += 1;
            }
            self.kept.truncate(keep);
            self.kept.sort_unstable_by_key(|k| k.1);
        }
    }
}

/// The first index of the largest value (torch's `argmax`).
pub fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &l) in logits.iter().enumerate() {
        if l > logits[best] {
            best = i;
        }
    }
    best as u32
}

/// The token whose cumulative probability, in id order, first passes `u`.
fn draw(kept: &[(f32, u32)], u: f64) -> u32 {
    let max = kept.iter().map(|k| k.0).fold(f32::NEG_INFINITY, f32::max);
    let total: f64 = kept.iter().map(|k| f64::from(k.0 - max).exp()).sum();
    let target = u * total;
    let mut acc = 0.0;
    for &(l, id) in kept {
        acc += f64::from(l - max).exp();
        if acc > target {
            return id;
        }
    }
    kept.last().map_or(0, |k| k.1)
}

/// A seed from the operating system's generator.
pub fn draw_seed() -> u64 {
    let mut b = [0u8; 8];
    match rustix::rand::getrandom(&mut b, rustix::rand::GetRandomFlags::empty()) {
        Ok(8) => u64::from_le_bytes(b),
        // Never expected on Linux; the time still differs run to run.
        _ => std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos() as u64),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// vLLM's V1 sampler written out as its native path computes it, in
    /// f64: penalties, temperature, min-p, top-k (ascending sort, the
    /// `V - k`-th value the threshold), top-p (ascending cumulative sum of
    /// the renormalised probabilities, masked where `≤ 1 - p`, the largest
    /// kept); then the softmax of what is left. `Mutant` plants the two
    /// mistakes the chi-square test must catch.
    #[derive(Clone, Copy, PartialEq)]
    enum Mutant {
        None,
        /// Top-p drops the token that crosses `p`.
        TopPOffByOne,
        /// Min-p after top-p instead of before.
        MinPAfterTopP,
    }

    fn vllm(logits: &[f32], p: &SamplingParams, h: History<'_>, mutant: Mutant) -> Vec<f64> {
        let v = logits.len();
        let mut l: Vec<f64> = logits.iter().map(|&x| x as f64).collect();
        let in_prompt_or_output = |t: usize| h.prompt.iter().chain(h.output).any(|&x| x as usize == t);
        for (t, lt) in l.iter_mut().enumerate() {
            if in_prompt_or_output(t) {
                let r = p.repetition_penalty as f64;
                *lt = if *lt > 0.0 { *lt / r } else { *lt * r };
            }
            let count = h.output.iter().filter(|&&x| x as usize == t).count() as f64;
            *lt -= p.frequency_penalty as f64 * count;
            *lt -= p.presence_penalty as f64 * if count > 0.0 { 1.0 } else { 0.0 };
        }
        l.iter_mut().for_each(|x| *x /= p.temperature as f64);
        let softmax = |l: &[f64]| {
            let m = l.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let e: Vec<f64> = l.iter().map(|x| (x - m).exp()).collect();
            let s: f64 = e.iter().sum();
            e.into_iter().map(|x| x / s).collect::<Vec<_>>()
        };
        let min_p = |l: &mut Vec<f64>| {
            let probs = softmax(l);
            let max = probs.iter().cloned().fold(0.0, f64::max);
            for (x, q) in l.iter_mut().zip(probs) {
                if q < p.min_p as f64 * max {
                    *x = f64::NEG_INFINITY;
                }
            }
        };
        if mutant != Mutant::MinPAfterTopP {
            min_p(&mut l);
        }
        let mut order: Vec<usize> = (0..v).collect();
        order.sort_by(|&a, &b| l[a].total_cmp(&l[b]).then(b.cmp(&a))); // ascending
        if let Some(k) = p.top_k.filter(|&k| k < v) {
            let threshold = l[order[v - k]];
            l.iter_mut().filter(|x| **x < threshold).for_each(|x| *x = f64::NEG_INFINITY);
        }
        if p.top_p < 1.0 {
            let sorted: Vec<f64> = order.iter().map(|&i| l[i]).collect();
            let probs = softmax(&sorted);
            let mut cum = 0.0;
            let mut masked = vec![false; v];
            for (j, q) in probs.iter().enumerate() {
                cum += q;
                masked[j] = match mutant {
                    Mutant::TopPOffByOne => cum < 1.0 - p.top_p as f64 + q,
                    _ => cum <= 1.0 - p.top_p as f64,
                };
            }
            masked[v - 1] = false;
            for (j, &i) in order.iter().enumerate() {
                if masked[j] {
                    l[i] = f64::NEG_INFINITY;
                }
            }
        }
        if mutant == Mutant::MinPAfterTopP {
            min_p(&mut l);
        }
        softmax(&l)
    }

    /// The chi-square statistic of `counts` against `probs` (`n` draws),
    /// and its degrees of freedom; a count where the probability is 0 is infinite.
    fn chi_square(counts: &[u64], probs: &[f64], n: u64) -> (f64, usize) {
        let mut stat = 0.0;
        let mut cells = 0;
        for (&c, &p) in counts.iter().zip(probs) {
            let e = p * n as f64;
            if e == 0.0 {
                if c > 0 {
                    return (f64::INFINITY, cells);
                }
                continue;
            }
            stat += (c as f64 - e).powi(2) / e;
            cells += 1;
        }
        (stat, cells.saturating_sub(1))
    }

    /// The chi-square value a statistic of `df` degrees of freedom exceeds
    /// with probability about 1e-6 (Wilson–Hilferty: z = 4.753).
    fn critical(df: usize) -> f64 {
        let k = df.max(1) as f64;
        let z = 4.753;
        k * (1.0 - 2.0 / (9.0 * k) + z * (2.0 / (9.0 * k)).sqrt()).powi(3)
    }

    struct Case {
        logits: Vec<f32>,
        params: SamplingParams,
        prompt: Vec<u32>,
        output: Vec<u32>,
    }

    fn cases() -> Vec<Case> {
        let base = SamplingParams::default();
        vec![
            // min-p removes the tail, which changes where top-p's mass crosses 0.7.
            Case {
                logits: vec![2.0, 1.5, 1.2, 1.0, 0.5, 0.3, 0.2, 0.1, 0.0, -0.1, -0.2, -0.3],
                params: SamplingParams { min_p: 0.3, top_p: 0.7, ..base },
                prompt: vec![],
                output: vec![],
            },
            // Temperature, top-k with a tie at the k-th value (both kept), top-p.
            Case {
                logits: vec![0.3, 1.1, -0.4, 0.9, 0.9, 0.2, 1.6, -1.0],
                params: SamplingParams { temperature: 0.7, top_k: Some(4), top_p: 0.9, ..base },
                prompt: vec![],
                output: vec![],
            },
            // Penalties: repetition on prompt and output, frequency and presence on the output.
            Case {
                logits: vec![1.0, -0.5, 0.8, 0.6, 1.2, 0.0, -1.5, 0.4, 0.9, 0.1],
                params: SamplingParams {
                    temperature: 1.3,
                    repetition_penalty: 1.4,
                    frequency_penalty: 0.3,
                    presence_penalty: 0.2,
                    top_p: 0.95,
                    ..base
                },
                prompt: vec![0, 3, 3, 9],
                output: vec![4, 4, 8, 1],
            },
        ]
    }

    fn draws(c: &Case, n: u64) -> Vec<u64> {
        let mut s = Sampler::new();
        let mut counts = vec![0u64; c.logits.len()];
        let h = History { prompt: &c.prompt, output: &c.output };
        for seed in 0..n {
            let key = DrawKey { seed, record: 7, generation: 1, position: 12 };
            counts[s.sample(&c.logits, &c.params, h, key) as usize] += 1;
        }
        counts
    }

    #[test]
    fn sampled_tokens_follow_vllms_processed_distribution() {
        let n = 40_000;
        for (i, c) in cases().iter().enumerate() {
            let h = History { prompt: &c.prompt, output: &c.output };
            let want = vllm(&c.logits, &c.params, h, Mutant::None);
            // The sampler's own account of its distribution is vLLM's.
            let mut dist = vec![0.0; c.logits.len()];
            for (t, p) in Sampler::new().distribution(&c.logits, &c.params, h) {
                dist[t as usize] = p;
            }
            for (t, (a, b)) in dist.iter().zip(&want).enumerate() {
                assert!((a - b).abs() < 1e-6, "case {i} token {t}: {a} vs vLLM's {b}");
            }
            let counts = draws(c, n);
            let (stat, df) = chi_square(&counts, &want, n);
            assert!(stat < critical(df), "case {i}: chi-square {stat:.1} > {:.1} (df {df})", critical(df));
        }
    }

    #[test]
    fn the_chi_square_test_catches_a_planted_top_p_or_min_p_order_bug() {
        let n = 40_000;
        let c = &cases()[0];
        let h = History { prompt: &c.prompt, output: &c.output };
        let counts = draws(c, n);
        for mutant in [Mutant::TopPOffByOne, Mutant::MinPAfterTopP] {
            let wrong = vllm(&c.logits, &c.params, h, mutant);
            let (stat, df) = chi_square(&counts, &wrong, n);
            assert!(stat > critical(df), "a mutant's distribution passes: chi-square {stat:.1} (df {df})");
        }
        // And on the second case, the off-by-one in top-p.
        let c = &cases()[1];
        let h = History { prompt: &c.prompt, output: &c.output };
        let wrong = vllm(&c.logits, &c.params, h, Mutant::TopPOffByOne);
        let (stat, df) = chi_square(&draws(c, n), &wrong, n);
        assert!(stat > critical(df), "top-p off by one passes: chi-square {stat:.1} (df {df})");
    }

    #[test]
    fn greedy_is_the_first_argmax_after_the_penalties() {
        let mut s = Sampler::new();
        let key = DrawKey { seed: 1, record: 2, generation: 0, position: 3 };
        let none = History { prompt: &[], output: &[] };
        let logits = [0.5, 2.0, 2.0, 1.9];
        assert_eq!(s.sample(&logits, &SamplingParams::greedy(), none, key), 1);
        let p = SamplingParams { repetition_penalty: 1.1, ..SamplingParams::greedy() };
        let h = History { prompt: &[1, 2], output: &[] };
        // 2.0 / 1.1 for both repeated tokens: 1.9 wins.
        assert_eq!(s.sample(&logits, &p, h, key), 3);
    }

    #[test]
    fn a_draw_depends_on_its_key_alone() {
        let key = DrawKey { seed: 5, record: 9, generation: 2, position: 40 };
        assert_eq!(key.uniform(), key.uniform());
        let others = [
            DrawKey { seed: 6, ..key },
            DrawKey { record: 10, ..key },
            DrawKey { generation: 3, ..key },
            DrawKey { position: 41, ..key },
        ];
        for other in others {
            assert_ne!(key.uniform(), other.uniform(), "{other:?}");
        }
        assert!((0..1000).map(|p| DrawKey { position: p, ..key }.uniform()).all(|u| (0.0..1.0).contains(&u)));
    }

    #[test]
    fn values_are_checked_as_vllm_checks_them() {
        let ok = SamplingParams::default();
        let err = |p: SamplingParams, k: i64| p.checked(k).unwrap_err().to_string();
        assert_eq!(err(SamplingParams { top_p: 0.0, ..ok }, 0), "top_p must be in (0, 1], got 0");
        assert_eq!(err(SamplingParams { temperature: -1.0, ..ok }, 0), "temperature must be non-negative, got -1");
        assert_eq!(err(SamplingParams { min_p: 1.5, ..ok }, 0), "min_p must be in [0, 1], got 1.5");
        assert_eq!(
            err(SamplingParams { presence_penalty: 2.5, ..ok }, 0),
            "presence_penalty must be in [-2, 2], got 2.5"
        );
        assert_eq!(
            err(SamplingParams { frequency_penalty: -3.0, ..ok }, 0),
            "frequency_penalty must be in [-2, 2], got -3"
        );
        assert_eq!(
            err(SamplingParams { repetition_penalty: 0.0, ..ok }, 0),
            "repetition_penalty must be greater than zero, got 0"
        );
        assert_eq!(err(ok, -2), "top_k must be 0 (disable), or at least 1, got -2");
        assert_eq!(ok.checked(-1).unwrap().0.top_k, None);
        assert_eq!(ok.checked(5).unwrap().0.top_k, Some(5));
        let (p, raised) = SamplingParams { temperature: 0.001, ..ok }.checked(0).unwrap();
        assert!(raised && p.temperature == MIN_TEMPERATURE);
        let (p, _) = SamplingParams { temperature: 0.0, top_p: 0.5, min_p: 0.1, ..ok }.checked(3).unwrap();
        assert_eq!(p, SamplingParams::greedy());
    }
}
