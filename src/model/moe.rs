//! The mixture-of-experts block every MoE family shares, as the backends
//! run it: a router GEMM kept in f32, the backend's top-k choice
//! ([`Router`]), the routed experts' gated MLPs over the rows each received
//! and the shared experts over every row, summed by one all-reduce.
//! A family's model file reads the weights under its own names and builds a
//! [`Moe`]; this file never names a checkpoint tensor.

use crate::backend::{Backend, GatedLinear, Gating, Resident, Router, Tensor};
use crate::shape::Dim;

/// A mixture of experts of one layer (this rank's slice of every expert).
pub struct Moe<B: Backend> {
    /// The router: `[experts, hidden]`, replicated, f32 inputs.
    pub gate: B::Linear,
    /// noaux_tc's bias on the scores, for the choice only.
    pub e_score_correction_bias: Option<B::Vector>,
    /// How the top-k experts and their weights are chosen.
    pub router: Router,
    /// The routed experts.
    pub experts: Vec<GatedLinear<B>>,
    /// The shared experts, over every token (DeepSeek), if any.
    pub shared_experts: Option<GatedLinear<B>>,
    /// Where the router's weights apply: the experts' outputs, or (Llama 4) their inputs.
    pub gating: Gating,
}

impl<B: Backend> Moe<B> {
    /// `out = Σ_topk w_e · experts[e](h) + shared_experts(h)` (or `experts[e](w_e · h)`,
    /// [`Gating::Input`]); `logits` `[T, experts]` is the router's output.
    pub fn forward<H: Dim>(&self, b: &B, h: &Tensor<B, H>, out: &mut Tensor<B, H>, logits: &mut Tensor<B>) {
        logits.resize(b, h.rows(), self.experts.len());
        b.linear_forward(&self.gate, h, logits);
        let routes = b.moe_route(logits, &self.router, self.e_score_correction_bias.as_ref());
        b.moe_experts(&self.experts, self.shared_experts.as_ref(), h, &routes, self.gating, out);
    }

    /// Every linear layer: the router, then each expert's gate/up and down.
    pub fn linears(&self) -> Vec<&B::Linear> {
        let mut out = vec![&self.gate];
        out.extend(self.experts.iter().chain(self.shared_experts.iter()).flat_map(|m| [&m.gate_up_proj, &m.down_proj]));
        out
    }

    /// Bytes the block's weights hold.
    pub fn weight_bytes(&self) -> usize {
        let bias = self.e_score_correction_bias.as_ref().map_or(0, |v| v.resident_bytes());
        bias + self.linears().iter().map(|l| l.resident_bytes()).sum::<usize>()
    }
}
