"""Text a client carries for the server: reasoning sent back in an opaque field (Anthropic's
thinking ``signature``, the Responses API's ``encrypted_content``), so a client that did not
keep or show the text still hands the model its own history. Sealed, not encrypted: the text
compressed and base64-encoded behind a tag (a local server has nobody to hide it from), stable
(same text, same seal) and reversible; a value sealed elsewhere is simply not ours."""

from __future__ import annotations

import base64
import binascii
import zlib


def seal(text: str, tag: bytes) -> str:
    return base64.b64encode(tag + zlib.compress(text.encode(), 9)).decode()


def unseal(value: str, tag: bytes) -> str | None:
    """The text ``value`` carries, or None when it is not a seal of ours under ``tag``."""
    try:
        raw = base64.b64decode(value, validate=True)
        if not raw.startswith(tag):
            return None
        return zlib.decompress(raw[len(tag) :]).decode()
    except (binascii.Error, ValueError, zlib.error, UnicodeDecodeError):
        return None
