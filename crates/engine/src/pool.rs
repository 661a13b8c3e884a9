//! The compute thread pool of a model: `threads - 1` workers plus the calling thread.
//!
//! A decode step runs ~100 small parallel regions (one per group of products), each a few tens of
//! microseconds long. Waking sleeping threads for each (as a general-purpose pool does after a
//! short idle) costs about as much as the work, so workers spin on an epoch counter for a short
//! while after each region and only then park. The caller takes tasks too, so two threads on two
//! cores need no hand-off at all.
//!
//! Not for nested use: a task must not call [`Pool::run`] on the same pool (it would deadlock on
//! the run lock). Concurrent callers from different threads are serialised region by region.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// How long an idle worker spins before parking: covers the gap between two regions of one
/// forward pass and between two decoded tokens (Python-side work included).
const SPIN: Duration = Duration::from_millis(2);

type TaskFn = dyn Fn(usize) + Sync;

/// One parallel region: `total` tasks claimed by index.
struct Job {
    /// The caller's closure with its lifetime erased; dereferenced only for a claimed index
    /// `< total`, which keeps `done < total` and so keeps the caller (and the closure) waiting.
    f: *const TaskFn,
    total: usize,
    next: AtomicUsize,
    done: AtomicUsize,
    panicked: AtomicBool,
}

// SAFETY: `f` points to a `Sync` closure and is only called while the `run` that owns it is
// blocked waiting for `done == total` (see `Job::f`); the counters are atomics.
unsafe impl Send for Job {}
// SAFETY: as above.
unsafe impl Sync for Job {}

impl Job {
    fn work(&self) {
        loop {
            let i = self.next.fetch_add(1, Ordering::Relaxed);
            if i >= self.total {
                return;
            }
            // SAFETY: index `i < total` is claimed and not yet counted in `done`, so the caller
            // of `run` is still waiting and the closure behind `f` is alive.
            let f = unsafe { &*self.f };
            if catch_unwind(AssertUnwindSafe(|| f(i))).is_err() {
                self.panicked.store(true, Ordering::Relaxed);
            }
            self.done.fetch_add(1, Ordering::Release);
        }
    }
}

struct State {
    job: Option<Arc<Job>>,
    sleepers: usize,
    shutdown: bool,
}

struct Shared {
    epoch: AtomicU64,
    state: Mutex<State>,
    wake: Condvar,
}

pub struct Pool {
    shared: Arc<Shared>,
    workers: Vec<JoinHandle<()>>,
    run_lock: Mutex<()>,
}

impl Pool {
    /// A pool computing on `threads` threads in all (the caller of `run` counts as one).
    pub fn new(threads: usize) -> std::io::Result<Pool> {
        let shared = Arc::new(Shared {
            epoch: AtomicU64::new(0),
            state: Mutex::new(State {
                job: None,
                sleepers: 0,
                shutdown: false,
            }),
            wake: Condvar::new(),
        });
        let mut workers = Vec::new();
        for i in 1..threads.max(1) {
            let s = shared.clone();
            workers.push(
                std::thread::Builder::new()
                    .name(format!("colibri-worker-{i}"))
                    .spawn(move || worker(&s))?,
            );
        }
        Ok(Pool {
            shared,
            workers,
            run_lock: Mutex::new(()),
        })
    }

    pub fn threads(&self) -> usize {
        self.workers.len() + 1
    }

    /// `[f(0), f(1), ..]` for `i < tasks`, computed over the pool (as [`Pool::run`]).
    pub fn map<T: Send, F: Fn(usize) -> T + Sync>(&self, tasks: usize, f: F) -> Vec<T> {
        let outs: Vec<Mutex<Option<T>>> = (0..tasks).map(|_| Mutex::new(None)).collect();
        self.run(tasks, |i| {
            let v = f(i);
            *outs[i].lock().unwrap_or_else(|e| e.into_inner()) = Some(v);
        });
        outs.into_iter()
            .map(|m| {
                m.into_inner()
                    .unwrap_or_else(|e| e.into_inner())
                    .expect("run calls every task once")
            })
            .collect()
    }

    /// Calls `f(i)` for every `i < tasks`, spread over the pool; returns when all are done.
    /// A panic in a task is re-raised here.
    pub fn run<F: Fn(usize) + Sync>(&self, tasks: usize, f: F) {
        if tasks == 0 {
            return;
        }
        if self.workers.is_empty() || tasks == 1 {
            (0..tasks).for_each(f);
            return;
        }
        let _serial = self.run_lock.lock().unwrap_or_else(|e| e.into_inner());
        let f: &(dyn Fn(usize) + Sync + '_) = &f;
        // SAFETY: only the lifetime is erased; `run` does not return before every claimed task
        // has finished (`done == total`), and unclaimed tasks are never started after that.
        let f: *const TaskFn =
            unsafe { std::mem::transmute::<&(dyn Fn(usize) + Sync + '_), &'static TaskFn>(f) };
        let job = Arc::new(Job {
            f,
            total: tasks,
            next: AtomicUsize::new(0),
            done: AtomicUsize::new(0),
            panicked: AtomicBool::new(false),
        });
        {
            let mut st = self.shared.state.lock().unwrap_or_else(|e| e.into_inner());
            st.job = Some(job.clone());
            self.shared.epoch.fetch_add(1, Ordering::Release);
            if st.sleepers > 0 {
                self.shared.wake.notify_all();
            }
        }
        job.work();
        while job.done.load(Ordering::Acquire) < tasks {
            std::hint::spin_loop();
        }
        self.shared
            .state
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .job = None;
        if job.panicked.load(Ordering::Relaxed) {
            panic!("a colibri worker task panicked");
        }
    }
}

fn worker(s: &Shared) {
    let mut seen = 0u64;
    loop {
        let mut since = Instant::now();
        let mut spins = 0u32;
        loop {
            let e = s.epoch.load(Ordering::Acquire);
            if e != seen {
                seen = e;
                break;
            }
            spins = spins.wrapping_add(1);
            if !spins.is_multiple_of(256) || since.elapsed() < SPIN {
                std::hint::spin_loop();
                continue;
            }
            let mut st = s.state.lock().unwrap_or_else(|e| e.into_inner());
            while s.epoch.load(Ordering::Acquire) == seen && !st.shutdown {
                st.sleepers += 1;
                st = s.wake.wait(st).unwrap_or_else(|e| e.into_inner());
                st.sleepers -= 1;
            }
            if st.shutdown {
                return;
            }
            since = Instant::now();
        }
        let job = s
            .state
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .job
            .clone();
        if let Some(job) = job {
            job.work();
        }
    }
}

impl Drop for Pool {
    fn drop(&mut self) {
        {
            let mut st = self.shared.state.lock().unwrap_or_else(|e| e.into_inner());
            st.shutdown = true;
            // Spinning workers see the epoch move; parked ones get the notification.
            self.shared.epoch.fetch_add(1, Ordering::Release);
            self.shared.wake.notify_all();
        }
        for w in self.workers.drain(..) {
            let _ = w.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_task_runs_exactly_once() {
        let pool = Pool::new(3).unwrap();
        for tasks in [0, 1, 2, 7, 100] {
            let hits: Vec<AtomicUsize> = (0..tasks).map(|_| AtomicUsize::new(0)).collect();
            pool.run(tasks, |i| {
                hits[i].fetch_add(1, Ordering::Relaxed);
            });
            assert!(hits.iter().all(|h| h.load(Ordering::Relaxed) == 1));
        }
    }

    #[test]
    fn map_keeps_the_order_of_the_tasks() {
        for threads in [1, 2, 3] {
            let pool = Pool::new(threads).unwrap();
            for tasks in [0, 1, 5, 64] {
                let v: Vec<String> = pool.map(tasks, |i| format!("t{i}"));
                let want: Vec<String> = (0..tasks).map(|i| format!("t{i}")).collect();
                assert_eq!(v, want);
            }
        }
    }

    #[test]
    fn regions_after_parking_still_complete() {
        let pool = Pool::new(2).unwrap();
        let n = AtomicUsize::new(0);
        pool.run(4, |_| {
            n.fetch_add(1, Ordering::Relaxed);
        });
        std::thread::sleep(SPIN * 3);
        pool.run(4, |_| {
            n.fetch_add(1, Ordering::Relaxed);
        });
        assert_eq!(n.load(Ordering::Relaxed), 8);
    }

    #[test]
    fn concurrent_callers_are_serialised() {
        let pool = Arc::new(Pool::new(2).unwrap());
        let total = Arc::new(AtomicUsize::new(0));
        let handles: Vec<_> = (0..4)
            .map(|_| {
                let (p, t) = (pool.clone(), total.clone());
                std::thread::spawn(move || {
                    for _ in 0..50 {
                        p.run(8, |_| {
                            t.fetch_add(1, Ordering::Relaxed);
                        });
                    }
                })
            })
            .collect();
        handles.into_iter().for_each(|h| h.join().unwrap());
        assert_eq!(total.load(Ordering::Relaxed), 4 * 50 * 8);
    }

    #[test]
    fn a_panicking_task_is_reported_to_the_caller() {
        let pool = Pool::new(2).unwrap();
        let r = catch_unwind(AssertUnwindSafe(|| pool.run(8, |i| assert!(i != 5))));
        assert!(r.is_err());
        pool.run(3, |_| {});
    }
}
