//! The key/value history of one sequence.
//!
//! Laid out from the model's [`KvLayout`]: what each layer keeps per position (`heads` runs of
//! keys `key_dim` wide and of values `value_dim` wide; GQA: the kv heads, both `head_dim`; MLA:
//! one run of the compressed keys and none of values; DSA: MLA's run and the indexer's keys as
//! the second run; a layer without per-position KV: none; DeepSeek-V4's compressed layers: one
//! row per window of `every` positions, the window's entries).
//! Stored head-major: per layer and head, one contiguous run of `cap` rows (`cap / every`), so a
//! query head's attention streams one block of memory front to back (position-major rows put a
//! head's 512 bytes every `kv_dim * 4` bytes, a stride the hardware prefetchers follow poorly).
//! Every layer's keys and values live in one buffer, so even a short history is big enough for
//! huge pages (a buffer per layer was 0.4 MB for a 96-position OLMoE-1B-7B cache: 4 KiB pages, and
//! decode attention 3% slower). Values are f32, or f16 ([`KvDtype`]: half the bytes each decode
//! step streams, as llama.cpp's default cache). Grows on demand (doubling, with headroom past a
//! long request) up to the model's context length, so a short chat does not reserve the full
//! context up front.
//! Slot files keep row-major f32 rows: [`KvCache::rows`] and [`KvCache::from_rows`] convert
//! (exactly, both ways). Beside the rows, a layer may carry a fixed-size state (linear
//! attention's recurrent state, DeepSeek-V4's window of keys and pending compressor inputs)
//! with snapshots to truncate back to.

use std::borrow::Cow;
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

    /// `v` as the cache stores and reads it back (f16: rounded to half precision by the same
    /// conversions as [`KvCache::write`] and the reads), for values kept beside the cache in
    /// f32 (a layer's state) that must equal what a cache row would give.
    pub fn round(self, v: &mut [f32]) {
        if self == KvDtype::F16 {
            let mut half = vec![f16::ZERO; v.len()];
            crate::ops::narrow_to_f16(v, &mut half);
            half.convert_to_f32_slice(v);
        }
    }
}

/// The keys and values of every layer: per layer, `heads` key runs of `cap * key_dim`, then
/// `heads` value runs of `cap * value_dim` (see [`KvCache::new`]).
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

    /// On ordinary pages (a short-lived copy, see [`HugeBuf::zeroed_small_pages`]).
    fn new_small_pages(dtype: KvDtype, len: usize) -> Block {
        match dtype {
            KvDtype::F32 => Block::F32(HugeBuf::zeroed_small_pages(len)),
            KvDtype::F16 => Block::F16(HugeBuf::zeroed_small_pages(len)),
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

    fn len(&self) -> usize {
        match self {
            Block::F32(d) => d.len(),
            Block::F16(d) => d.len(),
        }
    }

    fn slice(&self, r: Range<usize>) -> HeadRows<'_> {
        match self {
            Block::F32(d) => HeadRows::F32(&d[r]),
            Block::F16(d) => HeadRows::F16(d[r].reinterpret_cast()),
        }
    }
}

/// What one layer keeps: `heads` runs of keys `key_dim` wide and of values `value_dim` wide
/// (GQA: the kv heads, both `head_dim`), one row per position, or one row per `every`
/// positions (a compressed history: row `r` is written by position `(r + 1) * every - 1`, so
/// `len / every` rows follow `len` positions). A family's attention block says what its layers
/// keep ([`crate::model`]); the cache and slot files are laid out from it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LayerKv {
    pub heads: usize,
    pub key_dim: usize,
    pub value_dim: usize,
    pub every: usize,
}

impl LayerKv {
    /// A row per position of `heads` runs of `key_dim` keys and `value_dim` values.
    pub const fn per_position(heads: usize, key_dim: usize, value_dim: usize) -> LayerKv {
        LayerKv {
            heads,
            key_dim,
            value_dim,
            every: 1,
        }
    }

    /// Rows the layer holds after `positions` positions.
    pub fn rows(&self, positions: usize) -> usize {
        positions / self.every
    }

    /// The rows positions `r` write: `r.start / every .. r.end / every`.
    pub fn row_range(&self, r: Range<usize>) -> Range<usize> {
        self.rows(r.start)..self.rows(r.end)
    }
}

/// A layer's fixed-size state ([`KvCache::with_states`]).
#[derive(Clone)]
enum State {
    /// f32: linear attention's recurrent state, which accumulates and must stay exact.
    Exact(Vec<f32>),
    /// In the cache's dtype: values the model has already rounded as the cache stores them
    /// (DeepSeek-V4's keys and compressor inputs, [`KvDtype::round`]), so an f16 cache keeps
    /// them in half the bytes and gives back the same floats.
    Rounded(Block),
}

impl State {
    fn len(&self) -> usize {
        match self {
            State::Exact(v) => v.len(),
            State::Rounded(b) => b.len(),
        }
    }

    fn bytes(&self) -> usize {
        match self {
            State::Exact(v) => v.len() * 4,
            State::Rounded(Block::F32(d)) => d.len() * 4,
            State::Rounded(Block::F16(d)) => d.len() * 2,
        }
    }

    fn zero(&mut self) {
        match self {
            State::Exact(v) => v.fill(0.0),
            State::Rounded(Block::F32(d)) => d.fill(0.0),
            State::Rounded(Block::F16(d)) => d.fill(0),
        }
    }
}

/// A read-only view of a layer's state ([`KvCache::state_view`]).
pub struct StateView<'a>(&'a State);

impl StateView<'_> {
    /// Appends the state's floats in `r` to `out`.
    pub fn extend(&self, r: Range<usize>, out: &mut Vec<f32>) {
        match self.0 {
            State::Exact(v) => out.extend_from_slice(&v[r]),
            State::Rounded(b) => {
                let at = out.len();
                out.resize(at + r.len(), 0.0);
                b.load(r.start, &mut out[at..]);
            }
        }
    }
}

/// The KV state of a model: what each layer keeps per position.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KvLayout {
    pub layers: Vec<LayerKv>,
}

impl KvLayout {
    /// Every layer alike: `heads` kv heads of `head_dim` keys and values (GQA).
    pub fn uniform(num_layers: usize, heads: usize, head_dim: usize) -> KvLayout {
        KvLayout {
            layers: vec![LayerKv::per_position(heads, head_dim, head_dim); num_layers],
        }
    }
}

/// Where each layer's runs start in a buffer of `cap` positions, and the buffer's floats: per
/// layer `heads` key runs then `heads` value runs of `cap / every` rows each.
fn starts(layout: &KvLayout, cap: usize) -> (Vec<usize>, usize) {
    let mut at = 0usize;
    let mut out = Vec::with_capacity(layout.layers.len());
    for l in &layout.layers {
        out.push(at);
        let floats = l
            .heads
            .checked_mul(l.key_dim + l.value_dim)
            .and_then(|w| w.checked_mul(l.rows(cap)))
            .expect("KV cache size overflows");
        at = at.checked_add(floats).expect("KV cache size overflows");
    }
    (out, at)
}

pub struct KvCache {
    data: Block,
    layout: KvLayout,
    /// Per layer, where its runs start in `data` for the capacity `cap` ([`starts`]).
    starts: Vec<usize>,
    dtype: KvDtype,
    /// Positions the buffer has room for (a layer of one row per `every` positions: `cap /
    /// every` rows).
    cap: usize,
    /// Most positions the cache will ever hold (the model's context): growth stops there.
    limit: usize,
    /// Positions stored (the same in every layer once a forward pass completes).
    pub len: usize,
    /// Per layer, the fixed-size state a layer carries from position to position (linear
    /// attention's recurrent state, f32; DeepSeek-V4's window of keys and pending compressor
    /// inputs, in the cache's dtype; empty for the others), rewritten by every position's step.
    states: Vec<State>,
    /// Copies of every layer's state after `len` positions, newest last: what a truncation
    /// can go back to ([`KvCache::truncate`]).
    snapshots: Vec<StateSnapshot>,
}

/// Every state layer's state after `len` positions.
#[derive(Clone)]
struct StateSnapshot {
    len: usize,
    states: Vec<State>,
}

/// Snapshots a cache keeps at most: each is a full copy of the states (Qwen3-Next-80B: ~80 MB).
/// Which go when there are more: [`evicted`].
pub const MAX_SNAPSHOTS: usize = 4;

/// The newest snapshots never evicted: the end of the last prompt or turn and the one before
/// it (the token before a prompt's end, where the same prompt asked again resumes).
const KEPT_NEWEST: usize = 2;

/// Which of the snapshots at `lens` (ascending, more than [`MAX_SNAPSHOTS`]) goes: of all but
/// the newest [`KEPT_NEWEST`], the one whose removal leaves the shortest stretch without a
/// snapshot (from the one before it, or the start, to the one after it), the later of equals.
/// So the kept ones spread over the history instead of all following its end: a new prompt
/// that leaves a long shared prefix part way (another session of the same agent, after its
/// preamble) resumes within about a third of the history, where dropping the oldest would have
/// dropped every snapshot before the divergence after a few turns.
fn evicted(lens: &[usize]) -> usize {
    debug_assert!(lens.len() > KEPT_NEWEST);
    (0..lens.len() - KEPT_NEWEST)
        .min_by_key(|&i| {
            let before = if i == 0 { 0 } else { lens[i - 1] };
            (lens[i + 1] - before, std::cmp::Reverse(i))
        })
        .expect("at least one snapshot may go")
}

/// Smallest growth step, in positions.
const MIN_CAP: usize = 64;

impl KvCache {
    /// An empty cache laid out for `layout`: per layer, `heads` key runs then `heads` value runs
    /// (see [`KvCache::head`]).
    ///
    /// # Panics
    /// If a layer's `every` is 0, or its floats per row overflow `usize`.
    pub fn new(layout: &KvLayout, dtype: KvDtype) -> KvCache {
        for l in &layout.layers {
            assert!(
                l.every > 0,
                "a layer keeps a row per `every` >= 1 positions"
            );
            l.heads
                .checked_mul(
                    l.key_dim
                        .checked_add(l.value_dim)
                        .expect("KV layout too large"),
                )
                .expect("KV layout too large");
        }
        KvCache {
            data: Block::new(dtype, 0),
            layout: layout.clone(),
            starts: vec![0; layout.layers.len()],
            dtype,
            cap: 0,
            limit: usize::MAX,
            len: 0,
            states: vec![State::Exact(Vec::new()); layout.layers.len()],
            snapshots: Vec::new(),
        }
    }

    /// The same cache with a fixed-size f32 state of `widths[li]` floats in each layer that
    /// has one (0: none), zero at the start.
    ///
    /// # Panics
    /// If `widths` does not have one entry per layer.
    pub fn with_states(mut self, widths: &[usize]) -> KvCache {
        assert_eq!(widths.len(), self.num_layers(), "one state width per layer");
        self.states = widths.iter().map(|&w| State::Exact(vec![0.0; w])).collect();
        self.snapshots.clear();
        self
    }

    /// As [`KvCache::with_states`], the states stored in the cache's dtype: for values the
    /// model rounds as the cache would ([`KvDtype::round`]) before it stores them, which then
    /// read back unchanged.
    pub fn with_rounded_states(mut self, widths: &[usize]) -> KvCache {
        assert_eq!(widths.len(), self.num_layers(), "one state width per layer");
        let dtype = self.dtype;
        self.states = widths
            .iter()
            .map(|&w| match w {
                0 => State::Exact(Vec::new()),
                w => State::Rounded(Block::new_small_pages(dtype, w)),
            })
            .collect();
        self.snapshots.clear();
        self
    }

    /// Whether any layer carries a state (then truncation goes back to a snapshot).
    pub fn has_states(&self) -> bool {
        self.states.iter().any(|s| s.len() > 0)
    }

    /// Layer `li`'s state as f32 (empty when it has none): borrowed when it is kept in f32.
    pub fn state(&self, li: usize) -> Cow<'_, [f32]> {
        match &self.states[li] {
            State::Exact(v) => Cow::Borrowed(v),
            State::Rounded(b) => {
                let mut out = vec![0.0; b.len()];
                b.load(0, &mut out);
                Cow::Owned(out)
            }
        }
    }

    /// Layer `li`'s state, read a range at a time.
    pub fn state_view(&self, li: usize) -> StateView<'_> {
        StateView(&self.states[li])
    }

    /// Layer `li`'s f32 state, to update in place.
    ///
    /// # Panics
    /// If the layer's state is kept in the cache's dtype ([`KvCache::with_rounded_states`]).
    pub fn state_mut(&mut self, li: usize) -> &mut [f32] {
        match &mut self.states[li] {
            State::Exact(v) => v,
            State::Rounded(_) => panic!("layer {li}'s state is stored in the cache's dtype"),
        }
    }

    /// Writes `src` into layer `li`'s state from float `at` on (rounded to the cache's dtype
    /// where the state is kept in it).
    pub fn store_state(&mut self, li: usize, at: usize, src: &[f32]) {
        match &mut self.states[li] {
            State::Exact(v) => v[at..at + src.len()].copy_from_slice(src),
            State::Rounded(b) => b.store(at, src),
        }
    }

    /// Keeps a copy of every layer's state at the current position, for a later
    /// [`KvCache::truncate`] to go back to (at most [`MAX_SNAPSHOTS`]; which go: [`evicted`]).
    /// Does nothing for a cache without states.
    pub fn snapshot(&mut self) {
        if !self.has_states() {
            return;
        }
        self.snapshots.retain(|s| s.len != self.len);
        let mut lens: Vec<usize> = self.snapshots.iter().map(|s| s.len).collect();
        lens.push(self.len);
        lens.sort_unstable();
        if lens.len() > MAX_SNAPSHOTS {
            // Chosen before the copy, so no more than MAX_SNAPSHOTS copies ever exist.
            let gone = lens[evicted(&lens)];
            if gone == self.len {
                return;
            }
            self.snapshots.retain(|s| s.len != gone);
        }
        self.snapshots.push(StateSnapshot {
            len: self.len,
            states: self.states.clone(),
        });
        self.snapshots.sort_by_key(|s| s.len);
    }

    /// [`KvCache::snapshot`] when `due`.
    pub fn snapshot_if(&mut self, due: bool) {
        if due {
            self.snapshot();
        }
    }

    /// The positions of the snapshots kept, ascending.
    pub fn snapshot_positions(&self) -> Vec<usize> {
        self.snapshots.iter().map(|s| s.len).collect()
    }

    /// Bytes of state (every layer's, one copy; snapshots are as many copies more).
    pub fn state_bytes(&self) -> usize {
        self.states.iter().map(State::bytes).sum()
    }

    /// The same cache, never grown past `limit` positions (doubling would otherwise allocate
    /// up to twice the context on the last growth).
    pub fn with_limit(mut self, limit: usize) -> KvCache {
        self.limit = limit.max(self.cap);
        self
    }

    /// A cache holding `keys`/`values` given per layer as row-major f32 rows (the rows of
    /// `positions` positions: `layout.layers[li].rows(positions)` rows of `key_width(li)` and
    /// `value_width(li)` floats, as a slot file stores them; longer vectors are cut to that).
    ///
    /// # Panics
    /// If `keys`/`values` do not have one entry per layer of `layout`, or one is too short.
    pub fn from_rows(
        layout: &KvLayout,
        dtype: KvDtype,
        positions: usize,
        keys: &[Vec<f32>],
        values: &[Vec<f32>],
    ) -> KvCache {
        let mut kv = KvCache::new(layout, dtype);
        assert!(keys.len() == kv.num_layers() && values.len() == kv.num_layers());
        kv.reserve(positions);
        for (li, (k, v)) in keys.iter().zip(values).enumerate() {
            let (kw, vw) = (kv.key_width(li), kv.value_width(li));
            let rows = layout.layers[li].rows(positions);
            kv.write(li, 0, &k[..rows * kw], &v[..rows * vw]);
        }
        kv.len = positions;
        kv
    }

    pub fn num_layers(&self) -> usize {
        self.layout.layers.len()
    }

    /// What each layer keeps per position.
    pub fn layout(&self) -> &KvLayout {
        &self.layout
    }

    /// The start and row width of layer `li`'s `values` (or key) run of `head`, and the rows
    /// each run has room for.
    #[inline]
    fn run(&self, li: usize, values: bool, head: usize) -> (usize, usize, usize) {
        let l = &self.layout.layers[li];
        let rows = l.rows(self.cap);
        let (before, dim) = if values {
            (l.heads * l.key_dim, l.value_dim)
        } else {
            (0, l.key_dim)
        };
        (
            self.starts[li] + rows * before + head * rows * dim,
            dim,
            rows,
        )
    }

    /// Where position `pos` of head `head` starts in the keys (`values` false) or the values
    /// of layer `li`. For a uniform (GQA) layout this is
    /// `(((li * 2 + values) * kv_heads + head) * cap + pos) * head_dim`.
    #[cfg(test)]
    fn at(&self, li: usize, values: bool, head: usize, pos: usize) -> usize {
        let (at, dim, _) = self.run(li, values, head);
        at + pos * dim
    }

    /// Floats of keys per row in layer `li` (all its heads).
    pub fn key_width(&self, li: usize) -> usize {
        let s = &self.layout.layers[li];
        s.heads * s.key_dim
    }

    /// Floats of values per row in layer `li` (0 when values are read from the keys).
    pub fn value_width(&self, li: usize) -> usize {
        let s = &self.layout.layers[li];
        s.heads * s.value_dim
    }

    /// Rows layer `li` holds (its positions' rows, [`LayerKv::rows`]).
    pub fn rows_held(&self, li: usize) -> usize {
        self.layout.layers[li].rows(self.len)
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
        let (old_starts, old_size) = starts(&self.layout, self.cap);
        let (new_starts, size) = starts(&self.layout, cap);
        let mut grown = Block::new(self.dtype, size);
        for li in 0..self.num_layers() {
            self.copy_layer(li, &mut grown, new_starts[li], cap);
            // The old copy of this layer is done with: the peak stays one layer above the
            // grown cache rather than the old and the new caches whole.
            let end = old_starts.get(li + 1).copied().unwrap_or(old_size);
            self.data.release(old_starts[li]..end);
        }
        self.data = grown;
        self.cap = cap;
        self.starts = new_starts;
    }

    /// Copies layer `li`'s stored rows (every head's key and value runs) into `to`, whose
    /// layer starts at `start` for a capacity of `cap` positions.
    fn copy_layer(&self, li: usize, to: &mut Block, start: usize, cap: usize) {
        let l = &self.layout.layers[li];
        let (rows, held) = (l.rows(cap), self.rows_held(li));
        for values in [false, true] {
            for h in 0..l.heads {
                let (from, dim, _) = self.run(li, values, h);
                let before = if values { l.heads * l.key_dim } else { 0 };
                let at = start + rows * before + h * rows * dim;
                to.copy_from(at, &self.data, from, held * dim);
            }
        }
    }

    /// A copy of the history with room for `extra` more positions (only the stored positions
    /// are copied), on ordinary pages: another, short-lived continuation of the same prefix.
    pub fn fork(&self, extra: usize) -> KvCache {
        let cap = (self.len + extra)
            .max(MIN_CAP)
            .min(self.limit.max(self.len + extra));
        let (starts, size) = starts(&self.layout, cap);
        let mut data = Block::new_small_pages(self.dtype, size);
        for (li, start) in starts.iter().enumerate() {
            self.copy_layer(li, &mut data, *start, cap);
        }
        KvCache {
            data,
            layout: self.layout.clone(),
            starts,
            dtype: self.dtype,
            cap,
            limit: self.limit,
            len: self.len,
            states: self.states.clone(),
            snapshots: self.snapshots.clone(),
        }
    }

    /// Stores row-major f32 rows `k`/`v` (`n * key_width(li)` and `n * value_width(li)`
    /// floats) of layer `li` as its rows `start .. start + n` (positions, for a layer of a row
    /// per position); room for them must have been reserved. (A layer with neither keys nor
    /// values stores nothing.)
    pub fn write(&mut self, li: usize, start: usize, k: &[f32], v: &[f32]) {
        let (kw, vw) = (self.key_width(li), self.value_width(li));
        let heads = self.layout.layers[li].heads;
        // The rows' count, from whichever of keys and values the layer keeps.
        let n = k
            .len()
            .checked_div(kw)
            .or(v.len().checked_div(vw))
            .unwrap_or(0);
        let cap_rows = self.layout.layers[li].rows(self.cap);
        assert!(start + n <= cap_rows || n == 0);
        assert!(k.len() == n * kw && v.len() == n * vw);
        for (rows, values) in [(k, false), (v, true)] {
            let l = &self.layout.layers[li];
            let dim = if values { l.value_dim } else { l.key_dim };
            if dim == 0 || heads == 0 {
                continue;
            }
            for (p, row) in rows.chunks_exact(heads * dim).enumerate() {
                for (h, src) in row.chunks_exact(dim).enumerate() {
                    let (at, _, _) = self.run(li, values, h);
                    self.data.store(at + (start + p) * dim, src);
                }
            }
        }
    }

    /// Keys and values of head `head` in layer `li`: its first `rows` rows (positions, for a
    /// layer of a row per position) of `key_dim` and of `value_dim` each (an empty values
    /// slice for a layer whose values are read from the keys).
    pub fn head(&self, li: usize, head: usize, rows: usize) -> (HeadRows<'_>, HeadRows<'_>) {
        let run = |values: bool| {
            let (at, dim, cap_rows) = self.run(li, values, head);
            debug_assert!(head < self.layout.layers[li].heads && rows <= cap_rows);
            self.data.slice(at..at + rows * dim)
        };
        (run(false), run(true))
    }

    /// Row-major f32 keys and values of layer `li` written by `positions` (what a slot file
    /// stores): the layer's rows [`LayerKv::row_range`] of them, `key_width(li)` and
    /// `value_width(li)` floats each.
    pub fn rows(&self, li: usize, positions: Range<usize>) -> (Vec<f32>, Vec<f32>) {
        let l = self.layout.layers[li];
        let rows = l.row_range(positions);
        let gather = |values: bool| {
            let dim = if values { l.value_dim } else { l.key_dim };
            let width = l.heads * dim;
            let mut out = vec![0.0f32; rows.len() * width];
            if width == 0 {
                return out;
            }
            for (row, r) in out.chunks_exact_mut(width).zip(rows.clone()) {
                for (h, dst) in row.chunks_exact_mut(dim).enumerate() {
                    let (at, _, _) = self.run(li, values, h);
                    self.data.load(at + r * dim, dst);
                }
            }
            out
        };
        (gather(false), gather(true))
    }

    /// Columns `cols` of the key rows `rows` of layer `li` (one key run), as f32 rows of
    /// `cols.len()` one after another.
    pub fn key_columns(
        &self,
        li: usize,
        rows: impl Iterator<Item = usize>,
        cols: Range<usize>,
    ) -> Vec<f32> {
        let (at, dim, cap_rows) = self.run(li, false, 0);
        assert!(self.layout.layers[li].heads == 1 && cols.end <= dim);
        let w = cols.len();
        let mut out = Vec::new();
        for r in rows {
            debug_assert!(r < cap_rows);
            let o = out.len();
            out.resize(o + w, 0.0);
            self.data.load(at + r * dim + cols.start, &mut out[o..]);
        }
        out
    }

    /// Forgets every position (keeps the allocation).
    pub fn clear(&mut self) {
        self.len = 0;
        self.states.iter_mut().for_each(State::zero);
        self.snapshots.clear();
    }

    /// Drops positions from `len` on (keeps the common prefix for reuse). With states, a
    /// state cannot be unwound: the cache goes back to the latest snapshot at or before `len`
    /// (or to the start), so it may keep fewer positions than asked; `self.len` says how many.
    pub fn truncate(&mut self, len: usize) {
        if len >= self.len {
            return;
        }
        if !self.has_states() {
            self.len = len;
            return;
        }
        self.restore(len);
    }

    /// After a failed pass that started at `len` positions: drops what it wrote. Without
    /// states, [`KvCache::truncate`]; with them, the pass may have advanced some layers' states
    /// before it failed (while `len` did not move), so the cache goes back to the latest
    /// snapshot at or before `len` even when no position was added.
    pub fn rewind(&mut self, len: usize) {
        if self.has_states() {
            self.restore(len.min(self.len));
        } else {
            self.truncate(len);
        }
    }

    /// The states and length of the latest snapshot at or before `len` (or the start).
    fn restore(&mut self, len: usize) {
        match self.snapshots.iter().rev().find(|s| s.len <= len) {
            Some(s) => {
                self.len = s.len;
                self.states.clone_from(&s.states);
            }
            None => {
                self.len = 0;
                self.states.iter_mut().for_each(State::zero);
            }
        }
        let kept = self.len;
        self.snapshots.retain(|s| s.len <= kept);
    }

    /// Bytes of KV memory per cached token (keys and values over all layers; a layer of a row
    /// per `every` positions counts `1 / every` of its row, rounded up over the whole).
    pub fn bytes_per_token(&self) -> usize {
        let mut per_every: Vec<(usize, usize)> = Vec::new();
        for l in &self.layout.layers {
            let w = l.heads * (l.key_dim + l.value_dim);
            match per_every.iter_mut().find(|(e, _)| *e == l.every) {
                Some((_, sum)) => *sum += w,
                None => per_every.push((l.every, w)),
            }
        }
        let bytes = self.dtype.bytes() as f64;
        per_every
            .iter()
            .map(|&(e, w)| w as f64 * bytes / e as f64)
            .sum::<f64>()
            .ceil() as usize
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rows(n: usize, kvd: usize, seed: f32) -> Vec<f32> {
        // Small integers: exact in f16 too, so both dtypes round-trip them.
        (0..n * kvd).map(|i| seed + (i % 997) as f32).collect()
    }

    fn gqa(num_layers: usize, heads: usize, head_dim: usize, dtype: KvDtype) -> KvCache {
        KvCache::new(&KvLayout::uniform(num_layers, heads, head_dim), dtype)
    }

    fn to_f32(r: HeadRows<'_>) -> Vec<f32> {
        match r {
            HeadRows::F32(x) => x.to_vec(),
            HeadRows::F16(x) => x.iter().map(|v| v.to_f32()).collect(),
        }
    }

    /// A cache of one state layer whose state is its length (so a truncation shows which
    /// snapshot it went back to).
    fn stateful() -> KvCache {
        KvCache::new(&KvLayout::uniform(1, 1, 2), KvDtype::F32).with_states(&[1])
    }

    fn advance(kv: &mut KvCache, to: usize) {
        kv.reserve(to - kv.len);
        kv.len = to;
        kv.state_mut(0)[0] = to as f32;
    }

    #[test]
    fn snapshots_spread_over_a_long_history_and_keep_the_newest_two() {
        let mut kv = stateful();
        // An agent's first prompt: 17,500 tokens, a snapshot every 1024 and at its end and the
        // token before; then eight turns of 300 tokens, each ending in a snapshot.
        for at in (1024..17_499).step_by(1024).chain([17_499, 17_500]) {
            advance(&mut kv, at);
            kv.snapshot();
            assert!(kv.snapshot_positions().len() <= MAX_SNAPSHOTS);
        }
        let lens = kv.snapshot_positions();
        assert_eq!(lens[2..], [17_499, 17_500], "{lens:?}");
        for turn in 1..=8 {
            advance(&mut kv, 17_500 + 300 * turn);
            kv.snapshot();
        }
        let lens = kv.snapshot_positions();
        assert_eq!(lens.len(), MAX_SNAPSHOTS);
        assert_eq!(lens[2..], [19_600, 19_900], "{lens:?}");
        // Every stretch between snapshots is at most about a third of the history...
        let mut prev = 0;
        for &l in &lens {
            assert!(l - prev <= 19_900 / 2, "{lens:?}");
            prev = l;
        }
        // ... so another session leaving the shared preamble at 17,000 resumes from a snapshot
        // within it (dropping the oldest would have left only the last four turns: from 0).
        kv.truncate(17_000);
        assert_eq!(kv.len, 16_384, "{lens:?}");
        assert_eq!(kv.state(0)[0], kv.len as f32);
    }

    #[test]
    fn the_evicted_snapshot_leaves_the_shortest_gap_and_never_one_of_the_newest_two() {
        assert_eq!(
            evicted(&[1, 2, 3, 4, 5]),
            2,
            "equal gaps: the later of the candidates"
        );
        assert_eq!(evicted(&[1000, 8000, 9000, 9001, 9002]), 2);
        assert_eq!(evicted(&[5, 10, 7000, 9001, 9002]), 0);
        assert_eq!(evicted(&[4000, 4100, 5000, 9001, 9002]), 1);
        assert_eq!(evicted(&[3000, 6000, 9000, 9100, 9101]), 2);
    }

    #[test]
    fn growth_doubles_leaves_headroom_and_stops_at_the_limit() {
        let mut kv = gqa(1, 2, 4, KvDtype::F16).with_limit(100);
        kv.reserve(10);
        assert_eq!(kv.cap, MIN_CAP);
        kv.len = 64;
        kv.reserve(1);
        assert_eq!(kv.cap, 100, "doubling to 128 would pass the limit");
        let mut free = gqa(1, 2, 4, KvDtype::F16);
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
        let mut small = gqa(1, 2, 4, KvDtype::F32).with_limit(8);
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
        let layout = KvLayout::uniform(2, heads, hd);
        let mut kv = KvCache::new(&layout, dtype);
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
        let got = to_f32(kv.head(0, 2, 105).0);
        assert_eq!(got, want);
        kv.truncate(3);
        assert_eq!(kv.len, 3);
        assert_eq!(kv.rows(0, 1..3).0, k0[kvd..3 * kvd]);
        let back = KvCache::from_rows(
            &layout,
            dtype,
            105,
            &[k.clone(), k.clone()],
            &[v.clone(), v.clone()],
        );
        assert_eq!(back.rows(0, 0..105), (k, v));
    }

    #[test]
    fn a_uniform_layout_keeps_the_gqa_offsets() {
        // The offsets of the cache before layouts: (((li * 2 + values) * kv_heads + head) * cap
        // + pos) * head_dim, every layer's keys then values in one buffer.
        let (layers, heads, hd) = (3, 4, 8);
        let mut kv = gqa(layers, heads, hd, KvDtype::F32);
        kv.reserve(70);
        let cap = kv.cap;
        for li in 0..layers {
            for values in [false, true] {
                for head in 0..heads {
                    for pos in [0, 1, 37, cap - 1] {
                        let old =
                            (((li * 2 + usize::from(values)) * heads + head) * cap + pos) * hd;
                        assert_eq!(kv.at(li, values, head, pos), old);
                    }
                }
            }
        }
        assert_eq!(starts(&kv.layout, cap).1, layers * 2 * heads * cap * hd);
        assert_eq!(kv.bytes_per_token(), layers * heads * hd * 2 * 4);
        assert_eq!(
            (kv.key_width(2), kv.value_width(2)),
            (heads * hd, heads * hd)
        );
    }

    /// MLA-like (one run of 576-wide keys, no values), a layer with no per-position KV, and a
    /// GQA layer after them.
    fn mixed() -> KvLayout {
        KvLayout {
            layers: vec![
                LayerKv::per_position(1, 576, 0),
                LayerKv::per_position(0, 0, 0),
                LayerKv::per_position(2, 4, 4),
            ],
        }
    }

    #[test]
    fn rounded_states_keep_the_cache_dtype_and_read_back_what_was_rounded() {
        let layout = KvLayout::uniform(2, 1, 2);
        for dtype in [KvDtype::F16, KvDtype::F32] {
            let mut kv = KvCache::new(&layout, dtype).with_rounded_states(&[0, 6]);
            assert_eq!(kv.state_bytes(), 6 * dtype.bytes());
            let mut v = vec![0.1f32, -2.3, 1e-3, 65504.0, 0.0, 2.71];
            dtype.round(&mut v);
            kv.store_state(1, 0, &v[..4]);
            kv.store_state(1, 4, &v[4..]);
            assert_eq!(*kv.state(1), v[..]);
            let mut got = vec![7.0];
            kv.state_view(1).extend(2..5, &mut got);
            assert_eq!(got, [7.0, v[2], v[3], v[4]]);
            assert!(kv.state(0).is_empty());
            // Snapshots and truncation carry them like f32 states.
            kv.len = 3;
            kv.snapshot();
            kv.store_state(1, 0, &[0.5; 6]);
            kv.len = 5;
            kv.truncate(4);
            assert_eq!((kv.len, &*kv.state(1)), (3, &v[..]));
            kv.clear();
            assert_eq!(*kv.state(1), [0.0; 6]);
        }
    }

    #[test]
    #[should_panic(expected = "stored in the cache's dtype")]
    fn a_rounded_state_is_not_handed_out_as_f32_to_update() {
        let mut kv =
            KvCache::new(&KvLayout::uniform(1, 1, 2), KvDtype::F16).with_rounded_states(&[4]);
        kv.state_mut(0)[0] = 1.0;
    }

    #[test]
    fn a_failed_pass_rewinds_states_it_advanced_without_adding_positions() {
        let layout = KvLayout::uniform(1, 1, 2);
        let mut kv = KvCache::new(&layout, KvDtype::F32).with_states(&[3]);
        kv.reserve(8);
        kv.len = 5;
        kv.state_mut(0).copy_from_slice(&[1.0, 2.0, 3.0]);
        kv.snapshot();
        // A pass advanced the state, then failed before its positions counted.
        kv.state_mut(0).fill(9.0);
        kv.truncate(5);
        assert_eq!(
            *kv.state(0),
            [9.0; 3],
            "truncate keeps what it cannot know about"
        );
        kv.rewind(5);
        assert_eq!((kv.len, &*kv.state(0)), (5, &[1.0, 2.0, 3.0][..]));
        // Without states, a rewind is a truncation.
        let mut plain = KvCache::new(&layout, KvDtype::F32);
        plain.reserve(8);
        plain.len = 6;
        plain.rewind(4);
        assert_eq!(plain.len, 4);
    }

    /// A layer of a row per position, one of a row per 3 positions (compressed entries), one
    /// of a row per 8 with values.
    fn sparse() -> KvLayout {
        KvLayout {
            layers: vec![
                LayerKv::per_position(1, 4, 0),
                LayerKv {
                    every: 3,
                    ..LayerKv::per_position(1, 5, 0)
                },
                LayerKv {
                    every: 8,
                    ..LayerKv::per_position(2, 2, 1)
                },
            ],
        }
    }

    #[test]
    fn a_layer_of_a_row_per_several_positions_keeps_only_its_rows() {
        for dtype in [KvDtype::F32, KvDtype::F16] {
            let layout = sparse();
            let mut kv = KvCache::new(&layout, dtype);
            // 4 + 5/3 + 6/8 floats per position, rounded up over the whole.
            let want = ((4.0 + 5.0 / 3.0 + 6.0 / 8.0) * dtype.bytes() as f64).ceil() as usize;
            assert_eq!(kv.bytes_per_token(), want);
            // Positions written pass by pass; a layer gets the rows its positions complete.
            let mut truth: Vec<(Vec<f32>, Vec<f32>)> = vec![Default::default(); 3];
            for (pass, n) in [5usize, 1, 1, 70, 2].into_iter().enumerate() {
                kv.reserve(n);
                let (p0, end) = (kv.len, kv.len + n);
                for (li, l) in layout.layers.iter().enumerate() {
                    let r = l.row_range(p0..end);
                    let (kw, vw) = (kv.key_width(li), kv.value_width(li));
                    let k = rows(r.len(), kw, (pass * 10 + li) as f32);
                    let v = rows(r.len(), vw, (500 + pass) as f32);
                    kv.write(li, r.start, &k, &v);
                    truth[li].0.extend(k);
                    truth[li].1.extend(v);
                }
                kv.len = end;
            }
            assert_eq!(kv.len, 79);
            assert_eq!(
                (kv.rows_held(0), kv.rows_held(1), kv.rows_held(2)),
                (79, 26, 9)
            );
            for (li, t) in truth.iter().enumerate() {
                assert_eq!(&kv.rows(li, 0..79), t, "layer {li}");
            }
            // Positions 7..25 write rows 2..8 of the layer of a row per 3.
            assert_eq!(kv.rows(1, 7..25).0, truth[1].0[2 * 5..8 * 5]);
            assert_eq!(kv.key_columns(1, [4, 0].into_iter(), 1..3), {
                let k = &truth[1].0;
                [&k[21..23], &k[1..3]].concat()
            });
            let fork = kv.fork(10);
            let back = KvCache::from_rows(
                &layout,
                dtype,
                79,
                &truth.iter().map(|t| t.0.clone()).collect::<Vec<_>>(),
                &truth.iter().map(|t| t.1.clone()).collect::<Vec<_>>(),
            );
            for (li, t) in truth.iter().enumerate() {
                assert_eq!(&fork.rows(li, 0..79), t);
                assert_eq!(&back.rows(li, 0..79), t);
            }
            // Truncation keeps the rows of the positions kept.
            kv.truncate(17);
            assert_eq!((kv.rows_held(1), kv.rows_held(2)), (5, 2));
            assert_eq!(kv.rows(1, 0..17).0, truth[1].0[..5 * 5]);
        }
    }

    #[test]
    fn a_mixed_layout_round_trips_through_growth_and_truncation() {
        for dtype in [KvDtype::F32, KvDtype::F16] {
            mixed_round_trip(dtype);
        }
    }

    fn mixed_round_trip(dtype: KvDtype) {
        let layout = mixed();
        let mut kv = KvCache::new(&layout, dtype);
        let widths: Vec<(usize, usize)> = (0..3)
            .map(|li| (kv.key_width(li), kv.value_width(li)))
            .collect();
        assert_eq!(widths, [(576, 0), (0, 0), (8, 8)]);
        assert_eq!(kv.bytes_per_token(), (576 + 16) * dtype.bytes());
        let write = |kv: &mut KvCache, start: usize, n: usize, seed: f32| {
            let mut out = Vec::new();
            for (li, &(kw, vw)) in widths.iter().enumerate() {
                let (k, v) = (rows(n, kw, seed + li as f32), rows(n, vw, seed + 50.0));
                kv.write(li, start, &k, &v);
                out.push((k, v));
            }
            out
        };
        kv.reserve(5);
        let first = write(&mut kv, 0, 5, 0.0);
        kv.len = 5;
        kv.reserve(100); // grows: every layer's history moves
        assert!(kv.cap >= 105);
        let second = write(&mut kv, 5, 100, 200.0);
        kv.len = 105;
        let mut keys = Vec::new();
        let mut values = Vec::new();
        for li in 0..3 {
            let (k, v) = kv.rows(li, 0..105);
            assert_eq!(k, [first[li].0.clone(), second[li].0.clone()].concat());
            assert_eq!(v, [first[li].1.clone(), second[li].1.clone()].concat());
            keys.push(k);
            values.push(v);
        }
        // The MLA layer's one head is its whole rows; its values are empty.
        let (hk, hv) = kv.head(0, 0, 105);
        assert_eq!(to_f32(hk), keys[0]);
        assert!(to_f32(hv).is_empty());
        // The GQA layer behind it: head 1 is the second half of every row.
        let (hk, hv) = kv.head(2, 1, 105);
        let half =
            |r: &[f32]| -> Vec<f32> { r.chunks_exact(8).flat_map(|r| r[4..].to_vec()).collect() };
        assert_eq!(to_f32(hk), half(&keys[2]));
        assert_eq!(to_f32(hv), half(&values[2]));
        assert_eq!(kv.rows(1, 0..105), (vec![], vec![]));
        // Truncation, then new positions over the dropped ones.
        kv.truncate(3);
        let third = write(&mut kv, 3, 2, 600.0);
        kv.len = 5;
        for li in 0..3 {
            let (k, v) = kv.rows(li, 0..5);
            let (kw, vw) = widths[li];
            assert_eq!(k, [&first[li].0[..3 * kw], &third[li].0[..]].concat());
            assert_eq!(v, [&first[li].1[..3 * vw], &third[li].1[..]].concat());
        }
        let back = KvCache::from_rows(&layout, dtype, 105, &keys, &values);
        for li in 0..3 {
            assert_eq!(
                back.rows(li, 0..105),
                (keys[li].clone(), values[li].clone())
            );
        }
        assert_eq!(back.len, 105);
        // A layout without any per-position KV takes no memory and still counts positions.
        let mut none = KvCache::new(&KvLayout::uniform(2, 0, 0), dtype);
        none.reserve(10);
        none.write(1, 0, &[], &[]);
        assert_eq!(none.bytes_per_token(), 0);
        assert_eq!(none.rows(0, 0..10), (vec![], vec![]));
    }
}
