//! The advisory lock that keeps a second process off a slot file, and the holder's pid
//! (from /proc/locks) for the error that turns the second one away.

use std::fs::{self, File, OpenOptions, TryLockError};
use std::io;
use std::os::unix::fs::MetadataExt;
use std::path::Path;

use crate::error::{io_err, Error, Result};

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
pub(super) fn lock(file: &File, path: &Path) -> Result<()> {
    match file.try_lock() {
        Ok(()) => Ok(()),
        Err(TryLockError::WouldBlock) => Err(in_use(file, path)),
        Err(TryLockError::Error(e)) if e.kind() == io::ErrorKind::Unsupported => Ok(()),
        Err(TryLockError::Error(e)) => Err(io_err(path)(e)),
    }
}

/// Opens (creating if missing) and locks the file at `path`, making sure the locked inode is
/// still the one at `path` (a compaction elsewhere may have renamed a new file over it).
pub(super) fn open_locked(path: &Path) -> Result<File> {
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

#[cfg(test)]
mod tests {
    use super::*;

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
