"""The arithmetic of the one RAM budget (runtime/budget.py, ``--ram-gb``): fixed parts first,
the rest shared equally (water-filling) between the models loaded at startup and one share for
the models loaded on demand; every expert cache at least one record and at most its experts
file; a budget the startup models cannot fit is refused with the numbers. The engine's
``memory_plan`` gives, without loading a model, what ``Engine.info`` gives once it is loaded."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from colibri.demo.builtin import builtin_model_dir, default_model_dir
from colibri.runtime.budget import (
    STATE_COPIES,
    BudgetError,
    ModelMemory,
    RamBudget,
    fair_shares,
    plan_model,
)
from colibri.runtime.engine import Engine

sizes = st.integers(min_value=0, max_value=10**12)


@settings(max_examples=500, deadline=None)
@given(st.integers(min_value=-(10**12), max_value=10**13), st.lists(sizes, max_size=8))
def test_fair_shares_water_fill(room, wants):
    shares = fair_shares(room, wants)
    assert len(shares) == len(wants)
    assert sum(shares) <= max(0, room)
    for share, want in zip(shares, wants, strict=True):
        assert 0 <= share <= want
    unmet = [s for s, w in zip(shares, wants, strict=True) if s < w]
    if unmet:
        # Nothing is kept back while someone still wants more: all of the room is given, but
        # for the remainder of the integer division (less than one byte per claimant)...
        assert max(0, room) - sum(shares) < len(wants)
        # ... and every claimant left wanting got the same, at least what any other got.
        assert max(unmet) - min(unmet) <= 1 and min(unmet) + 1 >= max(shares)


def test_fair_shares_examples():
    assert fair_shares(90, [10, 100, 100]) == [10, 40, 40]
    assert fair_shares(90, [100, 100, 100]) == [30, 30, 30]
    assert fair_shares(90, [10, 20]) == [10, 20]  # each takes what it wants, no more
    assert fair_shares(-5, [10, 20]) == [0, 0]
    assert fair_shares(10, []) == []


def mem(fixed: int, experts: int, record: int = 10) -> ModelMemory:
    return ModelMemory(resident=fixed, experts=experts, record=record, kv=0, state=0)


def test_one_model_gets_what_the_budget_leaves_up_to_its_experts():
    b = RamBudget(1000, {"m": mem(300, 2000)}, {})
    assert b.cache_bytes("m") == 700 and b.need("m") == 1000 and b.on_demand_room == 0
    b = RamBudget(1000, {"m": mem(300, 200)}, {})
    assert b.cache_bytes("m") == 200 and b.on_demand_room == 500  # every expert, no more
    assert RamBudget(1000, {"m": mem(300, 0, record=0)}, {}).cache_bytes("m") == 0


def test_startup_models_and_the_on_demand_share_split_the_rest_equally():
    kept = {"d": mem(100, 10_000), "p": mem(100, 50)}
    on_demand = {"a": mem(200, 10_000), "b": mem(100, 100)}
    b = RamBudget(3100, kept, on_demand)
    # 2900 left after d's and p's fixed parts: p takes its 50, d and the on-demand share split
    # the other 2850 equally (the on-demand models want 10,400 together).
    assert b.cache_bytes("p") == 50 and b.cache_bytes("d") == 1425
    assert b.on_demand_room == 1425
    # A model loaded on demand: what the on-demand share leaves after its fixed part.
    assert b.cache_bytes("a") == 1225 and b.need("a") == 1425
    assert b.cache_bytes("b") == 100 and b.need("b") == 200  # all of it
    # Whatever loads, the startup models and any one model on demand fit the budget.
    for entry_id in on_demand:
        assert sum(b.need(k) for k in kept) + b.need(entry_id) <= b.total


def test_small_models_on_demand_leave_the_rest_to_the_startup_model():
    b = RamBudget(10_000, {"big": mem(1000, 100_000)}, {"x": mem(100, 200), "y": mem(50, 50)})
    assert b.on_demand_room == 400  # both of them whole: fixed parts and experts
    assert b.cache_bytes("big") == 8600
    assert b.need("x") + b.need("y") == 400


def test_every_cache_holds_one_record_and_a_model_that_cannot_fit_is_refused():
    b = RamBudget(1000, {"d": mem(500, 10_000, record=100)}, {"huge": mem(600, 100)})
    assert b.cache_bytes("d") == 250 and b.on_demand_room == 250
    assert b.refusal("huge") == (
        "it needs at least 0.6 kB (resident weights 0.6 kB + KV 0.0 kB and one expert record) "
        "and --ram-gb 1e-06 leaves 0.2 kB beside the models never unloaded (the default and "
        "pinned ones)"
    )
    assert b.refusal("d") is None
    small = RamBudget(1000, {"d": mem(500, 10_000, record=100)}, {"s": mem(100, 1000, 100)})
    assert small.refusal("s") is None and small.cache_bytes("s") == 150
    with pytest.raises(BudgetError) as e:
        RamBudget(550, {"d": mem(500, 10_000, record=100)}, {})  # 500 + one record > 550
    assert str(e.value).startswith(
        "--ram-gb 5.5e-07 is too small: the models loaded at startup need at least 0.6 kB (d "
        "(resident weights 0.5 kB + KV 0.0 kB), and one expert record each); give --ram-gb "
        "0.001 or more"
    )


def test_an_unreadable_model_on_demand_counts_nothing_until_its_load_fails():
    b = RamBudget(1000, {"d": mem(100, 100)}, {"broken": None})
    assert b.need("broken") == 0 and b.refusal("broken") is None and b.cache_bytes("d") == 100


@pytest.mark.parametrize("slots,context", [(1, None), (3, 256)])
def test_the_memory_plan_is_what_the_loaded_engine_reports(slots, context):
    for path in (builtin_model_dir(), default_model_dir()):
        plan = plan_model(path, slots, context)
        info = Engine(path, threads=1, slots=slots, context=context).info
        ctx = info["context_length"]
        assert plan.kv == slots * ctx * info["kv_bytes_per_token"]
        assert plan.state == slots * info["state_bytes_per_slot"] * STATE_COPIES
        assert plan.resident == (path / "resident.bin").stat().st_size == info["resident_bytes"]
        assert plan.experts == (path / "experts.bin").stat().st_size
        assert plan.experts % plan.record == 0 and plan.record > 0


def test_the_memory_plan_of_a_linear_attention_model_counts_its_states(converted):
    path = converted("qwen3_next", "int4")
    plan = plan_model(path, 2, None)
    info = Engine(path, threads=1, slots=2).info
    assert info["state_bytes_per_slot"] > 0
    assert plan.state == 2 * STATE_COPIES * info["state_bytes_per_slot"]


def kv_b_columns_bytes(path) -> int:
    """What the engine's copy of an MLA model's `kv_b` by columns takes (quant/columns.rs):
    per head, its rows padded to tiles of 64, a nibble (int4) or a byte (8-bit) a value and an
    f32 scale per row and group of 32 columns."""
    manifest = json.loads((path / "manifest.json").read_text())
    heads = manifest["config"]["num_attention_heads"]
    total = 0
    for name, t in manifest["resident"]["tensors"].items():
        if name.endswith((".kv_b_uk_t", ".kv_b_uv")) and t["dtype"] in ("q4", "q8"):
            rows, cols = t["shape"][0] // heads, t["shape"][1]
            rows_p = -(-rows // 64) * 64
            values = cols * rows_p // 2 if t["dtype"] == "q4" else cols * rows_p
            total += heads * (values + 4 * -(-cols // 32) * rows_p)
    return total


def test_the_memory_plan_of_an_mla_model_counts_its_kv_b_copy_by_columns(converted, monkeypatch):
    path = converted("deepseek_v3", "int4")
    file = (path / "resident.bin").stat().st_size
    copy = kv_b_columns_bytes(path)
    assert copy > 0
    monkeypatch.delenv("COLI_MLA_EXPANDED", raising=False)
    assert plan_model(path, 1, None).resident == file + copy
    assert Engine(path, threads=1).info["resident_bytes"] == file + copy
    monkeypatch.setenv("COLI_MLA_EXPANDED", "off")
    assert plan_model(path, 1, None).resident == file
    assert Engine(path, threads=1).info["resident_bytes"] == file


def test_the_memory_plan_of_a_directory_that_is_not_a_model_is_an_error(tmp_path):
    with pytest.raises((ValueError, RuntimeError)):
        plan_model(tmp_path, 1, None)


def test_one_command_takes_ram_gb_for_its_one_model(capsys):
    """`colibri generate` (as bench and eval-ppl): the budget's rest after the model's fixed
    part is its expert cache; a budget below the fixed part and one record is exit status 2."""
    from colibri.cli import main

    path = builtin_model_dir()
    plan = plan_model(path, 1, None)
    base = ["generate", "--model", str(path), "--prompt", "Hi", "--max-tokens", "3"]
    assert main([*base, "--ram-gb", repr((plan.fixed + 2 * plan.record + 8) / 1e9)]) == 0
    assert capsys.readouterr().out.strip()
    assert main([*base, "--ram-gb", repr((plan.fixed + plan.record - 100) / 1e9)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("colibri generate: --ram-gb ") and "is too small" in err, err
