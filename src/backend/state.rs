//! What a backend keeps of chunked samples between steps, by layer kind.

use super::{Backend, BackendError};
use crate::pipeline::batch::PackedBatch;

/// The keys and values a backend keeps between the steps of a chunked sample.
pub trait KvStore: Default + Send {
    /// Checks that every continuing segment of `batch` finds exactly its
    /// earlier positions, and notes the positions this step will add.
    fn begin(&mut self, batch: &PackedBatch) -> Result<(), BackendError>;
    /// Drops the samples whose last chunk `batch` ran.
    fn retire(&mut self, batch: &PackedBatch);
    /// Samples with cached positions.
    fn len(&self) -> usize;
    /// Bytes the store holds (allocated, on its device), all samples.
    fn held_bytes(&self) -> usize;
    /// Whether nothing is cached.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// One layer's part of the state a backend keeps between steps: the store
/// of its layer kind and the layer's index in it.
pub struct LayerState<'a, S> {
    /// The store of the layer's kind ([`AttentionOps::KvCache`](super::AttentionOps::KvCache) or
    /// [`RecurrentOps::DeltaState`](super::RecurrentOps::DeltaState)).
    pub state: &'a mut S,
    /// The layer.
    pub layer: usize,
}

impl<'a, S> LayerState<'a, S> {
    /// Layer `layer` of `state`.
    pub fn new(state: &'a mut S, layer: usize) -> Self {
        LayerState { state, layer }
    }

    /// The same layer's part, for one more op of the layer.
    pub fn reborrow(&mut self) -> LayerState<'_, S> {
        LayerState { state: &mut *self.state, layer: self.layer }
    }
}

/// Everything a backend keeps of chunked samples between steps, by layer
/// kind: keys and values for attention layers, conv and recurrent state
/// for Gated DeltaNet layers. A [`crate::model::decoder::Block`] hands each
/// of its layers the part its kind keeps.
pub struct SeqState<B: Backend> {
    /// The attention layers' keys and values.
    pub kv: B::KvCache,
    /// The Gated DeltaNet layers' state.
    pub delta: B::DeltaState,
}

impl<B: Backend> Default for SeqState<B> {
    fn default() -> Self {
        SeqState { kv: B::KvCache::default(), delta: B::DeltaState::default() }
    }
}

impl<B: Backend> KvStore for SeqState<B> {
    fn begin(&mut self, batch: &PackedBatch) -> Result<(), BackendError> {
        self.kv.begin(batch)?;
        self.delta.begin(batch)
    }
    fn retire(&mut self, batch: &PackedBatch) {
        self.kv.retire(batch);
        self.delta.retire(batch);
    }
    fn len(&self) -> usize {
        self.kv.len().max(self.delta.len())
    }
    fn held_bytes(&self) -> usize {
        self.kv.held_bytes() + self.delta.held_bytes()
    }
}
