"""Publishing a drafter directory whole: written beside its destination, then renamed into place.

``scorer init`` (and ``--train-steps``) used to rewrite an existing directory file by file; a
crash between ``config.json`` and the weights left a new config with old weights, which scored
silently. Here the files go to a hidden sibling directory and one rename publishes them, so a
reader sees the old drafter or the new one, never a mix. Replacing a non-empty directory needs
``overwrite``; a path that is a file is refused before any work is done.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

from hscache.store.fsio import fsync_dir
from scorer.errors import ScorerError

__all__ = ["check_drafter_dir", "staged_drafter_dir"]


def check_drafter_dir(out: str | os.PathLike, overwrite: bool = False) -> Path:
    """Refuse an ``out`` that is a file, or a non-empty directory without ``overwrite``.

    Called before any expensive work (training), so a bad path costs nothing.
    """
    path = Path(out)
    if path.exists() and not path.is_dir():
        raise ScorerError(f"{path} is a file, not a directory; pass a directory path for the drafter")
    if blocker := next((p for p in path.parents if p.exists() and not p.is_dir()), None):
        raise ScorerError(f"{blocker} is a file, not a directory; pass a directory path for the drafter")
    if path.is_dir() and not overwrite and any(path.iterdir()):
        raise ScorerError(
            f"{path} is not empty; pass --overwrite to replace it (the old files are removed), "
            "or choose a new directory"
        )
    return path


@contextlib.contextmanager
def staged_drafter_dir(out: str | os.PathLike, overwrite: bool = False) -> Iterator[Path]:
    """Yield an empty directory to write the drafter into; on success it replaces ``out``.

    On an exception the staging directory is removed and ``out`` is untouched.
    """
    path = check_drafter_dir(out, overwrite).absolute()
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = path.parent / f".{path.name}.staging-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    try:
        yield staging
        fsync_dir(staging)
        _replace(staging, path)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def _replace(staging: Path, path: Path) -> None:
    if not path.exists():
        staging.rename(path)
    else:
        # Two renames: between them neither drafter is at ``path`` (absent, never mixed).
        retired = path.parent / f".{path.name}.replaced-{os.getpid()}"
        shutil.rmtree(retired, ignore_errors=True)
        path.rename(retired)
        staging.rename(path)
        shutil.rmtree(retired, ignore_errors=True)
    fsync_dir(path.parent)
