"""One writer per cache: an exclusive ``flock`` on ``<cache>/.hscache-writer.lock`` (layout.WRITER_LOCK).

zarr has no locking, and two processes appending to one store damage it (spec/storage.md). Every
command that writes a cache (extract, import, merge, recompress, ...) holds this lock from before it
touches the directory until its last commit.

Why ``flock`` and not a pid file: the kernel drops the lock when its holder dies, kill -9 included,
so a stale lock never blocks anyone and taking it over needs no guess about whether a pid is alive
(pids are reused, and a pid says nothing across hosts). The file's content (pid, host, command,
start time) only serves the refusal message and ``hscache info``. The lock file is removed on a
clean release; a killed holder leaves it behind, unlocked, and the next writer simply takes it.
On network filesystems ``flock`` is only as good as the filesystem's lock support (NFSv4 maps it to
byte-range locks; some FUSE mounts ignore it): the lock is a guard against accidents, not a
distributed lock service.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import socket
import stat
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from hscache.errors import CacheLockedError, InputError
from hscache.store.layout import WRITER_LOCK

__all__ = ["check_no_writer", "current_writer", "writer_lock"]


def _holder_text(info: dict[str, Any] | None) -> str:
    if not info:
        return "another process (no details recorded yet)"
    started = info.get("started_at")
    when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(started)) if started else "?"
    return f"pid {info.get('pid')} on {info.get('host')} (`{info.get('command')}`, started {when})"


def _read_info(fd: int) -> dict[str, Any] | None:
    try:
        raw = os.pread(fd, 4096, 0)
        info = json.loads(raw.decode()) if raw else None
    except (OSError, ValueError):
        return None
    return info if isinstance(info, dict) else None


# The lock is opened without following a link (a cache received from someone else may carry a link
# named like it, pointing anywhere: the writer would truncate and overwrite its target) and without
# blocking (a FIFO named like it would wait forever for a writer at its other end).
_OPEN_FLAGS = os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)


def _not_a_lock(path: Path, what: str) -> InputError:
    return InputError(
        f"{path} is {what}, not hscache's writer lock (a regular file a writer creates); hscache never "
        "makes one: remove it by hand and re-run"
    )


def _open_lock(path: Path, flags: int) -> int:
    """``os.open(path, flags)`` on the lock file, refused unless it is a regular file, the link
    itself never followed and a FIFO never waited on (fstat on the descriptor: no swap slips in).

    Raises:
        InputError: ``path`` is a link, a FIFO, a directory, a socket or a device (one line).
        OSError: any other failure to open it.
    """
    try:
        fd = os.open(path, flags | _OPEN_FLAGS, 0o644)
    except OSError as exc:
        if exc.errno == errno.ELOOP or path.is_symlink():
            raise _not_a_lock(path, "a symbolic link") from None
        if exc.errno in (errno.EISDIR, errno.ENXIO):  # ENXIO: a FIFO opened for writing, no reader
            raise _not_a_lock(path, "a directory" if exc.errno == errno.EISDIR else "a FIFO") from None
        raise
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        kinds = ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISDIR, "a directory"), (stat.S_ISSOCK, "a socket"))
        raise _not_a_lock(path, next((w for test, w in kinds if test(mode)), "a device"))
    os.set_blocking(fd, True)
    return fd


def _locked_error(root: Path, info: dict[str, Any] | None) -> CacheLockedError:
    return CacheLockedError(
        f"{root} is being written by {_holder_text(info)}; one writer per cache: wait for it to "
        "finish (or stop it), then re-run this command"
    )


def check_no_writer(root: Path | str) -> None:
    """Refuse at once, before a command's heavy work (loading a model), when a live process holds
    the writer lock of ``root``; ``writer_lock`` still decides (this only says it early).

    Raises:
        CacheLockedError: the same line ``writer_lock`` would raise.
        InputError: the lock path is a link, a FIFO or another non-regular file (as ``writer_lock``).
    """
    try:  # a link or a FIFO in its place: refused now, not after the model is loaded
        os.close(_open_lock(Path(root) / WRITER_LOCK, os.O_RDONLY))
    except FileNotFoundError:
        pass
    holder = current_writer(root)
    if holder is not None:
        raise _locked_error(Path(root), holder or None)


def _make_directories(root: Path) -> list[Path]:
    """Create ``root`` and its missing parents; the directories this call made, deepest first.

    Raises:
        InputError: a file is in the way (nothing made is left behind).
    """
    missing = []
    for path in (root, *root.parents):
        if path.is_dir():
            break
        missing.append(path)
    made: list[Path] = []
    try:
        for path in reversed(missing):
            try:
                path.mkdir()
            except FileExistsError:  # another process made it meanwhile, or it is a file
                if not path.is_dir():
                    raise
                continue
            made.insert(0, path)
    except (NotADirectoryError, FileExistsError):
        _remove_empty(made)
        blocker = next((p for p in root.parents if p.exists() and not p.is_dir()), root)
        raise InputError(
            f"{blocker} is a file, not a directory, so {root} cannot be created: choose another path"
        ) from None
    except OSError:
        _remove_empty(made)
        raise
    return made


def _remove_empty(made: list[Path]) -> None:
    """Remove the directories a writer made (deepest first) that are still empty: what it wrote stays."""
    for path in made:
        try:
            path.rmdir()
        except OSError:
            return  # not empty: nor are its parents


@contextlib.contextmanager
def writer_lock(root: Path | str, command: str) -> Iterator[None]:
    """Hold the cache's writer lock for the ``with`` block; create ``root`` if it does not exist.

    The directories it creates (``root`` and missing parents) are removed again on the way out while
    they are empty, so a writer refused or failed before it wrote anything leaves the filesystem as
    it found it.

    Args:
        root: the cache directory.
        command: what this writer is, for the message another writer gets (e.g. "hscache extract").

    Raises:
        CacheLockedError: another live process holds the lock (one line naming it).
        InputError: ``root`` is a file, or its lock path is not a regular file (a link, a FIFO...).
    """
    root = Path(root)
    if root.exists() and not root.is_dir():
        raise InputError(f"{root} is a file, not a directory; a cache is a directory: choose another path")
    created = _make_directories(root)
    path = root / WRITER_LOCK
    while True:
        try:
            fd = _open_lock(path, os.O_RDWR | os.O_CREAT)
        except InputError:
            _remove_empty(created)
            raise
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            info = _read_info(fd)
            os.close(fd)
            _remove_empty(created)
            if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise
            raise _locked_error(root, info) from None
        # A releasing holder unlinks the file after we opened it: our lock would then be on an
        # orphaned inode that the next writer never sees. Retry on the file that is there now.
        try:
            same = os.fstat(fd).st_ino == os.stat(path).st_ino
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)
    try:
        info = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "command": command,
            "started_at": time.time(),
        }
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(info).encode(), 0)
        yield
    finally:
        # Unlink while still holding the lock, so nobody can lock this inode after we let go.
        with contextlib.suppress(OSError):
            path.unlink()
        os.close(fd)
        _remove_empty(created)  # a writer refused before it wrote anything leaves no directory behind


def current_writer(root: Path | str) -> dict[str, Any] | None:
    """The recorded details (pid, host, command, started_at) of the live process writing the cache at
    ``root``; ``None`` when nobody holds its lock (a file left by a killed writer does not count, nor
    a link or a FIFO in its place, which is never followed nor waited on: ``writer_lock`` refuses it)."""
    path = Path(root) / WRITER_LOCK
    try:
        fd = _open_lock(path, os.O_RDONLY)
    except (OSError, InputError):
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError:
            return _read_info(fd) or {}
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)
