"""What a path that should be a cache (or a peer's folder) is instead, and the advice that fits it.

A command given something that is not a cache says what the path is (missing, a file, an empty
directory, a drafter directory, a folder inside a cache, a folder of other files) and the one fix
that fits that case: never "create a cache there" for a file or a drafter, never "no manifest" for
a path that does not exist. Cheap and torch-free: every command calls these before its heavy imports.
"""

from __future__ import annotations

from pathlib import Path

from hscache.errors import CacheNotFoundError, InputError
from hscache.store.layout import MANIFEST, WRITER_LOCK
from hscache.store.marks import check_marked_dir

__all__ = [
    "check_empty_out",
    "check_source_dir",
    "drafter_files",
    "enclosing_cache",
    "is_cache_dir",
    "not_a_cache",
]


def is_cache_dir(path: Path) -> bool:
    """A directory holding a manifest (a cache, complete or not)."""
    return (Path(path) / MANIFEST).is_file()


def enclosing_cache(path: Path) -> Path | None:
    """The cache directory ``path`` lies inside (a file or folder of it), or None."""
    for parent in Path(path).absolute().parents:
        if is_cache_dir(parent):
            return parent
    return None


def drafter_files(path: Path) -> list[str]:
    """``config.json`` and the weight files of a drafter (or model) directory; [] when it is none."""
    path = Path(path)
    if not (path / "config.json").is_file():
        return []
    weights = sorted(p.name for p in path.iterdir() if p.suffix in (".safetensors", ".bin", ".pt"))
    return ["config.json", *weights[:2]] if weights else []


def not_a_cache(path: str | Path, *, hint: str | None = None) -> CacheNotFoundError:
    """The one-line error for ``path`` given as a cache that holds none, with the fix that fits
    what it is. ``hint``: how to make a cache in the missing/empty case (default: extract into it)."""
    path = Path(path)
    make = hint or f"make one with `hscache extract --out {path}`"
    inside = enclosing_cache(path)
    if inside is not None:
        what, fix = f"is inside the cache {inside}", f"pass the cache directory itself: {inside}"
    elif not path.exists():
        what, fix = "does not exist", f"check the path, or {make}"
    elif path.is_file():
        what = "is a file, not a cache (a cache is a directory holding manifest.json)"
        fix = "pass the cache directory"
    elif not any(path.iterdir()):
        what, fix = "is an empty directory, not a cache", make
    elif files := drafter_files(path):
        what = f"is a drafter or model directory ({', '.join(files)}; no {MANIFEST}), not a cache"
        fix = "pass the cache directory (scorer commands take the drafter first and the cache with --cache)"
    else:
        what = f"holds no cache (no {MANIFEST})"
        fix = "pass a cache directory, or make one with `hscache extract --out NEW_DIR` (a new or empty directory)"
    return CacheNotFoundError(f"{path} {what}; {fix}")


def check_source_dir(path: str | Path, fmt: str) -> Path:
    """``hscache import``'s source: an existing directory, said in one line before anything loads.

    Raises:
        InputError: ``path`` does not exist or is a file.
    """
    path = Path(path)
    if not path.exists():
        raise InputError(
            f"{path} does not exist; pass the folder of {fmt} files to import "
            f"(e.g. what `hscache export --format {fmt}` or {fmt} itself wrote)"
        )
    if not path.is_dir():
        raise InputError(f"{path} is a file; pass the folder of {fmt} files that holds it")
    return path


def check_empty_out(out: str | Path, flag: str = "--out", *, restart_mark: str | None = None) -> None:
    """An output directory that must be new or empty (export, import), checked without creating it.
    ``restart_mark``: a file whose presence marks our own killed run, which may be started over
    (when hscache wrote it and ``out`` holds only what that run created: store/marks.py).

    Raises:
        InputError: a file is in the way, ``out`` is inside a cache, or it holds other files.
    """
    out = Path(out)
    if blocker := next((p for p in out.parents if p.exists() and not p.is_dir()), None):
        raise InputError(f"{flag} {out}: {blocker} is a file, not a directory; choose another path")
    if out.exists() and not out.is_dir():
        raise InputError(f"{flag} {out} is a file; choose a new or empty directory")
    if (inside := enclosing_cache(out)) is not None:
        raise InputError(f"{flag} {out} is inside the cache {inside}; choose a directory outside it")
    if not out.is_dir():
        return
    if restart_mark and ((out / restart_mark).exists() or (out / restart_mark).is_symlink()):
        check_marked_dir(out, restart_mark, flag)
        return
    if any(p.name != WRITER_LOCK for p in out.iterdir()):
        raise InputError(f"{flag} {out} exists and is not empty; choose a new or empty directory")
