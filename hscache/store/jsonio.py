"""Parse JSON from files a cache, a prompts file or a checkpoint holds: damage is a ValueError.

``json.loads`` raises ``RecursionError`` on input nested a few thousand levels deep (100,000
levels of ``[`` is a 100 KB file): that is bad input, not a bug, so it becomes the same
``json.JSONDecodeError`` every caller already turns into one line.
"""

from __future__ import annotations

import json
from typing import Any

__all__ = ["loads"]


def loads(text: str | bytes) -> Any:
    """``json.loads(text)``; input nested too deeply raises ``json.JSONDecodeError`` too.

    Raises:
        json.JSONDecodeError: not JSON, or nested too deeply to parse.
        UnicodeDecodeError: bytes that are not UTF-8.
    """
    try:
        return json.loads(text)
    except RecursionError:
        doc = text if isinstance(text, str) else text[:64].decode("utf-8", "replace")
        raise json.JSONDecodeError("nested too deeply to parse", doc, 0) from None
