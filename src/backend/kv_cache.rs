//! What the CPU and reference backends keep in host memory between the
//! steps of samples processed in chunks: per sample, per layer, a state whose
//! type the layer's kind decides (keys and values of an attention layer, the
//! conv and recurrent state of a Gated DeltaNet layer).

use super::{BackendError, KvStore};
use crate::pipeline::batch::PackedBatch;
use std::collections::HashMap;

/// Keys and values of one layer for the positions a sample has run so far.
#[derive(Default, Debug)]
pub(crate) struct LayerKv {
    pub(crate) k: Vec<f32>,
    pub(crate) v: Vec<f32>,
}

/// What a layer's state holds in memory, and whether it can be cut back.
pub(crate) trait Held {
    /// Bytes allocated.
    fn held_bytes(&self) -> usize;
    /// Cuts a state of `from` positions back to its first `to` (`to < from`);
    /// `false` where the state cannot be (a recurrent state sums every position).
    fn rewind(&mut self, _from: usize, _to: usize) -> bool {
        false
    }
}

impl Held for LayerKv {
    fn held_bytes(&self) -> usize {
        (self.k.capacity() + self.v.capacity()) * 4
    }
    fn rewind(&mut self, from: usize, to: usize) -> bool {
        // Rows of equal width: a layer holds `from` of them (or none yet).
        self.k.truncate(self.k.len() / from.max(1) * to);
        self.v.truncate(self.v.len() / from.max(1) * to);
        true
    }
}

/// One sample's entry: its positions, the most it reserved, each layer's state.
#[derive(Debug, Default)]
pub(crate) struct Entry<T> {
    positions: usize,
    reserved: usize,
    layers: Vec<T>,
}

/// One state `T` per layer of every sample being processed in chunks, kept
/// between steps. Holds only samples whose last chunk has not run yet.
#[derive(Debug)]
pub(crate) struct SeqStore<T> {
    entries: HashMap<u64, Entry<T>>,
}

impl<T> Default for SeqStore<T> {
    fn default() -> Self {
        SeqStore { entries: HashMap::new() }
    }
}

/// Checks that every segment of `batch` that uses a cache continues exactly
/// the positions `cached(key)` says its sample has (any backend's cache).
pub(crate) fn check_continuations(batch: &PackedBatch, cached: impl Fn(u64) -> usize) -> Result<(), BackendError> {
    for (s, seg) in batch.segments().iter().enumerate() {
        let have = cached(seg.key);
        if seg.uses_cache() && have != seg.pos0 {
            return Err(BackendError::Input {
                sample: s,
                problem: format!("chunk starts at position {} but {have} earlier positions are cached", seg.pos0),
            });
        }
    }
    Ok(())
}

/// A rewind a cache cannot do: past its positions, or of a recurrent state.
pub(crate) fn rewind_refused(key: u64, from: usize, to: usize) -> BackendError {
    BackendError::Input {
        sample: key as usize,
        problem: format!(
            "cannot cut a cached sample of {from} positions back to {to}: only keys and values of earlier \
             positions can be dropped, not a recurrent state's"
        ),
    }
}

impl<T: Default + Send + Held> SeqStore<T> {
    fn len(&self) -> usize {
        self.entries.len()
    }

    fn held_bytes(&self) -> usize {
        self.entries.values().flat_map(|e| &e.layers).map(Held::held_bytes).sum()
    }

    fn begin(&mut self, batch: &PackedBatch) -> Result<(), BackendError> {
        for &(key, to) in batch.rewinds() {
            // A store without the sample (a model with no layer of its kind) has nothing to cut.
            let Some(e) = self.entries.get_mut(&key) else { continue };
            if to == 0 {
                self.entries.remove(&key);
            } else if to != e.positions {
                let from = e.positions;
                if to > from || !e.layers.iter_mut().all(|l| l.rewind(from, to)) {
                    return Err(rewind_refused(key, from, to));
                }
                e.positions = to;
            }
        }
        check_continuations(batch, |key| self.entries.get(&key).map_or(0, |e| e.positions))?;
        for (s, seg) in batch.segments().iter().enumerate().filter(|(_, g)| g.uses_cache()) {
            self.entries.entry(seg.key).or_default().positions = seg.pos0 + batch.range(s).len();
        }
        for &(key, positions) in batch.reservations() {
            if let Some(e) = self.entries.get_mut(&key) {
                e.reserved = positions;
            }
        }
        Ok(())
    }

    /// The positions sample `key` reserved (0: none).
    pub(crate) fn reserved(&self, key: u64) -> usize {
        self.entries.get(&key).map_or(0, |e| e.reserved)
    }

    fn retire(&mut self, batch: &PackedBatch) {
        for seg in batch.segments().iter().filter(|g| !g.keep) {
            self.entries.remove(&seg.key);
        }
    }

    /// Layer `layer` of sample `key` (which `begin` has registered), to update.
    pub(crate) fn layer_mut(&mut self, key: u64, layer: usize) -> &mut T {
        let layers = &mut self.entries.get_mut(&key).expect("checked").layers;
        if layers.len() <= layer {
            layers.resize_with(layer + 1, T::default);
        }
        &mut layers[layer]
    }

    /// Layer `layer` of sample `key`.
    pub(crate) fn layer(&self, key: u64, layer: usize) -> &T {
        &self.entries[&key].layers[layer]
    }
}

/// Keys/values of the attention layers of samples being processed in
/// chunks, kept between steps.
#[derive(Default, Debug)]
pub struct KvCache(pub(crate) SeqStore<LayerKv>);

/// The sequence state of the Gated DeltaNet layers of samples being
/// processed in chunks (a backend's per-layer state `S`), kept between steps.
#[derive(Debug)]
pub struct DeltaCache<S>(pub(crate) SeqStore<S>);

impl<S> Default for DeltaCache<S> {
    fn default() -> Self {
        DeltaCache(SeqStore::default())
    }
}

macro_rules! store {
    ($ty:ty $(, $p:ident)?) => {
        impl$(<$p: Default + Send + Held>)? KvStore for $ty {
            fn len(&self) -> usize {
                self.0.len()
            }
            fn held_bytes(&self) -> usize {
                self.0.held_bytes()
            }
            fn begin(&mut self, batch: &PackedBatch) -> Result<(), BackendError> {
                self.0.begin(batch)
            }
            fn retire(&mut self, batch: &PackedBatch) {
                self.0.retire(batch)
            }
        }
    };
}
store!(KvCache);
store!(DeltaCache<S>, S);

impl KvCache {
    /// Layer `layer` of sample `key` (which [`KvStore::begin`] has registered), to append
    /// rows of `kw` keys and `vw` values to: room for the positions it reserved, made once.
    pub(crate) fn layer_mut(&mut self, key: u64, layer: usize, kw: usize, vw: usize) -> &mut LayerKv {
        let reserved = self.0.reserved(key);
        let l = self.0.layer_mut(key, layer);
        // Made once, or once more when a continued sample reserves more.
        if l.k.capacity() < reserved * kw {
            l.k.reserve_exact(reserved * kw - l.k.len());
            l.v.reserve_exact(reserved * vw - l.v.len());
        }
        l
    }

    /// Layer `layer` of sample `key`.
    pub(crate) fn layer(&self, key: u64, layer: usize) -> &LayerKv {
        self.0.layer(key, layer)
    }
}
