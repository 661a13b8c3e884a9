//! A decode step's per-head MLA work in one parallel region.
//!
//! Each head's chain after the query projection is its own: `W_uk^T q_nope` (the absorbed
//! query), attention over the cached latents, `W_uv` of the weighted latent. In a prefill each
//! link is a product over many positions and earns its own parallel region; in a decode step
//! (one new position per sequence) the three are small (on DeepSeek-V3's shape 36 KiB of int4
//! per head and product) and three regions, with their per-head inputs gathered and quantized
//! apart, cost more than the work (measured: 2.4 ms of a 16.5 ms token, the products at
//! 12-13 GB/s against 40 for the large ones). Here each thread takes a run of heads through the
//! whole chain on its own: one region, each head's weights read as one stream per product.
//!
//! Every product and the attention are the kernels the three-region path calls, on the same
//! inputs (one product per head, the attention's heads sharing one read of the history), so
//! the results are the same bits (`decode_heads_give_the_bits_of_the_three_regions`).

use super::{columns_product, dims, KvB, Mla};
use crate::attention::{attend, AttendArgs};
use crate::kv::KvCache;
use crate::linear::{matmul_whole, Linear};
use crate::model::layers::Span;
use crate::model::Model;

impl Model {
    /// Whether a pass's absorbed sequences, of `rows` new positions each, can take
    /// [`Model::decode_heads`]: at least one, each one position, `kv_b` split, statistics not
    /// being collected (the calibration reads each product's inputs where the three-region
    /// path gives them).
    pub(in crate::model) fn decodes_by_heads(
        &self,
        layer: &Mla,
        rows: impl Iterator<Item = usize>,
    ) -> bool {
        let mut rows = rows.peekable();
        rows.peek().is_some()
            && rows.all(|n| n == 1)
            && matches!(layer.kv_b, KvB::Split { .. })
            && !self.calib.is_on()
    }

    /// Every head's attention value for the decode sequences `spans` (one row each, its
    /// queries `q`: per (row, head) `[q_nope | q_rope]` with the rope applied; its history in
    /// `kvs`, this position's latent included), written to `att` (per row, every head's
    /// `v_head_dim`).
    pub(in crate::model) fn decode_heads(
        &self,
        li: usize,
        layer: &Mla,
        spans: &[Span],
        q: &[f32],
        kvs: &[&KvCache],
        att: &mut [f32],
    ) {
        let KvB::Split { uk_t, uv, cols } = &layer.kv_b else {
            unreachable!("decodes_by_heads checked the split kv_b")
        };
        let d = dims(&self.cfg);
        let heads = self.cfg.num_heads;
        let (nope, r, vd) = (d.qk_nope_head_dim, d.kv_lora_rank, d.v_head_dim);
        let qk = nope + d.qk_rope_head_dim;
        let kw = r + d.qk_rope_head_dim;
        let m = spans.len();
        let (uk_cols, uv_cols) = (self.by_columns(&cols.uk), self.by_columns(&cols.uv));
        let runs = self.pool.threads().clamp(1, heads);
        let first = |t: usize| t * heads / runs;
        let values = self.pool.map(runs, |t| {
            let hs = first(t)..first(t + 1);
            let g = hs.len();
            // One head's product over the m rows: the head's row block of `w` times `x`.
            let product = |w: &Linear, rows: usize, head: usize, x: Vec<f32>| {
                let mut x = self.kv_b_input(x, m, w.cols);
                x.prepare(w.dtype.takes_q8_acts());
                let mut out = vec![0.0f32; m * rows];
                let block = w.row_block(head * rows, rows);
                matmul_whole(self.kernel, self.w(&block), &x, &mut out);
                out
            };
            // Absorbed queries, per (row, head of the run): [W_uk^T q_nope | q_rope].
            let mut absorbed = vec![0.0f32; m * g * kw];
            for (k, head) in hs.clone().enumerate() {
                let at = |s: &Span| (s.row0 * heads + head) * qk;
                let x = spans.iter().flat_map(|s| &q[at(s)..at(s) + nope]).copied();
                let uk_q = match uk_cols {
                    Some(cols) => {
                        columns_product(self.kernel, &cols[head], &x.collect::<Vec<_>>(), m)
                    }
                    None => product(uk_t, r, head, x.collect()),
                };
                for (j, s) in spans.iter().enumerate() {
                    let row = &mut absorbed[(j * g + k) * kw..(j * g + k + 1) * kw];
                    row[..r].copy_from_slice(&uk_q[j * r..(j + 1) * r]);
                    row[r..].copy_from_slice(&q[at(s) + nope..at(s) + qk]);
                }
            }
            // The run's heads attend together over each sequence's latents.
            let mut lats = vec![0.0f32; m * g * kw];
            for (j, s) in spans.iter().enumerate() {
                let qs: Vec<&[f32]> = absorbed[j * g * kw..(j + 1) * g * kw]
                    .chunks_exact(kw)
                    .collect();
                let (rows, _) = kvs[j].head(li, 0, s.p0 + 1);
                let args = AttendArgs {
                    keys: rows,
                    values: rows,
                    n0: s.p0 + 1,
                    share: g,
                    scale: d.softmax_scale,
                };
                attend(&qs, &args, &mut lats[j * g * kw..(j + 1) * g * kw]);
            }
            // Each head's value W_uv lat, per (row, head of the run).
            let mut out = vec![0.0f32; m * g * vd];
            for k in 0..g {
                let x = (0..m).flat_map(|j| &lats[(j * g + k) * kw..(j * g + k) * kw + r]);
                let x: Vec<f32> = x.copied().collect();
                let v = match uv_cols {
                    Some(cols) => columns_product(self.kernel, &cols[hs.start + k], &x, m),
                    None => product(uv, vd, hs.start + k, x),
                };
                for j in 0..m {
                    out[(j * g + k) * vd..(j * g + k + 1) * vd]
                        .copy_from_slice(&v[j * vd..(j + 1) * vd]);
                }
            }
            out
        });
        let w = heads * vd;
        for (t, v) in values.iter().enumerate() {
            let hs = first(t)..first(t + 1);
            let g = hs.len();
            for (j, s) in spans.iter().enumerate() {
                let dst = s.row0 * w + hs.start * vd;
                att[dst..dst + g * vd].copy_from_slice(&v[j * g * vd..(j + 1) * g * vd]);
            }
        }
    }
}
