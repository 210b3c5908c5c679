//! The data's way through an extraction job, stage by stage:
//!
//! ```text
//! source ─► schedule ─► (model) ─► capture ─► gather ─► (sink)
//! ```
//!
//! - [`source`]: samples (token ids, loss mask, id) streamed from JSON Lines;
//! - [`schedule`]: samples packed into steps of a token budget ([`batch`]),
//!   long ones split across steps (chunked prefill);
//! - the model ([`crate::model`]) runs a step and fills the [`capture`] points;
//! - [`gather`]: each sample's `[L, T, H]` states cut out of the step, or
//!   reassembled from its chunks;
//! - the sink ([`crate::sink`]) writes them.
//!
//! `crate::job::Pipeline` composes the stages with a model and a sink.

pub mod batch;
pub mod capture;
pub mod gather;
pub mod schedule;
pub mod source;
