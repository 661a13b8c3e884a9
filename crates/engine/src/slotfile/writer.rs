//! Writing: records appended past the committed end (streamed in chunks, hashed as they go),
//! header copies, fsync, and compaction through `<path>.tmp` and a rename.

use std::borrow::Cow;
use std::ffi::OsString;
use std::fs::{self, File, OpenOptions};
use std::io;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use xxhash_rust::xxh3::Xxh3;

use super::format::{
    state_record_len, Header, Shape, HEADER_BLOCK, HEADER_COPIES, HEADER_LEN, LOG_START,
    RECORD_HEAD, RECORD_MAGIC, STATE_HEAD, STATE_MAGIC,
};
use super::lock::lock;
use super::{KvRows, PositionMajor, SlotFile};
use crate::error::{io_err, Error, Result};

/// Every change a slot file makes to the filesystem goes through this, so tests can kill the
/// writer after any call (or in the middle of a write).
pub(super) trait Io: Send + Sync {
    fn write_at(&mut self, file: &File, buf: &[u8], offset: u64) -> io::Result<()>;
    fn set_len(&mut self, file: &File, len: u64) -> io::Result<()>;
    fn sync_file(&mut self, file: &File) -> io::Result<()>;
    fn rename(&mut self, from: &Path, to: &Path) -> io::Result<()>;
    fn sync_dir(&mut self, dir: &Path) -> io::Result<()>;
}

/// The real filesystem.
pub(super) struct RealIo;

impl Io for RealIo {
    fn write_at(&mut self, file: &File, buf: &[u8], offset: u64) -> io::Result<()> {
        file.write_all_at(buf, offset)
    }
    fn set_len(&mut self, file: &File, len: u64) -> io::Result<()> {
        file.set_len(len)
    }
    fn sync_file(&mut self, file: &File) -> io::Result<()> {
        // fdatasync: data plus the metadata needed to read it back (the file size).
        file.sync_data()
    }
    fn rename(&mut self, from: &Path, to: &Path) -> io::Result<()> {
        fs::rename(from, to)
    }
    fn sync_dir(&mut self, dir: &Path) -> io::Result<()> {
        File::open(dir)?.sync_all()
    }
}

/// Knobs tests turn down to make small files hit every code path.
#[derive(Clone, Copy)]
pub(super) struct Tuning {
    /// Largest single write (records are streamed in pieces of at most this).
    pub(super) chunk: usize,
    /// Compact when the log exceeds twice the live state's record by more than this.
    pub(super) compact_slack: u64,
}

impl Default for Tuning {
    fn default() -> Tuning {
        Tuning {
            chunk: 1 << 20,
            compact_slack: 1 << 20,
        }
    }
}

/// Positioned, buffered writes that hash what they write.
struct Writer<'a> {
    io: &'a mut dyn Io,
    file: &'a File,
    offset: u64,
    buf: Vec<u8>,
    chunk: usize,
    hash: Xxh3,
}

impl Writer<'_> {
    fn put(&mut self, b: &[u8]) -> io::Result<()> {
        self.hash.update(b);
        self.put_raw(b)
    }

    fn put_raw(&mut self, b: &[u8]) -> io::Result<()> {
        if self.buf.len() + b.len() <= self.chunk {
            self.buf.extend_from_slice(b);
            return Ok(());
        }
        self.flush()?;
        if b.len() < self.chunk {
            self.buf.extend_from_slice(b);
            return Ok(());
        }
        for piece in b.chunks(self.chunk) {
            self.io.write_at(self.file, piece, self.offset)?;
            self.offset += piece.len() as u64;
        }
        Ok(())
    }

    fn flush(&mut self) -> io::Result<()> {
        if !self.buf.is_empty() {
            self.io.write_at(self.file, &self.buf, self.offset)?;
            self.offset += self.buf.len() as u64;
            self.buf.clear();
        }
        Ok(())
    }
}

fn f32_le(v: &[f32]) -> Cow<'_, [u8]> {
    if cfg!(target_endian = "little") {
        Cow::Borrowed(bytemuck::cast_slice(v))
    } else {
        Cow::Owned(v.iter().flat_map(|x| x.to_le_bytes()).collect())
    }
}

fn u32_le(v: &[u32]) -> Cow<'_, [u8]> {
    if cfg!(target_endian = "little") {
        Cow::Borrowed(bytemuck::cast_slice(v))
    } else {
        Cow::Owned(v.iter().flat_map(|x| x.to_le_bytes()).collect())
    }
}

/// What a record holds: positions `start..start + tokens.len()` of the state.
struct RecordData<'a> {
    start: usize,
    tokens: &'a [u32],
    kv: &'a dyn KvRows,
}

/// Writes one record at `offset`, chained to `chain`; returns (end offset, its checksum).
fn write_record(
    io: &mut dyn Io,
    file: &File,
    offset: u64,
    chain: u64,
    rec: &RecordData,
    shape: &Shape,
    chunk: usize,
) -> io::Result<(u64, u64)> {
    let n = rec.tokens.len();
    let len = shape
        .record_len(rec.start as u64, n as u64)
        .ok_or_else(|| io::Error::other("record size overflows u64"))?;
    let mut w = Writer {
        io,
        file,
        offset,
        buf: Vec::with_capacity(chunk.min(usize::try_from(len).unwrap_or(usize::MAX))),
        chunk: chunk.max(1),
        hash: Xxh3::with_seed(chain),
    };
    let mut head = [0u8; RECORD_HEAD as usize];
    head[0..4].copy_from_slice(&RECORD_MAGIC);
    head[8..16].copy_from_slice(&(rec.start as u64).to_le_bytes());
    head[16..24].copy_from_slice(&(n as u64).to_le_bytes());
    w.put(&head)?;
    w.put(&u32_le(rec.tokens))?;
    for (layer, &(kw, vw)) in shape.widths.iter().enumerate() {
        // In bounds: `check_state` saw this layer count and widths, and at least start + n
        // positions in every layer.
        let (k, v) = rec.kv.rows(layer, rec.start..rec.start + n);
        let e = shape.every[layer];
        let rows = (rec.start + n) / e - rec.start / e;
        if k.len() != rows * kw || v.len() != rows * vw {
            // A `KvRows` that breaks its word: the record is never referenced by a header.
            return Err(io::Error::other(format!(
                "layer {layer}: {} + {} KV floats for {rows} rows of {kw} + {vw}",
                k.len(),
                v.len()
            )));
        }
        w.put(&f32_le(&k))?;
        w.put(&f32_le(&v))?;
    }
    let sum = w.hash.digest();
    w.put_raw(&sum.to_le_bytes())?;
    w.flush()?;
    debug_assert_eq!(w.offset, offset + len);
    Ok((offset + len, sum))
}

/// Writes a state record at `offset` (every state layer's state after `position` positions,
/// `states` one slice per layer, empty for a layer without), chained to `chain`; returns (end
/// offset, its checksum).
#[allow(clippy::too_many_arguments)] // the record writer's own arguments, as `write_record`'s
fn write_state_record(
    io: &mut dyn Io,
    file: &File,
    offset: u64,
    chain: u64,
    position: usize,
    states: &[Cow<'_, [f32]>],
    shape: &Shape,
    chunk: usize,
) -> io::Result<(u64, u64)> {
    let floats = shape.state_floats();
    for (layer, (s, &want)) in states.iter().zip(&shape.states).enumerate() {
        if s.len() != want {
            return Err(io::Error::other(format!(
                "layer {layer}: a state of {} floats, the file's {want}",
                s.len()
            )));
        }
    }
    if states.len() != shape.states.len() {
        return Err(io::Error::other("state of another layer count"));
    }
    let len = state_record_len(floats).ok_or_else(|| io::Error::other("state too large"))?;
    let mut w = Writer {
        io,
        file,
        offset,
        buf: Vec::with_capacity(chunk.min(usize::try_from(len).unwrap_or(usize::MAX))),
        chunk: chunk.max(1),
        hash: Xxh3::with_seed(chain),
    };
    let mut head = [0u8; STATE_HEAD as usize];
    head[0..4].copy_from_slice(&STATE_MAGIC);
    head[8..16].copy_from_slice(&(position as u64).to_le_bytes());
    head[16..24].copy_from_slice(&floats.to_le_bytes());
    w.put(&head)?;
    for s in states {
        w.put(&f32_le(s))?;
    }
    let sum = w.hash.digest();
    w.put_raw(&sum.to_le_bytes())?;
    w.flush()?;
    debug_assert_eq!(w.offset, offset + len);
    Ok((offset + len, sum))
}

pub(super) fn tmp_path(path: &Path) -> PathBuf {
    let mut s: OsString = path.as_os_str().to_owned();
    s.push(".tmp");
    PathBuf::from(s)
}

fn parent_dir(path: &Path) -> PathBuf {
    match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    }
}

impl SlotFile {
    fn check_state(&self, what: &str, upto: usize, kv: &dyn KvRows) -> Result<()> {
        if kv.num_layers() != self.shape.num_layers() {
            return Err(Error::Input(format!(
                "slot file {what}: KV of another layer count than the file's {}",
                self.shape.num_layers()
            )));
        }
        for (layer, &want) in self.shape.widths.iter().enumerate() {
            let got = kv.widths(layer);
            if got != want {
                return Err(Error::Input(format!(
                    "slot file {what}: layer {layer} keeps {} + {} KV floats per position, \
                     the file's {} + {}",
                    got.0, got.1, want.0, want.1
                )));
            }
            let (got, want) = (kv.every(layer), self.shape.every[layer]);
            if got != want {
                return Err(Error::Input(format!(
                    "slot file {what}: layer {layer} keeps a row per {got} positions, the \
                     file's per {want}"
                )));
            }
        }
        if kv.positions() < upto {
            return Err(Error::Input(format!(
                "slot file {what}: KV rows shorter than {upto} positions"
            )));
        }
        Ok(())
    }

    /// Appends positions `start .. start + tokens.len()` (their KV rows taken from
    /// `keys[layer][pos * key width ..]` / `values[layer][pos * value width ..]`) after
    /// truncating the persisted state to `start` (start <= persisted length), then updates the
    /// header. No fsync.
    ///
    /// On `Err` the persisted state is unchanged (the previous commit) and the file stays
    /// usable: a later commit may retry.
    pub fn commit(
        &mut self,
        start: usize,
        tokens: &[u32],
        keys: &[Vec<f32>],
        values: &[Vec<f32>],
    ) -> Result<()> {
        let (widths, every) = (self.shape.widths.clone(), self.shape.every.clone());
        let kv = PositionMajor {
            keys,
            values,
            widths: &widths,
            every: &every,
        };
        self.commit_kv(start, tokens, &kv)
    }

    /// [`SlotFile::commit`] with the rows read through [`KvRows`].
    pub fn commit_kv(&mut self, start: usize, tokens: &[u32], kv: &dyn KvRows) -> Result<()> {
        if start > self.tokens.len() {
            return Err(Error::Input(format!(
                "slot file commit: start {start} past the {} persisted tokens",
                self.tokens.len()
            )));
        }
        self.check_state("commit", start + tokens.len(), kv)?;
        if tokens.is_empty() && start == self.tokens.len() {
            return Ok(());
        }
        let path = self.path.clone();
        let rec = RecordData { start, tokens, kv };
        let (end, chain) = write_record(
            &mut *self.io,
            &self.file,
            self.end,
            self.chain,
            &rec,
            &self.shape,
            self.tuning.chunk,
        )
        .map_err(io_err(&path))?;
        self.write_header(end, chain, start + tokens.len())?;
        self.tokens.truncate(start);
        self.tokens.extend_from_slice(tokens);
        Ok(())
    }

    /// Commits a log that now ends at `end` with `chain` and holds `tokens` tokens: a new
    /// header in a block that holds neither the newest nor the durable one.
    fn write_header(&mut self, end: u64, chain: u64, tokens: usize) -> Result<()> {
        let path = self.path.clone();
        // The header goes to a block that holds neither the newest header (the state a kill
        // must fall back to) nor the durable one (the state a power loss must fall back to).
        let target = (0..HEADER_COPIES)
            .filter(|&i| i != self.current && i != self.durable)
            .min_by_key(|&i| self.seqs[i])
            .expect("three header blocks leave at least one free");
        let header = Header {
            version: self.shape.version(),
            fingerprint: self.fingerprint,
            num_layers: self.shape.num_layers() as u64,
            kv_dim: self.shape.kv_dim,
            seq: self.seq + 1,
            end,
            tokens: tokens as u64,
            chain,
        };
        self.seqs[target] = 0;
        self.io
            .write_at(&self.file, &header.encode(), target as u64 * HEADER_BLOCK)
            .map_err(io_err(&path))?;
        self.seqs[target] = header.seq;
        self.seq = header.seq;
        self.current = target;
        self.end = end;
        self.chain = chain;
        Ok(())
    }

    /// Appends a state record: the layers' `states` after the persisted positions (whose
    /// count must be `position`), then a header. No fsync.
    fn commit_state(&mut self, position: usize, states: &[Cow<'_, [f32]>]) -> Result<()> {
        if position != self.tokens.len() {
            return Err(Error::Input(format!(
                "slot file state at position {position}, {} tokens persisted",
                self.tokens.len()
            )));
        }
        let path = self.path.clone();
        let (end, chain) = write_state_record(
            &mut *self.io,
            &self.file,
            self.end,
            self.chain,
            position,
            states,
            &self.shape,
            self.tuning.chunk,
        )
        .map_err(io_err(&path))?;
        self.write_header(end, chain, position)
    }

    /// Whether the log has grown well past what the live state needs.
    pub(super) fn compaction_due(&self) -> bool {
        let live = if self.tokens.is_empty() {
            0
        } else {
            self.shape
                .record_len(0, self.tokens.len() as u64)
                .and_then(|r| r.checked_add(state_record_len(self.shape.state_floats())?))
                .unwrap_or(u64::MAX)
        };
        let log = self.end - LOG_START;
        log > live
            .saturating_mul(2)
            .saturating_add(self.tuning.compact_slack)
    }

    /// fsync (end of a turn); then compacts if the log is too big (needs the full state: pass
    /// it). `tokens` must start with the persisted tokens and `keys`/`values` hold at least
    /// their rows; only the persisted prefix is used (positions not committed yet are ignored).
    ///
    /// After `Ok`, the persisted state survives a power loss. Compaction rewrites the state into
    /// `<path>.tmp` (fsynced), renames it over the file and fsyncs the directory.
    pub fn sync(&mut self, tokens: &[u32], keys: &[Vec<f32>], values: &[Vec<f32>]) -> Result<()> {
        let (widths, every) = (self.shape.widths.clone(), self.shape.every.clone());
        let kv = PositionMajor {
            keys,
            values,
            widths: &widths,
            every: &every,
        };
        self.sync_kv(tokens, &kv)
    }

    /// [`SlotFile::sync`] with the rows read through [`KvRows`].
    pub fn sync_kv(&mut self, tokens: &[u32], kv: &dyn KvRows) -> Result<()> {
        let n = self.tokens.len();
        if tokens.len() < n || tokens[..n] != self.tokens[..] {
            return Err(Error::Input(
                "slot file sync: the tokens passed do not start with the persisted ones".into(),
            ));
        }
        self.check_state("sync", n, kv)?;
        // With states: the state after the persisted positions, when the cache is there
        // (a state record is only ever written for the position it belongs to).
        if self.shape.has_states() && kv.positions() == n {
            self.commit_state(n, &kv.states())?;
        }
        // fsync first, so a compaction that fails (a full disk) still leaves the turn durable.
        self.io.sync_file(&self.file).map_err(io_err(&self.path))?;
        self.durable = self.current;
        if self.compaction_due() {
            self.replace(&tokens[..n], kv)?;
        }
        Ok(())
    }

    /// Replaces the file with a new one holding exactly `tokens` (and their KV rows) as one
    /// record: written to `<path>.tmp`, fsynced, renamed over `path`, directory fsynced.
    pub(super) fn replace(&mut self, tokens: &[u32], kv: &dyn KvRows) -> Result<()> {
        let tmp = tmp_path(&self.path);
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(&tmp)
            .map_err(io_err(&tmp))?;
        // Locked before it appears at `path`, so no other process can take it over.
        lock(&file, &tmp)?;
        let (mut end, mut chain) = if tokens.is_empty() {
            (LOG_START, 0)
        } else {
            let rec = RecordData {
                start: 0,
                tokens,
                kv,
            };
            write_record(
                &mut *self.io,
                &file,
                LOG_START,
                0,
                &rec,
                &self.shape,
                self.tuning.chunk,
            )
            .map_err(io_err(&tmp))?
        };
        // The state goes along when the rows passed hold it (a compaction at the end of a
        // turn); without one, a state file loads empty (nothing to pair the positions with).
        if self.shape.has_states() && !tokens.is_empty() && kv.positions() == tokens.len() {
            (end, chain) = write_state_record(
                &mut *self.io,
                &file,
                end,
                chain,
                tokens.len(),
                &kv.states(),
                &self.shape,
                self.tuning.chunk,
            )
            .map_err(io_err(&tmp))?;
        }
        let header = Header {
            version: self.shape.version(),
            fingerprint: self.fingerprint,
            num_layers: self.shape.num_layers() as u64,
            kv_dim: self.shape.kv_dim,
            seq: self.seq + 1,
            end,
            tokens: tokens.len() as u64,
            chain,
        };
        let mut region = vec![0u8; LOG_START as usize];
        region[..HEADER_LEN].copy_from_slice(&header.encode());
        self.io.write_at(&file, &region, 0).map_err(io_err(&tmp))?;
        self.io.sync_file(&file).map_err(io_err(&tmp))?;
        self.io
            .rename(&tmp, &self.path)
            .map_err(io_err(&self.path))?;
        // From here on the new file is the slot file.
        self.file = file;
        self.tokens = tokens.to_vec();
        self.end = end;
        self.chain = chain;
        self.seq = header.seq;
        self.seqs = [0; HEADER_COPIES];
        self.seqs[0] = header.seq;
        self.current = 0;
        self.durable = 0;
        let dir = parent_dir(&self.path);
        self.io.sync_dir(&dir).map_err(io_err(&dir))
    }
}
