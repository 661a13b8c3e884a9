"""`--context N` / `COLI_CONTEXT` / `Engine(context=N)`: running a model with less context than
it allows. The built-in model's own context is 2048; these tests lower it to 256."""

from __future__ import annotations

import gc
import logging
import os
import subprocess
import sys

import openai
import pytest
from openai import OpenAI

from colibri import cli, server
from colibri.demo.builtin import builtin_model_dir
from colibri.runtime.engine import Engine

from .server import RunningServer, builtin_prompt_ids

OWN = 2048
CONTEXT = 256
MODEL = "colibri-builtin"


@pytest.fixture(scope="module")
def full():
    return Engine(builtin_model_dir(), threads=2)


@pytest.fixture(scope="module")
def small():
    return Engine(builtin_model_dir(), threads=2, context=CONTEXT)


def prompt(n: int) -> list[int]:
    return [(7 * i + 3) % 200 + 10 for i in range(n)]  # the built-in vocabulary: 265


# --- the Engine API --------------------------------------------------------------------------


def test_info_reports_the_context_in_use_and_the_models_own(full, small):
    assert full.info["context_length"] == full.info["model_context_length"] == OWN
    assert small.info["context_length"] == CONTEXT
    assert small.info["model_context_length"] == OWN
    same = Engine(builtin_model_dir(), threads=2, context=OWN)
    assert same.info["context_length"] == OWN


def test_a_lowered_context_is_the_limit_of_logits_and_generation(full, small):
    assert small.logits(prompt(CONTEXT)).shape[0] == CONTEXT
    with pytest.raises(ValueError, match=f"{CONTEXT + 1} tokens exceed the context length 256"):
        small.logits(prompt(CONTEXT + 1))
    # Generation ends at the context: 250 prompt positions + 6 fed-back tokens, and the 7th
    # token sampled from the last of them; the tokens are the full-context engine's.
    ids = prompt(250)
    out = list(small.generate(ids, 100))
    assert len(out) == CONTEXT - len(ids) + 1
    assert out == list(full.generate(ids, len(out)))
    with pytest.raises(ValueError, match="257 tokens exceed the context length 256"):
        next(small.generate(prompt(CONTEXT + 1), 1))


@pytest.mark.parametrize("n", [0, -1, OWN + 1, 10**12])
def test_a_context_out_of_range_is_refused_naming_both_numbers(n):
    want = f"context {n} is out of range: the model's context length is {OWN} (give 1 to {OWN})"
    with pytest.raises(ValueError) as e:
        Engine(builtin_model_dir(), threads=2, context=n)
    assert str(e.value) == want


def _history(kv_dir, lengths: list[int], context: int | None = None) -> list[int]:
    """Writes slot ``i`` with a history of ``lengths[i]`` tokens (a prompt of that length and one
    generated token, which is never fed back); returns what each slot then holds."""
    engine = Engine(
        builtin_model_dir(), threads=2, slots=len(lengths), kv_dir=kv_dir, context=context
    )
    for i, n in enumerate(lengths):
        stream = engine.generate(prompt(n), 1, slot=i)
        list(stream)
        stream.close()
    held = [engine.slot_info(i)["cached_tokens"] for i in range(len(lengths))]
    del stream, engine
    gc.collect()  # the slot files' locks go with the engine
    return held


def test_a_persisted_slot_longer_than_the_lowered_context_starts_empty(tmp_path, caplog):
    kv = tmp_path / "kv"
    lengths = [CONTEXT - 1, CONTEXT, 300]
    assert _history(kv, lengths) == lengths
    with caplog.at_level(logging.WARNING, logger="colibri.engine"):
        engine = Engine(builtin_model_dir(), threads=2, slots=3, kv_dir=kv, context=CONTEXT)
    held = [engine.slot_info(i)["cached_tokens"] for i in range(3)]
    # The shorter history is restored; ones the context cannot hold (and extend) start empty.
    assert held == [CONTEXT - 1, 0, 0]
    assert engine.slot_info(0)["tokens"] == prompt(CONTEXT - 1)
    notes = [r.getMessage() for r in caplog.records if r.name == "colibri.engine"]
    assert len(notes) == 2
    for slot, note in zip((1, 2), notes, strict=True):
        assert f"slot-{slot}.kv: holds more tokens than the context" in note
    # A slot that started empty works, and its new history replaces the old one on disk.
    stream = engine.generate(prompt(20), 1, slot=2)
    list(stream)
    stream.close()
    del stream, engine
    gc.collect()
    reopened = Engine(builtin_model_dir(), threads=2, slots=3, kv_dir=kv)
    assert [reopened.slot_info(i)["cached_tokens"] for i in range(3)] == [CONTEXT - 1, CONTEXT, 20]


# --- the server ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def srv():
    # The flag wins over the variable.
    s = RunningServer("--context", str(CONTEXT), env={"COLI_CONTEXT": "999"})
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(srv):
    return OpenAI(base_url=srv.base_url, api_key="x", max_retries=0)


def test_the_server_reports_the_lowered_context(srv, client):
    card = client.models.retrieve(MODEL)
    assert card.model_extra["max_model_len"] == CONTEXT
    assert [m.model_extra["max_model_len"] for m in client.models.list()] == [CONTEXT]
    line = next(x for x in srv.log if x.startswith("colibri: context "))
    assert line.startswith(
        f"colibri: context {CONTEXT} tokens (the model's: {OWN}); KV memory up to "
    )
    assert f"(1 slot(s) x {CONTEXT} tokens x " in line


@pytest.mark.parametrize("stream", [False, True])
def test_a_prompt_that_fits_the_models_context_but_not_the_lowered_one_is_refused(
    client, full, stream
):
    messages = [{"role": "user", "content": "x" * 300}]
    n = len(builtin_prompt_ids(full, messages))
    assert CONTEXT < n < OWN
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=messages, max_tokens=5, stream=stream)
    assert e.value.body["code"] == "context_length_exceeded"
    assert f"maximum context length is {CONTEXT} tokens" in e.value.body["message"]
    assert f"resulted in {n} tokens" in e.value.body["message"]


def test_max_tokens_is_clamped_to_the_lowered_context(client, full):
    messages = [{"role": "user", "content": "Count to a thousand."}]
    ids = builtin_prompt_ids(full, messages)
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=5000)
    assert r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens == len(ids)
    assert r.usage.completion_tokens == CONTEXT - len(ids)
    # The same tokens as at the full context (the built-in model never ends on its own).
    want = full.detokenize(list(full.generate(ids, CONTEXT - len(ids))))
    assert r.choices[0].message.content == want
    # Legacy completions too.
    c = client.completions.create(model=MODEL, prompt="abc", max_tokens=5000)
    assert c.choices[0].finish_reason == "length"
    assert c.usage.prompt_tokens + c.usage.completion_tokens == CONTEXT


def test_coli_context_sets_it_without_the_flag():
    s = RunningServer("--no-kv-persist", env={"COLI_CONTEXT": "128"})
    try:
        client = OpenAI(base_url=s.base_url, api_key="x", max_retries=0)
        assert client.models.retrieve(MODEL).model_extra["max_model_len"] == 128
    finally:
        s.stop()


# --- the command line ------------------------------------------------------------------------


def run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    full_env = {k: v for k, v in os.environ.items() if k != "COLI_CONTEXT"}
    return subprocess.run(
        [sys.executable, "-m", "colibri", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**full_env, "COLI_MODEL": str(builtin_model_dir()), **(env or {})},
    )


@pytest.mark.parametrize(
    "args, env, message",
    [
        (
            ("--context", "4096"),
            None,
            "colibri {cmd}: --context 4096 is out of range: the model's context length is 2048",
        ),
        ((), {"COLI_CONTEXT": "4096"}, "colibri {cmd}: --context 4096 is out of range"),
        (("--context", "0"), None, "argument --context: must be at least 1, got 0"),
        ((), {"COLI_CONTEXT": "-5"}, "argument --context: must be at least 1, got -5"),
        ((), {"COLI_CONTEXT": "many"}, "argument --context: invalid"),
    ],
)
@pytest.mark.parametrize("cmd", ["serve", "generate", "bench"])
def test_a_bad_context_is_a_usage_error(cmd, args, env, message):
    extra = {
        "serve": ("--port", "0", "--no-kv-persist"),
        "generate": ("--prompt", "hi"),
        "bench": (),
    }[cmd]
    r = run(cmd, *extra, *args, env=env)
    assert r.returncode == 2, r.stderr
    assert message.format(cmd=cmd) in r.stderr


def test_generate_stops_at_the_lowered_context(full):
    text = "x" * 200
    ids = full.tokenize(text)
    r = run("generate", "--prompt", text, "--max-tokens", "1000", "--context", str(CONTEXT))
    assert r.returncode == 0, r.stderr
    assert r.stdout == full.detokenize(list(full.generate(ids, CONTEXT - len(ids) + 1))) + "\n"


def test_the_kv_memory_check_uses_the_lowered_context(monkeypatch, capsys):
    per_token = Engine(builtin_model_dir(), threads=1).info["kv_bytes_per_token"]
    # Room for 2 slots x 1000 tokens: the model's 2048 do not fit, 1000 do.
    monkeypatch.setattr(server, "available_memory_bytes", lambda: 2 * 1000 * per_token)
    monkeypatch.setattr(server, "run", lambda *a, **k: None)
    base = ["serve", "--port", "0", "--threads", "1", "--no-kv-persist", "--kv-slots", "2"]
    base += ["--model", str(builtin_model_dir())]
    assert cli.main(base) == 2
    err = capsys.readouterr().err
    assert f"--kv-slots 2 needs up to 0.0 GiB of KV memory ({OWN} tokens x {per_token}" in err
    assert "use --kv-slots 0 or fewer, or keep them with --context 1000 or less" in err
    assert cli.main([*base, "--context", "1000"]) == 0
    err = capsys.readouterr().err
    assert f"colibri: context 1000 tokens (the model's: {OWN}); KV memory up to " in err
    assert f"(2 slot(s) x 1000 tokens x {per_token} bytes per token)" in err


def test_kv_report():
    info = {"context_length": 2048, "model_context_length": 2048, "kv_bytes_per_token": 1024}
    assert cli.kv_report(2, info) == (
        "colibri: context 2048 tokens; KV memory up to 4.0 MiB "
        "(2 slot(s) x 2048 tokens x 1024 bytes per token)"
    )
    info = {"context_length": 1 << 20, "model_context_length": 1 << 21, "kv_bytes_per_token": 4096}
    assert cli.kv_report(1, info) == (
        "colibri: context 1048576 tokens (the model's: 2097152); KV memory up to 4.0 GiB "
        "(1 slot(s) x 1048576 tokens x 4096 bytes per token)"
    )
