"""Read-only access to a cache: ``open_cache(path)`` -> ``Cache``.

The reader trusts only ``manifest.json``: it sees exactly the committed sequences, even while
an extraction is still appending. The directory is data, never code: nothing is unpickled, and
index part paths are checked to stay inside the cache.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa
import zarr

from hscache.errors import CacheFormatError
from hscache.store import fsio, jsonio
from hscache.store.chunks import ChunkReader, chunk_reader
from hscache.store.index import empty_index, expand_metadata, index_part_path, read_part, read_part_bytes
from hscache.store.integrity import UNSEALED_MESSAGE, chunk_sha256_of, digest_bytes, rows_sha256
from hscache.store.layout import (
    ARRAYS_GROUP,
    FORMAT_NAME,
    FORMAT_VERSION,
    MANIFEST,
    PROVENANCE,
    SAMPLED_ARRAYS,
    TARGET_DIR,
    ArraySpec,
)
from hscache.store.lock import current_writer
from hscache.store.paths import not_a_cache
from hscache.store.sampling import SamplingSetting, sampling_setting
from hscache.store.target_files import (
    HEAD_FILE,
    MTP_FILE,
    check_safetensors_bytes,
    load_tokenizer_files,
    tensors_from_safetensors,
)
from hscache.store.urls import absolute_location
from hscache.store.zarr_meta import array_from_metadata

__all__ = [
    "ARRAY_NAME",
    "Cache",
    "SequenceSpans",
    "check_integrity",
    "open_local",
    "read_manifest",
    "row_of",
    "sequence_row",
]

# Array names become paths inside arrays/: plain identifiers only, never "..", "/" or absolute paths.
ARRAY_NAME = re.compile(r"^[a-z][a-z0-9_]{0,63}$")
_OPEN_ATTEMPTS = 8

if TYPE_CHECKING:  # torch is imported when a tensor is first returned: `hscache info` never needs it
    import torch


def read_manifest(root: Path) -> dict[str, Any]:
    """The manifest of the cache at ``root``, checked for format and version.

    Raises:
        CacheNotFoundError: no manifest.json there.
        CacheFormatError: unreadable, another format, or a newer format version.
    """
    path = Path(root) / MANIFEST
    if path.is_symlink() and Path(root).resolve() not in path.resolve().parents:
        raise CacheFormatError(
            f"{path} is a symlink that leads outside the cache directory; hscache never writes links: "
            "copy the cache's own manifest into place, or re-extract"
        )
    if not path.exists() and not path.is_symlink():
        raise not_a_cache(root)
    try:
        data = bytes(fsio.read_regular(path))
    except OSError as exc:
        raise CacheFormatError(
            f"{path} cannot be read ({exc.strerror or exc}); the cache is damaged"
        ) from None
    manifest = jsonio.load_cache_object(data, path)
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
        if not ARRAY_NAME.match(str(name)):
            raise CacheFormatError(f"{path} names array {name!r}, which is not a plain identifier")


class SequenceSpans:
    """Where each sequence's tokens lie, for a cache view that sets ``_offsets`` and ``_lengths``
    (a cache's index columns; a sharded cache's concatenation in global order)."""

    _offsets: np.ndarray
    _lengths: np.ndarray

    @property
    def offsets(self) -> np.ndarray:
        """int64 ``[len(self)]``: the first token of each sequence (the index's ``offset`` column)."""
        return self._offsets

    @property
    def lengths(self) -> np.ndarray:
        """int64 ``[len(self)]``: the tokens of each sequence (the index's ``length`` column)."""
        return self._lengths


class Cache(SequenceSpans):
    """A read-only view of the committed part of a cache directory.

    Per-sequence accessors take a row number ``i`` of ``index`` (or a record id, e.g. ``"chat-1"``)
    and return torch tensors.

    Every file that is not a chunk (index parts, provenance, ``target/``) is read once and used from
    the bytes that were checked: ``files`` holds those ``open_cache`` hashed (every one up to 16 MiB),
    and a bigger one is read whole, hashed and used from that read (``file_bytes``). A file replaced
    after the cache was opened is never scored under the digest of the one that was checked.
    """

    def __init__(self, root: Path, manifest: dict[str, Any], files: dict[str, bytes] | None = None):
        self.path = Path(root)
        self.manifest = manifest
        self._files: dict[str, bytes] = dict(files or {})
        self.specs = {name: ArraySpec.from_dict(name, d) for name, d in manifest["arrays"].items()}
        try:
            # Absolute: a zarr array pickled into a dask graph (hscache.data.open_xarray) reopens its
            # path on a worker whose working directory differs from ours.
            self._group = zarr.open_group(
                absolute_location(self.path / ARRAYS_GROUP), mode="r", zarr_format=3
            )
        except FileNotFoundError as exc:
            raise CacheFormatError(
                f"{self.path} has a manifest but no {ARRAYS_GROUP}/ group; the cache is damaged"
            ) from exc
        self._arrays: dict[str, zarr.Array] = {}
        self._chunk_readers: dict[str, ChunkReader | None] = {}
        # Each chunk's committed rows against its recorded sha256, the first time it is decoded
        # (store/integrity.py); setting it False before reading trades that for scan speed.
        self.check_chunks = True  # a public switch: set False before reading
        # Every part parsed from the bytes that were hashed, whatever its size: those open_cache kept,
        # or (a part over 16 MiB) read once now and checked against its recorded sha256 (issue 52).
        parts = [read_part_bytes(p, self._part_bytes(p)) for p in manifest["index_parts"]]
        table = pa.concat_tables(parts) if parts else empty_index()
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
        self._check_rows()

    def _part_bytes(self, name: str) -> bytes:
        if name in self._files:
            return self._files[name]
        index_part_path(self.path, name)  # a name that leaves the cache: refused by name
        if not (self.path / name).is_file() and not (self.path / name).is_symlink():
            read_part(self.path, name)  # missing: its one line ("listed in manifest.json is missing")
        return bytes(self.file_bytes(name))

    def _check_rows(self) -> None:
        """Every index row in range, as ``hscache verify`` checks it (a resealed edit passes the seal):
        lengths of at least one token, contiguous offsets that sum to the committed tokens, and
        prompt_len in 0..length. Damage is one line here, never a ValueError deep in a reader."""
        prompt = np.asarray(self.index.column("prompt_len").to_numpy(), dtype=np.int64)
        starts = np.concatenate([[0], np.cumsum(self._lengths)[:-1]]) if len(self._lengths) else self._lengths
        bad = np.flatnonzero(
            (self._lengths < 1) | (self._offsets != starts) | (prompt < 0) | (prompt > self._lengths)
        )
        if len(bad) or int(self._lengths.sum()) != self.num_tokens:
            i = int(bad[0]) if len(bad) else len(self._lengths) - 1
            raise CacheFormatError(
                f"the index of {self.path} is inconsistent at sequence {i} (offset {self._offsets[i]}, length "
                f"{self._lengths[i]}, prompt_len {prompt[i]}; the lengths sum to {int(self._lengths.sum())} of "
                f"{self.num_tokens} committed tokens); the cache is damaged: run `hscache verify {self.path}`"
            )

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
        from hscache.store.compact import states_dtype
        from hscache.store.dtypes import torch_dtype_of_logical

        return torch_dtype_of_logical(states_dtype(self.manifest))  # a compact cache's: its source dtype

    def file_bytes(self, rel: str) -> bytes:
        """The bytes of the cache file ``rel`` (e.g. ``"target/config.json"``): those checked at open,
        or (a file bigger than 16 MiB) read once now, regular files only, and checked against the
        sha256 recorded at commit before they are returned.

        Raises:
            CacheFormatError: the file is missing, not a regular file, or not what its commit recorded.
        """
        data = self._files.get(rel)
        if data is not None:
            return data
        path = self.path / rel
        try:
            data = fsio.read_regular(path)
        except OSError as exc:
            raise CacheFormatError(
                f"{path} cannot be read ({exc.strerror or exc}); run `hscache verify {self.path}`"
            ) from exc
        recorded = (self.manifest.get("checksums") or {}).get(rel)
        if recorded is not None and digest_bytes(bytes(data)) != {
            "sha256": recorded.get("sha256"),
            "bytes": recorded.get("bytes"),
        }:
            raise CacheFormatError(
                f"{path} does not match its sha256 recorded at commit; run `hscache verify {self.path}`"
            )
        return data

    def _has_file(self, rel: str) -> bool:
        if rel in self._files or rel in (self.manifest.get("checksums") or {}):
            return True
        return "checksums" not in self.manifest and (self.path / rel).is_file()  # unsealed caches

    def _json_file(self, rel: str) -> dict[str, Any]:
        return jsonio.load_cache_object(bytes(self.file_bytes(rel)), self.path / rel)

    @cached_property
    def provenance(self) -> dict[str, Any]:
        return self._json_file(PROVENANCE) if self._has_file(PROVENANCE) else {}

    @cached_property
    def target_config(self) -> dict[str, Any]:
        return self._json_file(f"{TARGET_DIR}/config.json")

    @property
    def mask_token_id(self) -> int | None:
        return self.settings.get("mask_token_id")

    def array(self, name: str) -> zarr.Array:
        if name not in self._arrays:
            if name not in self.specs:
                raise KeyError(f"cache has no array {name!r}; it has {', '.join(self.specs)}")
            checked = self._files.get(f"{ARRAYS_GROUP}/{name}/zarr.json")
            self._arrays[name] = (
                self._group[name] if checked is None else array_from_metadata(self._group, name, checked)
            )
        return self._arrays[name]

    def _chunk_reader(self, name: str) -> ChunkReader | None:
        if name not in self._chunk_readers:
            reader = chunk_reader(self.array(name))
            if reader is not None and self.check_chunks:
                reader.expect_sha256(chunk_sha256_of(self.manifest, name), self.num_tokens)
            self._chunk_readers[name] = reader
        return self._chunk_readers[name]

    def _read_through_zarr(self, name: str, start: int, stop: int) -> np.ndarray:
        """Rows ``[start, stop)`` through zarr (a remote store), each chunk's committed rows checked
        against its recorded sha256 the first time it is read (whole chunks: zarr fetches them anyway).

        Raises:
            CacheFormatError: a chunk fails its crc32c, does not decode, or does not match its sha256.
        """
        array, step = self.array(name), self.specs[name].chunk_tokens
        expected = chunk_sha256_of(self.manifest, name) if self.check_chunks else None
        verified = self.__dict__.setdefault("_verified_chunks", set())
        todo = [c for c in range(start // step, -(-stop // step)) if (name, c) not in verified]
        a = min(start, todo[0] * step) if (expected is not None and todo) else start
        b = (
            max(stop, min(self.num_tokens, (todo[-1] + 1) * step))
            if (expected is not None and todo)
            else stop
        )
        try:
            rows = np.asarray(array[a:b])
        except (ValueError, OSError, RuntimeError) as exc:  # zarr: bad crc32c, codec errors, I/O
            raise CacheFormatError(
                f"{name} rows {a}-{b} of {getattr(self, 'url', self.path)} cannot be read ({exc}); a chunk is "
                "damaged or missing: run `hscache verify` on the cache"
            ) from exc
        if expected is not None:
            for c in todo:
                lo, hi = c * step, min(self.num_tokens, (c + 1) * step)
                got = rows_sha256(rows[lo - a : hi - a])
                if c >= len(expected) or got != expected[c]:
                    raise CacheFormatError(
                        f"{name} chunk {c} of {getattr(self, 'url', self.path)} does not match its sha256 "
                        "recorded at commit; the cache was changed after it was written: run `hscache verify` on it"
                    )
                verified.add((name, c))
        return rows[start - a : stop - a]

    def _check_tokens(self, start: int, stop: int) -> None:
        if not 0 <= start <= stop <= self.num_tokens:
            raise IndexError(
                f"tokens {start}-{stop} out of range for a cache of {self.num_tokens} committed tokens"
            )

    def read_tokens(self, name: str, start: int, stop: int, out: np.ndarray | None = None) -> np.ndarray:
        """Rows ``[start, stop)`` of array ``name`` in its stored dtype (bfloat16 as raw uint16).

        A local cache's chunk files are read directly, several at once (store/chunks.py); anything
        else (a remote cache, codecs hscache does not write) through zarr. Both check crc32c (the
        direct path once per chunk file and process, store/chunks.py ``VERIFIED``).
        ``out``: a C-contiguous array of that shape and stored dtype to fill (one copy, e.g. into a
        pinned or shared-memory buffer); returned.

        Raises:
            KeyError: no array ``name``.
            IndexError: the range reaches past the committed tokens.
            ValueError: a chunk fails its checksum or does not decode (``CacheFormatError``
                naming the chunk on the direct path); ``out`` of the wrong shape or dtype.
        """
        self._check_tokens(start, stop)
        reader = self._chunk_reader(name)
        if reader is not None:
            return reader.read(start, stop, out)
        rows = self._read_through_zarr(name, start, stop)
        if out is None:
            return rows
        if out.shape != rows.shape or out.dtype != rows.dtype:
            raise ValueError(f"{name}: out is {out.shape} {out.dtype}, need {rows.shape} {rows.dtype}")
        out[...] = rows
        return out

    def iter_tokens(
        self, name: str, start: int = 0, stop: int | None = None, copy: bool = True
    ) -> Iterator[tuple[int, np.ndarray]]:
        """``(first token, rows)`` chunk by chunk over ``[start, stop)`` (default: every committed
        token), the next chunks read in the background: a full scan with memory of a few chunks.

        ``copy=False``: an uncompressed local array's blocks are read-only views of its mapped
        chunk files (no copy at all; checked on first touch); other arrays are read as with copy.

        Raises:
            as ``read_tokens``.
        """
        stop = self.num_tokens if stop is None else stop
        self._check_tokens(start, stop)
        reader = self._chunk_reader(name)
        if reader is not None:
            yield from reader.iter_blocks(start, stop, copy=copy)
            return
        step, a = self.specs[name].chunk_tokens, start
        while a < stop:
            b = min(stop, (a // step + 1) * step)
            yield a, self._read_through_zarr(name, a, b)
            a = b

    def rows(self, name: str, start: int, stop: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """Token rows ``[start, stop)`` of array ``name`` as a tensor in its logical dtype.

        ``out``: a contiguous CPU tensor of that shape and logical dtype to read into (e.g. pinned,
        ``torch.empty(..., pin_memory=True)``, or shared memory): one copy from the page cache; returned.

        Raises:
            as ``read_tokens``.
        """
        if (
            name == "hidden_states" and "states" in self.manifest
        ):  # fp8 states: dequantised (store/compact.py)
            from hscache.store.compact import read_states

            self._check_tokens(start, stop)
            return read_states(self, start, stop, out)
        if out is None:
            return self._rows(name, start, stop)
        from hscache.store.dtypes import stored_view

        self.read_tokens(name, start, stop, stored_view(out, self.specs[name].stored_dtype))
        return out

    def _rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        if name == "hidden_states" and "states" in self.manifest:
            return self.rows(name, start, stop)
        from hscache.store.dtypes import tensor_from_stored  # imports torch: not at `hscache info`

        return tensor_from_stored(self.read_tokens(name, start, stop), self.specs[name].logical_dtype)

    def row_of(self, record_id: str) -> int:
        """The row of the sequence whose record id is ``record_id``.

        Raises:
            KeyError: no sequence has that id, or several do (caches written before ids were unique).
        """
        return row_of(self, record_id)

    def sequence_span(self, i: int | str) -> tuple[int, int]:
        """``(first token, end token)`` of sequence row ``i`` in the token-major arrays.

        Raises:
            IndexError: ``i`` is not a committed row.
        """
        i = sequence_row(self, i)
        if not 0 <= i < len(self):
            raise IndexError(f"sequence row {i} out of range for a cache of {len(self)} sequences")
        start = int(self._offsets[i])
        return start, start + int(self._lengths[i])

    def hidden_states(self, i: int | str) -> torch.Tensor:
        """``[T, K, H]`` in the logical dtype (a compact cache's: its source dtype); K follows ``layer_ids``."""
        return self._rows("hidden_states", *self.sequence_span(i))

    def token_ids(self, i: int | str) -> torch.Tensor:
        return self._rows("token_ids", *self.sequence_span(i)).long()

    def target_argmax(self, i: int | str) -> torch.Tensor:
        """``[T]``: the target's greedy prediction for position t + 1, at each position t."""
        return self._rows("target_argmax", *self.sequence_span(i)).long()

    def target_topk(self, i: int | str) -> tuple[torch.Tensor, torch.Tensor]:
        """(values ``[T, k]`` float32 logits, ids ``[T, k]`` int64), sorted descending."""
        start, stop = self.sequence_span(i)
        return self._rows("target_topk_values", start, stop), self._rows(
            "target_topk_ids", start, stop
        ).long()

    def target_logsumexp(self, i: int | str) -> torch.Tensor:
        """``[T]`` float32 log-sum-exp of the full logits: top-k probs = exp(value - lse)."""
        return self._rows("target_logsumexp", *self.sequence_span(i))

    def target_logits(self, i: int | str) -> torch.Tensor:
        """``[T, V]`` float32 full logits (only in caches written with ``--full-logits``)."""
        return self._rows("target_logits", *self.sequence_span(i))

    @property
    def sampling(self) -> SamplingSetting:
        """The sampling setting the cache was extracted at (``GREEDY`` when it records none)."""
        return sampling_setting(self)

    def sampled_support(self, i: int | str) -> tuple[torch.Tensor, torch.Tensor]:
        """(ids ``[T, W]`` int64, probs ``[T, W]`` float32): row t's processed distribution of token
        t + 1, sorted descending, -1 / 0 past the support (only in sampled caches)."""
        start, stop = self.sequence_span(i)
        ids = self._rows(SAMPLED_ARRAYS[0], start, stop).long()
        return ids, self._rows(SAMPLED_ARRAYS[1], start, stop)

    def realised_prob(self, i: int | str) -> torch.Tensor:
        """``[T]`` float32: the processed probability of token t + 1 at row t; NaN where no token
        was drawn (the prompt, the last row). Only in sampled caches."""
        return self._rows(SAMPLED_ARRAYS[2], *self.sequence_span(i))

    def target_head(self) -> dict[str, torch.Tensor]:
        """``{"embed_tokens": [V, H], "lm_head": [V, H]}`` (one shared tensor when tied) and the target's
        final norm, ``final_norm.weight`` [H], ``final_norm.eps`` and ``final_norm.kind`` [1], when the
        extraction saved it (capture/final_norm.py)."""
        tensors = self._safetensors(f"{TARGET_DIR}/{HEAD_FILE}")
        if "lm_head" not in tensors:
            tensors["lm_head"] = tensors["embed_tokens"]
        return tensors

    def _safetensors(self, rel: str) -> dict[str, torch.Tensor]:
        # A buffer of the caller's own: the tensors are views of it, and a caller writing to them
        # must not change the bytes this cache checked.
        return tensors_from_safetensors(bytearray(self.file_bytes(rel)), rel)

    def target_mtp(self) -> dict[str, torch.Tensor]:
        """The target's own MTP head (``mtp.*`` tensors, checkpoint names); {} when not stored."""
        rel = f"{TARGET_DIR}/{MTP_FILE}"
        return self._safetensors(rel) if self._has_file(rel) else {}

    @cached_property
    def vocab_size(self) -> int:
        """Rows of the target's embedding, read from the safetensors header (no weights loaded)."""
        rel = f"{TARGET_DIR}/{HEAD_FILE}"
        if rel in self._files:
            header = check_safetensors_bytes(self._files[rel], rel)
        else:  # a big head: its header only (its full hash is checked when target_head reads it)
            from hscache.store.target_files import check_safetensors

            header = check_safetensors(self.path / rel)
        embed = header.get("embed_tokens")
        if not isinstance(embed, dict) or len(embed.get("shape", [])) != 2:
            raise CacheFormatError(f"{rel} holds no [vocab, hidden] embed_tokens; the cache is damaged")
        return int(embed["shape"][0])

    def tokenizer(self) -> Any:
        """The target's tokenizer (from ``target/``, never remote code), from the bytes checked at open."""
        prefix = f"{TARGET_DIR}/"
        if "checksums" in self.manifest:
            names = [r for r in self.manifest["checksums"] if r.startswith(prefix)]
        else:
            names = [f"{prefix}{p.name}" for p in (self.path / TARGET_DIR).iterdir() if p.is_file()]
        files = {
            rel[len(prefix) :]: bytes(self.file_bytes(rel))
            for rel in names
            if "/" not in rel[len(prefix) :] and not rel.endswith(".safetensors")
        }
        return load_tokenizer_files(files)


def check_integrity(
    root: Path,
    manifest: dict[str, Any],
    digests: str = "small",
    allow_unsealed: bool = False,
    keep: dict[str, bytes] | None = None,
) -> None:
    """Refuse a cache whose files disagree with the checksums recorded at commit (store/integrity.py):
    its scores could silently change (an edited prompt_len, layer id, config, head). ``keep``
    receives the bytes of the files that were hashed (``Cache(files=...)`` reads those).

    Raises:
        CacheFormatError: naming the first file that disagrees.
    """
    from hscache.store.integrity import check_cache

    found = check_cache(Path(root), manifest, digests, allow_unsealed, keep)  # type: ignore[arg-type]
    bad = [m for m in found if not m.warning]
    if bad and "checksums" not in manifest and bad[0].path == MANIFEST:
        raise CacheFormatError(f"{root} {UNSEALED_MESSAGE}")
    if bad:
        more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
        raise CacheFormatError(
            f"{root}: {bad[0].message}{more}; the cache was changed after it was written and its scores "
            f"cannot be trusted: run `hscache verify {root}`, then re-extract"
        )


def row_of(cache: Any, record_id: str) -> int:
    """``cache.row_of``: the row holding ``record_id`` (a lookup table built once per cache)."""
    rows = cache.__dict__.get("_rows_by_id")
    if rows is None:
        rows = {}
        for row, rid in enumerate(cache.index.column("record_id").to_pylist()):
            rows[rid] = -1 if rid in rows else row  # -1: several rows, ambiguous
        cache.__dict__["_rows_by_id"] = rows
    row = rows.get(record_id)
    if row is None:
        raise KeyError(f"no sequence has record id {record_id!r}; cache.index['record_id'] lists them")
    if row < 0:
        raise KeyError(f"several sequences have record id {record_id!r}; pass a row number instead")
    return row


def sequence_row(cache: Any, i: int | str) -> int:
    """A sequence given as a row number or a record id, as a checked row number.

    Raises:
        TypeError: neither an int nor a str. KeyError: unknown record id. IndexError: row out of range.
    """
    if isinstance(i, str):
        i = row_of(cache, i)
    elif isinstance(i, (int, np.integer)) and not isinstance(i, bool):
        i = int(i)
    else:
        raise TypeError(f"a sequence is a row number (int) or a record id (str), not {type(i).__name__}")
    if not 0 <= i < len(cache):
        raise IndexError(f"sequence row {i} out of range for a cache of {len(cache)} sequences")
    return i


def open_local(path: str | Path, allow_unsealed: bool = False) -> Cache:
    """Open the (unsharded, local) cache directory ``path`` read-only; see ``store.open.open_cache``.

    Raises:
        CacheNotFoundError: ``path`` holds no cache.
        CacheFormatError: the manifest or index is damaged or of an unknown version, or a file
            disagrees with the checksum its commit recorded (sizes, and the digests of small files).
    """
    root = Path(path)
    for attempt in range(_OPEN_ATTEMPTS):
        manifest = read_manifest(root)
        try:
            for name in manifest["index_parts"]:
                index_part_path(root, name)  # names that leave the cache: refused by name first
            # Checked before zarr parses any array's zarr.json: damage is one line, not a traceback.
            files: dict[str, bytes] = {}
            check_integrity(root, manifest, allow_unsealed=allow_unsealed, keep=files)
            return Cache(root, manifest, files)
        except CacheFormatError:
            # A running extraction may have compacted the index (and deleted the parts this
            # manifest lists) between our two reads, or be between publishing a file and the
            # manifest recording its checksum: retry on the newer manifest.
            if attempt + 1 == _OPEN_ATTEMPTS:
                raise
            if read_manifest(root) == manifest:
                # A complete cache nobody writes does not change: the mismatch is real. A writer
                # that marked it complete still publishes runs.json and then its checksum.
                if manifest.get("complete") and current_writer(root) is None:
                    raise
                time.sleep(0.05 * (attempt + 1))
    raise AssertionError("unreachable")
