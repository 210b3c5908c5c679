//! Strata: shape-verified hidden-state extraction from transformer LLMs.
//!
//! The data flows one way: a [`source`] of samples is packed into a
//! [`batch::PackedBatch`], a [`model`] runs it and fills the requested
//! [`capture`] points into typed `[L, T, H]` [`shape::CapturedStates`],
//! which a [`sink`] writes to disk. [`extract`] composes them for the CLI.

#![warn(missing_docs)]

pub mod batch;
pub mod capture;
pub mod checkpoint;
pub mod config;
pub mod cpu;
pub mod dataset;
pub mod embedded;
pub mod extract;
pub mod gather;
pub mod inspect;
pub mod manifest;
pub mod model;
pub mod pipeline;
pub mod quant;
pub mod schedule;
pub mod shape;
pub mod sink;
pub mod source;
pub mod stats;
pub mod synth;
pub mod tp;
pub mod verify;
