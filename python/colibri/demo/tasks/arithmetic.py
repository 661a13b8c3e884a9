"""2-digit addition: the question phrasings, the fixed split of the number pairs (10% held out for
the evaluation, ``EVAL_PAIRS``) and the digit-wise trace."""

from __future__ import annotations

import random

ARITH_TRAIN_QUESTIONS = [
    "What is {a} + {b}?",
    "What's {a} + {b}?",
    "What is {a} plus {b}?",
    "Compute {a} + {b}.",
    "Calculate {a} + {b}.",
    "{a} + {b} = ?",
    "{a}+{b}=?",
    "Add {a} and {b}.",
    "What do you get if you add {a} and {b}?",
    "How much is {a} + {b}?",
    "What is the sum of {a} and {b}?",
    "{a} + {b}?",
]
ARITH_EVAL_QUESTIONS = ARITH_TRAIN_QUESTIONS  # the held-out part is the pair of numbers


def _split_pairs() -> frozenset[tuple[int, int]]:
    pairs = [(a, b) for a in range(10, 100) for b in range(a, 100)]
    random.Random(5).shuffle(pairs)  # fixed: the split never depends on a caller's seed
    return frozenset(pairs[: len(pairs) // 10])


EVAL_PAIRS = _split_pairs()


def is_eval_pair(a: int, b: int) -> bool:
    return (min(a, b), max(a, b)) in EVAL_PAIRS


def addition_trace(a: int, b: int) -> str:
    """Digit-wise addition with carry, e.g. ``7 + 8 = 15, carry 1. 3 + 4 + 1 = 8. 37 + 48 = 85.``"""
    u = a % 10 + b % 10
    t = a // 10 + b // 10 + u // 10
    return (
        f"{a % 10} + {b % 10} = {u}, carry {u // 10}. {a // 10} + {b // 10} + {u // 10} = {t}. "
        f"{a} + {b} = {a + b}."
    )
