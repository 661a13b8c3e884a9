"""``POST /v1/brio`` end to end: the real server on the demo model, raw HTTP (no SDK has the
route). The demo model knows the capitals it was trained on; the choice must depend on the
question, not just on the options' own text."""

from __future__ import annotations

import re
import time

import httpx
import pytest

from .server import RunningServer

MODEL = "colibri-demo"
CAPITALS = [
    "The capital of Portugal is Lisbon.",
    "The capital of Spain is Madrid.",
    "The capital of France is Paris.",
    "The capital of Italy is Rome.",
]
# The demo model answers a sum with the number alone (and a capital with a sentence).
SUMS = ["85", "45", "42"]


@pytest.fixture(scope="module")
def server():
    srv = RunningServer("--kv-slots", "2", default_model=True)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


def brio(http: httpx.Client, **body) -> httpx.Response:
    body.setdefault("model", MODEL)
    return http.post("/v1/brio", json=body)


def prompt_tokens_total(http: httpx.Client) -> float:
    text = http.get("/metrics").text
    m = re.search(rf'^colibri_engine_prompt_tokens_total\{{model="{MODEL}"\}} (\S+)$', text, re.M)
    assert m, text
    return float(m.group(1))


@pytest.mark.parametrize(
    ("question", "answer"),
    [
        ("What is the capital of Portugal?", CAPITALS[0]),
        ("What is the capital of Spain?", CAPITALS[1]),
        ("What is the capital of France?", CAPITALS[2]),
        ("What is the capital of Italy?", CAPITALS[3]),
    ],
)
def test_the_right_capital_among_four(http, question, answer):
    r = brio(http, question=question, options=CAPITALS)
    assert r.status_code == 200, r.text
    d = r.json()
    assert d["object"] == "brio.choice" and d["model"] == MODEL
    assert d["id"].startswith("brio-")
    assert d["answer"] == answer
    ps = [c["p"] for c in d["choices"]]
    assert ps == sorted(ps, reverse=True) and sum(ps) == pytest.approx(1.0)
    assert {c["option"] for c in d["choices"]} == set(CAPITALS)
    assert 0.0 <= d["entropy"] <= 1.0 and d["normalize"] == "sum"
    c = d["choices"][0]
    assert c["mean_logprob"] == pytest.approx(c["logprob"] / c["tokens"])
    u = d["usage"]
    assert u["completion_tokens"] == 0
    assert u["read_tokens"] == sum(c["tokens"] for c in d["choices"])
    assert u["total_tokens"] == u["prompt_tokens"] + u["read_tokens"]
    assert float(r.headers["x-colibri-elapsed-ms"]) > 0
    assert "x-colibri-queue-wait-ms" in r.headers


@pytest.mark.parametrize(
    ("question", "answer"),
    [("What is 37 + 48?", "85"), ("What is 26 + 19?", "45"), ("What is 12 + 30?", "42")],
)
def test_the_right_sum_among_three(http, question, answer):
    r = brio(http, question=question, options=SUMS)
    assert r.status_code == 200, r.text
    d = r.json()
    assert d["answer"] == answer and d["prompt_format"] == "chat"
    assert d["entropy"] < 0.4  # confident


def test_entropy_is_lower_on_a_question_the_model_knows(http):
    def h(question: str, options: list[str], **kw) -> float:
        r = brio(http, question=question, options=options, **kw)
        assert r.status_code == 200, r.text
        return r.json()["entropy"]

    for nonsense in ("blorp fizzle wug?", "Hello"):
        assert h("What is 37 + 48?", SUMS) < h(nonsense, SUMS)
        known = h("What is the capital of Portugal?", CAPITALS, normalize="mean")
        assert known < h(nonsense, CAPITALS, normalize="mean")


def test_the_text_form_reads_the_plain_prompt(http):
    """The contract's plain prompt (Question: ... Answer:), for models without chat."""
    r = brio(http, question="What is the capital of Italy?", options=CAPITALS, prompt_format="text")
    assert r.status_code == 200, r.text
    d = r.json()
    assert d["answer"] == CAPITALS[3] and d["prompt_format"] == "text"


def d_questions() -> list[dict]:
    return [
        {"question": "What is the capital of Italy?", "options": CAPITALS},
        {"question": "What is the capital of Spain?", "options": CAPITALS},
        {"question": "What is the capital of France?", "options": CAPITALS, "normalize": "mean"},
    ]


def test_questions_share_the_state_prefilled_once(http):
    state = "A long document about European geography. " * 20
    before = prompt_tokens_total(http)
    r = brio(http, state=state, questions=d_questions(), cache_slot=1)
    assert r.status_code == 200, r.text
    d = r.json()
    assert d["object"] == "brio.answers"
    assert [a["answer"] for a in d["answers"]] == [CAPITALS[3], CAPITALS[1], CAPITALS[2]]
    assert [a["normalize"] for a in d["answers"]] == ["sum", "sum", "mean"]
    assert d["answers"][0]["question"] == "What is the capital of Italy?"
    prefilled = prompt_tokens_total(http) - before
    longest = d["usage"]["prompt_tokens"]  # the state prefix and one question (~15 tokens)
    assert longest > 200
    # The state once, then only the questions' own tokens (never the state again).
    assert prefilled <= longest + 2 * 20, (prefilled, d["usage"])
    # Asked again, the slot's history (the state and the first question) is reused.
    before = prompt_tokens_total(http)
    again = brio(http, state=state, questions=d_questions(), cache_slot=1).json()
    assert [a["answer"] for a in again["answers"]] == [a["answer"] for a in d["answers"]]
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] >= longest - 20
    assert prompt_tokens_total(http) - before <= 3 * 20


def test_schema_fields_in_order_from_their_values(http):
    r = brio(
        http,
        state="Ticket: the web login page returns 500 for every user since this morning.",
        task="Triage the ticket.",
        schema={"team": ["web", "database", "billing"], "urgent": ["yes", "no"]},
    )
    assert r.status_code == 200, r.text
    d = r.json()
    assert d["object"] == "brio.schema"
    assert list(d["json"]) == ["team", "urgent"]
    assert d["json"]["team"] in ("web", "database", "billing")
    assert d["json"]["urgent"] in ("yes", "no")
    for f in d["fields"]:
        assert f["value"] == d["json"][f["field"]] == f["choices"][0]["option"]
        assert f["p"] == f["choices"][0]["p"]


def test_a_messages_state_is_accepted(http):
    r = brio(
        http,
        messages=[{"role": "user", "content": [{"type": "text", "text": "I live in Italy."}]}],
        question="What is the capital of Italy?",
        options=CAPITALS,
    )
    assert r.status_code == 200, r.text
    assert r.json()["answer"] == CAPITALS[3]


@pytest.mark.parametrize(
    ("body", "status", "param", "code"),
    [
        ({"question": "q", "options": ["a"]}, 400, "options", None),
        ({"question": "q", "options": ["a", "a"]}, 400, "options", None),
        ({"question": "q", "options": ["a", " "]}, 400, "options", None),
        ({"question": "q", "options": [f"o{i}" for i in range(65)]}, 400, "options", None),
        ({"state": "s", "options": ["a", "b"], "questions": []}, 400, "options", None),
        ({"state": "s"}, 400, "options", None),
        ({"options": ["a", "b"]}, 400, "state", None),
        ({"questions": [{"question": "q", "options": ["a", "b"]}]}, 400, "state", None),
        ({"state": 3, "options": ["a", "b"]}, 400, "state", None),
        (
            {"state": "s", "questions": [{"question": "q", "options": ["a"]}]},
            400,
            "questions[0].options",
            None,
        ),
        ({"state": "s", "schema": {"f": ["x"]}}, 400, "schema.f", None),
        ({"state": "s", "schema": {'a"b': ["x", "y"]}}, 400, 'schema.a"b', None),
        ({"state": "s", "options": ["a", "b"], "normalize": "max"}, 400, "normalize", None),
        ({"state": "s", "options": ["a", "b"], "task": "t"}, 400, "task", None),
        ({"state": "s", "options": ["a", "b"], "cache_slot": 9}, 400, "cache_slot", None),
        ({"state": "s", "options": ["a", "b"], "cache_slot": "x"}, 400, "cache_slot", None),
        ({"state": "s", "options": ["a", "b"], "prompt_format": "xml"}, 400, "prompt_format", None),
        (
            {
                "messages": [{"role": "user", "content": [{"type": "text", "text": 3}]}],
                "options": ["a", "b"],
            },
            400,
            "messages.0.content.0.text",
            None,
        ),
        (
            {"state": "s", "options": ["a", "b"], "temperature": 1},
            400,
            "temperature",
            "unknown_parameter",
        ),
        ({"model": "other", "state": "s", "options": ["a", "b"]}, 404, "model", "model_not_found"),
        # ~40k tokens: over the demo model's 32,768.
        ({"state": "word " * 20000, "options": ["a", "b"]}, 400, None, "context_length_exceeded"),
    ],
)
def test_refusals(http, body, status, param, code):
    r = brio(http, **body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == param
    if code is not None:
        assert err["code"] == code
    assert err["message"]


def test_a_client_that_goes_away_stops_the_scoring(http):
    """64 questions of 64 sentence options (seconds of work): the client gives up after a
    moment; the server stops after the engine step in flight and gives the slot back."""
    before = http.get("/health").json()
    options = [f"The capital of Portugal is Lisbon number {i}." for i in range(64)]
    body = {
        "model": MODEL,
        "state": "A note.",
        "questions": [{"question": f"Question {i}?", "options": options} for i in range(64)],
    }
    with pytest.raises(httpx.ReadTimeout):
        http.post("/v1/brio", json=body, timeout=1.0)
    deadline = time.monotonic() + 5
    while True:
        now = http.get("/health").json()
        if now["active"] == 0 and now["cancelled"] > before["cancelled"]:
            break
        assert time.monotonic() < deadline, (before, now)
        time.sleep(0.05)
    # The server goes on serving.
    r = brio(http, question="What is 37 + 48?", options=SUMS)
    assert r.status_code == 200 and r.json()["answer"] == "85"
