//! The scheduler: fills each forward step up to a token budget, in input
//! order, splitting a sample across steps where the budget runs out
//! (chunked prefill). At most one sample is ever in flight between steps.

use super::batch::{PackedBatch, Segment};
use super::source::Sample;
use std::ops::Range;
use std::sync::Arc;

/// One segment of a step: which sample, which of its tokens, and whether it ends the sample.
#[derive(Clone, Debug)]
pub struct Part {
    /// The sample.
    pub sample: Arc<Sample>,
    /// Its tokens in this step.
    pub range: Range<usize>,
    /// This part ends the sample.
    pub last: bool,
}

/// One forward step.
#[derive(Clone, Debug, Default)]
pub struct Step {
    /// The packed tokens.
    pub batch: PackedBatch,
    /// What each segment of `batch` is.
    pub parts: Vec<Part>,
}

/// Cuts a stream of samples into steps of at most `budget` tokens.
#[derive(Debug)]
pub struct Scheduler {
    budget: usize,
    in_flight: Option<(Arc<Sample>, usize)>,
}

impl Scheduler {
    /// A scheduler with a token budget per step (at least 1).
    pub fn new(budget: usize) -> Self {
        Scheduler { budget: budget.max(1), in_flight: None }
    }

    /// The next step, pulling samples from `source` as needed; `None` at the end.
    pub fn next_step<E>(&mut self, source: &mut impl Iterator<Item = Result<Sample, E>>) -> Result<Option<Step>, E> {
        let mut step = Step::default();
        let mut room = self.budget;
        while room > 0 {
            let (sample, done) = match self.in_flight.take() {
                Some(x) => x,
                None => match source.next() {
                    None => break,
                    Some(s) => (Arc::new(s?), 0),
                },
            };
            let take = (sample.len() - done).min(room);
            let end = done + take;
            let last = end == sample.len();
            let segment = Segment { key: sample.index as u64, pos0: done, keep: !last };
            step.batch.push_segment(&sample.input_ids[done..end], segment);
            step.parts.push(Part { sample: sample.clone(), range: done..end, last });
            room -= take;
            if !last {
                self.in_flight = Some((sample, end));
            }
        }
        Ok((!step.parts.is_empty()).then_some(step))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(index: usize, len: usize) -> Result<Sample, ()> {
        Ok(Sample {
            index,
            line: index + 1,
            id: index.to_string(),
            input_ids: (0..len as u32).collect(),
            loss_mask: None,
            end: Default::default(),
            finish: vec![],
        })
    }

    #[test]
    fn fills_budget_and_chunks_in_order() {
        let mut src = vec![sample(0, 3), sample(1, 10), sample(2, 2)].into_iter();
        let mut s = Scheduler::new(4);
        let mut got = Vec::new();
        while let Some(step) = s.next_step(&mut src).unwrap() {
            assert!(step.batch.num_tokens() <= 4);
            got.push(step.parts.iter().map(|p| (p.sample.index, p.range.clone(), p.last)).collect::<Vec<_>>());
        }
        assert_eq!(
            got,
            vec![
                vec![(0, 0..3, true), (1, 0..1, false)],
                vec![(1, 1..5, false)],
                vec![(1, 5..9, false)],
                vec![(1, 9..10, true), (2, 0..2, true)],
            ]
        );
    }
}
