"""Where a command may write what a user names (--json, --report, a study's --out), checked before
its work (issue 51): a command writes only the paths it names, and never over something it would
destroy.

Refused, in one line naming the flag: an empty path; a path under a file; a directory, a link, a FIFO
or a device where a file goes; a path inside an hscache cache or a drafter directory (a report over a
cache's manifest made the cache unreadable); an existing file that is not a report hscache wrote
(JSON with our ``schema_version``, or a page carrying ``GENERATOR_META``); an HTML page under another
suffix than .html/.htm; a place this user cannot write (said now, not after an 83 s evaluation).
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

from hscache.errors import InputError
from hscache.store import fsio
from hscache.store.marks import manifest_problem
from hscache.store.paths import drafter_files

__all__ = ["GENERATOR_META", "OUTPUT_KINDS", "check_output_path"]

# Every HTML page hscache and the scorer write carries this tag in its <head> (hscache/report/html.py
# html_page): the mark that a page at a --report path is ours to replace.
GENERATOR_META = '<meta name="generator" content="hscache">'
# How every page began before it carried the tag (2026-12-07): reports written then stay replaceable.
_PAGE_BEFORE_THE_TAG = b'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>'
OUTPUT_KINDS = ("json", "html", "file", "directory")
_HTML_SUFFIXES = (".html", ".htm")
# Our reports stay far below this; a larger file is not read to find out whether it is one.
_MAX_REPORT_BYTES = 256 << 20


def _kind_of(mode: int) -> str:
    kinds = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"))
    return next((what for test, what in kinds if test(mode)), "a device")


def _is_cache(path: Path) -> bool:
    return manifest_problem(path) is None


def _ours(path: Path, kind: str) -> bool:
    """Whether the regular file ``path`` is a report of ``kind`` hscache wrote."""
    try:
        with fsio.open_regular(path) as f:
            if os.fstat(f.fileno()).st_size > _MAX_REPORT_BYTES:
                return False
            data = f.read() if kind == "json" else f.read(4096)
    except OSError:
        return False
    if kind == "html":
        return GENERATOR_META.encode() in data or data.startswith(_PAGE_BEFORE_THE_TAG)
    try:
        document = json.loads(data)
    except (ValueError, RecursionError):
        return False
    if isinstance(document, dict) and isinstance(document.get("reports"), list) and document["reports"]:
        document = document["reports"][0]  # scorer eval over several caches
    return isinstance(document, dict) and "schema_version" in document


def _holder(path: Path, *, drafter: bool) -> str | None:
    """What ``path`` lies inside that a report must not be written into, in words, or None
    (``drafter``: a drafter directory counts too, when ``path`` is a file written beside its weights)."""
    for parent in path.absolute().parents:
        if _is_cache(parent):
            return f"is inside the cache {parent}"
    parent = path.absolute().parent
    if drafter and (files := drafter_files(parent)):
        return f"is inside the drafter directory {parent} ({', '.join(files)})"
    return None


def check_output_path(path: str | os.PathLike, flag: str, *, kind: str = "file") -> Path:
    """Refuse, before any work, an output ``path`` given as ``flag`` that this command may not write
    (see the module docstring); ``kind``: "json", "html", "file" (a file of another kind), or
    "directory" (a folder the command writes into). Returns ``path``.

    Raises:
        InputError: one line naming ``flag``, the problem and the fix.
    """
    if kind not in OUTPUT_KINDS:
        raise ValueError(f"kind {kind!r}; one of {OUTPUT_KINDS}")
    if not str(path).strip():
        raise InputError(
            f"{flag} {str(path)!r} is an empty path; give the path to write, or leave {flag} out"
        )
    path = Path(path)
    if blocker := next((p for p in path.parents if p.exists() and not p.is_dir()), None):
        raise InputError(f"{flag} {path}: {blocker} is a file, not a directory; choose another path")
    if kind == "directory":
        if path.exists() and not path.is_dir():
            raise InputError(f"{flag} {path} is a file; choose a directory path")
        if path.is_dir() and _is_cache(path):
            raise InputError(f"{flag} {path} is an hscache cache; choose a directory outside it")
        if path.is_dir() and (files := drafter_files(path)):
            raise InputError(
                f"{flag} {path} is a drafter directory ({', '.join(files)}); choose another directory"
            )
    exists = kind != "directory" and (path.exists() or path.is_symlink())
    if exists:
        mode = os.lstat(path).st_mode
        if stat.S_ISLNK(mode):
            raise InputError(f"{flag} {path} is a symbolic link; give the path of a new file, not a link")
        if not stat.S_ISREG(mode):
            raise InputError(f"{flag} {path} is {_kind_of(mode)}; choose a file path")
    if kind == "html" and path.suffix.lower() not in _HTML_SUFFIXES:
        raise InputError(
            f"{flag} {path}: the report is an HTML page; give it a .html (or .htm) name, e.g. "
            f"{path.with_suffix('.html')}"
        )
    if (where := _holder(path, drafter=kind != "directory")) is not None:
        raise InputError(f"{flag} {path} {where}; choose a path outside it")
    if exists:
        if kind == "file" or not _ours(path, kind):
            what = {"html": "an HTML report", "json": "a JSON report"}.get(kind, "a file")
            raise InputError(
                f"{flag} {path} exists and is not {what} hscache wrote, so it is left alone; give a new path "
                "(or remove the file yourself)"
            )
    existing = next(p for p in (path, *path.parents) if p.exists())  # "." or "/" at the latest
    folder = existing if existing.is_dir() else existing.parent
    if not os.access(folder, os.W_OK | os.X_OK):
        raise InputError(f"{flag} {path}: {folder} is not writable by this user; choose another path")
    return path
