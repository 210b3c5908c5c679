//! The router of a mixture of experts, as the MoE ops take it.

use crate::hf::moe::{Scoring, TopkMethod};

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
