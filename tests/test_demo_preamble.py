"""Long agent preambles for the demo model (``colibri.demo.preamble``): deterministic, sized as
asked, the demo tools declared among the agent's, and the trained answers unchanged behind them."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from colibri.chat.template import ChatTemplate
from colibri.demo import data as demo_data
from colibri.demo import preamble as demo_preamble

TEMPLATE = ChatTemplate(
    (Path(demo_data.__file__).parents[1] / "chat" / "templates" / "glm45.jinja").read_text("utf-8")
)
DEMO = list(demo_data.TOOLS.values())
MARKERS = ("<|", "<tool_call>", "</tool_call>", "<arg_key>", "<arg_value>", "<think>")


def _names(tools: list[dict]) -> list[str]:
    return [t["function"]["name"] for t in tools]


def _chars(p: dict) -> int:
    return len(p["system"]) + sum(len(json.dumps(t)) for t in p["tools"])


def test_preambles_are_deterministic_for_a_seed():
    a = demo_preamble.agent_preamble(random.Random(3), 20000, DEMO)
    assert a == demo_preamble.agent_preamble(random.Random(3), 20000, DEMO)
    assert a != demo_preamble.agent_preamble(random.Random(4), 20000, DEMO)


@pytest.mark.parametrize("target", [3000, 12000, 30000, 60000])
def test_a_preamble_has_about_the_size_asked(target):
    for seed in range(5):
        p = demo_preamble.agent_preamble(random.Random(seed), target, DEMO)
        assert 0.8 * target < _chars(p) < 1.2 * target + 1500
        assert p["system"].startswith("You are an interactive CLI agent")


def test_the_catalog_grows_like_an_agents_and_declares_each_demo_tool_once():
    for seed in range(10):
        p = demo_preamble.agent_preamble(random.Random(seed), 28000, DEMO)
        names = _names(p["tools"])
        assert len(names) == len(set(names))
        for t in demo_data.TOOLS:
            assert names.count(t) == 1
        assert 4 <= len(names) - 3 <= 30
        agent = [t for t in p["tools"] if t["function"]["name"] not in demo_data.TOOLS]
        for t in agent:
            f = t["function"]
            assert len(f["description"]) > 100
            assert f["parameters"]["type"] == "object"
            assert set(f["parameters"]["required"]) <= set(f["parameters"]["properties"])
    # Without demo tools, only the agent's.
    p = demo_preamble.agent_preamble(random.Random(0), 10000)
    assert not set(_names(p["tools"])) & set(demo_data.TOOLS)


def test_demo_tools_land_anywhere_in_the_catalog():
    places = set()
    for seed in range(40):
        p = demo_preamble.agent_preamble(random.Random(seed), 20000, [demo_data.TOOLS["get_time"]])
        places.add(_names(p["tools"]).index("get_time"))
    assert 0 in places and len(places) > 5


def test_preamble_text_holds_no_chat_markers():
    for seed in range(20):
        p = demo_preamble.agent_preamble(random.Random(seed), 15000, DEMO)
        text = p["system"] + json.dumps(p["tools"])
        for m in MARKERS:
            assert m not in text


def test_fit_preamble_hits_a_token_count():
    def count(p: dict) -> int:  # a stand-in tokenizer: 2.3 characters a token
        return int(_chars(p) / 2.3)

    for target in (1000, 6000, 12000):
        p = demo_preamble.fit_preamble(random.Random(target), target, count, DEMO)
        # A tool is ~1-2k characters: the size moves in steps of that.
        assert abs(p["tokens"] - target) <= 0.1 * target
        assert p["tokens"] == count(p)
    a = demo_preamble.fit_preamble(random.Random(1), 5000, count, DEMO)
    b = demo_preamble.fit_preamble(random.Random(1), 5000, count, DEMO)
    assert a == b


def test_with_preamble_replaces_the_system_line_and_keeps_the_turns():
    conv = {
        "messages": [
            {"role": "system", "content": "Answer briefly."},
            {"role": "user", "content": "What is 2 + 3?"},
            {"role": "assistant", "content": "5"},
        ],
        "tools": [demo_data.TOOLS["get_weather"]],
        "thinking": [False],
        "kinds": ["arith"],
    }
    pre = demo_preamble.agent_preamble(random.Random(0), 5000, [demo_data.TOOLS["get_weather"]])
    out = demo_preamble.with_preamble(conv, pre)
    assert out["messages"][0] == {"role": "system", "content": pre["system"]}
    assert out["messages"][1:] == conv["messages"][1:]
    assert out["tools"] == pre["tools"]
    assert out["thinking"] == conv["thinking"] and out["kinds"] == conv["kinds"]
    assert conv["messages"][0]["content"] == "Answer briefly."  # the input is not changed
    with pytest.raises(ValueError, match="does not declare get_time"):
        demo_preamble.with_preamble(dict(conv, tools=[demo_data.TOOLS["get_time"]]), pre)


def test_long_conversations_call_only_declared_demo_tools_and_answer_every_call():
    calls = undeclared = 0
    for seed in range(60):
        rng = random.Random(seed)
        conv = demo_preamble.long_train_conversation(rng, 8000, 10, tool_extra=3)
        msgs = conv["messages"]
        assert msgs[0]["role"] == "system" and len(msgs[0]["content"]) > 2000
        assert sum(m["role"] == "system" for m in msgs) == 1
        demo = set(_names(conv["tools"])) & set(demo_data.TOOLS)
        # A request for a demo tool the preamble does not declare is answered without a call.
        undeclared += conv["kinds"].count("no_tool")
        for i, m in enumerate(msgs):
            for tc in m.get("tool_calls") or []:
                calls += 1
                assert tc["function"]["name"] in demo
                assert msgs[i + 1]["role"] == "tool"
        assert len(conv["thinking"]) == len(conv["kinds"]) >= 10
        # It renders, the preamble first.
        text = TEMPLATE.render(msgs, add_generation_prompt=False, tools=conv["tools"])
        assert text.index(msgs[0]["content"][:40]) < text.index("<|user|>")
    assert calls > 60 and undeclared > 3


def test_the_episode_count_can_be_set_and_the_default_stream_is_unchanged():
    mix = [("arith", 1)]
    conv = demo_data.train_conversation(random.Random(0), mix=mix, episodes=12)
    assert conv["kinds"] == ["arith"] * 12
    with pytest.raises(ValueError, match="episodes"):
        demo_data.train_conversation(random.Random(0), episodes=0)
    a = [demo_data.train_conversation(random.Random(s)) for s in range(30)]
    b = [demo_data.train_conversation(random.Random(s), episodes=None) for s in range(30)]
    assert a == b


def test_long_eval_items_keep_the_expectations_and_share_preambles_in_groups():
    def count(p: dict) -> int:
        return _chars(p) // 2

    for task in demo_data.EVAL_TASKS:
        short = demo_data.eval_items(task, 12, 7)
        long = demo_preamble.long_eval_items(task, 12, 7, 3000, count, group=5)
        assert len(long) == len(short)
        for s, lg in zip(short, long, strict=True):
            assert lg["expect"] == s["expect"] and lg["thinking"] == s["thinking"]
            assert [m for m in s["messages"] if m["role"] != "system"] == lg["messages"][1:]
            assert set(demo_data.TOOLS) <= set(_names(lg["tools"]))
            assert abs(lg["preamble_tokens"] - 3000) <= 150
        for i in range(12):
            same = long[(i // 5) * 5]
            assert long[i]["tools"] == same["tools"]
            assert long[i]["messages"][0] == same["messages"][0]
        assert long[0]["messages"][0] != long[5]["messages"][0]
    assert demo_preamble.long_eval_items("arith", 4, 7, 2000, count) == (
        demo_preamble.long_eval_items("arith", 4, 7, 2000, count)
    )


def test_no_loss_falls_on_the_preamble():
    """Through the training script's encoder: the preamble conditions, only the answers after
    it carry loss."""
    import importlib.util
    import sys

    from tokenizers import Tokenizer

    root = Path(__file__).resolve().parents[1]
    spec = importlib.util.spec_from_file_location(
        "train_demo_model", root / "scripts" / "train_demo_model.py"
    )
    mod = importlib.util.module_from_spec(spec)
    sys.modules["train_demo_model"] = mod
    spec.loader.exec_module(mod)
    tok = Tokenizer.from_file(
        str(root / "python" / "colibri" / "demo" / "model" / "tokenizer.json")
    )
    template = mod.chat_template.ChatTemplate(mod.TEMPLATE_PATH.read_text(encoding="utf-8"))
    conv = demo_preamble.long_train_conversation(random.Random(5), 6000, 8, tool_extra=3)
    ids, mask = mod.encode_conversation(tok, template, conv)
    first_user = ids.index(tok.token_to_id("<|user|>"))
    assert first_user > 2000  # ~2 characters a token
    assert not any(mask[:first_user])
    assert sum(m > 0 for m in mask) > 100
