"""Tool-call text formats, one module per family (see docs/FORMATS.md "Tool calls").

A format knows the markers that open a call block, where a block ends, and how to read the calls
in a complete block; the streaming machinery around it is shared (chat/toolcalls.py).
"""

from __future__ import annotations

from colibri.chat.toolformats.base import Parsed, ToolFormat
from colibri.chat.toolformats.deepseek import DEEPSEEK_V31, DSML, DSML_V4
from colibri.chat.toolformats.glm import GLM_XML
from colibri.chat.toolformats.kimi import KIMI_K2
from colibri.chat.toolformats.qwen import QWEN3_CALLS

FORMATS: dict[str, ToolFormat] = {
    f.name: f for f in (GLM_XML, QWEN3_CALLS, DEEPSEEK_V31, DSML, DSML_V4, KIMI_K2)
}

__all__ = [
    "DEEPSEEK_V31",
    "DSML",
    "DSML_V4",
    "FORMATS",
    "GLM_XML",
    "KIMI_K2",
    "QWEN3_CALLS",
    "Parsed",
    "ToolFormat",
]
