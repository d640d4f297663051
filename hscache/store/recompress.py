"""``recompress_cache(root, compression)``: convert a cache's arrays to another codec, in place.

A scoring cache (``fast``) becomes a training cache (``none``) without re-extracting, and back.
The decoded bytes never change: only each array's chunk files and its ``zarr.json`` codecs do.

Protocol, array by array (crash-safe and resumable like every other write, under the writer lock):

1. build the converted array in ``<cache>/.hscache-recompress/<array>/`` (a zarr v3 array with the
   new codecs): each committed chunk is read through the checked read path (its crc32c verified,
   store/chunks.py) and written whole by zarr (temp file + rename);
2. fsync every new chunk file, its directories and ``zarr.json``;
3. swap the two directories in one ``renameat2(RENAME_EXCHANGE)`` (Linux): a reader sees the old
   array or the new one, never a mix; where the exchange is not supported, two renames with the
   old array parked as ``.hscache-recompress/<array>.old`` (a resume finishes the swap);
4. delete the old array and publish a manifest recording the array's new codec and ``zarr.json``
   digest (its own ``compression`` field); once every array is converted, the manifest's
   ``compression`` names the new codec, then the work directory is deleted.

A kill at any point leaves every array readable (old or new codec, each array's ``zarr.json``
naming its own); re-running the command skips converted arrays, keeps the chunks already written
to the work directory (each re-checked by its crc32c) and finishes. Chunks past the committed
tokens (written by a run that was killed before its commit) are not carried over: they do not exist.
Readers that opened the cache before a swap must reopen it (their arrays' codecs changed).
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import zarr

from hscache.errors import CacheFormatError, InputError, StoreWriteError
from hscache.store import fsio, integrity
from hscache.store.chunks import chunk_reader
from hscache.store.layout import ARRAYS_GROUP, COMPRESSIONS, ArraySpec, chunk_key, codecs_for
from hscache.store.lock import writer_lock
from hscache.store.reader import read_manifest
from hscache.store.shards import has_shards
from hscache.store.writer import publish_manifest

__all__ = ["WORK_DIR", "exchange_dirs", "recompress_cache"]

WORK_DIR = ".hscache-recompress"
_RENAME_EXCHANGE = 2  # linux/fs.h


def _exchange(a: Path, b: Path) -> bool:
    """Swap directories ``a`` and ``b`` atomically; False where the system cannot (then nothing moved)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd = -100
    result = renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), _RENAME_EXCHANGE)
    if result == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), str(a))


def exchange_dirs(a: Path, b: Path) -> bool:
    """Swap directories ``a`` and ``b`` in one ``renameat2(RENAME_EXCHANGE)``; False where the system
    cannot (then nothing moved): the caller falls back to two renames (store/compact_convert.py too)."""
    return _exchange(a, b)


def _codec_names(array_dir: Path) -> list[dict[str, Any]]:
    return json.loads((array_dir / "zarr.json").read_text()).get("codecs") or []


def _target_codecs(spec: ArraySpec, compression: str, dtype: str) -> list[dict[str, Any]]:
    """The codec list zarr records for ``spec`` written with ``compression`` (to compare with a zarr.json)."""
    probe = zarr.create_array(
        store={},
        shape=(0, *spec.row_shape),
        chunks=(spec.chunk_tokens, *spec.row_shape),
        dtype=dtype,
        compressors=codecs_for(spec, compression),
    )
    return json.loads(json.dumps(list(probe.metadata.to_dict()["codecs"])))  # as a zarr.json holds it


def _finish_parked_swap(live: Path, staged: Path, parked: Path) -> None:
    """Complete a two-rename swap that was killed between its renames (no-op otherwise)."""
    if not live.exists() and parked.exists():
        os.replace(staged if staged.exists() else parked, live)
        fsio.fsync_dir(live.parent)
    if parked.exists() and live.exists():
        shutil.rmtree(parked)


def _open_staged(
    staged: Path, source: zarr.Array, spec: ArraySpec, compression: str, want: list
) -> zarr.Array:
    """The work array for ``spec`` (resumed when it already has the wanted codecs, else started over)."""
    if (staged / "zarr.json").is_file():
        if _codec_names(staged) == want and json.loads((staged / "zarr.json").read_text())["shape"] == list(
            source.shape
        ):
            return zarr.open_array(str(staged), mode="a", zarr_format=3).with_config(
                {"write_empty_chunks": True}
            )
        shutil.rmtree(staged)  # a killed conversion to another codec, or an old array left by a swap
    elif staged.exists():
        shutil.rmtree(staged)
    array = zarr.create_array(
        str(staged),
        shape=source.shape,
        chunks=(spec.chunk_tokens, *spec.row_shape),
        dtype=source.dtype,
        fill_value=0,
        compressors=codecs_for(spec, compression),
        config={"write_empty_chunks": True},
    )
    array.attrs.update(dict(source.attrs))
    return array


def _chunk_is_sound(staged_reader: Any, index: int) -> bool:
    """A chunk already in the work array that reads back whole (crc32c and frame checked)."""
    if not staged_reader.chunk_path(index).is_file():
        return False
    base = index * staged_reader.chunk_tokens
    try:
        staged_reader.read(base, base + staged_reader.chunk_tokens)
    except CacheFormatError:
        return False
    return True


def _write_chunk(staged: zarr.Array, source_read: Callable[[int, int], np.ndarray], a: int, b: int) -> None:
    """One whole chunk: read (checked) from the source array, written by zarr to the work array."""
    staged[a:b] = source_read(a, b)


def _convert_array(
    root: Path,
    name: str,
    spec: ArraySpec,
    compression: str,
    committed_tokens: int,
    progress: Callable[[str], None],
    announce: Callable[[Path], None],
) -> None:
    """Convert one array (protocol steps 1-4); ``announce(staged zarr.json)`` runs just before the swap."""
    live = root / ARRAYS_GROUP / name
    work = root / WORK_DIR
    staged, parked = work / name, work / f"{name}.old"
    _finish_parked_swap(live, staged, parked)
    source = zarr.open_group(str(live.parent), mode="r", zarr_format=3)[
        name
    ]  # via the group: errors name the array
    want = _target_codecs(spec, compression, str(source.dtype))
    if _codec_names(live) == want:
        if staged.exists():
            shutil.rmtree(staged)  # the old array, left by a swap that was killed before this delete
        return
    work.mkdir(exist_ok=True)
    target = _open_staged(staged, source, spec, compression, want)
    reader = chunk_reader(source)
    staged_reader = chunk_reader(target)

    def read(a: int, b: int) -> np.ndarray:
        return reader.read(a, b) if reader is not None else np.asarray(source[a:b])

    ct = spec.chunk_tokens
    chunks = -(-min(committed_tokens, source.shape[0]) // ct)
    kept = 0
    for index in range(chunks):
        if staged_reader is not None and _chunk_is_sound(staged_reader, index):
            kept += 1
            continue
        _write_chunk(target, read, index * ct, min((index + 1) * ct, source.shape[0]))
    for index in range(chunks):
        fsio.fsync_file_and_parents(staged / chunk_key(spec, index), staged)
    fsio.fsync_file(staged / "zarr.json")
    fsio.fsync_dir(work)
    announce(staged / "zarr.json")
    if _exchange(staged, live):
        fsio.fsync_dir(live.parent)
        fsio.fsync_dir(work)
        shutil.rmtree(staged)  # now the old array
    else:
        os.replace(live, parked)
        os.replace(staged, live)
        fsio.fsync_dir(live.parent)
        fsio.fsync_dir(work)
        shutil.rmtree(parked)
    progress(
        f"{name}: {chunks} chunks converted to {compression}"
        + (f" ({kept} kept from an earlier run)" if kept else "")
    )


def _announce_swap(
    root: Path, manifest: dict[str, Any], name: str, compression: str, staged_meta: Path
) -> None:
    """Publish that array ``name`` is about to become ``compression`` with the staged zarr.json:
    until ``_record_array``, the old and the new array both verify (store/integrity.py)."""
    converting: dict[str, Any] = {"compression": compression}
    if "checksums" in manifest:
        converting["zarr_json_sha256"] = integrity.zarr_json_sha256(json.loads(staged_meta.read_bytes()))
    if manifest["arrays"][name].get("converting") != converting:
        manifest["arrays"][name]["converting"] = converting
        publish_manifest(root, manifest)


def _record_array(root: Path, manifest: dict[str, Any], name: str, compression: str) -> None:
    """Publish array ``name``'s new codec (its own ``compression`` until every array has it) and its
    zarr.json digest. Skipped when nothing changed (an array converted by an earlier run and
    recorded then)."""
    entry = manifest["arrays"][name]
    before = dict(entry)
    entry.pop("converting", None)
    if compression != manifest.get("compression"):
        entry["compression"] = compression
    else:
        entry.pop("compression", None)
    if "zarr_json_sha256" in entry or "checksums" in manifest:
        meta = json.loads((root / ARRAYS_GROUP / name / "zarr.json").read_bytes())
        entry["zarr_json_sha256"] = integrity.zarr_json_sha256(meta)
    if entry != before:
        publish_manifest(root, manifest)


def recompress_cache(
    root: str | Path, compression: str, progress: Callable[[str], None] = lambda _line: None
) -> dict[str, Any]:
    """Convert every array of the cache at ``root`` to ``compression`` (none, fast, balanced) in place.

    Returns the new manifest. Safe to kill at any point and to re-run (see the module docstring).

    Raises:
        InputError: an unknown codec name, or ``root`` is a directory of shards (convert each shard).
        CacheNotFoundError, CacheFormatError: no cache at ``root``, or a chunk fails its checksum
            (the cache is then unchanged apart from arrays already converted, which read the same).
        CacheLockedError: another process is writing the cache.
        StoreWriteError: the disk refused a write (e.g. full); re-run to resume.
    """
    if compression not in COMPRESSIONS:
        raise InputError(f"--compression {compression!r}: choose one of {', '.join(COMPRESSIONS)}")
    root = Path(root)
    if has_shards(root):
        raise InputError(f"{root} holds shards: recompress each shard directory ({root}/<shard>) in turn")
    read_manifest(root)  # CacheNotFoundError before the lock creates anything
    with writer_lock(root, f"hscache recompress --compression {compression}"):
        manifest = read_manifest(root)  # re-read under the lock: nobody changes it from here on
        committed = int(manifest["committed"]["tokens"])
        try:
            for name, entry in manifest["arrays"].items():
                # The seal vouches for each array's zarr.json (store/integrity.py): the swap is announced
                # first (either zarr.json verifies during it) and recorded after, so the cache verifies
                # at every point of the conversion, a kill included.
                _convert_array(
                    root,
                    name,
                    ArraySpec.from_dict(name, entry),
                    compression,
                    committed,
                    progress,
                    announce=lambda meta_path, name=name: _announce_swap(
                        root, manifest, name, compression, meta_path
                    ),
                )
                _record_array(root, manifest, name, compression)
            if manifest.get("compression") != compression or any(
                "compression" in entry for entry in manifest["arrays"].values()
            ):
                manifest["compression"] = compression
                for entry in manifest["arrays"].values():
                    entry.pop("compression", None)
                publish_manifest(root, manifest)
            shutil.rmtree(root / WORK_DIR, ignore_errors=True)
        except OSError as exc:
            raise StoreWriteError(
                f"recompressing {root} failed{fsio.failure(exc)}; every array still reads as "
                "before: fix the cause (e.g. free disk space) and re-run the same command to resume"
            ) from exc
    return manifest
