"""``POST /v1/systemone`` (the Jev question contract) and ``POST /v1/rank`` (the CLM rank
route) end to end: the real server on the demo model, raw HTTP."""

from __future__ import annotations

import re

import httpx
import pytest

from .server import RunningServer

CAPITALS = [
    "The capital of Portugal is Lisbon.",
    "The capital of Spain is Madrid.",
    "The capital of France is Paris.",
    "The capital of Italy is Rome.",
]


@pytest.fixture(scope="module")
def server():
    srv = RunningServer(default_model=True)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


def engine_calls(http: httpx.Client) -> float:
    text = http.get("/metrics").text
    m = re.search(
        r'^colibri_scheduler_engine_call_seconds_count\{model="[^"]+"\} (\S+)$', text, re.M
    )
    return float(m.group(1)) if m else 0.0


def test_the_three_question_types(http):
    r = http.post(
        "/v1/systemone",
        json={
            "model": "jev-latest",
            "state": {"ticket": "The login page is down.", "customer": "Zoë"},
            "questions": {
                "true": {"type": "noul", "criteria": {"true": "it is about login"}},
                "team": {"type": "choice", "criteria": {"web": "the website", "db": None}},
                "severity": {"type": "score", "criteria": ["low", "mid", "", "critical"]},
            },
        },
    )
    assert r.status_code == 200, r.text
    d = r.json()
    assert d["model"] == "colibri-demo" and d["provider"] == "colibri"
    assert re.fullmatch(r"req_[0-9a-f]{32}", d["id"])
    assert r.headers["x-typesafe-request-id"] == d["id"]
    assert list(d["answers"]) == ["true", "team", "severity"]
    noul, choice, score = d["answers"]["true"], d["answers"]["team"], d["answers"]["severity"]
    assert noul["type"] == "noul" and 0.0 <= noul["noul"] <= 1.0 and "confidence" not in noul
    assert choice["type"] == "choice" and list(choice["probabilities"]) == ["web", "db"]
    probs = choice["probabilities"]
    assert choice["choice"] == max(probs, key=probs.get)
    assert sum(probs.values()) == pytest.approx(1.0, abs=1e-5)
    n = len(probs)
    assert choice["confidence"] == pytest.approx(
        max(0, (n * max(probs.values()) - 1) / (n - 1)), abs=1e-5
    )
    assert list(score["legend"]) == ["0", "1", "2", "3"]
    assert score["legend"] == {"0": "low", "1": "mid", "2": "", "3": "critical"}
    sp = score["probabilities"]
    assert score["score"] == pytest.approx(sum(int(k) * p for k, p in sp.items()), abs=1e-5)
    assert set(d["usage"]) == {"input_tokens", "output_tokens", "cost"}
    assert d["usage"]["output_tokens"] > 0 and d["usage"]["cost"] == 0


def test_one_label_questions_are_answered_without_the_engine(http):
    before = engine_calls(http)
    r = http.post(
        "/v1/systemone",
        json={
            "state": "anything",
            "questions": {
                "c": {"type": "choice", "criteria": {"only": None}},
                "s": {"type": "score", "criteria": ["one level"]},
            },
        },
    )
    assert r.status_code == 200, r.text
    a = r.json()["answers"]
    assert a["c"] == {
        "type": "choice",
        "choice": "only",
        "probabilities": {"only": 1.0},
        "confidence": 1.0,
    }
    assert a["s"]["score"] == 0.0 and a["s"]["confidence"] == 1.0
    assert engine_calls(http) == before


def test_an_empty_state_reads_no_context(http):
    r = http.post(
        "/v1/systemone",
        json={"state": "", "questions": {"q": {"type": "noul", "instructions": "Is 2 > 1?"}}},
    )
    assert r.status_code == 200, r.text


@pytest.mark.parametrize(
    ("body", "param", "loc"),
    [
        ({"questions": {"q": {"type": "noul"}}}, "state", ["body", "state"]),
        ({"state": 3, "questions": {"q": {"type": "noul"}}}, "state", ["body", "state"]),
        ({"state": "s", "questions": {}}, "questions", ["body", "questions"]),
        (
            {"state": "s", "questions": {"q": {"type": "guess"}}},
            "questions.q.type",
            ["body", "questions", "q", "type"],
        ),
        (
            {"state": "s", "questions": {"q": {"type": "score", "criteria": ["fine", 3]}}},
            "questions.q.criteria[1]",
            ["body", "questions", "q", "criteria", 1],
        ),
        (
            {"state": "s", "questions": {"q": {"type": "choice", "criteria": {}}}},
            "questions.q.criteria",
            ["body", "questions", "q", "criteria"],
        ),
        (
            {"state": "s", "questions": {" ": {"type": "noul"}}},
            "questions. ",
            ["body", "questions", " "],
        ),
        (
            {"state": "s", "questions": {"q": {"type": "noul"}}, "normalize": "max"},
            "normalize",
            ["body", "normalize"],
        ),
        (
            {"state": "s", "questions": {"q": {"type": "noul"}}, "extra": 1},
            "extra",
            ["body", "extra"],
        ),
    ],
)
def test_systemone_refusals_are_422_with_detail(http, body, param, loc):
    r = http.post("/v1/systemone", json=body)
    assert r.status_code == 422, r.text
    d = r.json()
    assert d["error"]["param"] == param
    assert d["detail"][0]["loc"] == loc and d["detail"][0]["type"] == "value_error"


def test_rank_orders_the_candidates(http):
    r = http.post(
        "/v1/rank",
        json={
            "context": "We talk about Europe.",
            "question": "What is the capital of Italy?",
            "answers": [CAPITALS[1], CAPITALS[3], CAPITALS[1]],
        },
    )
    assert r.status_code == 200, r.text
    d = r.json()
    assert d["model"] == "colibri-demo"
    ranked = d["ranked"]
    assert [x["rank"] for x in ranked] == [1, 2, 3]
    assert ranked[0]["candidate"] == CAPITALS[3]
    assert [x["candidate"] for x in ranked].count(CAPITALS[1]) == 2  # duplicates kept
    probs = [x["prob"] for x in ranked]
    assert probs == sorted(probs, reverse=True) and sum(probs) == pytest.approx(1.0)
    assert float(r.headers["X-CLM-Latency-Ms"]) > 0


def test_a_high_temperature_flattens_the_ranking(http):
    body = {"question": "What is the capital of Italy?", "answers": CAPITALS[2:]}
    sharp = http.post("/v1/rank", json=body).json()["ranked"]
    flat = http.post("/v1/rank", json={**body, "temperature": 100}).json()["ranked"]
    assert flat[0]["prob"] < sharp[0]["prob"]
    assert flat[0]["candidate"] == sharp[0]["candidate"]


@pytest.mark.parametrize(
    "body",
    [
        {"answers": []},
        {"answers": [""]},
        {"answers": "a"},
        {"answers": ["a"], "temperature": 0},
        {"answers": ["a"], "temperature": 101},
        {"answers": ["a"], "temperature": "hot"},
    ],
)
def test_rank_refusals_are_422(http, body):
    r = http.post("/v1/rank", json=body)
    assert r.status_code == 422, r.text
    assert r.json()["detail"]


def test_rank_limits(http):
    r = http.post("/v1/rank", json={"answers": [f"a{i}" for i in range(257)]})
    assert r.status_code == 413 and r.json()["error"]["code"] == "clm_too_many_candidates"
    assert r.headers["x-should-retry"] == "false"
    r = http.post("/v1/rank", content=b"{not json")
    assert r.status_code == 422
    # 200 answers of ~200 tokens each: more than 32768 tokens to read.
    r = http.post(
        "/v1/rank", json={"question": "q", "answers": [f"{i} " + "w " * 100 for i in range(200)]}
    )
    assert r.status_code == 413 and r.json()["error"]["code"] == "too_many_tokens", r.text
    assert r.headers["x-should-retry"] == "false"


def test_rank_refuses_a_context_longer_than_the_servers():
    """The demo model's context (32,768) is the request's token cap too, so a context that
    overflows it is refused as too many tokens (above); under a lowered --context, the
    context's own refusal."""
    srv = RunningServer("--context", "2048", "--no-kv-persist", default_model=True)
    try:
        r = httpx.post(
            srv.url + "/v1/rank", json={"context": "word " * 3000, "answers": ["a", "b"]}
        )
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
        assert r.headers["x-should-retry"] == "false"
    finally:
        srv.stop()


def test_models_list_has_jev_models(http):
    d = http.get("/v1/models").json()
    assert d["data"][0]["id"] == "colibri-demo"
    assert d["models"][0]["name"] == "colibri-demo"
    assert set(d["models"][0]) == {"name", "description", "release_date"}
