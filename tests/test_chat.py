"""Unit tests of the chat pieces: templates, rendering and continuation, families, the
incremental detokenizer and the whole output pipeline."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer

from colibri.chat.detok import IncrementalDetokenizer
from colibri.chat.families import (
    GLM,
    OLMOE,
    QWEN3,
    architecture_families,
    detect_family,
    family_by_name,
)
from colibri.chat.output import OutputPipeline, ReasoningState
from colibri.chat.render import ContinuationRefused, render_chat
from colibri.chat.template import ChatTemplate, TemplateRefused, special_tokens_of
from colibri.demo.builtin import CHAT_TEMPLATE, builtin_model_dir

from .conftest import FIXTURES

HELLO = [{"role": "user", "content": "Hello"}]
# A ChatML template with Qwen3's thinking switch (written for these tests).
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}"
    "{% endif %}"
)


# --- templates -------------------------------------------------------------------------------


def test_template_sandbox_blocks_python_internals():
    t = ChatTemplate("{{ messages.__class__.__mro__[1].__subclasses__() }}")
    with pytest.raises(TemplateRefused):
        t.render(HELLO, add_generation_prompt=True)


def test_template_raise_exception_and_helpers():
    t = ChatTemplate(
        "{% if messages[0].role != 'system' %}{{ raise_exception('system first') }}{% endif %}"
    )
    with pytest.raises(TemplateRefused, match="system first"):
        t.render(HELLO, add_generation_prompt=True)
    t = ChatTemplate("{{ bos_token }}{{ messages | tojson }}{{ strftime_now('%Y') | length }}")
    out = t.render([{"role": "user", "content": "é"}], add_generation_prompt=False, bos_token="<s>")
    assert out == '<s>[{"role": "user", "content": "é"}]4'
    with pytest.raises(ValueError, match="does not compile"):
        ChatTemplate("{% for %}")


def test_special_tokens_of_tokenizer_config():
    cfg = {"bos_token": {"content": "<s>"}, "eos_token": "</s>", "pad_token": None}
    assert special_tokens_of(cfg) == {"bos_token": "<s>", "eos_token": "</s>"}


# --- rendering -------------------------------------------------------------------------------


def glm(messages, thinking=False, **kw):
    return render_chat(ChatTemplate(CHAT_TEMPLATE), GLM, messages, enable_thinking=thinking, **kw)


def test_glm_generation_prompt_and_thinking_switch():
    off, on = glm(HELLO), glm(HELLO, thinking=True)
    assert off.text == "[gMASK]<sop><|user|>\nHello<|assistant|>\n<think></think>"
    assert on.text == "[gMASK]<sop><|user|>\nHello<|assistant|>"
    assert (off.in_reasoning, off.after_reasoning) == (False, True)
    assert (on.in_reasoning, on.after_reasoning) == (False, False)
    assert not off.continued and not on.continued


def test_continuation_ends_inside_the_turn():
    r = glm([*HELLO, {"role": "assistant", "content": "The answer is"}])
    assert r.continued and r.text.endswith("<|assistant|>\n<think></think>\nThe answer is")
    r = glm([*HELLO, {"role": "assistant", "content": "<think>Let me see"}])
    assert r.continued and r.in_reasoning
    r = glm([*HELLO, {"role": "assistant", "content": "<think>x</think>So"}])
    assert r.continued and not r.in_reasoning and not r.after_reasoning


def test_continuation_switch_off_folds_the_turn():
    r = glm([*HELLO, {"role": "assistant", "content": "Sure"}], continue_assistant=False)
    assert not r.continued
    assert r.text.endswith("\nSure<|assistant|>\n<think></think>")


def test_continuation_refusals():
    with pytest.raises(ContinuationRefused, match="whitespace"):
        glm([*HELLO, {"role": "assistant", "content": "Sure "}])
    with pytest.raises(ContinuationRefused, match="tools"):
        glm([*HELLO, {"role": "assistant", "content": "Sure"}], tools=[{"type": "function"}])
    # An empty trailing turn is not a continuation: it is folded.
    assert not glm([*HELLO, {"role": "assistant", "content": ""}]).continued


def test_template_without_an_open_turn_falls_back():
    # This template drops assistant text from history: no open-turn shape exists.
    t = ChatTemplate(
        "{% for m in messages %}{% if m.role == 'user' %}U:{{ m.content }}\n{% endif %}"
        "{% endfor %}{% if add_generation_prompt %}A:{% endif %}"
    )
    r = render_chat(
        t, OLMOE, [*HELLO, {"role": "assistant", "content": "Hi"}], enable_thinking=False
    )
    assert not r.continued and r.text == "U:Hello\nA:"


def test_quoted_think_tag_in_a_user_turn_is_not_reasoning():
    r = glm([{"role": "user", "content": "What does <think> mean?"}], thinking=True)
    assert not r.in_reasoning


def test_qwen_style_thinking_off_starts_after_reasoning():
    t = ChatTemplate(CHATML)
    off = render_chat(t, QWEN3, HELLO, enable_thinking=False)
    assert off.text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert off.after_reasoning and not off.in_reasoning
    on = render_chat(t, QWEN3, HELLO, enable_thinking=True)
    assert not on.after_reasoning and not on.in_reasoning
    cont = render_chat(t, QWEN3, [*HELLO, {"role": "assistant", "content": "<think>\nhm"}],
                       enable_thinking=True)  # fmt: skip
    assert cont.continued and cont.in_reasoning


# --- families --------------------------------------------------------------------------------


def test_family_detection():
    assert detect_family("OlmoeForCausalLM", CHAT_TEMPLATE) is GLM  # the template decides
    assert detect_family("OlmoeForCausalLM", None) is OLMOE
    assert detect_family("Qwen3MoeForCausalLM", "{{ x }}") is QWEN3
    assert detect_family("Glm4MoeForCausalLM", "") is GLM
    assert detect_family("OlmoeForCausalLM", CHATML) is QWEN3
    assert family_by_name("olmoe") is OLMOE
    with pytest.raises(ValueError, match="unknown chat family"):
        family_by_name("llama")


def test_every_engine_architecture_has_a_chat_family():
    archs = architecture_families()
    assert {"OlmoeForCausalLM", "Qwen3MoeForCausalLM", "Glm4MoeForCausalLM"} <= set(archs)
    for arch, name in archs.items():
        assert detect_family(arch, None) is family_by_name(name), arch


def test_glm_implicit_stops_replace_marker_token_stops():
    ids = {"<|user|>": 7, "<|observation|>": 8, "<|endoftext|>": 9}
    stops, lead, stop_ids = GLM.chat_stops([], False, [9, 7, 8], ids.get)
    assert stops == ["<|user|>", "<|observation|>"] and lead and stop_ids == [9]
    # A client stop replaces them; the config's EOS ids all stay token stops.
    assert GLM.chat_stops(["END"], False, [9, 7, 8], ids.get) == (["END"], False, [9, 7, 8])
    assert QWEN3.chat_stops([], False, [3], ids.get) == ([], False, [3])


# --- detokenizer -----------------------------------------------------------------------------

TOKENIZERS = {
    "builtin": builtin_model_dir() / "tokenizer.json",
    **{a: FIXTURES / a / "hf" / "tokenizer.json" for a in ("olmoe", "qwen3_moe", "glm4_moe")},
}


@pytest.fixture(scope="module", params=sorted(TOKENIZERS))
def tokenizer(request) -> Tokenizer:
    return Tokenizer.from_file(str(TOKENIZERS[request.param]))


@settings(max_examples=60, deadline=None)
@given(text=st.text(st.characters(codec="utf-8", exclude_categories=["Cs"]), max_size=40))
def test_incremental_detokenizer_equals_full_decode(tokenizer, text):
    ids = tokenizer.encode(text, add_special_tokens=False).ids

    def decode(x: list[int]) -> str:
        return tokenizer.decode(x, skip_special_tokens=False)

    detok = IncrementalDetokenizer(decode)
    pieces = [detok.push(t) for t in ids]
    pieces.append(detok.flush())
    assert "".join(pieces) == decode(ids)
    # Nothing is emitted as a replacement character unless the full decode has one too.
    assert all("\ufffd" not in p for p in pieces[:-1]) or "\ufffd" in decode(ids)


def test_detokenizer_holds_a_split_character():
    tok = Tokenizer.from_file(str(TOKENIZERS["builtin"]))
    ids = tok.encode("é", add_special_tokens=False).ids
    assert len(ids) == 2  # byte-level: one token per UTF-8 byte
    detok = IncrementalDetokenizer(lambda x: tok.decode(x))
    assert detok.push(ids[0]) == "" and detok.push(ids[1]) == "é"


# --- the output pipeline ---------------------------------------------------------------------


def builtin_tokenizer() -> Tokenizer:
    return Tokenizer.from_file(str(TOKENIZERS["builtin"]))


def run_pipeline(text: str, **kw) -> tuple[list[tuple[str, str]], bool]:
    tok = builtin_tokenizer()
    out = OutputPipeline(lambda x: tok.decode(x, skip_special_tokens=False), **kw)
    pieces = []
    for t in tok.encode(text, add_special_tokens=False).ids:
        pieces += out.push_token(t)
        if out.stopped:
            break
    return pieces + out.finish(), out.stopped


def joined(pieces, kind: str) -> str:
    return "".join(t for k, t in pieces if k == kind)


def test_pipeline_glm_role_marker_stops():
    pieces, stopped = run_pipeline(
        "<|user|>\nHi there<|user|>\nmore", stops=GLM.implicit_stops, ignore_leading_stop=True
    )
    assert stopped and joined(pieces, "content") == "\nHi there"


def test_pipeline_reasoning_then_content_then_stop():
    pieces, stopped = run_pipeline(
        "\n<think>Need weather.</think>\nLet me check.<|observation|>x",
        stops=GLM.implicit_stops,
        ignore_leading_stop=True,
        reasoning=ReasoningState(in_reasoning=False, after_reasoning=False),
    )
    assert stopped
    assert joined(pieces, "reasoning") == "Need weather."
    assert joined(pieces, "content") == "Let me check."


def test_pipeline_without_stop_flushes_everything():
    pieces, stopped = run_pipeline("abc <thi", reasoning=ReasoningState(False, False))
    assert not stopped and joined(pieces, "content") == "abc <thi"
