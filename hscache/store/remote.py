"""Caches at fsspec URLs (``s3://bucket/cache``, ``gs://...``): read in place, write by upload.

Reading: ``open_remote_cache(url)`` copies the small files (manifest, index parts, provenance,
``target/``) into a local mirror directory and reads the arrays straight from the URL through
zarr's ``FsspecStore``: a worker fetches only the chunks of the rows it reads.

Writing (the honest, simple design): ``extract --out s3://...`` extracts into a local staging
directory (resumable like any local run) and, once finished, uploads the committed cache:
every file but ``manifest.json`` first, the manifest last, so a reader of the URL sees the old
cache or the whole new one, never a partial one. Limitation: no incremental remote commits;
nothing is visible at the URL until the run ends, and the staging disk must hold the cache.

Credentials and endpoints come from the usual places (``AWS_*`` environment variables,
``~/.aws``, fsspec configuration, e.g. ``AWS_ENDPOINT_URL`` for an S3-compatible server).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import uuid
from pathlib import Path
from typing import Any

import zarr

from hscache.errors import CacheFormatError, CacheNotFoundError, InputError
from hscache.store import fsio
from hscache.store.layout import ARRAYS_GROUP, CREATING_MARK, MANIFEST, PROVENANCE, TARGET_DIR
from hscache.store.reader import Cache

__all__ = ["RemoteCache", "is_url", "open_remote_cache", "staging_dir", "upload_cache"]

_MIRRORS = "hscache-remote"


def is_url(path: str | Path) -> bool:
    """Whether ``path`` names an fsspec URL (``proto://...``) rather than a local path."""
    return "://" in str(path)


def _filesystem(url: str) -> tuple[Any, str]:
    try:
        import fsspec
    except ImportError as exc:
        raise InputError(f"{url} needs fsspec; pip install fsspec (and s3fs for s3://)") from exc
    try:
        return fsspec.core.url_to_fs(url)
    except (ImportError, ValueError) as exc:  # unknown protocol or its backend package missing
        raise InputError(f"cannot open {url} ({exc}); install the fsspec backend, e.g. pip install s3fs") from exc


def _local_root() -> Path:
    return Path(os.environ.get("HSCACHE_LOCAL_DIR") or Path.home() / ".cache" / "hscache")


def staging_dir(url: str) -> Path:
    """The local directory an extraction to ``url`` writes before uploading (stable: a re-run resumes)."""
    return _local_root() / "staging" / hashlib.sha256(url.encode()).hexdigest()[:16]


def _fetch(fs: Any, remote: str, local: Path) -> None:
    """Copy one file unless the mirror already has it at the same size (e.g. the target head)."""
    size = fs.size(remote)
    if local.is_file() and local.stat().st_size == size:
        return
    local.parent.mkdir(parents=True, exist_ok=True)
    tmp = local.with_name(f"{local.name}{fsio.TEMP_MARK}{uuid.uuid4().hex}")
    fs.get_file(remote, str(tmp))
    os.replace(tmp, local)  # several worker processes may mirror the same cache at once


class RemoteCache(Cache):
    """A ``Cache`` whose arrays are read from ``url``; ``path`` is the local mirror of its small files."""

    def __init__(self, url: str, mirror: Path, manifest: dict[str, Any]):
        super().__init__(mirror, manifest)
        self.url = url
        from zarr.storage import FsspecStore

        # from_url makes its own asynchronous filesystem on zarr's event loop (sharing ``fs`` fails:
        # an s3fs instance is bound to fsspec's loop); local/sync backends are wrapped by zarr.
        store = FsspecStore.from_url(f"{url}/{ARRAYS_GROUP}", read_only=True)
        self._group = zarr.open_group(store, mode="r")
        self._arrays, self._chunk_readers = {}, {}  # read through the URL, never the mirror

    def __repr__(self) -> str:
        return f"RemoteCache({self.url!r}, sequences={len(self)}, tokens={self.num_tokens}, layers={self.layer_ids})"


def open_remote_cache(url: str) -> RemoteCache:
    """Open the cache at ``url`` read-only (see module docstring).

    Raises:
        CacheNotFoundError: no manifest.json at ``url``.
        CacheFormatError: as for a local cache.
        InputError: fsspec or the protocol's backend is not installed.
    """
    url = url.rstrip("/")
    fs, root = _filesystem(url)
    try:
        manifest = json.loads(fs.cat_file(f"{root}/{MANIFEST}"))
    except FileNotFoundError as exc:
        raise CacheNotFoundError(f"{url} is not an hscache cache (no {MANIFEST}); create one with "
                                 f"`hscache extract --out {url}`") from exc
    except json.JSONDecodeError as exc:
        raise CacheFormatError(f"{url}/{MANIFEST} is not valid JSON ({exc}); the cache is damaged") from exc
    mirror = _local_root() / "mirrors" / hashlib.sha256(url.encode()).hexdigest()[:16]
    names = [*manifest.get("index_parts", []), f"{ARRAYS_GROUP}/zarr.json"]
    if fs.exists(f"{root}/{PROVENANCE}"):
        names.append(PROVENANCE)
    names += [f"{TARGET_DIR}/{p.rsplit('/', 1)[1]}" for p in fs.ls(f"{root}/{TARGET_DIR}", detail=False)]
    for name in names:
        _fetch(fs, f"{root}/{name}", mirror / name)
    fsio.atomic_write_json(mirror / MANIFEST, manifest)
    from hscache.store.reader import read_manifest

    return RemoteCache(url, mirror, read_manifest(mirror))


def _upload_order(local: Path) -> list[Path]:
    """Every committed file, manifest last; leftovers of killed runs (temp, .partial) excluded."""
    files = [p for p in sorted(local.rglob("*")) if p.is_file() and fsio.TEMP_MARK not in p.name
             and not p.name.endswith(".partial") and p.name != CREATING_MARK]
    return [p for p in files if p.name != MANIFEST or p.parent != local] + [local / MANIFEST]


def upload_cache(local: str | Path, url: str, *, remove_local: bool = False) -> None:
    """Publish the cache at ``local`` to ``url``: old manifest removed first, new manifest last.

    Raises:
        CacheNotFoundError: ``local`` holds no cache.
        OSError: an upload failed (the URL then has no manifest: re-run to upload again).
    """
    local, url = Path(local), url.rstrip("/")
    if not (local / MANIFEST).is_file():
        raise CacheNotFoundError(f"{local} holds no cache to upload (no {MANIFEST})")
    fs, root = _filesystem(url)
    if fs.exists(f"{root}/{MANIFEST}"):
        fs.rm_file(f"{root}/{MANIFEST}")  # readers must never see the old manifest over new files
    for path in _upload_order(local):
        fs.put_file(str(path), f"{root}/{path.relative_to(local).as_posix()}")
    if remove_local:
        shutil.rmtree(local)
