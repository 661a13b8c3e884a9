//! Replacement policy of the expert cache: LRU lists over cache slots, either one list for all
//! layers ([`Policy::GlobalLru`]) or one per MoE layer over a fixed share of the slots
//! ([`Policy::PerLayerLru`]), and a trace simulator that compares them (`simulate`).
//!
//! The lists are intrusive (index-linked arrays), so a touch or an eviction is O(1) whatever the
//! number of slots (GLM-4.5-Air has 5,888 expert records).

use std::collections::HashMap;

use serde::{Deserialize, Serialize};

/// Which cached expert makes room for a new one.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Policy {
    /// The least recently used expert of any layer. Adapts the share of each layer to how
    /// varied its routing is (measured better, see docs/PERFORMANCE.md "Tiered experts").
    /// When the cache holds fewer records than one token uses (MoE layers x top_k), plain LRU
    /// evicts every record before its next use (a cyclic scan); it then inserts as
    /// [`Policy::GlobalLruFreq`] does.
    GlobalLru,
    /// The least recently used expert of the same layer; every MoE layer gets an equal share.
    PerLayerLru,
    /// Global LRU with frequency-aware insertion: a missed record that has been requested less
    /// often than the one it replaces goes to the cold end of the list (the next to go), so rare
    /// experts cycle through a few slots while frequent ones stay. Avoids LRU's collapse when
    /// the cache is smaller than what one token touches across all layers (a cyclic scan).
    GlobalLruFreq,
}

/// Whether misses are inserted by frequency (see [`Policy::GlobalLruFreq`]).
pub(crate) fn freq_insert(policy: Policy, cache_slots: usize, layers: usize, top_k: usize) -> bool {
    match policy {
        Policy::GlobalLruFreq => true,
        Policy::GlobalLru => cache_slots < layers * top_k,
        Policy::PerLayerLru => false,
    }
}

/// Records a frequency-inserting cache keeps hot: the rest of the slots take the rare ones.
pub(crate) fn hot_slots(cache_slots: usize) -> usize {
    cache_slots * 3 / 4
}

/// Request counts per record, halved every `window` requests so they follow a drifting
/// routing (a decayed frequency, as TinyLFU's).
/// Also keeps the hot set: the `rank` most requested records (ties: lower record first),
/// recomputed every 1024 requests. An exact set rather than a count threshold, because routing
/// that is nearly fixed gives many records the same count.
pub(crate) struct Freq {
    counts: Vec<u32>,
    since: u64,
    window: u64,
    rank: usize,
    hot: Vec<bool>,
    until_rank: u32,
}

impl Freq {
    /// `hot_slots`: how many records the cache can keep hot.
    pub fn new(records: usize, hot_slots: usize) -> Freq {
        Freq {
            counts: vec![0; records],
            since: 0,
            window: (records as u64 * 16).max(1024),
            rank: hot_slots.min(records),
            hot: vec![false; records],
            until_rank: 0,
        }
    }

    /// Starts from a saved ranking (`hottest_first`, e.g. the routing heat of earlier runs)
    /// instead of nothing: the i-th of n records counts n - i, so the order holds until this
    /// run's own requests, which halve the prior every window, take over.
    pub fn seed(&mut self, hottest_first: &[u32]) {
        let n = hottest_first.len();
        for (i, &r) in hottest_first.iter().enumerate() {
            if let Some(c) = self.counts.get_mut(r as usize) {
                *c = u32::try_from(n - i).unwrap_or(u32::MAX);
            }
        }
        self.rank_hot();
        self.until_rank = 1024;
    }

    pub fn hit(&mut self, rec: usize) {
        self.counts[rec] = self.counts[rec].saturating_add(1);
        self.since += 1;
        if self.since >= self.window {
            self.since = 0;
            self.counts.iter_mut().for_each(|c| *c /= 2);
        }
        if self.until_rank == 0 {
            self.until_rank = 1024;
            self.rank_hot();
        }
        self.until_rank -= 1;
    }

    fn rank_hot(&mut self) {
        self.hot.fill(false);
        let mut v: Vec<(u32, u32)> = self
            .counts
            .iter()
            .enumerate()
            .filter(|(_, &c)| c > 0)
            .map(|(r, &c)| (c, r as u32))
            .collect();
        let k = self.rank.min(v.len());
        if k == 0 {
            return;
        }
        if k < v.len() {
            v.select_nth_unstable_by(k - 1, |a, b| b.0.cmp(&a.0).then(a.1.cmp(&b.1)));
        }
        for &(_, r) in &v[..k] {
            self.hot[r as usize] = true;
        }
    }

    /// Among the `hot_slots` most requested records (as of the last ranking).
    pub fn is_hot(&self, rec: usize) -> bool {
        self.hot[rec]
    }
}

const NIL: u32 = u32::MAX;

/// Doubly-linked LRU lists over slot indices; a slot is in at most one list. Front = most
/// recently used.
pub(crate) struct LruLists {
    prev: Vec<u32>,
    next: Vec<u32>,
    head: Vec<u32>,
    tail: Vec<u32>,
    list_of: Vec<u32>,
}

impl LruLists {
    pub fn new(slots: usize, lists: usize) -> LruLists {
        LruLists {
            prev: vec![NIL; slots],
            next: vec![NIL; slots],
            head: vec![NIL; lists],
            tail: vec![NIL; lists],
            list_of: vec![NIL; slots],
        }
    }

    /// Puts `slot` (in no list) at the front of `list`.
    pub fn push_front(&mut self, list: usize, slot: usize) {
        debug_assert_eq!(self.list_of[slot], NIL);
        let h = self.head[list];
        self.prev[slot] = NIL;
        self.next[slot] = h;
        if h != NIL {
            self.prev[h as usize] = slot as u32;
        } else {
            self.tail[list] = slot as u32;
        }
        self.head[list] = slot as u32;
        self.list_of[slot] = list as u32;
    }

    /// Puts `slot` (in no list) at the back of `list`: the first candidate for eviction.
    pub fn push_back(&mut self, list: usize, slot: usize) {
        debug_assert_eq!(self.list_of[slot], NIL);
        let t = self.tail[list];
        self.next[slot] = NIL;
        self.prev[slot] = t;
        if t != NIL {
            self.next[t as usize] = slot as u32;
        } else {
            self.head[list] = slot as u32;
        }
        self.tail[list] = slot as u32;
        self.list_of[slot] = list as u32;
    }

    pub fn remove(&mut self, slot: usize) {
        let list = self.list_of[slot];
        if list == NIL {
            return;
        }
        let (p, n) = (self.prev[slot], self.next[slot]);
        if p != NIL {
            self.next[p as usize] = n;
        } else {
            self.head[list as usize] = n;
        }
        if n != NIL {
            self.prev[n as usize] = p;
        } else {
            self.tail[list as usize] = p;
        }
        self.list_of[slot] = NIL;
    }

    /// Marks `slot` most recently used in its list.
    pub fn touch(&mut self, slot: usize) {
        let list = self.list_of[slot];
        if list != NIL && self.head[list as usize] != slot as u32 {
            self.remove(slot);
            self.push_front(list as usize, slot);
        }
    }

    /// The least recently used slot of `list` that `ok` accepts.
    pub fn victim(&self, list: usize, mut ok: impl FnMut(usize) -> bool) -> Option<usize> {
        let mut s = self.tail[list];
        while s != NIL {
            if ok(s as usize) {
                return Some(s as usize);
            }
            s = self.prev[s as usize];
        }
        None
    }
}

/// How `slots` cache slots are split into lists: `(number of lists, list of each slot)`.
/// Per-layer lists get `slots / layers` slots each (the first ones one more), at least one.
pub(crate) fn partition(policy: Policy, slots: usize, layers: usize) -> (usize, Vec<usize>) {
    match policy {
        Policy::GlobalLru | Policy::GlobalLruFreq => (1, vec![0; slots]),
        Policy::PerLayerLru => {
            let layers = layers.max(1);
            let (base, extra) = (slots / layers, slots % layers);
            let mut of = Vec::with_capacity(slots);
            for l in 0..layers {
                let n = base + usize::from(l < extra);
                of.extend(std::iter::repeat_n(l, n));
            }
            (layers, of)
        }
    }
}

/// A routing trace: for each token, for each MoE layer, the experts it routed to.
pub type Trace = Vec<Vec<Vec<u16>>>;

/// Hit rate of an expert cache of `slots` records under `policy` over `trace` (the experts of
/// one layer are requested together and are not evicted by each other, as in the store).
pub fn simulate(policy: Policy, slots: usize, layers: usize, trace: &Trace) -> f64 {
    let slots = match policy {
        Policy::PerLayerLru => slots.max(layers),
        _ => slots.max(1),
    };
    let experts = trace
        .iter()
        .flatten()
        .flatten()
        .map(|&e| e as usize + 1)
        .max()
        .unwrap_or(1);
    let top_k = trace.iter().flatten().map(Vec::len).max().unwrap_or(1);
    let by_freq = freq_insert(policy, slots, layers, top_k);
    let mut freq = Freq::new(layers * experts, hot_slots(slots));
    let (lists, list_of_slot) = partition(policy, slots, layers);
    let mut lru = LruLists::new(slots, lists);
    for (s, &l) in list_of_slot.iter().enumerate() {
        lru.push_back(l, s);
    }
    let mut key: Vec<Option<(usize, u16)>> = vec![None; slots];
    let mut at: HashMap<(usize, u16), usize> = HashMap::new();
    let (mut hits, mut total) = (0u64, 0u64);
    for token in trace {
        for (layer, experts) in token.iter().enumerate() {
            let list = if lists == 1 { 0 } else { layer };
            let mut busy: Vec<usize> = Vec::with_capacity(experts.len());
            for &e in experts {
                total += 1;
                let rec = layer * (freq.counts.len() / layers) + e as usize;
                freq.hit(rec);
                if let Some(&s) = at.get(&(layer, e)) {
                    hits += 1;
                    lru.touch(s);
                    busy.push(s);
                    continue;
                }
                // Slots of this layer's other experts stay (they are in use); with fewer slots
                // than experts per token the last one is reused (the store streams them).
                let v = lru
                    .victim(list, |s| !busy.contains(&s))
                    .or_else(|| lru.victim(list, |_| true))
                    .expect("every list has a slot");
                let colder = !freq.is_hot(rec);
                if let Some(old) = key[v].take() {
                    at.remove(&old);
                }
                key[v] = Some((layer, e));
                at.insert((layer, e), v);
                if by_freq && colder {
                    lru.remove(v);
                    lru.push_back(list, v);
                } else {
                    lru.touch(v);
                }
                busy.push(v);
            }
        }
    }
    if total == 0 {
        return 1.0;
    }
    hits as f64 / total as f64
}

/// A synthetic routing trace shaped like a trained MoE's (no trained checkpoint is available
/// here): each layer has its own Zipf-skewed expert popularity (exponent drawn per layer from
/// `0.2..1.4`, so some layers route almost uniformly and others concentrate on a few experts),
/// over its own random ordering of the experts, and each token keeps each of the previous
/// token's experts of the layer with probability `stay` (consecutive tokens share experts).
pub fn synthetic_trace(
    tokens: usize,
    layers: usize,
    experts: usize,
    top_k: usize,
    stay: f64,
    seed: u64,
) -> Trace {
    use rand::{RngExt, SeedableRng};
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let weights: Vec<Vec<f64>> = (0..layers)
        .map(|_| {
            let s: f64 = rng.random_range(0.2..1.4);
            let mut order: Vec<usize> = (0..experts).collect();
            for i in (1..experts).rev() {
                order.swap(i, rng.random_range(0..=i));
            }
            let mut w = vec![0.0; experts];
            for (rank, &e) in order.iter().enumerate() {
                w[e] = 1.0 / ((rank + 1) as f64).powf(s);
            }
            w
        })
        .collect();
    let mut prev: Vec<Vec<u16>> = vec![Vec::new(); layers];
    let mut trace = Vec::with_capacity(tokens);
    for _ in 0..tokens {
        let mut tok = Vec::with_capacity(layers);
        for l in 0..layers {
            let mut chosen: Vec<u16> = prev[l]
                .iter()
                .copied()
                .filter(|_| rng.random_bool(stay))
                .collect();
            while chosen.len() < top_k.min(experts) {
                let total: f64 = (0..experts)
                    .filter(|e| !chosen.contains(&(*e as u16)))
                    .map(|e| weights[l][e])
                    .sum();
                let mut r = rng.random_range(0.0..total);
                for (e, w) in weights[l].iter().enumerate() {
                    if chosen.contains(&(e as u16)) {
                        continue;
                    }
                    r -= w;
                    if r <= 0.0 {
                        chosen.push(e as u16);
                        break;
                    }
                }
                if r > 0.0 {
                    // Rounding left no pick: take the first free expert.
                    let e = (0..experts as u16).find(|e| !chosen.contains(e)).unwrap();
                    chosen.push(e);
                }
            }
            chosen.sort_unstable();
            prev[l] = chosen.clone();
            tok.push(chosen);
        }
        trace.push(tok);
    }
    trace
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lists_keep_order_and_skip_refused_slots() {
        let mut l = LruLists::new(4, 1);
        for s in 0..4 {
            l.push_front(0, s);
        }
        // front 3 2 1 0 back
        assert_eq!(l.victim(0, |_| true), Some(0));
        l.touch(0);
        assert_eq!(l.victim(0, |_| true), Some(1));
        assert_eq!(l.victim(0, |s| s != 1), Some(2));
        l.remove(2);
        assert_eq!(l.victim(0, |s| s != 1), Some(3));
        l.push_back(0, 2);
        assert_eq!(l.victim(0, |_| true), Some(2));
        assert_eq!(l.victim(0, |_| false), None);
    }

    #[test]
    fn per_layer_partition_gives_every_layer_a_share() {
        let (n, of) = partition(Policy::PerLayerLru, 10, 4);
        assert_eq!(n, 4);
        assert_eq!(of, vec![0, 0, 0, 1, 1, 1, 2, 2, 3, 3]);
    }

    #[test]
    fn a_cache_that_holds_everything_only_misses_once_per_expert() {
        let t = synthetic_trace(200, 4, 16, 4, 0.3, 7);
        for p in [Policy::GlobalLru, Policy::PerLayerLru] {
            let h = simulate(p, 64, 4, &t);
            let touched: std::collections::HashSet<(usize, u16)> = t
                .iter()
                .flat_map(|tok| {
                    tok.iter()
                        .enumerate()
                        .flat_map(|(l, es)| es.iter().map(move |&e| (l, e)))
                })
                .collect();
            let total = (200 * 4 * 4) as f64;
            assert!((h - (1.0 - touched.len() as f64 / total)).abs() < 1e-12);
        }
    }

    /// Plain LRU smaller than one token's experts gets no hits at all on a cyclic pass over the
    /// layers; the default then inserts rare experts at the cold end and keeps frequent ones.
    #[test]
    fn a_cache_smaller_than_a_token_does_not_thrash() {
        let t = synthetic_trace(1500, 8, 32, 4, 0.0, 3);
        let slots = 16; // one token touches 8 * 4 = 32
        assert!(freq_insert(Policy::GlobalLru, slots, 8, 4));
        let lru_only = simulate(Policy::PerLayerLru, slots, 8, &t);
        let default = simulate(Policy::GlobalLru, slots, 8, &t);
        assert!(lru_only < 0.05, "{lru_only}");
        assert!(default > 0.15, "{default}");
        // Larger caches keep plain LRU.
        assert!(!freq_insert(Policy::GlobalLru, 32, 8, 4));
    }

    #[test]
    fn a_seeded_ranking_is_hot_from_the_first_request() {
        let mut f = Freq::new(10, 3);
        f.seed(&[7, 2, 9, 4, 42]);
        let hot: Vec<usize> = (0..10).filter(|&r| f.is_hot(r)).collect();
        assert_eq!(hot, vec![2, 7, 9]);
        // This run's own requests take over once they outweigh the prior.
        for _ in 0..2048 {
            f.hit(5);
            f.hit(6);
            f.hit(8);
        }
        let hot: Vec<usize> = (0..10).filter(|&r| f.is_hot(r)).collect();
        assert_eq!(hot, vec![5, 6, 8]);
    }

    #[test]
    fn tiny_caches_still_run() {
        let t = synthetic_trace(20, 3, 8, 5, 0.0, 1);
        assert!(simulate(Policy::GlobalLru, 1, 3, &t) >= 0.0);
        assert!(simulate(Policy::PerLayerLru, 1, 3, &t) >= 0.0);
    }
}
