//! Activation buffers on a backend's device, `[rows, W]`, typed like host storage.

use super::Buffers;
use crate::shape::{check_dim, Dim, ShapeError};

/// An activation buffer `[rows, W]` held by backend `B`: the residual stream
/// is a `Tensor<B, H>` (`H` the model's hidden dim), working buffers are
/// `Tensor<B>` with a run-time width. Sizes are checked where host data
/// enters or leaves ([`from_host`](Self::from_host), [`Buffers::capture`]).
pub struct Tensor<B: Buffers, W: Dim = usize> {
    rows: usize,
    width: W,
    storage: B::Storage,
}

impl<B: Buffers, W: Dim> Tensor<B, W> {
    /// A zero-filled `[rows, width]` buffer.
    pub fn zeros(b: &B, rows: usize, width: W) -> Self {
        Tensor { rows, width, storage: b.alloc(rows * width.size()) }
    }

    /// An empty buffer of width `width`, to be [`resize`](Self::resize)d by a step.
    pub fn empty(b: &B, width: W) -> Self {
        Self::zeros(b, 0, width)
    }

    /// Copies host values `[rows, width]` to the device, checking their count.
    pub fn from_host(b: &B, data: &[f32], rows: usize, width: W) -> Result<Self, ShapeError> {
        if data.len() != rows * width.size() {
            return Err(ShapeError::new("tensor from host", "elements", rows * width.size(), data.len()));
        }
        Ok(Tensor { rows, width, storage: b.upload(data) })
    }

    /// Copies the buffer to the host, `[rows, width]` row-major.
    pub fn to_host(&self, b: &B) -> Vec<f32> {
        let mut out = vec![0f32; self.len()];
        b.download(&self.storage, &mut out);
        out
    }

    /// Makes this a `[rows, width]` buffer, reusing its allocation; contents unspecified.
    pub fn resize(&mut self, b: &B, rows: usize, width: W) {
        self.rows = rows;
        self.width = width;
        b.realloc(&mut self.storage, rows * width.size());
    }

    /// Rows (tokens).
    pub fn rows(&self) -> usize {
        self.rows
    }
    /// The width dim.
    pub fn width(&self) -> W {
        self.width
    }
    /// Values held: `rows · width`.
    pub fn len(&self) -> usize {
        self.rows * self.width.size()
    }
    /// Whether the buffer holds no values.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// The backend's storage (for the backend's own kernels).
    pub fn storage(&self) -> &B::Storage {
        &self.storage
    }
    /// The backend's storage, mutable.
    pub fn storage_mut(&mut self) -> &mut B::Storage {
        &mut self.storage
    }

    /// Every column.
    pub fn all(&self) -> Cols<'_, B> {
        let w = self.width.size();
        Cols { storage: &self.storage, rows: self.rows, stride: w, offset: 0, width: w }
    }

    /// Columns `offset .. offset + width` of every row.
    ///
    /// # Panics
    /// If the block does not fit the buffer's width: a bug in the model code, not in its input.
    pub fn cols(&self, offset: usize, width: usize) -> Cols<'_, B> {
        let w = self.width.size();
        assert!(offset + width <= w, "column block {offset}..{} of a width-{w} tensor", offset + width);
        Cols { storage: &self.storage, rows: self.rows, stride: w, offset, width }
    }

    /// Checks the buffer's shape against an expected one, naming the axis.
    pub fn check(&self, context: &str, rows: usize, width: W) -> Result<(), ShapeError> {
        check_dim(context, "tokens", rows, self.rows)?;
        check_dim(context, "width", width, self.width.size())
    }
}

/// A block of columns of every row of a [`Tensor`]: row `r`, column `c` of
/// the block is element `r · stride + offset + c` of its storage.
pub struct Cols<'a, B: Buffers> {
    /// The tensor's storage.
    pub storage: &'a B::Storage,
    /// Rows.
    pub rows: usize,
    /// The tensor's width.
    pub stride: usize,
    /// First column of the block.
    pub offset: usize,
    /// Columns in the block.
    pub width: usize,
}

impl<B: Buffers> Clone for Cols<'_, B> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<B: Buffers> Copy for Cols<'_, B> {}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::{Backend, Cpu, Reference};
    use crate::shape::Hidden;

    fn round_trip<B: Backend>(b: &B) {
        let data: Vec<f32> = (0..12).map(|i| i as f32).collect();
        let t = Tensor::<B, Hidden<4>>::from_host(b, &data, 3, Hidden).unwrap();
        assert_eq!((t.rows(), t.len()), (3, 12));
        assert_eq!(t.to_host(b), data);
        assert!(t.check("t", 3, Hidden).is_ok());
        let e = Tensor::<B, Hidden<4>>::from_host(b, &data[..10], 3, Hidden).err().unwrap();
        assert_eq!(e.to_string(), "tensor from host: axis elements: expected 12, got 10");
        let e = Tensor::<B>::from_host(b, &data, 4, 3).unwrap().check("q", 4, 6).unwrap_err();
        assert_eq!((e.axis, e.expected, e.actual), ("width", 6, 3));
        let c = t.cols(1, 2);
        assert_eq!((c.rows, c.stride, c.offset, c.width), (3, 4, 1, 2));
    }

    #[test]
    fn host_copies_are_checked_on_every_backend() {
        round_trip(&Cpu::<crate::backend::F32>::default());
        round_trip(&Cpu::<crate::backend::Bf16>::default());
        round_trip(&Reference);
    }
}
