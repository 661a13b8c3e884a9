//! Which cache level the int4 kernels' software prefetch fills.
//!
//! The kernels prefetch each thread's weight stream 8 KiB ahead. Into L2 (`prefetcht1`) is the
//! default on every CPU measured: on Intel (Sapphire-Rapids-class) machines it decodes 20-30%
//! faster than into L1 (OLMoE-1B-7B-shaped int4, 2 threads, paired runs: 27.9-29.9 -> 33.5-37.6
//! tok/s), as L2 prefetches are not limited by the core's few L1 fill buffers; on AMD Zen 4,
//! with the format-v3 kernels, L1 decodes at 0.79-0.86 of L2 with a sequence per level (AVX2
//! kernel: 0.88) and at 0.95-0.97 token by token, and prefills at 0.94
//! (`examples/prefetch_bench.rs`, levels alternating in one process). No software prefetch
//! (`off`) loses 10-25% elsewhere: prefill on Zen 4, decode on Intel; but the AVX-512 decode loop
//! (one token) on Zen 4 streams faster without it: 1.04-1.09x decode on the DeepSeek-V3,
//! Qwen3-Next and OLMoE shapes, token by token and in turns of 32 (2026-12-06; with the format-v3
//! kernels the OLMoE shape had measured 0.96-1.03, a tie). So a one-token product on an AMD CPU
//! prefetches nothing by default ([`decode_prefetch_level`]), every other product into L2.
//! `COLI_KERNEL_PREFETCH=l1|l2|off` forces one level for every product of the process.

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

/// Resolves a `COLI_KERNEL_PREFETCH` setting: the level it forces, or none (unset or empty:
/// the defaults; an unknown value: the defaults and a warning, the second value).
pub fn resolve_prefetch(setting: Option<&str>) -> (Option<PrefetchLevel>, Option<String>) {
    match setting {
        None => (None, None),
        Some(s) if s.trim().is_empty() => (None, None),
        Some(s) => match PrefetchLevel::parse(s) {
            Some(level) => (Some(level), None),
            None => (
                None,
                Some(format!(
                    "colibri: COLI_KERNEL_PREFETCH={}: unknown level (expected l1|l2|off), \
                     using the defaults",
                    s.trim(),
                )),
            ),
        },
    }
}

/// The level of a one-token product when none is forced: `off` on an AMD CPU, else
/// [`PrefetchLevel::DEFAULT`] (see the module documentation).
pub fn decode_default(amd: bool) -> PrefetchLevel {
    if amd {
        PrefetchLevel::Off
    } else {
        PrefetchLevel::DEFAULT
    }
}

/// Whether this CPU's vendor is AMD.
fn is_amd() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        // CPUID leaf 0 (the vendor string) exists on every x86_64 CPU.
        let r = std::arch::x86_64::__cpuid(0);
        let vendor: Vec<u8> = [r.ebx, r.edx, r.ecx]
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect();
        vendor == b"AuthenticAMD"
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// The process's setting: 0 until first read, [`DEFAULTS`] when no level is forced, else 1 +
/// the forced level's index in `PrefetchLevel::ALL`.
static LEVEL: AtomicU8 = AtomicU8::new(0);
const DEFAULTS: u8 = PrefetchLevel::ALL.len() as u8 + 1;

/// The forced level, if any: decided on first use from `COLI_KERNEL_PREFETCH`, unless
/// [`set_prefetch_level`] chose one. One relaxed load per product.
fn forced() -> Option<PrefetchLevel> {
    match LEVEL.load(Ordering::Relaxed) {
        0 => {
            let (level, warning) = resolve_prefetch(crate::settings::kernel_prefetch());
            let c = level.map_or(DEFAULTS, code);
            // Only the first thread to decide prints the warning and sets the level.
            if LEVEL
                .compare_exchange(0, c, Ordering::Relaxed, Ordering::Relaxed)
                .is_ok()
            {
                if let Some(w) = warning {
                    eprintln!("{w}");
                }
            }
            forced()
        }
        DEFAULTS => None,
        c => Some(PrefetchLevel::ALL[usize::from(c - 1)]),
    }
}

/// The level a product of several tokens (a prefill's tiles) prefetches into.
pub fn prefetch_level() -> PrefetchLevel {
    forced().unwrap_or(PrefetchLevel::DEFAULT)
}

/// The level the AVX-512 one-token (decode) loops prefetch into.
pub fn decode_prefetch_level() -> PrefetchLevel {
    static AMD: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    forced().unwrap_or_else(|| decode_default(*AMD.get_or_init(is_amd)))
}

/// Forces the level of every product for the rest of the process (benchmarks alternate levels
/// in one process, so that the machine's drift hits each alike). Products already running
/// finish with the old one.
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
        assert_eq!(resolve_prefetch(None), (None, None));
        assert_eq!(resolve_prefetch(Some("")), (None, None));
        assert_eq!(
            resolve_prefetch(Some(" L1 ")),
            (Some(PrefetchLevel::L1), None)
        );
        assert_eq!(
            resolve_prefetch(Some("l2")),
            (Some(PrefetchLevel::L2), None)
        );
        assert_eq!(
            resolve_prefetch(Some("Off")),
            (Some(PrefetchLevel::Off), None)
        );
        let (level, warning) = resolve_prefetch(Some("l3"));
        assert_eq!(level, None);
        assert!(warning.unwrap().contains("expected l1|l2|off"));
        assert_eq!(decode_default(true), PrefetchLevel::Off);
        assert_eq!(decode_default(false), PrefetchLevel::L2);
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
