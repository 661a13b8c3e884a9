//! Zero-filled buffers of plain values in anonymous memory, with transparent huge pages advised
//! (Linux `madvise`): for data a decode step streams front to back every token, such as the KV
//! history. Through 4 KiB pages, reading a head's f16 history cost a page walk every 4 KiB and
//! stopped the hardware prefetcher at each page end: 9 GB/s on one thread against 12.5-16 GB/s
//! on 2 MiB pages (`examples/attn_bench.rs`, 4096 positions, Intel).
//!
//! The kernel backs only 2 MiB-aligned 2 MiB runs of a mapping with huge pages, so a buffer of
//! 2 MiB or more is placed at a 2 MiB boundary (the mapping is 2 MiB longer than the buffer and
//! the part before the boundary is never touched, so it costs address space, not memory).

use std::marker::PhantomData;
use std::ops::{Deref, DerefMut};

use bytemuck::Pod;

pub struct HugeBuf<T: Pod> {
    /// `None` for an empty buffer (a mapping cannot be empty).
    map: Option<memmap2::MmapMut>,
    /// Where the values start in the mapping (the first 2 MiB boundary for large buffers).
    start: usize,
    len: usize,
    _values: PhantomData<T>,
}

/// The size of a huge page (x86_64 and most aarch64 kernels).
const HUGE_PAGE: usize = 2 << 20;

impl<T: Pod> HugeBuf<T> {
    /// `len` values whose bytes are all zero (0.0 for the float types).
    ///
    /// # Panics
    /// If the memory cannot be mapped (as a `Vec` aborts when it cannot allocate).
    pub fn zeroed(len: usize) -> HugeBuf<T> {
        HugeBuf::zeroed_with(len, true)
    }

    /// As [`HugeBuf::zeroed`], on ordinary pages: for a short-lived buffer, whose first touch
    /// of fresh huge pages can cost more than they save (a scoring's forked KV history: 100 ms
    /// for 36 MB when the kernel had to compact memory for them, 15 ms on 4 KiB pages).
    pub fn zeroed_small_pages(len: usize) -> HugeBuf<T> {
        HugeBuf::zeroed_with(len, false)
    }

    fn zeroed_with(len: usize, huge: bool) -> HugeBuf<T> {
        let bytes = len
            .checked_mul(std::mem::size_of::<T>())
            .expect("buffer size overflows");
        let align = huge && bytes >= HUGE_PAGE;
        let map = (bytes > 0).then(|| {
            let size = if align { bytes + HUGE_PAGE } else { bytes };
            let map = memmap2::MmapMut::map_anon(size)
                .unwrap_or_else(|e| panic!("cannot map {size} bytes of memory: {e}"));
            // Advised before the first touch, so the pages are huge from the start.
            #[cfg(target_os = "linux")]
            if huge {
                let _ = map.advise(memmap2::Advice::HugePage);
            }
            map
        });
        let start = match &map {
            Some(m) if align => (HUGE_PAGE - m.as_ptr() as usize % HUGE_PAGE) % HUGE_PAGE,
            _ => 0,
        };
        HugeBuf {
            map,
            start,
            len,
            _values: PhantomData,
        }
    }

    /// Gives the memory of `range` (values) back to the system, whole pages of it: afterwards
    /// those values read as zero, the others keep theirs (a buffer being emptied piece by piece,
    /// e.g. the old KV history while it is copied into a larger one, so the two never both sit
    /// in RAM whole).
    pub fn release(&mut self, range: std::ops::Range<usize>) {
        let size = std::mem::size_of::<T>();
        assert!(range.start <= range.end && range.end <= self.len);
        let Some(map) = &self.map else { return };
        let page = 4096;
        let from = (self.start + range.start * size).next_multiple_of(page);
        let to = (self.start + range.end * size) / page * page;
        if to <= from {
            return;
        }
        #[cfg(unix)]
        // SAFETY: `&mut self` means no reference into the mapping is alive during the call;
        // MADV_DONTNEED on private anonymous memory makes the pages read as zero afterwards, and
        // all-zero bytes are a valid `T` (`Pod`). Both ends are inside the mapping.
        let _ = unsafe {
            map.unchecked_advise_range(memmap2::UncheckedAdvice::DontNeed, from, to - from)
        };
    }

    fn byte_range(&self) -> std::ops::Range<usize> {
        self.start..self.start + self.len * std::mem::size_of::<T>()
    }
}

impl<T: Pod> Deref for HugeBuf<T> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        match &self.map {
            // A mapping is page-aligned, `start` a multiple of the page size, and the mapping
            // holds `len * size_of::<T>()` bytes from there.
            Some(m) => bytemuck::cast_slice(&m[self.byte_range()]),
            None => &[],
        }
    }
}

impl<T: Pod> DerefMut for HugeBuf<T> {
    fn deref_mut(&mut self) -> &mut [T] {
        let r = self.byte_range();
        match &mut self.map {
            Some(m) => bytemuck::cast_slice_mut(&mut m[r]),
            None => &mut [],
        }
    }
}

impl<T: Pod> Clone for HugeBuf<T> {
    fn clone(&self) -> Self {
        let mut c = HugeBuf::zeroed(self.len);
        c.copy_from_slice(self);
        c
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn zeroed_writable_and_cloned() {
        let mut b: HugeBuf<f32> = HugeBuf::zeroed(3 << 20);
        assert_eq!(b.len(), 3 << 20);
        assert!(b.iter().all(|&v| v == 0.0));
        b[12345] = 2.5;
        let c = b.clone();
        assert_eq!(c[12345], 2.5);
        assert_eq!(c.len(), b.len());
        assert_eq!(
            b.as_ptr() as usize % HUGE_PAGE,
            0,
            "a buffer of 2 MiB or more starts on a huge page boundary"
        );
        // Released pages read as zero; values in partly released pages stay.
        b[0] = 1.0;
        b[1 << 20] = 3.0;
        b[(2 << 20) - 1] = 4.0;
        b.release(1..(2 << 20) - 1);
        assert_eq!((b[0], b[1 << 20], b[(2 << 20) - 1]), (1.0, 0.0, 4.0));
        assert_eq!(b[12345], 0.0, "inside a released page");
        let small: HugeBuf<u8> = HugeBuf::zeroed(5000);
        assert_eq!(small.len(), 5000);
        let e: HugeBuf<u16> = HugeBuf::zeroed(0);
        assert!(e.is_empty());
        assert!(e.clone().is_empty());
    }
}
