"""The machine the benchmark runs on: how busy other processes keep its CPUs (waiting for quiet,
re-measuring a disturbed run), the size of its caches (which sizes the bandwidth probe's
buffer), and its description for the report."""

from __future__ import annotations

import os
import platform
import time
from collections.abc import Callable
from pathlib import Path

from .common import log


def cpu_times() -> tuple[int, int] | None:
    """(busy, total) jiffies over all CPUs from /proc/stat, or None off Linux."""
    try:
        f = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return None
    total = sum(f[:8])  # user nice system idle iowait irq softirq steal
    return total - f[3] - f[4], total


def others_cpu(before, after, own_cpu_s: float = 0.0) -> float | None:
    """Fraction of all CPUs used by other processes between two cpu_times() samples."""
    if not before or not after or after[1] <= before[1]:
        return None
    own = own_cpu_s * os.sysconf("SC_CLK_TCK")
    return max(0.0, (after[0] - before[0] - own) / (after[1] - before[1]))


def wait_for_idle(max_wait: float, threshold: float) -> float | None:
    """Wait (up to max_wait s) until other processes use <= threshold of the CPUs.

    Returns the last 1-second busy fraction seen.
    """
    t0 = time.monotonic()
    said = -1e9
    while True:
        c0 = cpu_times()
        time.sleep(1.0)
        busy = others_cpu(c0, cpu_times())
        if busy is None or busy <= threshold:
            return busy
        waited = time.monotonic() - t0
        if waited >= max_wait:
            log(f"  machine still busy ({busy:.0%} CPU) after {waited:.0f}s; measuring anyway")
            return busy
        if waited - said >= 15:
            log(f"  waiting for the machine to go idle (other processes: {busy:.0%} CPU)")
            said = waited


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def cpu_cache_bytes(cpu_dir: Path = Path("/sys/devices/system/cpu")) -> int:
    """Total size of every distinct CPU cache (each L1/L2 of each core, each shared L3
    once), from sysfs; 0 when the kernel does not say."""
    seen: set[tuple[str, ...]] = set()
    total = 0
    for d in sorted(cpu_dir.glob("cpu[0-9]*/cache/index[0-9]*")):
        try:
            key = tuple((d / f).read_text().strip() for f in ("level", "type", "shared_cpu_list"))
            size = (d / "size").read_text().strip()
        except OSError:
            continue
        if key in seen:
            continue
        seen.add(key)
        unit = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(size[-1:].upper(), 1)
        digits = size.rstrip("KMGkmg")
        total += int(digits) * unit if digits.isdigit() else 0
    return total


def probe_size_mib(requested: int, cache_bytes: int) -> int:
    """The bandwidth probe's buffer: what was asked for, or (0, the default) 8x all the
    CPU caches, in whole GiB and never below 1 GiB. STREAM asks for at least 4x so that
    no pass is served from cache; these VMs report L3s of up to 480 MB whose replacement
    policy keeps part of a 1 GiB stream between passes (its best pass read 10-15% above
    an 8 GiB one's, measured in alternation), so twice that margin."""
    if requested > 0:
        return requested
    gib = -(-8 * cache_bytes // (1 << 30))
    return max(1, gib) * 1024


def mem_total_gb() -> float:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal"):
                return int(line.split()[1]) / 1024**2
    except OSError:
        pass
    return 0.0


class Quiet:
    """Measuring on a shared machine: wait for quiet before a round, and measure again when
    other processes took more than --max-others of the CPUs meanwhile, all within the
    per-wait (--wait-idle) and whole-run (--max-wait-total) budgets of the options `a`."""

    def __init__(self, a) -> None:
        self.a = a
        self.budget = a.max_wait_total  # seconds of waiting/re-measuring left for the whole run

    def settle(self) -> float | None:
        """Wait for an idle machine, within the per-wait and whole-run budgets."""
        limit = min(self.a.wait_idle, self.budget)
        if limit <= 0:
            return None
        t0 = time.monotonic()
        busy = wait_for_idle(limit, self.a.idle_threshold)
        self.budget -= time.monotonic() - t0
        return busy

    def clean(self, measure: Callable[[], dict], what: str) -> dict:
        """Measure; while other processes took > --max-others of the CPUs meanwhile,
        wait for quiet and measure again (--retries times), keeping the cleanest."""
        a = self.a
        best: dict = {}
        for attempt in range(1 + a.retries):
            t0 = time.monotonic()
            res = measure()
            res["run_s"] = time.monotonic() - t0  # this attempt's own wall time
            if attempt:
                self.budget -= res["run_s"]
            res["attempts"] = attempt + 1
            busy = res.get("others_cpu")
            if not best or (busy or 0) < (best.get("others_cpu") or 0):
                best = res
            if busy is None or busy <= a.max_others or attempt == a.retries:
                break
            if self.budget <= 0:
                log(f"  {what}: other processes took {busy:.0%} CPU (no waiting budget left)")
                break
            log(f"  {what}: other processes took {busy:.0%} CPU meanwhile; re-measuring")
            self.settle()
        return best
