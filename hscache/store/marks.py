"""The marks that make a directory hscache's to empty: a cache's manifest, and the creation mark of a
fresh run (``.hscache-creating``, ``.hscache-importing``).

A directory is emptied (``--overwrite``, a killed fresh run started over) only when it is proven to
be hscache's (issue 52): a ``manifest.json`` that parses as an hscache manifest, not merely a file of
that name (a web app has one); a creation mark hscache wrote (JSON naming itself, with the run's
nonce and the top-level entries that run creates), not merely a file of that name. Even under a
valid mark only the entries the run recorded creating are deleted: a file added after the kill
(results.csv beside a killed extract) is named in a refusal, never deleted. Marks and manifests are
read without following a link or waiting on a FIFO (fsio.read_regular).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
import uuid
from pathlib import Path

from hscache.errors import InputError
from hscache.store import fsio
from hscache.store.layout import (
    ARRAYS_GROUP,
    FORMAT_NAME,
    INDEX_DIR,
    MANIFEST,
    PROVENANCE,
    RUN_LOG,
    TARGET_DIR,
    WRITER_LOCK,
)

__all__ = [
    "CACHE_ENTRIES",
    "CONNECTOR_MARK",
    "check_connector_dir",
    "check_marked_dir",
    "clear_marked_dir",
    "manifest_problem",
    "remove_entries",
    "write_connector_mark",
    "write_mark",
]

# What a run writing a cache creates at its top level (store/writer.py, capture/target_files.py,
# store/shards.py's shards.json): the only names a killed run's restart may delete.
CACHE_ENTRIES = (ARRAYS_GROUP, INDEX_DIR, TARGET_DIR, MANIFEST, PROVENANCE, RUN_LOG, "shards.json")
_MARK_KEY = "hscache_mark"
_NONCE = re.compile(r"[0-9a-f]{32}")
# A manifest of a real cache (Qwen3.6-27B, ~10^6 sequences) stays far below this; a larger file
# named manifest.json is not parsed to find out what it is.
_MAX_MANIFEST_BYTES = 256 << 20


def _regular_bytes(path: Path, limit: int) -> bytes | str:
    """The bytes of ``path``, or why they cannot be a mark/manifest of ours (a link, a FIFO, too big)."""
    if path.is_symlink():
        return "is a symbolic link"
    try:
        with fsio.open_regular(path) as f:
            if os.fstat(f.fileno()).st_size > limit:
                return f"is over {limit >> 20} MiB"
            return f.read()
    except OSError as exc:
        return f"cannot be read ({exc.strerror or exc})"


def manifest_problem(root: Path) -> str | None:
    """None when ``root/manifest.json`` parses as an hscache manifest (format "hscache"), else why
    not, in words (it is missing, a link, not JSON, another program's manifest)."""
    path = Path(root) / MANIFEST
    if not path.exists() and not path.is_symlink():
        return f"has no {MANIFEST}"
    data = _regular_bytes(path, _MAX_MANIFEST_BYTES)
    if isinstance(data, str):
        return f"holds a {MANIFEST} that {data}"
    try:
        document = json.loads(data)
    except (ValueError, RecursionError):
        return f"holds a {MANIFEST} that is not JSON"
    if not isinstance(document, dict) or document.get("format") != FORMAT_NAME:
        return f'holds a {MANIFEST} that is not an hscache manifest (no "format": "{FORMAT_NAME}")'
    return None


def write_mark(out: Path, name: str) -> None:
    """Write the creation mark ``name`` into ``out`` (new or empty, the caller checked): this run's
    nonce and the entries it creates (``CACHE_ENTRIES``), made durable before anything else is
    written. Never through a link: ``out`` was empty, and the mark is created exclusively."""
    document = {
        _MARK_KEY: name,
        "nonce": uuid.uuid4().hex,
        "creates": list(CACHE_ENTRIES),
        "pid": os.getpid(),
        "started_at": time.time(),
    }
    fd = os.open(out / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
    with os.fdopen(fd, "wb") as f:
        f.write(json.dumps(document).encode())
        f.flush()
        os.fsync(f.fileno())
    fsio.fsync_dir(out)


def _mark_problem(out: Path, name: str) -> tuple[str | None, list[str]]:
    """(why the mark ``name`` in ``out`` is not one hscache wrote, or None; the entries it records)."""
    data = _regular_bytes(out / name, 1 << 20)
    if isinstance(data, str):
        return f"its {name} {data}", []
    try:
        document = json.loads(data)
    except (ValueError, RecursionError):
        document = None
    creates = document.get("creates") if isinstance(document, dict) else None
    if (
        not isinstance(document, dict)
        or document.get(_MARK_KEY) != name
        or not isinstance(document.get("nonce"), str)
        or not _NONCE.fullmatch(document["nonce"])
        or not isinstance(creates, list)
        or not all(isinstance(c, str) and c in CACHE_ENTRIES for c in creates)
    ):
        return f"its {name} was not written by hscache (no run's nonce and entries in it)", []
    return None, creates


def _unknown_entries(out: Path, name: str, creates: list[str]) -> list[str]:
    return sorted(
        p.name
        for p in out.iterdir()
        if p.name not in (name, WRITER_LOCK, *creates) and fsio.TEMP_MARK not in p.name
    )


def check_marked_dir(out: Path, name: str, flag: str = "--out") -> None:
    """Refuse, without touching it, a directory holding the mark ``name`` that its restart may not
    empty: a mark hscache did not write, or entries besides those its run recorded creating.

    Raises:
        InputError: one line naming the mark's problem or the unknown entries.
    """
    problem, creates = _mark_problem(out, name)
    if problem is not None:
        raise InputError(
            f"{flag} {out} holds {name} but {problem}, so it is not a killed hscache run to start over: "
            "nothing was deleted; choose an empty or new directory"
        )
    if unknown := _unknown_entries(out, name, creates):
        shown = ", ".join(unknown[:5]) + (f" and {len(unknown) - 5} more" if len(unknown) > 5 else "")
        raise InputError(
            f"{flag} {out} is a killed hscache run, but also holds {shown}, which that run did not "
            "create: nothing was deleted; move them out (or choose another directory) and re-run"
        )


def clear_marked_dir(out: Path, name: str, flag: str = "--out") -> None:
    """Start a killed run over: delete what the run recorded in its mark ``name`` creating (and our
    temp files), keep the writer lock the caller holds, remove the mark last.

    Raises:
        InputError: as ``check_marked_dir`` (then nothing is deleted).
    """
    _, creates = _mark_problem(out, name)
    check_marked_dir(out, name, flag)
    remove_entries(out, creates, strict=True)
    (out / name).unlink()
    fsio.fsync_dir(out)


def remove_entries(out: Path, names: list[str] | tuple[str, ...], strict: bool = False) -> None:
    """Delete the top-level entries ``names`` of ``out`` that a run created (and our temp files),
    nothing else: a file another program or the user put there meanwhile is kept, and so is the
    writer lock. A failed run cleaning its own output (hscache/interop/common.py) is not strict: what
    cannot be deleted (the disk error that failed it) stays; strict, the first failure raises."""
    if not Path(out).is_dir():
        return
    for child in Path(out).iterdir():
        if child.name == WRITER_LOCK or (child.name not in names and fsio.TEMP_MARK not in child.name):
            continue
        if child.is_dir() and not child.is_symlink():
            shutil.rmtree(child, ignore_errors=not strict)
        else:
            try:
                child.unlink()
            except OSError:
                if strict:
                    raise


# ``hscache extract --engine vllm --connector-dir DIR`` keeps vLLM's files there (hs_<n>.safetensors):
# the mark records the cache they belong to, so a resumed run may replace them and nothing else may.
CONNECTOR_MARK = ".hscache-connector"
_CONNECTOR_FILE = re.compile(r"hs_\d+\.safetensors")


def _connector_cache(conn: Path) -> str | None:
    data = _regular_bytes(conn / CONNECTOR_MARK, 1 << 20)
    try:
        document = json.loads(data) if isinstance(data, bytes) else None
    except (ValueError, RecursionError):
        document = None
    ok = isinstance(document, dict) and document.get(_MARK_KEY) == CONNECTOR_MARK
    return document.get("cache") if ok and isinstance(document.get("cache"), str) else None


def check_connector_dir(conn: Path, out: Path) -> None:
    """``--connector-dir``: new, empty, or the files an extraction into the same ``out`` kept there
    (its mark names that cache), so that no file of another run or program is overwritten.

    Raises:
        InputError: ``conn`` is a file, or holds files this extraction did not write (named).
    """
    conn = Path(conn)
    if conn.is_symlink() or (conn.exists() and not conn.is_dir()):
        raise InputError(f"--connector-dir {conn} is not a directory; choose a new or empty directory")
    if not conn.exists():
        return
    entries = sorted(p.name for p in conn.iterdir() if p.name != CONNECTOR_MARK)
    ours = _connector_cache(conn) == str(Path(out).absolute())
    foreign = [e for e in entries if not (ours and _CONNECTOR_FILE.fullmatch(e))]
    if foreign:
        shown = ", ".join(foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
        raise InputError(
            f"--connector-dir {conn} holds {shown}, which an extraction into --out {out} did not write "
            "there (it would overwrite hs_<n>.safetensors): choose a new or empty directory"
        )


def write_connector_mark(conn: Path, out: Path) -> None:
    """Create ``conn`` if needed and record in it the cache whose vLLM files it keeps."""
    conn = Path(conn)
    conn.mkdir(parents=True, exist_ok=True)
    document = {_MARK_KEY: CONNECTOR_MARK, "cache": str(Path(out).absolute())}
    fsio.atomic_write_bytes(conn / CONNECTOR_MARK, json.dumps(document).encode())
