//! The forward pass: embeddings, each layer's attention and feed-forward blocks over the
//! residual stream, the final norm and the output head; long prompts in chunks.

use std::time::Instant;

use super::layers::Ffn;
use super::{Model, Pass};
use crate::error::{Error, Result};
use crate::format::DType;
use crate::kv::KvCache;
use crate::linear::{for_each_chunk_mut, matmul_many, Acts, Job, Linear};
use crate::ops::{self, RopeAngles};

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

impl Model {
    /// Runs `tokens` at positions `kv.len ..` and appends them to `kv`, in passes of at most
    /// [`PREFILL_CHUNK`] positions. Returns logits for every token (`all_logits`) or only the
    /// last, `vocab_size` values per token.
    pub fn forward(&self, tokens: &[u32], kv: &mut KvCache, all_logits: bool) -> Result<Vec<f32>> {
        let n = tokens.len();
        if n == 0 {
            return Err(Error::Input("no tokens to run".into()));
        }
        if kv.len + n > self.cfg.max_positions {
            return Err(Error::Input(format!(
                "{} tokens exceed the context length {}",
                kv.len + n,
                self.cfg.max_positions
            )));
        }
        if let Some(&bad) = tokens.iter().find(|&&t| t as usize >= self.cfg.vocab_size) {
            return Err(Error::Input(format!(
                "token id {bad} is outside the vocabulary ({})",
                self.cfg.vocab_size
            )));
        }
        let t0 = Instant::now();
        let mut pass = Pass::default();
        let len0 = kv.len;
        kv.reserve(n);
        let r = tokens
            .chunks(self.prefill_chunk)
            .try_fold(Vec::new(), |mut logits, chunk| {
                let l = self.forward_inner(chunk, kv, all_logits, &mut pass)?;
                if !all_logits {
                    return Ok(l);
                }
                logits.extend(l);
                Ok(logits)
            });
        if r.is_err() {
            // A failed read leaves this pass's positions half written: drop them.
            kv.truncate(len0);
        }
        pass.times.total = t0.elapsed();
        self.turns
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .add_pass(n, &pass.times, &pass.routed);
        r
    }

    fn forward_inner(
        &self,
        tokens: &[u32],
        kv: &mut KvCache,
        all_logits: bool,
        pass: &mut Pass,
    ) -> Result<Vec<f32>> {
        let c = &self.cfg;
        let (n, h) = (tokens.len(), c.hidden_size);
        let mut x = vec![0.0f32; n * h];
        let embed = self.w(&self.embed);
        for (i, &tok) in tokens.iter().enumerate() {
            embed.row(tok as usize, h, &mut x[i * h..(i + 1) * h]);
        }
        // The same rotation serves every layer's queries and keys.
        let angles: Vec<RopeAngles> = (0..n).map(|i| self.rope.angles(kv.len + i)).collect();
        // A DSA indexer's choice, for the shared layers after it.
        let mut selection = None;
        for (li, layer) in self.layers.iter().enumerate() {
            let t = Instant::now();
            let mut hn = x.clone();
            self.per_position(&mut hn, h, |_, row| {
                ops::rms_norm(row, &layer.attn_norm, c.rms_norm_eps)
            });
            let att = self.attention(li, &layer.attention, hn, &angles, kv, &mut selection);
            pass.times.attention += t.elapsed();
            for (a, b) in x.iter_mut().zip(&att) {
                *a += *b;
            }
            let mut hn = x.clone();
            self.per_position(&mut hn, h, |_, row| {
                ops::rms_norm(row, &layer.ffn_norm, c.rms_norm_eps)
            });
            let mut acts = Acts::from_vec(hn, n, h);
            let y = match &layer.ffn {
                Ffn::Dense(m) => {
                    let t = Instant::now();
                    let y = self.mlp(m, &mut acts);
                    pass.times.expert += t.elapsed();
                    y
                }
                Ffn::Moe(m) => self.moe_block(m, &mut acts, li, &x, pass)?,
            };
            for (a, b) in x.iter_mut().zip(&y) {
                *a += *b;
            }
        }
        kv.len += n;

        let t = Instant::now();
        let rows: Vec<f32> = if all_logits {
            x
        } else {
            x[(n - 1) * h..].to_vec()
        };
        let m = rows.len() / h;
        let mut hn = rows;
        ops::rms_norm(&mut hn, &self.norm, c.rms_norm_eps);
        let mut acts = Acts::from_vec(hn, m, h);
        let logits = self.project(&[self.lm_head], &mut acts).remove(0);
        pass.times.lm_head += t.elapsed();
        Ok(logits)
    }

    /// `W x` for each weight in `ws` (same input), in one parallel region.
    pub(in crate::model) fn project(&self, ws: &[Linear], x: &mut Acts) -> Vec<Vec<f32>> {
        x.prepare(ws.iter().any(|w| w.dtype == DType::Q4));
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
