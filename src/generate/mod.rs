//! Generation: the target model writes its own responses, and their hidden
//! states are captured in the same pass.
//!
//! - [`sampling`]: how a token is chosen from a row of logits, as vLLM's V1
//!   sampler chooses it, with draws keyed by (seed, record, generation,
//!   position) so that tokens never depend on batching;
//! - [`config`]: a checkpoint's `generation_config.json` as vLLM reads it;
//! - [`conversation`]: multi-turn regeneration as speculators' tool runs it
//!   against vLLM (turns, cached tool results, where a conversation stops);
//! - [`decode`]: the loop that runs sequences to completion, prefill chunks
//!   and decode tokens sharing each step.

pub mod config;
pub mod conversation;
pub mod decode;
pub mod sampling;

pub use config::{AskedSampling, GenerationDefaults};
pub use decode::{generate, CacheCost, Decode, DecodeOptions, DecodeStats, Finish, Generated, Sequence, StepSegment};
pub use sampling::{draw_seed, DrawKey, History, Sampler, SamplingError, SamplingParams};
