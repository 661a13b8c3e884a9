//! `alloc::tune_once` keeps freed memory in the heap for the next forward pass. Its own test
//! binary without the test harness, so it runs alone on the main thread (the main arena, which
//! `mallinfo2` describes without other tests' allocations mixed in).

#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn main() {
    if std::env::var("GLIBC_TUNABLES").is_ok_and(|t| t.contains("glibc.malloc.")) {
        println!("malloc_tuning: skipped (GLIBC_TUNABLES sets malloc tunables)");
        return;
    }
    assert_eq!(colibri_engine::alloc::tune_once(), Some(true));
    // SAFETY: mallinfo2 only reads the allocator's statistics.
    let info = || unsafe { libc::mallinfo2() };
    let mapped_before = info().hblkhd;
    // 24 MiB blocks: above glibc's default mmap threshold, under the tuned one.
    let blocks: Vec<Vec<u8>> = (0..4)
        .map(|i| std::hint::black_box(vec![i as u8 + 1; 24 << 20]))
        .collect();
    assert_eq!(info().hblkhd, mapped_before, "a 24 MiB block was mmapped");
    let heap = info().arena;
    assert!(heap >= 96 << 20, "heap {heap} bytes");
    drop(blocks);
    // 96 MiB free at the top of the heap: the default (2x the dynamic threshold) would trim it.
    let kept = info().arena;
    assert!(
        kept + (1 << 20) >= heap,
        "heap trimmed from {heap} to {kept} bytes"
    );
    println!("malloc_tuning: ok (heap {heap} bytes, kept {kept} after freeing)");
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
fn main() {
    assert_eq!(colibri_engine::alloc::tune_once(), None);
}
