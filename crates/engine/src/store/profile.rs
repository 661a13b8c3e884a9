//! Per-turn profile: where a turn's time went, what it read, how the expert cache did.
//!
//! A turn is everything the model computed between two [`crate::model::Model::end_turn`] calls.
//! Its first forward pass, and any pass over more than one token, count as prefill; the other
//! single-token passes are decode.

use std::collections::VecDeque;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::StoreStats;

/// How many finished turns the model keeps.
pub const PROFILE_HISTORY: usize = 30;

/// One turn's profile. Times are wall-clock seconds on the thread that ran the forward passes.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Profile {
    /// Tokens run as prefill, and decode steps.
    pub prefill_tokens: u64,
    pub decode_tokens: u64,
    pub prefill_s: f64,
    pub decode_s: f64,
    pub prefill_tok_s: f64,
    pub decode_tok_s: f64,
    /// Blocked waiting for expert records to arrive from disk.
    pub io_wait_s: f64,
    /// Routed and shared experts and dense MLPs (their products and activations).
    pub expert_matmul_s: f64,
    /// Attention: q/k/v/o products, norms, RoPE, the attention itself.
    pub attention_s: f64,
    /// Final norm and output head.
    pub lm_head_s: f64,
    /// Everything else: embedding, residual norms, routers, prefetch look-ahead, combining.
    pub other_s: f64,
    /// Bytes read from the experts file (0 when every expert is resident).
    pub bytes_read: u64,
    pub cache_hits: u64,
    pub cache_misses: u64,
    /// `hits / (hits + misses)`; 1.0 when every expert is resident.
    pub cache_hit_rate: f64,
    /// Prefetch: reads started, those that were then used, and the share of routed experts
    /// the look-ahead had predicted (0 when prefetch is off).
    pub prefetch_reads: u64,
    pub prefetch_used: u64,
    pub prefetch_recall: f64,
}

/// Times of one forward pass.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct PassTimes {
    pub total: Duration,
    pub io_wait: Duration,
    pub expert: Duration,
    pub attention: Duration,
    pub lm_head: Duration,
    /// Routed experts predicted by the look-ahead that were routed, and routed experts of
    /// layers that had a prediction.
    pub predicted_hit: u64,
    pub predicted_of: u64,
}

/// The turn in progress plus the finished ones.
#[derive(Default)]
pub(crate) struct Turns {
    cur: Profile,
    passes: u64,
    predicted_hit: u64,
    predicted_of: u64,
    start: StoreStats,
    /// model layer -> expert -> routed this turn.
    routed: Vec<Vec<bool>>,
    pub history: VecDeque<Profile>,
    pub last_routed: Vec<Vec<u32>>,
}

impl Turns {
    pub fn new(layers: usize, experts: usize, start: StoreStats) -> Turns {
        Turns {
            routed: vec![vec![false; experts]; layers],
            start,
            ..Default::default()
        }
    }

    pub fn add_pass(&mut self, n: usize, t: &PassTimes, routed: &[(usize, Vec<usize>)]) {
        let prefill = n > 1 || self.passes == 0;
        self.passes += 1;
        let c = &mut self.cur;
        if prefill {
            c.prefill_tokens += n as u64;
            c.prefill_s += t.total.as_secs_f64();
        } else {
            c.decode_tokens += n as u64;
            c.decode_s += t.total.as_secs_f64();
        }
        c.io_wait_s += t.io_wait.as_secs_f64();
        c.expert_matmul_s += t.expert.as_secs_f64();
        c.attention_s += t.attention.as_secs_f64();
        c.lm_head_s += t.lm_head.as_secs_f64();
        c.other_s += (t
            .total
            .saturating_sub(t.io_wait + t.expert + t.attention + t.lm_head))
        .as_secs_f64();
        self.predicted_hit += t.predicted_hit;
        self.predicted_of += t.predicted_of;
        for (layer, experts) in routed {
            if let Some(row) = self.routed.get_mut(*layer) {
                for &e in experts {
                    if let Some(b) = row.get_mut(e) {
                        *b = true;
                    }
                }
            }
        }
    }

    /// Closes the turn (if anything ran) given the store's counters now.
    pub fn end(&mut self, now: StoreStats) {
        if self.passes == 0 {
            return;
        }
        let mut p = std::mem::take(&mut self.cur);
        let s = &self.start;
        p.bytes_read = now.bytes_read - s.bytes_read;
        p.cache_hits = now.hits - s.hits;
        p.cache_misses = now.misses - s.misses;
        p.prefetch_reads = now.prefetch_reads - s.prefetch_reads;
        p.prefetch_used = now.prefetch_used - s.prefetch_used;
        let asked = p.cache_hits + p.cache_misses;
        p.cache_hit_rate = if asked == 0 {
            1.0
        } else {
            p.cache_hits as f64 / asked as f64
        };
        p.prefetch_recall = if self.predicted_of == 0 {
            0.0
        } else {
            self.predicted_hit as f64 / self.predicted_of as f64
        };
        let rate = |n: u64, s: f64| if s > 0.0 { n as f64 / s } else { 0.0 };
        p.prefill_tok_s = rate(p.prefill_tokens, p.prefill_s);
        p.decode_tok_s = rate(p.decode_tokens, p.decode_s);
        self.history.push_back(p);
        while self.history.len() > PROFILE_HISTORY {
            self.history.pop_front();
        }
        self.last_routed = self
            .routed
            .iter_mut()
            .map(|row| {
                let ids = row
                    .iter()
                    .enumerate()
                    .filter(|(_, &b)| b)
                    .map(|(e, _)| e as u32)
                    .collect();
                row.fill(false);
                ids
            })
            .collect();
        self.passes = 0;
        self.predicted_hit = 0;
        self.predicted_of = 0;
        self.start = now;
    }
}
