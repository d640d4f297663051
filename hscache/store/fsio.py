"""Durable file operations: write to a temp file, fsync, rename, fsync the directory.

A reader therefore sees either the old or the new file, never a torn one, and a power
loss after the rename cannot lose what the rename published.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = [
    "atomic_write_bytes",
    "atomic_write_json",
    "atomic_write_with",
    "drop_page_cache",
    "failure",
    "file_sha256",
    "fsync_dir",
    "fsync_file",
    "fsync_file_and_parents",
    "match_umask",
    "open_regular",
    "read_regular",
    "TEMP_MARK",
]


# Every temp file hscache creates contains this mark, so a resume can find and delete leftovers.
TEMP_MARK = ".hscache-tmp-"


def _current_umask() -> int:
    """The process umask, read without changing it (os.umask sets it: racy with other threads)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)  # no /proc: set and restore once, at import, before any thread runs
    os.umask(mask)
    return mask


_UMASK = _current_umask()


def match_umask(path: Path) -> None:
    """Give a file the mode the umask asks for: libraries that write through a private temp file
    (safetensors) leave it 0600, which nobody else on a shared cluster can read."""
    os.chmod(path, 0o666 & ~_UMASK)


def fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: Path) -> None:
    """Make a rename or a new file in ``path`` durable (no-op where directories cannot be opened)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def fsync_file_and_parents(path: Path, top: Path) -> None:
    """Make ``path`` durable, and its entry in each directory from its own up to ``top``: a file
    written into new nested directories (a chunk's ``c/<i>/0/...``) is lost on a crash unless each
    new directory is durable in its parent too."""
    fsync_file(path)
    for parent in path.parents:
        fsync_dir(parent)
        if parent == top:
            break


def atomic_write_with(path: Path, write: Callable[[Path], object]) -> Path:
    """Publish at ``path``, atomically and durably, the file ``write(tmp_path)`` creates (for writers
    that want a path, e.g. safetensors' ``save_file``). Returns ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}{TEMP_MARK}{uuid.uuid4().hex}")
    try:
        write(tmp)
        match_umask(tmp)  # e.g. safetensors writes 0600: make it readable as the umask says
        fsync_file(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)
    return path


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Publish ``data`` at ``path`` atomically and durably."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}{TEMP_MARK}{uuid.uuid4().hex}")
    try:
        with tmp.open("wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def atomic_write_json(path: Path, document: Any) -> None:
    atomic_write_bytes(path, (json.dumps(document, indent=2, sort_keys=True) + "\n").encode())


def open_regular(path: str | os.PathLike) -> Any:
    """``open(path, "rb")`` that never blocks and opens only a regular file: a FIFO, a device or a
    socket in place of a cache file would make a plain ``open`` or ``read`` wait forever (issue 36).
    Opened with O_NONBLOCK (a FIFO's open returns at once), then refused unless ``fstat`` says it is
    a regular file (the check is on the descriptor, so a swap between check and read cannot slip in).

    Raises:
        OSError: it cannot be opened, or it is not a regular file (errno EINVAL, naming what it is).
    """
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            kind = (
                "a FIFO"
                if stat.S_ISFIFO(mode)
                else "a directory"
                if stat.S_ISDIR(mode)
                else "a socket"
                if stat.S_ISSOCK(mode)
                else "a device"
            )
            raise OSError(22, f"{kind}, not a regular file", str(path))
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_regular(path: str | os.PathLike) -> bytearray:
    """The whole content of the regular file ``path`` (see ``open_regular``), read once into one buffer.

    Raises:
        OSError: as ``open_regular``, or a read failed.
    """
    with open_regular(path) as f:
        size = os.fstat(f.fileno()).st_size
        data = bytearray(size)
        got = f.readinto(data)
        if got != size or f.read(1):  # the file changed size while read: read what is there now
            f.seek(0)
            data = bytearray(f.read())
    return data


def file_sha256(path: Path, block_bytes: int = 1 << 22) -> str:
    """Hex sha256 of the bytes of file ``path``, read in blocks (memory stays at one block)."""
    digest = hashlib.sha256()
    with open_regular(path) as f:
        while block := f.read(block_bytes):
            digest.update(block)
    return digest.hexdigest()


def drop_page_cache(paths: list[Path]) -> None:
    """Evict ``paths`` from the page cache, so the next read is cold (benchmarks)."""
    os.sync()
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def failure(exc: BaseException) -> str:
    """``" at FILE (reason)"``: where an ``OSError`` struck and why, for a one-line write error
    (``"writing to X failed" + failure(exc) + "; fix ..."``); no file, no ``at``."""
    filename = getattr(exc, "filename", None)
    where = f" at {filename}" if filename else ""
    return f"{where} ({getattr(exc, 'strerror', None) or exc})"
