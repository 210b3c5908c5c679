//! Mixture of experts on the CPU: routing each token to its experts (every
//! scoring and grouping mode of the DeepSeek family), then running each
//! expert over the rows routed to it.

use super::linear::PackedLinear;
use super::ops::glu;
use crate::backend::{Gating, Glu, Router};
use crate::hf::moe::{Scoring, TopkMethod};
use rayon::prelude::*;

/// Per expert, the tokens routed to it and their weights, in token order
/// (`routes[e]`), and how many tokens were routed.
pub struct Routes {
    by_expert: Vec<Vec<(usize, f32)>>,
    tokens: usize,
}

impl std::ops::Deref for Routes {
    type Target = [Vec<(usize, f32)>];
    fn deref(&self) -> &Self::Target {
        &self.by_expert
    }
}

impl crate::backend::RoutesInfo for Routes {
    fn tokens(&self) -> usize {
        self.tokens
    }
    fn experts(&self) -> Option<usize> {
        Some(self.by_expert.len())
    }
}

/// Routes every token of `logits` (`[T, E]`); `correction` is noaux_tc's
/// `e_score_correction_bias`, added to the scores for the choice only.
pub fn route(logits: &[f32], e: usize, r: &Router, correction: Option<&[f32]>) -> Routes {
    let per_group = e / r.n_group;
    let mut routes = vec![Vec::new(); e];
    let mut scores = vec![0f32; e];
    let mut choice = vec![0f32; e];
    let mut order: Vec<usize> = Vec::with_capacity(e);
    let by_logit = r.ranks_by_logit(correction.is_some());
    for (tok, logits) in logits.chunks_exact(e).enumerate() {
        match r.scoring {
            Scoring::Sigmoid => scores.iter_mut().zip(logits).for_each(|(s, l)| *s = 1.0 / (1.0 + (-l).exp())),
            Scoring::Softmax => {
                let max = logits.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
                let z: f32 = logits.iter().map(|l| (l - max).exp()).sum();
                scores.iter_mut().zip(logits).for_each(|(s, l)| *s = (l - max).exp() / z);
            }
        }
        if by_logit {
            choice.copy_from_slice(logits);
        } else {
            choice.copy_from_slice(&scores);
        }
        if let Some(b) = correction {
            choice.iter_mut().zip(b).for_each(|(c, b)| *c += b);
        }
        if r.topk_method != TopkMethod::Greedy && r.n_group > 1 {
            let group_score = |g: usize| -> f32 {
                let grp = &choice[g * per_group..(g + 1) * per_group];
                if r.topk_method == TopkMethod::NoauxTc {
                    let (mut a, mut b) = (f32::NEG_INFINITY, f32::NEG_INFINITY);
                    for &v in grp {
                        if v > a {
                            b = a;
                            a = v;
                        } else if v > b {
                            b = v;
                        }
                    }
                    a + b
                } else {
                    grp.iter().cloned().fold(f32::NEG_INFINITY, f32::max)
                }
            };
            let mut groups: Vec<(usize, f32)> = (0..r.n_group).map(|g| (g, group_score(g))).collect();
            groups.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
            for &(g, _) in &groups[r.topk_group..] {
                // Masked like HF: -inf for noaux_tc choice, 0 for group_limited_greedy scores.
                let fill = if r.topk_method == TopkMethod::NoauxTc { f32::NEG_INFINITY } else { 0.0 };
                choice[g * per_group..(g + 1) * per_group].fill(fill);
            }
        }
        order.clear();
        order.extend(0..e);
        order.sort_by(|&a, &b| choice[b].total_cmp(&choice[a]).then(a.cmp(&b)));
        let picked = &order[..r.top_k];
        let weight = |i: usize| if r.topk_method == TopkMethod::NoauxTc || by_logit { scores[i] } else { choice[i] };
        let denom = if r.norm_topk_prob { picked.iter().map(|&i| weight(i)).sum::<f32>() + 1e-20 } else { 1.0 };
        for &i in picked {
            routes[i].push((tok, weight(i) / denom * r.routed_scaling_factor));
        }
    }
    Routes { by_expert: routes, tokens: logits.len() / e.max(1) }
}

/// One expert's gate/up and down GEMMs, the activation between them, and
/// a bias `[h]` to add to its output outside the down GEMM (a row-parallel
/// bias, which one rank of several adds: the all-reduce then counts it once).
pub type Expert<'a> = (&'a PackedLinear, &'a PackedLinear, Glu, Option<&'a [f32]>);

/// Working buffers of one MoE layer.
#[derive(Default)]
struct Scratch {
    rows: Vec<f32>,
    gu: Vec<f32>,
    act: Vec<f32>,
    eout: Vec<f32>,
}

/// `out = down(act(gate(x), up(x)))` for `t` rows; with `split`, each GEMM
/// is split over the threads, else it runs on this one (inside a parallel task).
#[allow(clippy::too_many_arguments)]
pub fn gated(
    (gate_up, down, act_fn, post_bias): Expert<'_>,
    x: &[f32],
    t: usize,
    gu: &mut Vec<f32>,
    act: &mut Vec<f32>,
    out: &mut [f32],
    split: bool,
) {
    let inter = gate_up.out_features() / 2;
    gu.resize(t * 2 * inter, 0.0);
    act.resize(t * inter, 0.0);
    gate_up.forward_split(x, t, gu, false, split);
    glu(act_fn, gu, inter, act);
    down.forward_split(act, t, out, false, split);
    if let Some(b) = post_bias {
        out[..t * b.len()].chunks_exact_mut(b.len()).for_each(|row| row.iter_mut().zip(b).for_each(|(o, b)| *o += b));
    }
}

/// `out = Σ_e Σ_(tok, w) w · expert_e(x[tok]) + shared(x)` for the `[T, h]`
/// rows of `x` (this rank's part of every expert); with [`Gating::Input`],
/// `expert_e(w · x[tok])` (each row scaled in f32 as it is gathered). The experts run in
/// parallel, one per task, each over all the rows routed to it (a few
/// hundred rows: one GEMM per expert keeps its weights' packing and the
/// task's A block whole); their outputs are then added in expert index
/// order, token order within, so the sum does not depend on the threads.
pub fn experts(
    experts: &[Expert<'_>],
    shared: Option<Expert<'_>>,
    x: &[f32],
    h: usize,
    routes: &Routes,
    gating: Gating,
    out: &mut [f32],
) {
    let t = x.len() / h;
    let active: Vec<usize> = (0..experts.len()).filter(|&e| !routes[e].is_empty()).collect();
    // With at least as many experts as threads, each expert's GEMMs stay on
    // its task; with fewer (a small step), they are split over the threads too.
    let split = active.len() < rayon::current_num_threads();
    // [n_e, h] outputs of each active expert.
    let outs: Vec<Vec<f32>> = active
        .par_iter()
        .map_init(Scratch::default, |s, &e| {
            let tokens = &routes[e];
            let n = tokens.len();
            s.rows.resize(n * h, 0.0);
            for (dst, &(tok, w)) in s.rows.chunks_exact_mut(h).zip(tokens) {
                let src = &x[tok * h..(tok + 1) * h];
                match gating {
                    Gating::Output => dst.copy_from_slice(src),
                    Gating::Input => dst.iter_mut().zip(src).for_each(|(d, v)| *d = v * w),
                }
            }
            let mut eout = vec![0f32; n * h];
            gated(experts[e], &s.rows, n, &mut s.gu, &mut s.act, &mut eout, split);
            eout
        })
        .collect();
    out[..t * h].fill(0.0);
    for (&e, eout) in active.iter().zip(&outs) {
        for (src, &(tok, w)) in eout.chunks_exact(h).zip(&routes[e]) {
            let dst = &mut out[tok * h..(tok + 1) * h];
            match gating {
                Gating::Output => dst.iter_mut().zip(src).for_each(|(o, v)| *o += v * w),
                Gating::Input => dst.iter_mut().zip(src).for_each(|(o, v)| *o += v),
            }
        }
    }
    if let Some(shared) = shared {
        let s = &mut Scratch::default();
        s.eout.resize(t * h, 0.0);
        gated(shared, x, t, &mut s.gu, &mut s.act, &mut s.eout, true);
        out.iter_mut().zip(&s.eout).for_each(|(o, v)| *o += v);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_plain_sigmoid_router_ranks_logits_its_f32_sigmoids_cannot_tell_apart() {
        // sigmoid(20), sigmoid(25) and sigmoid(30) all round to 1.0 in f32.
        let r = Router {
            scoring: Scoring::Sigmoid,
            topk_method: TopkMethod::Greedy,
            top_k: 2,
            n_group: 1,
            topk_group: 1,
            norm_topk_prob: false,
            routed_scaling_factor: 1.0,
        };
        let routes = route(&[20.0, 30.0, 25.0, 0.0], 4, &r, None);
        let picked: Vec<usize> = (0..4).filter(|&e| !routes[e].is_empty()).collect();
        assert_eq!(picked, vec![1, 2], "the two largest logits, not the lowest indices among equal sigmoids");
        assert_eq!(routes[1], vec![(0, 1.0)], "the weight is the sigmoid");
    }
}
