//! Per-turn profile: where a turn's time went, what it read, how the expert cache did.
//!
//! A turn is everything one generation or scoring computed, from its first forward pass to its
//! end ([`crate::model::Model::close_turn`]); several turns run at once when streams are
//! stepped together, each in its own [`Turn`]. Its first forward pass, and any pass over more
//! than one of its tokens, count as prefill; its other single-token passes are decode. A pass
//! shared by several streams counts whole in each one's times (the time each waited for it).

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
    /// Read busy time during the turn: wall-clock seconds, from the start of its first pass to
    /// its end, during which at least one expert read was in flight (overlapping reads count
    /// once; reads of streams stepped with it count too, as shared passes do). The part of it
    /// that compute did not wait for, `read_busy_s - io_wait_s`, is the reading overlapped
    /// with compute. 0 when every expert is resident.
    pub read_busy_s: f64,
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

/// One turn in progress: the passes run for one generation or scoring (its slot keeps it, so
/// turns of streams stepped together stay apart).
#[derive(Default)]
pub struct Turn {
    cur: Profile,
    passes: u64,
    predicted_hit: u64,
    predicted_of: u64,
    /// The store's counters when the turn's first pass started (None before it).
    start: Option<StoreStats>,
    /// model layer -> expert -> routed this turn (grown as layers report).
    routed: Vec<Vec<bool>>,
}

/// The finished turns the model keeps.
#[derive(Default)]
pub(crate) struct Finished {
    pub history: VecDeque<Profile>,
    pub last_routed: Vec<Vec<u32>>,
}

impl Turn {
    /// Whether the turn's counters start is still to be taken ([`Turn::begin`]).
    pub(crate) fn needs_start(&self) -> bool {
        self.start.is_none()
    }

    /// Takes the store's counters `store` as the turn's start (before its first pass runs, so
    /// that pass's reads count in the turn); later calls change nothing.
    pub(crate) fn begin(&mut self, store: StoreStats) {
        self.start.get_or_insert(store);
    }

    /// Adds one forward pass of `n` of this turn's tokens that took `t` (the whole pass's times,
    /// shared with any sequences stepped with it) and routed `routed` ((model layer, experts) of
    /// this turn's tokens). The turn's start counters were taken before it ([`Turn::begin`]).
    pub(crate) fn add_pass(&mut self, n: usize, t: &PassTimes, routed: &[(usize, Vec<usize>)]) {
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
            if self.routed.len() <= *layer {
                self.routed.resize(layer + 1, Vec::new());
            }
            let row = &mut self.routed[*layer];
            for &e in experts {
                if row.len() <= e {
                    row.resize(e + 1, false);
                }
                row[e] = true;
            }
        }
    }

    /// Closes the turn (if anything ran) given the store's counters now: its profile and the
    /// experts it routed to per layer (`layers` of them). The turn starts empty again.
    pub(crate) fn close(
        &mut self,
        now: StoreStats,
        layers: usize,
    ) -> Option<(Profile, Vec<Vec<u32>>)> {
        if self.passes == 0 {
            self.start = None;
            return None;
        }
        let done = std::mem::take(self);
        let mut p = done.cur;
        let s = done.start.unwrap_or_default();
        p.bytes_read = now.bytes_read - s.bytes_read;
        p.read_busy_s = (now.read_busy_s - s.read_busy_s).max(0.0);
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
        p.prefetch_recall = if done.predicted_of == 0 {
            0.0
        } else {
            done.predicted_hit as f64 / done.predicted_of as f64
        };
        let rate = |n: u64, s: f64| if s > 0.0 { n as f64 / s } else { 0.0 };
        p.prefill_tok_s = rate(p.prefill_tokens, p.prefill_s);
        p.decode_tok_s = rate(p.decode_tokens, p.decode_s);
        let mut routed: Vec<Vec<u32>> = done
            .routed
            .iter()
            .map(|row| {
                row.iter()
                    .enumerate()
                    .filter(|(_, &b)| b)
                    .map(|(e, _)| e as u32)
                    .collect()
            })
            .collect();
        routed.resize(layers.max(routed.len()), Vec::new());
        Some((p, routed))
    }
}

impl Finished {
    pub(crate) fn push(&mut self, profile: Profile, routed: Vec<Vec<u32>>) {
        self.history.push_back(profile);
        while self.history.len() > PROFILE_HISTORY {
            self.history.pop_front();
        }
        self.last_routed = routed;
    }
}
