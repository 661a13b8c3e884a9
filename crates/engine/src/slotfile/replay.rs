//! Loading: restoring a slot from the log (the newest header whose records replay and chain
//! to it), from the open file or from bytes in memory.

use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt;

use xxhash_rust::xxh3::Xxh3;

use super::format::{
    hex, le_u32, le_u64, parse_block, Block, Header, Shape, HEADER_BLOCK, HEADER_COPIES, LOG_START,
    RECORD_HEAD, RECORD_MAGIC, RECORD_TAIL, SLOT_FILE_MAGIC, STATE_HEAD, STATE_MAGIC, VERSIONS,
};
use super::LoadedSlot;
use crate::kv::KvLayout;

/// Something the loader reads from: bytes in memory or the open file.
pub(super) trait Source {
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

pub(super) enum LoadError {
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
pub(super) struct Found {
    pub(super) state: LoadedSlot,
    pub(super) header: Header,
    pub(super) copy: usize,
    /// `seq` of each block's valid header (0: none).
    pub(super) seqs: [u64; HEADER_COPIES],
}

/// Loads the newest header whose log verifies. `Ok(None)`: an empty source.
pub(super) fn load_from<S: Source + ?Sized>(
    src: &S,
    fingerprint: [u8; 32],
    shape: &Shape,
) -> std::result::Result<Option<Found>, LoadError> {
    let size = src.size()?;
    if size == 0 {
        return Ok(None);
    }
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
                "slot file version {v}, this build reads versions {VERSIONS}"
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
        if h.version != shape.version() {
            return Err(LoadError::Invalid(format!(
                "slot file version {}, this model's slot files are version {}",
                h.version,
                shape.version()
            )));
        }
        if h.fingerprint != fingerprint {
            return Err(LoadError::Invalid(format!(
                "made for another model or KV layout (fingerprint {}, expected {})",
                hex(&h.fingerprint[..8]),
                hex(&fingerprint[..8])
            )));
        }
        if h.num_layers != shape.num_layers() as u64 || h.kv_dim != shape.kv_dim {
            return Err(LoadError::Invalid(format!(
                "KV layout {}, expected {}",
                Shape::describe(h.num_layers, h.kv_dim),
                Shape::describe(shape.num_layers() as u64, shape.kv_dim)
            )));
        }
    }
    // Newest first; an older copy is a fallback for when the newer one's log does not verify
    // (corruption, or a power loss that kept the header but not its record).
    valid.sort_by_key(|v| std::cmp::Reverse(v.1.seq));
    let mut first_err = None;
    for (copy, header) in valid {
        match replay(src, size, &header, shape) {
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
    shape: &Shape,
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
    let mut st = LoadedSlot::empty(shape.num_layers());
    let mut pos = LOG_START;
    let mut chain = 0u64;
    // The latest state record still valid: (position, every layer's state, concatenated).
    let mut state: Option<(usize, Vec<f32>)> = None;
    while pos < h.end {
        let avail = h.end - pos;
        if avail < RECORD_HEAD + RECORD_TAIL {
            return bad(format!(
                "record at byte {pos}: cut off by the committed end"
            ));
        }
        let mut head = [0u8; RECORD_HEAD as usize];
        src.read_at(&mut head, pos)?;
        if head[0..4] == STATE_MAGIC && shape.has_states() && le_u32(&head, 4) == 0 {
            let (position, floats) = (le_u64(&head, 8), le_u64(&head, 16));
            if position != st.tokens.len() as u64 {
                return bad(format!(
                    "state record at byte {pos}: for position {position}, after {} tokens",
                    st.tokens.len()
                ));
            }
            if floats != shape.state_floats() {
                return bad(format!(
                    "state record at byte {pos}: {floats} floats, expected {}",
                    shape.state_floats()
                ));
            }
            if floats > (avail - STATE_HEAD - RECORD_TAIL) / 4 {
                return bad(format!(
                    "state record at byte {pos}: overruns the committed end"
                ));
            }
            let mut hash = Xxh3::with_seed(chain);
            hash.update(&head[..STATE_HEAD as usize]);
            let mut data = Vec::new();
            read_f32s(src, &mut data, floats as usize, pos + STATE_HEAD, &mut hash)?;
            let at = pos + STATE_HEAD + 4 * floats;
            let mut tail = [0u8; 8];
            src.read_at(&mut tail, at)?;
            let sum = hash.digest();
            if u64::from_le_bytes(tail) != sum {
                return bad(format!("state record at byte {pos}: checksum mismatch"));
            }
            state = Some((position as usize, data));
            chain = sum;
            pos = at + RECORD_TAIL;
            continue;
        }
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
        // The record's size <= avail, without overflow: bounds every allocation below by
        // bytes that exist.
        if shape.record_len(start, n).is_none_or(|len| len > avail) {
            return bad(format!(
                "record at byte {pos}: {n} tokens overrun the committed end"
            ));
        }
        let (start, n) = (start as usize, n as usize);
        // A record that goes back before the last state leaves no state for what follows.
        if state.as_ref().is_some_and(|(p, _)| start < *p) {
            state = None;
        }
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
        for (l, &(kw, vw)) in shape.widths.iter().enumerate() {
            // rows * (kw + vw) * 4 <= the record's bytes (checked above).
            // (start + n cannot overflow: `record_len` computed it.)
            let before = start / shape.every[l];
            let rows = (start + n) / shape.every[l] - before;
            for (v, w) in [(&mut st.keys[l], kw), (&mut st.values[l], vw)] {
                v.truncate(before * w);
                read_f32s(src, v, rows * w, at, &mut hash)?;
                at += 4 * (rows * w) as u64;
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
    if shape.has_states() {
        // The history ends where the last state belongs (positions after it could not be
        // continued without their state); none: nothing.
        let (n, data) = state.unwrap_or((0, Vec::new()));
        st.tokens.truncate(n);
        for (l, &(kw, vw)) in shape.widths.iter().enumerate() {
            let rows = n / shape.every[l];
            st.keys[l].truncate(rows * kw);
            st.values[l].truncate(rows * vw);
        }
        let mut at = 0;
        for (l, &w) in shape.states.iter().enumerate() {
            st.states[l] = if data.is_empty() {
                vec![0.0; w]
            } else {
                data[at..at + w].to_vec()
            };
            at += w;
        }
    }
    Ok(st)
}

/// Pure loader over the bytes of a slot file (tests, fuzzing) of `num_layers` layers of
/// `kv_dim` keys and values per position ([`load_bytes_layout`]: any layout): `Ok(Some(state))`
/// for a valid file (possibly with no tokens), `Ok(None)` for an empty (new) file, `Err(reason)`
/// for a foreign or damaged one. Never panics; allocations are bounded by `bytes.len()` (plus
/// the `num_layers` empty vectors of the result); O(file size).
pub fn load_bytes(
    bytes: &[u8],
    fingerprint: [u8; 32],
    num_layers: usize,
    kv_dim: usize,
) -> std::result::Result<Option<LoadedSlot>, String> {
    if bytes.is_empty() {
        return Ok(None);
    }
    load_shape(bytes, fingerprint, &Shape::uniform(num_layers, kv_dim)?)
}

/// [`load_bytes`] for the slot file of a model whose KV is laid out as `layout` (per layer,
/// `tokens * heads * key_dim` keys and `tokens * heads * value_dim` values).
pub fn load_bytes_layout(
    bytes: &[u8],
    fingerprint: [u8; 32],
    layout: &KvLayout,
) -> std::result::Result<Option<LoadedSlot>, String> {
    if bytes.is_empty() {
        return Ok(None);
    }
    load_shape(bytes, fingerprint, &Shape::of(layout)?)
}

/// [`load_bytes_layout`] for the (version-2 or 3) slot files of a model whose layers also carry
/// `states[li]` floats of state: the loaded slot ends at the last state record's position and
/// holds that state.
pub fn load_bytes_states(
    bytes: &[u8],
    fingerprint: [u8; 32],
    layout: &KvLayout,
    states: &[usize],
) -> std::result::Result<Option<LoadedSlot>, String> {
    if bytes.is_empty() {
        return Ok(None);
    }
    load_shape(bytes, fingerprint, &Shape::of(layout)?.with_states(states)?)
}

fn load_shape(
    bytes: &[u8],
    fingerprint: [u8; 32],
    shape: &Shape,
) -> std::result::Result<Option<LoadedSlot>, String> {
    match load_from(bytes, fingerprint, shape) {
        Ok(found) => Ok(found.map(|f| f.state)),
        Err(LoadError::Invalid(why)) => Err(why),
        Err(LoadError::Io(e)) => Err(e.to_string()),
    }
}
