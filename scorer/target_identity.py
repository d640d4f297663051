"""Which target a drafter was built for, recorded in its config and checked at eval.

The two built-in targets share hidden size and vocabulary, so the shape checks pass when a
drafter is scored on the other target's cache, and tau comes out near 1 with exit 0. ``scorer
init`` and ``scorer.families.dflash.train`` therefore write the cache's target identity into the drafter's
``config.json`` under ``hscache_target`` (the target's weights sha256, model type and tokenizer
sha256, as the cache's provenance records them); ``scorer eval`` compares every field both sides
know and refuses a difference unless ``--allow-target-mismatch``. A checkpoint without the record
(every published one) is scored with a note that the target could not be checked.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hscache.store.view import CacheView
from scorer.errors import IncompatibleCacheError

__all__ = [
    "IDENTITY_KEY",
    "IDENTITY_FIELDS",
    "TargetCheck",
    "cache_target_identity",
    "check_target",
    "loaded_target_identity",
    "recorded_target_identity",
]

IDENTITY_KEY = "hscache_target"
# What identifies a target: its weights, its architecture, and how text becomes token ids.
IDENTITY_FIELDS = ("weights_sha256", "model_type", "tokenizer_sha256")


def cache_target_identity(cache: CacheView) -> dict[str, str]:
    """The identity fields the cache's provenance records (an import may record none)."""
    model = (cache.provenance or {}).get("model") or {}
    return {k: str(model[k]) for k in IDENTITY_FIELDS if model.get(k) not in (None, "", "unknown")}


def loaded_target_identity(target: Any) -> dict[str, str]:
    """The same fields for a loaded ``hscache.capture.target.Target`` (``scorer online``), computed as
    the provenance of an extraction computes them."""
    from hscache.capture.provenance import tokenizer_sha256

    model_type = getattr(target.model.config, "model_type", None)
    identity = {
        "weights_sha256": target.weights_sha256,
        "model_type": model_type,
        "tokenizer_sha256": tokenizer_sha256(target.tokenizer),
    }
    return {k: str(v) for k, v in identity.items() if v not in (None, "", "unknown")}


def recorded_target_identity(checkpoint: str | os.PathLike, config_path: str | None = None) -> dict | None:
    """The ``hscache_target`` record of the drafter's config (``--config``, else ``config.json`` in
    a checkpoint directory); None when there is none. The config itself was already read and
    validated by the checkpoint loader, so a broken file here means "no record"."""
    path = Path(config_path) if config_path else Path(checkpoint) / "config.json"
    if not path.is_file():
        return None
    try:
        record = json.loads(path.read_text()).get(IDENTITY_KEY)
    except (ValueError, AttributeError, RecursionError):
        return None
    if not isinstance(record, dict):
        return None
    return {k: str(record[k]) for k in IDENTITY_FIELDS if record.get(k)}


@dataclass(frozen=True)
class TargetCheck:
    """Outcome of comparing the drafter's recorded target with the cache's.

    ``status``: "match" (every field both know is equal), "mismatch" (scored anyway with
    ``--allow-target-mismatch``) or "unknown" (nothing to compare).
    """

    status: str
    recorded: dict[str, str] | None
    cache: dict[str, str]
    differences: list[str] = field(default_factory=list)

    def message(self) -> str | None:
        """The line the report shows: a warning for a mismatch, a note for unknown, None for a match."""
        if self.status == "mismatch":
            return (
                "the drafter was built for another target than this cache's ("
                + "; ".join(self.differences)
                + "); scored anyway because of --allow-target-mismatch: tau says nothing about this target"
            )
        if self.status == "unknown":
            why = (
                "the checkpoint records no target identity (hscache_target in its config)"
                if not self.recorded
                else "the cache records none of the fields the checkpoint does"
            )
            return f"the target could not be checked: {why}; make sure it was trained for this cache's target"
        return None

    def to_dict(self) -> dict[str, Any]:
        return {
            "status": self.status,
            "recorded": self.recorded,
            "cache": self.cache,
            "differences": list(self.differences),
        }


def _short(value: str) -> str:
    return value[:12] if len(value) == 64 else value  # sha256 digests: a prefix is enough to tell


def check_target(
    recorded: dict[str, str] | None,
    cache: dict[str, str],
    *,
    allow_mismatch: bool,
    where: str,
    against: str = "cache",
) -> TargetCheck:
    """Compare ``recorded`` (the drafter's) with ``cache`` (the cache's, or with ``against="model"``
    the loaded target's) on the fields both know; ``where`` names it in the message.

    Raises:
        IncompatibleCacheError: a field differs and ``allow_mismatch`` is False.
    """
    common = [k for k in IDENTITY_FIELDS if recorded and k in recorded and k in cache]
    if not common:
        return TargetCheck("unknown", recorded, cache)
    differences = [
        f"{k}: drafter {_short(recorded[k])}, {against} {_short(cache[k])}"
        for k in common
        if recorded[k] != cache[k]
    ]
    if not differences:
        return TargetCheck("match", recorded, cache)
    if not allow_mismatch:
        raise IncompatibleCacheError(
            f"the drafter was built for another target than the {against} {where} ({'; '.join(differences)}); "
            f"use a {against} of its own target, or pass --allow-target-mismatch to run it anyway"
        )
    return TargetCheck("mismatch", recorded, cache, differences)
