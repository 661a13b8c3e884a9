"""City names strung from the demo tokenizer's letter pieces, and near misses of known names:
training's cities beyond the fixed tables (``NamePieces``), never one the evaluation holds out."""

from __future__ import annotations

import random

from .eval_items import EVAL_SEED
from .tasks.capitals import CAPITALS
from .tasks.cities import EVAL_CITIES, TRAIN_CITIES, eval_city_names, train_city_pool


class NamePieces:
    """The letter pieces of the model's tokenizer, to build city names from.

    Copying a name means copying its tokens; a piece that training names never contain is a piece
    the model never practised copying (the real cities of the evaluation are cut into pieces the
    tokenizer learned from other words: "Galway" ends in "way" of "Norway"). Names strung from
    random pieces make every piece a copy target. ``pieces`` are the tokenizer's tokens that
    decode to letters only; names start with a capitalised piece like real names do.
    """

    def __init__(
        self,
        pieces: list[str],
        short_p: float = 0.0,
        share: float | None = None,
        near_miss: float = 0.0,
        drill: float = 0.0,
    ) -> None:
        letters = sorted({p for p in pieces if p.isalpha()})
        self.initial = [p for p in letters if p[0].isupper()]
        self.inner = [p for p in letters if p[0].islower()]
        if not self.initial or not self.inner:
            raise ValueError("the tokenizer has no capitalised or no lower-case letter pieces")
        # Real names are mostly a lone capital letter then short pieces ("O|den|se",
        # "G|al|way"): the tokenizer merged long pieces from the generated names, so a uniform
        # draw practises those. With ``short_p`` > 0, that share of the pieces is drawn from the
        # short ones (a lone capital first, at most two letters after).
        self.short_p = short_p
        # Share of the training cities strung from these pieces (``PIECE_NAME_P`` by default).
        self.share = PIECE_NAME_P if share is None else share
        self.short_initial = [p for p in self.initial if len(p) == 1] or self.initial
        self.short_inner = [p for p in self.inner if len(p) <= 2] or self.inner
        # Share of the other cities (not strung) that are near misses of a known name.
        self.near_miss = near_miss
        # Share of the episodes that are copy drills (``COPY_DRILL_QUESTIONS``).
        self.drill = drill
        self._held_out = set(EVAL_CITIES) | set(eval_city_names(1000, EVAL_SEED))

    def _piece(self, rng: random.Random, every: list[str], short: list[str]) -> str:
        # No draw at all when off: the stream of names stays what it was before short pieces.
        if self.short_p > 0 and rng.random() < self.short_p:
            return rng.choice(short)
        return rng.choice(every)

    def name(self, rng: random.Random) -> str:
        while True:
            n = rng.choice([1, 2, 2, 3, 3, 4])
            word = self._piece(rng, self.initial, self.short_initial) + "".join(
                self._piece(rng, self.inner, self.short_inner) for _ in range(n - 1)
            )
            if len(word) >= 3 and word not in self._held_out:
                return word

    def near_miss_name(self, rng: random.Random) -> str:
        """A name that starts like one the model learns by heart and then goes elsewhere: the
        known name's first letters, then the tail of another known name, one or two pieces, or
        nothing (it ends early). Copying a held-out city fails exactly there: the model copies
        "Cór" of "Córdoba" and goes on with "hagen" of a name it knows ("Córhagena"); on these
        names, only the copy is right."""
        known = _known_cities()
        while True:
            head = rng.choice(known)
            if len(head) < 3:
                continue
            cut = rng.randrange(2, len(head))
            r = rng.random()
            if r < 0.5:
                other = rng.choice(known)
                tail = other[rng.randrange(1, len(other)) :] if len(other) > 1 else ""
            elif r < 0.8:
                tail = "".join(rng.choice(self.inner) for _ in range(rng.choice([1, 2])))
            else:
                tail = ""
            word = head[:cut] + tail
            if len(word) >= 3 and word[-1].isalpha() and word not in self._held_out:
                return word


def _known_cities() -> list[str]:
    """Every city name training shows as itself (the generated pool, the real ones, the capitals),
    in a fixed order."""
    return train_city_pool() + TRAIN_CITIES + list(CAPITALS.values())


# Share of training cities strung from tokenizer pieces when ``train_conversation`` gets them.
PIECE_NAME_P = 0.4
