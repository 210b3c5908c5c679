//! Strata's integration tests, one binary: each file of `tests/` is a suite
//! (a module), so the library and its dependencies are linked once, not once
//! per suite. A filter selects one suite:
//!
//!     cargo test --features cuda --test integration -- serve::
//!
//! Apart stand trybuild's compile-fail tests (`tests/compile_fail.rs`: they
//! build crates of their own) and nothing else; `scripts/gpu-check.sh` runs
//! this binary's `kernels::` and `cuda_gpu::` suites on a GPU machine.
//!
//! Suites run on threads of one process, so no test changes process-global
//! state (environment variables, signal dispositions, rlimits, allocator
//! settings) in it. Those that need such state set it in a child process:
//! `serve::` sets `RLIMIT_FSIZE` in the server it starts (between fork and
//! exec) and holds its 1100 silent connections from a child of this binary
//! with a raised `RLIMIT_NOFILE`; `hostile_input::` and `hostile_config::`
//! give the `strata` processes they start `RAYON_NUM_THREADS` and
//! `MALLOC_ARENA_MAX`.

mod common;
#[cfg(feature = "cuda")]
mod cuda_emu;
#[cfg(feature = "cuda")]
mod cuda_shapes;

mod accuracy;
mod backends;
mod chat;
mod cuda_backend;
mod cuda_gpu;
mod deepseek;
mod errors;
mod generate;
// The test family's suite: its row is built with the `test-family` feature,
// which this crate's dev-dependency on itself turns on.
#[cfg(feature = "test-family")]
mod family;
mod hostile_config;
mod hostile_dataset;
mod hostile_input;
mod hub_configs;
mod hybrid;
mod interop;
mod kernels;
mod kernels_emulated;
mod parity;
mod parts;
mod pipeline;
#[path = "../proptests/main.rs"]
mod proptests;
mod quant;
mod recompute;
mod reliability;
mod serve;
mod tp;

// The scaled-down founding cases run end to end here (the examples' own
// `tests` modules), not as test binaries of their own.
#[allow(dead_code)]
#[path = "../examples/glm45_air_eagle3.rs"]
mod glm45_air_eagle3;
#[allow(dead_code)]
#[path = "../examples/kimi_k25_eagle3.rs"]
mod kimi_k25_eagle3;
