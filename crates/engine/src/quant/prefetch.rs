//! Which cache level the int4 kernels' software prefetch fills.
//!
//! The kernels prefetch each thread's weight stream 8 KiB ahead. On the AMD (Zen 4) machines
//! this project first measured on, prefetching into L1 was best; on Intel (Sapphire-Rapids-class)
//! machines, prefetching into L2 decodes 20-30% faster (OLMoE-1B-7B-shaped int4, 2 threads,
//! paired runs: 27.9-29.9 -> 33.5-37.6 tok/s), as L2 prefetches are not limited by the core's
//! few L1 fill buffers. So the default follows the CPU vendor, and `COLI_KERNEL_PREFETCH=l1|l2` forces
//! one level (for measuring either on any machine).

use std::sync::OnceLock;

/// The cache level a software prefetch fills.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PrefetchLevel {
    L1,
    L2,
}

impl PrefetchLevel {
    pub fn name(self) -> &'static str {
        match self {
            PrefetchLevel::L1 => "l1",
            PrefetchLevel::L2 => "l2",
        }
    }

    /// The measured-best level for a CPU vendor string (`cpuid` leaf 0).
    pub fn for_vendor(vendor: &str) -> PrefetchLevel {
        if vendor == "GenuineIntel" {
            PrefetchLevel::L2
        } else {
            PrefetchLevel::L1
        }
    }
}

/// Resolves a `COLI_KERNEL_PREFETCH` setting against the vendor's default; an unknown value
/// gives the default and a warning (the second value).
pub fn resolve_prefetch(setting: Option<&str>, vendor: &str) -> (PrefetchLevel, Option<String>) {
    let default = PrefetchLevel::for_vendor(vendor);
    match setting.map(|s| s.trim().to_ascii_lowercase()) {
        None => (default, None),
        Some(s) if s.is_empty() => (default, None),
        Some(s) if s == "l1" => (PrefetchLevel::L1, None),
        Some(s) if s == "l2" => (PrefetchLevel::L2, None),
        Some(s) => (
            default,
            Some(format!(
                "colibri: COLI_KERNEL_PREFETCH={s}: unknown level (expected l1|l2), using {}",
                default.name()
            )),
        ),
    }
}

/// The CPU vendor string (`GenuineIntel`, `AuthenticAMD`, ...); empty off x86_64.
pub fn cpu_vendor() -> String {
    #[cfg(target_arch = "x86_64")]
    {
        // cpuid leaf 0 (the vendor string) exists on every x86_64 CPU.
        let r = std::arch::x86_64::__cpuid(0);
        let mut v = Vec::with_capacity(12);
        for w in [r.ebx, r.edx, r.ecx] {
            v.extend_from_slice(&w.to_le_bytes());
        }
        String::from_utf8_lossy(&v).into_owned()
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        String::new()
    }
}

/// The level the kernels prefetch into, decided once per process.
pub fn prefetch_level() -> PrefetchLevel {
    static LEVEL: OnceLock<PrefetchLevel> = OnceLock::new();
    *LEVEL.get_or_init(|| {
        let env = std::env::var("COLI_KERNEL_PREFETCH").ok();
        let (level, warning) = resolve_prefetch(env.as_deref(), &cpu_vendor());
        if let Some(w) = warning {
            eprintln!("{w}");
        }
        level
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn vendor_defaults_and_overrides() {
        assert_eq!(
            resolve_prefetch(None, "GenuineIntel"),
            (PrefetchLevel::L2, None)
        );
        assert_eq!(
            resolve_prefetch(None, "AuthenticAMD"),
            (PrefetchLevel::L1, None)
        );
        assert_eq!(
            resolve_prefetch(Some(" L1 "), "GenuineIntel"),
            (PrefetchLevel::L1, None)
        );
        assert_eq!(
            resolve_prefetch(Some("l2"), "AuthenticAMD"),
            (PrefetchLevel::L2, None)
        );
        assert_eq!(
            resolve_prefetch(Some(""), "AuthenticAMD"),
            (PrefetchLevel::L1, None)
        );
        let (level, warning) = resolve_prefetch(Some("l3"), "AuthenticAMD");
        assert_eq!(level, PrefetchLevel::L1);
        assert!(warning.unwrap().contains("expected l1|l2"));
    }

    #[test]
    fn vendor_string_is_read() {
        let v = cpu_vendor();
        #[cfg(target_arch = "x86_64")]
        assert_eq!(v.len(), 12, "{v:?}");
        #[cfg(not(target_arch = "x86_64"))]
        assert!(v.is_empty());
    }
}
