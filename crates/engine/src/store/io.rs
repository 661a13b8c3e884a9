//! Reading expert records into cache slots: a plain `pread` thread pool, or io_uring (Linux)
//! with one submission thread. Both take [`ReadReq`]s without blocking the caller and report
//! each finished read through [`Complete`]. A record is one contiguous, 4096-aligned run of the
//! experts file, so each request is one read (`O_DIRECT`-compatible when the file is opened so).

use std::collections::VecDeque;
use std::fs::File;
use std::io;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use serde::{Deserialize, Serialize};

/// How expert records are read from disk.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum IoBackend {
    /// io_uring where the kernel allows it, else the pread pool.
    #[default]
    Auto,
    /// io_uring only (falls back to pread, and says so in `StoreStats::io`, where it is refused).
    Uring,
    /// A pool of threads each doing blocking `pread`s.
    Pread,
}

impl IoBackend {
    pub fn parse(s: &str) -> Option<IoBackend> {
        match s {
            "auto" => Some(IoBackend::Auto),
            "uring" | "io_uring" => Some(IoBackend::Uring),
            "pread" => Some(IoBackend::Pread),
            _ => None,
        }
    }
}

/// One read: `len` bytes at file `offset` into `dst`, for cache slot `slot`.
pub(crate) struct ReadReq {
    pub slot: u32,
    pub dst: *mut u8,
    pub len: usize,
    pub offset: u64,
}

// SAFETY: `dst` points into the store's arena, which outlives every reader thread (they hold an
// `Arc` of it), and the slot it designates is written by this request alone: the store hands a
// slot to a read only while the slot is `Loading`, when nothing else reads or writes it.
unsafe impl Send for ReadReq {}

/// Where finished reads are reported (the store's shared state).
pub(crate) trait Complete: Send + Sync + 'static {
    fn complete(&self, slot: u32, len: usize, r: io::Result<()>);
}

/// Opens the experts file, with `O_DIRECT` if asked and the file system allows it. Returns the
/// file and whether `O_DIRECT` is in effect.
pub(crate) fn open(path: &Path, direct: bool) -> io::Result<(File, bool)> {
    #[cfg(target_os = "linux")]
    if direct {
        use std::os::unix::fs::OpenOptionsExt;
        match std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_DIRECT)
            .open(path)
        {
            Ok(f) => return Ok((f, true)),
            // tmpfs and some others refuse O_DIRECT: read through the page cache instead.
            Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {}
            Err(e) => return Err(e),
        }
    }
    let _ = direct;
    Ok((File::open(path)?, false))
}

/// Reads exactly `buf.len()` bytes at `offset` (retrying short reads).
pub(crate) fn read_exact_at(f: &File, mut buf: &mut [u8], mut offset: u64) -> io::Result<()> {
    while !buf.is_empty() {
        #[cfg(unix)]
        let n = std::os::unix::fs::FileExt::read_at(f, buf, offset);
        #[cfg(windows)]
        let n = std::os::windows::fs::FileExt::seek_read(f, buf, offset);
        match n {
            Ok(0) => {
                return Err(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    "experts file ends inside a record",
                ))
            }
            Ok(n) => {
                buf = &mut buf[n..];
                offset += n as u64;
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

fn do_read(f: &File, r: &ReadReq) -> io::Result<()> {
    // SAFETY: see `ReadReq`: `dst..dst+len` is inside the arena and owned by this read.
    let buf = unsafe { std::slice::from_raw_parts_mut(r.dst, r.len) };
    read_exact_at(f, buf, r.offset)
}

struct Queue {
    reqs: Mutex<(VecDeque<ReadReq>, bool)>,
    cv: Condvar,
}

/// The running reader of a store.
pub(crate) struct Reader {
    queue: Arc<Queue>,
    threads: Vec<JoinHandle<()>>,
    #[cfg(target_os = "linux")]
    uring: Option<uring::Handle>,
    /// `"io_uring"` or `"pread"`.
    pub name: &'static str,
}

/// pread threads: enough to keep a few records in flight while others are being copied.
const PREAD_THREADS: usize = 4;

impl Reader {
    /// Starts the reader. `slow`: each pread read first sleeps this long (tests only, a disk of
    /// known speed; zero otherwise).
    pub fn start(
        file: &File,
        backend: IoBackend,
        done: Arc<dyn Complete>,
        slow: Duration,
    ) -> io::Result<(Reader, Option<String>)> {
        let queue = Arc::new(Queue {
            reqs: Mutex::new((VecDeque::new(), false)),
            cv: Condvar::new(),
        });
        let mut note = None;
        #[cfg(target_os = "linux")]
        if backend != IoBackend::Pread {
            match uring::Handle::start(file.try_clone()?, queue.clone(), done.clone()) {
                Ok((h, t)) => {
                    return Ok((
                        Reader {
                            queue,
                            threads: vec![t],
                            uring: Some(h),
                            name: "io_uring",
                        },
                        None,
                    ))
                }
                Err(e) => note = Some(format!("io_uring unavailable ({e}); using pread")),
            }
        }
        #[cfg(not(target_os = "linux"))]
        if backend == IoBackend::Uring {
            note = Some("io_uring is Linux only; using pread".into());
        }
        let mut threads = Vec::new();
        for i in 0..PREAD_THREADS {
            let (f, q, d) = (file.try_clone()?, queue.clone(), done.clone());
            threads.push(
                std::thread::Builder::new()
                    .name(format!("colibri-pread-{i}"))
                    .spawn(move || pread_worker(&f, &q, &*d, slow))?,
            );
        }
        Ok((
            Reader {
                queue,
                threads,
                #[cfg(target_os = "linux")]
                uring: None,
                name: "pread",
            },
            note,
        ))
    }

    /// Queues reads; returns at once.
    pub fn submit(&self, reqs: Vec<ReadReq>) {
        if reqs.is_empty() {
            return;
        }
        self.queue
            .reqs
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .0
            .extend(reqs);
        #[cfg(target_os = "linux")]
        if let Some(u) = &self.uring {
            u.wake();
            return;
        }
        self.queue.cv.notify_all();
    }
}

impl Drop for Reader {
    fn drop(&mut self) {
        self.queue.reqs.lock().unwrap_or_else(|e| e.into_inner()).1 = true;
        self.queue.cv.notify_all();
        #[cfg(target_os = "linux")]
        if let Some(u) = &self.uring {
            u.wake();
        }
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

fn pread_worker(f: &File, q: &Queue, done: &dyn Complete, slow: Duration) {
    loop {
        let req = {
            let mut g = q.reqs.lock().unwrap_or_else(|e| e.into_inner());
            loop {
                if let Some(r) = g.0.pop_front() {
                    break r;
                }
                if g.1 {
                    return;
                }
                g = q.cv.wait(g).unwrap_or_else(|e| e.into_inner());
            }
        };
        if !slow.is_zero() {
            std::thread::sleep(slow);
        }
        let r = do_read(f, &req);
        done.complete(req.slot, req.len, r);
    }
}

#[cfg(target_os = "linux")]
mod uring {
    //! One thread owns the ring: it takes queued requests, submits them all, and reaps
    //! completions. New requests wake it through an eventfd whose read is always in the ring.

    use super::*;
    use io_uring::{opcode, types, IoUring};
    use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

    const ENTRIES: u32 = 64;
    const WAKE: u64 = u64::MAX;

    pub struct Handle {
        efd: Arc<OwnedFd>,
    }

    impl Handle {
        pub fn start(
            file: File,
            queue: Arc<Queue>,
            done: Arc<dyn Complete>,
        ) -> io::Result<(Handle, JoinHandle<()>)> {
            let ring = IoUring::new(ENTRIES)?;
            // SAFETY: plain syscall; the result is checked before use.
            let fd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC) };
            if fd < 0 {
                return Err(io::Error::last_os_error());
            }
            // SAFETY: `fd` is a fresh descriptor that nothing else owns.
            let efd = Arc::new(unsafe { OwnedFd::from_raw_fd(fd) });
            let e2 = efd.clone();
            let t = std::thread::Builder::new()
                .name("colibri-uring".into())
                .spawn(move || run(ring, &file, &e2, &queue, &*done))?;
            Ok((Handle { efd }, t))
        }

        pub fn wake(&self) {
            let one = 1u64.to_ne_bytes();
            // SAFETY: writes 8 bytes from a live buffer to our eventfd. A failure (counter
            // overflow) cannot happen with 1-increments that the ring thread keeps reading.
            unsafe { libc::write(self.efd.as_raw_fd(), one.as_ptr().cast(), 8) };
        }
    }

    fn run(mut ring: IoUring, file: &File, efd: &OwnedFd, q: &Queue, done: &dyn Complete) {
        let fd = types::Fd(file.as_raw_fd());
        let mut wake_buf = [0u8; 8];
        let mut wake_armed = false;
        let mut inflight: Vec<Option<ReadReq>> = Vec::new();
        let mut free_ids: Vec<usize> = Vec::new();
        let mut count = 0usize;
        loop {
            let shutdown = {
                let mut g = q.reqs.lock().unwrap_or_else(|e| e.into_inner());
                while count + 1 < ENTRIES as usize {
                    let Some(r) = g.0.pop_front() else { break };
                    let id = free_ids.pop().unwrap_or_else(|| {
                        inflight.push(None);
                        inflight.len() - 1
                    });
                    let sqe = opcode::Read::new(fd, r.dst, r.len as u32)
                        .offset(r.offset)
                        .build()
                        .user_data(id as u64);
                    inflight[id] = Some(r);
                    count += 1;
                    // SAFETY: the buffer (`ReadReq::dst`, owned by this read until it
                    // completes) and the file (`file`, open for the life of this thread, which
                    // reaps every read before it returns) outlive the operation.
                    unsafe { ring.submission().push(&sqe).expect("ring has room") };
                }
                g.1
            };
            if !wake_armed && !shutdown {
                let sqe = opcode::Read::new(types::Fd(efd.as_raw_fd()), wake_buf.as_mut_ptr(), 8)
                    .build()
                    .user_data(WAKE);
                // SAFETY: `wake_buf` lives on this thread's stack until the function returns,
                // and it does not return while this read is armed (see the exit test below).
                unsafe { ring.submission().push(&sqe).expect("ring has room") };
                wake_armed = true;
            }
            if shutdown && count == 0 && !wake_armed {
                return;
            }
            if let Err(e) = ring.submit_and_wait(1) {
                if e.raw_os_error() != Some(libc::EINTR) && e.raw_os_error() != Some(libc::EBUSY) {
                    // The ring broke: finish the in-flight reads synchronously and fail none.
                    std::thread::sleep(std::time::Duration::from_millis(1));
                }
                continue;
            }
            let cqes: Vec<(u64, i32)> = ring
                .completion()
                .map(|c| (c.user_data(), c.result()))
                .collect();
            for (id, res) in cqes {
                if id == WAKE {
                    wake_armed = false;
                    continue;
                }
                let r = inflight[id as usize].take().expect("known read");
                free_ids.push(id as usize);
                count -= 1;
                let out = if res < 0 {
                    Err(io::Error::from_raw_os_error(-res))
                } else if (res as usize) < r.len {
                    // Short read (rare): finish it with a plain pread.
                    let n = res as usize;
                    let rest = ReadReq {
                        slot: r.slot,
                        // SAFETY: `n < len`, so the pointer stays inside the request's buffer.
                        dst: unsafe { r.dst.add(n) },
                        len: r.len - n,
                        offset: r.offset + n as u64,
                    };
                    do_read(file, &rest)
                } else {
                    Ok(())
                };
                done.complete(r.slot, r.len, out);
            }
        }
    }

    #[allow(dead_code)]
    fn _assert_send(_: AtomicBool, _: Ordering) {}
}
