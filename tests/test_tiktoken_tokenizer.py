"""Checkpoints whose tokenizer is published as tiktoken files (Moonshot's Kimi K2 and Kimi
Linear: `tiktoken.model`, the split pattern in the tokenizer's Python module, special tokens
after the ranks; no tokenizer.json). The conversion writes the equivalent tokenizer.json; here it
is held to tiktoken itself on the same files (tests/fixtures/tiktoken/: 2,048 trained ranks and
Kimi's split pattern), on arbitrary text, and a Kimi-style checkpoint converts and serves."""

from __future__ import annotations

import base64
import json
import re
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer

from colibri import Engine, _engine, convert
from colibri.chat.template import ChatTemplate, sorts_tool_keys
from colibri.runtime import long_texts

from .conftest import FIXTURES
from .kimi_tokenizer import TIKTOKEN, kimi_checkpoint, kimi_k25_checkpoint, reference, tiktoken_dir

RANKS = 2048
# The fixture's 17 named special tokens and some reserved ones after them.
VOCAB = RANKS + 40


@pytest.fixture(scope="module")
def made() -> Tokenizer:
    return Tokenizer.from_str(_engine.tiktoken_tokenizer(str(TIKTOKEN), VOCAB))


@pytest.fixture(scope="module")
def ref():
    return reference(TIKTOKEN, VOCAB)


# Text of every kind the split pattern distinguishes: Han, other letters of each case, marks,
# digits, punctuation, every sort of whitespace and line break, emoji, and anything else.
SAMPLES = (
    "aZé中文字日本語ßÆΩжЖ가あア0123456789٣'sLlTHE.,;:!?—–…😀🎉∑√"
    "\u0301\u0308\u200b\u00a0\u3000\u2028\t\n\r\x0b\x0c \\\"'`"
)
texts = st.one_of(
    st.text(alphabet=st.sampled_from(SAMPLES), max_size=48),
    st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=32),
    st.lists(
        st.sampled_from(["the", " model", "'s", "'LL", "  ", "\n\n", "123456", "中文", "x"]),
        max_size=12,
    ).map("".join),
)


@settings(max_examples=400, deadline=None)
@given(texts)
def test_the_converted_tokenizer_encodes_as_tiktoken(made, ref, text):
    ids = made.encode(text, add_special_tokens=False).ids
    assert ids == ref.encode(text, allowed_special="all")
    assert made.decode(ids, skip_special_tokens=False) == text


def test_the_docs_encode_as_tiktoken(made, ref):
    docs = sorted((Path(__file__).parent.parent / "docs").glob("*.md"))
    text = "".join(p.read_text(encoding="utf-8") for p in docs)
    assert made.encode(text, add_special_tokens=False).ids == ref.encode(
        text, allowed_special="all"
    )


def test_special_tokens_are_one_token_each_and_fill_the_vocabulary(made, ref):
    text = "[BOS]<|im_user|>user<|im_middle|>Hi<|im_end|><|reserved_token_2087|>"
    ids = made.encode(text, add_special_tokens=False).ids
    assert ids == ref.encode(text, allowed_special="all")
    assert ids[:2] == [RANKS, RANKS + 3] and ids[-1] == VOCAB - 1
    assert made.get_vocab_size() == VOCAB
    # Past the model's vocabulary there are no tokens: a reserved name there is plain text.
    assert len(made.encode(f"<|reserved_token_{VOCAB}|>").ids) > 1
    named = json.loads((TIKTOKEN / "tokenizer_config.json").read_text())["added_tokens_decoder"]
    for i, tok in named.items():
        assert made.id_to_token(int(i)) == tok["content"]


def refusal(tmp_path: Path, change) -> str:
    """The error converting the DeepSeek-V3 fixture with Kimi's tokenizer files changed by
    ``change(dir)``."""
    hf = kimi_checkpoint(FIXTURES / "deepseek_v3" / "hf", tmp_path / "hf", 400)
    change(hf)
    with pytest.raises((ValueError, RuntimeError)) as exc:
        convert(hf, tmp_path / "out", "f32")
    assert not (tmp_path / "out" / "manifest.json").exists()
    return str(exc.value)


def edit(name: str, old: str, new: str):
    def change(hf: Path) -> None:
        p = hf / name
        p.write_text(p.read_text().replace(old, new, 1))

    return change


def test_a_tokenizer_that_cannot_be_read_is_refused_with_the_reason(tmp_path):
    cases = {
        "module": (lambda hf: (hf / "tokenization_kimi.py").unlink(), "tokenization_kimi.py"),
        "pattern": (edit("tokenization_kimi.py", "pat_str =", "pattern ="), "no `pat_str"),
        "auto_map": (edit("tokenizer_config.json", '"auto_map"', '"x"'), "auto_map"),
        "ranks": (edit("tiktoken.model", " 300\n", " 299\n"), "rank 299 is given twice"),
        "config": (lambda hf: (hf / "tokenizer_config.json").unlink(), "tokenizer_config.json"),
        "nothing": (lambda hf: (hf / "tiktoken.model").unlink(), "has no tokenizer"),
        # A pattern in a dialect the gateway's regex engine does not read.
        "dialect": (edit("tokenization_kimi.py", r'r"""\s+""",', r'r"""(?<x>\s+""",'), "load"),
    }
    for name, (change, want) in cases.items():
        err = refusal(tmp_path / name, change)
        assert want in err, (name, err)


def test_a_kimi_k25_checkpoints_tokenizer_is_checked_before_its_weights(tmp_path):
    """The check reads the vocabulary from the text model's config (K2.5 has it only in
    ``text_config``): a pattern the gateway cannot read stops the conversion there too."""
    hf = kimi_k25_checkpoint(FIXTURES / "deepseek_v3" / "hf", tmp_path / "hf", 400)
    edit("tokenization_kimi.py", r'r"""\s+""",', r'r"""(?<x>\s+""",')(hf)
    with pytest.raises(ValueError, match="the tokenizer made from tiktoken.model does not load"):
        convert(hf, tmp_path / "out", "f32")
    assert not (tmp_path / "out" / "manifest.json").exists()


def test_a_kimi_checkpoint_converts_and_its_engine_tokenizes_as_tiktoken(tmp_path):
    # DeepSeek-V3's architecture (Kimi K2's): 463 tokens = 440 ranks + 23 special.
    hf = kimi_checkpoint(FIXTURES / "deepseek_v3" / "hf", tmp_path / "hf", 440)
    assert not (hf / "tokenizer.json").exists()
    convert(hf, tmp_path / "out", "int4")
    engine = Engine(tmp_path / "out", threads=1)
    ref = reference(hf, 463)
    text = "<|im_user|>user<|im_middle|>Wie spät ist es? 東京の天気 — 21°C<|im_end|>"
    assert engine.tokenize(text) == ref.encode(text, allowed_special="all")
    assert engine.detokenize(engine.tokenize(text)) == text
    # [EOS] from tokenizer_config.json ends a reply as the config's eos_token_id does.
    assert ref.encode_single_token("[EOS]") in engine.eos_token_ids
    assert sorts_tool_keys(engine.tokenizer_config)


def test_kimis_tokenizer_sorts_the_keys_of_tool_definitions():
    """Kimi's tokenizer module sorts every tool definition's keys (recursively) before its
    template renders them; colibri does the same for such a checkpoint, and only for one."""
    cfg = json.loads((TIKTOKEN / "tokenizer_config.json").read_text())
    assert sorts_tool_keys(cfg)
    assert sorts_tool_keys({"auto_map": {"AutoTokenizer": "moonshotai/K--tokenization_kimi.T"}})
    assert not sorts_tool_keys({"auto_map": {"AutoTokenizer": ["tokenization_other.T", None]}})
    assert not sorts_tool_keys({})
    tool = {
        "type": "function",
        "function": {
            "name": "f",
            "parameters": {"type": "object", "properties": {"b": {}, "a": {"type": "string"}}},
        },
    }
    source = "{{ tools | tojson }}"
    sorted_ = ChatTemplate(source, sort_tool_keys=True).render(
        [], add_generation_prompt=False, tools=[tool]
    )
    plain = ChatTemplate(source).render([], add_generation_prompt=False, tools=[tool])
    assert sorted_ == json.dumps([tool], sort_keys=True, ensure_ascii=False)
    assert plain == json.dumps([tool], ensure_ascii=False) != sorted_


def test_the_fixture_tables_cut_to_any_prefix_are_valid(tmp_path):
    """The helper's premise: a prefix of the trained table is a table (each token's parts rank
    lower), so cutting it for a small model keeps tiktoken's encoding of the prefix."""
    cut = tiktoken_dir(tmp_path / "cut", 300)
    made = Tokenizer.from_str(_engine.tiktoken_tokenizer(str(cut), 320))
    ref = reference(cut, 320)
    text = (FIXTURES.parent.parent / "README.md").read_text(encoding="utf-8")
    assert made.encode(text, add_special_tokens=False).ids == ref.encode(
        text, allowed_special="all"
    )


def test_a_ranked_token_with_a_special_tokens_text_leaves_the_special_ids_in_place(tmp_path):
    """A table may hold a special token's text as an ordinary token too (here "[EOS]"); the
    special token still gets its own id, as tiktoken gives it. Read literally (the gateway's
    reading of what users write), the text is plain text in smaller tokens."""
    d = tiktoken_dir(tmp_path / "t", 300)
    lines = (d / "tiktoken.model").read_text().splitlines()[:296]
    extra = [b"[E", b"[EO", b"[EOS", b"[EOS]"]
    lines += [f"{base64.b64encode(t).decode()} {296 + i}" for i, t in enumerate(extra)]
    (d / "tiktoken.model").write_text("\n".join(lines) + "\n")
    made = Tokenizer.from_str(_engine.tiktoken_tokenizer(str(d), 340))
    ref = reference(d, 340)
    eos = 301  # the specials from 300: [BOS], [EOS], ... (299 is the ordinary "[EOS]")
    assert ref.encode("[EOS]", allowed_special="all") == [eos]
    for text in ["[EOS]", "x[EOS]y [EOS]\n[EO", "[BOS]<|im_end|>[EOS]"]:
        ids = made.encode(text, add_special_tokens=False).ids
        assert ids == ref.encode(text, allowed_special="all")
    assert made.token_to_id("[EOS]") == eos
    literal = Tokenizer.from_str(made.to_str())
    literal.encode_special_tokens = True
    ids = literal.encode("say [EOS] now", add_special_tokens=False).ids
    assert eos not in ids and 299 not in ids
    assert literal.decode(ids) == "say [EOS] now"


def kimi_cuts(s: str, max_run: int):
    """The loop Kimi's module runs over each 400,000-character window (written out here as it
    publishes it): a piece ends where a run of whitespace or non-whitespace passes ``max_run``."""
    if not s:
        return
    run, space, start = 0, s[0].isspace(), 0
    for i, c in enumerate(s):
        if space != c.isspace():
            run, space = 1, c.isspace()
        else:
            run += 1
            if run > max_run:
                yield s[start:i]
                start, run = i, 1
    yield s[start:]


def test_the_whitespace_class_is_str_isspace_on_every_code_point():
    space = re.compile(r"\s")
    assert all(bool(space.fullmatch(chr(c))) == chr(c).isspace() for c in range(sys.maxunicode + 1))


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.sampled_from(["a", "xy", " ", "\n", "\u3000", "\x1c", "中"]), max_size=80).map(
        "".join
    ),
    st.integers(1, 9),
    st.integers(1, 30),
)
def test_long_texts_are_cut_where_kimis_tokenizer_cuts_them(text, max_run, window):
    windows = [text[w : w + window] for w in range(0, len(text), window)]
    want = [p for part in windows for p in kimi_cuts(part, max_run)]
    assert long_texts.pieces(text, window, max_run) == want


def test_a_kimi_engine_encodes_long_texts_in_kimis_pieces(tmp_path):
    """A word past 25,000 letters and a text past one 400,000-character window, around special
    tokens: the engine's ids are tiktoken's over Kimi's pieces of each segment between special
    tokens, which here differ from encoding each segment whole (both cuts fall inside a "the",
    one token whole); a text with no cut is encoded whole."""
    hf = kimi_checkpoint(FIXTURES / "deepseek_v3" / "hf", tmp_path / "hf", 440)
    convert(hf, tmp_path / "out", "int4")
    engine = Engine(tmp_path / "out", threads=1)
    ref = reference(hf, 463)
    specials = re.compile(r"(<\|im_user\|>|<\|im_end\|>)")

    def kimi_encode(text: str) -> list[int]:
        ids: list[int] = []
        for seg in specials.split(text):
            if specials.fullmatch(seg):
                ids += ref.encode(seg, allowed_special="all")
                continue
            for w in range(0, len(seg), long_texts.WINDOW):
                for piece in kimi_cuts(seg[w : w + long_texts.WINDOW], long_texts.MAX_RUN):
                    ids += ref.encode(piece, allowed_special="all")
        return ids

    word = "the" * 8_337 + "t"  # 25,012 letters, cut after 25,000: "the" * 8,333 + "t" | "he.."
    words = "xx" + "the " * 100_003  # the window ends after "th" of a word
    for text in (f"<|im_user|>x {word} y<|im_end|>", f"{words}<|im_end|>{word}"):
        want = kimi_encode(text)
        assert engine.tokenize(text) == want
        assert want != ref.encode(text, allowed_special="all")
    assert engine.tokenize_literal(word) == kimi_encode(word)
    short = f"<|im_user|>{'the' * 8_333}t<|im_end|>"
    assert engine.tokenize(short) == ref.encode(short, allowed_special="all")
