"""Sharded caches: ``hscache extract --shard I/N`` on N machines, read back as one cache.

Layout: shard I of N extracts prompt records n (after ``--limit``) with ``n % N == I`` into
``OUT/shard-IIIII-of-NNNNN/``, an ordinary cache whose manifest settings carry
``shard = {"index": I, "count": N}``. Round-robin rather than contiguous ranges: it needs no
prompt count up front and balances prompt files sorted by length.

``open_cache(OUT)`` returns a ``ShardedCache``: global row g is local row ``g // N`` of shard
``g % N``, i.e. the original record order. Its index is recomputed as if one cache held every
sequence: ``seq_id`` = g and ``offset`` = the start of sequence g in the concatenation of all
sequences in global order (so offsets/lengths agree with a 1-shard extraction). While shards
are still running, the view holds the longest prefix of rows every shard has committed.

``merge_shards(OUT)`` checks the shards and writes ``OUT/shards.json`` (each shard's settings,
size and provenance); ``into=DEST`` also writes one ordinary merged cache.
"""

from __future__ import annotations

import re
import shutil
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa

from hscache.errors import CacheFormatError, CacheNotFoundError, InputError
from hscache.store import fsio
from hscache.store.index import INDEX_SCHEMA, expand_metadata
from hscache.store.layout import MANIFEST, PROVENANCE, TARGET_DIR, WRITER_LOCK, ArraySpec
from hscache.store.lock import writer_lock
from hscache.store.paths import is_cache_dir, not_a_cache
from hscache.store.reader import Cache, SequenceSpans, open_local, row_of, sequence_row
from hscache.store.sampling import SamplingSetting, sampling_setting
from hscache.store.writer import SequenceRows, StoreWriter

if TYPE_CHECKING:
    import torch

__all__ = [
    "SHARDS_FILE",
    "ShardedCache",
    "has_shards",
    "merge_shards",
    "open_sharded",
    "parse_shard",
    "shard_path",
    "shard_dirs",
]

SHARDS_FILE = "shards.json"
_SHARD_DIR = re.compile(r"^shard-(\d{5})-of-(\d{5})$")


def parse_shard(text: str) -> tuple[int, int]:
    """``"I/N"`` -> (I, N) with 0 <= I < N.

    Raises:
        InputError: not of that form or out of range.
    """
    match = re.fullmatch(r"\s*(\d+)\s*/\s*(\d+)\s*", text)
    if not match:
        raise InputError(f"--shard {text!r} is not I/N (e.g. 0/4 for the first of 4 shards)")
    index, count = int(match.group(1)), int(match.group(2))
    _check_shard(index, count)
    return index, count


def _check_shard(index: int, count: int) -> None:
    if not (count >= 1 and 0 <= index < count):
        raise InputError(
            f"--shard {index}/{count} out of range; shard I of N needs 0 <= I < N, e.g. 0/{max(count, 1)}"
        )


def shard_path(out: str | Path, index: int, count: int) -> Path:
    """The directory shard ``index`` of ``count`` writes into under ``out``."""
    _check_shard(index, count)
    return Path(out) / f"shard-{index:05d}-of-{count:05d}"


def has_shards(root: str | Path) -> bool:
    """Whether ``root`` is a directory of shard subdirectories (and no cache of its own).

    Raises:
        CacheFormatError: ``root`` holds shard folders and a cache of its own (``manifest.json``):
            hscache never writes that, and a reader (the cache) and verify (the shards) could then
            check one thing and read another (issue 36).
    """
    root = Path(root)
    found = root.is_dir() and any(_SHARD_DIR.match(p.name) for p in root.iterdir() if p.is_dir())
    if found and ((root / MANIFEST).exists() or (root / MANIFEST).is_symlink()):
        raise CacheFormatError(
            f"{root} holds both a cache of its own (manifest.json) and shard folders (shard-IIIII-of-NNNNN/), "
            "which hscache never writes: which one to read is ambiguous; move the shard folders or the "
            "cache's files into a directory of their own"
        )
    return found


def shard_dirs(root: Path) -> list[Path]:
    """The shard directories under ``root`` in shard order; all of one run, none missing."""
    if not root.is_dir():
        raise _no_shards(root)
    found = sorted(
        (int(m.group(1)), int(m.group(2)), p)
        for p in root.iterdir()
        if p.is_dir() and (m := _SHARD_DIR.match(p.name))
    )
    counts = {count for _, count, _ in found}
    if not counts:
        raise _no_shards(root)
    if len(counts) != 1:
        raise CacheFormatError(f"{root} mixes shard counts {sorted(counts)}; keep the shards of one run only")
    count = counts.pop()
    missing = sorted(set(range(count)) - {index for index, _, _ in found})
    if missing:
        raise CacheFormatError(
            f"{root} has {len(found)} of {count} shards; shard {missing[0]} is missing: run "
            f"`hscache extract ... --out {root} --shard {missing[0]}/{count}`"
        )
    return [p for _, _, p in found]


def _no_shards(root: Path) -> CacheFormatError | CacheNotFoundError:
    """What ``root``, given as a directory of shards, is instead."""
    if is_cache_dir(root):
        return CacheFormatError(
            f"{root} is one cache, not a directory of shards (shard-IIIII-of-NNNNN/ folders written by "
            "`hscache extract --shard I/N`): there is nothing to merge, read it as it is"
        )
    return not_a_cache(root, hint=f"run `hscache extract --out {root} --shard I/N` for each I")


def _check_same(root: Path, shards: list[Cache]) -> None:
    """Every shard must hold the same settings (but ``shard``) and arrays; name the first difference."""
    first = shards[0]
    base = {k: v for k, v in first.settings.items() if k != "shard"}
    for i, shard in enumerate(shards):
        expected = {"index": i, "count": len(shards)}
        if shard.settings.get("shard") != expected:
            raise CacheFormatError(
                f"{shard.path} has settings shard={shard.settings.get('shard')!r}, expected "
                f"{expected!r}; it was not written by `--shard {i}/{len(shards)}`"
            )
        other = {k: v for k, v in shard.settings.items() if k != "shard"}
        for key in sorted(base.keys() | other.keys()):
            if base.get(key) != other.get(key):
                raise CacheFormatError(
                    f"shards of {root} differ in {key}: {first.path.name} has {base.get(key)!r}, {shard.path.name} "
                    f"has {other.get(key)!r}; re-extract {shard.path.name} with the same settings as the others"
                )
        if shard.specs != first.specs:
            raise CacheFormatError(
                f"shards of {root} differ in their arrays ({first.path.name} vs {shard.path.name}); "
                "re-extract with the same --logits-top-k, --full-logits and --chunk-mb"
            )


class ShardedCache(SequenceSpans):
    """Read-only view of a sharded cache as one cache, in the original record order.

    Offers the ``Cache`` API (``index``, ``hidden_states(i)``, ``target_head()``...) except
    ``array(name)``: there is no single array; read per sequence or merge with ``--into``.
    """

    def __init__(self, root: Path, shards: list[Cache]):
        self.path = Path(root)
        self.shards = shards
        self.specs: dict[str, ArraySpec] = shards[0].specs
        n = len(shards)
        # Row g exists iff every shard has committed its share of rows 0..g: the first missing
        # global row of shard i is committed_i * n + i.
        self._rows = min(len(s) * n + i for i, s in enumerate(shards))
        order = [(g % n, g // n) for g in range(self._rows)]
        lengths = np.array([shards[i].lengths[j] for i, j in order], dtype=np.int64)
        offsets = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64) if len(lengths) else lengths
        self._order, self._lengths, self._offsets = order, lengths, offsets
        self.index = self._global_index(order, offsets)

    def _global_index(self, order: list[tuple[int, int]], offsets: np.ndarray) -> pa.Table:
        """The stored index columns in global order, then metadata expanded over ALL rows.

        Each shard's metadata columns (e.g. ``category``) were inferred from its own rows only: a
        key may be missing from a shard, or have another type there. Re-expanding ``metadata_json``
        over the combined rows gives exactly the columns and types a 1-shard extraction would.
        """
        tables = [s.index for s in self.shards]
        columns = {}
        for field in INDEX_SCHEMA:
            per_shard = [t.column(field.name).to_pylist() for t in tables]
            values = [per_shard[i][j] for i, j in order]
            columns[field.name] = pa.array(values, type=field.type)
        columns["seq_id"] = pa.array(
            np.arange(len(order), dtype=np.int64), type=INDEX_SCHEMA.field("seq_id").type
        )
        columns["offset"] = pa.array(offsets, type=INDEX_SCHEMA.field("offset").type)
        return expand_metadata(pa.table(columns, schema=INDEX_SCHEMA))

    def __len__(self) -> int:
        return self._rows

    def __repr__(self) -> str:
        return (
            f"ShardedCache({str(self.path)!r}, shards={len(self.shards)}, sequences={len(self)}, "
            f"tokens={self.num_tokens}, layers={self.layer_ids})"
        )

    @property
    def num_tokens(self) -> int:
        return int(self._lengths.sum())

    @property
    def complete(self) -> bool:
        return all(s.complete for s in self.shards) and self._rows == sum(len(s) for s in self.shards)

    @property
    def settings(self) -> dict[str, Any]:
        return {k: v for k, v in self.shards[0].settings.items() if k != "shard"}

    @property
    def manifest(self) -> dict[str, Any]:
        """Shard 0's manifest with the view's settings and size (what a 1-shard run would commit)."""
        return {
            **self.shards[0].manifest,
            "settings": self.settings,
            "committed": {"sequences": len(self), "tokens": self.num_tokens},
            "complete": self.complete,
        }

    @property
    def layer_ids(self) -> list[int]:
        return list(self.settings["layer_ids"])

    @property
    def dtype(self) -> torch.dtype:
        return self.shards[0].dtype

    @property
    def mask_token_id(self) -> int | None:
        return self.settings.get("mask_token_id")

    @cached_property
    def provenance(self) -> dict[str, Any]:
        """Shard 0's provenance plus ``shards``: every shard's own provenance, in shard order."""
        return {**self.shards[0].provenance, "shards": [s.provenance for s in self.shards]}

    @property
    def target_config(self) -> dict[str, Any]:
        return self.shards[0].target_config

    def target_head(self) -> dict[str, torch.Tensor]:
        return self.shards[0].target_head()

    def target_mtp(self) -> dict[str, torch.Tensor]:
        return self.shards[0].target_mtp()

    @property
    def vocab_size(self) -> int:
        return self.shards[0].vocab_size

    def tokenizer(self) -> Any:
        return self.shards[0].tokenizer()

    def array(self, name: str) -> Any:
        raise CacheFormatError(
            f"{self.path} is sharded and has no single {name!r} array; read per sequence, or "
            f"write one cache with `hscache merge {self.path} --into DEST`"
        )

    def row_of(self, record_id: str) -> int:
        """The row of the sequence whose record id is ``record_id`` (as ``Cache.row_of``)."""
        return row_of(self, record_id)

    def locate(self, i: int | str) -> tuple[Cache, int]:
        """``(shard, local row)`` holding global row ``i`` (round-robin: shard ``i % N``, row ``i // N``).

        Raises:
            IndexError: ``i`` is not a row of the view.
        """
        i = sequence_row(self, i)
        if not 0 <= i < len(self):
            raise IndexError(f"sequence row {i} out of range for a cache of {len(self)} sequences")
        shard, local = self._order[i]
        return self.shards[shard], local

    def hidden_states(self, i: int | str) -> torch.Tensor:
        shard, local = self.locate(i)
        return shard.hidden_states(local)

    def token_ids(self, i: int | str) -> torch.Tensor:
        shard, local = self.locate(i)
        return shard.token_ids(local)

    def target_argmax(self, i: int | str) -> torch.Tensor:
        shard, local = self.locate(i)
        return shard.target_argmax(local)

    def target_topk(self, i: int | str) -> tuple[torch.Tensor, torch.Tensor]:
        shard, local = self.locate(i)
        return shard.target_topk(local)

    def target_logsumexp(self, i: int | str) -> torch.Tensor:
        shard, local = self.locate(i)
        return shard.target_logsumexp(local)

    def target_logits(self, i: int | str) -> torch.Tensor:
        shard, local = self.locate(i)
        return shard.target_logits(local)

    @property
    def sampling(self) -> SamplingSetting:
        return sampling_setting(self)

    def sampled_support(self, i: int | str) -> tuple[torch.Tensor, torch.Tensor]:
        shard, local = self.locate(i)
        return shard.sampled_support(local)

    def realised_prob(self, i: int | str) -> torch.Tensor:
        shard, local = self.locate(i)
        return shard.realised_prob(local)


def open_sharded(root: str | Path, allow_unsealed: bool = False) -> ShardedCache:
    """Open the shards under ``root`` as one read-only cache.

    Raises:
        CacheFormatError: a shard is missing, or the shards' settings or arrays differ (names the key).
    """
    root = Path(root)
    shards = [open_local(p, allow_unsealed=allow_unsealed) for p in shard_dirs(root)]
    _check_same(root, shards)
    return ShardedCache(root, shards)


def merge_shards(root: str | Path, into: str | Path | None = None) -> dict[str, Any]:
    """Check the shards under ``root`` and write ``root/shards.json``; with ``into``, also one merged cache.

    Returns:
        The shards.json document: shard count, sequences, tokens, settings, and per shard its
        directory, size, completeness, settings and provenance.

    Raises:
        CacheFormatError: as ``open_sharded``, or (with ``into``) a shard is not complete.
        InputError: ``into`` exists and is not empty.
    """
    cache = open_sharded(root)
    document = {
        "format": "hscache-shards",
        "format_version": 1,
        "shards": len(cache.shards),
        "sequences": len(cache),
        "tokens": cache.num_tokens,
        "complete": cache.complete,
        "settings": cache.settings,
        "parts": [
            {
                "path": s.path.name,
                "sequences": len(s),
                "tokens": s.num_tokens,
                "complete": s.complete,
                "settings": s.settings,
                "provenance": s.provenance,
            }
            for s in cache.shards
        ],
    }
    fsio.atomic_write_json(cache.path / SHARDS_FILE, document)
    if into is not None:
        _write_merged(cache, Path(into), document)
    return document


def _write_merged(cache: ShardedCache, dest: Path, document: dict[str, Any]) -> None:
    if not cache.complete:
        raise CacheFormatError(
            f"{cache.path} has unfinished shards; finish every shard before merging into one cache"
        )
    if any("states" in s.manifest for s in cache.shards):  # fp8 states (store/compact.py)
        raise InputError(
            f"{cache.path} has shards with fp8 states, whose exact slices are per shard: merging them is not "
            "implemented; merge shards extracted without --states fp8, then `hscache recompress DEST --states fp8`"
        )
    with writer_lock(dest, "hscache shards --into"):
        if any(p.name != WRITER_LOCK for p in dest.iterdir()):
            raise InputError(f"--into {dest} exists and is not empty; choose a new directory")
        try:
            _copy_shards(cache, dest, document)
        except BaseException:
            # dest held nothing but our lock: what is there now is this merge's, half written
            # (e.g. a shard refused for a chunk that fails its sha256). Leave no partial cache.
            for path in dest.iterdir():
                if path.name != WRITER_LOCK:
                    shutil.rmtree(path) if path.is_dir() and not path.is_symlink() else path.unlink()
            raise


def _copy_shards(cache: ShardedCache, dest: Path, document: dict[str, Any]) -> None:
    first = cache.shards[0]
    writer = StoreWriter.create(dest, cache.specs, first.manifest["compression"], cache.settings)
    for g in range(len(cache)):
        shard, local = cache.locate(g)
        start, stop = shard.sequence_span(local)
        row = shard.index.slice(local, 1).to_pylist()[0]
        writer.append(
            SequenceRows(
                # Through the checked reader (crc32c and each chunk's sha256): a shard rewritten with
                # a valid crc32c is refused, never resealed into the merged cache (issue 52).
                arrays={name: shard.read_tokens(name, start, stop) for name in cache.specs},
                record_id=row["record_id"],
                prompt_len=row["prompt_len"],
                stop_reason=row["stop_reason"],
                token_sha256=row["token_sha256"],
                metadata_json=row["metadata_json"],
            )
        )
    # Every file before the completion mark: a merge killed after finish() is whole (issue 36).
    _copy_checked_files(first, dest)
    writer.record_files([TARGET_DIR, PROVENANCE])
    writer.finish()
    fsio.atomic_write_json(dest / SHARDS_FILE, document)


def _copy_checked_files(shard: Cache, dest: Path) -> None:
    """``target/`` and provenance of ``shard`` into ``dest``, from the bytes its seal vouches for
    (``Cache.file_bytes``: hashed at open, or read once and hashed now), never re-read by name."""
    sealed = shard.manifest.get("checksums")
    if not isinstance(sealed, dict):  # an unsealed shard (--allow-unsealed): nothing to check against
        shutil.copytree(shard.path / TARGET_DIR, dest / TARGET_DIR)
        shutil.copy2(shard.path / PROVENANCE, dest / PROVENANCE)
        return
    for rel in sorted(sealed):
        if rel == PROVENANCE or rel.startswith(f"{TARGET_DIR}/"):
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            (dest / rel).write_bytes(shard.file_bytes(rel))
