//! Tiered experts: routed experts staged from disk into a bounded cache when a token routes to
//! them (docs/ARCHITECTURE.md, "Tiered experts").
//!
//! The cache is an arena of `record_size` slots (one expert record each: gate, up and down
//! together, as the converter lays them out). A request for one layer's experts ([`ExpertStore::
//! request`]) pins the cached ones at once and starts one read per missing record; the caller
//! takes records as they become ready ([`Batch::next_ready`]), so it computes cached experts
//! while the others load. A record in use is pinned and never evicted; when every slot is pinned
//! a miss waits for one to be released, so any budget of at least one record runs.
//!
//! Slots evict least-recently-used first ([`Policy`]); a pinned (permanent) part holds the
//! hottest experts from the routing heat. Nothing here changes results: a record's bytes are the
//! file's bytes wherever they come from, and the model sums experts in a fixed order.

pub mod heat;
mod io;
pub mod policy;
pub mod profile;

use std::collections::{HashMap, VecDeque};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

pub use io::IoBackend;
pub use policy::Policy;

use crate::error::{Error, Result};
use io::{ReadReq, Reader};
use policy::LruLists;

const NIL: u32 = u32::MAX;

/// How routed experts are held. The default keeps every expert in RAM (read whole at load), as
/// before; a `ram_bytes` budget turns on the expert cache.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ExpertOptions {
    /// RAM for routed experts, in bytes: the cache plus the pinned part. `None`: every expert is
    /// read into RAM at load (no cache, no disk reads afterwards). At least one record is used
    /// whatever the budget; a budget above the experts file's size caches all of it.
    pub ram_bytes: Option<u64>,
    /// Part of `ram_bytes` that holds the hottest experts (routing heat) for the whole run,
    /// loaded at start. Clamped so that at least `top_k` records (one token's layer) stay for
    /// the cache.
    pub pin_bytes: u64,
    /// Read with `O_DIRECT`, bypassing the page cache (falls back to buffered reads, noted in
    /// [`StoreStats::notes`], where the file system refuses it).
    pub direct_io: bool,
    /// Start reading the next layer's likely experts (router look-ahead) before they are needed.
    pub prefetch: bool,
    pub io: IoBackend,
    pub policy: Policy,
    /// Where the routing heat (`routing-heat.json`) is read from and saved to.
    pub heat: heat::HeatHome,
}

impl Default for ExpertOptions {
    fn default() -> Self {
        ExpertOptions {
            ram_bytes: None,
            pin_bytes: 0,
            direct_io: false,
            prefetch: false,
            io: IoBackend::Auto,
            policy: Policy::GlobalLru,
            heat: heat::HeatHome::ModelDir,
        }
    }
}

impl ExpertOptions {
    /// Options from the environment: `COLI_RAM_GB` (budget in GB = 1e9 bytes, fractional ok),
    /// `COLI_PIN_GB`, `COLI_DIRECT_IO=1`, `COLI_PREFETCH=1`, `COLI_IO=auto|uring|pread`,
    /// `COLI_CACHE_POLICY=global|layer|freq`. Unset variables keep the defaults.
    pub fn from_env() -> Result<ExpertOptions> {
        let mut o = ExpertOptions::default();
        let vars = crate::settings::expert_vars();
        let gb = |k: &str, v: String| -> Result<u64> {
            match v.trim().parse::<f64>() {
                Ok(g) if g.is_finite() && g >= 0.0 => Ok((g * 1e9) as u64),
                _ => Err(Error::Input(format!(
                    "{k}={v}: expected a number of GB >= 0"
                ))),
            }
        };
        let flag = |v: String| matches!(v.trim(), "1" | "true" | "yes" | "on");
        if let Some(v) = vars.ram_gb {
            o.ram_bytes = Some(gb("COLI_RAM_GB", v)?);
        }
        if let Some(v) = vars.pin_gb {
            o.pin_bytes = gb("COLI_PIN_GB", v)?;
        }
        if let Some(v) = vars.direct_io {
            o.direct_io = flag(v);
        }
        if let Some(v) = vars.prefetch {
            o.prefetch = flag(v);
        }
        if let Some(v) = vars.io {
            o.io = IoBackend::parse(v.trim()).ok_or_else(|| {
                Error::Input(format!("COLI_IO={v}: expected auto, uring or pread"))
            })?;
        }
        if let Some(v) = vars.cache_policy {
            o.policy = match v.trim() {
                "global" => Policy::GlobalLru,
                "layer" => Policy::PerLayerLru,
                "freq" => Policy::GlobalLruFreq,
                _ => {
                    return Err(Error::Input(format!(
                        "COLI_CACHE_POLICY={v}: expected global, layer or freq"
                    )))
                }
            };
        }
        Ok(o)
    }
}

/// The default expert budget for the model in `dir`: `None` (every expert resident, the fastest)
/// when the experts file fits in available memory beside the resident part (and the copies a
/// model makes of it at load) with `reserve_bytes` to spare (KV cache, activations, the rest of
/// the system), else the bytes that do fit (at least one record). Available memory is `MemAvailable` from `/proc/meminfo` (Linux); where it
/// cannot be read, `None`.
pub fn fit_ram_bytes(dir: &Path, reserve_bytes: u64) -> Result<Option<u64>> {
    let m = crate::format::read_manifest(dir)?;
    let Some(x) = &m.experts else {
        return Ok(None);
    };
    let size = |name: &str| -> Result<u64> {
        let p = dir.join(name);
        Ok(std::fs::metadata(&p).map_err(io_err(&p))?.len())
    };
    // The resident file, and the copies of it the model makes at load (MLA's `kv_b` by
    // columns).
    let resident = size(&m.resident.file)? + crate::model::layers::mla::kv_b_columns_bytes(&m);
    let experts = size(&x.file)?;
    let Some(avail) = mem_available() else {
        return Ok(None);
    };
    let room = avail.saturating_sub(resident).saturating_sub(reserve_bytes);
    if room >= experts {
        return Ok(None);
    }
    Ok(Some(room.max(x.record_size as u64)))
}

/// `MemAvailable` in bytes (Linux), else `None`.
fn mem_available() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

/// Counters of a store since it opened (differences between two snapshots give a turn's).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct StoreStats {
    /// Expert requests served from RAM (cached, pinned, or already being read).
    pub hits: u64,
    /// Expert requests that started a read.
    pub misses: u64,
    /// Bytes read from the experts file (demand reads and prefetches).
    pub bytes_read: u64,
    pub reads: u64,
    /// Reads started by prefetch, and how many of those records were then requested.
    pub prefetch_reads: u64,
    pub prefetch_used: u64,
    /// Time callers spent blocked waiting for records.
    pub io_wait_s: f64,
    /// Read busy time: wall-clock seconds during which at least one expert read was in flight
    /// (the store's `BusyClock`: from the read's slot assignment to its completion). Reads
    /// that overlap count once; `read_busy_s - io_wait_s` is the read time no caller waited
    /// for: hidden behind compute.
    #[serde(default)]
    pub read_busy_s: f64,
    /// Slots: all of them, and the pinned ones among them.
    pub slots: usize,
    pub pinned: usize,
    pub record_size: usize,
    /// `"io_uring"` or `"pread"`, and whether `O_DIRECT` is in effect.
    pub io: String,
    pub direct_io: bool,
    /// Fallbacks taken at open (io_uring refused, O_DIRECT unsupported, budget rounded up).
    pub notes: Vec<String>,
}

/// Where an expert record is now ([`ExpertStore::tiers`], `Model::expert_tiers`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Tier {
    /// In RAM for the whole run because the model has no expert cache (every expert read at
    /// load).
    Resident,
    /// In the pinned part of the cache: the hottest by routing heat, read at load, never evicted.
    Pinned,
    /// In the cache's LRU part now.
    Cached,
    /// Not in RAM (or its read is still in flight): its next use reads the experts file.
    Disk,
}

impl Tier {
    /// One letter per tier (`r`, `p`, `c`, `d`): how the server's routing map spells it.
    pub fn letter(self) -> char {
        match self {
            Tier::Resident => 'r',
            Tier::Pinned => 'p',
            Tier::Cached => 'c',
            Tier::Disk => 'd',
        }
    }
}

/// Where the experts are in the file, per record.
pub(crate) struct StoreLayout {
    pub path: PathBuf,
    pub record_size: usize,
    /// MoE layer ordinal (0..moe_layers) of each record.
    pub rec_layer: Vec<u32>,
    pub moe_layers: usize,
    pub top_k: usize,
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum St {
    Empty,
    Loading,
    Ready,
}

#[derive(Clone, Copy)]
struct Slot {
    rec: u32,
    st: St,
    permanent: bool,
    /// Loaded by a prefetch and not requested since.
    prefetched: bool,
}

struct State {
    slots: Vec<Slot>,
    /// record -> slot (NIL: not in RAM).
    at: Vec<u32>,
    /// record -> how many holders (batches, record refs) keep it from eviction.
    pins: Vec<u32>,
    /// Demand misses waiting for a free slot, and whether each record is queued.
    queue: VecDeque<u32>,
    queued: Vec<bool>,
    /// Read errors of records someone waits for.
    failed: HashMap<u32, String>,
    lru: LruLists,
    /// record -> its LRU list.
    list_of_rec: Vec<u32>,
    /// Request frequencies (kept for the global policies; `policy::freq_insert` says whether
    /// every miss is inserted by them).
    freq: Option<policy::Freq>,
    /// Every miss is inserted by frequency (the policy's choice for this cache).
    freq_always: bool,
    /// The misses of the current request are: always, or for a step of several sequences
    /// whose experts together overflow the cache.
    by_freq_now: bool,
    /// Records of one layer's request above which a step's requests over every MoE layer
    /// overflow the cache (its unpinned slots / MoE layers).
    overflow_at: usize,
    /// Reads in flight and since when (feeds `stats.read_busy_s`).
    busy: BusyClock,
    stats: StoreStats,
}

/// Wall time during which at least one read is in flight. A read is in flight from the moment
/// the store gives it a cache slot and queues it for the reader ([`ExpertStore::assign`], the
/// pinned load at open) until its completion is recorded ([`io::Complete::complete`], success
/// or error); both ends happen under the state lock, so the count is exact. The clock runs
/// while the count is above zero: overlapping reads count once, gaps with no read count
/// nothing. It reads the time only when the count leaves or returns to zero (two
/// `Instant::now()` per busy period, none per read in between).
#[derive(Clone, Copy, Debug, Default)]
struct BusyClock {
    in_flight: u32,
    /// When the count last left zero (meaningful while `in_flight > 0`).
    since: Option<Instant>,
    /// Closed busy periods.
    total: Duration,
}

impl BusyClock {
    fn start(&mut self, now: impl FnOnce() -> Instant) {
        if self.in_flight == 0 {
            self.since = Some(now());
        }
        self.in_flight += 1;
    }

    fn finish(&mut self, now: impl FnOnce() -> Instant) {
        debug_assert!(self.in_flight > 0, "a read finished that never started");
        self.in_flight = self.in_flight.saturating_sub(1);
        if self.in_flight == 0 {
            if let Some(t) = self.since.take() {
                self.total += now().saturating_duration_since(t);
            }
        }
    }

    /// Busy time up to `now`, the open period included.
    fn busy_at(&self, now: Instant) -> Duration {
        match self.since {
            Some(t) if self.in_flight > 0 => self.total + now.saturating_duration_since(t),
            _ => self.total,
        }
    }
}

/// The cache memory: `slots * record_size` bytes of anonymous memory (huge pages advised).
struct Arena {
    map: memmap2::MmapMut,
    base: *mut u8,
    record_size: usize,
}

// SAFETY: the arena is only accessed through raw slot pointers under the store's slot protocol:
// a slot is written only by its one in-flight read (state `Loading`, no readers), and read only
// through `RecordRef`s while `Ready` and pinned (never re-assigned while pinned).
unsafe impl Send for Arena {}
// SAFETY: as above.
unsafe impl Sync for Arena {}

impl Arena {
    fn new(slots: usize, record_size: usize) -> std::io::Result<Arena> {
        let mut map = memmap2::MmapMut::map_anon((slots * record_size).max(1))?;
        #[cfg(target_os = "linux")]
        let _ = map.advise(memmap2::Advice::HugePage);
        let base = map.as_mut_ptr();
        Ok(Arena {
            map,
            base,
            record_size,
        })
    }

    fn ptr(&self, slot: u32) -> *mut u8 {
        debug_assert!((slot as usize + 1) * self.record_size <= self.map.len());
        // SAFETY: in bounds of the map (slot < slots).
        unsafe { self.base.add(slot as usize * self.record_size) }
    }
}

struct Shared {
    state: Mutex<State>,
    ready: Condvar,
    arena: Arena,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl io::Complete for Shared {
    fn complete(&self, slot: u32, len: usize, r: std::io::Result<()>) {
        let mut s = self.lock();
        let sl = &mut s.slots[slot as usize];
        debug_assert_eq!(sl.st, St::Loading);
        let rec = sl.rec;
        match r {
            Ok(()) => {
                sl.st = St::Ready;
                s.stats.bytes_read += len as u64;
            }
            Err(e) => {
                *sl = Slot {
                    rec: NIL,
                    st: St::Empty,
                    permanent: sl.permanent,
                    prefetched: false,
                };
                s.at[rec as usize] = NIL;
                if !s.slots[slot as usize].permanent {
                    s.lru.remove(slot as usize);
                    let list = s.list_of_rec[rec as usize] as usize;
                    s.lru.push_back(list, slot as usize);
                }
                if s.pins[rec as usize] > 0 {
                    s.failed.insert(rec, e.to_string());
                }
            }
        }
        s.busy.finish(Instant::now);
        drop(s);
        self.ready.notify_all();
    }
}

/// A bounded cache of expert records over the experts file. See the module doc.
pub struct ExpertStore {
    shared: Arc<Shared>,
    path: PathBuf,
    reader: Reader,
    record_size: usize,
    records: usize,
    /// Every record has a slot of its own: after warm-up nothing is read or evicted.
    holds_all: bool,
}

impl ExpertStore {
    /// Opens the store: sizes the arena from `opts`, starts the reader, and loads `hot` (records,
    /// hottest first) into the pinned part.
    pub(crate) fn open(layout: StoreLayout, opts: &ExpertOptions, hot: &[u32]) -> Result<Self> {
        Self::open_with(layout, opts, hot, Duration::ZERO)
    }

    /// [`ExpertStore::open`] whose pread reads each take at least `slow` (tests: a disk of
    /// known speed; zero in the engine).
    fn open_with(
        layout: StoreLayout,
        opts: &ExpertOptions,
        hot: &[u32],
        slow: Duration,
    ) -> Result<Self> {
        let rs = layout.record_size;
        let records = layout.rec_layer.len();
        let mut notes = Vec::new();
        let budget = opts.ram_bytes.unwrap_or(u64::MAX);
        let mut slots = ((budget / rs as u64) as usize).min(records);
        if slots == 0 {
            notes.push(format!(
                "budget below one expert record ({rs} bytes): using one"
            ));
            slots = 1;
        }
        let keep = layout.top_k.min(slots);
        let mut pinned = ((opts.pin_bytes / rs as u64) as usize).min(slots - keep);
        if slots == records {
            pinned = 0; // everything fits: nothing to choose
        }
        // The saved routing heat, hottest first: what to pin, and the frequencies' prior.
        let heat_order: Vec<u32> = hot
            .iter()
            .copied()
            .filter(|&r| (r as usize) < records)
            .collect();
        let hot: Vec<u32> = heat_order.iter().copied().take(pinned).collect();
        pinned = hot.len();
        let mut cache = slots - pinned;
        if opts.policy == Policy::PerLayerLru && cache < layout.moe_layers {
            notes.push(format!(
                "per-layer cache needs one record per layer: {} slots instead of {cache}",
                layout.moe_layers
            ));
            cache = layout.moe_layers;
        }
        let slots = pinned + cache;
        let freq_always = policy::freq_insert(opts.policy, cache, layout.moe_layers, layout.top_k);
        let freq = (opts.policy != Policy::PerLayerLru).then(|| {
            let mut f = policy::Freq::new(records, policy::hot_slots(cache));
            f.seed(&heat_order);
            f
        });
        let (lists, list_of_slot) = policy::partition(opts.policy, cache, layout.moe_layers);
        let list_of_rec: Vec<u32> = layout
            .rec_layer
            .iter()
            .map(|&l| if lists == 1 { 0 } else { l })
            .collect();
        let mut lru = LruLists::new(slots, lists);
        for (i, &l) in list_of_slot.iter().enumerate() {
            lru.push_back(l, pinned + i);
        }
        let (file, direct) =
            io::open(&layout.path, opts.direct_io).map_err(io_err(&layout.path))?;
        if opts.direct_io && !direct {
            notes.push("O_DIRECT not supported by this file system: buffered reads".into());
        }
        let len = file.metadata().map_err(io_err(&layout.path))?.len();
        if len < (records * rs) as u64 {
            return Err(Error::Format(format!(
                "{} is {len} bytes, smaller than its {records} records of {rs} bytes",
                layout.path.display()
            )));
        }
        let arena = Arena::new(slots, rs).map_err(io_err(&layout.path))?;
        let state = State {
            slots: vec![
                Slot {
                    rec: NIL,
                    st: St::Empty,
                    permanent: false,
                    prefetched: false,
                };
                slots
            ],
            at: vec![NIL; records],
            pins: vec![0; records],
            queue: VecDeque::new(),
            queued: vec![false; records],
            failed: HashMap::new(),
            lru,
            list_of_rec,
            freq,
            freq_always,
            by_freq_now: freq_always,
            overflow_at: cache / layout.moe_layers.max(1),
            busy: BusyClock::default(),
            stats: StoreStats {
                slots,
                pinned,
                record_size: rs,
                direct_io: direct,
                ..Default::default()
            },
        };
        let shared = Arc::new(Shared {
            state: Mutex::new(state),
            ready: Condvar::new(),
            arena,
        });
        let (reader, note) = Reader::start(&file, opts.io, shared.clone(), slow)
            .map_err(|e| Error::Input(format!("cannot start expert readers: {e}")))?;
        notes.extend(note);
        {
            let mut s = shared.lock();
            s.stats.io = reader.name.to_string();
            s.stats.notes = notes;
        }
        let store = ExpertStore {
            shared,
            path: layout.path.clone(),
            reader,
            record_size: rs,
            records,
            holds_all: slots == records,
        };
        store.load_pinned(&hot)?;
        Ok(store)
    }

    /// Reads `hot` into slots `0..hot.len()`, marked permanent, and waits for them.
    fn load_pinned(&self, hot: &[u32]) -> Result<()> {
        if hot.is_empty() {
            return Ok(());
        }
        let mut reqs = Vec::new();
        {
            let mut s = self.shared.lock();
            for (i, &rec) in hot.iter().enumerate() {
                s.slots[i] = Slot {
                    rec,
                    st: St::Loading,
                    permanent: true,
                    prefetched: false,
                };
                s.at[rec as usize] = i as u32;
                s.pins[rec as usize] += 1;
                reqs.push(self.req(i as u32, rec));
                s.stats.reads += 1;
                s.busy.start(Instant::now);
            }
        }
        self.reader.submit(reqs);
        let mut s = self.shared.lock();
        loop {
            if let Some((_, e)) = s.failed.iter().next() {
                return Err(Error::Input(format!("reading pinned experts: {e}")));
            }
            if hot.iter().all(|&r| {
                s.at[r as usize] != NIL && s.slots[s.at[r as usize] as usize].st == St::Ready
            }) {
                for &r in hot {
                    s.pins[r as usize] -= 1;
                }
                return Ok(());
            }
            s = self.shared.ready.wait(s).unwrap_or_else(|e| e.into_inner());
        }
    }

    fn req(&self, slot: u32, rec: u32) -> ReadReq {
        ReadReq {
            slot,
            dst: self.shared.arena.ptr(slot),
            len: self.record_size,
            offset: rec as u64 * self.record_size as u64,
        }
    }

    pub fn record_size(&self) -> usize {
        self.record_size
    }

    /// The counters now (`read_busy_s` includes a busy period still open).
    pub fn stats(&self) -> StoreStats {
        let s = self.shared.lock();
        let mut st = s.stats.clone();
        st.read_busy_s = s.busy.busy_at(Instant::now()).as_secs_f64();
        st
    }

    /// Takes a slot for `rec` (which is in no slot) if one can be evicted; returns its read.
    fn assign(&self, s: &mut State, rec: u32, prefetch: bool) -> Option<ReadReq> {
        let list = s.list_of_rec[rec as usize] as usize;
        let v = {
            let (slots, pins) = (&s.slots, &s.pins);
            s.lru.victim(list, |i| {
                let sl = &slots[i];
                sl.st != St::Loading && (sl.rec == NIL || pins[sl.rec as usize] == 0)
            })?
        };
        let old = s.slots[v].rec;
        if old != NIL {
            s.at[old as usize] = NIL;
        }
        s.slots[v] = Slot {
            rec,
            st: St::Loading,
            permanent: false,
            prefetched: prefetch,
        };
        s.at[rec as usize] = v as u32;
        if s.by_freq_now && s.freq.as_ref().is_some_and(|f| !f.is_hot(rec as usize)) {
            // A rare record: next to go once released, so frequent ones stay.
            s.lru.remove(v);
            s.lru.push_back(list, v);
        } else {
            s.lru.touch(v);
        }
        s.stats.reads += 1;
        s.busy.start(Instant::now);
        if prefetch {
            s.stats.prefetch_reads += 1;
        }
        Some(self.req(v as u32, rec))
    }

    /// Gives freed slots to queued misses, in arrival order.
    fn schedule(&self, s: &mut State) -> Vec<ReadReq> {
        let mut reqs = Vec::new();
        let mut i = 0;
        while i < s.queue.len() {
            let rec = s.queue[i];
            if s.pins[rec as usize] == 0 {
                // Nobody waits for it any more.
                s.queue.remove(i);
                s.queued[rec as usize] = false;
                continue;
            }
            match self.assign(s, rec, false) {
                Some(r) => {
                    reqs.push(r);
                    s.queue.remove(i);
                    s.queued[rec as usize] = false;
                }
                None => i += 1,
            }
        }
        reqs
    }

    /// Pins `records` (one layer's experts) and starts reading the missing ones. Take them with
    /// [`Batch::next_ready`].
    pub fn request(&self, records: &[u32]) -> Batch<'_> {
        self.request_for(records, false)
    }

    /// [`ExpertStore::request`] for a step of `several` sequences at once: when their union
    /// (this layer's records, over every MoE layer) overflows the cache, its misses (and the
    /// reads they queue, and prefetches until the next request) are inserted by frequency, so it
    /// cycles through a few slots instead of evicting every record before its next use.
    /// Measured on the 4-layer OLMoE shape at a 25% budget (64 slots): 4 streams stepped
    /// together (~26 experts a layer) 44 tok/s by LRU, 58 by frequency; 2 streams (~15 a layer,
    /// fitting) 109 by LRU, 61 by frequency; one stream keeps LRU (by frequency it fell from 122
    /// to 65).
    pub fn request_for(&self, records: &[u32], several: bool) -> Batch<'_> {
        let mut reqs = Vec::new();
        {
            let mut s = self.shared.lock();
            s.by_freq_now = s.freq_always || (several && records.len() > s.overflow_at);
            for &rec in records {
                assert!((rec as usize) < self.records, "expert record out of range");
                if let Some(f) = s.freq.as_mut() {
                    f.hit(rec as usize);
                }
                s.pins[rec as usize] += 1;
                s.failed.remove(&rec);
                let slot = s.at[rec as usize];
                if slot != NIL {
                    s.stats.hits += 1;
                    let sl = &mut s.slots[slot as usize];
                    if sl.prefetched {
                        sl.prefetched = false;
                        s.stats.prefetch_used += 1;
                    }
                    if !s.slots[slot as usize].permanent {
                        s.lru.touch(slot as usize);
                    }
                } else if s.queued[rec as usize] {
                    s.stats.hits += 1;
                } else {
                    s.stats.misses += 1;
                    match self.assign(&mut s, rec, false) {
                        Some(r) => reqs.push(r),
                        None => {
                            s.queue.push_back(rec);
                            s.queued[rec as usize] = true;
                        }
                    }
                }
            }
        }
        self.reader.submit(reqs);
        Batch {
            store: self,
            recs: records.to_vec(),
            taken: vec![false; records.len()],
            left: records.len(),
            io_wait: Duration::ZERO,
        }
    }

    /// Whether the cache has a slot for every record (then prefetching cannot gain anything
    /// after warm-up).
    pub fn holds_all(&self) -> bool {
        self.holds_all
    }

    /// Starts reading `records` (not needed yet) into slots that are free or evictable now;
    /// records already in RAM, being read, or without a slot to spare are skipped.
    pub fn prefetch(&self, records: &[u32]) {
        let mut reqs = Vec::new();
        {
            let mut s = self.shared.lock();
            for &rec in records {
                if (rec as usize) < self.records
                    && s.at[rec as usize] == NIL
                    && !s.queued[rec as usize]
                {
                    match self.assign(&mut s, rec, true) {
                        Some(r) => reqs.push(r),
                        None => break,
                    }
                }
            }
        }
        self.reader.submit(reqs);
    }

    /// Where every record is now, in record order: pinned, cached, or disk (a record whose read
    /// is in flight counts as disk until it is ready). One look under the lock: a consistent
    /// picture of that moment.
    pub fn tiers(&self) -> Vec<Tier> {
        let s = self.shared.lock();
        s.at.iter()
            .map(|&slot| match s.slots.get(slot as usize) {
                Some(sl) if sl.st == St::Ready && sl.permanent => Tier::Pinned,
                Some(sl) if sl.st == St::Ready => Tier::Cached,
                _ => Tier::Disk,
            })
            .collect()
    }

    /// Whether `rec` is in RAM now (cached or pinned; not counting reads in flight).
    pub fn is_resident(&self, rec: u32) -> bool {
        let s = self.shared.lock();
        let slot = s.at[rec as usize];
        slot != NIL && s.slots[slot as usize].st == St::Ready
    }

    fn unpin(&self, rec: u32) {
        let reqs = {
            let mut s = self.shared.lock();
            s.pins[rec as usize] -= 1;
            if s.pins[rec as usize] == 0 {
                s.failed.remove(&rec);
            }
            if s.queue.is_empty() {
                return;
            }
            self.schedule(&mut s)
        };
        self.reader.submit(reqs);
    }
}

fn io_err(p: &Path) -> impl Fn(std::io::Error) -> Error + '_ {
    move |e| crate::error::io_err(p)(e)
}

/// One layer's requested records, taken as they become ready. Dropping it releases the
/// records not taken.
pub struct Batch<'s> {
    store: &'s ExpertStore,
    recs: Vec<u32>,
    taken: Vec<bool>,
    left: usize,
    io_wait: Duration,
}

impl<'s> Batch<'s> {
    /// The requested records that are ready and not yet taken, as `(index in the request,
    /// record)`. Blocks while none is ready and some are still being read; an empty result
    /// means every record has been taken.
    pub fn next_ready(&mut self) -> Result<Vec<(usize, RecordRef<'s>)>> {
        let mut out = Vec::new();
        loop {
            if self.left == 0 {
                return Ok(out);
            }
            let mut s = self.store.shared.lock();
            let reqs = if s.queue.is_empty() {
                Vec::new()
            } else {
                self.store.schedule(&mut s)
            };
            for (i, &rec) in self.recs.iter().enumerate() {
                if self.taken[i] {
                    continue;
                }
                if let Some(e) = s.failed.get(&rec) {
                    let e = Error::Io {
                        path: self.store.path.clone(),
                        source: std::io::Error::other(format!("reading expert record {rec}: {e}")),
                    };
                    drop(s);
                    self.store.reader.submit(reqs);
                    return Err(e);
                }
                let slot = s.at[rec as usize];
                if slot != NIL && s.slots[slot as usize].st == St::Ready {
                    self.taken[i] = true;
                    self.left -= 1;
                    out.push((
                        i,
                        RecordRef {
                            store: self.store,
                            rec,
                            slot,
                        },
                    ));
                }
            }
            if !out.is_empty() {
                drop(s);
                self.store.reader.submit(reqs);
                return Ok(out);
            }
            if !reqs.is_empty() {
                drop(s);
                self.store.reader.submit(reqs);
                continue;
            }
            let t = Instant::now();
            let mut s = self
                .store
                .shared
                .ready
                .wait(s)
                .unwrap_or_else(|e| e.into_inner());
            let w = t.elapsed();
            self.io_wait += w;
            s.stats.io_wait_s += w.as_secs_f64();
        }
    }

    /// Time this batch spent blocked on reads.
    pub fn io_wait(&self) -> Duration {
        self.io_wait
    }
}

impl Drop for Batch<'_> {
    fn drop(&mut self) {
        for (i, &rec) in self.recs.iter().enumerate() {
            if !self.taken[i] {
                self.store.unpin(rec);
            }
        }
    }
}

/// A record in RAM, pinned while this lives.
pub struct RecordRef<'s> {
    store: &'s ExpertStore,
    rec: u32,
    slot: u32,
}

impl RecordRef<'_> {
    /// The record's bytes (`record_size`, as in the experts file).
    pub fn bytes(&self) -> &[u8] {
        let a = &self.store.shared.arena;
        // SAFETY: the slot is `Ready` and this ref pins its record, so the slot is neither
        // re-assigned nor written while the slice lives (it borrows `self`).
        unsafe { std::slice::from_raw_parts(a.ptr(self.slot), a.record_size) }
    }

    pub fn record(&self) -> u32 {
        self.rec
    }
}

impl Drop for RecordRef<'_> {
    fn drop(&mut self) {
        self.store.unpin(self.rec);
    }
}

#[cfg(test)]
mod tests;
