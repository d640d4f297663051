"""The chunk verifications this user's processes made, kept beyond one process (store/chunks.py).

A reader checks a chunk file's crc32c and its rows' sha256 on first touch in a process; without a
record, every new process (each DataLoader worker, each run) pays that again, and a cold epoch then
reads at hashing speed instead of disk speed. Each verification is appended here as one line:

    <chunk path relative to its array directory> <device> <inode> <size> <mtime_ns> <ctime_ns> <sha256>

in one log per array directory under ``HSCACHE_VERIFIED_DIR`` (default
``$XDG_CACHE_HOME/hscache/verified``, i.e. ``~/.cache/hscache/verified``; ``off`` disables it).
A later process trusts a line only while the file's identity is still exactly the one recorded and
the sha256 is the one its manifest expects. Any write to a chunk file changes its ctime, which no
user-space call can set back, so a rewritten or edited chunk is checked again. The log lives in
the user's own cache directory, not in the cache: whoever can write the cache cannot vouch for it.
Lines are appended with O_APPEND (concurrent readers interleave whole lines); a torn or malformed
line is ignored (that chunk is simply checked again); nothing here is ever needed for correctness.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable, Iterator
from pathlib import Path

__all__ = ["VerifiedEntry", "append_entries", "log_path", "read_entries", "record_dir"]

# (relative path, (device, inode), (size, mtime_ns, ctime_ns), sha256)
VerifiedEntry = tuple[str, tuple[int, int], tuple[int, int, int], str]

_MAX_LOG_BYTES = 64 << 20  # a log past this is not read (and restarted): ~400k verifications


def record_dir() -> Path | None:
    """Where the logs live, or None when ``HSCACHE_VERIFIED_DIR`` is ``off`` (or empty)."""
    configured = os.environ.get("HSCACHE_VERIFIED_DIR")
    if configured is not None:
        return None if configured.strip().lower() in ("", "off", "0", "none") else Path(configured)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "hscache" / "verified"


def log_path(records: Path, array_dir: Path) -> Path:
    """The log of the array at ``array_dir`` (named by a hash of its resolved path)."""
    key = hashlib.sha256(str(Path(array_dir).resolve()).encode()).hexdigest()[:32]
    return records / f"{key}.log"


def read_entries(path: Path) -> Iterator[VerifiedEntry]:
    """The well-formed lines of the log at ``path`` (none when it is missing, unreadable or too big)."""
    try:
        if path.stat().st_size > _MAX_LOG_BYTES:
            path.unlink(missing_ok=True)  # restart it: entries are only ever a saving
            return
        text = path.read_text(encoding="ascii", errors="replace")
    except OSError:
        return
    for line in text.splitlines():
        parts = line.split(" ")
        if len(parts) != 7 or len(parts[6]) != 64:
            continue
        try:
            dev, ino, size, mtime, ctime = (int(p) for p in parts[1:6])
        except ValueError:
            continue
        yield parts[0], (dev, ino), (size, mtime, ctime), parts[6]


def append_entries(path: Path, entries: Iterable[VerifiedEntry]) -> None:
    """Append ``entries`` to the log at ``path`` (created with its directory); errors are ignored:
    a log that cannot be written only means the next process checks those chunks again."""
    lines = "".join(
        f"{rel} {key[0]} {key[1]} {state[0]} {state[1]} {state[2]} {sha}\n"
        for rel, key, state, sha in entries
        if " " not in rel and "\n" not in rel
    )
    if not lines:
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            os.write(fd, lines.encode("ascii"))
        finally:
            os.close(fd)
    except (OSError, UnicodeEncodeError):
        pass
