//! How a mixture of experts routes tokens, as configs name it: the vocabulary
//! shared by the family configs that have experts and the backends that route.

/// How router scores are made from logits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Scoring {
    /// DeepSeek-V2.
    Softmax,
    /// DeepSeek-V3, Kimi-K2.
    Sigmoid,
}

/// How the top-k experts are chosen.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TopkMethod {
    /// The k best scores.
    Greedy,
    /// Best `topk_group` groups by their best score, then the k best in them (V2).
    GroupLimitedGreedy,
    /// Scores plus `e_score_correction_bias`; groups ranked by the sum of their
    /// two best; weights from the unbiased scores (V3).
    NoauxTc,
}
