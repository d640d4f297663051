"""Parse JSON from files a cache, a prompts file or a checkpoint holds: damage is a ValueError.

``json.loads`` raises ``RecursionError`` on input nested a few thousand levels deep (100,000
levels of ``[`` is a 100 KB file): that is bad input, not a bug, so it becomes the same
``json.JSONDecodeError`` every caller already turns into one line. `load_cache_object` is that line
for the JSON objects a cache holds (manifest, provenance, the target's config); `read_object` reads
a JSON object from a file a user names (a model's config.json, a checkpoint's), its callers adding
which option gave the file and which error class says so.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from hscache.errors import CacheFormatError
from hscache.store.fsio import read_regular

__all__ = ["JsonObjectError", "first_surrogate", "load_cache_object", "loads", "read_object"]


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
    except json.JSONDecodeError:
        raise
    except ValueError as exc:  # an integer of more than 4300 digits (sys.set_int_max_str_digits)
        doc = text if isinstance(text, str) else text[:64].decode("utf-8", "replace")
        raise json.JSONDecodeError(f"a number too long to parse ({str(exc)[:80]})", doc, 0) from None


def load_cache_object(data: bytes, where: str | Path) -> dict[str, Any]:
    """The JSON object in ``data``, the bytes of the cache file ``where`` (named in the error).

    Raises:
        CacheFormatError: not JSON (or not UTF-8), or JSON but not an object: the cache is damaged.
    """
    try:
        value = loads(data)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CacheFormatError(f"{where} is not valid JSON ({exc}); the cache is damaged") from exc
    if not isinstance(value, dict):
        raise CacheFormatError(f"{where} is not a JSON object; the cache is damaged")
    return value


class JsonObjectError(ValueError):
    """``read_object``'s one-line reason (``"<path> is not valid JSON (...)"``); callers re-raise it as
    their own error class, with the option that named the file in front."""


def read_object(path: str | Path, max_bytes: int | None = None) -> dict[str, Any]:
    """The JSON object in the regular file ``path`` (never a FIFO's wait: ``fsio.read_regular``),
    refused past ``max_bytes`` before it is read.

    Raises:
        JsonObjectError: unreadable, not a regular file, too big, not JSON (or not UTF-8), or JSON
            but not an object.
    """
    path = Path(path)
    try:
        if max_bytes is not None and (size := path.stat().st_size) > max_bytes:
            raise JsonObjectError(f"{path} holds {size} bytes, more than a JSON config ({max_bytes})")
        value = loads(bytes(read_regular(path)))
    except OSError as exc:
        raise JsonObjectError(f"{path} cannot be read ({exc.strerror or exc})") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise JsonObjectError(f"{path} is not valid JSON ({str(exc)[:200]})") from None
    if not isinstance(value, dict):
        raise JsonObjectError(f"{path} holds a JSON {type(value).__name__}, not an object")
    return value


def first_surrogate(value: Any) -> str | None:
    """The first string in the parsed JSON ``value`` (keys included) that holds a lone surrogate
    (``"\\ud800"`` parses, but cannot be written as UTF-8 into an index or a report), else None."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                return item.encode("utf-8", "backslashreplace").decode()[:60]
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return None
