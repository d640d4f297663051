"""Publishing a drafter directory whole: written beside its destination, then renamed into place.

``scorer init`` (and ``--train-steps``) used to rewrite an existing directory file by file; a
crash between ``config.json`` and the weights left a new config with old weights, which scored
silently. Here the files go to a hidden sibling directory and one rename publishes them, so a
reader sees the old drafter or the new one, never a mix. Replacing a non-empty directory needs
``overwrite``; a path that is a file is refused before any work is done.

One writer per drafter directory, as per cache: ``drafter_writer`` holds the cache's writer lock
(hscache/store/lock.py, an ``flock`` the kernel drops when its holder dies) on ``out`` for the whole
command, training included, so a second ``scorer init`` into the same directory is refused at once,
naming the process, instead of training for minutes and then finding the directory taken.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from hscache.errors import CacheLockedError
from hscache.store.fsio import fsync_dir, read_regular
from hscache.store.layout import WRITER_LOCK
from hscache.store.lock import current_writer, writer_lock
from hscache.store.marks import manifest_problem
from hscache.store.paths import drafter_files
from scorer.errors import ScorerError
from scorer.target_identity import IDENTITY_KEY

__all__ = ["check_drafter_dir", "drafter_writer", "staged_drafter_dir", "written_here"]


def _being_written(path: Path, holder: dict[str, Any] | None) -> ScorerError:
    holder = holder or {}
    started = holder.get("started_at")
    when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(started)) if started else "?"
    who = (
        f"pid {holder.get('pid')} on {holder.get('host')} (`{holder.get('command')}`, started {when})"
        if holder
        else "another process"
    )
    return ScorerError(
        f"{path} is being written by {who}; one writer per drafter directory: wait for it to finish "
        "(or stop it), or choose another directory"
    )


def _check_writable(out: str | os.PathLike) -> Path:
    """``out`` can become a drafter directory: no file in the way, not a cache nor inside one, no
    other process writing it."""
    path = Path(out)
    if path.exists() and not path.is_dir():
        raise ScorerError(f"{path} is a file, not a directory; pass a directory path for the drafter")
    if blocker := next((p for p in path.parents if p.exists() and not p.is_dir()), None):
        raise ScorerError(f"{blocker} is a file, not a directory; pass a directory path for the drafter")
    if path.is_dir() and manifest_problem(path) is None:
        raise ScorerError(
            f"{path} is a hidden-state cache, not a drafter directory: scorer init never replaces a cache "
            "(--overwrite replaces only a drafter it wrote); choose a new directory for the drafter"
        )
    if (cache := next((p for p in path.absolute().parents if manifest_problem(p) is None), None)) is not None:
        raise ScorerError(
            f"{path} is inside the cache {cache}; choose a directory for the drafter outside it"
        )
    holder = current_writer(path)
    if holder is not None and holder.get("pid") != os.getpid():  # this process's own lock is ours
        raise _being_written(path, holder)
    _recover_leftovers(path)
    return path


def _dead(pid_text: str) -> bool:
    """Whether the process that named a staging folder is gone (its leftovers are then ours to clear)."""
    try:
        pid = int(pid_text)
    except ValueError:
        return False
    if pid == os.getpid():
        return True  # our own, from an earlier call of this process
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:
        return False  # alive, another user's
    return False


def _recover_leftovers(path: Path) -> None:
    """Clear what a ``scorer init`` killed mid-publish left beside ``path`` (issue 36): its staging
    folder ``.<name>.staging-PID`` is removed; the drafter it had moved aside to replace,
    ``.<name>.replaced-PID``, is put back when ``path`` is missing (killed between its two renames:
    nothing already written is lost), else removed. Leftovers of a live process are left alone."""
    if not path.parent.is_dir():
        return
    for prefix in ("staging", "replaced"):
        found = sorted(
            (p for p in path.parent.glob(f".{path.name}.{prefix}-*") if _dead(p.name.rsplit("-", 1)[-1])),
            key=lambda p: p.stat().st_mtime,
        )
        if prefix == "replaced" and found and not path.exists() and not path.is_symlink():
            found.pop().rename(path)  # the newest moved-aside drafter
            fsync_dir(path.parent)
        for leftover in found:
            shutil.rmtree(leftover, ignore_errors=True)


def written_here(path: Path) -> bool:
    """Whether ``path`` holds a drafter this project wrote: its config.json (a regular file, read
    without following a link) records the target it was made for (scorer/target_identity.py)."""
    try:
        config = json.loads(read_regular(Path(path) / "config.json"))
    except (OSError, ValueError, RecursionError):
        return False
    return isinstance(config, dict) and IDENTITY_KEY in config


def check_drafter_dir(out: str | os.PathLike, overwrite: bool = False) -> Path:
    """Refuse an ``out`` that is a file, a cache or inside one, that another process is writing
    (``drafter_writer``), or a non-empty directory unless ``overwrite`` and it holds a drafter this
    project wrote (``written_here``): --overwrite replaces a drafter, never other files.

    Called before any expensive work (training), so a bad path costs nothing.
    """
    path = _check_writable(out)
    # The lock file of a writer (ours, or one killed) is no drafter file.
    held = sorted(p.name for p in path.iterdir() if p.name != WRITER_LOCK) if path.is_dir() else []
    if not held:
        return path
    if written_here(path):
        if not overwrite:
            raise ScorerError(
                f"{path} is not empty; pass --overwrite to replace it (the old files are removed), "
                "or choose a new directory"
            )
        return path
    what = (
        f"a drafter this project did not write ({', '.join(files)}; its config.json records no {IDENTITY_KEY})"
        if (files := drafter_files(path))
        else f"files that are not a drafter ({', '.join(held[:3])}{', ...' if len(held) > 3 else ''})"
    )
    raise ScorerError(
        f"{path} is not empty: it holds {what}; --overwrite replaces only a drafter scorer wrote, so "
        "nothing was touched: choose a new directory (or move those files away)"
    )


@contextlib.contextmanager
def drafter_writer(out: str | os.PathLike, command: str = "scorer init") -> Iterator[Path]:
    """Hold ``out``'s writer lock for the ``with`` block (the whole of a command that writes a
    drafter there). A directory it had to create for the lock is removed again when nothing was
    published into it. Whether ``out`` may be replaced (``check_drafter_dir``'s ``overwrite``) is
    the writer's to check, inside the block.

    Raises:
        ScorerError: another process is writing ``out`` (one line naming it), or ``out`` is a file.
    """
    path = _check_writable(out)
    with contextlib.ExitStack() as stack:
        try:
            stack.enter_context(writer_lock(path, command))
        except CacheLockedError:  # lost the race to a writer that started after the check
            raise _being_written(path, current_writer(path)) from None
        yield path


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
