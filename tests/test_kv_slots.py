"""KV slots: prefix reuse within and across requests (engine and server)."""

from __future__ import annotations

import pytest
from openai import OpenAI

from colibri.demo.builtin import builtin_model_dir
from colibri.runtime.engine import Engine

from .server import RunningServer, builtin_prompt_ids

USER1 = {"role": "user", "content": "Remember the number 417."}
USER2 = {"role": "user", "content": "Which number did I mention?"}


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine(builtin_model_dir(), threads=2, slots=3)


def test_second_turn_prefills_only_new_tokens(engine):
    p1 = builtin_prompt_ids(engine, [USER1])
    first = engine.generate(p1, 12, slot=1)
    out1 = list(first)
    assert first.reused_tokens == 0
    history = p1 + out1[:-1]  # the last sampled token was never fed back
    assert engine.slot_info(1)["tokens"] == history
    reply = {"role": "assistant", "content": engine.detokenize(out1)}
    p2 = builtin_prompt_ids(engine, [USER1, reply, USER2])
    second = engine.generate(p2, 12, slot=1)
    out2 = list(second)
    assert second.reused_tokens == common_prefix(history, p2) >= len(p1)
    assert out2 == list(engine.generate(p2, 12))  # a cold run on the same prompt
    # The same prompt again reuses all but its last token.
    again = engine.generate(p2, 12, slot=1)
    assert list(again) == out2 and again.reused_tokens == len(p2) - 1


def test_slots_are_independent(engine):
    a, b = builtin_prompt_ids(engine, [USER1]), builtin_prompt_ids(engine, [USER2])
    list(engine.generate(a, 4, slot=0))
    list(engine.generate(b, 4, slot=2))
    assert engine.slot_info(0)["tokens"][: len(a)] == a
    assert engine.slot_info(2)["tokens"][: len(b)] == b
    t = engine.generate(a, 4, slot=0)
    list(t)
    assert t.reused_tokens == len(a) - 1
    with pytest.raises(ValueError, match="slot must be 0..2"):
        engine.generate(a, 1, slot=3)


def test_server_reports_cached_tokens(engine):
    srv = RunningServer("--kv-slots", "2")
    try:
        client = OpenAI(base_url=srv.base_url, api_key="x", max_retries=0)
        r1 = client.chat.completions.create(
            model="colibri-builtin", messages=[USER1], max_tokens=8, extra_body={"cache_slot": 1}
        )
        assert r1.usage.prompt_tokens_details.cached_tokens == 0
        reply = {"role": "assistant", "content": r1.choices[0].message.content}
        messages = [USER1, reply, USER2]
        r2 = client.chat.completions.create(
            model="colibri-builtin", messages=messages, max_tokens=8, extra_body={"cache_slot": 1}
        )
        p1, p2 = builtin_prompt_ids(engine, [USER1]), builtin_prompt_ids(engine, messages)
        assert r2.usage.prompt_tokens == len(p2)
        assert r2.usage.prompt_tokens_details.cached_tokens >= len(p1)
        cold = engine.detokenize(list(engine.generate(p2, 8)))
        assert r2.choices[0].message.content == cold
        # Another slot starts cold.
        r3 = client.chat.completions.create(
            model="colibri-builtin", messages=messages, max_tokens=2, extra_body={"cache_slot": 0}
        )
        assert r3.usage.prompt_tokens_details.cached_tokens == 0
    finally:
        srv.stop()


def test_any_slot_requests_go_where_their_prefix_is(engine):
    """Two conversations alternating without cache_slot each keep their own warm slot."""
    srv = RunningServer("--kv-slots", "2")
    try:
        client = OpenAI(base_url=srv.base_url, api_key="x", max_retries=0)
        a = [{"role": "user", "content": "First conversation " * 20}]
        b = [{"role": "user", "content": "Another topic entirely " * 20}]
        for messages in (a, b):
            client.chat.completions.create(model="colibri-builtin", messages=messages, max_tokens=2)
        for messages in (a, b, a, b):
            r = client.chat.completions.create(
                model="colibri-builtin", messages=messages, max_tokens=2
            )
            assert r.usage.prompt_tokens_details.cached_tokens == r.usage.prompt_tokens - 1
    finally:
        srv.stop()
