"""Whether a cache path is an fsspec URL (the one test), and a path made absolute before it leaves
the process; importable without fsspec or the store."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["absolute_location", "is_url"]


def is_url(path: str | Path) -> bool:
    """Whether ``path`` names an fsspec URL (``proto://...``) rather than a local path."""
    return "://" in str(path)


def absolute_location(path: str | Path) -> str:
    """``path`` as another process can open it: a URL unchanged, a local path made absolute.

    A relative path names a different directory in a process with another working directory (a
    dask worker, a DataLoader worker after ``chdir``): there it silently reads another cache, or
    none. Every path sent to another process goes through this first. Symlinks are kept (not
    resolved), so the path stays the one the user gave, anchored at this process's directory.
    """
    return str(path) if is_url(path) else os.path.abspath(os.fspath(path))
