"""What the gateway must know about a model family beyond its chat template.

See docs/FORMATS.md ("Chat families") and ../shared/design/TOOL-FORMATS.md. A family is chosen
from the architecture and the template text; ``--chat-family`` overrides it for checkpoints whose
template says nothing recognisable.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Family:
    name: str
    # The text that opens an assistant turn in a rendered prompt: where to look for an open
    # <think> block at the end of a prompt.
    assistant_marker: str
    # Whether the family has a <think> reasoning mode that `enable_thinking` switches on.
    reasoning: bool
    # Role markers that end a model-completed turn: implicit text stops for chat requests that
    # bring no stop of their own (leading ones are ignored).
    implicit_stops: tuple[str, ...] = ()
    open_think: str = "<think>"
    close_think: str = "</think>"

    def chat_stops(
        self,
        client_stops: Sequence[str],
        ignore_leading: bool,
        eos_ids: Sequence[int],
        token_id: Callable[[str], int | None],
    ) -> tuple[list[str], bool, list[int]]:
        """(text stops, ignore leading matches, stop token ids) for a chat request.

        Without client stops, the family's role markers end a turn the model completed on its
        own; leading ones (a marker before any answer) are skipped, so they become text stops
        and leave the token stop set even when the config lists them as EOS.
        """
        if client_stops or not self.implicit_stops:
            return list(client_stops), ignore_leading, list(eos_ids)
        marker_ids = {token_id(m) for m in self.implicit_stops}
        return list(self.implicit_stops), True, [t for t in eos_ids if t not in marker_ids]


GLM = Family("glm", "<|assistant|>", reasoning=True, implicit_stops=("<|user|>", "<|observation|>"))
QWEN3 = Family("qwen3", "<|im_start|>assistant", reasoning=True)
OLMOE = Family("olmoe", "<|assistant|>", reasoning=False)
FAMILIES = {f.name: f for f in (GLM, QWEN3, OLMOE)}


def detect_family(architecture: str, chat_template: str | None) -> Family:
    """The family of a model: its template's markers first, then its architecture."""
    t = chat_template or ""
    if "<|observation|>" in t or "[gMASK]" in t:
        return GLM
    if "<|im_start|>" in t and "<think>" in t:
        return QWEN3
    if architecture == "Glm4MoeForCausalLM":
        return GLM
    if architecture == "Qwen3MoeForCausalLM":
        return QWEN3
    return OLMOE


def family_by_name(name: str) -> Family:
    try:
        return FAMILIES[name]
    except KeyError:
        raise ValueError(
            f"unknown chat family {name!r} (known: {', '.join(sorted(FAMILIES))})"
        ) from None
