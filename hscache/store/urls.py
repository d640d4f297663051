"""Whether a cache path is an fsspec URL: the one test, importable without fsspec or the store."""

from __future__ import annotations

from pathlib import Path

__all__ = ["is_url"]


def is_url(path: str | Path) -> bool:
    """Whether ``path`` names an fsspec URL (``proto://...``) rather than a local path."""
    return "://" in str(path)
