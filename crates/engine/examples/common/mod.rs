//! Helpers shared by the measuring examples (a directory without `main.rs`, so Cargo does not
//! build it as an example of its own).

/// The middle value of `v` (the upper middle for an even count).
#[allow(dead_code)] // not every example that shares this module takes medians
pub fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

#[repr(C)]
struct Timespec {
    sec: i64,
    nsec: i64,
}

extern "C" {
    fn clock_gettime(clock: i32, ts: *mut Timespec) -> i32;
}

/// CPU time of this thread in seconds (robust against other processes time-slicing the core).
#[allow(dead_code)] // not every example that shares this module reads clocks
pub fn thread_cpu_time() -> f64 {
    cpu_time(3) // CLOCK_THREAD_CPUTIME_ID
}

/// CPU time of every thread of this process in seconds.
#[allow(dead_code)]
pub fn process_cpu_time() -> f64 {
    cpu_time(2) // CLOCK_PROCESS_CPUTIME_ID
}

fn cpu_time(clock: i32) -> f64 {
    let mut ts = Timespec { sec: 0, nsec: 0 };
    // SAFETY: clock_gettime writes one timespec (two longs on x86_64 Linux) into `ts`.
    let rc = unsafe { clock_gettime(clock, &mut ts) };
    assert_eq!(rc, 0);
    ts.sec as f64 + ts.nsec as f64 * 1e-9
}
