//! The key/value history of one sequence.
//!
//! Stored head-major: per layer and kv head, one contiguous run of `cap` rows of `head_dim`
//! values, so a query head's attention streams one block of memory front to back (position-major
//! rows put a head's 512 bytes every `kv_dim * 4` bytes, a stride the hardware prefetchers follow
//! poorly). Every layer's keys and values live in one buffer, so even a short history is big
//! enough for huge pages (a buffer per layer was 0.4 MB for a 96-position OLMoE-1B-7B cache:
//! 4 KiB pages, and decode attention 3% slower). Values are f32, or f16 ([`KvDtype`]: half the
//! bytes each decode step streams, as llama.cpp's default cache). Grows on demand (doubling,
//! with headroom past a long request) up to the model's context length, so a short chat does
//! not reserve the full context up front.
//! Slot files keep position-major f32 rows: [`KvCache::rows`] and [`KvCache::from_rows`] convert
//! (exactly, both ways).

use std::ops::Range;

use half::f16;
use half::slice::{HalfBitsSliceExt, HalfFloatSliceExt};

use crate::attention::HeadRows;
use crate::hugebuf::HugeBuf;

/// How the cache stores keys and values.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KvDtype {
    F32,
    F16,
}

impl KvDtype {
    pub fn bytes(self) -> usize {
        match self {
            KvDtype::F32 => 4,
            KvDtype::F16 => 2,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            KvDtype::F32 => "f32",
            KvDtype::F16 => "f16",
        }
    }
}

/// The keys and values of every layer: per layer, keys then values, each `kv_heads` runs of
/// `cap * head_dim` (see [`KvCache::at`]).
#[derive(Clone)]
enum Block {
    F32(HugeBuf<f32>),
    /// f16 bit patterns (viewed as `f16` through `half`'s safe reinterpretation).
    F16(HugeBuf<u16>),
}

impl Block {
    fn new(dtype: KvDtype, len: usize) -> Block {
        match dtype {
            KvDtype::F32 => Block::F32(HugeBuf::zeroed(len)),
            KvDtype::F16 => Block::F16(HugeBuf::zeroed(len)),
        }
    }

    /// Copies `len` floats from `src[from..]` into `self[to..]` (same dtype).
    fn copy_from(&mut self, to: usize, src: &Block, from: usize, len: usize) {
        match (self, src) {
            (Block::F32(d), Block::F32(s)) => d[to..to + len].copy_from_slice(&s[from..from + len]),
            (Block::F16(d), Block::F16(s)) => d[to..to + len].copy_from_slice(&s[from..from + len]),
            _ => unreachable!("one cache, one dtype"),
        }
    }

    fn store(&mut self, at: usize, src: &[f32]) {
        match self {
            Block::F32(d) => d[at..at + src.len()].copy_from_slice(src),
            Block::F16(d) => {
                crate::ops::narrow_to_f16(src, d[at..at + src.len()].reinterpret_cast_mut())
            }
        }
    }

    fn load(&self, at: usize, out: &mut [f32]) {
        match self {
            Block::F32(d) => out.copy_from_slice(&d[at..at + out.len()]),
            Block::F16(d) => d[at..at + out.len()]
                .reinterpret_cast::<f16>()
                .convert_to_f32_slice(out),
        }
    }

    fn release(&mut self, r: Range<usize>) {
        match self {
            Block::F32(d) => d.release(r),
            Block::F16(d) => d.release(r),
        }
    }

    fn slice(&self, r: Range<usize>) -> HeadRows<'_> {
        match self {
            Block::F32(d) => HeadRows::F32(&d[r]),
            Block::F16(d) => HeadRows::F16(d[r].reinterpret_cast()),
        }
    }
}

pub struct KvCache {
    data: Block,
    layers: usize,
    dtype: KvDtype,
    kv_heads: usize,
    head_dim: usize,
    /// Positions each head block has room for.
    cap: usize,
    /// Most positions the cache will ever hold (the model's context): growth stops there.
    limit: usize,
    /// Positions stored (the same in every layer once a forward pass completes).
    pub len: usize,
}

/// Smallest growth step, in positions.
const MIN_CAP: usize = 64;

impl KvCache {
    pub fn new(num_layers: usize, kv_heads: usize, head_dim: usize, dtype: KvDtype) -> KvCache {
        KvCache {
            data: Block::new(dtype, 0),
            layers: num_layers,
            dtype,
            kv_heads,
            head_dim,
            cap: 0,
            limit: usize::MAX,
            len: 0,
        }
    }

    /// The same cache, never grown past `limit` positions (doubling would otherwise allocate
    /// up to twice the context on the last growth).
    pub fn with_limit(mut self, limit: usize) -> KvCache {
        self.limit = limit.max(self.cap);
        self
    }

    /// A cache holding `keys`/`values` given per layer as position-major f32 rows of `kv_dim`
    /// (`positions * kv_dim` floats each, as a slot file stores them).
    pub fn from_rows(
        kv_heads: usize,
        head_dim: usize,
        dtype: KvDtype,
        positions: usize,
        keys: &[Vec<f32>],
        values: &[Vec<f32>],
    ) -> KvCache {
        let mut kv = KvCache::new(keys.len(), kv_heads, head_dim, dtype);
        kv.reserve(positions);
        let kvd = kv.kv_dim();
        for (li, (k, v)) in keys.iter().zip(values).enumerate() {
            kv.write(li, 0, &k[..positions * kvd], &v[..positions * kvd]);
        }
        kv.len = positions;
        kv
    }

    pub fn num_layers(&self) -> usize {
        self.layers
    }

    /// Where position `pos` of kv head `head` starts in the keys (`values` false) or the
    /// values of layer `li`, for a capacity of `cap` positions.
    fn at(&self, cap: usize, li: usize, values: bool, head: usize, pos: usize) -> usize {
        (((li * 2 + usize::from(values)) * self.kv_heads + head) * cap + pos) * self.head_dim
    }

    pub fn kv_dim(&self) -> usize {
        self.kv_heads * self.head_dim
    }

    pub fn dtype(&self) -> KvDtype {
        self.dtype
    }

    /// Makes room for `extra` positions after `len` (copies the history when it grows).
    pub fn reserve(&mut self, extra: usize) {
        let need = self.len + extra;
        if need <= self.cap {
            return;
        }
        // Doubling, and half again past a long request (a prompt, a restored slot): otherwise
        // the first decoded token after a 1k-token prompt would copy the whole history.
        let wanted = (self.cap * 2).max(need + need / 2).max(MIN_CAP);
        let cap = need.max(wanted.min(self.limit));
        let (hd, len, old_cap) = (self.head_dim, self.len, self.cap);
        let mut grown = Block::new(self.dtype, self.layers * 2 * self.kv_heads * cap * hd);
        for li in 0..self.layers {
            for values in [false, true] {
                for h in 0..self.kv_heads {
                    let (to, from) = (
                        self.at(cap, li, values, h, 0),
                        self.at(old_cap, li, values, h, 0),
                    );
                    grown.copy_from(to, &self.data, from, len * hd);
                }
            }
            // The old copy of this layer is done with: the peak stays one layer above the
            // grown cache rather than the old and the new caches whole.
            let (lo, hi) = (
                self.at(old_cap, li, false, 0, 0),
                self.at(old_cap, li + 1, false, 0, 0),
            );
            self.data.release(lo..hi);
        }
        self.data = grown;
        self.cap = cap;
    }

    /// Stores position-major f32 rows `k`/`v` (`n * kv_dim` each) of layer `li` at positions
    /// `start .. start + n`; room for them must have been reserved.
    pub fn write(&mut self, li: usize, start: usize, k: &[f32], v: &[f32]) {
        let (hd, cap, kvd) = (self.head_dim, self.cap, self.kv_dim());
        let n = k.len() / kvd;
        assert!(start + n <= cap && k.len() == v.len() && k.len() == n * kvd);
        for (rows, values) in [(k, false), (v, true)] {
            for (p, row) in rows.chunks_exact(kvd).enumerate() {
                for (h, src) in row.chunks_exact(hd).enumerate() {
                    let at = self.at(cap, li, values, h, start + p);
                    self.data.store(at, src);
                }
            }
        }
    }

    /// Keys and values of kv head `head` in layer `li`: `positions` rows of `head_dim` each.
    pub fn head(&self, li: usize, head: usize, positions: usize) -> (HeadRows<'_>, HeadRows<'_>) {
        let (hd, cap) = (self.head_dim, self.cap);
        let run = |values: bool| {
            let at = self.at(cap, li, values, head, 0);
            self.data.slice(at..at + positions * hd)
        };
        (run(false), run(true))
    }

    /// Position-major f32 keys and values of layer `li` at `positions` (what a slot file
    /// stores).
    pub fn rows(&self, li: usize, positions: Range<usize>) -> (Vec<f32>, Vec<f32>) {
        let (hd, cap, kvd) = (self.head_dim, self.cap, self.kv_dim());
        let gather = |values: bool| {
            let mut out = vec![0.0f32; positions.len() * kvd];
            for (row, p) in out.chunks_exact_mut(kvd).zip(positions.clone()) {
                for (h, dst) in row.chunks_exact_mut(hd).enumerate() {
                    self.data.load(self.at(cap, li, values, h, p), dst);
                }
            }
            out
        };
        (gather(false), gather(true))
    }

    /// Forgets every position (keeps the allocation).
    pub fn clear(&mut self) {
        self.len = 0;
    }

    /// Drops positions from `len` on (keeps the common prefix for reuse).
    pub fn truncate(&mut self, len: usize) {
        self.len = self.len.min(len);
    }

    /// Bytes of KV memory per cached token (keys and values over all layers).
    pub fn bytes_per_token(&self) -> usize {
        self.layers * self.kv_dim() * 2 * self.dtype.bytes()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rows(n: usize, kvd: usize, seed: f32) -> Vec<f32> {
        // Small integers: exact in f16 too, so both dtypes round-trip them.
        (0..n * kvd).map(|i| seed + (i % 997) as f32).collect()
    }

    #[test]
    fn growth_doubles_leaves_headroom_and_stops_at_the_limit() {
        let mut kv = KvCache::new(1, 2, 4, KvDtype::F16).with_limit(100);
        kv.reserve(10);
        assert_eq!(kv.cap, MIN_CAP);
        kv.len = 64;
        kv.reserve(1);
        assert_eq!(kv.cap, 100, "doubling to 128 would pass the limit");
        let mut free = KvCache::new(1, 2, 4, KvDtype::F16);
        free.reserve(1000);
        assert_eq!(
            free.cap, 1500,
            "a long request leaves half again for what follows"
        );
        free.len = 1000;
        free.reserve(1);
        assert_eq!(free.cap, 1500, "the next token fits without a copy");
        free.len = 1500;
        free.reserve(1);
        assert_eq!(free.cap, 3000);
        // A request past the limit is still served (the model refuses those before).
        let mut small = KvCache::new(1, 2, 4, KvDtype::F32).with_limit(8);
        small.reserve(20);
        assert_eq!(small.cap, 20);
    }

    #[test]
    fn rows_round_trip_through_growth_and_truncation() {
        for dtype in [KvDtype::F32, KvDtype::F16] {
            round_trip(dtype);
        }
    }

    fn round_trip(dtype: KvDtype) {
        let (heads, hd) = (3, 4);
        let kvd = heads * hd;
        let mut kv = KvCache::new(2, heads, hd, dtype);
        let (k0, v0) = (rows(5, kvd, 0.0), rows(5, kvd, 100.0));
        kv.reserve(5);
        for li in 0..2 {
            kv.write(li, 0, &k0, &v0);
        }
        kv.len = 5;
        // Grow past the first block: the history moves, the rows stay.
        let (k1, v1) = (rows(100, kvd, 200.0), rows(100, kvd, 300.0));
        kv.reserve(100);
        kv.write(1, 5, &k1, &v1);
        kv.write(0, 5, &k1, &v1);
        kv.len = 105;
        let (k, v) = kv.rows(1, 0..105);
        assert_eq!(k, [k0.clone(), k1.clone()].concat());
        assert_eq!(v, [v0.clone(), v1.clone()].concat());
        // One head's block is its slice of every row, in position order.
        let want: Vec<f32> = k
            .chunks_exact(kvd)
            .flat_map(|r| r[2 * hd..3 * hd].to_vec())
            .collect();
        let got: Vec<f32> = match kv.head(0, 2, 105).0 {
            HeadRows::F32(x) => x.to_vec(),
            HeadRows::F16(x) => x.iter().map(|v| v.to_f32()).collect(),
        };
        assert_eq!(got, want);
        kv.truncate(3);
        assert_eq!(kv.len, 3);
        assert_eq!(kv.rows(0, 1..3).0, k0[kvd..3 * kvd]);
        let back = KvCache::from_rows(
            heads,
            hd,
            dtype,
            105,
            &[k.clone(), k.clone()],
            &[v.clone(), v.clone()],
        );
        assert_eq!(back.rows(0, 0..105), (k, v));
    }
}
