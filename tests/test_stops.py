"""Stop strings: the one-shot reference and the streaming filter agree for any chunking."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from colibri.chat.stops import StopFilter, apply_stops

ROLE_STOPS = ["<|user|>", "<|observation|>"]


def stream(
    chunks: list[str], stops: list[str], ignore_leading: bool = False
) -> tuple[str, bool, StopFilter]:
    """Feed ``chunks`` through a filter; return (all emitted text, stopped, the filter)."""
    f = StopFilter(stops, ignore_leading=ignore_leading)
    out = [f.push(chunk) for chunk in chunks]
    out.append(f.flush())
    return "".join(out), f.stopped, f


def chunk_at(text: str, cuts: list[int]) -> list[str]:
    """Split ``text`` at the given positions (repeated positions give empty chunks)."""
    bounds = [0, *sorted(cuts), len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]


# --- plain examples ---------------------------------------------------------------------------


def test_reference_cuts_at_the_earliest_stop() -> None:
    assert apply_stops("hello world. bye", ["bye", "."]) == ("hello world", True)
    assert apply_stops("no stop here", ["STOP"]) == ("no stop here", False)
    assert apply_stops("", ["x"]) == ("", False)


def test_reference_overlapping_stops() -> None:
    assert apply_stops("xxabc", ["abc", "b"]) == ("xx", True)
    assert apply_stops("xxab", ["abc", "b"]) == ("xxa", True)


def test_role_marker_before_the_answer_is_discarded() -> None:
    text = "<|user|>\nHello<|user|>x"
    assert apply_stops(text, ROLE_STOPS, ignore_leading=True) == ("\nHello", True)
    for chunks in ([text], list(text), chunk_at(text, [3, 10, 17])):
        out, stopped, _ = stream(chunks, ROLE_STOPS, ignore_leading=True)
        assert (out, stopped) == ("\nHello", True)


def test_without_ignore_leading_a_leading_marker_stops() -> None:
    assert apply_stops("<|user|>\nHello", ROLE_STOPS) == ("", True)
    assert stream(list("<|user|>\nHello"), ROLE_STOPS)[:2] == ("", True)


def test_ignore_leading_keeps_whitespace_and_discards_repeated_markers() -> None:
    text = " \n<|user|> <|observation|>\n Hi <|user|> more"
    assert apply_stops(text, ROLE_STOPS, ignore_leading=True) == (" \n \n Hi ", True)
    assert stream(list(text), ROLE_STOPS, ignore_leading=True)[:2] == (" \n \n Hi ", True)


def test_ignore_leading_prefers_the_longest_stop_at_the_same_start() -> None:
    assert apply_stops("abcX", ["ab", "abc"], ignore_leading=True) == ("X", False)
    out, stopped, _ = stream(["a", "b", "c", "X"], ["ab", "abc"], ignore_leading=True)
    assert (out, stopped) == ("X", False)
    # The text ends right after the shorter stop: it is the match after all.
    assert stream(["a", "b"], ["ab", "abc"], ignore_leading=True)[:2] == ("", False)


def test_stop_split_across_chunks_is_found() -> None:
    f = StopFilter(["</s>"])
    assert f.push("Hi <") == "Hi "
    assert f.push("/") == ""
    assert not f.stopped
    assert f.push("s> and more") == ""
    assert f.stopped


def test_stop_is_reported_as_soon_as_it_is_certain() -> None:
    # "ab" could still grow into "abc", but that cannot change the kept text: stop now.
    f = StopFilter(["ab", "abc"])
    assert f.push("xab") == "x"
    assert f.stopped


def test_text_is_emitted_as_soon_as_it_cannot_start_a_stop() -> None:
    f = StopFilter(["</s>", "###"])
    assert f.push("abc") == "abc"
    assert f.push("d<") == "d"
    assert f.pending == "<"
    assert f.push("x") == "<x"
    assert f.push("##") == ""
    assert f.flush() == "##"
    assert not f.stopped


def test_held_text_that_completes_a_stop_at_flush() -> None:
    # "abc" may still grow into "abcd" (which starts earlier than "bc"), so it is held; at the
    # end it settles as the "bc" match.
    f = StopFilter(["abcd", "bc"])
    assert f.push("abc") == ""
    assert f.flush() == "a"
    assert f.stopped


def test_nothing_comes_out_after_a_stop() -> None:
    f = StopFilter(["STOP"])
    assert f.push("oneSTOPtwo") == "one"
    assert f.stopped
    assert f.push("three") == ""
    assert f.flush() == ""
    assert f.pending == ""


def test_no_stops_passes_everything_through() -> None:
    f = StopFilter([])
    assert f.push("<|user|>") == "<|user|>"
    assert f.pending == ""
    assert f.flush() == ""
    assert not f.stopped
    assert apply_stops("abc", []) == ("abc", False)


def test_empty_stop_string_is_rejected() -> None:
    with pytest.raises(ValueError):
        StopFilter(["ok", ""])
    with pytest.raises(ValueError):
        apply_stops("text", [""])


def test_bare_string_is_rejected() -> None:
    with pytest.raises(TypeError):
        StopFilter("stop")  # type: ignore[arg-type]


# --- properties -------------------------------------------------------------------------------

STOP_ALPHABET = "abc"
TEXT_ALPHABET = list("abcx \n")


@st.composite
def cases(draw: st.DrawFn) -> tuple[str, list[str], list[str]]:
    """(text, stops, chunks): texts are made of stop strings and loose characters, so that
    stops, partial stops and overlapping stops actually occur."""
    stops = draw(
        st.one_of(
            st.lists(st.text(STOP_ALPHABET, min_size=1, max_size=4), min_size=1, max_size=4),
            st.sampled_from([["ab", "b", "abc"], ["aba", "ba"], [" a", "a"], ["\n"], ["aaa"]]),
        )
    )
    parts = draw(st.lists(st.sampled_from(TEXT_ALPHABET + stops), max_size=25))
    text = "".join(parts)
    cuts = draw(st.lists(st.integers(0, len(text)), max_size=len(text) + 3))
    return text, stops, chunk_at(text, cuts)


@settings(max_examples=600)
@given(cases(), st.booleans())
def test_streaming_matches_the_reference(
    case: tuple[str, list[str], list[str]], ignore_leading: bool
) -> None:
    text, stops, chunks = case
    out, stopped, _ = stream(chunks, stops, ignore_leading)
    assert (out, stopped) == apply_stops(text, stops, ignore_leading)


@settings(max_examples=400)
@given(cases())
def test_output_is_a_stop_free_prefix(case: tuple[str, list[str], list[str]]) -> None:
    text, stops, chunks = case
    out, stopped, _ = stream(chunks, stops)
    assert text.startswith(out)
    assert not any(stop in out for stop in stops)
    # A stop occurs in the text exactly when the filter stopped, however it was split.
    assert stopped == any(stop in text for stop in stops)


@settings(max_examples=400)
@given(cases(), st.booleans())
def test_hold_back_is_bounded_by_the_longest_stop(
    case: tuple[str, list[str], list[str]], ignore_leading: bool
) -> None:
    _, stops, chunks = case
    f = StopFilter(stops, ignore_leading=ignore_leading)
    longest = max(map(len, stops))
    for chunk in chunks:
        f.push(chunk)
        assert len(f.pending) < longest
    f.flush()
    assert f.pending == ""


@settings(max_examples=300)
@given(cases())
def test_held_text_is_a_partial_stop(case: tuple[str, list[str], list[str]]) -> None:
    """Without ignore_leading, the filter holds back exactly the longest suffix of what it was
    given that is a proper prefix of a stop string (before any stop matched)."""
    _, stops, chunks = case
    f = StopFilter(stops)
    seen = ""
    for chunk in chunks:
        f.push(chunk)
        seen += chunk
        if f.stopped:
            break
        partial = [
            n
            for n in range(1, len(seen) + 1)
            if any(s.startswith(seen[-n:]) and len(s) > n for s in stops)
        ]
        assert f.pending == (seen[-max(partial) :] if partial else "")


def test_matched_names_the_stop_that_ended_the_text():
    f = StopFilter(["END", "STOP"])
    assert f.push("abc ST") == "abc "
    assert f.matched is None
    assert f.push("OP more") == "" and f.stopped and f.matched == "STOP"
