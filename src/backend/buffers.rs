//! Device storage: activation buffers, weight vectors and the embedding
//! table, and the copy of a captured buffer to the host. The two host
//! backends share one implementation of it ([`super::host`]).

use super::{check, PendingCopies, Resident, Tensor};
use crate::hf::checkpoint::TensorBytes;
use crate::shape::{CapturedStates, DType, Dim, ShapeError};

/// What the shape guards need of a weight vector.
pub trait VectorInfo: Resident + Send + Sync {
    /// Values held.
    fn len(&self) -> usize;
    /// Whether it holds no value.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// What the shape guards need of an embedding table.
pub trait EmbeddingInfo: Resident + Send + Sync {
    /// The row width (the hidden dim).
    fn hidden(&self) -> usize;
}

/// A backend's storage: where activations, weight vectors and the embedding
/// table live, and how values cross to and from the host.
pub trait Buffers: Send + Sync + Sized + 'static {
    /// Storage of one activation buffer.
    type Storage: Send + Sync;
    /// A weight vector (norm weight, router bias), on the device.
    type Vector: VectorInfo;
    /// The token embedding table.
    type Embedding: EmbeddingInfo;

    /// Zero-filled storage of `len` values.
    fn alloc(&self, len: usize) -> Self::Storage;
    /// Resizes storage to `len` values, keeping its allocation where it can;
    /// the contents are unspecified (every op overwrites its output).
    fn realloc(&self, s: &mut Self::Storage, len: usize);
    /// Copies host values to a new storage.
    fn upload(&self, host: &[f32]) -> Self::Storage;
    /// Copies storage back to the host; `out` has exactly its length.
    fn download(&self, s: &Self::Storage, out: &mut [f32]);

    /// A weight vector.
    fn vector(&self, v: Vec<f32>) -> Self::Vector;
    /// The embedding table `[vocab, hidden]`, as stored (`dtype` little-endian bytes).
    fn embedding(&self, bytes: TensorBytes, dtype: DType, hidden: usize) -> Self::Embedding;

    /// Copies the whole `[T, H]` buffer into slot `slot` of host `[L, T, H]`
    /// states: at once on a host backend; a device backend copies
    /// asynchronously, while the forward goes on, and completes the copy
    /// through what [`Buffers::capture_take`] returns.
    fn capture<L: Dim, H: Dim>(
        &self,
        x: &Tensor<Self, H>,
        out: &mut CapturedStates<L, H>,
        slot: usize,
    ) -> Result<(), ShapeError> {
        check::capture(x.rows(), x.width().size(), out, slot)?;
        self.capture_unchecked(x, out, slot);
        Ok(())
    }
    /// [`Buffers::capture`] once the sizes are checked: what a backend implements.
    fn capture_unchecked<L: Dim, H: Dim>(&self, x: &Tensor<Self, H>, out: &mut CapturedStates<L, H>, slot: usize);
    /// Takes a step's captures still on their way to the host: called once
    /// per step on a capturing rank, after its last [`Buffers::capture`] into
    /// `out`. Running the result on `out`'s values after the step ends
    /// ([`super::DeviceOps::end_step`]) completes them, on any thread (the
    /// pipeline's writer does it while the next step runs). `None`: nothing
    /// is pending (host backends copied already).
    fn capture_take<L: Dim, H: Dim>(&self, _out: &CapturedStates<L, H>) -> Option<PendingCopies> {
        None
    }
}
