"""colibri: run large Mixture-of-Experts language models on ordinary machines.

The public surface is small: :class:`Engine` (load a converted model, tokenize, score, generate)
and :func:`convert` (Hugging Face checkpoint -> colibri model directory).
"""

from colibri.runtime.engine import Engine, convert

__all__ = ["Engine", "convert"]
__version__ = "0.1.0"
