//! Slot-file commits written by a background thread, so a long prefill does not wait for its
//! KV to reach the file (a 2k-token prefill of an OLMoE-shaped model appends ~128 MB).
//!
//! Each commit copies its new rows out of the KV cache on the engine thread (the part of the
//! work that needs the cache) and queues them; one writer thread appends them to the slot file in
//! order, as [`SlotFile::commit_kv`] would have done inline, so the file's bytes and its crash
//! safety are unchanged: a crash loses at most commits still queued, and the file then holds an
//! earlier committed state, as after a crash just before those commits. [`SlotStore::sync`] (the
//! end of a turn) waits for the queue to drain, then fsyncs (and compacts) on the caller's
//! thread. A failed background write is reported by the next commit or sync, which then
//! disables the slot's persistence as an inline failure would.

use std::borrow::Cow;
use std::ops::Range;
use std::sync::mpsc::{sync_channel, SyncSender};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;

use crate::error::{Error, Result};
use crate::kv::{KvCache, LayerKv};
use crate::slotfile::{KvRows, SlotFile};
use crate::slots::SlotStore;

/// Commits queued at most before a commit waits for the writer (each holds one step's rows).
const QUEUE: usize = 2;

/// The rows positions `start .. end` write in every layer, row-major (what a commit appends).
struct Tail {
    start: usize,
    end: usize,
    /// Per layer: what it keeps (its rows' widths, positions per row).
    layers: Vec<LayerKv>,
    keys: Vec<Vec<f32>>,
    values: Vec<Vec<f32>>,
}

impl KvRows for Tail {
    fn num_layers(&self) -> usize {
        self.layers.len()
    }

    fn widths(&self, layer: usize) -> (usize, usize) {
        let l = &self.layers[layer];
        (l.heads * l.key_dim, l.heads * l.value_dim)
    }

    fn every(&self, layer: usize) -> usize {
        self.layers[layer].every
    }

    fn positions(&self) -> usize {
        self.end
    }

    /// Only the positions it holds are ever asked for (a commit reads its own range); others
    /// come back empty.
    fn rows<'a>(
        &'a self,
        layer: usize,
        positions: Range<usize>,
    ) -> (Cow<'a, [f32]>, Cow<'a, [f32]>) {
        let (kw, vw) = self.widths(layer);
        if positions.start < self.start {
            return (Cow::Borrowed(&[]), Cow::Borrowed(&[]));
        }
        let e = self.every(layer);
        let first = self.start / e;
        let r = positions.start / e - first..positions.end / e - first;
        // Borrowed: the writer encodes straight from the rows the commit copied out.
        let slice =
            |v: &'a [f32], w: usize| -> &'a [f32] { v.get(r.start * w..r.end * w).unwrap_or(&[]) };
        (
            Cow::Borrowed(slice(&self.keys[layer], kw)),
            Cow::Borrowed(slice(&self.values[layer], vw)),
        )
    }
}

struct Commit {
    start: usize,
    tokens: Vec<u32>,
    rows: Tail,
}

/// What the engine thread and the writer share: commits not yet written, and the first failure.
#[derive(Default)]
struct State {
    pending: usize,
    error: Option<String>,
}

/// A slot file whose commits are appended by a background thread.
pub struct BackgroundFile {
    file: Arc<Mutex<SlotFile>>,
    state: Arc<(Mutex<State>, Condvar)>,
    queue: Option<SyncSender<Commit>>,
    writer: Option<JoinHandle<()>>,
}

impl BackgroundFile {
    pub fn new(file: SlotFile) -> Result<BackgroundFile> {
        let file = Arc::new(Mutex::new(file));
        let state: Arc<(Mutex<State>, Condvar)> = Arc::default();
        let (queue, jobs) = sync_channel::<Commit>(QUEUE);
        let (f, s) = (file.clone(), state.clone());
        let writer = std::thread::Builder::new()
            .name("colibri-slot-writer".into())
            .spawn(move || {
                for job in jobs {
                    let r = f.lock().unwrap_or_else(|e| e.into_inner()).commit_kv(
                        job.start,
                        &job.tokens,
                        &job.rows,
                    );
                    let (lock, done) = &*s;
                    let mut st = lock.lock().unwrap_or_else(|e| e.into_inner());
                    if let Err(e) = r {
                        st.error.get_or_insert(e.to_string());
                    }
                    st.pending -= 1;
                    done.notify_all();
                }
            })
            .map_err(|e| Error::Input(format!("cannot start the slot writer thread: {e}")))?;
        Ok(BackgroundFile {
            file,
            state,
            queue: Some(queue),
            writer: Some(writer),
        })
    }

    /// Waits until every queued commit is written; the first failure, if any.
    fn drain(&self) -> Result<()> {
        let (lock, done) = &*self.state;
        let mut st = lock.lock().unwrap_or_else(|e| e.into_inner());
        while st.pending > 0 {
            st = done.wait(st).unwrap_or_else(|e| e.into_inner());
        }
        match &st.error {
            Some(e) => Err(Error::Input(e.clone())),
            None => Ok(()),
        }
    }

    fn failed(&self) -> Option<String> {
        let st = self.state.0.lock().unwrap_or_else(|e| e.into_inner());
        st.error.clone()
    }
}

impl SlotStore for BackgroundFile {
    fn commit(&mut self, start: usize, tokens: &[u32], kv: &KvCache) -> Result<()> {
        if let Some(e) = self.failed() {
            return Err(Error::Input(e));
        }
        let layers = kv.num_layers();
        let end = start + tokens.len();
        let (mut keys, mut values) = (Vec::with_capacity(layers), Vec::with_capacity(layers));
        for l in 0..layers {
            let (k, v) = kv.rows(l, start..end);
            keys.push(k);
            values.push(v);
        }
        let rows = Tail {
            start,
            end,
            layers: kv.layout().layers.clone(),
            keys,
            values,
        };
        self.state
            .0
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .pending += 1;
        let job = Commit {
            start,
            tokens: tokens.to_vec(),
            rows,
        };
        let sent = self.queue.as_ref().map(|q| q.send(job));
        if !matches!(sent, Some(Ok(()))) {
            self.state
                .0
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .pending -= 1;
            return Err(Error::Input("the slot writer thread has stopped".into()));
        }
        Ok(())
    }

    fn sync(&mut self, tokens: &[u32], kv: &KvCache) -> Result<()> {
        self.drain()?;
        self.file
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .sync_kv(tokens, kv)
    }
}

impl Drop for BackgroundFile {
    fn drop(&mut self) {
        // Queued commits are still written (the writer ends when the queue closes).
        self.queue = None;
        if let Some(w) = self.writer.take() {
            let _ = w.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kv::{KvDtype, KvLayout};

    fn cache(layout: &KvLayout, n: usize, seed: f32) -> KvCache {
        let mut kv = KvCache::new(layout, KvDtype::F32);
        kv.reserve(n);
        for li in 0..layout.layers.len() {
            let w = kv.key_width(li);
            let rows: Vec<f32> = (0..n * w)
                .map(|i| seed + li as f32 + i as f32 * 0.25)
                .collect();
            kv.write(li, 0, &rows, &rows);
        }
        kv.len = n;
        kv
    }

    /// The same commits and syncs, written inline and in the background, give the same file
    /// bytes (truncation and compaction included).
    #[test]
    fn background_commits_write_the_same_file() {
        let layout = KvLayout::uniform(3, 2, 8);
        let dir = crate::testutil::scratch_dir("slotwriter", "same");
        let fp = [7u8; 32];
        let steps: Vec<(usize, usize, f32)> = vec![(0, 40, 1.0), (40, 25, 1.0), (10, 30, 2.0)];
        let mut files = Vec::new();
        for background in [false, true] {
            let path = dir.join(format!("slot-{background}.kv"));
            let (file, _) = SlotFile::open_layout(&path, fp, &layout).unwrap();
            let mut store: Box<dyn SlotStore> = if background {
                Box::new(BackgroundFile::new(file).unwrap())
            } else {
                Box::new(file)
            };
            let mut tokens: Vec<u32> = Vec::new();
            for &(start, n, seed) in &steps {
                let kv = cache(&layout, start + n, seed);
                tokens.truncate(start);
                tokens.extend((start..start + n).map(|t| t as u32 + seed as u32));
                store.commit(start, &tokens[start..], &kv).unwrap();
                if start == 40 {
                    store.sync(&tokens, &kv).unwrap();
                }
            }
            let kv = cache(&layout, tokens.len(), 2.0);
            store.sync(&tokens, &kv).unwrap();
            drop(store);
            files.push(std::fs::read(&path).unwrap());
        }
        assert!(files[0].len() > 4096);
        assert!(files[0] == files[1], "background writes changed the file");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// A commit the file refuses fails in the background; the next commit or sync says so.
    #[test]
    fn a_background_failure_is_reported_by_the_next_call() {
        let layout = KvLayout::uniform(2, 1, 4);
        let dir = crate::testutil::scratch_dir("slotwriter", "fail");
        let (file, _) = SlotFile::open_layout(&dir.join("s.kv"), [1u8; 32], &layout).unwrap();
        let mut store = BackgroundFile::new(file).unwrap();
        let kv = cache(&layout, 20, 0.5);
        let tokens: Vec<u32> = (0..20).collect();
        // Start 10 is past the 0 persisted tokens: refused by the writer.
        store.commit(10, &tokens[10..], &kv).unwrap();
        let e = store.sync(&tokens, &kv).unwrap_err().to_string();
        assert!(e.contains("past the 0 persisted tokens"), "{e}");
        assert!(store.commit(0, &tokens, &kv).is_err());
        drop(store);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
