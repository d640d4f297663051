"""The header every scorer document shares: the cache it read and when, with what, it was made.

One definition for the eval report, the compare document, the online result and the sweep (each
schema under schemas/ names these fields).
"""

from __future__ import annotations

from typing import Any

from hscache.capture.provenance import git_commit, package_versions, utc_now
from hscache.store.integrity import cache_digest
from hscache.store.view import CacheView

__all__ = ["cache_block", "run_stamp"]


def cache_block(cache: CacheView) -> dict[str, Any]:
    """The cache a document scored: where, its digest, how many sequences, its layers and settings."""
    return {
        "path": str(getattr(cache, "url", cache.path)),
        "digest": cache_digest(cache),
        "sequences": len(cache),
        "layer_ids": cache.layer_ids,
        "settings": cache.settings,
    }


def run_stamp(seconds: float) -> dict[str, Any]:
    """The package versions, the git commit, the run's wall seconds and the UTC time of writing."""
    return {
        "versions": package_versions(),
        "hscache_git_commit": git_commit(),
        "seconds": seconds,
        "created_at": utc_now(),
    }
