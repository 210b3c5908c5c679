//! Shape vocabulary: named axis types, element types and typed host storage.
//!
//! Sizes the compiler can know are types (`Layers<4>`, `Hidden<7168>`); sizes
//! only the running program knows are `usize`. Both implement dfdx's [`Dim`],
//! so one generic code path serves a static job and a `config.json`-driven one.
//! Whatever crosses a boundary (a file, a checkpoint, a device) is checked once
//! on the way in and a mismatch is a [`ShapeError`] naming the axis.

mod dims;
mod element;
mod error;
pub mod fp8;
mod states;

pub use dfdx::shapes::{ConstDim, Dim};
pub use dims::{Hidden, Layers};
pub use element::{bf16_bits, DType, Element};
pub use error::ShapeError;
pub use states::{CapturedStates, ConcatAxis, HiddenAxis, LayerAxis, StatesAxis, StatesView, TokenAxis};

/// Checks that a run-time size matches a dim, naming the axis on mismatch.
pub fn check_dim<D: Dim>(context: &str, axis: &'static str, dim: D, actual: usize) -> Result<(), ShapeError> {
    if dim.size() == actual {
        Ok(())
    } else {
        Err(ShapeError::new(context, axis, dim.size(), actual))
    }
}

/// Builds a dim from a run-time size: `usize` accepts any size, a const dim only its own.
pub fn dim_from_size<D: Dim + Default>(context: &str, axis: &'static str, actual: usize) -> Result<D, ShapeError> {
    // `usize::from_size` never fails, so on failure `D` is a const dim whose
    // `Default` value carries the expected size.
    D::from_size(actual).ok_or_else(|| ShapeError::new(context, axis, D::default().size(), actual))
}
