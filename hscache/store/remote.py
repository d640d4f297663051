"""Caches at fsspec URLs (``s3://bucket/cache``, ``gs://...``): read in place, write by upload.

Reading: ``open_remote_cache(url)`` copies the small files (manifest, index parts, provenance,
``target/``) into a local mirror directory and reads the arrays straight from the URL through
zarr's ``FsspecStore``: a worker fetches only the chunks of the rows it reads. The mirror is
keyed by URL; each file in it is fetched again when its remote identity (ETag, md5 or generation,
else modification time, plus size) differs from the one recorded when it was mirrored, so a cache
re-published at the same URL is never read through stale mirrored files (e.g. the old target head).

Writing (the honest, simple design): ``extract --out s3://...`` extracts into a local staging
directory (resumable like any local run) and, once finished, uploads the committed cache:
every file but ``manifest.json`` first, the manifest last, so a reader of the URL sees the old
cache or the whole new one, never a partial one; files of an earlier upload that the new cache
lacks are removed from its folders before the manifest goes up. Limitation: no incremental remote commits;
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
from hscache.store import fsio, jsonio
from hscache.store.index import index_part_path
from hscache.store.layout import (
    ARRAYS_GROUP,
    CREATING_MARK,
    INDEX_DIR,
    MANIFEST,
    PROVENANCE,
    RUN_LOG,
    TARGET_DIR,
    WRITER_LOCK,
)
from hscache.store.reader import ARRAY_NAME, Cache, check_integrity, read_manifest

__all__ = ["RemoteCache", "list_files", "mirror_remote", "open_remote_cache", "staging_dir", "upload_cache"]

_MIRRORS = "hscache-remote"


def _filesystem(url: str) -> tuple[Any, str]:
    try:
        import fsspec
    except ImportError as exc:
        raise InputError(f"{url} needs fsspec; pip install fsspec (and s3fs for s3://)") from exc
    try:
        return fsspec.core.url_to_fs(url)
    except (ImportError, ValueError) as exc:  # unknown protocol or its backend package missing
        raise InputError(
            f"cannot open {url} ({exc}); install the fsspec backend, e.g. pip install s3fs"
        ) from exc


def _local_root() -> Path:
    return Path(os.environ.get("HSCACHE_LOCAL_DIR") or Path.home() / ".cache" / "hscache")


def staging_dir(url: str) -> Path:
    """The local directory an extraction to ``url`` writes before uploading (stable: a re-run resumes)."""
    return _local_root() / "staging" / hashlib.sha256(url.encode()).hexdigest()[:16]


# What identifies one version of a remote file, best first. Content or version stamps (S3 ETag,
# GCS md5/generation, ...) change whenever the bytes do; modification times are the fallback for
# backends without them. Size alone is not enough: re-extracting a same-architecture target gives
# a head.safetensors, config and index parts of the same sizes but other bytes.
_CONTENT_KEYS = ("ETag", "etag", "md5Hash", "md5", "crc32c", "checksum", "generation", "VersionId")
_TIME_KEYS = ("LastModified", "last_modified", "mtime", "updated", "modified", "created")


def _identity(info: dict[str, Any]) -> str | None:
    """A text that changes whenever the remote file does, or None where the backend gives no stamp."""
    for keys in (_CONTENT_KEYS, _TIME_KEYS):
        stamps = {k: str(info[k]) for k in keys if info.get(k) is not None}
        if stamps:
            return json.dumps({"size": info.get("size"), **stamps}, sort_keys=True)
    return None


def _fetch(fs: Any, remote: str, local: Path, info: dict[str, Any], stamp: Path) -> None:
    """Copy one file unless the mirror already holds this version of it (``stamp`` records which).

    The stamp is written after the file, so a stamp that matches always describes the file next to
    it; without an identity from the backend the file is copied every time.
    """
    identity = _identity(info)
    if (
        identity is not None
        and local.is_file()
        and local.stat().st_size == info.get("size")
        and stamp.is_file()
        and stamp.read_text() == identity
    ):
        return
    local.parent.mkdir(parents=True, exist_ok=True)
    tmp = local.with_name(f"{local.name}{fsio.TEMP_MARK}{uuid.uuid4().hex}")
    fs.get_file(remote, str(tmp))
    os.replace(tmp, local)  # several worker processes may mirror the same cache at once
    if identity is not None:
        fsio.atomic_write_bytes(stamp, identity.encode())


def _prune(mirror: Path, keep: set[str]) -> None:
    """Delete mirrored files the remote cache no longer has (e.g. a tokenizer file of an older target)."""
    for path in mirror.rglob("*"):
        name = path.relative_to(mirror).as_posix()
        if path.is_file() and name != MANIFEST and name not in keep and fsio.TEMP_MARK not in path.name:
            path.unlink(missing_ok=True)  # another process may prune the same file


class RemoteCache(Cache):
    """A ``Cache`` whose arrays are read from ``url``; ``path`` is the local mirror of its small files."""

    def __init__(
        self, url: str, mirror: Path, manifest: dict[str, Any], files: dict[str, bytes] | None = None
    ):
        super().__init__(mirror, manifest, files)
        self.url = url
        from zarr.storage import FsspecStore

        # from_url makes its own asynchronous filesystem on zarr's event loop (sharing ``fs`` fails:
        # an s3fs instance is bound to fsspec's loop); local/sync backends are wrapped by zarr.
        store = FsspecStore.from_url(f"{url}/{ARRAYS_GROUP}", read_only=True)
        self._group = zarr.open_group(store, mode="r", zarr_format=3)  # no v2 metadata probes
        self._arrays, self._chunk_readers = {}, {}  # read through the URL, never the mirror

    def __repr__(self) -> str:
        return f"RemoteCache({self.url!r}, sequences={len(self)}, tokens={self.num_tokens}, layers={self.layer_ids})"


def open_remote_cache(url: str, allow_unsealed: bool = False) -> RemoteCache:
    """Open the cache at ``url`` read-only (see module docstring), with the same checks as a local
    open run on the mirrored small files (store/integrity.py); each chunk is checked against its
    recorded sha256 when first read.

    Raises:
        CacheNotFoundError: no manifest.json at ``url``.
        CacheFormatError: as for a local cache.
        InputError: fsspec or the protocol's backend is not installed.
    """
    url = url.rstrip("/")
    mirror = mirror_remote(url)
    manifest = read_manifest(mirror)
    files: dict[str, bytes] = {}
    try:
        check_integrity(mirror, manifest, allow_unsealed=allow_unsealed, keep=files)
    except CacheFormatError as exc:
        raise CacheFormatError(str(exc).replace(str(mirror), url)) from None
    return RemoteCache(url, mirror, manifest, files)


def list_files(url: str, folder: str) -> list[str]:
    """Every file below ``folder`` of the cache at ``url``, relative to the cache (one listing)."""
    fs, root = _filesystem(url.rstrip("/"))
    fs.invalidate_cache(f"{root}/{folder}")
    try:
        return [path[len(root) :].lstrip("/") for path in fs.find(f"{root}/{folder}")]
    except FileNotFoundError:
        return []


def mirror_remote(url: str) -> Path:
    """Copy the small files of the cache at ``url`` (manifest, index parts, provenance, target/,
    every zarr.json) into its local mirror, unchecked; return the mirror directory.

    Raises:
        CacheNotFoundError, CacheFormatError, InputError: as ``open_remote_cache``.
    """
    url = url.rstrip("/")
    fs, root = _filesystem(url)
    # fsspec instances are shared and cache listings (s3fs answers info() from them): one made before
    # the cache was re-published would describe the old files. Invalidating a folder clears its parents.
    for folder in (TARGET_DIR, INDEX_DIR, ARRAYS_GROUP):
        fs.invalidate_cache(f"{root}/{folder}")
    try:
        manifest_bytes = fs.cat_file(f"{root}/{MANIFEST}")
    except FileNotFoundError as exc:
        raise CacheNotFoundError(
            f"{url} is not an hscache cache (no {MANIFEST}); create one with `hscache extract --out {url}`"
        ) from exc
    manifest = jsonio.load_cache_object(manifest_bytes, f"{url}/{MANIFEST}")
    key = hashlib.sha256(url.encode()).hexdigest()[:16]
    mirror, stamps = _local_root() / "mirrors" / key, _local_root() / "mirrors" / f"{key}.stamps"
    parts = manifest.get("index_parts") if isinstance(manifest, dict) else None
    for name in parts if isinstance(parts, list) else []:
        index_part_path(mirror, name)  # a name like ../x must not write outside the mirror
    arrays = manifest.get("arrays") if isinstance(manifest.get("arrays"), dict) else {}
    # Every array's zarr.json too: the same checks as a local open (store/integrity.py) run on the mirror.
    array_metas = [f"{ARRAYS_GROUP}/{name}/zarr.json" for name in arrays if ARRAY_NAME.match(str(name))]
    infos = {}
    for name in [
        *(parts if isinstance(parts, list) else []),
        f"{ARRAYS_GROUP}/zarr.json",
        *array_metas,
        PROVENANCE,
        RUN_LOG,
    ]:
        try:
            infos[name] = fs.info(f"{root}/{name}")
        except FileNotFoundError:
            if name not in (PROVENANCE, RUN_LOG):  # optional (older caches), the rest is not
                raise CacheFormatError(
                    f"{url}/{name} is missing; the cache is damaged: re-extract with "
                    f"`hscache extract --out {url} --overwrite`"
                ) from None
    for info in fs.ls(f"{root}/{TARGET_DIR}", detail=True):
        name = str(info["name"]).rsplit("/", 1)[-1]
        # An empty object named "target/" (a folder marker some tools write) is no file (issue 36).
        folder_marker = str(info["name"]).rstrip("/") == f"{root}/{TARGET_DIR}".rstrip("/") or not name
        if info.get("type", "file") == "file" and not folder_marker:
            infos[f"{TARGET_DIR}/{name}"] = info
    for name, info in infos.items():
        _fetch(fs, f"{root}/{name}", mirror / name, info, stamps / name)
    _prune(mirror, set(infos))
    fsio.atomic_write_json(mirror / MANIFEST, manifest)
    return mirror


def _upload_order(local: Path) -> list[Path]:
    """Every committed file, manifest last; leftovers of killed runs (temp, .partial) excluded."""
    files = [
        p
        for p in sorted(local.rglob("*"))
        if p.is_file()
        and fsio.TEMP_MARK not in p.name
        and not p.name.endswith(".partial")
        and p.name not in (CREATING_MARK, WRITER_LOCK)
    ]
    return [p for p in files if p.name != MANIFEST or p.parent != local] + [local / MANIFEST]


def _remove_stale(fs: Any, root: str, names: set[str]) -> None:
    """Delete files an earlier upload left in the cache's own folders (e.g. the old target's tokenizer
    files, which a reader would otherwise mirror next to the new ones); nothing else at the URL."""
    for folder in (TARGET_DIR, INDEX_DIR, ARRAYS_GROUP):
        fs.invalidate_cache(f"{root}/{folder}")
        try:
            found = fs.find(f"{root}/{folder}")
        except FileNotFoundError:
            continue
        stale = [path for path in found if path[len(root) :].lstrip("/") not in names]
        if stale:
            fs.rm(stale)


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
    order = _upload_order(local)
    names = {path.relative_to(local).as_posix() for path in order}
    for path in order[:-1]:
        fs.put_file(str(path), f"{root}/{path.relative_to(local).as_posix()}")
    _remove_stale(fs, root, names)
    fs.put_file(str(order[-1]), f"{root}/{MANIFEST}")
    if remove_local:
        shutil.rmtree(local)
