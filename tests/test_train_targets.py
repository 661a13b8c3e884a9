"""What the demo-model training script trains on: the loss-carrying tokens of a conversation are
exactly what the model must generate, each turn ending on the marker the server stops at.

The script is development-only (torch is imported lazily inside its training functions); its data
path (tokenizer, template, ``encode_conversation``) is plain Python and is tested here with the
shipped model's tokenizer."""

from __future__ import annotations

import random
import sys
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

from demo_training import batches as T  # noqa: E402  (the script's data path)
from demo_training.repo import TEMPLATE_PATH, chat_template  # noqa: E402

TOK = Tokenizer.from_file(str(ROOT / "python" / "colibri" / "demo" / "model" / "tokenizer.json"))
TEMPLATE = chat_template.ChatTemplate(TEMPLATE_PATH.read_text(encoding="utf-8"))
PIECES = T.name_pieces(TOK, drill=0.15)


def _spans(mask: list[int]) -> list[tuple[int, int, int]]:
    """(start, end, label) of each run of equal nonzero labels."""
    spans, i = [], 0
    while i < len(mask):
        if mask[i]:
            j = i
            while j < len(mask) and mask[j] == mask[i]:
                j += 1
            spans.append((i, j, mask[i]))
            i = j
        else:
            i += 1
    return spans


@settings(max_examples=150, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), with_pieces=st.booleans())
def test_each_trained_turn_ends_on_the_marker_the_server_stops_at(seed, with_pieces):
    conv = T.demo_data.train_conversation(
        random.Random(seed), PIECES if with_pieces else None, trailing=True
    )
    ids, mask = T.encode_conversation(TOK, TEMPLATE, conv)
    assert len(ids) == len(mask)
    assistants = [m for m in conv["messages"] if m["role"] == "assistant"]
    spans = _spans(mask)
    # One span per assistant turn (two turns never touch: a prompt lies between them).
    assert len(spans) == len(assistants) == len(conv["kinds"])
    for (start, end, label), msg, kind, think in zip(
        spans, assistants, conv["kinds"], conv["thinking"], strict=True
    ):
        assert T.LOSS_LABELS[label - 1] == kind + ("/think" if think else "")
        text = TOK.decode(ids[start:end], skip_special_tokens=False)
        # A tool call ends on <|observation|> even when the conversation stops at the call.
        marker = "<|observation|>" if msg.get("tool_calls") else "<|user|>"
        assert text.endswith(marker), (kind, text)
        body = text[: -len(marker)]
        assert "<|user|>" not in body and "<|observation|>" not in body
        if msg.get("tool_calls"):
            call = msg["tool_calls"][0]["function"]
            assert f"<tool_call>{call['name']}" in body
        else:
            assert msg["content"] in body
        if think:
            assert "<think>" in body and "</think>" in body


def test_a_conversation_that_stops_at_a_call_still_trains_the_observation_marker():
    # Conversations that end on the call exist in the stream (a quarter of the tool episodes).
    rng = random.Random(11)
    found = 0
    for _ in range(400):
        conv = T.demo_data.train_conversation(rng)
        if not conv["messages"][-1].get("tool_calls"):
            continue
        found += 1
        ids, mask = T.encode_conversation(TOK, TEMPLATE, conv)
        start, end, _ = _spans(mask)[-1]
        assert TOK.decode(ids[start:end], skip_special_tokens=False).endswith("<|observation|>")
    assert found >= 10
