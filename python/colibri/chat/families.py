"""What the gateway must know about a model family beyond its chat template.

See docs/FORMATS.md ("Chat families") and ../shared/design/TOOL-FORMATS.md. A family is chosen
from the template text, else from the architecture (the engine registry's chat family for it,
``_engine.architectures()``); ``--chat-family`` overrides it for checkpoints whose
template says nothing recognisable.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from colibri.chat.toolformats import (
    DEEPSEEK_V31,
    DSML,
    DSML_V4,
    GLM_XML,
    KIMI_K2,
    QWEN3_CALLS,
    ToolFormat,
)

_TEMPLATES = Path(__file__).parent / "templates"


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
    # How the family writes tool calls (None: no tool calling).
    tool_format: ToolFormat | None = None
    # Whether the template wants history `arguments` as a mapping (else the JSON string).
    arguments_as_mapping: bool = True
    # colibri's own template (chat/templates/) for checkpoints that ship none: the families
    # whose vendor publishes the chat format as code instead (DeepSeek-V3.2 and V4).
    builtin_template: str | None = None

    def builtin_template_source(self) -> str | None:
        if self.builtin_template is None:
            return None
        return (_TEMPLATES / self.builtin_template).read_text("utf-8")

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


GLM = Family(
    "glm",
    "<|assistant|>",
    reasoning=True,
    implicit_stops=("<|user|>", "<|observation|>"),
    tool_format=GLM_XML,
)
QWEN3 = Family("qwen3", "<|im_start|>assistant", reasoning=True, tool_format=QWEN3_CALLS)
DEEPSEEK_V3_1 = Family(
    "deepseek_v31",
    "<｜Assistant｜>",
    reasoning=True,
    tool_format=DEEPSEEK_V31,
    arguments_as_mapping=False,
)
DEEPSEEK_V3_2 = Family(
    "deepseek_v32",
    "<｜Assistant｜>",
    reasoning=True,
    tool_format=DSML,
    builtin_template="deepseek_v32.jinja",
)
DEEPSEEK_V4 = Family(
    "deepseek_v4",
    "<｜Assistant｜>",
    reasoning=True,
    tool_format=DSML_V4,
    builtin_template="deepseek_v4.jinja",
)
KIMI = Family(
    "kimi_k2",
    "<|im_assistant|>",
    reasoning=True,
    tool_format=KIMI_K2,
    arguments_as_mapping=False,
)
OLMOE = Family("olmoe", "<|assistant|>", reasoning=False)
FAMILIES = {f.name: f for f in (GLM, QWEN3, DEEPSEEK_V3_1, DEEPSEEK_V3_2, DEEPSEEK_V4, KIMI, OLMOE)}


def detect_family(architecture: str, chat_template: str | None) -> Family:
    """The family of a model: its template's markers first, then its architecture."""
    t = chat_template or ""
    if "DSML" in t:
        # V3.2 names its call block function_calls; V4's templates never mention that name.
        return DEEPSEEK_V3_2 if "function_calls" in t else DEEPSEEK_V4
    if "tool▁calls▁begin" in t or "<｜Assistant｜>" in t:
        return DEEPSEEK_V3_1
    if "tool_calls_section_begin" in t or "<|im_middle|>" in t:
        return KIMI
    if "<|observation|>" in t or "[gMASK]" in t:
        return GLM
    if "<|im_start|>" in t and ("<think>" in t or "<tool_call>" in t):
        return QWEN3
    return FAMILIES.get(architecture_families().get(architecture, ""), OLMOE)


@cache
def architecture_families() -> dict[str, str]:
    """The chat family of each architecture the engine runs, from its registry."""
    from colibri import _engine

    return dict(_engine.architectures())


def family_by_name(name: str) -> Family:
    try:
        return FAMILIES[name]
    except KeyError:
        raise ValueError(
            f"unknown chat family {name!r} (known: {', '.join(sorted(FAMILIES))})"
        ) from None
