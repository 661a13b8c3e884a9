//! DeepSeek-V4's attention (transformers' `DeepseekV4Attention` with its compressors and
//! lightning indexer).
//!
//! Per position: the query `q_b(rms(q_a x))`, each head RMS-normed without a weight; one key
//! that is also the value, `rms(kv x)`; both rotated on their last `rope_dim` dims (interleaved
//! pairs). Each head attends over the last `sliding_window` positions' keys and, by the layer's
//! kind, compressed entries of the history; a per-head sink logit joins the softmax's
//! denominator; the output is rotated back (minus the angles), then projected per group of heads
//! (`o_a`, `o_groups` row blocks) and mixed (`o_b`).
//!
//! A compressor turns every window of `rate` positions into one entry: per channel, a softmax
//! over the window's gate values (plus a learned bias per slot) weighs its values; the sum is
//! RMS-normed and rotated at the window's first position. HCA layers attend over every entry
//! whose window is complete; CSA layers' windows overlap (each entry also weighs the previous
//! window's first half of a two-part projection) and an indexer with its own compressor scores
//! the entries per query (`sum_h w_h * relu(q_h . k)`), the `index_topk` best attended.
//!
//! What a later position can read is all a layer keeps ([`kv_layout`], [`state_widths`]): the
//! entries, one row per window (`every` = the rate: the compressor's entry, and CSA's indexer
//! entry after it), in the cache; and a fixed-size state: a ring of the last `sliding_window -
//! 1` keys and rings of the compressor's (and indexer's) per-position values and gates, as many
//! as the window being filled (and, for CSA's overlap, the previous one) can still read. The
//! state cannot go back, so truncation returns to a snapshot
//! ([`crate::kv::KvCache::truncate`]), as linear attention's does. Keys and compressor inputs
//! pass through the cache's dtype on their way into the state (an f16 cache rounds them as it
//! would store them).

use std::ops::Range;

use super::SeqRows;
use crate::config::{AttentionKind, CompressKind, CompressedDims, ModelConfig};
use crate::error::Result;
use crate::format::DType;
use crate::kv::{KvDtype, KvLayout, LayerKv, StateView};
use crate::linear::{Acts, Linear};
use crate::model::load::Tensors;
use crate::model::plan::Plan;
use crate::model::{fmt_err, Model};
use crate::ops::{self, Rope};

pub(super) fn dims(c: &ModelConfig) -> CompressedDims {
    match c.attention {
        AttentionKind::Compressed(d) => d,
        _ => unreachable!("a compressed-attention block of another config"),
    }
}

/// A ring of `slots` rows of `width` floats at `at` in a layer's state: position `p`'s row sits
/// in slot `p % slots`, so the ring holds the last `slots` positions.
#[derive(Clone, Copy, Debug)]
struct Ring {
    at: usize,
    slots: usize,
    width: usize,
}

impl Ring {
    fn new(at: usize, slots: usize, width: usize) -> Ring {
        Ring { at, slots, width }
    }

    fn end(&self) -> usize {
        self.at + self.slots * self.width
    }

    /// Where position `p`'s row sits (the ring must have slots).
    fn row(&self, p: usize) -> Range<usize> {
        let s = self.at + (p % self.slots) * self.width;
        s..s + self.width
    }
}

/// A layer's state: the keys a later position's window can still read (`sliding_window - 1`,
/// `head_dim` each), then the compressor's inputs (`[values | gates]` per position, `2 *
/// comp_in` wide) and the indexer's (`2 * 2 * index_head_dim`) that a later entry can still
/// read: `rate - 1` positions of the window being filled (HCA), `2 * rate - 1` with the previous
/// window (CSA's overlap).
#[derive(Clone, Copy, Debug)]
struct StateLayout {
    keys: Ring,
    comp: Ring,
    idx: Ring,
    comp_in: usize,
    width: usize,
}

fn state_layout(c: &ModelConfig, kind: CompressKind) -> StateLayout {
    let d = dims(c);
    let hd = c.head_dim;
    // A window past the context holds at most the context (a config's window is not bounded).
    let window = d.sliding_window.min(c.max_positions.max(1));
    let keys = Ring::new(0, window - 1, hd);
    let (comp_in, pending) = match kind {
        CompressKind::Sliding => (0, 0),
        CompressKind::Heavy => (hd, d.hca_rate - 1),
        CompressKind::Sparse => (2 * hd, 2 * d.csa_rate - 1),
    };
    let comp = Ring::new(keys.end(), pending, 2 * comp_in);
    let idx = match kind {
        CompressKind::Sparse => Ring::new(comp.end(), pending, 4 * d.index_head_dim),
        _ => Ring::new(comp.end(), 0, 0),
    };
    StateLayout {
        keys,
        comp,
        idx,
        comp_in,
        width: idx.end(),
    }
}

/// What every layer keeps in the cache: a row per window of its compressor (`every` = the
/// rate): the entry (`head_dim`), then for CSA the indexer's entry (`index_head_dim`); a sliding
/// layer none.
pub fn kv_layout(c: &ModelConfig) -> KvLayout {
    let d = dims(c);
    KvLayout {
        layers: c
            .compress_layers
            .iter()
            .map(|&k| match k {
                CompressKind::Sliding => LayerKv::per_position(0, 0, 0),
                CompressKind::Heavy => LayerKv {
                    every: d.hca_rate,
                    ..LayerKv::per_position(1, c.head_dim, 0)
                },
                CompressKind::Sparse => LayerKv {
                    every: d.csa_rate,
                    ..LayerKv::per_position(1, c.head_dim + d.index_head_dim, 0)
                },
            })
            .collect(),
    }
}

/// Per layer, the floats of its state ([`StateLayout`]).
pub fn state_widths(c: &ModelConfig) -> Vec<usize> {
    c.compress_layers
        .iter()
        .map(|&k| state_layout(c, k).width)
        .collect()
}

/// The tensors of layer `i`'s attention block.
pub fn plan(p: &mut Plan, c: &ModelConfig, i: usize) {
    let d = dims(c);
    let (h, heads, hd) = (c.hidden_size, c.num_heads, c.head_dim);
    let hf = |s: &str| format!("model.layers.{i}.self_attn.{s}");
    let n = |s: &str| format!("layers.{i}.{s}");
    p.matrix(n("q_a"), hf("q_a_proj.weight"), d.q_lora_rank, h);
    p.vector(n("q_a_norm"), hf("q_a_norm.weight"), d.q_lora_rank);
    p.matrix(n("q_b"), hf("q_b_proj.weight"), heads * hd, d.q_lora_rank);
    p.matrix(n("kv"), hf("kv_proj.weight"), hd, h);
    p.vector(n("kv_norm"), hf("kv_norm.weight"), hd);
    let group_in = heads * hd / d.o_groups;
    p.matrix(
        n("o_a"),
        hf("o_a_proj.weight"),
        d.o_groups * d.o_lora_rank,
        group_in,
    );
    p.matrix(
        n("o_b"),
        hf("o_b_proj.weight"),
        h,
        d.o_groups * d.o_lora_rank,
    );
    p.vector(n("sinks"), hf("sinks"), heads);
    let kind = c.compress_layers[i];
    let rate = rate(&d, kind);
    if kind != CompressKind::Sliding {
        let cin = state_layout(c, kind).comp_in;
        p.matrix(n("comp.kv"), hf("compressor.kv_proj.weight"), cin, h);
        p.matrix(n("comp.gate"), hf("compressor.gate_proj.weight"), cin, h);
        p.f32_matrix(n("comp.ape"), hf("compressor.position_bias"), rate, cin);
        p.vector(n("comp.norm"), hf("compressor.kv_norm.weight"), hd);
    }
    if kind == CompressKind::Sparse {
        let (ih, ihd) = (d.index_heads, d.index_head_dim);
        let x = |s: &str| hf(&format!("compressor.indexer.{s}"));
        p.matrix(n("idx.kv"), x("kv_proj.weight"), 2 * ihd, h);
        p.matrix(n("idx.gate"), x("gate_proj.weight"), 2 * ihd, h);
        p.f32_matrix(n("idx.ape"), x("position_bias"), rate, 2 * ihd);
        p.vector(n("idx.norm"), x("kv_norm.weight"), ihd);
        p.matrix(n("idx.q_b"), x("q_b_proj.weight"), ih * ihd, d.q_lora_rank);
        p.f32_matrix(n("idx.weights"), x("scorer.weights_proj.weight"), ih, h);
    }
}

fn rate(d: &CompressedDims, kind: CompressKind) -> usize {
    match kind {
        CompressKind::Heavy => d.hca_rate,
        _ => d.csa_rate,
    }
}

/// One compressor: per position `values` and `gates` (`inputs` wide), a learned bias per slot
/// of the window (`ape`, `[rate, inputs]`), the entry's RMSNorm weight (`width`).
struct Compressor {
    kv: Linear,
    gate: Linear,
    ape: Vec<f32>,
    norm: Vec<f32>,
    rate: usize,
    width: usize,
    /// CSA: an entry weighs the previous window's first half of the inputs and its own
    /// window's second half (`inputs` = `2 * width`); HCA: its own window (`inputs` = `width`).
    overlap: bool,
}

impl Compressor {
    fn load(
        t: &Tensors,
        prefix: &str,
        h: usize,
        rate: usize,
        width: usize,
        overlap: bool,
    ) -> Result<Self> {
        let inputs = if overlap { 2 * width } else { width };
        Ok(Compressor {
            kv: t.linear(&format!("{prefix}.kv"), inputs, h)?,
            gate: t.linear(&format!("{prefix}.gate"), inputs, h)?,
            ape: t.vector(&format!("{prefix}.ape"), rate * inputs)?,
            norm: t.vector(&format!("{prefix}.norm"), width)?,
            rate,
            width,
            overlap,
        })
    }

    /// The entry of window `w` from the rows of positions `first ..` (each `[values | gates]`,
    /// `2 * inputs` wide): `2 * rate` rows from `(w - 1) * rate` for an overlapping compressor
    /// past its first window, else `rate` rows from `w * rate`. Not yet normed or rotated.
    fn entry(&self, w: usize, rows: &[f32]) -> Vec<f32> {
        let (m, width) = (self.rate, self.width);
        let inputs = if self.overlap { 2 * width } else { width };
        let row = |j: usize| &rows[j * 2 * inputs..(j + 1) * 2 * inputs];
        // (row, column offset of this half, slot) of every slot the entry weighs.
        let mut slots: Vec<(usize, usize, usize)> = Vec::with_capacity(2 * m);
        if self.overlap {
            let cur = if w > 0 { m } else { 0 };
            if w > 0 {
                slots.extend((0..m).map(|j| (j, 0, j)));
            }
            slots.extend((0..m).map(|j| (cur + j, width, j)));
        } else {
            slots.extend((0..m).map(|j| (j, 0, j)));
        }
        let mut out = vec![0.0f32; width];
        let mut logits = vec![0.0f32; slots.len()];
        for (ch, o) in out.iter_mut().enumerate() {
            for (l, &(r, off, j)) in logits.iter_mut().zip(&slots) {
                *l = row(r)[inputs + off + ch] + self.ape[j * inputs + off + ch];
            }
            let mx = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let mut sum = 0.0f32;
            let mut acc = 0.0f32;
            for (&l, &(r, off, _)) in logits.iter().zip(&slots) {
                let e = (l - mx).exp();
                sum += e;
                acc += e * row(r)[off + ch];
            }
            *o = acc / sum;
        }
        out
    }

    /// The positions whose rows [`Compressor::entry`] reads for window `w`.
    fn source(&self, w: usize) -> Range<usize> {
        let m = self.rate;
        if self.overlap && w > 0 {
            (w - 1) * m..(w + 1) * m
        } else {
            w * m..(w + 1) * m
        }
    }
}

/// The CSA indexer: its compressor, query heads over the normed low-rank query, and the
/// per-head weights from the layer's input.
struct Indexer {
    comp: Compressor,
    q_b: Linear,
    weights: Linear,
}

/// One layer's DeepSeek-V4 attention weights.
pub(in crate::model) struct Compressed {
    q_a: Linear,
    q_a_norm: Vec<f32>,
    q_b: Linear,
    kv: Linear,
    kv_norm: Vec<f32>,
    o_a: Linear,
    o_b: Linear,
    sinks: Vec<f32>,
    comp: Option<Compressor>,
    indexer: Option<Indexer>,
    /// The layer's RoPE (`main` for sliding layers, else `compress`) and the compressors' and
    /// indexer's (`compress`).
    rope: Rope,
    comp_rope: Rope,
    state: StateLayout,
}

impl Compressed {
    pub(in crate::model) fn load(t: &Tensors, c: &ModelConfig, i: usize) -> Result<Compressed> {
        let d = dims(c);
        let (h, heads, hd) = (c.hidden_size, c.num_heads, c.head_dim);
        let n = |s: &str| format!("layers.{i}.{s}");
        let kind = c.compress_layers[i];
        let comp_rope = Rope::scaled(d.rope_dim, d.compress_theta, &d.compress_scaling);
        let rope = match kind {
            CompressKind::Sliding => Rope::scaled(d.rope_dim, d.main_theta, &d.main_scaling),
            _ => Rope::scaled(d.rope_dim, d.compress_theta, &d.compress_scaling),
        };
        let r = rate(&d, kind);
        let comp = match kind {
            CompressKind::Sliding => None,
            k => Some(Compressor::load(
                t,
                &n("comp"),
                h,
                r,
                hd,
                k == CompressKind::Sparse,
            )?),
        };
        let indexer = match kind {
            CompressKind::Sparse => {
                let (ih, ihd) = (d.index_heads, d.index_head_dim);
                let weights = t.linear(&n("idx.weights"), ih, h)?;
                if weights.dtype != DType::F32 {
                    return Err(fmt_err(format!(
                        "tensor `{}` should be f32",
                        n("idx.weights")
                    )));
                }
                Some(Indexer {
                    comp: Compressor::load(t, &n("idx"), h, r, ihd, true)?,
                    q_b: t.linear(&n("idx.q_b"), ih * ihd, d.q_lora_rank)?,
                    weights,
                })
            }
            _ => None,
        };
        Ok(Compressed {
            q_a: t.linear(&n("q_a"), d.q_lora_rank, h)?,
            q_a_norm: t.vector(&n("q_a_norm"), d.q_lora_rank)?,
            q_b: t.linear(&n("q_b"), heads * hd, d.q_lora_rank)?,
            kv: t.linear(&n("kv"), hd, h)?,
            kv_norm: t.vector(&n("kv_norm"), hd)?,
            o_a: t.linear(
                &n("o_a"),
                d.o_groups * d.o_lora_rank,
                heads * hd / d.o_groups,
            )?,
            o_b: t.linear(&n("o_b"), h, d.o_groups * d.o_lora_rank)?,
            sinks: t.vector(&n("sinks"), heads)?,
            comp,
            indexer,
            rope,
            comp_rope,
            state: state_layout(c, kind),
        })
    }
}

/// One sequence's view of a pass for a layer: its rows of the pass at positions `p0 ..`, and
/// its state before the pass (the positions before `p0` that a later one can read).
struct History<'a> {
    p0: usize,
    row0: usize,
    state: StateView<'a>,
}

impl History<'_> {
    /// Appends position `p`'s row of `width` floats to `out`: from the pass's rows (`pass`,
    /// row-major) from `p0` on, else from the state's `ring`.
    fn extend_row(&self, p: usize, ring: &Ring, pass: &[f32], out: &mut Vec<f32>) {
        if p >= self.p0 {
            let at = (self.row0 + p - self.p0) * ring.width;
            out.extend_from_slice(&pass[at..at + ring.width]);
        } else {
            self.state.extend(ring.row(p), out);
        }
    }
}

/// Per sequence: the keys the pass's rows may see (from the first row's window to the last
/// row), and the entries (and index keys) complete by the last row.
struct Seen {
    first: usize,
    keys: Vec<f32>,
    entries: Vec<f32>,
    index_keys: Vec<f32>,
}

impl Model {
    /// Layer `li`'s attention over the normed inputs `hn` of every sequence of the pass;
    /// writes the entries of the windows the pass completes and moves each sequence's state
    /// past the pass.
    pub(in crate::model) fn compressed_attention(
        &self,
        li: usize,
        w: &Compressed,
        hn: Vec<f32>,
        seqs: &mut [SeqRows],
    ) -> Vec<f32> {
        let c = &self.cfg;
        let d = dims(c);
        let (h, heads, hd) = (c.hidden_size, c.num_heads, c.head_dim);
        let eps = c.rms_norm_eps;
        let n = hn.len() / h;
        // Each row's position in its sequence.
        let mut pos = vec![0usize; n];
        for s in seqs.iter() {
            for (k, r) in s.rows.clone().enumerate() {
                pos[r] = s.kv.len + k;
            }
        }
        let mut acts = Acts::from_vec(hn, n, h);
        let mut ws = vec![w.q_a, w.kv];
        if let Some(cp) = &w.comp {
            ws.extend([cp.kv, cp.gate]);
        }
        if let Some(ix) = &w.indexer {
            ws.extend([ix.comp.kv, ix.comp.gate, ix.weights]);
        }
        let mut outs = self.project(&ws, &mut acts).into_iter();
        let mut qa = outs.next().unwrap();
        let mut kv = outs.next().unwrap();
        let comp_in = w
            .comp
            .as_ref()
            .map(|_| (outs.next().unwrap(), outs.next().unwrap()));
        let idx_in = w.indexer.as_ref().map(|_| {
            (
                outs.next().unwrap(),
                outs.next().unwrap(),
                outs.next().unwrap(),
            )
        });

        let rank = d.q_lora_rank;
        self.per_position(&mut qa, rank, |_, row| ops::rms_norm(row, &w.q_a_norm, eps));
        let mut qa = Acts::from_vec(qa, n, rank);
        let mut qws = vec![w.q_b];
        if let Some(ix) = &w.indexer {
            qws.push(ix.q_b);
        }
        let mut qouts = self.project(&qws, &mut qa).into_iter();
        let mut q = qouts.next().unwrap();
        let mut iq = qouts.next();
        self.per_position(&mut q, heads * hd, |i, row| {
            row.chunks_exact_mut(hd)
                .for_each(|head| ops::rms_norm_unweighted(head, eps));
            w.rope
                .apply_interleaved_tail(row, hd, &w.rope.angles(pos[i]), false);
        });
        self.per_position(&mut kv, hd, |i, row| {
            ops::rms_norm(row, &w.kv_norm, eps);
            w.rope
                .apply_interleaved_tail(row, hd, &w.rope.angles(pos[i]), false);
        });
        if let Some(iq) = iq.as_mut() {
            let ihd = d.index_head_dim;
            self.per_position(iq, d.index_heads * ihd, |i, row| {
                w.comp_rope
                    .apply_interleaved_tail(row, ihd, &w.comp_rope.angles(pos[i]), false);
            });
        }

        // What the state keeps, as the cache's dtype stores it: the keys, and each
        // compressor's `[values | gates]` rows.
        let dtype = seqs.first().map_or(KvDtype::F32, |s| s.kv.dtype());
        dtype.round(&mut kv);
        let inputs_rows = |(values, gates): (&Vec<f32>, &Vec<f32>), width: usize| {
            let mut rows = Vec::with_capacity(2 * n * width);
            for i in 0..n {
                rows.extend_from_slice(&values[i * width..(i + 1) * width]);
                rows.extend_from_slice(&gates[i * width..(i + 1) * width]);
            }
            dtype.round(&mut rows);
            rows
        };
        let comp_rows = comp_in
            .as_ref()
            .map(|(v, g)| inputs_rows((v, g), w.state.comp_in))
            .unwrap_or_default();
        let idx_rows = idx_in
            .as_ref()
            .map(|(v, g, _)| inputs_rows((v, g), 2 * d.index_head_dim))
            .unwrap_or_default();

        self.write_entries(li, w, seqs, &comp_rows, &idx_rows);
        let seen = self.seen(li, w, seqs, &kv);
        self.advance_states(li, w, seqs, &kv, &comp_rows, &idx_rows);

        let spans: Vec<(usize, usize)> =
            seqs.iter().map(|s| (s.rows.start, s.rows.len())).collect();
        let att = self.attend_compressed(
            w,
            &spans,
            &seen,
            &q,
            iq.as_deref(),
            idx_in.as_ref().map(|x| x.2.as_slice()),
            &pos,
        );

        // Grouped output projection: each group of heads through its row block of `o_a`.
        let (g, r) = (d.o_groups, d.o_lora_rank);
        let gw = heads * hd / g;
        let inputs: Vec<Acts> = (0..g)
            .map(|k| {
                let mut x = Vec::with_capacity(n * gw);
                for i in 0..n {
                    let at = i * heads * hd + k * gw;
                    x.extend_from_slice(&att[at..at + gw]);
                }
                Acts::from_vec(x, n, gw)
            })
            .collect();
        let groups = self.per_head_products(&w.o_a, r, inputs);
        let mut mid = Vec::with_capacity(n * g * r);
        for i in 0..n {
            for out in &groups {
                mid.extend_from_slice(&out[i * r..(i + 1) * r]);
            }
        }
        let mut mid = Acts::from_vec(mid, n, g * r);
        self.project(&[w.o_b], &mut mid).remove(0)
    }

    /// The entries of the windows the pass's positions complete, each written as its window's
    /// row of the cache (the compressor's entry, then the indexer's). Their inputs are the
    /// pass's rows and, before it, the state's.
    fn write_entries(
        &self,
        li: usize,
        w: &Compressed,
        seqs: &mut [SeqRows],
        comp_rows: &[f32],
        idx_rows: &[f32],
    ) {
        let Some(comp) = &w.comp else { return };
        let eps = self.cfg.rms_norm_eps;
        let rate = comp.rate;
        // (sequence, window) of every completed window.
        let mut tasks: Vec<(usize, usize)> = Vec::new();
        for (s, sq) in seqs.iter().enumerate() {
            let p0 = sq.kv.len;
            for p in p0..p0 + sq.rows.len() {
                if (p + 1).is_multiple_of(rate) {
                    tasks.push((s, (p + 1) / rate - 1));
                }
            }
        }
        if tasks.is_empty() {
            return;
        }
        let hist: Vec<History> = seqs
            .iter()
            .map(|s| History {
                p0: s.kv.len,
                row0: s.rows.start,
                state: s.kv.state_view(li),
            })
            .collect();
        let entry = |cp: &Compressor, hs: &History, win: usize, ring: &Ring, pass: &[f32]| {
            let mut rows = Vec::with_capacity(cp.source(win).len() * ring.width);
            for p in cp.source(win) {
                hs.extend_row(p, ring, pass, &mut rows);
            }
            let mut e = cp.entry(win, &rows);
            ops::rms_norm(&mut e, &cp.norm, eps);
            let angles = w.comp_rope.angles(win * cp.rate);
            w.comp_rope
                .apply_interleaved_tail(&mut e, cp.width, &angles, false);
            e
        };
        let rows = self.pool.map(tasks.len(), |t| {
            let (s, win) = tasks[t];
            let mut row = entry(comp, &hist[s], win, &w.state.comp, comp_rows);
            if let Some(ix) = &w.indexer {
                row.extend(entry(&ix.comp, &hist[s], win, &w.state.idx, idx_rows));
            }
            row
        });
        drop(hist);
        for (&(s, win), row) in tasks.iter().zip(rows) {
            seqs[s].kv.write(li, win, &row, &[]);
        }
    }

    /// Each sequence's [`Seen`]: its keys from the state and the pass (`kv`), its entries from
    /// the cache (this pass's included).
    fn seen(&self, li: usize, w: &Compressed, seqs: &[SeqRows], kv: &[f32]) -> Vec<Seen> {
        let d = dims(&self.cfg);
        let hd = self.cfg.head_dim;
        seqs.iter()
            .map(|s| {
                let hs = History {
                    p0: s.kv.len,
                    row0: s.rows.start,
                    state: s.kv.state_view(li),
                };
                let first = (hs.p0 + 1).saturating_sub(d.sliding_window);
                let end = hs.p0 + s.rows.len();
                let mut keys = Vec::with_capacity((end - first) * hd);
                for p in first..end {
                    hs.extend_row(p, &w.state.keys, kv, &mut keys);
                }
                let (mut entries, mut index_keys) = (Vec::new(), Vec::new());
                if let Some(cp) = &w.comp {
                    entries = s.kv.key_columns(li, 0..end / cp.rate, 0..hd);
                }
                if let Some(ix) = &w.indexer {
                    let ihd = ix.comp.width;
                    index_keys = s.kv.key_columns(li, 0..end / ix.comp.rate, hd..hd + ihd);
                }
                Seen {
                    first,
                    keys,
                    entries,
                    index_keys,
                }
            })
            .collect()
    }

    /// Moves each sequence's state past the pass: the last positions of each ring from the
    /// pass's rows (the older ones it keeps are still in their slots).
    fn advance_states(
        &self,
        li: usize,
        w: &Compressed,
        seqs: &mut [SeqRows],
        kv: &[f32],
        comp_rows: &[f32],
        idx_rows: &[f32],
    ) {
        let st = &w.state;
        for s in seqs.iter_mut() {
            let (p0, row0, end) = (s.kv.len, s.rows.start, s.kv.len + s.rows.len());
            for (ring, pass) in [(&st.keys, kv), (&st.comp, comp_rows), (&st.idx, idx_rows)] {
                if ring.slots == 0 {
                    continue;
                }
                for p in end.saturating_sub(ring.slots).max(p0)..end {
                    let at = (row0 + p - p0) * ring.width;
                    let to = ring.row(p).start;
                    s.kv.store_state(li, to, &pass[at..at + ring.width]);
                }
            }
        }
    }

    /// Every row's attention output (`heads * head_dim`, rotated back), row-major.
    #[allow(clippy::too_many_arguments)]
    fn attend_compressed(
        &self,
        w: &Compressed,
        spans: &[(usize, usize)],
        seen: &[Seen],
        q: &[f32],
        iq: Option<&[f32]>,
        iw: Option<&[f32]>,
        pos: &[usize],
    ) -> Vec<f32> {
        let c = &self.cfg;
        let d = dims(c);
        let (heads, hd) = (c.num_heads, c.head_dim);
        let win = d.sliding_window;
        let scale = 1.0 / (hd as f32).sqrt();
        let row_span: Vec<usize> = {
            let mut v = vec![0; q.len() / (heads * hd)];
            for (s, &(row0, n)) in spans.iter().enumerate() {
                v[row0..row0 + n].fill(s);
            }
            v
        };
        // Each row's keys: its window, then the entries it attends (the indexer's choice).
        let keys: Vec<Vec<&[f32]>> = self.pool.map(row_span.len(), |i| {
            let (s, p) = (row_span[i], pos[i]);
            let sn = &seen[s];
            let mut keys: Vec<&[f32]> = Vec::new();
            for k in (p + 1).saturating_sub(win)..=p {
                let at = (k - sn.first) * hd;
                keys.push(&sn.keys[at..at + hd]);
            }
            if let Some(cp) = &w.comp {
                let ready = (p + 1) / cp.rate;
                let chosen: Vec<usize> = match (&w.indexer, iq, iw) {
                    (Some(ix), Some(iq), Some(iw)) => {
                        let (ih, ihd) = (d.index_heads, ix.comp.width);
                        let qi = &iq[i * ih * ihd..(i + 1) * ih * ihd];
                        let wi = &iw[i * ih..(i + 1) * ih];
                        index_choice(qi, wi, &sn.index_keys, ready, ihd, d.index_topk)
                    }
                    _ => (0..ready).collect(),
                };
                for e in chosen {
                    keys.push(&sn.entries[e * hd..(e + 1) * hd]);
                }
            }
            keys
        });
        // Every (row, head) on its own: decode's one row still spreads over the threads.
        let outs = self.pool.map(row_span.len() * heads, |t| {
            let (i, head) = (t / heads, t % heads);
            let qh = &q[(i * heads + head) * hd..(i * heads + head + 1) * hd];
            attend_with_sink(qh, &keys[i], w.sinks[head], scale)
        });
        let mut att = outs.concat();
        self.per_position(&mut att, heads * hd, |i, row| {
            w.rope
                .apply_interleaved_tail(row, hd, &w.rope.angles(pos[i]), true);
        });
        att
    }
}

/// The `topk` entries (of the first `ready`) the indexer scores highest for one query
/// (`sum_h w_h / sqrt(heads) * relu(q_h . k) / sqrt(head_dim)`), ascending; ties to the lower
/// index.
fn index_choice(
    q: &[f32],
    weights: &[f32],
    keys: &[f32],
    ready: usize,
    head_dim: usize,
    topk: usize,
) -> Vec<usize> {
    let qscale = 1.0 / (head_dim as f32).sqrt();
    let wscale = 1.0 / (weights.len() as f32).sqrt();
    let scores: Vec<f32> = (0..ready)
        .map(|e| {
            let k = &keys[e * head_dim..(e + 1) * head_dim];
            q.chunks_exact(head_dim)
                .zip(weights)
                .map(|(qh, &wh)| wh * wscale * (ops::dot(qh, k).max(0.0) * qscale))
                .sum()
        })
        .collect();
    let mut order: Vec<usize> = (0..ready).collect();
    order.sort_by(|&a, &b| scores[b].total_cmp(&scores[a]).then(a.cmp(&b)));
    order.truncate(topk);
    order.sort_unstable();
    order
}

/// One head's attention over `keys` (which are also the values) with a sink logit in the
/// softmax's denominator.
fn attend_with_sink(q: &[f32], keys: &[&[f32]], sink: f32, scale: f32) -> Vec<f32> {
    let mut logits: Vec<f32> = keys.iter().map(|k| ops::dot(q, k) * scale).collect();
    let mx = logits.iter().copied().fold(sink, f32::max);
    let mut sum = (sink - mx).exp();
    for l in logits.iter_mut() {
        *l = (*l - mx).exp();
        sum += *l;
    }
    let mut out = vec![0.0f32; q.len()];
    for (l, k) in logits.iter().zip(keys) {
        let p = l / sum;
        for (o, v) in out.iter_mut().zip(k.iter()) {
            *o += p * v;
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kv::{KvCache, KvDtype};
    use serde_json::json;

    /// DeepSeek-V4-Flash's published config.json (the fields that shape its attention): 43
    /// layers, two sliding, then CSA (rate 4) and HCA (rate 128) alternating, the last entry of
    /// `compress_ratios` its MTP layer's.
    fn flash() -> ModelConfig {
        let mut ratios = vec![0, 0];
        ratios.extend((0..41).map(|i| if i % 2 == 0 { 4 } else { 128 }));
        ratios.push(0);
        let v = json!({
            "architectures": ["DeepseekV4ForCausalLM"],
            "model_type": "deepseek_v4",
            "hidden_size": 4096, "num_hidden_layers": 43, "num_attention_heads": 64,
            "num_key_value_heads": 1, "head_dim": 512, "qk_rope_head_dim": 64,
            "q_lora_rank": 1024, "o_groups": 8, "o_lora_rank": 1024,
            "index_head_dim": 128, "index_n_heads": 64, "index_topk": 512,
            "sliding_window": 128, "compress_ratios": ratios,
            "compress_rope_theta": 160000, "rope_theta": 10000,
            "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 16,
                             "original_max_position_embeddings": 65536, "type": "yarn"},
            "max_position_embeddings": 1048576, "vocab_size": 129280,
            "moe_intermediate_size": 2048, "n_routed_experts": 256, "n_shared_experts": 1,
            "num_experts_per_tok": 6, "num_hash_layers": 3, "hc_mult": 4,
            "rms_norm_eps": 1e-6, "scoring_func": "sqrtsoftplus", "swiglu_limit": 10.0,
        });
        ModelConfig::from_hf(&v).unwrap()
    }

    #[test]
    fn flash_keeps_its_entries_per_position_and_its_windows_per_slot() {
        let c = flash();
        let kinds = |k: CompressKind| c.compress_layers.iter().filter(|&&x| x == k).count();
        assert_eq!(
            (
                kinds(CompressKind::Sliding),
                kinds(CompressKind::Sparse),
                kinds(CompressKind::Heavy)
            ),
            (2, 21, 20)
        );
        let kv = super::super::with_states(&c, KvCache::new(&kv_layout(&c), KvDtype::F16));
        // Per position: CSA (512 + 128) / 4, HCA 512 / 128 floats (the layout before kept
        // 119,936: every position's key, compressor inputs and a row for each entry).
        assert_eq!(kv.bytes_per_token(), (21 * 160 + 20 * 4) * 2);
        // Per slot: 127 keys per layer, 127 HCA inputs of 2 x 512, 7 CSA inputs of 2 x 1024
        // and of 2 x 256, in the cache's dtype (f16 here; they were f32: 23,093,248 bytes).
        let floats = 43 * 127 * 512 + 20 * 127 * 1024 + 21 * 7 * (2048 + 512);
        assert_eq!(kv.state_bytes(), floats * 2);
        assert_eq!(kv.state_bytes(), 11_546_624);
        let f32_cache = super::super::with_states(&c, KvCache::new(&kv_layout(&c), KvDtype::F32));
        assert_eq!(f32_cache.state_bytes(), floats * 4);
    }

    #[test]
    fn a_window_past_the_context_keeps_the_context_at_most() {
        let mut c = flash();
        let AttentionKind::Compressed(ref mut d) = c.attention else {
            panic!()
        };
        d.sliding_window = 1 << 40;
        c.max_positions = 1000;
        let st = state_layout(&c, CompressKind::Sliding);
        assert_eq!((st.keys.slots, st.width), (999, 999 * 512));
    }
}
