"""Which target made a cache: the fields of its provenance that identify the model.

Two caches of different targets (the built-in tiny Qwen3.5 and Qwen3 share hidden size and
vocabulary) pass every shape check, so ``hscache diff`` would report their distance as "drift";
``scorer eval`` would score a drafter of one on the other. Both compare these fields: the target's
weights sha256, its model type and its tokenizer's sha256, as the extraction recorded them
(capture/provenance.py). An imported cache records none of them (it has no model section).
"""

from __future__ import annotations

from typing import Any

__all__ = ["IDENTITY_FIELDS", "cache_target_identity", "identity_differences", "target_name"]

# What identifies a target: its weights, its architecture, and how text becomes token ids.
IDENTITY_FIELDS = ("weights_sha256", "model_type", "tokenizer_sha256")


def cache_target_identity(cache: Any) -> dict[str, str]:
    """The identity fields the cache's provenance records (a ``CacheView``; an import may record none)."""
    model = (cache.provenance or {}).get("model") or {}
    return {k: str(model[k]) for k in IDENTITY_FIELDS if model.get(k) not in (None, "", "unknown")}


def target_name(cache: Any) -> str:
    """What the cache says its target is called (``--model`` as given), for messages."""
    model = (cache.provenance or {}).get("model") or {}
    return str(model.get("name") or cache.settings.get("model") or "an unrecorded target")


def _short(value: str) -> str:
    return value[:12] if len(value) == 64 else value  # sha256 digests: a prefix is enough to tell


def identity_differences(a: dict[str, str], b: dict[str, str]) -> list[str]:
    """``"field: A-value vs B-value"`` for each field both record and that differs."""
    return [
        f"{k} {_short(a[k])} vs {_short(b[k])}" for k in IDENTITY_FIELDS if k in a and k in b and a[k] != b[k]
    ]
