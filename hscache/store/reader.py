"""Read-only access to a cache: ``open_cache(path)`` -> ``Cache``.

The reader trusts only ``manifest.json``: it sees exactly the committed sequences, even while
an extraction is still appending. The directory is data, never code: nothing is unpickled, and
index part paths are checked to stay inside the cache.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
import zarr

from hscache.errors import CacheFormatError, CacheNotFoundError
from hscache.store.chunks import ChunkReader, chunk_reader
from hscache.store.layout import (
    ARRAYS_GROUP,
    FORMAT_NAME,
    FORMAT_VERSION,
    MANIFEST,
    PROVENANCE,
    TARGET_DIR,
    ArraySpec,
)

__all__ = ["Cache", "expand_metadata", "index_part_path", "open_cache", "read_manifest"]

_PART_NAME = re.compile(r"^index/part-\d{6}\.parquet$")
# Array names become paths inside arrays/: plain identifiers only, never "..", "/" or absolute paths.
_ARRAY_NAME = re.compile(r"^[a-z][a-z0-9_]{0,63}$")
_OPEN_ATTEMPTS = 3
_TORCH_DTYPES = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
    "int32": torch.int32,
}


def read_manifest(root: Path) -> dict[str, Any]:
    """The manifest of the cache at ``root``, checked for format and version.

    Raises:
        CacheNotFoundError: no manifest.json there.
        CacheFormatError: unreadable, another format, or a newer format version.
    """
    path = Path(root) / MANIFEST
    if not path.is_file():
        raise CacheNotFoundError(
            f"{root} is not an hscache cache (no {MANIFEST}); create one with `hscache extract --out {root}`"
        )
    try:
        manifest = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CacheFormatError(f"{path} is not valid JSON ({exc}); the cache is damaged") from exc
    if manifest.get("format") != FORMAT_NAME:
        raise CacheFormatError(f"{path} names format {manifest.get('format')!r}, expected {FORMAT_NAME!r}")
    if manifest.get("format_version") != FORMAT_VERSION:
        raise CacheFormatError(
            f"{path} has format_version {manifest.get('format_version')}, this hscache reads "
            f"{FORMAT_VERSION}; upgrade hscache"
        )
    _check_shape(path, manifest)
    return manifest


def _check_shape(path: Path, manifest: dict[str, Any]) -> None:
    """The few manifest fields the reader relies on, so damage reads as CacheFormatError."""
    try:
        committed = manifest["committed"]
        ok = (
            int(committed["sequences"]) >= 0
            and int(committed["tokens"]) >= 0
            and isinstance(manifest["index_parts"], list)
            and isinstance(manifest["arrays"], dict)
            and isinstance(manifest["settings"], dict)
        )
    except (KeyError, TypeError, ValueError):
        ok = False
    if not ok:
        raise CacheFormatError(f"{path} lacks committed/index_parts/arrays/settings; the cache is damaged")
    for name in manifest["arrays"]:
        if not _ARRAY_NAME.match(str(name)):
            raise CacheFormatError(f"{path} names array {name!r}, which is not a plain identifier")


def index_part_path(root: Path, name: str) -> Path:
    """The file of index part ``name`` (as listed in the manifest), checked to stay inside ``root``.

    Raises:
        CacheFormatError: ``name`` is not ``index/part-NNNNNN.parquet`` or resolves outside ``root``
            (e.g. through a symlink).
    """
    if not isinstance(name, str) or not _PART_NAME.match(name):
        raise CacheFormatError(f"manifest lists index part {name!r}, which is not index/part-NNNNNN.parquet")
    path = (Path(root) / name).resolve()
    if Path(root).resolve() not in path.parents:
        raise CacheFormatError(f"index part {name!r} points outside the cache directory")
    return path


def _read_part(root: Path, name: str) -> pa.Table:
    path = index_part_path(root, name)
    try:
        return pq.read_table(path)
    except FileNotFoundError as exc:
        raise CacheFormatError(
            f"index part {name} listed in {MANIFEST} is missing; the cache is damaged: run `hscache verify "
            f"{root}`, then re-extract with --overwrite"
        ) from exc
    except (OSError, pa.ArrowException) as exc:
        raise CacheFormatError(
            f"index part {name} is unreadable ({exc}); run `hscache verify {root}`"
        ) from exc


def expand_metadata(table: pa.Table) -> pa.Table:
    """Turn the ``metadata_json`` column into one column per key (e.g. ``category``)."""
    records = [json.loads(s) if s else {} for s in table.column("metadata_json").to_pylist()]
    keys = sorted({k for r in records for k in r} - set(table.column_names))
    for key in keys:
        values = [r.get(key) for r in records]
        try:
            column = pa.array(values)
        except (pa.ArrowInvalid, pa.ArrowTypeError):
            column = pa.array([None if v is None else json.dumps(v) for v in values])
        table = table.append_column(key, column)
    return table


class Cache:
    """A read-only view of the committed part of a cache directory.

    Per-sequence accessors take a row number ``i`` of ``index`` and return torch tensors.
    """

    def __init__(self, root: Path, manifest: dict[str, Any]):
        self.path = Path(root)
        self.manifest = manifest
        self.specs = {name: ArraySpec.from_dict(name, d) for name, d in manifest["arrays"].items()}
        try:
            self._group = zarr.open_group(str(self.path / ARRAYS_GROUP), mode="r")
        except FileNotFoundError as exc:
            raise CacheFormatError(
                f"{self.path} has a manifest but no {ARRAYS_GROUP}/ group; the cache is damaged"
            ) from exc
        self._arrays: dict[str, zarr.Array] = {}
        self._chunk_readers: dict[str, ChunkReader | None] = {}
        parts = [_read_part(self.path, p) for p in manifest["index_parts"]]
        table = pa.concat_tables(parts) if parts else _empty_index()
        committed = int(manifest["committed"]["sequences"])
        if table.num_rows < committed:
            raise CacheFormatError(
                f"the index of {self.path} has {table.num_rows} rows but the manifest commits {committed} "
                f"sequences; the cache is damaged: run `hscache verify {self.path}`"
            )
        table = table.slice(0, committed)
        self.index: pa.Table = expand_metadata(table)
        self._offsets = np.asarray(self.index.column("offset").to_numpy(), dtype=np.int64)
        self._lengths = np.asarray(self.index.column("length").to_numpy(), dtype=np.int64)

    def __len__(self) -> int:
        return self.index.num_rows

    def __repr__(self) -> str:
        return f"Cache({str(self.path)!r}, sequences={len(self)}, tokens={self.num_tokens}, layers={self.layer_ids})"

    @property
    def num_tokens(self) -> int:
        return int(self.manifest["committed"]["tokens"])

    @property
    def complete(self) -> bool:
        return bool(self.manifest.get("complete"))

    @property
    def settings(self) -> dict[str, Any]:
        return self.manifest["settings"]

    @property
    def layer_ids(self) -> list[int]:
        return list(self.settings["layer_ids"])

    @property
    def dtype(self) -> torch.dtype:
        return _TORCH_DTYPES[self.specs["hidden_states"].logical_dtype]

    @cached_property
    def provenance(self) -> dict[str, Any]:
        path = self.path / PROVENANCE
        return json.loads(path.read_text()) if path.is_file() else {}

    @cached_property
    def target_config(self) -> dict[str, Any]:
        return json.loads((self.path / TARGET_DIR / "config.json").read_text())

    @property
    def mask_token_id(self) -> int | None:
        return self.settings.get("mask_token_id")

    def array(self, name: str) -> zarr.Array:
        if name not in self._arrays:
            if name not in self.specs:
                raise KeyError(f"cache has no array {name!r}; it has {', '.join(self.specs)}")
            self._arrays[name] = self._group[name]
        return self._arrays[name]

    def _chunk_reader(self, name: str) -> ChunkReader | None:
        if name not in self._chunk_readers:
            self._chunk_readers[name] = chunk_reader(self.array(name))
        return self._chunk_readers[name]

    def _check_tokens(self, start: int, stop: int) -> None:
        if not 0 <= start <= stop <= self.num_tokens:
            raise IndexError(
                f"tokens {start}-{stop} out of range for a cache of {self.num_tokens} committed tokens"
            )

    def read_tokens(self, name: str, start: int, stop: int) -> np.ndarray:
        """Rows ``[start, stop)`` of array ``name`` in its stored dtype (bfloat16 as raw uint16).

        A local cache's chunk files are read directly, several at once (store/chunks.py); anything
        else (a remote cache, codecs hscache does not write) through zarr. Both check crc32c.

        Raises:
            KeyError: no array ``name``.
            IndexError: the range reaches past the committed tokens.
            ValueError: a chunk fails its checksum or does not decode (``CacheFormatError``
                naming the chunk on the direct path).
        """
        self._check_tokens(start, stop)
        reader = self._chunk_reader(name)
        if reader is None:
            return np.asarray(self.array(name)[start:stop])
        return reader.read(start, stop)

    def iter_tokens(
        self, name: str, start: int = 0, stop: int | None = None
    ) -> Iterator[tuple[int, np.ndarray]]:
        """``(first token, rows)`` chunk by chunk over ``[start, stop)`` (default: every committed
        token), the next chunks read in the background: a full scan with memory of a few chunks.

        Raises:
            as ``read_tokens``.
        """
        stop = self.num_tokens if stop is None else stop
        self._check_tokens(start, stop)
        reader = self._chunk_reader(name)
        if reader is not None:
            yield from reader.iter_blocks(start, stop)
            return
        step, a = self.specs[name].chunk_tokens, start
        while a < stop:
            b = min(stop, (a // step + 1) * step)
            yield a, np.asarray(self.array(name)[a:b])
            a = b

    def rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Token rows ``[start, stop)`` of array ``name`` as a tensor in its logical dtype.

        Raises:
            as ``read_tokens``.
        """
        return self._rows(name, start, stop)

    def span(self, i: int) -> tuple[int, int]:
        """The token range ``[start, stop)`` of sequence row ``i``."""
        return self._span(i)

    def _rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        tensor = torch.from_numpy(np.ascontiguousarray(self.read_tokens(name, start, stop)))
        logical = self.specs[name].logical_dtype
        if logical == "bfloat16":
            return tensor.view(torch.bfloat16)  # stored as the raw 16 bits (see store/layout.py)
        return tensor

    def _span(self, i: int) -> tuple[int, int]:
        if not 0 <= i < len(self):
            raise IndexError(f"sequence row {i} out of range for a cache of {len(self)} sequences")
        start = int(self._offsets[i])
        return start, start + int(self._lengths[i])

    def hidden_states(self, i: int) -> torch.Tensor:
        """``[T, K, H]`` in the logical dtype; K follows ``layer_ids``."""
        return self._rows("hidden_states", *self._span(i))

    def token_ids(self, i: int) -> torch.Tensor:
        return self._rows("token_ids", *self._span(i)).long()

    def target_argmax(self, i: int) -> torch.Tensor:
        """``[T]``: the target's greedy prediction for position t + 1, at each position t."""
        return self._rows("target_argmax", *self._span(i)).long()

    def target_topk(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(values ``[T, k]`` float32 logits, ids ``[T, k]`` int64), sorted descending."""
        start, stop = self._span(i)
        return self._rows("target_topk_values", start, stop), self._rows(
            "target_topk_ids", start, stop
        ).long()

    def target_logsumexp(self, i: int) -> torch.Tensor:
        """``[T]`` float32 log-sum-exp of the full logits: top-k probs = exp(value - lse)."""
        return self._rows("target_logsumexp", *self._span(i))

    def target_logits(self, i: int) -> torch.Tensor:
        """``[T, V]`` float32 full logits (only in caches written with ``--full-logits``)."""
        return self._rows("target_logits", *self._span(i))

    def target_head(self) -> dict[str, torch.Tensor]:
        """``{"embed_tokens": [V, H], "lm_head": [V, H]}``; one shared tensor when tied."""
        from safetensors.torch import load_file

        tensors = load_file(str(self.path / TARGET_DIR / "head.safetensors"))
        if "lm_head" not in tensors:
            tensors["lm_head"] = tensors["embed_tokens"]
        return tensors

    @cached_property
    def vocab_size(self) -> int:
        """Rows of the target's embedding, read from the safetensors header (no weights loaded)."""
        from safetensors import safe_open

        with safe_open(str(self.path / TARGET_DIR / "head.safetensors"), framework="pt") as f:
            return int(f.get_slice("embed_tokens").get_shape()[0])

    def tokenizer(self) -> Any:
        from transformers import AutoTokenizer

        # The cache is data, never code: no remote code from tokenizer_config.json's auto_map.
        return AutoTokenizer.from_pretrained(
            str(self.path / TARGET_DIR), local_files_only=True, trust_remote_code=False
        )


def _empty_index() -> pa.Table:
    from hscache.store.writer import INDEX_SCHEMA

    return INDEX_SCHEMA.empty_table()


def open_cache(path: str | Path) -> Cache:
    """Open the cache at ``path`` read-only; it shows the sequences committed so far.

    ``path`` may also be a directory of shards (``extract --shard I/N``), read as one cache
    (store/shards.py), or an fsspec URL such as ``s3://bucket/cache`` (store/remote.py).

    Raises:
        CacheNotFoundError: ``path`` holds no cache.
        CacheFormatError: the manifest or index is damaged or of an unknown version.
    """
    if "://" in str(path):
        from hscache.store.remote import open_remote_cache  # lazy: fsspec backends are optional

        return open_remote_cache(str(path))
    root = Path(path)
    if not (root / MANIFEST).is_file():
        from hscache.store.shards import has_shards, open_sharded

        if has_shards(root):
            return open_sharded(root)
    for attempt in range(_OPEN_ATTEMPTS):
        manifest = read_manifest(root)
        try:
            return Cache(root, manifest)
        except CacheFormatError:
            # A running extraction may have compacted the index (and deleted the parts this
            # manifest lists) between our two reads: retry on the newer manifest.
            if attempt + 1 == _OPEN_ATTEMPTS or read_manifest(root) == manifest:
                raise
    raise AssertionError("unreachable")
