//! What the host backends (CPU and reference) share: their [`Buffers`],
//! one implementation for both. Activations, weight vectors and the
//! embedding table live in host memory; a capture is a copy. Buffers are
//! allocated as the CPU backend's GEMM wants them (`cpu::panels::zeroed`:
//! huge-page advice on large ones); the reference backend reads them as
//! plain slices, so how they are allocated changes none of its values.

use super::cpu::panels;
use super::{Buffers, EmbeddingInfo, Resident, Tensor, VectorInfo};
use crate::hf::checkpoint::TensorBytes;
use crate::shape::{CapturedStates, DType, Dim};

/// A backend whose buffers are host memory: it has [`Buffers`] through this
/// module's one implementation.
pub trait Host: Send + Sync + Sized + 'static {}

impl<B: Host> Buffers for B {
    type Storage = Vec<f32>;
    type Vector = Vec<f32>;
    type Embedding = Embedding;

    fn alloc(&self, len: usize) -> Vec<f32> {
        panels::zeroed(len)
    }

    fn realloc(&self, s: &mut Vec<f32>, len: usize) {
        if len > s.capacity() {
            // A fresh zeroed allocation instead of a fill pass: the kernel maps
            // its pages as they are first written (and never, for a buffer a
            // fused op leaves unused).
            *s = panels::zeroed(len);
        } else {
            s.resize(len, 0.0);
        }
    }

    fn upload(&self, host: &[f32]) -> Vec<f32> {
        host.to_vec()
    }

    fn download(&self, s: &Vec<f32>, out: &mut [f32]) {
        out.copy_from_slice(s);
    }

    fn vector(&self, v: Vec<f32>) -> Vec<f32> {
        v
    }

    fn embedding(&self, bytes: TensorBytes, dtype: DType, hidden: usize) -> Embedding {
        Embedding::new(bytes, dtype, hidden)
    }

    fn capture_unchecked<L: Dim, H: Dim>(&self, x: &Tensor<Self, H>, out: &mut CapturedStates<L, H>, slot: usize) {
        out.layer_mut(slot).copy_from_slice(x.storage());
    }
}

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

    /// `out[t] = table[ids[t]]`, `[T, hidden]`.
    pub fn lookup(&self, ids: &[u32], out: &mut [f32]) {
        let (h, es) = (self.h, self.dtype.size());
        for (row, &id) in out.chunks_exact_mut(h).zip(ids) {
            let at = id as usize * h * es;
            self.dtype.decode_into(&self.bytes[at..at + h * es], row);
        }
    }
}

impl EmbeddingInfo for Embedding {
    fn hidden(&self) -> usize {
        self.h
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

impl VectorInfo for Vec<f32> {
    fn len(&self) -> usize {
        <[f32]>::len(self)
    }
}
