//! Re-encodes a format-v2 model directory as v3, losslessly: v3 only moved each int4 row's
//! nibble bytes (blocks of 16 groups interleaved by 4-byte word, `quant::nibble_offset`), so the
//! upgrade permutes them and copies everything else. The weights, scales and results are the
//! ones the checkpoint was converted to, without the checkpoint or a new quantization.
//!
//! The new directory is written beside the destination under a temporary name and renamed into
//! place at the end, so an interrupted upgrade leaves no half-written model; the source is only
//! read.

use std::fs::{self, File};
use std::io::{BufWriter, Read, Write};
use std::path::{Path, PathBuf};

use crate::convert::Progress;
use crate::error::{io_err, Error, Result};
use crate::format::{
    check_file_name, read_manifest, DType, Manifest, TensorEntry, FORMAT_NAME, FORMAT_VERSION,
    MANIFEST,
};
use crate::quant::{q4_row_bytes, v2_nibbles_to_v3, Q4Matrix, GROUP};

/// The only version this module upgrades from.
const FROM_VERSION: u32 = 2;

fn fmt_err(msg: impl Into<String>) -> Error {
    Error::Format(msg.into())
}

/// What [`upgrade`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UpgradeSummary {
    /// int4 matrices re-encoded (resident tensors, plus expert parts once per record).
    pub matrices: usize,
    /// Bytes written for the weight files.
    pub bytes: u64,
}

/// Reads `src`'s manifest and checks it is a v2 colibri model directory.
fn read_v2_manifest(src: &Path) -> Result<Manifest> {
    let m = read_manifest(src)?;
    if m.format != FORMAT_NAME {
        return Err(fmt_err(format!(
            "{}: not a colibri model directory (format `{}`)",
            src.join(MANIFEST).display(),
            m.format
        )));
    }
    if m.version == FORMAT_VERSION {
        return Err(fmt_err(format!(
            "{}: already format v{FORMAT_VERSION}, nothing to upgrade",
            src.display()
        )));
    }
    if m.version != FROM_VERSION {
        return Err(fmt_err(format!(
            "{}: format v{} cannot be upgraded (only v{FROM_VERSION}); convert the checkpoint \
             again with `colibri convert`",
            src.display(),
            m.version
        )));
    }
    // The table grid came after v2: such a manifest is not one v2 wrote.
    let resident = m.resident.tensors.iter();
    let parts = m.experts.iter().flat_map(|x| x.parts.iter());
    if let Some((name, _)) = resident.chain(parts).find(|(_, e)| e.dtype == DType::Q4T) {
        return Err(fmt_err(format!(
            "{}: tensor `{name}` is q4t, which no format v2 directory holds",
            src.display()
        )));
    }
    Ok(m)
}

/// An int4 entry's `(rows, cols)`, if its shape is a matrix's.
fn q4_shape(name: &str, e: &TensorEntry) -> Result<(usize, usize)> {
    match e.shape[..] {
        [rows, cols] => Ok((rows, cols)),
        _ => Err(fmt_err(format!(
            "{name}: int4 tensor with shape {:?}",
            e.shape
        ))),
    }
}

/// Re-encodes the int4 matrix `bytes` (`rows x cols`, v2 layout) in place as v3.
fn reencode(bytes: &mut [u8], rows: usize, cols: usize) {
    let row = q4_row_bytes(cols);
    let groups = cols.div_ceil(GROUP);
    let mut scratch = vec![0u8; groups * 16];
    for r in 0..rows {
        let nib = &mut bytes[r * row + groups * 2..(r + 1) * row];
        v2_nibbles_to_v3(groups, nib, &mut scratch);
        nib.copy_from_slice(&scratch);
    }
}

/// Re-encodes every int4 tensor of `entries` inside `buf` (offsets relative to `buf`).
fn reencode_all<'a>(
    buf: &mut [u8],
    entries: impl Iterator<Item = (&'a String, &'a TensorEntry)>,
) -> Result<usize> {
    let mut n = 0;
    for (name, e) in entries.filter(|(_, e)| e.dtype == DType::Q4) {
        let (rows, cols) = q4_shape(name, e)?;
        let end = e
            .offset
            .checked_add(e.nbytes)
            .filter(|&end| end <= buf.len());
        let Some(end) = end else {
            return Err(fmt_err(format!("{name}: bytes past the end of its file")));
        };
        // The length check of the int4 layout (overflow-safe), before touching the bytes.
        Q4Matrix::new(&buf[e.offset..end], rows, cols)
            .map_err(|err| fmt_err(format!("{name}: {err}")))?;
        reencode(&mut buf[e.offset..end], rows, cols);
        n += 1;
    }
    Ok(n)
}

/// A file the manifest names (`what`), refused if it would leave the directory.
fn member(dir: &Path, what: &str, name: &str) -> Result<PathBuf> {
    check_file_name(what, name)?;
    Ok(dir.join(name))
}

/// Writes `dst/experts`: `src`'s records one at a time, each record's int4 parts re-encoded,
/// reporting `(records done, records)` to `progress`.
fn upgrade_experts(
    src: &Path,
    dst: &Path,
    m: &Manifest,
    progress: Progress,
) -> Result<(usize, u64)> {
    let Some(x) = &m.experts else {
        return Ok((0, 0));
    };
    let (from, to) = (
        member(src, "experts file", &x.file)?,
        member(dst, "experts file", &x.file)?,
    );
    let mut input = File::open(&from).map_err(io_err(&from))?;
    let len = input.metadata().map_err(io_err(&from))?.len();
    if x.record_size == 0 || len % x.record_size as u64 != 0 {
        return Err(fmt_err(format!(
            "{}: {len} bytes is not a whole number of {}-byte records",
            from.display(),
            x.record_size
        )));
    }
    let mut out = BufWriter::new(File::create(&to).map_err(io_err(&to))?);
    let mut record = vec![0u8; x.record_size];
    let (mut matrices, records) = (0, len / x.record_size as u64);
    for done in 0..records as usize {
        input.read_exact(&mut record).map_err(io_err(&from))?;
        matrices += reencode_all(&mut record, x.parts.iter())?;
        out.write_all(&record).map_err(io_err(&to))?;
        progress(done + 1, records as usize, "experts");
    }
    let f = out.into_inner().map_err(|e| io_err(&to)(e.into_error()))?;
    f.sync_all().map_err(io_err(&to))?;
    Ok((matrices, len))
}

/// Upgrades the v2 model directory `src` into the new directory `dst` (which must not exist),
/// reporting the expert records done to `progress`.
pub fn upgrade(src: &Path, dst: &Path, progress: Progress) -> Result<UpgradeSummary> {
    let mut m = read_v2_manifest(src)?;
    if dst.exists() {
        return Err(Error::Input(format!(
            "{}: already exists; name a new directory",
            dst.display()
        )));
    }
    let name = dst
        .file_name()
        .ok_or_else(|| Error::Input(format!("{}: not a directory name", dst.display())))?;
    let tmp = dst.with_file_name(format!(".{}.upgrading", name.to_string_lossy()));
    if tmp.exists() {
        fs::remove_dir_all(&tmp).map_err(io_err(&tmp))?;
    }
    fs::create_dir_all(&tmp).map_err(io_err(&tmp))?;
    let done = (|| {
        // Resident weights: small enough to re-encode in memory.
        let (from, to) = (
            member(src, "resident file", &m.resident.file)?,
            member(&tmp, "resident file", &m.resident.file)?,
        );
        let mut resident = fs::read(&from).map_err(io_err(&from))?;
        let mut matrices = reencode_all(&mut resident, m.resident.tensors.iter())?;
        fs::write(&to, &resident).map_err(io_err(&to))?;
        let (xm, xbytes) = upgrade_experts(src, &tmp, &m, progress)?;
        matrices += xm;
        // Everything else (tokenizer, configs, card, routing heat) as it is.
        let weights = [Some(&m.resident.file), m.experts.as_ref().map(|x| &x.file)];
        for entry in fs::read_dir(src).map_err(io_err(src))? {
            let entry = entry.map_err(io_err(src))?;
            let fname = entry.file_name();
            let is_weights = weights.iter().flatten().any(|w| fname == w.as_str());
            let ty = entry.file_type().map_err(io_err(entry.path()))?;
            if ty.is_file() && !is_weights && fname != MANIFEST {
                let to = tmp.join(&fname);
                fs::copy(entry.path(), &to).map_err(io_err(&to))?;
            }
        }
        m.version = FORMAT_VERSION;
        let to = tmp.join(MANIFEST);
        let text = serde_json::to_string_pretty(&m).expect("manifest serializes");
        fs::write(&to, text + "\n").map_err(io_err(&to))?;
        Ok(UpgradeSummary {
            matrices,
            bytes: resident.len() as u64 + xbytes,
        })
    })();
    match done {
        Ok(s) => {
            fs::rename(&tmp, dst).map_err(io_err(dst))?;
            Ok(s)
        }
        Err(e) => {
            let _ = fs::remove_dir_all(&tmp);
            Err(e)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::convert::convert;
    use crate::format::Quant;
    use crate::model::Model;
    use crate::quant::v3_nibbles_to_v2;

    use crate::testutil::{fixture, scratch_dir};

    /// `dir` (a v3 model) rewritten as v2 would have stored it, into `out`.
    fn downgrade(dir: &Path, out: &Path) {
        fs::create_dir_all(out).unwrap();
        let mut m: Manifest =
            serde_json::from_str(&fs::read_to_string(dir.join(MANIFEST)).unwrap()).unwrap();
        let back = |buf: &mut [u8], entries: &mut dyn Iterator<Item = &TensorEntry>| {
            for e in entries.filter(|e| e.dtype == DType::Q4) {
                let (rows, cols) = (e.shape[0], e.shape[1]);
                let (row, groups) = (q4_row_bytes(cols), cols.div_ceil(GROUP));
                let mut scratch = vec![0u8; groups * 16];
                for r in 0..rows {
                    let at = e.offset + r * row + groups * 2;
                    let nib = &mut buf[at..at + groups * 16];
                    v3_nibbles_to_v2(groups, nib, &mut scratch);
                    nib.copy_from_slice(&scratch);
                }
            }
        };
        let mut res = fs::read(dir.join(&m.resident.file)).unwrap();
        back(&mut res, &mut m.resident.tensors.values());
        fs::write(out.join(&m.resident.file), res).unwrap();
        if let Some(x) = &m.experts {
            let mut all = fs::read(dir.join(&x.file)).unwrap();
            for rec in all.chunks_mut(x.record_size) {
                back(rec, &mut x.parts.values());
            }
            fs::write(out.join(&x.file), all).unwrap();
        }
        for f in fs::read_dir(dir).unwrap() {
            let f = f.unwrap();
            let n = f.file_name();
            if !out.join(&n).exists() && n != MANIFEST {
                fs::copy(f.path(), out.join(&n)).unwrap();
            }
        }
        m.version = 2;
        fs::write(out.join(MANIFEST), serde_json::to_string(&m).unwrap()).unwrap();
    }

    #[test]
    fn v2_directories_upgrade_to_the_bytes_a_fresh_conversion_writes() {
        let root = scratch_dir("upgrade", "roundtrip");
        for arch in ["olmoe", "qwen3_moe", "glm4_moe"] {
            let v3 = root.join(format!("{arch}-v3"));
            convert(&fixture(arch), &v3, Quant::Int4, &mut |_, _, _| {}).unwrap();
            let v2 = root.join(format!("{arch}-v2"));
            downgrade(&v3, &v2);
            // The v2 bytes really differ (the fixtures have rows of several groups).
            assert_ne!(
                fs::read(v2.join("resident.bin")).unwrap(),
                fs::read(v3.join("resident.bin")).unwrap()
            );
            let err = Model::load(&v2, Some(1))
                .err()
                .expect("v2 is refused")
                .to_string();
            assert!(err.contains("colibri upgrade"), "{err}");
            let up = root.join(format!("{arch}-up"));
            let s = upgrade(&v2, &up, &mut |_, _, _| {}).unwrap();
            assert!(s.matrices > 0);
            for f in ["resident.bin", "experts.bin", "tokenizer.json"] {
                assert_eq!(
                    fs::read(up.join(f)).unwrap(),
                    fs::read(v3.join(f)).unwrap(),
                    "{arch}: {f}"
                );
            }
            let (a, b) = (
                Model::load(&up, Some(1)).unwrap(),
                Model::load(&v3, Some(1)).unwrap(),
            );
            let ids = [1u32, 5, 9, 2];
            let la = a.forward(&ids, &mut a.new_cache(), true).unwrap();
            let lb = b.forward(&ids, &mut b.new_cache(), true).unwrap();
            assert_eq!(la, lb, "{arch}");
            // Upgrading again, or into an existing directory, is refused with a reason.
            let again = upgrade(&up, &root.join("x"), &mut |_, _, _| {})
                .unwrap_err()
                .to_string();
            assert!(again.contains("already format v3"), "{again}");
            let exists = upgrade(&v2, &up, &mut |_, _, _| {})
                .unwrap_err()
                .to_string();
            assert!(exists.contains("already exists"), "{exists}");
            assert!(!root.join(format!(".{arch}-up.upgrading")).exists());
        }
        fs::remove_dir_all(&root).unwrap();
    }

    /// A manifest labelled v2 that holds a table-grid tensor is no directory v2 wrote: refused
    /// by name before anything is written.
    #[test]
    fn a_v2_label_on_table_grid_tensors_is_refused() {
        let root = scratch_dir("upgrade", "q4t");
        let dir = root.join("table");
        let prec = crate::convert::Precisions {
            grid: crate::quant::Grid::Table,
            ..Default::default()
        };
        crate::convert::convert_with(
            &fixture("olmoe"),
            &dir,
            Quant::Int4,
            &prec,
            &mut |_, _, _| {},
        )
        .unwrap();
        let path = dir.join(MANIFEST);
        let mut m: Manifest = serde_json::from_str(&fs::read_to_string(&path).unwrap()).unwrap();
        m.version = 2;
        fs::write(&path, serde_json::to_string(&m).unwrap()).unwrap();
        let up = root.join("up");
        let err = upgrade(&dir, &up, &mut |_, _, _| {})
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("is q4t, which no format v2 directory holds"),
            "{err}"
        );
        assert!(!up.exists());
    }

    #[test]
    fn a_truncated_experts_file_is_refused_and_leaves_nothing() {
        let root = scratch_dir("upgrade", "truncated");
        let v3 = root.join("v3");
        convert(&fixture("olmoe"), &v3, Quant::Int4, &mut |_, _, _| {}).unwrap();
        let v2 = root.join("v2");
        downgrade(&v3, &v2);
        let x = fs::read(v2.join("experts.bin")).unwrap();
        fs::write(v2.join("experts.bin"), &x[..x.len() - 100]).unwrap();
        let up = root.join("up");
        let err = upgrade(&v2, &up, &mut |_, _, _| {})
            .unwrap_err()
            .to_string();
        assert!(err.contains("whole number"), "{err}");
        assert!(!up.exists() && !root.join(".up.upgrading").exists());
        fs::remove_dir_all(&root).unwrap();
    }
}
