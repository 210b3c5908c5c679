//! The Gated DeltaNet ops' types: the chunk grid, a layer's sizes, and the
//! weights of its recurrence.

use super::Backend;

/// Positions of a sample's Gated DeltaNet chunks: chunk `c` covers
/// positions `64c .. 64c + 63`, however the sample is split into steps
/// (transformers' `chunk_size`). Fixing the grid to positions is what keeps
/// the chunked delta rule bitwise independent of `--max-batch-tokens`.
pub const DELTA_CHUNK: usize = 64;

/// The sizes of a Gated DeltaNet layer on one rank (its share of the heads).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DeltaShape {
    /// Query/key heads.
    pub k_heads: usize,
    /// Value heads, a multiple of `k_heads`: key head `i` serves value heads
    /// `i·r .. (i + 1)·r` with `r = v_heads / k_heads`.
    pub v_heads: usize,
    /// Width of a query/key head.
    pub k_dim: usize,
    /// Width of a value head.
    pub v_dim: usize,
    /// Taps of the depthwise causal conv1d (4).
    pub conv_kernel: usize,
}

impl DeltaShape {
    /// Channels of the conv1d: `[q | k | v]`, `2·k_heads·k_dim + v_heads·v_dim`.
    pub fn channels(&self) -> usize {
        2 * self.k_heads * self.k_dim + self.v_heads * self.v_dim
    }

    /// Bytes of sequence state one sample keeps in one layer between steps,
    /// at most: the recurrent state `[v_heads, k_dim, v_dim]` (32 × 128 × 128
    /// × 4 B = 2 MiB for Qwen3-Next), the conv's last `conv_kernel - 1`
    /// inputs, and the prepared rows of a chunk a step left unfinished (up to
    /// 63; counted as `DELTA_CHUNK`), all f32. The CUDA backend keeps two
    /// buffers of those rows (one read, one written per step).
    pub fn state_bytes(&self) -> usize {
        let recurrent = self.v_heads * self.k_dim * self.v_dim;
        let conv = (self.conv_kernel - 1) * self.channels();
        let rows = DELTA_CHUNK * (self.channels() + 2 * self.v_heads);
        4 * (recurrent + conv + rows)
    }
}

/// A Gated DeltaNet layer's weights of the recurrence, as
/// [`Backend::gated_delta_rule`] takes them (this rank's heads).
pub struct DeltaRule<'a, B: Backend> {
    /// The sizes.
    pub shape: DeltaShape,
    /// `A_log`, `[v_heads]`: the decay of value head `h` at a token is
    /// `g = -exp(A_log[h]) · softplus(a + dt_bias[h])`, in log space.
    pub a_log: &'a B::Vector,
    /// `dt_bias`, `[v_heads]`.
    pub dt_bias: &'a B::Vector,
    /// The gated RMSNorm's weight, `[v_dim]` (plain: `w`, not `1 + w`).
    pub norm: &'a B::Vector,
    /// Its epsilon.
    pub eps: f32,
}
