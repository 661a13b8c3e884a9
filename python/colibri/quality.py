"""How good a model's next-token predictions are on a text: perplexity, and the KL divergence of
its next-token distributions from a reference model's (the same weights at f32, say).

Counted the way llama.cpp's ``llama-perplexity`` counts, so the two tools' figures on the same
text and tokens compare: the tokens are cut into chunks of ``ctx`` (a remainder shorter than a
chunk is dropped), each chunk is one forward pass from an empty context (its first token
replaced by BOS when the tokenizer adds one), and only the second half of each chunk is scored:
the logits at positions ``ctx // 2 .. ctx - 2`` predicting the token after each. Perplexity is
``exp`` of the mean negative log-likelihood, with llama.cpp's uncertainty estimate; the KL
divergence is ``KL(reference || model)`` per scored position, summed in float64 (llama.cpp keeps
the reference's log-probabilities at 16 bits; here they are exact), with how often both put the
same token on top.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from typing import Any, Protocol

import numpy as np


class LogitsModel(Protocol):
    def logits(self, ids: list[int]) -> np.ndarray: ...


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """Row-wise log-softmax in float64 (max subtracted)."""
    x = np.asarray(logits, dtype=np.float64)
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def kl_divergence(ref_logp: np.ndarray, logp: np.ndarray) -> np.ndarray:
    """``KL(P_ref || P)`` per row from log-probabilities (float64; 0 log 0 counts as 0)."""
    p = np.exp(ref_logp)
    return np.where(p > 0, p * (ref_logp - logp), 0.0).sum(axis=-1)


def chunks(tokens: list[int], ctx: int) -> Iterator[list[int]]:
    """The whole chunks of ``ctx`` tokens, in order."""
    for start in range(0, len(tokens) - ctx + 1, ctx):
        yield tokens[start : start + ctx]


@dataclass
class Quality:
    """One model's figures on one text (``kl_*`` and ``same_top`` only with a reference)."""

    ctx: int
    chunks: int
    scored_tokens: int
    ppl: float
    ppl_err: float
    mean_nll: float
    kl_mean: float | None = None
    kl_err: float | None = None
    kl_max: float | None = None
    kl_p99: float | None = None
    same_top: float | None = None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def evaluate(
    model: LogitsModel,
    tokens: list[int],
    ctx: int,
    reference: LogitsModel | None = None,
    bos: int | None = None,
    max_chunks: int | None = None,
) -> Quality:
    """``model``'s figures on ``tokens`` in chunks of ``ctx`` (see the module doc); with
    ``reference``, also the KL divergence from it at every scored position."""
    if ctx < 4:
        raise ValueError(f"the chunk length must be at least 4 tokens (got {ctx})")
    if len(tokens) < ctx:
        raise ValueError(
            f"the text has {len(tokens)} tokens, fewer than one chunk of {ctx}: "
            "use a longer text or a shorter --ctx"
        )
    first = ctx // 2
    nll: list[np.ndarray] = []
    kls: list[np.ndarray] = []
    same = 0
    n_chunks = 0
    for chunk in chunks(tokens, ctx):
        if max_chunks is not None and n_chunks >= max_chunks:
            break
        n_chunks += 1
        ids = list(chunk)
        if bos is not None:
            ids[0] = bos
        logp = log_softmax(model.logits(ids)[first : ctx - 1])
        targets = np.asarray(ids[first + 1 : ctx])
        nll.append(-logp[np.arange(len(targets)), targets])
        if reference is not None:
            ref_logp = log_softmax(reference.logits(ids)[first : ctx - 1])
            kls.append(kl_divergence(ref_logp, logp))
            same += int((ref_logp.argmax(axis=-1) == logp.argmax(axis=-1)).sum())
    all_nll = np.concatenate(nll)
    n = len(all_nll)
    mean = float(all_nll.mean())
    # llama.cpp's estimate: the standard error of the mean NLL, carried through exp.
    var = float((all_nll**2).mean()) - mean * mean
    err = math.sqrt(var / (n - 1)) if n > 1 and var > 0 else 0.0
    q = Quality(
        ctx=ctx,
        chunks=n_chunks,
        scored_tokens=n,
        ppl=math.exp(mean),
        ppl_err=math.exp(mean) * err,
        mean_nll=mean,
    )
    if reference is not None:
        kl = np.concatenate(kls)
        q.kl_mean = float(kl.mean())
        q.kl_err = float(kl.std(ddof=1) / math.sqrt(n)) if n > 1 else 0.0
        q.kl_max = float(kl.max())
        q.kl_p99 = float(np.percentile(kl, 99))
        q.same_top = same / n
    return q
