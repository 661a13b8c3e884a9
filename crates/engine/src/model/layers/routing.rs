//! Expert choice for one token from its router logits: which `top_k` experts, with what weights.

use crate::config::Routing;

/// Indices of the `k` largest values, largest first (ties: lower index first).
fn top_k(values: &[f32], k: usize) -> Vec<usize> {
    let mut idx: Vec<usize> = (0..values.len()).collect();
    idx.sort_by(|&a, &b| values[b].total_cmp(&values[a]).then(a.cmp(&b)));
    idx.truncate(k);
    idx
}

/// `(expert, weight)` pairs for one token.
pub fn route(
    routing: &Routing,
    k: usize,
    logits: &[f32],
    bias: Option<&[f32]>,
) -> Vec<(usize, f32)> {
    match *routing {
        Routing::SoftmaxTopK { norm_topk_prob } => {
            let mut probs = logits.to_vec();
            crate::ops::softmax(&mut probs);
            let chosen = top_k(&probs, k);
            let mut w: Vec<f32> = chosen.iter().map(|&e| probs[e]).collect();
            if norm_topk_prob {
                let s: f32 = w.iter().sum();
                w.iter_mut().for_each(|x| *x /= s);
            }
            chosen.into_iter().zip(w).collect()
        }
        Routing::SigmoidGrouped {
            n_group,
            topk_group,
            norm_topk_prob,
            scaling,
        } => {
            let scores: Vec<f32> = logits.iter().map(|&x| 1.0 / (1.0 + (-x).exp())).collect();
            let mut choice: Vec<f32> = match bias {
                Some(b) => scores.iter().zip(b).map(|(s, b)| s + b).collect(),
                None => scores.clone(),
            };
            let per = choice.len() / n_group;
            if n_group > 1 {
                let group_scores: Vec<f32> = choice
                    .chunks_exact(per)
                    .map(|g| top_k(g, 2).iter().map(|&i| g[i]).sum())
                    .collect();
                let keep = top_k(&group_scores, topk_group);
                for (g, chunk) in choice.chunks_exact_mut(per).enumerate() {
                    if !keep.contains(&g) {
                        chunk.fill(f32::NEG_INFINITY);
                    }
                }
            }
            let chosen = top_k(&choice, k);
            let mut w: Vec<f32> = chosen.iter().map(|&e| scores[e]).collect();
            if norm_topk_prob {
                let s: f32 = w.iter().sum::<f32>() + 1e-20;
                w.iter_mut().for_each(|x| *x /= s);
            }
            w.iter_mut().for_each(|x| *x *= scaling);
            chosen.into_iter().zip(w).collect()
        }
        Routing::SqrtSoftplus { .. } => {
            let scores = sqrt_softplus(logits);
            let choice: Vec<f32> = match bias {
                Some(b) => scores.iter().zip(b).map(|(s, b)| s + b).collect(),
                None => scores.clone(),
            };
            weigh(routing, &scores, top_k(&choice, k))
        }
    }
}

/// `sqrt(softplus(x))` of every logit (softplus as torch computes it: `x` itself above 20).
fn sqrt_softplus(logits: &[f32]) -> Vec<f32> {
    logits
        .iter()
        .map(|&x| crate::ops::softplus(x).sqrt())
        .collect()
}

/// The chosen experts' scores, renormalised and scaled (DeepSeek-V4).
fn weigh(routing: &Routing, scores: &[f32], chosen: Vec<usize>) -> Vec<(usize, f32)> {
    let Routing::SqrtSoftplus { scaling } = *routing else {
        unreachable!("only sqrt-softplus routing weighs given experts")
    };
    let s: f32 = chosen.iter().map(|&e| scores[e]).sum::<f32>() + 1e-20;
    chosen
        .into_iter()
        .map(|e| (e, scores[e] / s * scaling))
        .collect()
}

/// `(expert, weight)` pairs for a token whose experts are given (a hash-routed layer's table
/// entry), weighed by the router's scores as the learned choice is.
pub fn route_fixed(routing: &Routing, logits: &[f32], experts: &[u32]) -> Vec<(usize, f32)> {
    let scores = sqrt_softplus(logits);
    weigh(
        routing,
        &scores,
        experts.iter().map(|&e| e as usize).collect(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn softmax_topk_renormalised_weights_sum_to_one() {
        let r = route(
            &Routing::SoftmaxTopK {
                norm_topk_prob: true,
            },
            3,
            &[0.1, 2.0, -1.0, 1.5, 0.7],
            None,
        );
        assert_eq!(r.iter().map(|x| x.0).collect::<Vec<_>>(), vec![1, 3, 4]);
        assert!((r.iter().map(|x| x.1).sum::<f32>() - 1.0).abs() < 1e-6);
    }

    #[test]
    fn grouped_routing_stays_inside_the_best_group() {
        let routing = Routing::SigmoidGrouped {
            n_group: 2,
            topk_group: 1,
            norm_topk_prob: true,
            scaling: 2.5,
        };
        // Group 0 (experts 0..4) has the single best expert, group 1 the best pair.
        let logits = [5.0, -5.0, -5.0, -5.0, 3.0, 3.0, 0.0, 0.0];
        let r = route(&routing, 3, &logits, Some(&[0.0; 8]));
        assert!(r.iter().all(|(e, _)| *e >= 4), "{r:?}");
        assert!((r.iter().map(|x| x.1).sum::<f32>() - 2.5).abs() < 1e-5);
    }

    #[test]
    fn correction_bias_changes_choice_not_weight() {
        let routing = Routing::SigmoidGrouped {
            n_group: 1,
            topk_group: 1,
            norm_topk_prob: false,
            scaling: 1.0,
        };
        let r = route(&routing, 1, &[1.0, 0.0], Some(&[0.0, 1.0]));
        assert_eq!(r[0].0, 1);
        assert!(
            (r[0].1 - 0.5).abs() < 1e-6,
            "weight is the unbiased sigmoid"
        );
    }
}
