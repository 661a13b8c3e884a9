"""From options' log-probabilities to a choice: the softmax over the options only, the
normalised entropy that says how sure the model is, and the orderings the replies use."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

# Below this normalised entropy the model is confident; above UNSURE it is a coin flip
# (docs/API.md, "Reading the entropy").
CONFIDENT = 0.4
UNSURE = 0.8


@dataclass(frozen=True)
class OptionRead:
    """One option as the engine read it: the sum of its tokens' natural-log probabilities
    after the prompt, and how many tokens it has."""

    option: str
    logprob: float
    tokens: int

    @property
    def mean_logprob(self) -> float:
        return self.logprob / max(self.tokens, 1)

    def score(self, normalize: str) -> float:
        """The option's score: its ``sum`` or ``mean`` log-probability."""
        return self.mean_logprob if normalize == "mean" else self.logprob


def softmax(scores: Sequence[float], temperature: float = 1.0) -> list[float]:
    """``exp(s_i / T - max) / sum`` over the scores (the options only); the largest score is
    taken out first, so any finite scores give finite probabilities summing to 1."""
    if not scores:
        return []
    scaled = [s / temperature for s in scores]
    top = max(scaled)
    weights = [math.exp(s - top) for s in scaled]
    total = sum(weights)
    return [w / total for w in weights]


def entropy(probs: Sequence[float]) -> float:
    """The entropy of ``probs`` divided by its largest possible value, ``ln n`` (``ln 2`` for a
    single option): 0 when one option has everything, 1 when all are equal. Rounded to 6 dp."""
    h = -sum(p * math.log(max(p, 1e-12)) for p in probs)
    return round(h / math.log(max(len(probs), 2)), 6)


def confidence(probs: Sequence[float]) -> float:
    """``(n * p_max - 1) / (n - 1)`` clipped at 0: 1 when one option has everything, 0 at the
    uniform distribution (equal to "top minus the mean of the rest"); 1 for fewer than two."""
    n = len(probs)
    if n < 2:
        return 1.0
    return max(0.0, (n * max(probs) - 1) / (n - 1))


def ranked(probs: Sequence[float]) -> list[int]:
    """Indices by probability, highest first; ties keep their input order."""
    return sorted(range(len(probs)), key=lambda i: -probs[i])
