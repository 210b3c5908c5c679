//! What the host backends (CPU and reference) share: weights and tables in
//! host memory.

use super::Resident;
use crate::hf::checkpoint::TensorBytes;
use crate::shape::DType;

/// The embedding table `[vocab, hidden]`, held in its checkpoint dtype (a row
/// is decoded when a token looks it up), so a bf16 table is not doubled in memory.
pub struct Embedding {
    bytes: TensorBytes,
    dtype: DType,
    h: usize,
}

impl Embedding {
    /// Wraps the table's little-endian bytes.
    pub fn new(bytes: TensorBytes, dtype: DType, hidden: usize) -> Self {
        Embedding { bytes, dtype, h: hidden }
    }

    /// The row width.
    pub fn hidden(&self) -> usize {
        self.h
    }

    /// `out[t] = table[ids[t]]`, `[T, hidden]`.
    pub fn lookup(&self, ids: &[u32], out: &mut [f32]) {
        let (h, es) = (self.h, self.dtype.size());
        for (row, &id) in out.chunks_exact_mut(h).zip(ids) {
            let at = id as usize * h * es;
            self.dtype.decode_into(&self.bytes[at..at + h * es], row);
        }
    }
}

impl Resident for Embedding {
    fn resident_bytes(&self) -> usize {
        self.bytes.len()
    }
}

/// Host weight vectors (norms, biases).
impl Resident for Vec<f32> {
    fn resident_bytes(&self) -> usize {
        self.len() * 4
    }
}
