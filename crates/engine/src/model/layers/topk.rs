//! The DSA indexer's top-k: which `k` of a query's scored positions it attends over.

/// The positions of the `k` highest `scores` (all of them when there are at most `k`), in
/// increasing order. Ties at the cut go to the earlier position.
pub fn select(scores: &[f32], k: usize) -> Vec<usize> {
    let mut order: Vec<usize> = (0..scores.len()).collect();
    if scores.len() > k {
        order.sort_by(|&a, &b| scores[b].total_cmp(&scores[a]).then(a.cmp(&b)));
        order.truncate(k);
        order.sort_unstable();
    }
    order
}

#[cfg(test)]
mod tests {
    use super::select;

    #[test]
    fn keeps_the_k_best_in_position_order() {
        let s = [0.5, -1.0, 3.0, 0.25, 2.0, -0.5];
        assert_eq!(select(&s, 3), [0, 2, 4]);
        assert_eq!(select(&s, 1), [2]);
        // A history no longer than k is kept whole.
        assert_eq!(select(&s, 6), [0, 1, 2, 3, 4, 5]);
        assert_eq!(select(&s[..2], 7), [0, 1]);
    }

    #[test]
    fn ties_at_the_cut_go_to_the_earlier_position() {
        // relu zeroes many scores: ties at 0 are the common case when a query scores fewer
        // than k positions above it.
        let s = [0.0, 1.0, 0.0, 0.0, -2.0, 0.0];
        assert_eq!(select(&s, 3), [0, 1, 2]);
        assert_eq!(select(&s, 4), [0, 1, 2, 3]);
    }
}
