//! The forward pass: embeddings, each layer's attention and feed-forward blocks over the
//! residual stream, the final norm and the output head; long prompts in chunks.

use std::time::Instant;

use std::ops::Range;

use super::layers::dsa::Selection;
use super::layers::hyper::{HyperMix, Mix};
use super::layers::{Ffn, SeqRows};
use super::{Model, Pass};
use crate::error::{Error, Result};
use crate::kv::KvCache;
use crate::linear::{for_each_chunk_mut, matmul_many, Acts, Job, Linear};
use crate::ops::{self, RopeAngles};
use crate::store::profile::Turn;

/// The most prompt positions one forward pass runs at once; longer prompts run in chunks of
/// this many, one after another over the same cache. A pass's transient memory grows with its
/// positions (OLMoE-1B-7B: ~0.2 GB of activations, expert inputs and outputs per 1024, by
/// peak RSS), so an unchunked 32k-token prompt would take ~6.5 GB beside the model. Prefill
/// of 2048 and 3072 tokens ran as fast in chunks of 256, 512, 1024 or 2048 as in one pass
/// (within the machine's ±3%; the weights re-read per chunk are ~3% of a 512-position chunk's
/// time). Results do not depend on the chunking (every position's arithmetic is the same;
/// tested).
pub(super) const PREFILL_CHUNK: usize = 512;

/// [`PREFILL_CHUNK`], or `COLI_PREFILL_CHUNK` (positions, at least 1) to measure others; a
/// value that is not one gives the default and a warning (the second value).
pub(super) fn resolve_prefill_chunk(setting: Option<&str>) -> (usize, Option<String>) {
    match setting.map(str::trim) {
        None | Some("") => (PREFILL_CHUNK, None),
        Some(v) => match v.parse::<usize>() {
            Ok(n) if n >= 1 => (n, None),
            _ => (
                PREFILL_CHUNK,
                Some(format!(
                    "colibri: COLI_PREFILL_CHUNK={v}: expected a number of positions >= 1, \
                     using {PREFILL_CHUNK}"
                )),
            ),
        },
    }
}

pub(super) fn prefill_chunk_from_env() -> usize {
    let (n, warning) = resolve_prefill_chunk(crate::settings::prefill_chunk().as_deref());
    if let Some(w) = warning {
        eprintln!("{w}");
    }
    n
}

/// One sequence of a batched forward pass ([`Model::forward_batch`]): its tokens, run at
/// positions `kv.len ..` of its own history and appended to it, and the turn whose profile
/// records the pass.
pub struct Seq<'a> {
    pub tokens: &'a [u32],
    pub kv: &'a mut KvCache,
    /// Logits for every token, or only the last.
    pub all_logits: bool,
    pub turn: &'a mut Turn,
}

impl Model {
    /// Runs `tokens` at positions `kv.len ..` and appends them to `kv`, in passes of at most
    /// [`PREFILL_CHUNK`] positions. Returns logits for every token (`all_logits`) or only the
    /// last, `vocab_size` values per token. The pass joins the model's own turn
    /// ([`Model::end_turn`]).
    pub fn forward(&self, tokens: &[u32], kv: &mut KvCache, all_logits: bool) -> Result<Vec<f32>> {
        let mut turn = self.own_turn.lock().unwrap_or_else(|e| e.into_inner());
        let mut seqs = [Seq {
            tokens,
            kv,
            all_logits,
            turn: &mut turn,
        }];
        Ok(self.forward_batch(&mut seqs)?.remove(0))
    }

    /// Whether `tokens` can run after `len` positions of history: at least one, inside the
    /// vocabulary, within the context length.
    pub fn check_tokens(&self, len: usize, tokens: &[u32]) -> Result<()> {
        let n = tokens.len();
        if n == 0 {
            return Err(Error::Input("no tokens to run".into()));
        }
        if len + n > self.cfg.max_positions {
            return Err(Error::Input(format!(
                "{} tokens exceed the context length {}",
                len + n,
                self.cfg.max_positions
            )));
        }
        if let Some(&bad) = tokens.iter().find(|&&t| t as usize >= self.cfg.vocab_size) {
            return Err(Error::Input(format!(
                "token id {bad} is outside the vocabulary ({})",
                self.cfg.vocab_size
            )));
        }
        Ok(())
    }

    /// Runs several sequences together, each over its own history: one pass reads every weight
    /// once for all their rows (a routed expert once for every row routed to it), and attention
    /// runs over each sequence's own cache. A sequence's results are exactly those it gets
    /// alone (every row's arithmetic is the same). Sequences longer than [`PREFILL_CHUNK`] run
    /// in rounds of a chunk each. Returns each sequence's logits (as [`Model::forward`]). An
    /// error leaves every cache as it was; `check_tokens` first to keep one sequence's bad
    /// input from failing the others.
    pub fn forward_batch(&self, seqs: &mut [Seq]) -> Result<Vec<Vec<f32>>> {
        for s in seqs.iter() {
            self.check_tokens(s.kv.len, s.tokens)?;
        }
        // A turn's counters start before its first pass (that pass's reads are the turn's).
        if seqs.iter().any(|s| s.turn.needs_start()) {
            let store = self.store_stats().unwrap_or_default();
            for s in seqs.iter_mut().filter(|s| s.turn.needs_start()) {
                s.turn.begin(store.clone());
            }
        }
        let t0 = Instant::now();
        let mut pass = Pass {
            routed: vec![Vec::new(); seqs.len()],
            ..Pass::default()
        };
        let len0: Vec<usize> = seqs.iter().map(|s| s.kv.len).collect();
        for s in seqs.iter_mut() {
            s.kv.reserve(s.tokens.len());
        }
        let chunk = self.prefill_chunk;
        let rounds = seqs
            .iter()
            .map(|s| s.tokens.len().div_ceil(chunk))
            .max()
            .unwrap_or(0);
        let mut logits: Vec<Vec<f32>> = vec![Vec::new(); seqs.len()];
        let mut r = Ok(());
        for round in 0..rounds {
            let mut parts: Vec<Part> = seqs
                .iter_mut()
                .enumerate()
                .filter_map(|(seq, s)| {
                    let tokens = s.tokens.chunks(chunk).nth(round)?;
                    Some(Part {
                        seq,
                        tokens,
                        kv: &mut *s.kv,
                        all_logits: s.all_logits,
                    })
                })
                .collect();
            match self.forward_inner(&mut parts, &mut pass) {
                Ok(out) => {
                    for (p, l) in parts.iter().zip(out) {
                        if p.all_logits {
                            logits[p.seq].extend(l);
                        } else {
                            logits[p.seq] = l;
                        }
                    }
                }
                Err(e) => {
                    r = Err(e);
                    break;
                }
            }
        }
        if r.is_err() {
            // A failed read leaves this pass's positions half written (and states that some
            // layers advanced): drop them.
            for (s, &len) in seqs.iter_mut().zip(&len0) {
                s.kv.rewind(len);
            }
        }
        pass.times.total = t0.elapsed();
        for (s, routed) in seqs.iter_mut().zip(&pass.routed) {
            s.turn.add_pass(s.tokens.len(), &pass.times, routed);
        }
        r.map(|()| logits)
    }

    fn forward_inner(&self, parts: &mut [Part], pass: &mut Pass) -> Result<Vec<Vec<f32>>> {
        let c = &self.cfg;
        let h = c.hidden_size;
        let n: usize = parts.iter().map(|p| p.tokens.len()).sum();
        // The residual: one row of `hidden` per position, or of `mult` streams of it with
        // hyper-connections (each starts as the embedding).
        let streams = c.hyper.map_or(1, |d| d.mult);
        let sw = streams * h;
        let mut x = vec![0.0f32; n * sw];
        let embed = self.w(&self.embed);
        pass.tokens = parts.iter().flat_map(|p| p.tokens).copied().collect();
        for (i, &tok) in pass.tokens.iter().enumerate() {
            let row = &mut x[i * sw..(i + 1) * sw];
            embed.row(tok as usize, h, &mut row[..h]);
            for k in 1..streams {
                row.copy_within(..h, k * h);
            }
        }
        // Each row's rotation, at its own position; it serves every layer's queries and keys.
        let angles: Vec<RopeAngles> = parts
            .iter()
            .flat_map(|p| (0..p.tokens.len()).map(|i| self.rope.angles(p.kv.len + i)))
            .collect();
        pass.row_seq = parts
            .iter()
            .flat_map(|p| std::iter::repeat_n(p.seq, p.tokens.len()))
            .collect();
        let all_logits: Vec<bool> = parts.iter().map(|p| p.all_logits).collect();
        let mut seqs: Vec<SeqRows> = Vec::with_capacity(parts.len());
        let mut row = 0;
        for p in parts.iter_mut() {
            let m = p.tokens.len();
            seqs.push(SeqRows {
                rows: row..row + m,
                kv: &mut *p.kv,
            });
            row += m;
        }
        // Each sequence's DSA indexer choice, for the shared layers after it.
        let mut selection: Vec<Option<Selection>> = (0..seqs.len()).map(|_| None).collect();
        for (li, layer) in self.layers.iter().enumerate() {
            let t = Instant::now();
            let (hn, mix) = self.block_input(&x, layer.attn_hc.as_ref(), &layer.attn_norm);
            let att = self.attention(li, &layer.attention, hn, &angles, &mut seqs, &mut selection);
            pass.times.attention += t.elapsed();
            self.block_output(&mut x, &att, mix);
            let (hn, mix) = self.block_input(&x, layer.ffn_hc.as_ref(), &layer.ffn_norm);
            // The router look-ahead routes the block's input with the next layer's norm: the
            // stream itself, or with hyper-connections this block's collapsed input.
            let ahead = if mix.is_some() {
                hn.clone()
            } else {
                Vec::new()
            };
            let residual = if mix.is_some() { &ahead } else { &x };
            let mut acts = Acts::from_vec(hn, n, h);
            let y = match &layer.ffn {
                Ffn::Dense(m) => {
                    let t = Instant::now();
                    let y = self.mlp(m, &mut acts);
                    pass.times.expert += t.elapsed();
                    y
                }
                Ffn::Moe(m) => self.moe_block(m, &mut acts, li, residual, pass)?,
            };
            self.block_output(&mut x, &y, mix);
        }
        for s in &mut seqs {
            s.kv.len += s.rows.len();
        }

        let t = Instant::now();
        // The rows whose logits are wanted: all of a sequence's, or its last.
        let wanted: Vec<Range<usize>> = seqs
            .iter()
            .zip(all_logits)
            .map(|(s, all)| {
                if all {
                    s.rows.clone()
                } else {
                    s.rows.end - 1..s.rows.end
                }
            })
            .collect();
        let mut hn: Vec<f32> =
            Vec::with_capacity(wanted.iter().map(|r| r.len()).sum::<usize>() * sw);
        for r in &wanted {
            hn.extend_from_slice(&x[r.start * sw..r.end * sw]);
        }
        if let (Some(head), Some(d)) = (&self.hc_head, c.hyper) {
            hn = self.hyper_head(head, d, &hn);
        }
        let m = hn.len() / h;
        self.per_position(&mut hn, h, |_, row| {
            ops::rms_norm(row, &self.norm, c.rms_norm_eps)
        });
        let mut acts = Acts::from_vec(hn, m, h);
        let all = self.project(&[self.lm_head], &mut acts).remove(0);
        let v = c.vocab_size;
        let mut at = 0;
        let logits = wanted
            .iter()
            .map(|r| {
                let l = all[at * v..(at + r.len()) * v].to_vec();
                at += r.len();
                l
            })
            .collect();
        pass.times.lm_head += t.elapsed();
        Ok(logits)
    }

    /// A block's normed input from the residual `x`: its rows, or with hyper-connections
    /// (`hc`) the streams collapsed, and then the mixing weights [`Model::block_output`] needs.
    fn block_input(
        &self,
        x: &[f32],
        hc: Option<&HyperMix>,
        norm: &[f32],
    ) -> (Vec<f32>, Option<Vec<Mix>>) {
        let c = &self.cfg;
        let (mut hn, mix) = match (hc, c.hyper) {
            (Some(w), Some(d)) => {
                let (collapsed, mix) = self.hyper_collapse(w, d, x);
                (collapsed, Some(mix))
            }
            _ => (x.to_vec(), None),
        };
        self.per_position(&mut hn, c.hidden_size, |_, row| {
            ops::rms_norm(row, norm, c.rms_norm_eps)
        });
        (hn, mix)
    }

    /// Adds a block's output `y` to the residual `x`, or mixes it into the streams.
    fn block_output(&self, x: &mut [f32], y: &[f32], mix: Option<Vec<Mix>>) {
        match (mix, self.cfg.hyper) {
            (Some(mix), Some(d)) => self.hyper_expand(d, x, y, &mix),
            _ => {
                for (a, b) in x.iter_mut().zip(y) {
                    *a += *b;
                }
            }
        }
    }

    /// `W x` for each weight in `ws` (same input), in one parallel region.
    pub(in crate::model) fn project(&self, ws: &[Linear], x: &mut Acts) -> Vec<Vec<f32>> {
        for w in ws {
            self.calib.resident(w.offset, w.rows, &x.x, x.cols);
        }
        x.prepare(ws.iter().any(|w| w.dtype.takes_q8_acts()));
        let mut outs: Vec<Vec<f32>> = ws.iter().map(|w| vec![0.0; w.rows * x.n]).collect();
        let x = &*x;
        let mut jobs: Vec<Job> = ws
            .iter()
            .zip(outs.iter_mut())
            .map(|(w, out)| Job {
                w: self.w(w),
                x,
                out,
            })
            .collect();
        matmul_many(&self.pool, self.kernel, &mut jobs);
        outs
    }

    /// `f(i, row i)` for each `width`-long row of `x` (one per position): over the pool for a
    /// prompt, on this thread for one position (a parallel region would cost more than it
    /// saves). Each row is computed whole by one thread, so the results do not depend on it.
    pub(in crate::model) fn per_position<F>(&self, x: &mut [f32], width: usize, f: F)
    where
        F: Fn(usize, &mut [f32]) + Sync,
    {
        if x.len() <= width {
            x.chunks_exact_mut(width)
                .enumerate()
                .for_each(|(i, r)| f(i, r));
        } else {
            for_each_chunk_mut(&self.pool, x, width, f);
        }
    }
}

/// One sequence's share of one round of [`Model::forward_batch`].
struct Part<'a> {
    /// Its index among the batch's sequences.
    seq: usize,
    tokens: &'a [u32],
    kv: &'a mut KvCache,
    all_logits: bool,
}
