"""A target model directory's ``config.json``: read once, bounded, checked, in one line when bad.

``hscache extract --model DIR``, ``hscache import --target DIR`` and the vLLM engine read the target's
config before (or instead of) transformers does: a file that is not a JSON object (``[1,2]``,
``{bad``, 100,000 levels of nesting), a FIFO in its place, or a shape field that is missing or not a
positive integer is refused naming the file and the field, never a KeyError/RecursionError (issue 52).
Torch-free (the extract preflight imports it).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from hscache.errors import InputError
from hscache.store import jsonio

__all__ = ["config_int", "read_model_config", "require_int", "text_config"]

_MAX_CONFIG_BYTES = 16 << 20  # real configs are a few KB; this bounds what is parsed


def read_model_config(directory: str | Path, flag: str) -> dict[str, Any]:
    """The JSON object in ``directory/config.json`` (``flag`` names the option that gave it).

    Raises:
        InputError: unreadable, not a regular file, too big, not JSON or not an object.
    """
    path = Path(directory) / "config.json"
    try:
        config = jsonio.read_object(path, max_bytes=_MAX_CONFIG_BYTES)
    except jsonio.JsonObjectError as exc:
        hint = "; pass a Hugging Face model directory" if "not an object" in str(exc) else ""
        raise InputError(f"{flag} {directory}: {exc}{hint}") from None
    return config


def text_config(config: dict[str, Any]) -> dict[str, Any]:
    """The language model's part of ``config`` (a multimodal model's ``text_config``)."""
    text = config.get("text_config")
    return text if isinstance(text, dict) else config


def config_int(config: dict[str, Any], key: str) -> int | None:
    """The positive integer ``key`` of ``config``'s text part (or of ``config``); None when absent or
    not a positive integer."""
    value = text_config(config).get(key, config.get(key))
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def require_int(config: dict[str, Any], key: str, where: str) -> int:
    """``config_int``, or an InputError naming ``where`` (the file) and the field.

    Raises:
        InputError: ``key`` is missing or not a positive integer.
    """
    value = config_int(config, key)
    if value is None:
        found = text_config(config).get(key, config.get(key))
        shown = "missing" if found is None else json.dumps(found)[:60]
        raise InputError(f"{where}: {key} is {shown}, not a positive integer; the model config is damaged")
    return value
