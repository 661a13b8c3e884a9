"""The demo model's synthetic data: deterministic, held-out parts disjoint, formats as trained."""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from colibri.chat.template import ChatTemplate
from colibri.demo import data as demo_data
from colibri.demo.eval import parse_answer, parse_call, score, split_output

TEMPLATE = ChatTemplate(
    (Path(demo_data.__file__).parents[1] / "chat" / "templates" / "glm45.jinja").read_text("utf-8")
)


def _convs(seed: int, n: int) -> list[dict]:
    rng = random.Random(seed)
    return [demo_data.train_conversation(rng) for _ in range(n)]


def test_training_conversations_are_deterministic_for_a_seed():
    assert _convs(3, 50) == _convs(3, 50)
    assert _convs(3, 50) != _convs(4, 50)


def test_eval_items_are_deterministic_for_a_seed():
    for task in demo_data.EVAL_TASKS:
        assert demo_data.eval_items(task, 20, 7) == demo_data.eval_items(task, 20, 7)
    assert demo_data.eval_items("arith", 20, 7) != demo_data.eval_items("arith", 20, 8)


def test_unknown_task_is_refused():
    with pytest.raises(ValueError, match="unknown task"):
        demo_data.eval_items("poetry", 1, 0)


def _user_texts(conv: dict) -> list[str]:
    return [m["content"] for m in conv["messages"] if m["role"] == "user"]


def test_training_never_adds_an_eval_pair():
    seen = 0
    for conv in _convs(11, 1500):
        for m in conv["messages"]:
            if m["role"] == "assistant" and m.get("reasoning_content", "").count(" + ") >= 3:
                # the trace ends "A + B = S."; the pair is in it
                last = m["reasoning_content"].rsplit(". ", 1)[-1]
                a, b = (int(x) for x in last.split(" = ")[0].split(" + "))
                assert not demo_data.is_eval_pair(a, b)
                seen += 1
    assert seen > 50
    # About a tenth of the pairs of 2-digit numbers are held out.
    assert 350 < len(demo_data.EVAL_PAIRS) < 450


def test_eval_arithmetic_uses_only_held_out_pairs():
    for item in demo_data.eval_items("arith", 100, 7):
        q = item["messages"][-1]["content"]
        nums = [int(x) for x in "".join(c if c.isdigit() else " " for c in q).split()]
        assert len(nums) == 2 and demo_data.is_eval_pair(*nums)
        assert item["expect"] == {"answer": str(sum(nums))}


def test_capital_eval_phrasings_are_held_out():
    assert not set(demo_data.CAPITAL_EVAL_QUESTIONS) & set(demo_data.CAPITAL_TRAIN_QUESTIONS)
    train_questions = {q for c in _convs(5, 1500) for q in _user_texts(c)}
    for item in demo_data.eval_items("capital", 50, 7):
        assert item["messages"][-1]["content"] not in train_questions
    assert len(demo_data.CAPITALS) == 50


def test_eval_cities_never_occur_in_training():
    train = demo_data.all_train_cities()
    assert not set(demo_data.EVAL_CITIES) & train
    generated = demo_data.eval_city_names(200, 7)
    assert len(set(generated)) == 200 and not set(generated) & train
    text = json.dumps(_convs(9, 1500), ensure_ascii=False)
    for item in demo_data.eval_items("tool_call", 100, 7):
        args = item["expect"]["call"]["arguments"]
        if "city" in args:
            assert f'"{args["city"]}"' not in text, args["city"]


def test_tool_items_name_the_source_of_their_city():
    real = set(demo_data.EVAL_CITIES)
    generated = set(demo_data.eval_city_names(200, 7))
    seen = set()
    for item in demo_data.eval_items("tool_call", 200, 7):
        city = item["expect"]["call"]["arguments"].get("city")
        expected = "no city" if city is None else "real" if city in real else "generated"
        assert item["source"] == expected
        if expected == "generated":
            assert city in generated
        seen.add(item["source"])
    assert seen == {"real", "generated", "no city"}
    answers = demo_data.eval_items("tool_answer", 40, 7)
    assert {it["source"] for it in answers} == {"real", "no city"}  # real names come first
    for task in ("arith", "capital", "chat"):
        assert all("source" not in it for it in demo_data.eval_items(task, 5, 7))


def test_some_eval_cities_are_not_ascii():
    cities = [
        item["expect"]["call"]["arguments"].get("city", "")
        for item in demo_data.eval_items("tool_call", 200, 7)
    ]
    assert any(not c.isascii() for c in cities)


def test_tool_calls_render_in_the_trained_glm45_shape():
    msgs = [
        {"role": "user", "content": "What's the weather in Lisbon?"},
        demo_data.tool_call_message("get_weather", {"city": "Lisbon"}, None),
    ]
    tools = [demo_data.TOOLS["get_weather"]]
    prompt = TEMPLATE.render(
        msgs[:1], add_generation_prompt=True, tools=tools, enable_thinking=False
    )
    full = TEMPLATE.render(msgs, add_generation_prompt=False, tools=tools)
    assert prompt.endswith("<|assistant|>\n<think></think>")
    assert full == prompt + (
        "\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Lisbon</arg_value>"
        "\n</tool_call>"
    )
    assert '{"type": "function", "function": {"name": "get_weather"' in prompt


def test_numbers_render_as_json_arguments():
    msg = demo_data.tool_call_message(
        "convert_currency", {"amount": 12.5, "from_currency": "USD", "to_currency": "EUR"}, None
    )
    text = TEMPLATE.render([{"role": "user", "content": "x"}, msg], add_generation_prompt=False)
    assert "<arg_key>amount</arg_key>\n<arg_value>12.5</arg_value>" in text
    assert demo_data.arg_text(12.5) == "12.5" and demo_data.arg_text("USD") == "USD"


def test_every_training_turn_has_a_generation_prompt_prefix():
    """Each assistant turn renders in history exactly as the generation prompt plus the output
    the model is trained to produce (thinking on or off as flagged)."""
    for conv in _convs(21, 300):
        msgs, turn = conv["messages"], 0
        assert len(conv["thinking"]) == sum(m["role"] == "assistant" for m in msgs)
        for i, m in enumerate(msgs):
            if m["role"] != "assistant":
                continue
            think = conv["thinking"][turn]
            turn += 1
            assert bool(m.get("reasoning_content")) == think
            prompt = TEMPLATE.render(
                msgs[:i], add_generation_prompt=True, tools=conv["tools"], enable_thinking=think
            )
            upto = TEMPLATE.render(msgs[: i + 1], add_generation_prompt=False, tools=conv["tools"])
            assert upto.startswith(prompt)
            out = upto[len(prompt) :]
            if think:
                assert prompt.endswith("<|assistant|>") and out.startswith("\n<think>")
            else:
                assert prompt.endswith("<|assistant|>\n<think></think>")
            assert out.split("</think>")[-1].startswith("\n")
            if m.get("tool_calls"):
                name = m["tool_calls"][0]["function"]["name"]
                assert conv["tools"] and name in [t["function"]["name"] for t in conv["tools"]]
                assert i + 1 == len(msgs) or msgs[i + 1]["role"] == "tool"


def test_the_task_mix_covers_every_kind():
    convs = _convs(2, 600)
    assert any(c["tools"] for c in convs) and any(not c["tools"] for c in convs)
    assert any(any(c["thinking"]) for c in convs) and any(not all(c["thinking"]) for c in convs)
    roles = {m["role"] for c in convs for m in c["messages"]}
    assert roles == {"system", "user", "assistant", "tool"}
    assert any(len(c["thinking"]) >= 3 for c in convs)


def test_addition_trace_carries():
    assert demo_data.addition_trace(37, 48) == ("7 + 8 = 15, carry 1. 3 + 4 + 1 = 8. 37 + 48 = 85.")
    assert demo_data.addition_trace(99, 99).endswith("9 + 9 + 1 = 19. 99 + 99 = 198.")


def test_scoring_accepts_the_trained_shapes_only():
    call = {
        "task": "tool_call",
        "thinking": False,
        "expect": {"call": {"name": "get_weather", "arguments": {"city": "Łódź"}}},
    }
    good = (
        "\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Łódź</arg_value>"
        "\n</tool_call><|observation|>"
    )
    assert score(call, good)
    assert not score(call, good.replace("Łódź", "Lodz"))
    assert not score(call, good.replace("<|observation|>", "<|user|>"))
    assert score(dict(call, thinking=True), "\n<think>I will call it.</think>" + good)
    assert not score(dict(call, thinking=True), good)
    ans = {"task": "arith", "thinking": False, "expect": {"answer": "85"}}
    assert score(ans, "\n85<|user|>") and score(ans, "\n85<|endoftext|>")
    assert not score(ans, "\n85") and not score(ans, "\n850<|user|>")
    assert not score(ans, "\n85\n<tool_call>x<|user|>")
    assert split_output("\n<think>a</think>\nb", True) == ("a", "\nb")
    assert parse_answer("\nIt is 21.<|user|>") == "It is 21."
    assert parse_call("\n<tool_call>f\n</tool_call><|observation|>") == {
        "name": "f",
        "arguments": {},
    }
    contains = {"task": "tool_answer", "thinking": False, "expect": {"contains": ["21", "Lisbon"]}}
    assert score(contains, "\nIn Lisbon it is 21 degrees and sunny.<|user|>")
    assert not score(contains, "\nIn Lisbon it is 12 degrees.<|user|>")


def _shipped_pieces(
    short_p: float = 0.0, share: float | None = None, near_miss: float = 0.0, drill: float = 0.0
) -> demo_data.NamePieces:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(Path(demo_data.__file__).parent / "model" / "tokenizer.json"))
    return demo_data.NamePieces(
        [tok.decode([i]) for i in range(tok.get_vocab_size())],
        short_p=short_p,
        share=share,
        near_miss=near_miss,
        drill=drill,
    )


def test_piece_names_use_every_letter_piece_and_never_an_eval_city():
    pieces = _shipped_pieces()
    rng = random.Random(0)
    names = [pieces.name(rng) for _ in range(20000)]
    held_out = set(demo_data.EVAL_CITIES) | set(demo_data.eval_city_names(200, 7))
    assert not set(names) & held_out
    assert all(n[0].isupper() and n.isalpha() and len(n) >= 3 for n in names)
    starts = {p for p in pieces.initial if any(n.startswith(p) for n in names[:5000])}
    assert len(starts) > 0.9 * len(pieces.initial)
    inner = "".join(names)
    assert all(p in inner for p in pieces.inner)


def _strung_share(pieces: demo_data.NamePieces, seed: int) -> float:
    """Share of the tool-call cities of 300 training conversations that no list holds."""
    rng_a, rng_b = random.Random(seed), random.Random(seed)
    with_pieces = [demo_data.train_conversation(rng_a, pieces) for _ in range(300)]
    assert with_pieces == [demo_data.train_conversation(rng_b, pieces) for _ in range(300)]
    cities = [
        tc["function"]["arguments"]["city"]
        for c in with_pieces
        for m in c["messages"]
        for tc in m.get("tool_calls") or []
        if "city" in tc["function"]["arguments"]
    ]
    known = demo_data.all_train_cities()
    return sum(c not in known for c in cities) / len(cities)


def test_piece_names_reach_the_training_conversations():
    # About PIECE_NAME_P (0.4) of the cities are strung from pieces by default (a few by chance
    # equal known ones); a share given to NamePieces replaces it.
    p = demo_data.PIECE_NAME_P
    assert p - 0.15 < _strung_share(_shipped_pieces(), 5) < p + 0.15
    assert 0.6 < _strung_share(_shipped_pieces(share=0.8), 5) < 0.95
    assert _strung_share(_shipped_pieces(share=0.0), 5) == 0.0


def test_name_pieces_need_both_cases():
    with pytest.raises(ValueError, match="capitalised"):
        demo_data.NamePieces(["abc", "de"])


def test_short_pieces_shape_names_and_leave_the_default_stream_alone():
    short = _shipped_pieces(short_p=1.0)
    assert short.short_inner and all(len(p) <= 2 for p in short.short_inner)
    rng = random.Random(3)
    for _ in range(500):
        name = short.name(rng)
        # A lone capital, then at most 3 pieces of at most two letters each.
        assert name[0] in short.short_initial and name[1:].islower() and len(name) <= 7
    # Off (the default), names take exactly the draws they took before short pieces existed,
    # so the shipped model's recipe still reproduces: one length, then uniform pieces.
    default = _shipped_pieces()
    a, b = random.Random(9), random.Random(9)
    held_out = set(demo_data.EVAL_CITIES) | set(
        demo_data.eval_city_names(1000, demo_data.EVAL_SEED)
    )
    for _ in range(200):
        while True:
            n = b.choice([1, 2, 2, 3, 3, 4])
            word = b.choice(default.initial) + "".join(
                b.choice(default.inner) for _ in range(n - 1)
            )
            if len(word) >= 3 and word not in held_out:
                break
        assert default.name(a) == word


_NEAR_MISS = _shipped_pieces(near_miss=0.5)
_KNOWN = demo_data.all_train_cities()


@settings(max_examples=300, deadline=None)
@given(st.integers(min_value=0, max_value=2**32))
def test_near_miss_names_start_like_a_known_name_and_are_never_held_out(seed):
    name = _NEAR_MISS.near_miss_name(random.Random(seed))
    assert len(name) >= 3 and name[-1].isalpha()
    assert any(k.startswith(name[:2]) for k in _KNOWN)
    assert name not in set(demo_data.EVAL_CITIES)
    assert name not in set(demo_data.eval_city_names(1000, demo_data.EVAL_SEED))


def test_near_misses_reach_the_training_conversations_only_when_asked():
    rng = random.Random(4)
    names = [_NEAR_MISS.near_miss_name(rng) for _ in range(2000)]
    # Most are new names; some end early, some run on past the known name they start like.
    assert sum(n not in _KNOWN for n in names) > 0.9 * len(names)
    assert any(any(k.startswith(n) and k != n for k in _KNOWN) for n in names[:200])
    # Half the unstrung cities, on top of the 40% strung: the strung-or-new share rises.
    assert _strung_share(_NEAR_MISS, 5) > _strung_share(_shipped_pieces(), 5) + 0.15


def test_every_assistant_turn_names_its_task():
    seen = set()
    for conv in _convs(11, 400):
        assistant = [m for m in conv["messages"] if m["role"] == "assistant"]
        assert len(conv["kinds"]) == len(assistant) == len(conv["thinking"])
        for kind, msg in zip(conv["kinds"], assistant, strict=True):
            assert kind in demo_data.TURN_KINDS
            assert (kind == "tool_call") == bool(msg.get("tool_calls"))
        seen.update(conv["kinds"])
    # Copy drills come only with strung names (``NamePieces.drill``).
    assert seen == set(demo_data.TURN_KINDS) - {"drill"}


def test_trailing_phrasings_are_opt_in_and_never_eval_phrasings():
    trailing = demo_data.WEATHER_TRAILING_QUESTIONS + demo_data.TIME_TRAILING_QUESTIONS
    evals = demo_data.WEATHER_EVAL_QUESTIONS + demo_data.TIME_EVAL_QUESTIONS
    assert not set(trailing) & set(evals)
    # Words follow the city in every one, and none of them is the evaluation's "right now".
    assert all(not q.split("{city}")[1][0].isalnum() and "right" not in q for q in trailing)
    assert all(q.split("{city}")[1].strip(" ?.") for q in trailing)

    def questions(rng: random.Random, on: bool) -> list[str]:
        return [
            m["content"]
            for _ in range(300)
            for m in demo_data.train_conversation(rng, None, on)["messages"]
            if m["role"] == "user"
        ]

    shapes = [re.compile(re.escape(q).replace(re.escape("{city}"), ".+")) for q in trailing]
    assert any(r.fullmatch(q) for q in questions(random.Random(2), True) for r in shapes)
    assert not any(r.fullmatch(q) for q in questions(random.Random(2), False) for r in shapes)
    # Off, the stream is exactly the one before these phrasings existed.
    assert questions(random.Random(6), False) == [
        m["content"] for c in _convs(6, 300) for m in c["messages"] if m["role"] == "user"
    ]


def test_copy_drills_say_strung_names_back_only_when_asked():
    held_out = set(demo_data.EVAL_CITIES) | set(
        demo_data.eval_city_names(1000, demo_data.EVAL_SEED)
    )
    drills = _shipped_pieces(drill=0.3)
    convs = [demo_data.train_conversation(random.Random(i), drills) for i in range(200)]
    said = 0
    for conv in convs:
        assistant = [m for m in conv["messages"] if m["role"] == "assistant"]
        for kind, msg in zip(conv["kinds"], assistant, strict=True):
            if kind == "drill":
                names = msg["content"].split(", ")
                assert 2 <= len(names) <= 4 and not set(names) & held_out
                assert all(n[0].isupper() and n.isalpha() for n in names)
                said += 1
    assert said > 50
    # Run 21's drills ("Please repeat these names exactly: ...") captured the held-out "Please
    # name the capital of X.": no drill phrasing starts like a held-out question or says "name".
    held = demo_data.CAPITAL_EVAL_QUESTIONS + demo_data.WEATHER_EVAL_QUESTIONS
    for q in demo_data.COPY_DRILL_QUESTIONS:
        assert "name" not in q.replace("{names}", "").lower()
        assert all(q.split()[0] != h.split()[0] for h in held)
    # Off (the default), no episode becomes a drill and the stream is the one before drills.
    off = [demo_data.train_conversation(random.Random(i), _shipped_pieces()) for i in range(50)]
    assert all("drill" not in c["kinds"] for c in off)


def test_the_addition_weight_reweighs_only_the_sums():
    assert demo_data.train_mix() == demo_data.TRAIN_MIX
    heavier = dict(demo_data.train_mix(60))
    assert heavier["arith"] == 60
    assert {t: w for t, w in heavier.items() if t != "arith"} == {
        t: w for t, w in demo_data.TRAIN_MIX if t != "arith"
    }
    with pytest.raises(ValueError, match="addition weight"):
        demo_data.train_mix(-1)

    def sums(mix) -> int:
        rng = random.Random(3)
        convs = [demo_data.train_conversation(rng, mix=mix) for _ in range(400)]
        return sum(c["kinds"].count("arith") for c in convs)

    # The default mix is the stream as it was; a heavier weight draws more sums.
    assert [demo_data.train_conversation(random.Random(i)) for i in range(20)] == [
        demo_data.train_conversation(random.Random(i), mix=demo_data.TRAIN_MIX) for i in range(20)
    ]
    assert sums(demo_data.train_mix(76)) > 1.3 * sums(demo_data.TRAIN_MIX)


def test_extra_episodes_join_only_conversations_that_declare_tools():
    def convs(extra: int) -> list[dict]:
        rng = random.Random(5)
        return [demo_data.train_conversation(rng, tool_extra=extra) for _ in range(300)]

    def turns(cs: list[dict], with_tools: bool) -> float:
        picked = [len(c["kinds"]) for c in cs if bool(c["tools"]) == with_tools]
        return sum(picked) / len(picked)

    plain, extra = convs(0), convs(3)
    # Off (the default) is the stream as it was: the same draws as a call without the argument.
    rng = random.Random(5)
    assert plain == [demo_data.train_conversation(rng) for _ in range(300)]
    # On: conversations under tool declarations carry more answers; the others do not change
    # in kind (their length is drawn as before).
    assert turns(extra, True) > turns(plain, True) + 2
    assert abs(turns(extra, False) - turns(plain, False)) < 0.5
    # Every call is answered: no conversation stops at a call, so the episodes after it are kept.
    ends_on_call = [c for c in plain if c["messages"][-1].get("tool_calls")]
    assert ends_on_call
    for c in extra:
        for i, m in enumerate(c["messages"]):
            if m.get("tool_calls"):
                assert c["messages"][i + 1]["role"] == "tool"
    with pytest.raises(ValueError, match="tool_extra"):
        demo_data.train_conversation(random.Random(0), tool_extra=-1)
