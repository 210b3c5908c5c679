//! Mixtures of experts ([`MoeOps`]): the router as the ops take it, the
//! routing and the experts' sum.

use super::{check, GatedLinear, Gating, RowOps, Tensor, VectorInfo};
use crate::hf::moe::{Scoring, TopkMethod};
use crate::shape::Dim;

/// What the shape guards need of a step's routes.
pub trait RoutesInfo {
    /// Tokens routed.
    fn tokens(&self) -> usize;
    /// Experts the routes are laid out for, where they are laid out by
    /// expert (the CPU's); `None` where they hold expert ids.
    fn experts(&self) -> Option<usize> {
        None
    }
}

/// A mixture of experts' routing and experts.
pub trait MoeOps: RowOps {
    /// Each token's experts and weights, for one MoE layer of one step.
    type Routes: RoutesInfo;

    /// Each token's top-k experts and weights from the router's logits `[T, E]`
    /// (`correction`: noaux_tc's `e_score_correction_bias`).
    fn moe_route(&self, logits: &Tensor<Self>, router: &Router, correction: Option<&Self::Vector>) -> Self::Routes {
        check::correction(logits, correction.map(VectorInfo::len));
        self.moe_route_unchecked(logits, router, correction)
    }
    /// [`MoeOps::moe_route`], sizes checked.
    fn moe_route_unchecked(
        &self,
        logits: &Tensor<Self>,
        router: &Router,
        correction: Option<&Self::Vector>,
    ) -> Self::Routes;

    /// `out = Σ_k w_k · expert_k(x) + shared(x)` (or, [`Gating::Input`],
    /// `Σ_k expert_k(w_k · x) + shared(x)`), summed over ranks (one all-reduce).
    fn moe_experts<H: Dim>(
        &self,
        experts: &[GatedLinear<Self>],
        shared: Option<&GatedLinear<Self>>,
        x: &Tensor<Self, H>,
        routes: &Self::Routes,
        gating: Gating,
        out: &mut Tensor<Self, H>,
    ) {
        check::shape("moe_experts", "tokens", x.rows(), routes.tokens());
        check::shape("moe_experts", "tokens", x.rows(), out.rows());
        if let Some(e) = routes.experts() {
            check::shape("moe_experts", "experts", experts.len(), e);
        }
        self.moe_experts_unchecked(experts, shared, x, routes, gating, out)
    }
    /// [`MoeOps::moe_experts`], sizes checked.
    fn moe_experts_unchecked<H: Dim>(
        &self,
        experts: &[GatedLinear<Self>],
        shared: Option<&GatedLinear<Self>>,
        x: &Tensor<Self, H>,
        routes: &Self::Routes,
        gating: Gating,
        out: &mut Tensor<Self, H>,
    );
}

/// How an MoE router picks each token's experts (every mode of the DeepSeek family).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Router {
    /// Softmax or sigmoid scores.
    pub scoring: Scoring,
    /// Greedy, group-limited greedy, or noaux_tc.
    pub topk_method: TopkMethod,
    /// Experts per token.
    pub top_k: usize,
    /// Expert groups.
    pub n_group: usize,
    /// Groups kept per token.
    pub topk_group: usize,
    /// Normalise the chosen weights to sum to 1.
    pub norm_topk_prob: bool,
    /// Factor on every routed weight.
    pub routed_scaling_factor: f32,
}

impl Router {
    /// Whether the top-k is taken of the logits rather than of the sigmoid
    /// scores: a sigmoid router with neither groups nor a correction (Llama
    /// 4's, which takes the top-k of its logits, then their sigmoids). The
    /// same choice, as the sigmoid is monotonic, except where f32 sigmoids
    /// round equal (to 1.0 from a logit of about 17): the logits still tell
    /// those apart. The weights are the sigmoids either way.
    pub fn ranks_by_logit(&self, corrected: bool) -> bool {
        self.scoring == Scoring::Sigmoid && self.topk_method == TopkMethod::Greedy && !corrected
    }
}
