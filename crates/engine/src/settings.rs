//! Every `COLI_*` environment variable the engine reads, read here and nowhere else (docs/API.md
//! describes them). Parsing, defaults, warnings and errors stay with the type a value becomes
//! (`quant::resolve_kernel`, `quant::prefetch::resolve_prefetch`, the model's prefill chunk and
//! KV dtype, `store::ExpertOptions::from_env`); this module only decides *when* each variable is
//! read.
//!
//! Two kinds:
//! - **Once per process** (cached in a `OnceLock` on first use): `COLI_KERNEL`,
//!   `COLI_KERNEL_PREFETCH` (the level can still be changed afterwards with
//!   `quant::prefetch::set_prefetch_level`; benchmarks alternate levels in one process),
//!   `COLI_AVX_VNNI`, `COLI_WHOLE_EXPERTS`, `COLI_GRAMMAR_OVERLAP`. The kernels ask for them on every product, so a
//!   change of the variable after the first product has no effect.
//! - **At each model load** (deliberately not cached): `COLI_PREFILL_CHUNK`,
//!   `COLI_DELTA_CHUNKED`, `COLI_MLA_EXPANDED`, `COLI_KV_DTYPE`,
//!   `COLI_LOAD`, and the expert store's `COLI_RAM_GB`, `COLI_PIN_GB`, `COLI_DIRECT_IO`,
//!   `COLI_PREFETCH`, `COLI_IO`, `COLI_CACHE_POLICY`. One process may load several models with
//!   different settings (the Python tests set them with `monkeypatch.setenv` between loads), and
//!   a bad value is reported by the load it affects.

use std::sync::OnceLock;

/// The variable's value, `None` when unset or not Unicode (as `std::env::var(..).ok()`).
fn var(name: &str) -> Option<String> {
    std::env::var(name).ok()
}

/// The raw value of `name`, read once per process.
fn once(cell: &'static OnceLock<Option<String>>, name: &str) -> Option<&'static str> {
    cell.get_or_init(|| var(name)).as_deref()
}

// ---------------------------------------------------------------------------------------------
// Once per process

/// `COLI_KERNEL` (`scalar|avx2|avx512`; resolved by `quant::resolve_kernel`).
pub fn kernel() -> Option<&'static str> {
    static V: OnceLock<Option<String>> = OnceLock::new();
    once(&V, "COLI_KERNEL")
}

/// `COLI_KERNEL_PREFETCH` (`l1|l2|off`; resolved by `quant::prefetch::resolve_prefetch`).
pub fn kernel_prefetch() -> Option<&'static str> {
    static V: OnceLock<Option<String>> = OnceLock::new();
    once(&V, "COLI_KERNEL_PREFETCH")
}

/// `COLI_AVX_VNNI`: whether the AVX2 kernel may use AVX-VNNI (anything but `0`, or unset).
pub fn avx_vnni_allowed() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| std::env::var("COLI_AVX_VNNI").map_or(true, |v| v.trim() != "0"))
}

/// `COLI_WHOLE_EXPERTS`: whether decode may give whole experts to threads (`0` turns it off, to
/// measure against the row split).
pub fn whole_experts() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| std::env::var("COLI_WHOLE_EXPERTS").map_or(true, |v| v != "0"))
}

/// `COLI_GRAMMAR_OVERLAP=1`: compute a grammar's token mask on another thread while the forward
/// pass runs. Off by default: the mask costs microseconds, and a thread started per token waits
/// for a core the compute pool holds (measured in docs/PERFORMANCE.md, "Constrained decoding").
pub fn grammar_overlap() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| std::env::var("COLI_GRAMMAR_OVERLAP").is_ok_and(|v| v.trim() == "1"))
}

// ---------------------------------------------------------------------------------------------
// At each model load (not cached: see the module documentation)

/// `COLI_PREFILL_CHUNK` (positions per prefill pass), read at each load.
pub fn prefill_chunk() -> Option<String> {
    var("COLI_PREFILL_CHUNK")
}

/// `COLI_DELTA_CHUNKED` (the shortest step of a linear-attention layer that runs the delta
/// rule's chunked form, or `off`), read at each load.
pub fn delta_chunked() -> Option<String> {
    var("COLI_DELTA_CHUNKED")
}

/// `COLI_MLA_EXPANDED` (`on|off`: MLA prefill in the expanded form where it pays, the default;
/// `off` keeps every pass absorbed), read at each load.
pub fn mla_expanded() -> Option<String> {
    var("COLI_MLA_EXPANDED")
}

/// `COLI_KV_DTYPE` (`f32|f16`), read at each load.
pub fn kv_dtype() -> Option<String> {
    var("COLI_KV_DTYPE")
}

/// `COLI_LOAD=mmap`: map the model files instead of reading them into huge pages; read at each
/// file a load maps.
pub fn load_mmap() -> bool {
    std::env::var("COLI_LOAD").is_ok_and(|v| v == "mmap")
}

/// The expert store's variables, each `None` when unset or empty; read at each load.
pub struct ExpertVars {
    pub ram_gb: Option<String>,
    pub pin_gb: Option<String>,
    pub direct_io: Option<String>,
    pub prefetch: Option<String>,
    pub io: Option<String>,
    pub cache_policy: Option<String>,
}

/// `COLI_RAM_GB`, `COLI_PIN_GB`, `COLI_DIRECT_IO`, `COLI_PREFETCH`, `COLI_IO`,
/// `COLI_CACHE_POLICY` as they are now (parsed by `store::ExpertOptions::from_env`).
pub fn expert_vars() -> ExpertVars {
    let var = |k: &str| var(k).filter(|v| !v.is_empty());
    ExpertVars {
        ram_gb: var("COLI_RAM_GB"),
        pin_gb: var("COLI_PIN_GB"),
        direct_io: var("COLI_DIRECT_IO"),
        prefetch: var("COLI_PREFETCH"),
        io: var("COLI_IO"),
        cache_policy: var("COLI_CACHE_POLICY"),
    }
}
