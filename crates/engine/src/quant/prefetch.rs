//! Which cache level the int4 kernels' software prefetch fills.
//!
//! The kernels prefetch each thread's weight stream 8 KiB ahead. Into L2 (`prefetcht1`) is the
//! default on every CPU measured: on Intel (Sapphire-Rapids-class) machines it decodes 20-30%
//! faster than into L1 (OLMoE-1B-7B-shaped int4, 2 threads, paired runs: 27.9-29.9 -> 33.5-37.6
//! tok/s), as L2 prefetches are not limited by the core's few L1 fill buffers; on AMD Zen 4,
//! with the format-v3 kernels, L1 decodes at 0.79-0.86 of L2 with a sequence per level (AVX2
//! kernel: 0.88) and at 0.95-0.97 token by token, and prefills at 0.94
//! (`examples/prefetch_bench.rs`, levels alternating in one process). No software prefetch
//! (`off`) decodes like L2 on Zen 4 (0.96-1.03) but loses 10-25% elsewhere: prefill on Zen 4,
//! decode on Intel. `COLI_KERNEL_PREFETCH=l1|l2|off` forces one level for the process.

use std::sync::atomic::{AtomicU8, Ordering};

/// The cache level a software prefetch fills, or none at all (the hardware prefetchers alone).
/// `ALL` lists the variants in declaration order, so `level as usize` is the index into it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum PrefetchLevel {
    L1,
    L2,
    Off,
}

impl PrefetchLevel {
    pub const ALL: [PrefetchLevel; 3] = [PrefetchLevel::L1, PrefetchLevel::L2, PrefetchLevel::Off];

    pub fn name(self) -> &'static str {
        match self {
            PrefetchLevel::L1 => "l1",
            PrefetchLevel::L2 => "l2",
            PrefetchLevel::Off => "off",
        }
    }

    /// The level a `COLI_KERNEL_PREFETCH` value names (case and surrounding space ignored).
    pub fn parse(s: &str) -> Option<PrefetchLevel> {
        let s = s.trim().to_ascii_lowercase();
        PrefetchLevel::ALL.into_iter().find(|l| l.name() == s)
    }

    /// The measured-best level (see the module documentation).
    pub const DEFAULT: PrefetchLevel = PrefetchLevel::L2;
}

/// Resolves a `COLI_KERNEL_PREFETCH` setting; unset or empty gives the default, an unknown
/// value the default and a warning (the second value).
pub fn resolve_prefetch(setting: Option<&str>) -> (PrefetchLevel, Option<String>) {
    let default = PrefetchLevel::DEFAULT;
    match setting {
        None => (default, None),
        Some(s) if s.trim().is_empty() => (default, None),
        Some(s) => match PrefetchLevel::parse(s) {
            Some(level) => (level, None),
            None => (
                default,
                Some(format!(
                    "colibri: COLI_KERNEL_PREFETCH={}: unknown level (expected l1|l2|off), \
                     using {}",
                    s.trim(),
                    default.name()
                )),
            ),
        },
    }
}

/// The process's level: 0 until first read, else 1 + its index in `PrefetchLevel::ALL`.
static LEVEL: AtomicU8 = AtomicU8::new(0);

/// The level the kernels prefetch into: decided on first use from `COLI_KERNEL_PREFETCH`, unless
/// [`set_prefetch_level`] chose one. One relaxed load per product.
pub fn prefetch_level() -> PrefetchLevel {
    match LEVEL.load(Ordering::Relaxed) {
        0 => {
            let (level, warning) = resolve_prefetch(crate::settings::kernel_prefetch());
            // Only the first thread to decide prints the warning and sets the level.
            if LEVEL
                .compare_exchange(0, code(level), Ordering::Relaxed, Ordering::Relaxed)
                .is_ok()
            {
                if let Some(w) = warning {
                    eprintln!("{w}");
                }
            }
            prefetch_level()
        }
        c => PrefetchLevel::ALL[usize::from(c - 1)],
    }
}

/// Sets the level for the rest of the process (benchmarks alternate levels in one process, so
/// that the machine's drift hits each alike). Products already running finish with the old one.
pub fn set_prefetch_level(level: PrefetchLevel) {
    LEVEL.store(code(level), Ordering::Relaxed);
}

fn code(level: PrefetchLevel) -> u8 {
    level as u8 + 1
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_and_overrides() {
        assert_eq!(resolve_prefetch(None), (PrefetchLevel::L2, None));
        assert_eq!(resolve_prefetch(Some("")), (PrefetchLevel::L2, None));
        assert_eq!(resolve_prefetch(Some(" L1 ")), (PrefetchLevel::L1, None));
        assert_eq!(resolve_prefetch(Some("l2")), (PrefetchLevel::L2, None));
        assert_eq!(resolve_prefetch(Some("Off")), (PrefetchLevel::Off, None));
        let (level, warning) = resolve_prefetch(Some("l3"));
        assert_eq!(level, PrefetchLevel::DEFAULT);
        assert!(warning.unwrap().contains("expected l1|l2|off"));
    }

    #[test]
    fn names_parse_back() {
        for l in PrefetchLevel::ALL {
            assert_eq!(PrefetchLevel::parse(l.name()), Some(l));
            assert_eq!(PrefetchLevel::ALL[usize::from(code(l) - 1)], l);
        }
        assert_eq!(PrefetchLevel::parse("none"), None);
    }
}
