//! Keys and values kept in host memory between the steps of samples
//! processed in chunks (the CPU and reference backends' KV cache).

use super::{BackendError, KvStore};
use crate::pipeline::batch::PackedBatch;
use std::collections::HashMap;

/// Keys and values of one layer for the positions a sample has run so far.
#[derive(Default, Debug)]
pub(crate) struct LayerKv {
    pub(crate) k: Vec<f32>,
    pub(crate) v: Vec<f32>,
}

/// Keys/values of samples being processed in chunks, kept between steps.
/// Holds only samples whose last chunk has not run yet.
#[derive(Default, Debug)]
pub struct KvCache {
    entries: HashMap<u64, (usize, Vec<LayerKv>)>,
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

impl KvStore for KvCache {
    fn len(&self) -> usize {
        self.entries.len()
    }

    fn begin(&mut self, batch: &PackedBatch) -> Result<(), BackendError> {
        check_continuations(batch, |key| self.entries.get(&key).map_or(0, |e| e.0))?;
        for (s, seg) in batch.segments().iter().enumerate().filter(|(_, g)| g.uses_cache()) {
            self.entries.entry(seg.key).or_default().0 = seg.pos0 + batch.range(s).len();
        }
        Ok(())
    }

    fn retire(&mut self, batch: &PackedBatch) {
        for seg in batch.segments().iter().filter(|g| !g.keep) {
            self.entries.remove(&seg.key);
        }
    }
}

impl KvCache {
    /// Layer `layer` of sample `key` (which [`KvStore::begin`] has registered), to append to.
    pub(crate) fn layer_mut(&mut self, key: u64, layer: usize) -> &mut LayerKv {
        let layers = &mut self.entries.get_mut(&key).expect("checked").1;
        if layers.len() <= layer {
            layers.resize_with(layer + 1, LayerKv::default);
        }
        &mut layers[layer]
    }

    /// Layer `layer` of sample `key`.
    pub(crate) fn layer(&self, key: u64, layer: usize) -> &LayerKv {
        &self.entries[&key].1[layer]
    }
}
