"""What the model trains on: conversations encoded with the mask of the tokens the loss is taken
on (each turn's label, for the loss of each task), and the endless streams of batches (short
conversations, and one-conversation batches behind a long agent preamble)."""

from __future__ import annotations

import random

from .repo import demo_data, demo_preamble

# Labels of the loss-carrying tokens, for the loss of each task in the log: the turn's kind,
# with "/think" when the turn was generated with thinking on.
LOSS_LABELS = [k + t for k in demo_data.TURN_KINDS for t in ("", "/think")]


def encode_conversation(tok, template, conv: dict) -> tuple[list[int], list[int]]:
    """Token ids of a rendered conversation and a parallel mask of what the model generates:
    for each assistant message, the text after the generation prompt (thinking on or off as that
    turn had it) up to and including the marker that ends the turn. The mask is 0 elsewhere and
    1 + the turn's index in ``LOSS_LABELS`` on those tokens."""
    msgs, tools = conv["messages"], conv["tools"]
    ids: list[int] = []
    mask: list[int] = []
    done = ""
    turn = 0

    def add(text: str, m: int) -> None:
        nonlocal done
        if text:
            t = tok.encode(text).ids
            ids.extend(t)
            mask.extend([m] * len(t))
            done += text

    for i, msg in enumerate(msgs):
        if msg["role"] != "assistant":
            continue
        think = conv["thinking"][turn]
        label = 1 + LOSS_LABELS.index(conv["kinds"][turn] + ("/think" if think else ""))
        turn += 1
        prompt = template.render(
            msgs[:i], add_generation_prompt=True, tools=tools, enable_thinking=think
        )
        upto = template.render(
            msgs[: i + 1], add_generation_prompt=False, tools=tools, enable_thinking=think
        )
        assert prompt.startswith(done) and upto.startswith(prompt), (prompt, upto)
        add(prompt[len(done) :], 0)
        # The marker that ends the turn is where the next message's render starts. A tool call
        # always ends on <|observation|>, also when the conversation stops at the call (before
        # run 26 those calls were trained to end on <|user|>: a quarter of the calls).
        end = "<|observation|>" if msg.get("tool_calls") else "<|user|>"
        add(upto[len(prompt) :] + end, label)
    return ids, mask


def name_pieces(
    tok,
    short_p: float = 0.0,
    share: float | None = None,
    near_miss: float = 0.0,
    drill: float = 0.0,
):
    """The tokenizer's letter pieces, for training city names made of them."""
    return demo_data.NamePieces(
        [tok.decode([i]) for i in range(tok.get_vocab_size())],
        short_p=short_p,
        share=share,
        near_miss=near_miss,
        drill=drill,
    )


def batches(
    rng: random.Random,
    tok,
    template,
    tokens: int,
    max_len: int,
    pieces_after: int,
    short_p: float = 0.0,
    piece_share: float | None = None,
    near_miss: float = 0.0,
    trailing: bool = False,
    drill: float = 0.0,
    arith_weight: int | None = None,
    tool_extra: int = 0,
):
    """Endless batches of (input ids, mask) lists, about ``tokens`` tokens each once padded:
    conversations are drawn 512 at a time, sorted by length (little padding), cut into batches
    and the batches shuffled. Cities strung from tokenizer pieces join the data once
    ``pieces_after`` batches are out: with them from the start, the copying circuit never formed
    (run 5: 0% on the training pool's own names); formed on name-like cities first, they then
    extend it to every piece."""
    pieces = name_pieces(tok, short_p=short_p, share=piece_share, near_miss=near_miss, drill=drill)
    mix = demo_data.train_mix(arith_weight)
    served = 0
    while True:
        pool = []
        while len(pool) < 512:
            conv = demo_data.train_conversation(
                rng,
                pieces if served >= pieces_after else None,
                trailing=trailing,
                mix=mix,
                tool_extra=tool_extra,
            )
            ids, mask = encode_conversation(tok, template, conv)
            if len(ids) <= max_len:
                pool.append((ids, mask))
        pool.sort(key=lambda s: len(s[0]))
        chunks, cur = [], []
        for s in pool:
            if cur and len(s[0]) * (len(cur) + 1) > tokens:
                chunks.append(cur)
                cur = []
            cur.append(s)
        chunks.append(cur)
        rng.shuffle(chunks)
        for chunk in chunks:
            served += 1
            yield chunk


def long_batches(
    rng: random.Random,
    tok,
    template,
    min_tokens: int,
    max_tokens: int,
    max_len: int,
    episodes: tuple[int, int],
    pieces,
    chars_per_token: float,
    long_bias: float = 0.5,
    trailing: bool = False,
    arith_weight: int | None = None,
    tool_extra: int = 0,
):
    """Endless batches of one conversation each whose prompt opens with an agent preamble
    (``demo_preamble.long_train_conversation``) of ``min_tokens``-``max_tokens`` tokens (uniform;
    with ``long_bias`` of the draws from the upper half of the range, where the evaluation is)
    and ``episodes`` (low, high) trained episodes after it; at most ``max_len`` tokens in all."""
    mix = demo_data.train_mix(arith_weight)
    while True:
        lo = min_tokens if rng.random() >= long_bias else (min_tokens + max_tokens) // 2
        target = rng.randint(lo, max_tokens)
        conv = demo_preamble.long_train_conversation(
            rng,
            int(target * chars_per_token),
            rng.randint(*episodes),
            pieces,
            trailing=trailing,
            mix=mix,
            tool_extra=tool_extra,
        )
        ids, mask = encode_conversation(tok, template, conv)
        if len(ids) <= max_len:
            yield [(ids, mask)]
