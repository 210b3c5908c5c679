//! Each kernel of `kernels/` declared once: `build.rs` reads the
//! `extern "C" __global__` signatures of the `.cu` files and generates, here,
//! a typed launcher per kernel (one Rust parameter per C parameter, so a
//! launch that passes the wrong arguments does not compile), the C header of
//! prototypes every source is compiled with ([`PROTOTYPES`]), and the CPU
//! emulation's entries ([`EMULATOR_ENTRIES`]).
#![allow(clippy::too_many_arguments)]

use super::device::{Arg, DevPtr, Device, Launch};
use super::CudaError;

include!(concat!(env!("OUT_DIR"), "/kernels.rs"));
