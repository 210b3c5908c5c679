//! What weights are to a backend: linear layers as the device holds them
//! ([`Weights`]), how a linear layer splits over ranks, the memory a weight
//! holds, and a gated MLP's weights and activation.

use super::DeviceOps;
use crate::hf::quant::{LinearWeight, QuantKind};

/// A backend's linear layers: a checkpoint's weight made into the form its
/// GEMMs read (packed panels, device copies, or as stored).
pub trait Weights: DeviceOps {
    /// A linear layer `y = x·Wᵀ + b`, in its [`Parallel`] kind.
    type Linear: LinearInfo;

    /// A linear layer from this rank's block of a weight, as stored (f32,
    /// bf16, FP8 blocks or INT4 groups), with an optional bias `[rows]` of the
    /// whole layer (row-parallel) or of this rank's rows (column-parallel).
    fn linear(&self, w: LinearWeight, bias: Option<Vec<f32>>, kind: Parallel) -> Self::Linear;

    /// [`linear`](Self::linear) computed with f32 inputs whatever the compute
    /// dtype (the MoE router). The default is `linear`, for f32-only backends.
    fn linear_f32(&self, w: LinearWeight, bias: Option<Vec<f32>>, kind: Parallel) -> Self::Linear {
        self.linear(w, bias, kind)
    }

    /// Builds `n` weights with `f(i)` on threads of the backend's choosing
    /// (a layer's hundreds of experts: the CPU backend packs them in
    /// parallel). The default builds them in order on the calling thread.
    fn build_many<T: Send, E: Send>(
        &self,
        n: usize,
        f: impl Fn(usize) -> Result<T, E> + Sync + Send,
    ) -> Result<Vec<T>, E> {
        (0..n).map(f).collect()
    }
}

/// How a linear layer is split over tensor-parallel ranks (mistral.rs'
/// `DistributedKind`): a property of the layer, so a forward never mentions ranks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Parallel {
    /// Every rank holds the whole weight and computes the whole output.
    Replicated,
    /// Each rank holds a block of output rows; its output is its own columns.
    Column,
    /// Each rank holds a block of input columns; partial outputs are summed
    /// over ranks (all-reduce, in rank order) and the bias added once.
    Row,
}

/// Memory a weight holds.
pub trait Resident {
    /// Bytes held (quantised weights as codes and scales).
    fn resident_bytes(&self) -> usize;
}

/// What a backend's linear layer tells about itself.
pub trait LinearInfo: Resident + Send + Sync {
    /// Output width on this rank.
    fn out_features(&self) -> usize;
    /// Input width on this rank.
    fn in_features(&self) -> usize;
    /// The codes the weight is held as (FP8, INT4, bf16); `None` for f32.
    fn held_as(&self) -> Option<QuantKind>;
}

/// The gated activation of an MLP, `act(gate, up)` of `[gate | up]`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Glu {
    /// SwiGLU, `silu(gate) · up` (Llama, DeepSeek).
    Silu,
    /// `gelu_tanh(gate) · up`, GELU's tanh approximation
    /// `g/2 · (1 + tanh(√(2/π) · (g + 0.044715·g³)))` (PyTorch's
    /// `gelu(approximate="tanh")`, Gemma's MLP).
    GeluTanh,
    /// gpt-oss's clamped GLU: `g = min(gate, limit)`, `u = clamp(up, ±limit)`,
    /// `(u + 1) · g · σ(alpha · g)`.
    Clamped {
        /// `swiglu_alpha`.
        alpha: f32,
        /// `swiglu_limit`.
        limit: f32,
    },
}

impl Glu {
    /// `act(gate, up)` of one element, in f32 (the definition every backend follows).
    pub fn apply(self, g: f32, u: f32) -> f32 {
        match self {
            Glu::Silu => g / (1.0 + (-g).exp()) * u,
            Glu::GeluTanh => {
                let inner = 0.797_884_6 * (g + 0.044715 * g * g * g);
                g / (1.0 + (-2.0 * inner).exp()) * u
            }
            Glu::Clamped { alpha, limit } => {
                let (g, u) = (g.min(limit), u.clamp(-limit, limit));
                (u + 1.0) * (g / (1.0 + (-alpha * g).exp()))
            }
        }
    }
}

/// A gated MLP's weights: `down_proj(act(gate, up))` of `[gate | up] = gate_up_proj(x)`.
/// Used for routed and shared experts, whose partial outputs the MoE op sums
/// before one all-reduce.
pub struct GatedLinear<B: Weights> {
    /// `gate_proj` and `up_proj` stacked: `[2·inter, hidden]` (column-parallel).
    pub gate_up_proj: B::Linear,
    /// `down_proj`: `[hidden, inter]` (row-parallel).
    pub down_proj: B::Linear,
    /// The activation between them.
    pub act: Glu,
}

impl<B: Weights> Resident for GatedLinear<B> {
    fn resident_bytes(&self) -> usize {
        self.gate_up_proj.resident_bytes() + self.down_proj.resident_bytes()
    }
}
