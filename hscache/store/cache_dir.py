"""The cache directory itself: the creation mark of a fresh run, ``--overwrite``, and ``provenance.json``.

A fresh extraction writes ``.hscache-creating`` (layout.CREATING_MARK) into an empty ``--out``,
recording its nonce and the entries it creates (store/marks.py); the first durable manifest removes
it (store/writer.py). A directory with the mark and no manifest is therefore a fresh run killed
early: what the mark records is ours to delete, anything else there is named and kept.
``--overwrite`` empties only a directory whose manifest parses as an hscache manifest.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from hscache import schemas
from hscache.errors import InputError
from hscache.store import jsonio
from hscache.store.layout import CREATING_MARK, MANIFEST, PROVENANCE, WRITER_LOCK
from hscache.store.marks import check_marked_dir, clear_marked_dir, manifest_problem, write_mark
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
    if _has(out, MANIFEST):
        _empty(out)  # a proven cache: --overwrite replaces it whole
    elif _has(out, CREATING_MARK):
        clear_marked_dir(out, CREATING_MARK)


def _has(out: Path, name: str) -> bool:
    return (out / name).exists() or (out / name).is_symlink()


def check_out_dir(out: Path, overwrite: bool) -> None:
    """Refuse an existing ``--out`` that extract may neither resume, restart nor (``overwrite``)
    empty, without touching it: what ``prepare_fresh_dir`` and ``clear_for_overwrite`` would refuse.

    Raises:
        InputError: ``out`` holds files but no hscache manifest (one that parses as ours) and no
            creation mark of ours, or files its killed run did not create (naming a drafter or
            model directory as such).
    """
    if not out.is_dir():
        return
    if _has(out, MANIFEST):
        if (problem := manifest_problem(out)) is None:
            return
        verb = "--overwrite deletes only hscache caches, and" if overwrite else "an existing"
        raise InputError(
            f"{verb} --out {out} {problem}: it is not a cache, so nothing was touched; "
            "choose an empty or new directory"
        )
    if _has(out, CREATING_MARK):
        check_marked_dir(out, CREATING_MARK)
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
        InputError: ``out`` holds files but no cache and no creation mark of ours, or files
            besides those its killed run recorded creating (named; nothing is deleted).
    """
    if out.exists() and _contents(out):
        check_out_dir(out, overwrite=False)
        # A fresh run was killed before its first manifest: it committed nothing; what its mark
        # records creating is deleted, and check_out_dir refused anything else.
        clear_marked_dir(out, CREATING_MARK)
    out.mkdir(parents=True, exist_ok=True)
    write_mark(out, CREATING_MARK)


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
