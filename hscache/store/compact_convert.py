"""``convert_states(root, "fp8")``: make a finished cache compact in place (``hscache recompress --states
fp8``, ``hscache extract --states fp8``): fp8 bits + scales for ``hidden_states`` (store/compact.py) and
an exact slice kept at the source dtype.

Protocol (under the writer lock; crash-safe like store/recompress.py):

1. build the fp8 ``hidden_states``, ``hidden_states_scale`` and the exact slice in
   ``<cache>/.hscache-states/`` from the source rows, each read through the checked read path
   (crc32c and the chunk's recorded sha256), hashing each chunk as it is written; fsync everything;
2. publish a manifest announcing the conversion (``states_converting``: the new arrays' entries and
   the ``states`` record): readers still read the source array, which it leaves untouched;
3. move the scale array and the exact slice into place (paths the current manifest does not name),
   then swap the two ``hidden_states`` directories in one ``renameat2(RENAME_EXCHANGE)`` (two renames
   with the old one parked where the system has none);
4. rewrite ``provenance.json`` with ``states`` and publish the compact manifest (``states``, the new arrays' entries and chunk hashes: the cache's
   digest changes), then delete the old array and the work directory.

A kill before step 3's swap leaves the source cache as it was (a re-run starts the conversion over);
after it, the re-run only publishes the announced manifest. Between the swap and that publish (one
manifest write) readers refuse the cache by name (its ``hidden_states`` zarr.json is not the one
recorded): re-run the command. The conversion is one way: the source values are gone.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import zarr

from hscache import schemas
from hscache.errors import InputError, StoreWriteError
from hscache.store import fsio, integrity, jsonio
from hscache.store.compact import EXACT_ARRAY, FP8, SCALE_ARRAY, STATES, exact_rows_for, is_compact, quantise
from hscache.store.layout import ARRAYS_GROUP, PROVENANCE, ArraySpec, chunk_key, chunk_tokens_for, codecs_for
from hscache.store.lock import writer_lock
from hscache.store.reader import open_local, read_manifest
from hscache.store.recompress import exchange_dirs
from hscache.store.shards import has_shards
from hscache.store.writer import publish_manifest

__all__ = ["DEFAULT_EXACT_EVERY", "WORK_DIR", "convert_states"]

WORK_DIR = ".hscache-states"
# One sequence in 64 (at least one) also kept at the source dtype: at bf16, 1/64 of a lossless cache
# more (0.50x + 0.016x of codec none), and a 1,000-sequence cache's drift measured on ~16 requests.
DEFAULT_EXACT_EVERY = 64
_PARKED = "hidden_states.old"


class _Staged:
    """One staged zarr array written chunk by chunk (whole chunks), each chunk's sha256 kept."""

    def __init__(self, path: Path, spec: ArraySpec, tokens: int, compression: str):
        self.path, self.spec, self.tokens = path, spec, tokens
        self.array = zarr.create_array(
            str(path),
            shape=(tokens, *spec.row_shape),
            chunks=(spec.chunk_tokens, *spec.row_shape),
            dtype=spec.stored_dtype,
            fill_value=0,
            compressors=codecs_for(spec, compression),
            config={"write_empty_chunks": True},
        )
        self.array.attrs.update({"logical_dtype": spec.logical_dtype, "hscache_array": spec.name})
        self.sha256: list[str] = []
        self._parts: list[np.ndarray] = []
        self._buffered = 0
        self._written = 0

    def append(self, rows: np.ndarray) -> None:
        self._parts.append(rows)
        self._buffered += len(rows)
        while self._buffered >= self.spec.chunk_tokens or (
            self._buffered and self._written + self._buffered == self.tokens
        ):
            data = np.concatenate(self._parts) if len(self._parts) > 1 else self._parts[0]
            n = min(len(data), self.spec.chunk_tokens)
            self.array[self._written : self._written + n] = data[:n]
            self.sha256.append(integrity.rows_sha256(data[:n]))
            self._written += n
            self._parts = [data[n:]] if n < len(data) else []
            self._buffered -= n

    def entry(self) -> dict[str, Any]:
        """The manifest entry of the finished array (files fsynced first)."""
        for index in range(len(self.sha256)):
            fsio.fsync_file_and_parents(self.path / chunk_key(self.spec, index), self.path)
        fsio.fsync_file(self.path / "zarr.json")
        meta = json.loads((self.path / "zarr.json").read_bytes())
        return {
            **self.spec.to_dict(),
            "chunk_sha256": self.sha256,
            "zarr_json_sha256": integrity.zarr_json_sha256(meta),
        }


def _stage(
    root: Path, manifest: dict[str, Any], work: Path, every: int, seed: int, progress: Callable[[str], None]
) -> dict[str, Any]:
    """Steps 1: the staged arrays in ``work``; returns the announcement (``states_converting``)."""
    cache = open_local(root)
    source = cache.specs["hidden_states"]
    tokens, compression = cache.num_tokens, manifest["compression"]
    layers = source.row_shape[0]
    fp8 = ArraySpec("hidden_states", source.row_shape, FP8, source.chunk_tokens)
    scale = ArraySpec(SCALE_ARRAY, (layers,), "float32", source.chunk_tokens)
    rows = exact_rows_for([str(r) for r in cache.index.column("record_id").to_pylist()], seed, every)
    exact_tokens = int(sum(int(cache.lengths[r]) for r in rows))
    # Chunks no longer than the slice: zarr stores an edge chunk whole (store/layout.py).
    exact_chunk = chunk_tokens_for(
        source.bytes_per_token, source.chunk_tokens * source.bytes_per_token, exact_tokens
    )
    exact = ArraySpec("hidden_states", source.row_shape, source.logical_dtype, exact_chunk)
    bits_out = _Staged(work / "hidden_states", fp8, tokens, compression)
    scale_out = _Staged(work / SCALE_ARRAY, scale, tokens, compression)
    exact_out = _Staged(work / EXACT_ARRAY, exact, exact_tokens, compression)
    step = source.chunk_tokens
    for a in range(0, tokens, step):
        b = min(tokens, a + step)
        bits, scales = quantise(cache.rows("hidden_states", a, b))
        bits_out.append(bits)
        scale_out.append(scales)
    offsets, at = [], 0
    for r in rows:
        start, stop = cache.sequence_span(r)
        exact_out.append(cache.read_tokens("hidden_states", start, stop))
        offsets.append(at)
        at += stop - start
    arrays = {"hidden_states": bits_out.entry(), SCALE_ARRAY: scale_out.entry()}
    exact_entry = exact_out.entry()
    fsio.fsync_dir(work / "exact")
    fsio.fsync_dir(work)
    progress(f"hidden_states: {tokens} tokens as fp8 e4m3fn + scales; exact slice {len(rows)} sequences")
    states = {
        "codec": FP8,
        "dtype": source.logical_dtype,
        "scale_array": SCALE_ARRAY,
        "scale": "absmax / 448 per token and layer",
        "exact": {
            "rule": "sha256(f'{seed}:{record_id}') % every == 0 (at least one: the smallest hash)",
            "seed": int(seed),
            "every": int(every),
            "rows": rows,
            "offsets": offsets,
            "tokens": exact_tokens,
            "path": EXACT_ARRAY,
            "logical_dtype": source.logical_dtype,
            "stored_dtype": source.stored_dtype,
            "chunk_tokens": exact_chunk,
            "chunk_sha256": exact_entry["chunk_sha256"],
            "zarr_json_sha256": exact_entry["zarr_json_sha256"],
        },
    }
    return {"arrays": arrays, "states": states}


def _swapped(root: Path, announced: dict[str, Any]) -> bool:
    """True when ``arrays/hidden_states`` is already the announced fp8 array (step 3 done)."""
    meta = root / ARRAYS_GROUP / "hidden_states" / "zarr.json"
    if not meta.is_file():
        return False
    digest = integrity.zarr_json_sha256(json.loads(meta.read_bytes()))
    return digest == announced["arrays"]["hidden_states"]["zarr_json_sha256"]


def _undo_partial(root: Path, work: Path) -> None:
    """Before a fresh start: put a parked source array back, drop staged and half-moved arrays."""
    live, parked = root / ARRAYS_GROUP / "hidden_states", work / _PARKED
    if not live.exists() and parked.exists():
        os.replace(parked, live)
        fsio.fsync_dir(live.parent)
    shutil.rmtree(work, ignore_errors=True)
    shutil.rmtree(root / ARRAYS_GROUP / SCALE_ARRAY, ignore_errors=True)
    shutil.rmtree(root / "exact", ignore_errors=True)


def _move_in(root: Path, work: Path) -> None:
    """Step 3: the scale array and the exact slice into place, then the hidden_states swap."""
    os.replace(work / SCALE_ARRAY, root / ARRAYS_GROUP / SCALE_ARRAY)
    os.replace(work / "exact", root / "exact")
    fsio.fsync_dir(root)
    live, staged, parked = root / ARRAYS_GROUP / "hidden_states", work / "hidden_states", work / _PARKED
    if not exchange_dirs(staged, live):
        os.replace(live, parked)
        os.replace(staged, live)
    fsio.fsync_dir(live.parent)
    fsio.fsync_dir(work)


def _record_provenance(root: Path, manifest: dict[str, Any], states: dict[str, Any]) -> None:
    """provenance.json says so too (``states``), written after the swap: until the compact manifest
    records its checksum the cache is refused anyway (module docstring), and a re-run writes the same."""
    path = root / PROVENANCE
    if not path.is_file():
        return  # a cache written by the store layer alone has none
    provenance = jsonio.load_cache_object(path.read_bytes(), path)
    exact = states["exact"]
    provenance["states"] = {
        "codec": states["codec"],
        "scale": states["scale"],
        "source_dtype": states["dtype"],
        "exact_rule": exact["rule"],
        "exact_seed": exact["seed"],
        "exact_every": exact["every"],
    }
    schemas.validate(provenance, "provenance")
    data = (json.dumps(provenance, indent=2, sort_keys=True) + "\n").encode()
    fsio.atomic_write_bytes(path, data)
    if "checksums" in manifest:
        manifest["checksums"][PROVENANCE] = integrity.digest_bytes(data)


def _publish_compact(root: Path, manifest: dict[str, Any], announced: dict[str, Any]) -> dict[str, Any]:
    """Step 4: provenance and the compact manifest, then the old array and the work directory deleted."""
    _record_provenance(root, manifest, announced["states"])
    manifest.pop("states_converting", None)
    manifest["arrays"] = {**manifest["arrays"], **announced["arrays"]}
    manifest["states"] = announced["states"]
    publish_manifest(root, manifest)
    shutil.rmtree(root / WORK_DIR, ignore_errors=True)
    return manifest


def convert_states(
    root: str | Path,
    states: str = "fp8",
    every: int = DEFAULT_EXACT_EVERY,
    seed: int = 0,
    progress: Callable[[str], None] = lambda _line: None,
) -> dict[str, Any]:
    """Store the hidden states of the finished cache at ``root`` as ``states`` (``fp8``) in place;
    ``every``/``seed``: the exact slice's rule (store/compact.py). Returns the new manifest. Safe to
    kill and re-run (module docstring); a compact cache is left as it is.

    Raises:
        InputError: an unknown ``states``, ``source`` asked of a compact cache (the source values are
            gone), ``every`` < 1, a directory of shards, or a cache still being written.
        CacheNotFoundError, CacheFormatError: no cache, or a chunk fails its checks (nothing changed).
        CacheLockedError: another process writes the cache.
        StoreWriteError: the disk refused a write; re-run to resume.
    """
    if states not in STATES:
        raise InputError(f"--states {states!r}: choose one of {', '.join(STATES)}")
    if every < 1:
        raise InputError(f"exact slice every {every}: need 1 or more (1 keeps every sequence exact)")
    root = Path(root)
    if has_shards(root):
        raise InputError(f"{root} holds shards: convert each shard directory ({root}/<shard>) in turn")
    manifest = read_manifest(root)
    if states == "source":
        if is_compact(manifest):
            raise InputError(
                f"{root} stores fp8 states: the source values are gone (its exact slice keeps only a few "
                "sequences); re-extract without --states fp8 for a lossless cache"
            )
        return manifest
    if is_compact(manifest):
        return manifest
    with writer_lock(root, "hscache recompress --states fp8"):
        manifest = read_manifest(root)
        if not manifest.get("complete"):
            raise InputError(
                f"{root} is not complete: finish (resume) its extraction first, then convert its states"
            )
        work = root / WORK_DIR
        try:
            announced = manifest.get("states_converting")
            if announced is not None and _swapped(root, announced):
                return _publish_compact(root, manifest, announced)
            _undo_partial(root, work)
            work.mkdir()
            announced = _stage(root, manifest, work, every, seed, progress)
            manifest["states_converting"] = announced
            publish_manifest(root, manifest)
            _move_in(root, work)
            return _publish_compact(root, manifest, announced)
        except OSError as exc:
            raise StoreWriteError(
                f"converting the states of {root} failed{fsio.failure(exc)}; re-run the same "
                "command to resume (fix the cause first, e.g. free disk space)"
            ) from exc
