//! The gatherer: turns each step's packed states into whole samples, in
//! order, reassembling samples that were split across steps.

use super::schedule::Step;
use super::source::Sample;
use crate::shape::{CapturedStates, Dim, ShapeError, StatesView};
use std::sync::Arc;

/// Reassembles per-sample `[L, T, H]` states from steps.
#[derive(Debug)]
pub struct Gatherer<L: Dim, H: Dim> {
    partial: Option<(Arc<Sample>, CapturedStates<L, H>)>,
}

impl<L: Dim, H: Dim> Default for Gatherer<L, H> {
    fn default() -> Self {
        Gatherer { partial: None }
    }
}

impl<L: Dim, H: Dim> Gatherer<L, H> {
    /// Hands every sample that `step` completes to `emit`, in order. A whole
    /// sample is passed as a view of the step's states (no copy); a chunked
    /// one is copied chunk by chunk into its own buffer.
    pub fn gather<E>(
        &mut self,
        step: &Step,
        states: &CapturedStates<L, H>,
        mut emit: impl FnMut(&Sample, StatesView<'_, L, H>) -> Result<(), E>,
    ) -> Result<(), E>
    where
        E: From<ShapeError>,
    {
        for (i, part) in step.parts.iter().enumerate() {
            let view = states.view_tokens(step.batch.range(i))?;
            if part.range.start == 0 && part.last {
                emit(&part.sample, view)?;
                continue;
            }
            if part.range.start == 0 {
                let full = CapturedStates::zeros(states.layers(), part.sample.len(), states.hidden());
                self.partial = Some((part.sample.clone(), full));
            }
            let Some((sample, buf)) = self.partial.as_mut().filter(|(s, _)| s.index == part.sample.index) else {
                return Err(
                    ShapeError::new("gather: chunk without its sample's start", "tokens", 0, part.range.start).into()
                );
            };
            let h = states.hidden().size();
            for l in 0..states.layers().size() {
                buf.layer_mut(l)[part.range.start * h..part.range.end * h].copy_from_slice(view.layer(l));
            }
            if part.last {
                let sample = sample.clone();
                let (_, buf) = self.partial.take().expect("just matched");
                emit(&sample, buf.view())?;
            }
        }
        Ok(())
    }

    /// Whether a sample is still waiting for chunks.
    pub fn has_partial(&self) -> bool {
        self.partial.is_some()
    }
}
