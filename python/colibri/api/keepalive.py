"""How often an idle stream says it is alive (Anthropic's ``ping`` events, and the comments
of a stream waiting for its model to load)."""

from __future__ import annotations

import logging
import os


def _ping_interval() -> float:
    """``COLI_SSE_PING_S`` (default 5): a ping at least this often while nothing else is sent,
    so clients with idle timeouts keep the stream. Bad values fall back to the default."""
    raw = os.environ.get("COLI_SSE_PING_S", "5")
    try:
        value = float(raw)
    except ValueError:
        value = 0.0
    if not 0.001 <= value <= 10:
        logging.getLogger("colibri.server").warning(
            "COLI_SSE_PING_S=%r is not a number of seconds in [0.001, 10]; using 5", raw
        )
        return 5.0
    return value


PING_INTERVAL_S = _ping_interval()
