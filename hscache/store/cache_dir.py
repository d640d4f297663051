"""The cache directory itself: the creation mark of a fresh run, ``--overwrite``, and ``provenance.json``.

A fresh extraction first empties ``--out`` and writes ``.hscache-creating`` (layout.CREATING_MARK);
the first durable manifest removes it (store/writer.py). A directory with the mark and no
manifest is therefore a fresh run killed early: everything in it is ours to delete.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from hscache import schemas
from hscache.errors import InputError
from hscache.store import fsio, jsonio
from hscache.store.layout import CREATING_MARK, MANIFEST, PROVENANCE, WRITER_LOCK
from hscache.store.paths import drafter_files
from hscache.store.writer import StoreWriter

__all__ = ["check_out_dir", "clear_for_overwrite", "prepare_fresh_dir", "read_provenance", "write_provenance"]


def clear_for_overwrite(out: Path) -> None:
    """``--overwrite``: empty ``out`` if it is a cache, a killed fresh run, or empty (the caller holds
    its writer lock, store/lock.py, which stays).

    Raises:
        InputError: ``out`` holds other files (only ever delete what hscache made).
    """
    if not out.exists():
        return
    check_out_dir(out, overwrite=True)
    _empty(out)


def check_out_dir(out: Path, overwrite: bool) -> None:
    """Refuse an existing ``--out`` that extract may neither resume, restart nor (``overwrite``)
    empty, without touching it: what ``prepare_fresh_dir`` and ``clear_for_overwrite`` would refuse.

    Raises:
        InputError: ``out`` holds files but no cache and no creation mark (naming a drafter or
            model directory as such).
    """
    if not out.is_dir() or (out / MANIFEST).is_file() or (out / CREATING_MARK).is_file():
        return
    if not _contents(out):
        return
    files = drafter_files(out)
    what = f"is a drafter or model directory ({', '.join(files)})" if files else "holds other files"
    if overwrite:
        raise InputError(
            f"--overwrite deletes only hscache caches, and --out {out} {what}; choose an empty or new directory"
        )
    if files:
        raise InputError(f"--out {out} {what}, not a cache; choose an empty or new directory")
    raise InputError(f"--out {out} exists, is not empty and holds no cache; choose an empty or new directory")


def _contents(out: Path) -> list[Path]:
    """What ``out`` holds besides the writer lock, which the caller holds and must not delete: a
    deleted lock file would let a second writer lock a new one while we still write."""
    return [child for child in out.iterdir() if child.name != WRITER_LOCK]


def _empty(out: Path) -> None:
    for child in _contents(out):
        if child.is_dir() and not child.is_symlink():
            shutil.rmtree(child)
        else:
            child.unlink()


def prepare_fresh_dir(out: Path) -> None:
    """Make ``out`` an empty directory carrying the creation mark (see layout.CREATING_MARK).

    Raises:
        InputError: ``out`` holds files but no cache and no creation mark.
    """
    if out.exists() and _contents(out):
        check_out_dir(out, overwrite=False)
        # A fresh run was killed before its first manifest: it committed nothing, and the
        # directory was empty when the mark was written, so everything in it is ours.
        _empty(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / CREATING_MARK).write_bytes(b"")
    fsio.fsync_dir(out)


def read_provenance(root: Path) -> dict[str, Any]:
    """``provenance.json`` of the cache at ``root``; ``{}`` where there is none."""
    path = Path(root) / PROVENANCE
    if not path.is_file():
        return {}
    return jsonio.load_cache_object(path.read_bytes(), path)


def write_provenance(writer: StoreWriter, provenance: dict[str, Any]) -> None:
    """Validate ``provenance`` (schemas/provenance.schema.json) and publish it through ``writer``,
    so that the next manifest records its checksum (store/integrity.py)."""
    schemas.validate(provenance, "provenance")
    writer.write_file(PROVENANCE, (json.dumps(provenance, indent=2, sort_keys=True) + "\n").encode())
