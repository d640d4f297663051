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
from hscache.store.fsio import read_regular

__all__ = ["config_int", "read_model_config", "require_int", "text_config"]

_MAX_CONFIG_BYTES = 16 << 20  # real configs are a few KB; this bounds what is parsed


def read_model_config(directory: str | Path, flag: str) -> dict[str, Any]:
    """The JSON object in ``directory/config.json`` (``flag`` names the option that gave it).

    Raises:
        InputError: unreadable, not a regular file, too big, not JSON or not an object.
    """
    path = Path(directory) / "config.json"
    try:
        size = path.stat().st_size
        if size > _MAX_CONFIG_BYTES:
            raise InputError(f"{flag} {directory}: {path} holds {size} bytes, not a model config")
        config = jsonio.loads(bytes(read_regular(path)))
    except OSError as exc:
        raise InputError(f"{flag} {directory}: {path} cannot be read ({exc.strerror or exc})") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise InputError(f"{flag} {directory}: {path} is not valid JSON ({str(exc)[:200]})") from None
    if not isinstance(config, dict):
        raise InputError(
            f"{flag} {directory}: {path} holds a JSON {type(config).__name__}, not an object; "
            "pass a Hugging Face model directory"
        )
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
