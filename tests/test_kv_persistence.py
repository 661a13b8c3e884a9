"""KV slot files: a warm conversation survives a restart, and a damaged or foreign file loads as
a state that was really committed, or is refused — the server always starts."""

from __future__ import annotations

import shutil

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from openai import OpenAI

from colibri.demo.builtin import builtin_model_dir
from colibri.runtime.engine import Engine

from .server import RunningServer, builtin_prompt_ids

USER1 = {"role": "user", "content": "Remember the number 417, please."}
USER2 = {"role": "user", "content": "Which number was it?"}


def test_conversation_continues_warm_after_a_restart(tmp_path):
    kv = tmp_path / "kv"
    srv = RunningServer("--kv-slots", "2", "--kv-dir", str(kv))
    try:
        client = OpenAI(base_url=srv.base_url, api_key="x", max_retries=0)
        r1 = client.chat.completions.create(
            model="colibri-builtin", messages=[USER1], max_tokens=10, extra_body={"cache_slot": 1}
        )
    finally:
        srv.stop()
    assert (kv / "slot-1.kv").is_file()
    messages = [USER1, {"role": "assistant", "content": r1.choices[0].message.content}, USER2]
    srv = RunningServer("--kv-slots", "2", "--kv-dir", str(kv))
    try:
        client = OpenAI(base_url=srv.base_url, api_key="x", max_retries=0)
        r2 = client.chat.completions.create(
            model="colibri-builtin", messages=messages, max_tokens=10, extra_body={"cache_slot": 1}
        )
    finally:
        srv.stop()
    engine = Engine(builtin_model_dir(), threads=2)
    p1, p2 = builtin_prompt_ids(engine, [USER1]), builtin_prompt_ids(engine, messages)
    assert r2.usage.prompt_tokens == len(p2)
    # Only the new turn was prefilled after the restart...
    assert r2.usage.prompt_tokens_details.cached_tokens >= len(p1)
    # ...and the answer is the one a cold run gives.
    assert r2.choices[0].message.content == engine.detokenize(list(engine.generate(p2, 10)))


def test_no_kv_persist_writes_nothing(tmp_path):
    srv = RunningServer("--no-kv-persist", env={"COLI_KV_DIR": str(tmp_path / "kv")})
    try:
        client = OpenAI(base_url=srv.base_url, api_key="x", max_retries=0)
        client.chat.completions.create(model="colibri-builtin", messages=[USER1], max_tokens=3)
    finally:
        srv.stop()
    assert not (tmp_path / "kv").exists()


@pytest.fixture(scope="module")
def committed(tmp_path_factory):
    """A slot file written by one generation, and every state it committed (in order)."""
    kv = tmp_path_factory.mktemp("kv")
    engine = Engine(builtin_model_dir(), threads=2, kv_dir=kv)
    ids = builtin_prompt_ids(engine, [USER1])
    stream = engine.generate(ids, 8, slot=0)
    out = list(stream)
    stream.close()
    history = engine.slot_info(0)["tokens"]
    assert history == ids + out[:-1]
    data = (kv / "slot-0.kv").read_bytes()
    del stream, engine
    # Committed states: the prefilled prompt, then one more token per decode step.
    states = [history[:n] for n in range(len(ids), len(history) + 1)]
    return data, states


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.data())
def test_damaged_files_load_a_committed_state_or_are_refused(committed, tmp_path_factory, data):
    raw, states = committed
    damaged = bytearray(raw)
    if data.draw(st.booleans(), label="truncate"):
        damaged = damaged[: data.draw(st.integers(0, len(raw)), label="cut")]
    else:
        for _ in range(data.draw(st.integers(1, 4), label="flips")):
            at = data.draw(st.integers(0, len(raw) - 1), label="at")
            damaged[at] ^= data.draw(st.integers(1, 255), label="xor")
    kv = tmp_path_factory.mktemp("damaged")
    (kv / "slot-0.kv").write_bytes(bytes(damaged))
    engine = Engine(builtin_model_dir(), threads=1, kv_dir=kv)  # always loads
    tokens = engine.slot_info(0)["tokens"]
    assert tokens == [] or tokens in states
    if tokens:
        # The KV that came back is the KV that was computed: the continuation matches a cold
        # run on the same tokens.
        warm = engine.generate(tokens + [tokens[-1]], 3, slot=0)
        assert list(warm) == list(engine.generate(tokens + [tokens[-1]], 3))
        assert warm.reused_tokens == len(tokens)


def test_a_file_from_another_model_is_refused_with_a_note(committed, tmp_path, converted):
    raw, _ = committed
    kv = tmp_path / "kv"
    kv.mkdir()
    (kv / "slot-0.kv").write_bytes(raw)
    other = Engine(converted("glm4_moe", "int4"), threads=1, kv_dir=kv)
    assert other.slot_info(0)["tokens"] == []
    assert any("slot-0.kv" in note for note in other._model.load_notes())
    shutil.rmtree(kv)
