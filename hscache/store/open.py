"""``open_cache(path)``: one entry point for every kind of cache, above the modules that read them.

A local directory -> ``Cache`` (store/reader.py); a directory of shards -> ``ShardedCache``
(store/shards.py); an fsspec URL -> ``RemoteCache`` (store/remote.py). The dispatch lives here
so that none of those three modules needs to import another one back.
"""

from __future__ import annotations

from pathlib import Path

from hscache.store.layout import MANIFEST
from hscache.store.paths import not_a_cache
from hscache.store.reader import open_local
from hscache.store.shards import has_shards, open_sharded
from hscache.store.urls import is_url
from hscache.store.view import CacheView

__all__ = ["check_cache_path", "open_cache"]


def check_cache_path(path: str | Path) -> None:
    """Refuse at once a local ``path`` that holds no cache (nor shards), saying what it is instead:
    what a command runs before its heavy imports (torch), so that a typo costs no wait.

    Raises:
        CacheNotFoundError: as ``open_cache`` would, in one line.
    """
    if is_url(path):
        return
    root = Path(path)
    manifest = root / MANIFEST
    if not has_shards(root) and not (manifest.exists() or manifest.is_symlink()):
        raise not_a_cache(root)


def open_cache(path: str | Path, allow_unsealed: bool = False) -> CacheView:
    """Open the cache at ``path`` read-only; it shows the sequences committed so far.

    Every file is checked against the checksums its commit recorded (store/integrity.py); a cache
    without them (no seal) is refused unless ``allow_unsealed`` (``--allow-unsealed``).

    ``path`` may also be a directory of shards (``extract --shard I/N``), read as one cache
    (store/shards.py), or an fsspec URL such as ``s3://bucket/cache`` (store/remote.py).

    Raises:
        CacheNotFoundError: ``path`` holds no cache.
        CacheFormatError: the manifest or index is damaged or of an unknown version.
        InputError: a URL whose fsspec backend is not installed.
    """
    if is_url(path):
        from hscache.store.remote import open_remote_cache  # lazy: fsspec backends are optional

        return open_remote_cache(str(path), allow_unsealed=allow_unsealed)
    root = Path(path)
    if has_shards(root):  # refuses a directory that also holds a cache of its own
        return open_sharded(root, allow_unsealed=allow_unsealed)
    return open_local(root, allow_unsealed=allow_unsealed)
