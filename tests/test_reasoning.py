"""Reasoning/content splitting: the one-shot reference and the streaming splitter agree."""

from __future__ import annotations

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from colibri.chat.reasoning import ReasoningSplitter, split_reasoning

Pieces = list[tuple[str, str]]


def stream_pieces(
    chunks: list[str],
    in_reasoning: bool,
    strip_content_start: bool = False,
    open_tag: str = "<think>",
    close_tag: str = "</think>",
) -> Pieces:
    """Feed ``chunks`` through a splitter; return every piece it produced, in order."""
    s = ReasoningSplitter(in_reasoning, strip_content_start, open_tag, close_tag)
    pieces: Pieces = []
    for chunk in chunks:
        pieces += s.push(chunk)
    pieces += s.flush()
    return pieces


def joined(pieces: Pieces) -> tuple[str, str]:
    reasoning = "".join(text for kind, text in pieces if kind == "reasoning")
    content = "".join(text for kind, text in pieces if kind == "content")
    return reasoning, content


def stream(
    chunks: list[str],
    in_reasoning: bool,
    strip_content_start: bool = False,
    open_tag: str = "<think>",
    close_tag: str = "</think>",
) -> tuple[str, str]:
    pieces = stream_pieces(chunks, in_reasoning, strip_content_start, open_tag, close_tag)
    return joined(pieces)


def chunk_at(text: str, cuts: list[int]) -> list[str]:
    """Split ``text`` at the given positions (repeated positions give empty chunks)."""
    bounds = [0, *sorted(cuts), len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]


# --- plain examples ---------------------------------------------------------------------------

EXAMPLES = [
    # (text, in_reasoning, strip_content_start, expected)
    (
        "\n<think>Need weather.</think>\nLet me check.",
        False,
        False,
        ("Need weather.", "Let me check."),
    ),
    ("\nUser wants weather.\n</think>\n\nHi", True, False, ("User wants weather.", "Hi")),
    ("Hello <think>x</think>", False, False, ("", "Hello <think>x</think>")),
    ("", False, False, ("", "")),
    ("", True, False, ("", "")),
    ("<think></think>", False, False, ("", "")),
    ("</think>", True, False, ("", "")),
    ("<think>", False, False, ("", "")),
    ("  \n ", False, False, ("", "  \n ")),
    ("  \n ", False, True, ("", "")),
    ("\n\nAnswer.", False, True, ("", "Answer.")),
    ("\n\nAnswer.", False, False, ("", "\n\nAnswer.")),
    ("  still thinking \n", True, False, ("still thinking", "")),
    ("<think> a \n b </think> c </think> d", False, False, ("a \n b", "c </think> d")),
    ("<think>a<think>b</think>c", False, False, ("a<think>b", "c")),
    ("x</think>y", False, False, ("", "x</think>y")),
    ("<thi", False, False, ("", "<thi")),
    (" <thi", False, True, ("", "<thi")),
    ("<think>abc</thi", False, False, ("abc</thi", "")),
    ("<think>abc </thi", False, False, ("abc </thi", "")),
    ("Sure</think>  \n", True, False, ("Sure", "")),
    ("Sure</think>Done  ", True, True, ("Sure", "Done  ")),
]


@pytest.mark.parametrize(("text", "in_reasoning", "strip_start", "expected"), EXAMPLES)
def test_examples(
    text: str, in_reasoning: bool, strip_start: bool, expected: tuple[str, str]
) -> None:
    assert split_reasoning(text, in_reasoning, strip_start) == expected
    assert stream([text], in_reasoning, strip_content_start=strip_start) == expected
    assert stream(list(text), in_reasoning, strip_content_start=strip_start) == expected


@pytest.mark.parametrize(("text", "in_reasoning", "strip_start", "expected"), EXAMPLES)
def test_examples_split_at_every_pair_of_boundaries(
    text: str, in_reasoning: bool, strip_start: bool, expected: tuple[str, str]
) -> None:
    for i in range(len(text) + 1):
        for j in range(i, len(text) + 1):
            chunks = chunk_at(text, [i, j])
            got = stream(chunks, in_reasoning, strip_content_start=strip_start)
            assert got == expected, chunks


def test_custom_tags() -> None:
    text = "  [T] plan [/T] answer [T]"
    assert split_reasoning(text, False, open_tag="[T]", close_tag="[/T]") == ("plan", "answer [T]")
    assert stream(list(text), False, open_tag="[T]", close_tag="[/T]") == ("plan", "answer [T]")


def test_empty_tags_are_rejected() -> None:
    with pytest.raises(ValueError):
        ReasoningSplitter(False, open_tag="")
    with pytest.raises(ValueError):
        split_reasoning("x", True, close_tag="")


def test_reasoning_is_emitted_while_streaming() -> None:
    s = ReasoningSplitter(False)
    assert s.push("\n") == []
    assert s.push("<thi") == []
    assert s.push("nk>\nLet") == [("reasoning", "Let")]
    # Trailing whitespace is held until more reasoning follows.
    assert s.push(" me ") == [("reasoning", " me")]
    assert s.push("think.</") == [("reasoning", " think.")]
    assert s.push("think>\n\n") == []
    assert s.push("Hi") == [("content", "Hi")]
    assert s.push(" there\n") == [("content", " there\n")]
    assert s.flush() == []


def test_content_is_emitted_at_once_when_no_tag_opens() -> None:
    s = ReasoningSplitter(False)
    assert s.push(" \n") == []
    assert s.push("He") == [("content", " \nHe")]
    assert s.push("llo <think>") == [("content", "llo <think>")]
    assert s.flush() == []


def test_partial_close_tag_is_flushed_as_reasoning() -> None:
    s = ReasoningSplitter(True)
    assert s.push("idea </thi") == [("reasoning", "idea")]
    assert s.flush() == [("reasoning", " </thi")]


def test_one_push_can_cover_both_parts() -> None:
    s = ReasoningSplitter(True)
    assert s.push("plan</think>answer") == [("reasoning", "plan"), ("content", "answer")]


# --- properties -------------------------------------------------------------------------------

TAG_PAIRS = [("<think>", "</think>"), ("[T]", "[/T]"), ("aab", "aac"), ("<<", "<</")]


@st.composite
def cases(draw: st.DrawFn) -> tuple[str, str, str, list[str]]:
    """(text, open_tag, close_tag, chunks): texts mix whole tags, tag fragments, whitespace and
    letters, so that tags, near-tags and split tags all occur."""
    open_tag, close_tag = draw(st.sampled_from(TAG_PAIRS))
    fragments = [open_tag, close_tag, open_tag[:-1], close_tag[:2], "<", "/", ">", "a", "b"]
    fragments += ["x", " ", "\n", "\t"]
    text = "".join(draw(st.lists(st.sampled_from(fragments), max_size=25)))
    cuts = draw(st.lists(st.integers(0, len(text)), max_size=len(text) + 3))
    return text, open_tag, close_tag, chunk_at(text, cuts)


@settings(max_examples=800)
@given(cases(), st.booleans(), st.booleans())
def test_streaming_matches_the_reference(
    case: tuple[str, str, str, list[str]], in_reasoning: bool, strip_start: bool
) -> None:
    text, open_tag, close_tag, chunks = case
    pieces = stream_pieces(chunks, in_reasoning, strip_start, open_tag, close_tag)
    assert joined(pieces) == split_reasoning(text, in_reasoning, strip_start, open_tag, close_tag)
    assert all(piece for _, piece in pieces)
    # Reasoning, if any, all comes before content.
    kinds = [kind for kind, _ in pieces]
    assert kinds == sorted(kinds, key=lambda kind: kind == "content")


@settings(max_examples=400)
@given(cases(), st.booleans(), st.booleans())
def test_every_push_returns_non_empty_pieces(
    case: tuple[str, str, str, list[str]], in_reasoning: bool, strip_start: bool
) -> None:
    _, open_tag, close_tag, chunks = case
    s = ReasoningSplitter(in_reasoning, strip_start, open_tag=open_tag, close_tag=close_tag)
    for chunk in chunks:
        result = s.push(chunk)
        assert all(kind in ("reasoning", "content") and piece for kind, piece in result)
    assert all(piece for _, piece in s.flush())


@settings(max_examples=400)
@given(cases(), st.booleans())
def test_delimiting_tags_never_reach_reasoning(
    case: tuple[str, str, str, list[str]], in_reasoning: bool
) -> None:
    """The close tag ends reasoning, so it never appears in it; the open tag only appears in
    reasoning when the model wrote another one inside the block (kept: never lose text)."""
    text, open_tag, close_tag, chunks = case
    reasoning, content = stream(chunks, in_reasoning, open_tag=open_tag, close_tag=close_tag)
    assert close_tag not in reasoning
    openers = text.count(open_tag) - (0 if in_reasoning else 1)
    if openers <= 0:
        assert open_tag not in reasoning
    if not reasoning and not in_reasoning and not text.lstrip().startswith(open_tag):
        assert content == text


@settings(max_examples=300)
@given(st.text(st.sampled_from(list("ab \n<>/think"))), st.booleans())
def test_content_without_an_opening_tag_is_verbatim(text: str, strip_start: bool) -> None:
    assume(not text.lstrip().startswith("<think>"))
    expected = text.lstrip() if strip_start else text
    assert stream(list(text), False, strip_content_start=strip_start) == ("", expected)
