"""One RAM budget for the whole server (``--ram-gb``): what each model takes, and how much of it
each engine's expert cache gets.

A loaded model takes a **fixed part** (its resident weights, ``resident.bin`` and the copies the
engine makes of them at load, as ``memory_plan`` counts them; its KV slots at full context; its
fixed-size states (linear attention, DeepSeek-V4's windows) with their snapshots) and an **expert
cache** (at most its whole ``experts.bin``). Every loaded model's fixed part and cache count against
the budget.

The rule (docs/API.md, "RAM budget"): the fixed parts come first; what the budget leaves is
shared equally between the models loaded at startup (the default model and pinned entries) and,
when the catalog has models loaded on demand, one more equal share for those. A share a model
does not need (its experts file is smaller) goes to the others (water-filling), so a small model
never holds RAM it cannot use. A model loaded on demand gets, as its expert cache, what the
on-demand share leaves after its own fixed part, up to its whole experts file; to make that room
the models loaded on demand that were used longest ago are unloaded (runtime/models.py). An
expert cache is sized when its engine loads and keeps that size until the model is unloaded.
Every expert cache holds at least one expert record (the engine's minimum), and a model whose
fixed part and one record do not fit is refused with the numbers.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

# Copies of a slot's fixed-size state (linear attention, DeepSeek-V4's windows) it holds at
# most: its own and the engine's snapshots (crates/engine/src/kv.rs `MAX_SNAPSHOTS`).
STATE_COPIES = 1 + 4

GB = 1e9


class BudgetError(ValueError):
    """A budget the models cannot run in (the message gives the numbers)."""


def gb(n: float) -> str:
    """Bytes for people, in the budget's decimal units (GB = 1e9 bytes, as --ram-gb)."""
    if abs(n) >= 1e9:
        return f"{n / 1e9:.3f} GB"
    return f"{n / 1e6:.1f} MB" if abs(n) >= 1e6 else f"{n / 1e3:.1f} kB"


@dataclass(frozen=True)
class ModelMemory:
    """What one model takes in RAM with ``slots`` KV slots of ``context`` tokens."""

    resident: int
    experts: int
    # One expert record (the expert cache's unit); 0 when the model has no routed experts.
    record: int
    kv: int
    state: int

    @property
    def fixed(self) -> int:
        """Resident weights, KV slots at full context and states: taken whatever the cache."""
        return self.resident + self.kv + self.state

    @property
    def smallest(self) -> int:
        """The least it runs in: its fixed part and one expert record."""
        return self.fixed + min(self.record, self.experts)

    def cache_for(self, room: int) -> int:
        """The expert cache in ``room`` bytes: at most every expert, at least one record."""
        if self.experts == 0:
            return 0
        return max(min(self.experts, room), min(self.record, self.experts))

    def describe(self) -> str:
        return f"resident weights {gb(self.resident)} + KV {gb(self.kv)}" + (
            f" + per-slot state {gb(self.state)}" if self.state else ""
        )


def memory_of(plan: Mapping[str, int], slots: int, context: int | None) -> ModelMemory:
    """A model's memory from the engine's ``memory_plan`` (or a loaded engine's figures):
    ``slots`` KV slots at ``context`` tokens (None: the model's own, at most it)."""
    own = int(plan["context_length"])
    ctx = min(context, own) if context else own
    return ModelMemory(
        resident=int(plan["resident_bytes"]),
        experts=int(plan["expert_bytes"]),
        record=int(plan["expert_record_bytes"]),
        kv=slots * ctx * int(plan["kv_bytes_per_token"]),
        state=slots * int(plan["state_bytes_per_slot"]) * STATE_COPIES,
    )


def plan_model(path: Path, slots: int, context: int | None) -> ModelMemory:
    """The memory of the model directory ``path``, read from its manifest (no weights loaded);
    ``ValueError`` when it cannot be read."""
    from colibri import _engine

    return memory_of(dict(_engine.memory_plan(str(path))), slots, context)


def fair_shares(room: int, wants: Sequence[int]) -> list[int]:
    """``room`` bytes shared equally between claimants that want ``wants`` bytes each: none gets
    more than it wants, and what one does not take is shared by the others (water-filling).
    The shares sum to at most ``room``; with ``room`` <= 0 every share is 0."""
    shares = [0] * len(wants)
    left = max(0, room)
    order = sorted(range(len(wants)), key=lambda i: wants[i])
    for n, i in enumerate(order):
        share = min(max(0, wants[i]), left // (len(order) - n))
        shares[i] = share
        left -= share
    return shares


class RamBudget:
    """``--ram-gb`` over a catalog: ``kept`` (the models loaded at startup and never unloaded:
    the default and pinned entries) and ``on_demand`` (the others), each with its memory
    (None: unknown, a directory that cannot be read; it fails at its load)."""

    def __init__(
        self,
        total: int,
        kept: Mapping[str, ModelMemory],
        on_demand: Mapping[str, ModelMemory | None],
    ) -> None:
        self.total = total
        self.memory: dict[str, ModelMemory | None] = {**kept, **on_demand}
        fixed = sum(m.fixed for m in kept.values())
        room = total - fixed
        wants = [m.experts for m in kept.values()]
        demand = sum(m.fixed + m.experts for m in on_demand.values() if m is not None)
        if on_demand:
            wants.append(demand)
        shares = fair_shares(room, wants)
        self.cache: dict[str, int] = {
            entry_id: m.cache_for(share)
            for (entry_id, m), share in zip(kept.items(), shares, strict=False)
        }
        used = fixed + sum(self.cache.values())
        if used > total:
            smallest = sum(m.smallest for m in kept.values())
            names = ", ".join(f"{entry_id} ({m.describe()})" for entry_id, m in kept.items())
            raise BudgetError(
                f"--ram-gb {total / GB:g} is too small: the models loaded at startup need at "
                f"least {gb(smallest)} ({names}, and one expert record each); give --ram-gb "
                f"{math.ceil(smallest / 1e6) / 1e3:g} or more, or fewer --kv-slots, or a "
                "smaller --context"
            )
        # What the models loaded on demand share: the budget minus every kept model.
        self.on_demand_room = total - used

    def cache_bytes(self, entry_id: str) -> int:
        """The expert cache ``entry_id``'s engine gets: its share (a kept model), or what the
        on-demand share leaves after its fixed part, up to its whole experts file."""
        if entry_id in self.cache:
            return self.cache[entry_id]
        m = self.memory.get(entry_id)
        if m is None:
            return 0
        return m.cache_for(self.on_demand_room - m.fixed)

    def need(self, entry_id: str) -> int:
        """What ``entry_id`` counts against the budget while loaded: fixed part and cache."""
        m = self.memory.get(entry_id)
        return 0 if m is None else m.fixed + self.cache_bytes(entry_id)

    def refusal(self, entry_id: str) -> str | None:
        """Why ``entry_id`` can never load under this budget (None: it can)."""
        m = self.memory.get(entry_id)
        if m is None or entry_id in self.cache or m.smallest <= self.on_demand_room:
            return None
        return (
            f"it needs at least {gb(m.smallest)} ({m.describe()} and one expert record) and "
            f"--ram-gb {self.total / GB:g} leaves {gb(max(0, self.on_demand_room))} beside the "
            "models never unloaded (the default and pinned ones)"
        )

    def engine_ram_gb(self, entry_id: str) -> float | None:
        """``ram_gb`` for ``entry_id``'s engine (its expert cache in GB, rounded up so the
        engine's whole records fit), or None for a model without routed experts."""
        cache = self.cache_bytes(entry_id)
        return (cache + 1) / GB if cache else None
