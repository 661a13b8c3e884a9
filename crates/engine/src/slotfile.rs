//! KV slot files: a sequence's token history and KV memory on disk, so a warm conversation
//! survives a restart (or a crash) without a new prefill.
//!
//! A slot file is three fixed header copies followed by an append-only log of records. A record
//! truncates the state to its `start` and appends positions; replaying the log from the start
//! rebuilds the state. A commit appends one record past the committed end and then writes one
//! header copy (a higher sequence number, the new committed end and the checksum that closes a
//! hash chain over every record). Nothing is ever rewritten in place except header copies that
//! are neither the newest one nor the one made durable by the last [`SlotFile::sync`].
//! Compaction writes the whole state into `<path>.tmp` and renames it over the file.
//!
//! The byte layout, the protocol and the crash-safety argument are in `docs/FORMATS.md`
//! ("KV slot files").

use std::borrow::Cow;
use std::ffi::OsString;
use std::fs::{self, File, OpenOptions, TryLockError};
use std::io;
use std::ops::Range;
use std::os::unix::fs::{FileExt, MetadataExt};
use std::path::{Path, PathBuf};

use xxhash_rust::xxh3::{xxh3_64, Xxh3};

use crate::error::{io_err, Error, Result};

/// The slot file format version; a file of any other version is refused.
pub const SLOT_FILE_VERSION: u32 = 1;

/// First 8 bytes of every header copy.
pub const SLOT_FILE_MAGIC: [u8; 8] = *b"CLBKVSLT";
/// First 4 bytes of every record.
pub const RECORD_MAGIC: [u8; 4] = *b"KVRC";
/// Number of header copies at the start of the file.
pub const HEADER_COPIES: usize = 3;
/// Each header copy owns one 4 KiB block (so no two copies share a page or a disk sector).
pub const HEADER_BLOCK: u64 = 4096;
/// Byte offset of the record log (the end of the header region).
pub const LOG_START: u64 = HEADER_COPIES as u64 * HEADER_BLOCK;
/// Bytes of a header copy that carry data (the rest of its block is zero).
const HEADER_LEN: usize = 104;
/// Bytes of a header covered by its checksum.
const HEADER_SUMMED: usize = 96;
/// A record's fixed part before the tokens: magic, reserved, start, n.
const RECORD_HEAD: u64 = 24;
/// A record's trailing checksum.
const RECORD_TAIL: u64 = 8;

/// A loaded slot: the tokens and, per layer, `tokens.len() * kv_dim` keys and values.
#[derive(Debug, Clone, PartialEq)]
pub struct LoadedSlot {
    pub tokens: Vec<u32>,
    pub keys: Vec<Vec<f32>>,
    pub values: Vec<Vec<f32>>,
}

impl LoadedSlot {
    fn empty(num_layers: usize) -> LoadedSlot {
        LoadedSlot {
            tokens: Vec::new(),
            keys: vec![Vec::new(); num_layers],
            values: vec![Vec::new(); num_layers],
        }
    }
}

/// What [`SlotFile::open`] found.
#[derive(Debug)]
pub enum Opened {
    /// No file, an empty file, or a valid file holding no tokens: start empty.
    Fresh,
    /// The last committed state.
    Loaded(LoadedSlot),
    /// The file was foreign or damaged (the reason, for one log line); it was replaced by an
    /// empty slot file.
    Refused(String),
}

/// One header copy (the decoded fields; magic and version are implied).
#[derive(Debug, Clone, Copy, PartialEq)]
struct Header {
    fingerprint: [u8; 32],
    num_layers: u64,
    kv_dim: u64,
    /// Commit sequence number: the newest valid copy wins. 0 is never written.
    seq: u64,
    /// Absolute byte offset where the committed log ends.
    end: u64,
    /// Tokens in the committed state.
    tokens: u64,
    /// Checksum of the last committed record (0 for an empty log): closes the hash chain.
    chain: u64,
}

impl Header {
    fn encode(&self) -> [u8; HEADER_LEN] {
        let mut b = [0u8; HEADER_LEN];
        b[0..8].copy_from_slice(&SLOT_FILE_MAGIC);
        b[8..12].copy_from_slice(&SLOT_FILE_VERSION.to_le_bytes());
        // 12..16 reserved, zero.
        b[16..48].copy_from_slice(&self.fingerprint);
        b[48..56].copy_from_slice(&self.num_layers.to_le_bytes());
        b[56..64].copy_from_slice(&self.kv_dim.to_le_bytes());
        b[64..72].copy_from_slice(&self.seq.to_le_bytes());
        b[72..80].copy_from_slice(&self.end.to_le_bytes());
        b[80..88].copy_from_slice(&self.tokens.to_le_bytes());
        b[88..96].copy_from_slice(&self.chain.to_le_bytes());
        let sum = xxh3_64(&b[..HEADER_SUMMED]);
        b[96..104].copy_from_slice(&sum.to_le_bytes());
        b
    }
}

/// What one header block holds.
enum Block {
    Valid(Header),
    /// Our magic, another version (read only when the checksum cannot vouch for it either).
    Version(u32),
    /// Our magic and version, but the checksum fails (torn or corrupted).
    Torn,
    /// Not our magic.
    Foreign,
}

fn le_u32(b: &[u8], at: usize) -> u32 {
    let mut a = [0u8; 4];
    a.copy_from_slice(&b[at..at + 4]);
    u32::from_le_bytes(a)
}

fn le_u64(b: &[u8], at: usize) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[at..at + 8]);
    u64::from_le_bytes(a)
}

fn parse_block(b: &[u8]) -> Block {
    if b.len() < HEADER_LEN || b[0..8] != SLOT_FILE_MAGIC {
        return Block::Foreign;
    }
    // The version sits at a fixed offset in every version; it is read before the checksum,
    // whose scheme another version may change.
    let version = le_u32(b, 8);
    if version != SLOT_FILE_VERSION {
        return Block::Version(version);
    }
    if le_u64(b, 96) != xxh3_64(&b[..HEADER_SUMMED]) || le_u32(b, 12) != 0 {
        return Block::Torn;
    }
    let mut fingerprint = [0u8; 32];
    fingerprint.copy_from_slice(&b[16..48]);
    Block::Valid(Header {
        fingerprint,
        num_layers: le_u64(b, 48),
        kv_dim: le_u64(b, 56),
        seq: le_u64(b, 64),
        end: le_u64(b, 72),
        tokens: le_u64(b, 80),
        chain: le_u64(b, 88),
    })
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// Bytes one token takes in a record: its id plus keys and values in every layer.
fn token_bytes(num_layers: usize, kv_dim: usize) -> Option<u64> {
    (num_layers as u64)
        .checked_mul(kv_dim as u64)?
        .checked_mul(8)?
        .checked_add(4)
}

/// Bytes of a record of `n` tokens.
fn record_len(n: u64, per_token: u64) -> Option<u64> {
    n.checked_mul(per_token)?
        .checked_add(RECORD_HEAD + RECORD_TAIL)
}

// ---------------------------------------------------------------------------------------------
// Loading

/// Something the loader reads from: bytes in memory or the open file.
trait Source {
    fn size(&self) -> io::Result<u64>;
    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()>;
}

impl Source for [u8] {
    fn size(&self) -> io::Result<u64> {
        Ok(self.len() as u64)
    }
    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        // Callers bound every read by `size()` first; a miss here is a loader bug, reported
        // as a read error rather than a panic.
        let range = usize::try_from(offset)
            .ok()
            .and_then(|a| Some(a..a.checked_add(buf.len())?))
            .filter(|r| r.end <= self.len())
            .ok_or_else(|| io::Error::new(io::ErrorKind::UnexpectedEof, "read past the end"))?;
        buf.copy_from_slice(&self[range]);
        Ok(())
    }
}

impl Source for File {
    fn size(&self) -> io::Result<u64> {
        Ok(self.metadata()?.len())
    }
    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        self.read_exact_at(buf, offset)
    }
}

enum LoadError {
    /// The file is foreign or damaged: the reason.
    Invalid(String),
    /// Reading failed: nothing is known about the file.
    Io(io::Error),
}

impl From<io::Error> for LoadError {
    fn from(e: io::Error) -> LoadError {
        LoadError::Io(e)
    }
}

/// A successful load: the state, the header it came from and what each header block holds.
struct Found {
    state: LoadedSlot,
    header: Header,
    copy: usize,
    /// `seq` of each block's valid header (0: none).
    seqs: [u64; HEADER_COPIES],
}

/// Loads the newest header whose log verifies. `Ok(None)`: an empty source.
fn load_from<S: Source + ?Sized>(
    src: &S,
    fingerprint: [u8; 32],
    num_layers: usize,
    kv_dim: usize,
) -> std::result::Result<Option<Found>, LoadError> {
    let size = src.size()?;
    if size == 0 {
        return Ok(None);
    }
    let Some(per_token) = token_bytes(num_layers, kv_dim) else {
        return Err(LoadError::Invalid(format!(
            "layout {num_layers} layers x {kv_dim} is too large"
        )));
    };
    let mut region = vec![0u8; size.min(LOG_START) as usize];
    src.read_at(&mut region, 0)?;
    let blocks: Vec<Block> = (0..HEADER_COPIES)
        .map(|i| {
            let at = i * HEADER_BLOCK as usize;
            parse_block(region.get(at..).unwrap_or(&[]))
        })
        .collect();
    let mut seqs = [0u64; HEADER_COPIES];
    let mut valid: Vec<(usize, Header)> = Vec::new();
    for (i, c) in blocks.iter().enumerate() {
        if let Block::Valid(h) = c {
            seqs[i] = h.seq;
            valid.push((i, *h));
        }
    }
    if valid.is_empty() {
        if let Some(v) = blocks.iter().find_map(|c| match c {
            Block::Version(v) => Some(*v),
            _ => None,
        }) {
            return Err(LoadError::Invalid(format!(
                "slot file version {v}, this build reads version {SLOT_FILE_VERSION}"
            )));
        }
        if size < LOG_START {
            return Err(LoadError::Invalid(
                if region.starts_with(&SLOT_FILE_MAGIC) {
                    format!(
                        "truncated: {size} bytes, shorter than the {LOG_START}-byte header region"
                    )
                } else {
                    "not a colibri KV slot file (bad magic)".into()
                },
            ));
        }
        if blocks.iter().any(|c| matches!(c, Block::Torn)) {
            return Err(LoadError::Invalid(
                "no intact header: every copy fails its checksum".into(),
            ));
        }
        return Err(LoadError::Invalid(
            "not a colibri KV slot file (bad magic)".into(),
        ));
    }
    for (_, h) in &valid {
        if h.fingerprint != fingerprint {
            return Err(LoadError::Invalid(format!(
                "made for another model or KV layout (fingerprint {}, expected {})",
                hex(&h.fingerprint[..8]),
                hex(&fingerprint[..8])
            )));
        }
        if h.num_layers != num_layers as u64 || h.kv_dim != kv_dim as u64 {
            return Err(LoadError::Invalid(format!(
                "KV layout {} layers x {} floats, expected {num_layers} x {kv_dim}",
                h.num_layers, h.kv_dim
            )));
        }
    }
    // Newest first; an older copy is a fallback for when the newer one's log does not verify
    // (corruption, or a power loss that kept the header but not its record).
    valid.sort_by_key(|v| std::cmp::Reverse(v.1.seq));
    let mut first_err = None;
    for (copy, header) in valid {
        match replay(src, size, &header, num_layers, kv_dim, per_token) {
            Ok(state) => {
                return Ok(Some(Found {
                    state,
                    header,
                    copy,
                    seqs,
                }))
            }
            Err(LoadError::Invalid(why)) => {
                first_err.get_or_insert(format!("header seq {}: {why}", header.seq));
            }
            Err(e) => return Err(e),
        }
    }
    Err(LoadError::Invalid(first_err.unwrap_or_default()))
}

/// Reads `count` little-endian f32 onto the end of `v`, feeding the bytes to `hash`.
fn read_f32s<S: Source + ?Sized>(
    src: &S,
    v: &mut Vec<f32>,
    count: usize,
    offset: u64,
    hash: &mut Xxh3,
) -> io::Result<()> {
    let old = v.len();
    v.resize(old + count, 0.0);
    let bytes: &mut [u8] = bytemuck::cast_slice_mut(&mut v[old..]);
    src.read_at(bytes, offset)?;
    hash.update(bytes);
    if cfg!(target_endian = "big") {
        for x in &mut v[old..] {
            *x = f32::from_bits(u32::from_le(x.to_bits()));
        }
    }
    Ok(())
}

/// Replays the log `[LOG_START, h.end)`: every record must be whole, within bounds and chained.
fn replay<S: Source + ?Sized>(
    src: &S,
    size: u64,
    h: &Header,
    num_layers: usize,
    kv_dim: usize,
    per_token: u64,
) -> std::result::Result<LoadedSlot, LoadError> {
    let bad = |s: String| Err(LoadError::Invalid(s));
    if h.end < LOG_START {
        return bad(format!("committed end {} inside the header region", h.end));
    }
    if h.end > size {
        return bad(format!(
            "committed end {} beyond the file's {size} bytes (truncated file)",
            h.end
        ));
    }
    let mut st = LoadedSlot::empty(num_layers);
    let mut pos = LOG_START;
    let mut chain = 0u64;
    while pos < h.end {
        let avail = h.end - pos;
        if avail < RECORD_HEAD + RECORD_TAIL {
            return bad(format!(
                "record at byte {pos}: cut off by the committed end"
            ));
        }
        let mut head = [0u8; RECORD_HEAD as usize];
        src.read_at(&mut head, pos)?;
        if head[0..4] != RECORD_MAGIC || le_u32(&head, 4) != 0 {
            return bad(format!("record at byte {pos}: bad record magic"));
        }
        let start = le_u64(&head, 8);
        let n = le_u64(&head, 16);
        if start > st.tokens.len() as u64 {
            return bad(format!(
                "record at byte {pos}: starts at position {start}, past the {} tokens before it",
                st.tokens.len()
            ));
        }
        // n * per_token <= avail - head - tail, without overflow: bounds every allocation
        // below by bytes that exist.
        if n > (avail - RECORD_HEAD - RECORD_TAIL) / per_token {
            return bad(format!(
                "record at byte {pos}: {n} tokens overrun the committed end"
            ));
        }
        let (start, n) = (start as usize, n as usize);
        let mut hash = Xxh3::with_seed(chain);
        hash.update(&head);
        let mut at = pos + RECORD_HEAD;
        st.tokens.truncate(start);
        st.tokens.resize(start + n, 0);
        {
            let bytes: &mut [u8] = bytemuck::cast_slice_mut(&mut st.tokens[start..]);
            src.read_at(bytes, at)?;
            hash.update(bytes);
        }
        if cfg!(target_endian = "big") {
            for t in &mut st.tokens[start..] {
                *t = u32::from_le(*t);
            }
        }
        at += 4 * n as u64;
        for l in 0..num_layers {
            // With a layer present, n * kv_dim * 4 <= the record's bytes (checked above).
            let rows = n * kv_dim;
            for v in [&mut st.keys[l], &mut st.values[l]] {
                v.truncate(start * kv_dim);
                read_f32s(src, v, rows, at, &mut hash)?;
                at += 4 * rows as u64;
            }
        }
        let mut tail = [0u8; 8];
        src.read_at(&mut tail, at)?;
        let sum = hash.digest();
        if u64::from_le_bytes(tail) != sum {
            return bad(format!("record at byte {pos}: checksum mismatch"));
        }
        chain = sum;
        pos = at + RECORD_TAIL;
    }
    if chain != h.chain {
        return bad("the log does not match its header (checksum chain)".into());
    }
    if st.tokens.len() as u64 != h.tokens {
        return bad(format!(
            "the log holds {} tokens, the header says {}",
            st.tokens.len(),
            h.tokens
        ));
    }
    Ok(st)
}

/// Pure loader over the bytes of a slot file (tests, fuzzing): `Ok(Some(state))` for a valid
/// file (possibly with no tokens), `Ok(None)` for an empty (new) file, `Err(reason)` for a
/// foreign or damaged one. Never panics; allocations are bounded by `bytes.len()` (plus the
/// `num_layers` empty vectors of the result); O(file size).
pub fn load_bytes(
    bytes: &[u8],
    fingerprint: [u8; 32],
    num_layers: usize,
    kv_dim: usize,
) -> std::result::Result<Option<LoadedSlot>, String> {
    match load_from(bytes, fingerprint, num_layers, kv_dim) {
        Ok(found) => Ok(found.map(|f| f.state)),
        Err(LoadError::Invalid(why)) => Err(why),
        Err(LoadError::Io(e)) => Err(e.to_string()),
    }
}

/// Fuzzing support: recomputes every checksum in `bytes` (records as far as they chain from
/// the log start, then each header copy with our magic, whose `chain` is set to the chain value
/// at its committed end when a record ends there), so mutated fields reach the replay logic
/// instead of stopping at a checksum. Never panics; O(len).
#[doc(hidden)]
pub fn reseal(bytes: &mut [u8], num_layers: usize, kv_dim: usize) {
    let Some(per_token) = token_bytes(num_layers, kv_dim) else {
        return;
    };
    let size = bytes.len() as u64;
    let mut ends = vec![(LOG_START, 0u64)];
    let (mut pos, mut chain) = (LOG_START, 0u64);
    while size >= pos + RECORD_HEAD + RECORD_TAIL {
        let at = pos as usize;
        if bytes[at..at + 4] != RECORD_MAGIC {
            break;
        }
        let n = le_u64(bytes, at + 16);
        if n > (size - pos - RECORD_HEAD - RECORD_TAIL) / per_token {
            break;
        }
        let body_end = (pos + RECORD_HEAD + n * per_token) as usize;
        let sum = xxhash_rust::xxh3::xxh3_64_with_seed(&bytes[at..body_end], chain);
        bytes[body_end..body_end + 8].copy_from_slice(&sum.to_le_bytes());
        chain = sum;
        pos = body_end as u64 + RECORD_TAIL;
        ends.push((pos, chain));
    }
    for i in 0..HEADER_COPIES {
        let at = i * HEADER_BLOCK as usize;
        let Some(b) = bytes.get_mut(at..at + HEADER_LEN) else {
            break;
        };
        if b[0..8] != SLOT_FILE_MAGIC {
            continue;
        }
        let end = le_u64(b, 72);
        if let Some(&(_, c)) = ends.iter().find(|(e, _)| *e == end) {
            b[88..96].copy_from_slice(&c.to_le_bytes());
        }
        let sum = xxh3_64(&b[..HEADER_SUMMED]);
        b[96..104].copy_from_slice(&sum.to_le_bytes());
    }
}

// ---------------------------------------------------------------------------------------------
// Writing

/// Every change a slot file makes to the filesystem goes through this, so tests can kill the
/// writer after any call (or in the middle of a write).
trait Io: Send + Sync {
    fn write_at(&mut self, file: &File, buf: &[u8], offset: u64) -> io::Result<()>;
    fn set_len(&mut self, file: &File, len: u64) -> io::Result<()>;
    fn sync_file(&mut self, file: &File) -> io::Result<()>;
    fn rename(&mut self, from: &Path, to: &Path) -> io::Result<()>;
    fn sync_dir(&mut self, dir: &Path) -> io::Result<()>;
}

/// The real filesystem.
struct RealIo;

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
struct Tuning {
    /// Largest single write (records are streamed in pieces of at most this).
    chunk: usize,
    /// Compact when the log exceeds twice the live state's record by more than this.
    compact_slack: u64,
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

/// The KV state a slot file persists, read as position-major rows of `kv_dim` floats per layer
/// (the engine keeps its cache head-major and converts only the rows a record holds).
pub trait KvRows {
    fn num_layers(&self) -> usize;
    /// Positions every layer holds rows for.
    fn positions(&self) -> usize;
    /// Keys and values of `layer` at `positions` (within [`KvRows::positions`]), row by row.
    fn rows(&self, layer: usize, positions: Range<usize>) -> (Cow<'_, [f32]>, Cow<'_, [f32]>);
}

/// Per-layer position-major vectors (`keys[layer][pos * kv_dim ..]`), as [`LoadedSlot`] holds.
pub struct PositionMajor<'a> {
    pub keys: &'a [Vec<f32>],
    pub values: &'a [Vec<f32>],
    pub kv_dim: usize,
}

impl KvRows for PositionMajor<'_> {
    fn num_layers(&self) -> usize {
        if self.keys.len() == self.values.len() {
            self.keys.len()
        } else {
            usize::MAX // never equal to a file's layer count: refused by `check_state`
        }
    }

    fn positions(&self) -> usize {
        self.keys
            .iter()
            .chain(self.values)
            .map(|v| v.len() / self.kv_dim.max(1))
            .min()
            .unwrap_or(usize::MAX)
    }

    fn rows(&self, layer: usize, positions: Range<usize>) -> (Cow<'_, [f32]>, Cow<'_, [f32]>) {
        let r = positions.start * self.kv_dim..positions.end * self.kv_dim;
        (
            Cow::Borrowed(&self.keys[layer][r.clone()]),
            Cow::Borrowed(&self.values[layer][r]),
        )
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
    per_token: u64,
    chunk: usize,
) -> io::Result<(u64, u64)> {
    let n = rec.tokens.len();
    let len = record_len(n as u64, per_token)
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
    for layer in 0..rec.kv.num_layers() {
        // In bounds: `check_state` saw at least start + n positions in every layer.
        let (k, v) = rec.kv.rows(layer, rec.start..rec.start + n);
        w.put(&f32_le(&k))?;
        w.put(&f32_le(&v))?;
    }
    let sum = w.hash.digest();
    w.put_raw(&sum.to_le_bytes())?;
    w.flush()?;
    debug_assert_eq!(w.offset, offset + len);
    Ok((offset + len, sum))
}

/// An open slot file, locked (advisory `flock`) against a second process using it.
pub struct SlotFile {
    file: File,
    path: PathBuf,
    fingerprint: [u8; 32],
    num_layers: usize,
    kv_dim: usize,
    per_token: u64,
    /// The persisted tokens (the committed state's history).
    tokens: Vec<u32>,
    /// Committed end of the log and the chain value there.
    end: u64,
    chain: u64,
    /// The highest sequence number written.
    seq: u64,
    /// `seq` of the valid header each block holds (0: none, or being overwritten).
    seqs: [u64; HEADER_COPIES],
    /// The block holding the newest header.
    current: usize,
    /// The block holding the header made durable by the last fsync; never overwritten
    /// before the next fsync.
    durable: usize,
    io: Box<dyn Io>,
    tuning: Tuning,
}

impl std::fmt::Debug for SlotFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SlotFile")
            .field("path", &self.path)
            .field("num_layers", &self.num_layers)
            .field("kv_dim", &self.kv_dim)
            .field("persisted_tokens", &self.tokens.len())
            .field("committed_bytes", &self.end)
            .field("seq", &self.seq)
            .finish()
    }
}

fn tmp_path(path: &Path) -> PathBuf {
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

/// The start of the error for a slot file locked by someone else (the CLI adds what to do).
pub const IN_USE: &str = "the slot file is in use";

/// `major:minor` of a `st_dev` as /proc/locks prints them (glibc's `gnu_dev_major/minor`).
fn dev_parts(dev: u64) -> (u64, u64) {
    let major = ((dev >> 8) & 0xfff) | ((dev >> 32) & !0xfff);
    let minor = (dev & 0xff) | ((dev >> 12) & !0xff);
    (major, minor)
}

/// The pid holding a lock on the inode `major:minor:ino` in a /proc/locks listing (waiting
/// locks, the `->` lines, are not holders); None when absent or not visible (pid 0 or -1:
/// another pid namespace, or an OFD lock).
fn lock_holder_in(locks: &str, major: u64, minor: u64, ino: u64) -> Option<u32> {
    locks
        .lines()
        .filter(|line| !line.contains("->"))
        .find_map(|line| {
            let fields: Vec<&str> = line.split_whitespace().collect();
            let at = fields.iter().position(|f| {
                let mut parts = f.split(':');
                let (Some(a), Some(b), Some(c), None) =
                    (parts.next(), parts.next(), parts.next(), parts.next())
                else {
                    return false;
                };
                u64::from_str_radix(a, 16).ok() == Some(major)
                    && u64::from_str_radix(b, 16).ok() == Some(minor)
                    && c.parse::<u64>().ok() == Some(ino)
            })?;
            let pid = fields.get(at.checked_sub(1)?)?.parse::<i64>().ok()?;
            u32::try_from(pid).ok().filter(|&p| p > 0)
        })
}

/// The pid of the process holding the lock on `file`, when the system says (Linux: /proc/locks).
fn lock_holder(file: &File) -> Option<u32> {
    let meta = file.metadata().ok()?;
    let locks = fs::read_to_string("/proc/locks").ok()?;
    let (major, minor) = dev_parts(meta.dev());
    lock_holder_in(&locks, major, minor, meta.ino())
}

/// The error for a slot file someone else holds, naming the holder's pid when it is known.
fn in_use(file: &File, path: &Path) -> Error {
    let by = match lock_holder(file) {
        Some(pid) if pid == std::process::id() => {
            format!(" elsewhere in this process (pid {pid})")
        }
        Some(pid) => format!(" by another process (pid {pid})"),
        None => " by another process".to_string(),
    };
    Error::Input(format!("{}: {IN_USE}{by}", path.display()))
}

/// Takes the advisory lock; `Unsupported` (some network filesystems) means unlocked.
fn lock(file: &File, path: &Path) -> Result<()> {
    match file.try_lock() {
        Ok(()) => Ok(()),
        Err(TryLockError::WouldBlock) => Err(in_use(file, path)),
        Err(TryLockError::Error(e)) if e.kind() == io::ErrorKind::Unsupported => Ok(()),
        Err(TryLockError::Error(e)) => Err(io_err(path)(e)),
    }
}

/// Opens (creating if missing) and locks the file at `path`, making sure the locked inode is
/// still the one at `path` (a compaction elsewhere may have renamed a new file over it).
fn open_locked(path: &Path) -> Result<File> {
    for _ in 0..16 {
        let f = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(path)
            .map_err(io_err(path))?;
        lock(&f, path)?;
        let a = f.metadata().map_err(io_err(path))?;
        match fs::metadata(path) {
            Ok(b) if b.dev() == a.dev() && b.ino() == a.ino() => return Ok(f),
            _ => continue,
        }
    }
    Err(Error::Input(format!(
        "{}: the slot file kept being replaced while opening it",
        path.display()
    )))
}

impl SlotFile {
    /// Opens (creating if missing) the slot file at `path` for this layout; an existing valid
    /// file is loaded, an invalid/foreign one is refused and replaced by an empty file.
    ///
    /// `fingerprint` identifies the model and KV layout (computed by the caller); a file made
    /// with another fingerprint, version, `num_layers` or `kv_dim` is refused. An I/O error
    /// while reading returns `Err` and leaves the file alone.
    pub fn open(
        path: &Path,
        fingerprint: [u8; 32],
        num_layers: usize,
        kv_dim: usize,
    ) -> Result<(SlotFile, Opened)> {
        Self::open_with(
            path,
            fingerprint,
            num_layers,
            kv_dim,
            Box::new(RealIo),
            Tuning::default(),
        )
    }

    fn open_with(
        path: &Path,
        fingerprint: [u8; 32],
        num_layers: usize,
        kv_dim: usize,
        io: Box<dyn Io>,
        tuning: Tuning,
    ) -> Result<(SlotFile, Opened)> {
        let per_token = token_bytes(num_layers, kv_dim).ok_or_else(|| {
            Error::Input(format!(
                "KV layout {num_layers} layers x {kv_dim} is too large"
            ))
        })?;
        let file = open_locked(path)?;
        // A compaction killed before its rename; only the lock holder writes it.
        let _ = fs::remove_file(tmp_path(path));
        let mut sf = SlotFile {
            file,
            path: path.to_path_buf(),
            fingerprint,
            num_layers,
            kv_dim,
            per_token,
            tokens: Vec::new(),
            end: LOG_START,
            chain: 0,
            seq: 0,
            seqs: [0; HEADER_COPIES],
            current: 0,
            durable: 0,
            io,
            tuning,
        };
        let empty = LoadedSlot::empty(num_layers);
        let empty_kv = PositionMajor {
            keys: &empty.keys,
            values: &empty.values,
            kv_dim,
        };
        let found = match sf.file.metadata() {
            Ok(m) if m.len() == 0 => Ok(None),
            Ok(_) => load_from(&sf.file, fingerprint, num_layers, kv_dim),
            Err(e) => Err(LoadError::Io(e)),
        };
        match found {
            Err(LoadError::Io(e)) => Err(io_err(path)(e)),
            Ok(None) => {
                sf.replace(&empty.tokens, &empty_kv)?;
                Ok((sf, Opened::Fresh))
            }
            Err(LoadError::Invalid(why)) => {
                sf.replace(&empty.tokens, &empty_kv)?;
                Ok((sf, Opened::Refused(why)))
            }
            Ok(Some(found)) => {
                sf.adopt(&found)?;
                let opened = if found.state.tokens.is_empty() {
                    Opened::Fresh
                } else {
                    Opened::Loaded(found.state)
                };
                Ok((sf, opened))
            }
        }
    }

    /// Continues the file after a successful load: drops newer headers whose log did not
    /// verify and any bytes past the committed end, and makes the loaded state durable.
    fn adopt(&mut self, found: &Found) -> Result<()> {
        let path = self.path.clone();
        let h = found.header;
        let mut seqs = found.seqs;
        for (i, s) in seqs.iter_mut().enumerate() {
            if *s > h.seq {
                // A header newer than the loaded state whose log failed to verify: erase it
                // so it can never compete with the sequence numbers written from now on.
                self.io
                    .write_at(&self.file, &[0u8; HEADER_LEN], i as u64 * HEADER_BLOCK)
                    .map_err(io_err(&path))?;
                *s = 0;
            }
        }
        let len = self.file.metadata().map_err(io_err(&path))?.len();
        if len > h.end {
            self.io.set_len(&self.file, h.end).map_err(io_err(&path))?;
        }
        self.io.sync_file(&self.file).map_err(io_err(&path))?;
        self.tokens = found.state.tokens.clone();
        self.end = h.end;
        self.chain = h.chain;
        self.seq = h.seq;
        self.seqs = seqs;
        self.current = found.copy;
        self.durable = found.copy;
        Ok(())
    }

    /// Tokens in the persisted (committed) state.
    pub fn persisted_tokens(&self) -> usize {
        self.tokens.len()
    }

    /// The persisted tokens themselves.
    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Bytes of the file's committed part (header region plus log).
    pub fn committed_bytes(&self) -> u64 {
        self.end
    }

    fn check_state(&self, what: &str, upto: usize, kv: &dyn KvRows) -> Result<()> {
        if kv.num_layers() != self.num_layers {
            return Err(Error::Input(format!(
                "slot file {what}: KV of another layer count than the file's {}",
                self.num_layers
            )));
        }
        if kv.positions() < upto {
            return Err(Error::Input(format!(
                "slot file {what}: KV rows shorter than {upto} positions"
            )));
        }
        Ok(())
    }

    /// Appends positions `start .. start + tokens.len()` (their KV rows taken from
    /// `keys[layer][pos*kv_dim..]` / `values`) after truncating the persisted state to `start`
    /// (start <= persisted length), then updates the header. No fsync.
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
        let kv = PositionMajor {
            keys,
            values,
            kv_dim: self.kv_dim,
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
            self.per_token,
            self.tuning.chunk,
        )
        .map_err(io_err(&path))?;
        // The header goes to a block that holds neither the newest header (the state a kill
        // must fall back to) nor the durable one (the state a power loss must fall back to).
        let target = (0..HEADER_COPIES)
            .filter(|&i| i != self.current && i != self.durable)
            .min_by_key(|&i| self.seqs[i])
            .expect("three header blocks leave at least one free");
        let header = Header {
            fingerprint: self.fingerprint,
            num_layers: self.num_layers as u64,
            kv_dim: self.kv_dim as u64,
            seq: self.seq + 1,
            end,
            tokens: (start + tokens.len()) as u64,
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
        self.tokens.truncate(start);
        self.tokens.extend_from_slice(tokens);
        Ok(())
    }

    /// Whether the log has grown well past what the live state needs.
    fn compaction_due(&self) -> bool {
        let live = if self.tokens.is_empty() {
            0
        } else {
            record_len(self.tokens.len() as u64, self.per_token).unwrap_or(u64::MAX)
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
        let kv = PositionMajor {
            keys,
            values,
            kv_dim: self.kv_dim,
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
    fn replace(&mut self, tokens: &[u32], kv: &dyn KvRows) -> Result<()> {
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
        let (end, chain) = if tokens.is_empty() {
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
                self.per_token,
                self.tuning.chunk,
            )
            .map_err(io_err(&tmp))?
        };
        let header = Header {
            fingerprint: self.fingerprint,
            num_layers: self.num_layers as u64,
            kv_dim: self.kv_dim as u64,
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::{Arc, Mutex};

    const L: usize = 2;
    const D: usize = 3;
    const FP: [u8; 32] = [0xa5; 32];

    /// The seeded generator of these tests, with the draws they need.
    struct Rng(rand::rngs::StdRng);

    impl Rng {
        fn new(seed: u64) -> Rng {
            Rng(rand::SeedableRng::seed_from_u64(seed))
        }
        fn next(&mut self) -> u64 {
            rand::RngExt::random(&mut self.0)
        }
        fn below(&mut self, n: usize) -> usize {
            rand::RngExt::random_range(&mut self.0, 0..n.max(1))
        }
        /// Mostly ordinary floats, with NaN payloads, signed zeros, infinities and subnormals.
        fn float(&mut self) -> f32 {
            match self.below(8) {
                0 => f32::from_bits(self.next() as u32), // any bit pattern, NaNs included
                1 => f32::from_bits(0x7fc0_1234),
                2 => -0.0,
                3 => f32::from_bits(1 + self.below(100) as u32),
                4 => f32::NEG_INFINITY,
                _ => (self.next() % 20001) as f32 / 1000.0 - 10.0,
            }
        }
    }

    /// A scratch directory, removed on drop.
    struct Scratch(PathBuf);

    impl Scratch {
        fn new(tag: &str) -> Scratch {
            static N: AtomicUsize = AtomicUsize::new(0);
            let base = if Path::new("/dev/shm").is_dir() {
                PathBuf::from("/dev/shm")
            } else {
                std::env::temp_dir()
            };
            let d = base.join(format!(
                "colibri-slotfile-{}-{tag}-{}",
                std::process::id(),
                N.fetch_add(1, Ordering::Relaxed)
            ));
            let _ = fs::remove_dir_all(&d);
            fs::create_dir_all(&d).unwrap();
            Scratch(d)
        }
        fn file(&self) -> PathBuf {
            self.0.join("slot.kv")
        }
    }

    impl Drop for Scratch {
        fn drop(&mut self) {
            let _ = fs::remove_dir_all(&self.0);
        }
    }

    fn same(a: &LoadedSlot, b: &LoadedSlot) -> bool {
        let bits = |v: &Vec<Vec<f32>>| -> Vec<Vec<u32>> {
            v.iter()
                .map(|l| l.iter().map(|x| x.to_bits()).collect())
                .collect()
        };
        a.tokens == b.tokens && bits(&a.keys) == bits(&b.keys) && bits(&a.values) == bits(&b.values)
    }

    /// Truncates `s` to `start` and appends `n` random positions.
    fn advance(s: &mut LoadedSlot, rng: &mut Rng, start: usize, n: usize, kv_dim: usize) {
        s.tokens.truncate(start);
        for _ in 0..n {
            s.tokens.push(rng.next() as u32);
        }
        for v in s.keys.iter_mut().chain(s.values.iter_mut()) {
            v.truncate(start * kv_dim);
            for _ in 0..n * kv_dim {
                v.push(rng.float());
            }
        }
    }

    fn commit(sf: &mut SlotFile, s: &LoadedSlot, start: usize) -> Result<()> {
        sf.commit(start, &s.tokens[start..], &s.keys, &s.values)
    }

    fn sync(sf: &mut SlotFile, s: &LoadedSlot) -> Result<()> {
        sf.sync(&s.tokens, &s.keys, &s.values)
    }

    fn load(path: &Path) -> std::result::Result<LoadedSlot, String> {
        let bytes = match fs::read(path) {
            Ok(b) => b,
            Err(e) if e.kind() == io::ErrorKind::NotFound => Vec::new(),
            Err(e) => panic!("{e}"),
        };
        Ok(load_bytes(&bytes, FP, L, D)?.unwrap_or_else(|| LoadedSlot::empty(L)))
    }

    // -----------------------------------------------------------------------------------------
    // The crash simulator

    /// How much of the write a kill interrupts lands.
    #[derive(Clone, Copy, Debug, PartialEq)]
    enum Tear {
        Nothing,
        OneByte,
        Half,
        AllButOne,
        /// Every other 4-byte block (a torn write that reached some sectors).
        Scatter,
    }

    const TEARS: [Tear; 5] = [
        Tear::Nothing,
        Tear::OneByte,
        Tear::Half,
        Tear::AllButOne,
        Tear::Scatter,
    ];

    #[derive(Default)]
    struct Log {
        ops: usize,
        dead: bool,
        killed_a_write: bool,
        /// The main file's bytes at its last fsync, and the writes since (power-loss model).
        synced: Vec<u8>,
        pending: Vec<(u64, Vec<u8>)>,
    }

    /// An [`Io`] that dies at its `kill_at`-th call (1-based): that call is torn per `tear`,
    /// every later one fails without effect. fsyncs do nothing (a process kill does not care)
    /// but snapshot the file for the power-loss model.
    struct Killer {
        log: Arc<Mutex<Log>>,
        kill_at: usize,
        tear: Tear,
    }

    fn killed() -> io::Error {
        io::Error::other("killed by the test")
    }

    impl Killer {
        fn new(kill_at: usize, tear: Tear) -> (Killer, Arc<Mutex<Log>>) {
            let log = Arc::new(Mutex::new(Log::default()));
            let k = Killer {
                log: log.clone(),
                kill_at,
                tear,
            };
            (k, log)
        }

        /// Ok(true): this call is the kill.
        fn step(&mut self, is_write: bool) -> io::Result<bool> {
            let mut g = self.log.lock().unwrap();
            if g.dead {
                return Err(killed());
            }
            g.ops += 1;
            if g.ops == self.kill_at {
                g.dead = true;
                g.killed_a_write = is_write;
                return Ok(true);
            }
            Ok(false)
        }
    }

    impl Io for Killer {
        fn write_at(&mut self, file: &File, buf: &[u8], offset: u64) -> io::Result<()> {
            if self.step(true)? {
                let m = buf.len();
                let land: Vec<(usize, usize)> = match self.tear {
                    Tear::Nothing => vec![],
                    Tear::OneByte => vec![(0, 1.min(m))],
                    Tear::Half => vec![(0, m / 2)],
                    Tear::AllButOne => vec![(0, m.saturating_sub(1))],
                    Tear::Scatter => (0..m).step_by(8).map(|a| (a, (a + 4).min(m))).collect(),
                };
                for (a, b) in land {
                    file.write_all_at(&buf[a..b], offset + a as u64)?;
                }
                return Err(killed());
            }
            file.write_all_at(buf, offset)?;
            self.log
                .lock()
                .unwrap()
                .pending
                .push((offset, buf.to_vec()));
            Ok(())
        }
        fn set_len(&mut self, file: &File, len: u64) -> io::Result<()> {
            if self.step(false)? {
                return Err(killed());
            }
            file.set_len(len)
        }
        fn sync_file(&mut self, file: &File) -> io::Result<()> {
            if self.step(false)? {
                return Err(killed());
            }
            let mut image = vec![0u8; file.metadata()?.len() as usize];
            file.read_exact_at(&mut image, 0)?;
            let mut g = self.log.lock().unwrap();
            g.synced = image;
            g.pending.clear();
            Ok(())
        }
        fn rename(&mut self, from: &Path, to: &Path) -> io::Result<()> {
            if self.step(false)? {
                return Err(killed());
            }
            fs::rename(from, to)
        }
        fn sync_dir(&mut self, _dir: &Path) -> io::Result<()> {
            if self.step(false)? {
                return Err(killed());
            }
            Ok(())
        }
    }

    #[derive(Clone, Copy, Debug)]
    enum Step {
        Commit(usize, usize),
        Sync,
    }

    use Step::{Commit as C, Sync as S};

    /// Appends of 1 and many tokens, truncations (with and without new tokens), and two syncs
    /// that compact (with `compact_slack: 0`).
    const SCRIPT: [Step; 15] = [
        C(0, 5),
        C(5, 1),
        C(6, 1),
        S,
        C(3, 4),
        C(2, 0),
        S, // compacts
        C(2, 6),
        C(8, 1),
        C(9, 1),
        S,
        C(0, 3),
        C(3, 2),
        S, // compacts
        C(5, 1),
    ];

    const SMALL: Tuning = Tuning {
        chunk: 40,
        compact_slack: 0,
    };

    /// Runs SCRIPT with a writer killed at its `kill_at`-th call. Returns whether the kill
    /// happened, whether it hit a write, and the states the file may now hold.
    fn run_killed(path: &Path, kill_at: usize, tear: Tear) -> (bool, bool, Vec<LoadedSlot>) {
        let (killer, log) = Killer::new(kill_at, tear);
        let mut rng = Rng::new(42);
        let mut truth = LoadedSlot::empty(L);
        let acceptable = match SlotFile::open_with(path, FP, L, D, Box::new(killer), SMALL) {
            Err(_) => vec![truth],
            Ok((mut sf, opened)) => {
                assert!(matches!(opened, Opened::Fresh), "{opened:?}");
                let mut outcome = None;
                for step in SCRIPT {
                    match step {
                        Step::Commit(start, n) => {
                            let before = truth.clone();
                            advance(&mut truth, &mut rng, start, n, D);
                            if commit(&mut sf, &truth, start).is_err() {
                                outcome = Some(vec![before, truth.clone()]);
                                break;
                            }
                            assert_eq!(sf.persisted_tokens(), truth.tokens.len());
                        }
                        Step::Sync => {
                            if sync(&mut sf, &truth).is_err() {
                                outcome = Some(vec![truth.clone()]);
                                break;
                            }
                        }
                    }
                }
                outcome.unwrap_or_else(|| vec![truth])
            }
        };
        let g = log.lock().unwrap();
        (g.dead, g.killed_a_write, acceptable)
    }

    #[test]
    fn a_kill_at_any_write_leaves_the_last_or_the_inflight_commit() {
        let mut runs = 0;
        for kill_at in 1.. {
            let mut done = false;
            for tear in TEARS {
                let dir = Scratch::new("kill");
                let path = dir.file();
                let (killed, hit_write, acceptable) = run_killed(&path, kill_at, tear);
                runs += 1;
                if !killed {
                    done = true;
                }
                let got = load(&path).unwrap_or_else(|why| {
                    panic!("kill at call {kill_at} ({tear:?}): refused: {why}")
                });
                assert!(
                    acceptable.iter().any(|s| same(s, &got)),
                    "kill at call {kill_at} ({tear:?}): {} tokens loaded, not a state just committed",
                    got.tokens.len()
                );
                // The server restarts on the file and carries on.
                let (mut sf, opened) = SlotFile::open(&path, FP, L, D).unwrap();
                match opened {
                    Opened::Fresh => assert!(got.tokens.is_empty()),
                    Opened::Loaded(s) => assert!(same(&s, &got)),
                    Opened::Refused(why) => panic!("refused on reopen: {why}"),
                }
                let mut next = got;
                let start = next.tokens.len() / 2;
                advance(&mut next, &mut Rng::new(kill_at as u64), start, 2, D);
                commit(&mut sf, &next, start).unwrap();
                sync(&mut sf, &next).unwrap();
                drop(sf);
                assert!(same(&load(&path).unwrap(), &next));
                assert!(!tmp_path(&path).exists() || kill_at > 0);
                if !hit_write {
                    break; // the other tears are the same kill
                }
            }
            if done {
                break;
            }
        }
        assert!(runs > 100, "only {runs} runs");
    }

    #[test]
    fn a_kill_while_reopening_a_damaged_file_is_harmless() {
        let dir = Scratch::new("reopen");
        let path = dir.file();
        let mut rng = Rng::new(5);
        let mut s = LoadedSlot::empty(L);
        let (mut sf, _) = SlotFile::open(&path, FP, L, D).unwrap();
        advance(&mut s, &mut rng, 0, 4, D);
        commit(&mut sf, &s, 0).unwrap();
        let older = s.clone();
        let older_end = sf.committed_bytes();
        advance(&mut s, &mut rng, 4, 3, D);
        commit(&mut sf, &s, 4).unwrap();
        sync(&mut sf, &s).unwrap();
        drop(sf);
        // Damage the newest record: the newest header no longer verifies, the older one does.
        let mut bytes = fs::read(&path).unwrap();
        bytes[older_end as usize + 30] ^= 0x10;
        bytes.extend([7u8; 100]); // and leftovers past the end
        for kill_at in 1..10 {
            for tear in TEARS {
                fs::write(&path, &bytes).unwrap();
                let (killer, _) = Killer::new(kill_at, tear);
                let r = SlotFile::open_with(&path, FP, L, D, Box::new(killer), SMALL);
                if let Ok((_, opened)) = &r {
                    assert!(matches!(opened, Opened::Loaded(x) if same(x, &older)));
                }
                drop(r);
                assert!(same(&load(&path).unwrap(), &older), "kill at {kill_at}");
                let (_, opened) = SlotFile::open(&path, FP, L, D).unwrap();
                assert!(matches!(opened, Opened::Loaded(x) if same(&x, &older)));
            }
        }
        // Once adopted, the bad header is gone and the file is exactly the older state.
        assert_eq!(fs::metadata(&path).unwrap().len(), older_end);
    }

    /// Power loss: the file as of the last fsync plus any subset of the later writes, each
    /// whole, torn or lost, in any order. It must load a state committed since that fsync.
    #[test]
    fn a_power_loss_loads_a_state_committed_since_the_last_sync() {
        let dir = Scratch::new("power");
        let path = dir.file();
        let (killer, log) = Killer::new(usize::MAX, Tear::Nothing);
        let tuning = Tuning {
            chunk: 40,
            compact_slack: u64::MAX / 4,
        };
        let (mut sf, _) = SlotFile::open_with(&path, FP, L, D, Box::new(killer), tuning).unwrap();
        let mut rng = Rng::new(9);
        let mut truth = LoadedSlot::empty(L);
        let mut states = vec![truth.clone()];
        let mut synced = 0;
        let mut trials = 0;
        for step in SCRIPT.iter().chain(&SCRIPT) {
            match *step {
                Step::Commit(start, n) => {
                    let start = start.min(truth.tokens.len());
                    advance(&mut truth, &mut rng, start, n, D);
                    commit(&mut sf, &truth, start).unwrap();
                    states.push(truth.clone());
                }
                Step::Sync => {
                    sync(&mut sf, &truth).unwrap();
                    synced = states.len() - 1;
                }
            }
            let (image, pending) = {
                let g = log.lock().unwrap();
                (g.synced.clone(), g.pending.clone())
            };
            for trial in 0..40 {
                let mut disk = image.clone();
                let mut order: Vec<usize> = (0..pending.len()).collect();
                if trial > 1 {
                    for i in (1..order.len()).rev() {
                        order.swap(i, rng.below(i + 1));
                    }
                }
                for &i in &order {
                    let (off, buf) = &pending[i];
                    let fate = match trial {
                        0 => 1,            // everything lands, in order
                        1 => 0,            // nothing lands
                        _ => rng.below(4), // lost, whole, torn, scattered
                    };
                    let off = *off as usize;
                    if disk.len() < off + buf.len() && fate != 0 {
                        disk.resize(off + buf.len(), 0);
                    }
                    match fate {
                        0 => {}
                        1 => disk[off..off + buf.len()].copy_from_slice(buf),
                        2 => {
                            let m = rng.below(buf.len() + 1);
                            disk[off..off + m].copy_from_slice(&buf[..m]);
                        }
                        _ => {
                            for a in (0..buf.len()).filter(|_| rng.below(2) == 0) {
                                disk[off + a] = buf[a];
                            }
                        }
                    }
                }
                let got = load_bytes(&disk, FP, L, D)
                    .unwrap_or_else(|why| panic!("refused after a power loss: {why}"))
                    .unwrap();
                let ok = states[synced..].iter().any(|s| same(s, &got));
                assert!(
                    ok,
                    "loaded a state older than the last sync or never committed"
                );
                if trial == 0 {
                    assert!(same(&got, states.last().unwrap()));
                }
                if trial == 1 {
                    assert!(same(&got, &states[synced]));
                }
                trials += 1;
            }
        }
        assert!(trials > 500);
    }

    // -----------------------------------------------------------------------------------------
    // Round trips, damage, foreign files

    /// A file written by the script (no compaction), with every state it committed.
    fn scripted_file(tuning: Tuning, seed: u64) -> (Vec<u8>, Vec<LoadedSlot>) {
        let dir = Scratch::new("scripted");
        let path = dir.file();
        let (mut sf, _) = SlotFile::open_with(&path, FP, L, D, Box::new(RealIo), tuning).unwrap();
        let mut rng = Rng::new(seed);
        let mut truth = LoadedSlot::empty(L);
        let mut states = vec![truth.clone()];
        for step in SCRIPT {
            match step {
                Step::Commit(start, n) => {
                    advance(&mut truth, &mut rng, start, n, D);
                    commit(&mut sf, &truth, start).unwrap();
                    states.push(truth.clone());
                }
                Step::Sync => sync(&mut sf, &truth).unwrap(),
            }
        }
        drop(sf);
        (fs::read(&path).unwrap(), states)
    }

    const NO_COMPACTION: Tuning = Tuning {
        chunk: 1 << 20,
        compact_slack: u64::MAX / 4,
    };

    #[test]
    fn commits_round_trip_bit_exact() {
        let dir = Scratch::new("roundtrip");
        let path = dir.file();
        let mut rng = Rng::new(1);
        let mut truth = LoadedSlot::empty(L);
        let (mut sf, opened) = SlotFile::open(&path, FP, L, D).unwrap();
        assert!(matches!(opened, Opened::Fresh));
        for round in 0..4 {
            // A prefill, single-token decode steps, a truncation to a shorter prefix, more.
            let start = truth.tokens.len();
            advance(&mut truth, &mut rng, start, 20 + round, D);
            commit(&mut sf, &truth, start).unwrap();
            for _ in 0..5 {
                let start = truth.tokens.len();
                advance(&mut truth, &mut rng, start, 1, D);
                commit(&mut sf, &truth, start).unwrap();
            }
            let start = truth.tokens.len() - 7;
            advance(&mut truth, &mut rng, start, 3, D);
            commit(&mut sf, &truth, start).unwrap();
            sync(&mut sf, &truth).unwrap();
            assert_eq!(sf.persisted_tokens(), truth.tokens.len());
            assert_eq!(sf.tokens(), &truth.tokens[..]);
            drop(sf);
            let (again, opened) = SlotFile::open(&path, FP, L, D).unwrap();
            sf = again;
            match opened {
                Opened::Loaded(s) => assert!(same(&s, &truth)),
                other => panic!("{other:?}"),
            }
        }
        // Truncating everything is a commit too.
        advance(&mut truth, &mut rng, 0, 0, D);
        commit(&mut sf, &truth, 0).unwrap();
        drop(sf);
        let (_, opened) = SlotFile::open(&path, FP, L, D).unwrap();
        assert!(matches!(opened, Opened::Fresh));
    }

    #[test]
    fn records_larger_than_a_write_chunk_round_trip() {
        let dir = Scratch::new("chunks");
        let path = dir.file();
        let tuning = Tuning {
            chunk: 7,
            compact_slack: 0,
        };
        let mut rng = Rng::new(3);
        let mut truth = LoadedSlot::empty(L);
        let (mut sf, _) = SlotFile::open_with(&path, FP, L, D, Box::new(RealIo), tuning).unwrap();
        advance(&mut truth, &mut rng, 0, 50, D);
        commit(&mut sf, &truth, 0).unwrap();
        advance(&mut truth, &mut rng, 10, 1, D);
        commit(&mut sf, &truth, 10).unwrap();
        sync(&mut sf, &truth).unwrap(); // compacts, through 7-byte writes
        drop(sf);
        assert!(same(&load(&path).unwrap(), &truth));
    }

    #[test]
    fn compaction_keeps_the_state_and_shrinks_the_file() {
        let dir = Scratch::new("compact");
        let path = dir.file();
        let tuning = Tuning {
            chunk: 1 << 20,
            compact_slack: 4096,
        };
        let mut rng = Rng::new(4);
        let mut truth = LoadedSlot::empty(L);
        let (mut sf, _) = SlotFile::open_with(&path, FP, L, D, Box::new(RealIo), tuning).unwrap();
        advance(&mut truth, &mut rng, 0, 30, D);
        commit(&mut sf, &truth, 0).unwrap();
        // Regenerate the tail many times: the log grows, the state does not.
        for _ in 0..40 {
            advance(&mut truth, &mut rng, 25, 5, D);
            commit(&mut sf, &truth, 25).unwrap();
        }
        let before = fs::metadata(&path).unwrap().len();
        assert!(sf.compaction_due());
        sync(&mut sf, &truth).unwrap();
        let after = fs::metadata(&path).unwrap().len();
        assert_eq!(
            after,
            LOG_START + record_len(30, token_bytes(L, D).unwrap()).unwrap()
        );
        assert!(
            (after - LOG_START) * 5 < before - LOG_START,
            "{before} -> {after}"
        );
        assert!(!tmp_path(&path).exists());
        // The compacted file keeps working: commit on it, reopen.
        advance(&mut truth, &mut rng, 30, 2, D);
        commit(&mut sf, &truth, 30).unwrap();
        drop(sf);
        let (_, opened) = SlotFile::open(&path, FP, L, D).unwrap();
        assert!(matches!(opened, Opened::Loaded(s) if same(&s, &truth)));
    }

    #[test]
    fn truncation_at_every_offset_loads_a_committed_state_or_refuses() {
        let (bytes, states) = scripted_file(NO_COMPACTION, 77);
        for cut in 0..bytes.len() {
            match load_bytes(&bytes[..cut], FP, L, D) {
                Ok(None) => assert_eq!(cut, 0),
                Ok(Some(s)) => assert!(states.iter().any(|t| same(t, &s)), "cut at {cut}"),
                Err(_) => {}
            }
        }
        let full = load_bytes(&bytes, FP, L, D).unwrap().unwrap();
        assert!(same(&full, states.last().unwrap()));
    }

    #[test]
    fn corruption_anywhere_loads_a_committed_state_or_refuses() {
        let (bytes, states) = scripted_file(NO_COMPACTION, 77);
        // Every byte flipped once (header blocks' used bytes and the whole log)...
        let mut offsets: Vec<usize> = (0..HEADER_COPIES)
            .flat_map(|i| i * HEADER_BLOCK as usize..i * HEADER_BLOCK as usize + HEADER_LEN)
            .collect();
        offsets.extend(LOG_START as usize..bytes.len());
        let mut refused = 0;
        for &at in &offsets {
            let mut b = bytes.clone();
            b[at] ^= 0x41;
            match load_bytes(&b, FP, L, D) {
                Ok(Some(s)) => assert!(states.iter().any(|t| same(t, &s)), "flip at {at}"),
                Ok(None) => panic!("flip at {at}: empty"),
                Err(_) => refused += 1,
            }
        }
        // ...flips in the log are caught, by a refusal or a fallback to an older header.
        assert!(refused < offsets.len());
        // ...and random damage: bytes, ranges, truncations, u64::MAX over a field.
        let mut rng = Rng::new(123);
        for i in 0..4000 {
            let mut b = bytes.clone();
            for _ in 0..1 + rng.below(3) {
                let at = if rng.below(2) == 0 {
                    rng.below(b.len())
                } else {
                    rng.below(HEADER_COPIES) * HEADER_BLOCK as usize + rng.below(HEADER_LEN)
                };
                let at = at.min(b.len() - 1);
                match rng.below(5) {
                    0 => b[at] = rng.next() as u8,
                    1 => b.truncate(at.max(1)),
                    2 => {
                        let end = (at + rng.below(64)).min(b.len());
                        b[at..end].fill(0);
                    }
                    3 if at + 8 <= b.len() => b[at..at + 8].copy_from_slice(&[0xff; 8]),
                    _ => b[at] ^= 1 << rng.below(8),
                }
            }
            match load_bytes(&b, FP, L, D) {
                Ok(Some(s)) => assert!(states.iter().any(|t| same(t, &s)), "case {i}"),
                Ok(None) => panic!("case {i}: empty"),
                Err(_) => {}
            }
        }
    }

    #[test]
    fn a_header_accepts_only_the_log_it_committed() {
        // Two histories of the same shape: the same record sizes and token counts.
        let (a, _) = scripted_file(NO_COMPACTION, 77);
        let (b, _) = scripted_file(NO_COMPACTION, 78);
        assert_eq!(a.len(), b.len());
        let mut spliced = a[..LOG_START as usize].to_vec();
        spliced.extend_from_slice(&b[LOG_START as usize..]);
        let why = load_bytes(&spliced, FP, L, D).expect_err("another log");
        assert!(why.contains("checksum"), "{why}");
    }

    /// Rewrites every valid header copy through `edit` and re-seals its checksum.
    fn edit_headers(bytes: &mut [u8], edit: impl Fn(&mut [u8])) {
        for i in 0..HEADER_COPIES {
            let b = &mut bytes[i * HEADER_BLOCK as usize..][..HEADER_LEN];
            if matches!(parse_block(b), Block::Valid(_)) {
                edit(b);
                let sum = xxh3_64(&b[..HEADER_SUMMED]);
                b[96..104].copy_from_slice(&sum.to_le_bytes());
            }
        }
    }

    #[test]
    fn foreign_files_are_refused_with_a_reason() {
        let (bytes, _) = scripted_file(NO_COMPACTION, 77);
        let why = |b: &[u8], fp: [u8; 32], l: usize, d: usize| match load_bytes(b, fp, l, d) {
            Err(why) => why,
            Ok(_) => panic!("accepted"),
        };
        assert!(why(&bytes, [0; 32], L, D).contains("fingerprint"));
        assert!(why(&bytes, FP, L + 1, D).contains("KV layout 2 layers x 3"));
        assert!(why(&bytes, FP, L, D + 1).contains("KV layout"));
        let mut b = bytes.clone();
        edit_headers(&mut b, |h| h[8..12].copy_from_slice(&2u32.to_le_bytes()));
        assert!(
            why(&b, FP, L, D).contains("version 2"),
            "{}",
            why(&b, FP, L, D)
        );
        let mut b = bytes.clone();
        edit_headers(&mut b, |h| h[0] = b'X');
        assert!(why(&b, FP, L, D).contains("bad magic"));
        let mut b = bytes.clone();
        for i in 0..HEADER_COPIES {
            b[i * HEADER_BLOCK as usize + 70] ^= 1;
        }
        assert!(why(&b, FP, L, D).contains("checksum"));
        assert!(why(b"GGUF\x03\0\0\0 something else", FP, L, D).contains("bad magic"));
        assert!(why(&bytes[..100], FP, L, D).contains("truncated"));
        assert!(why(&vec![0u8; 20000], FP, L, D).contains("bad magic"));
        assert_eq!(load_bytes(&[], FP, L, D), Ok(None));
        // Absurd layouts from the caller do not overflow.
        assert!(load_bytes(&bytes, FP, usize::MAX, usize::MAX).is_err());
        assert!(load_bytes(&bytes, FP, 0, usize::MAX).is_err());
    }

    #[test]
    fn open_refuses_and_resets_a_foreign_file() {
        let dir = Scratch::new("foreign");
        let path = dir.file();
        let mut s = LoadedSlot::empty(L);
        advance(&mut s, &mut Rng::new(8), 0, 3, D);
        let (mut sf, _) = SlotFile::open(&path, FP, L, D).unwrap();
        commit(&mut sf, &s, 0).unwrap();
        sync(&mut sf, &s).unwrap();
        drop(sf);
        // Another model's fingerprint.
        let (sf, opened) = SlotFile::open(&path, [1; 32], L, D).unwrap();
        assert!(matches!(&opened, Opened::Refused(w) if w.contains("fingerprint")));
        assert_eq!(sf.persisted_tokens(), 0);
        drop(sf);
        assert_eq!(
            load_bytes(&fs::read(&path).unwrap(), [1; 32], L, D)
                .unwrap()
                .unwrap()
                .tokens
                .len(),
            0
        );
        // Not a slot file at all.
        fs::write(&path, b"hello").unwrap();
        let (sf, opened) = SlotFile::open(&path, FP, L, D).unwrap();
        assert!(
            matches!(&opened, Opened::Refused(w) if w.contains("bad magic")),
            "{opened:?}"
        );
        drop(sf);
        // An empty file (a crash right after creating it) is just fresh.
        fs::write(&path, b"").unwrap();
        let (_, opened) = SlotFile::open(&path, FP, L, D).unwrap();
        assert!(matches!(opened, Opened::Fresh));
    }

    #[test]
    fn a_second_opener_is_turned_away() {
        let dir = Scratch::new("lock");
        let path = dir.file();
        let (sf, _) = SlotFile::open(&path, FP, L, D).unwrap();
        let err = SlotFile::open(&path, FP, L, D).expect_err("locked");
        assert!(err.to_string().contains(IN_USE), "{err}");
        if Path::new("/proc/locks").exists() {
            // flock locks belong to the open file, so this process's first open is the holder.
            let pid = std::process::id();
            assert!(err.to_string().contains(&format!("(pid {pid})")), "{err}");
        }
        drop(sf);
        SlotFile::open(&path, FP, L, D).unwrap();
    }

    #[test]
    fn slot_files_can_move_between_threads() {
        fn shareable<T: Send + Sync>() {}
        shareable::<SlotFile>();
    }

    #[test]
    fn bad_arguments_are_errors_not_panics() {
        let dir = Scratch::new("args");
        let path = dir.file();
        let mut s = LoadedSlot::empty(L);
        advance(&mut s, &mut Rng::new(2), 0, 4, D);
        let (mut sf, _) = SlotFile::open(&path, FP, L, D).unwrap();
        assert!(sf.commit(1, &s.tokens, &s.keys, &s.values).is_err()); // past the persisted
        assert!(sf.commit(0, &s.tokens, &s.keys[..1], &s.values).is_err()); // a layer short
        let short: Vec<Vec<f32>> = s.keys.iter().map(|k| k[..5].to_vec()).collect();
        assert!(sf.commit(0, &s.tokens, &short, &s.values).is_err()); // rows short
        commit(&mut sf, &s, 0).unwrap();
        assert!(sf.sync(&[9, 9, 9, 9], &s.keys, &s.values).is_err()); // other tokens
        assert!(sf.sync(&s.tokens[..2], &s.keys, &s.values).is_err()); // fewer tokens
        sync(&mut sf, &s).unwrap();
        // A no-op commit writes nothing.
        let end = sf.committed_bytes();
        sf.commit(4, &[], &s.keys, &s.values).unwrap();
        assert_eq!(sf.committed_bytes(), end);
        // Layouts without layers or KV still work.
        let (mut z, _) = SlotFile::open(&dir.0.join("z.kv"), FP, 0, 7).unwrap();
        z.commit(0, &[1, 2, 3], &[], &[]).unwrap();
        drop(z);
        let b = fs::read(dir.0.join("z.kv")).unwrap();
        assert_eq!(
            load_bytes(&b, FP, 0, 7).unwrap().unwrap().tokens,
            vec![1, 2, 3]
        );
    }

    #[test]
    fn lock_holder_is_read_from_proc_locks() {
        let locks = "1: POSIX  ADVISORY  WRITE 77 00:2a:99 0 EOF\n\
                     2: FLOCK  ADVISORY  WRITE 4242 103:02:1234567 0 EOF\n\
                     2: -> FLOCK  ADVISORY  WRITE 5151 103:02:1234567 0 EOF\n\
                     3: OFDLCK ADVISORY  WRITE -1 00:2b:5 0 EOF\n";
        assert_eq!(lock_holder_in(locks, 0x103, 2, 1234567), Some(4242));
        assert_eq!(lock_holder_in(locks, 0, 0x2a, 99), Some(77));
        assert_eq!(lock_holder_in(locks, 0, 0x2b, 5), None); // pid -1: not known
        assert_eq!(lock_holder_in(locks, 0x103, 2, 7), None);
        assert_eq!(lock_holder_in("", 0, 0, 0), None);
        // glibc's st_dev encoding: (major << 8) | minor for small numbers.
        assert_eq!(dev_parts(0x0803), (8, 3));
        assert_eq!(dev_parts((259 << 8) | 2), (259, 2));
    }
}
