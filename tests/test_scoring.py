"""Scoring without generation: the engine's option log-probabilities against the log-softmax
of its own logits on every fixture family, and the formulas that turn them into choices."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from colibri import Engine
from colibri.scoring.maths import confidence, entropy, ranked, softmax
from colibri.scoring.prompts import (
    question_prompt,
    question_read,
    schema_cell_prompt,
    schema_read,
    state_prefix,
    value_continuation,
)


def log_softmax(row: np.ndarray) -> np.ndarray:
    row = row.astype(np.float64)
    top = row.max()
    return row - top - np.log(np.exp(row - top).sum())


def expected(eng: Engine, context: list[int], option: list[int]) -> float:
    logits = eng.logits(context + option)
    return float(sum(log_softmax(logits[len(context) - 1 + i])[t] for i, t in enumerate(option)))


def test_scores_equal_the_log_softmax_of_the_logits(reference, converted):
    """Within 1e-5 on every family, options of 1..5 tokens, in a private history and in a
    slot whose history already holds the context (nothing prefilled again)."""
    eng = Engine(converted(reference.arch, "f32"), slots=1)
    vocab = eng.info["vocab_size"]
    context = [(i * 37 + 11) % vocab for i in range(30)]
    options = [[(i * 13 + k) % vocab for i in range(k + 1)] for k in range(5)]
    want = [expected(eng, context, o) for o in options]
    private = eng.score(context, options).run()
    first = eng.score(context, options, slot=0)
    in_slot = first.run()
    assert first.reused_tokens == 0
    again = eng.score(context, options, slot=0)
    reused = again.run()
    assert again.reused_tokens == len(context) - 1
    assert eng.slot_info(0)["tokens"] == context
    for got in (private, in_slot, reused):
        assert [n for _, n in got] == [len(o) for o in options]
        for (lp, _), w in zip(got, want, strict=True):
            assert abs(lp - w) <= 1e-5 * max(1.0, abs(w)), (reference.arch, lp, w)


def test_a_question_after_a_scored_state_reuses_the_state(converted):
    eng = Engine(converted("olmoe", "f32"), slots=1)
    state = list(range(1, 41))
    eng.score(state, [[5]], slot=0).run()
    s = eng.score(state + [7, 8, 9], [[5], [6, 2]], slot=0)
    got = s.run()
    assert s.reused_tokens == len(state)
    for (lp, _), o in zip(got, [[5], [6, 2]], strict=True):
        assert abs(lp - expected(eng, state + [7, 8, 9], o)) <= 1e-5 * max(1.0, abs(lp))


def _same(a: list, b: list, exact: bool) -> bool:
    """Scores equal: to the bit, or (not ``exact``) within f32 rounding."""
    if exact:
        return a == b
    close = [abs(x - y) <= 1e-5 * max(1.0, abs(y)) for (x, _), (y, _) in zip(a, b, strict=True)]
    return [t for _, t in a] == [t for _, t in b] and all(close)


# The fixtures whose prefill may take MLA's expanded form: a prompt's logits then depend on how
# it is cut into passes, within f32 rounding (COLI_MLA_EXPANDED=off: to the bit).
EXPANDS = {"deepseek_v3", "deepseek_v3_noqlora", "kimi_linear", "kimi_linear_lora"}


def test_several_questions_in_one_scoring_equal_each_alone(reference, converted, monkeypatch):
    """One state, three questions of their own tokens and options of 1..3 tokens: one
    score_many gives exactly each question's scores alone, on every family, int4 and f32 (with
    MLA's expanded prefill, within f32 rounding; without it, exactly); the slot keeps the first
    question's context, and the state is reused the next time."""
    settings = ["on", "off"] if reference.arch in EXPANDS else ["on"]
    for expanded, quant in [(e, q) for e in settings for q in ("int4", "f32")]:
        monkeypatch.setenv("COLI_MLA_EXPANDED", expanded)
        eng = Engine(converted(reference.arch, quant), slots=1)
        vocab = eng.info["vocab_size"]
        state = [(i * 37 + 11) % vocab for i in range(30)]
        questions = [
            (state + [(k * 7 + j) % vocab for j in range(k + 2)], [[k + 1], [k + 2, 3], [5, 6, 7]])
            for k in range(3)
        ]
        alone = [x for c, o in questions for x in eng.score(c, o).run()]
        s = eng.score_many(questions, slot=0)
        got = s.run()
        assert s.reused_tokens == 0
        exact = reference.arch not in EXPANDS or expanded == "off"
        assert _same(got, alone, exact), (reference.arch, quant, expanded)
        assert eng.slot_info(0)["tokens"] == questions[0][0]
        again = eng.score_many(questions, slot=0)
        assert _same(again.run(), got, exact), (reference.arch, quant, expanded)
        # The shared start (the state) comes from the slot, its last token computed again.
        assert again.reused_tokens == len(state) - 1


def test_bad_scoring_input_is_refused(converted):
    eng = Engine(converted("olmoe", "f32"), slots=1)
    with pytest.raises(ValueError, match="no tokens"):
        eng.score([], [[1]])
    with pytest.raises(ValueError, match="no options"):
        eng.score([1], [])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        eng.score([1, 2], [[eng.info["vocab_size"]]]).run()


scores = st.lists(
    st.floats(min_value=-1e4, max_value=1e4, allow_nan=False), min_size=1, max_size=64
)


@given(scores)
def test_softmax_sums_to_one_and_keeps_the_order(s):
    p = softmax(s)
    assert math.isclose(sum(p), 1.0, rel_tol=1e-9)
    assert all(0.0 <= x <= 1.0 for x in p)
    order = ranked(p)
    assert sorted(order) == list(range(len(s)))
    assert all(p[a] >= p[b] for a, b in zip(order, order[1:], strict=False))
    assert 0.0 <= entropy(p) <= 1.0 + 1e-6
    assert 0.0 <= confidence(p) <= 1.0 + 1e-9


@given(scores, st.randoms(use_true_random=False))
def test_option_order_does_not_change_the_probabilities(s, rnd):
    perm = list(range(len(s)))
    rnd.shuffle(perm)
    p, q = softmax(s), softmax([s[i] for i in perm])
    for j, i in enumerate(perm):
        assert math.isclose(q[j], p[i], rel_tol=1e-9, abs_tol=1e-300)


@given(st.lists(st.floats(min_value=-50, max_value=50), min_size=2, max_size=16))
def test_a_high_temperature_gives_the_uniform_distribution(s):
    p = softmax(s, temperature=1e9)
    assert all(math.isclose(x, 1 / len(s), rel_tol=1e-6) for x in p)
    assert entropy(p) == pytest.approx(1.0, abs=1e-6)
    assert confidence(p) == pytest.approx(0.0, abs=1e-6)


def test_entropy_and_confidence_at_the_extremes():
    assert entropy([1.0, 0.0, 0.0]) == 0.0
    assert entropy([0.5, 0.5]) == 1.0
    assert confidence([1.0, 0.0, 0.0, 0.0]) == 1.0
    assert confidence([1.0]) == 1.0
    assert confidence([0.25] * 4) == 0.0
    # Ties keep the input order.
    assert ranked([0.2, 0.4, 0.4]) == [1, 2, 0]


def test_prompts_have_the_documented_shape():
    assert state_prefix("") == ""
    assert question_prompt("doc", "Why?") == "Context:\ndoc\n\nQuestion: Why?\nAnswer:"
    assert question_prompt("", None) == "Answer:"
    cell = schema_cell_prompt("doc", "triage", [("team", 'we"b')], "urgent")
    assert cell == 'Context:\ndoc\n\nTask: triage\n{"team": "we\\"b", "urgent": "'
    assert value_continuation('a"b') == 'a\\"b"'
    # The chat form: the state as the system message, the question as the user's.
    read = question_read("doc", "Why?")
    assert (read.system, read.user, read.reply) == ("doc", "Why?", "")
    assert read.continuation("yes") == " yes"
    assert question_read("doc", None).user == "doc"
    cell_read = schema_read("doc", None, [], "team")
    assert cell_read.reply == '{"team": "' and cell_read.user == "Fill in the JSON object."
