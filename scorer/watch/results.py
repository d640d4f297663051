"""The results folder of a watch: an append-only log (``watch.jsonl``) and the lock of its writer.

Each scored (or refused) checkpoint is one JSON line (schemas/watch_record.schema.json), written with
one ``write`` and fsync'd before the next checkpoint is looked at: after kill -9 the log holds every
record it acknowledged, and at worst a torn last line, which opening the log again cuts off (that
record was never acknowledged; its checkpoint is scored again). A restarted watch reads the log and
scores nothing it holds (keyed by checkpoint path and content digest).

One writer per folder: ``watch.lock`` opened with O_NOFOLLOW (a planted symlink is refused) and held
by an exclusive ``flock``, holding the writer's pid. The kernel drops the lock when its holder dies,
kill -9 included, so a stale lock file is taken over by the next watch without a guess about
whether a pid is alive (hscache/store/lock.py does the same for caches, for the same reason).
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from hscache import schemas
from scorer.errors import ScorerError

__all__ = ["LOCK_NAME", "LOG_NAME", "ResultsLog", "WatchLockedError", "read_records"]

LOG_NAME = "watch.jsonl"
LOCK_NAME = "watch.lock"


class WatchLockedError(ScorerError):
    """Another live watch writes to the results folder."""


def _read_pid(fd: int) -> str:
    try:
        return os.pread(fd, 64, 0).decode().strip() or "?"
    except OSError:
        return "?"


class ResultsLog:
    """The log of one results folder, held open by one writer (use as a context manager).

    Example:
        >>> with ResultsLog("runs/exp1/..") as log:          # doctest: +SKIP
        ...     log.append(record)
    """

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        self.path = self.folder / LOG_NAME
        self._lock_fd: int | None = None

    def __enter__(self) -> ResultsLog:
        self.folder.mkdir(parents=True, exist_ok=True)
        lock = self.folder / LOCK_NAME
        try:
            fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise ScorerError(
                    f"{lock} is a symlink; remove it (a watch's lock is a plain file)"
                ) from None
            raise ScorerError(f"cannot open the lock file {lock}: {exc.strerror}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            pid = _read_pid(fd)
            os.close(fd)
            raise WatchLockedError(
                f"another scorer watch (pid {pid}) writes to {self.folder}; stop it, or pass --results "
                "another folder"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._lock_fd = fd
        self._cut_torn_tail()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._lock_fd is not None:
            (self.folder / LOCK_NAME).unlink(missing_ok=True)  # still ours: we hold the flock
            os.close(self._lock_fd)
            self._lock_fd = None

    def _cut_torn_tail(self) -> None:
        """Drop a last line a killed writer left without its newline (never acknowledged)."""
        if not self.path.is_file():
            return
        data = self.path.read_bytes()
        if data and not data.endswith(b"\n"):
            with open(self.path, "r+b") as f:
                f.truncate(data.rfind(b"\n") + 1)
                os.fsync(f.fileno())

    def records(self) -> list[dict[str, Any]]:
        """Every record in the log, in order.

        Raises:
            ScorerError: a complete line that is not a record (the log was edited by hand).
        """
        return list(read_records(self.path))

    def append(self, record: dict[str, Any]) -> None:
        """Validate ``record`` and append it as one line, fsync'd before returning."""
        if self._lock_fd is None:
            raise RuntimeError("ResultsLog.append outside its with-block")
        schemas.validate(record, "watch_record")
        line = (json.dumps(record, sort_keys=True, allow_nan=False) + "\n").encode()
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        try:
            os.write(fd, line)
            os.fsync(fd)
        finally:
            os.close(fd)


def read_records(path: str | Path) -> Iterator[dict[str, Any]]:
    """The records of a watch log (a torn last line, as kill -9 leaves, is skipped).

    Raises:
        ScorerError: a complete line that does not parse as a JSON object.
    """
    path = Path(path)
    if not path.is_file():
        return
    data = path.read_bytes()
    lines = data.split(b"\n")
    for number, line in enumerate(lines[:-1], 1):  # the part after the last newline is not a record
        try:
            record = json.loads(line)
        except ValueError:
            record = None
        if not isinstance(record, dict):
            raise ScorerError(
                f"{path} line {number} is not a watch record; move the file away to start afresh"
            )
        yield record
