//! Keys and values kept between steps for samples processed in chunks.

use super::ModelError;
use crate::batch::PackedBatch;
use std::collections::HashMap;

/// Keys and values of one layer for the positions a sample has run so far.
#[derive(Default, Debug)]
pub struct LayerKv {
    pub(crate) k: Vec<f32>,
    pub(crate) v: Vec<f32>,
}

/// Keys/values of samples being processed in chunks, kept between steps.
/// Holds only samples whose last chunk has not run yet.
#[derive(Default, Debug)]
pub struct KvCache {
    entries: HashMap<u64, (usize, Vec<LayerKv>)>,
}

impl KvCache {
    /// Samples with cached positions.
    pub fn len(&self) -> usize {
        self.entries.len()
    }
    /// Whether nothing is cached.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Checks that each continuing segment finds exactly its earlier positions.
    pub(crate) fn check(&mut self, batch: &PackedBatch) -> Result<(), ModelError> {
        for (s, seg) in batch.segments().iter().enumerate() {
            let have = self.entries.get(&seg.key).map_or(0, |e| e.0);
            if seg.uses_cache() && have != seg.pos0 {
                return Err(ModelError::Input {
                    sample: s,
                    problem: format!("chunk starts at position {} but {have} earlier positions are cached", seg.pos0),
                });
            }
        }
        for (s, seg) in batch.segments().iter().enumerate().filter(|(_, g)| g.uses_cache()) {
            self.entries.entry(seg.key).or_default().0 = seg.pos0 + batch.range(s).len();
        }
        Ok(())
    }

    pub(crate) fn layer_mut(&mut self, key: u64, layer: usize) -> &mut LayerKv {
        let layers = &mut self.entries.get_mut(&key).expect("checked").1;
        if layers.len() <= layer {
            layers.resize_with(layer + 1, LayerKv::default);
        }
        &mut layers[layer]
    }

    pub(crate) fn layer(&self, key: u64, layer: usize) -> &LayerKv {
        &self.entries[&key].1[layer]
    }

    /// Drops the samples whose last chunk this batch ran.
    pub(crate) fn retire(&mut self, batch: &PackedBatch) {
        for seg in batch.segments().iter().filter(|g| !g.keep) {
            self.entries.remove(&seg.key);
        }
    }
}
