"""The demo tokenizer: byte-level BPE trained on rendered synthetic conversations, digits one per
token, the GLM special tokens each one token."""

from __future__ import annotations

import random

from .config import PRETOKEN_PATTERN, SPECIAL_TOKENS, VOCAB_SIZE
from .repo import demo_data


def _split_specials(text: str) -> list[str]:
    parts = [text]
    for tok in SPECIAL_TOKENS:
        parts = [p for chunk in parts for p in chunk.split(tok)]
    return [p for p in parts if p]


def build_tokenizer(template, seed: int):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKEN_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=20,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    rng = random.Random(seed + 1)
    texts = []
    for _ in range(20000):
        conv = demo_data.train_conversation(rng)
        full = template.render(
            conv["messages"], add_generation_prompt=False, tools=conv["tools"], enable_thinking=True
        )
        texts += _split_specials(full)
    # The digits are pre-tokens of their own, so no merge ever joins them.
    tok.train_from_iterator(texts, trainer=trainer)
    tok.add_special_tokens(SPECIAL_TOKENS)  # matched before BPE, never split or merged
    for t in SPECIAL_TOKENS:
        assert tok.encode(t).ids == [tok.token_to_id(t)], t
    return tok
