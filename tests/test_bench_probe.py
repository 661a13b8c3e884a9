"""The benchmark's bandwidth-probe sizing (benchmarks/bench_vs_llamacpp.py): the buffer must
dwarf the CPU caches, or a cache-retained part of it inflates the decode ceiling."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st

ROOT = Path(__file__).resolve().parent.parent


def _bench():
    spec = importlib.util.spec_from_file_location(
        "bench_vs_llamacpp", ROOT / "benchmarks" / "bench_vs_llamacpp.py"
    )
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


bench = _bench()


def _cache(cpu_dir: Path, cpu: int, index: int, level: int, kind: str, size: str, shared: str):
    d = cpu_dir / f"cpu{cpu}" / "cache" / f"index{index}"
    d.mkdir(parents=True)
    for name, value in [("level", level), ("type", kind), ("size", size)]:
        (d / name).write_text(f"{value}\n")
    (d / "shared_cpu_list").write_text(f"{shared}\n")


def test_cache_total_counts_private_caches_per_core_and_shared_ones_once(tmp_path: Path) -> None:
    for cpu in (0, 1):
        _cache(tmp_path, cpu, 0, 1, "Data", "48K", str(cpu))
        _cache(tmp_path, cpu, 1, 1, "Instruction", "64K", str(cpu))
        _cache(tmp_path, cpu, 2, 2, "Unified", "2048K", str(cpu))
        _cache(tmp_path, cpu, 3, 3, "Unified", "491520K", "0-1")
    want = 2 * (48 + 64 + 2048) * 1024 + 491520 * 1024
    assert bench.cpu_cache_bytes(tmp_path) == want
    # The Intel VM of this kind: 8x its ~495 MB of caches is 4 GiB.
    assert bench.probe_size_mib(0, want) == 4096


def test_no_cache_information_gives_the_floor(tmp_path: Path) -> None:
    assert bench.cpu_cache_bytes(tmp_path) == 0
    assert bench.probe_size_mib(0, 0) == 1024


@given(st.integers(min_value=0, max_value=1 << 34), st.integers(min_value=0, max_value=1 << 16))
def test_probe_size_is_whole_gib_at_least_8x_the_caches(cache: int, asked: int) -> None:
    size = bench.probe_size_mib(asked, cache)
    if asked > 0:
        assert size == asked
    else:
        assert size % 1024 == 0 and size >= 1024
        assert size * (1 << 20) >= 8 * cache
        assert size == 1024 or (size - 1024) * (1 << 20) < 8 * cache


def test_per_round_ratios_report_their_range_and_median():
    # A report's ratio row gives the per-round ratios' median beside their range: with a VM
    # flipping between two states, the ratio of the engines' medians can pair different states
    # (the DeepSeek-V3 run of 2026-12-06 night: medians' ratio 1.17, these rounds).
    from vs_llamacpp.report import per_round

    rounds = [1.137, 1.120, 1.335, 1.258, 1.493]
    assert per_round(rounds) == "per round 1.12–1.49, their median 1.26"
    assert per_round([1.3]) == "per round 1.30–1.30, their median 1.30"
    assert per_round([1.0, 2.0]) == "per round 1.00–2.00, their median 1.50"
