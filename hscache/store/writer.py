"""Append sequences to a cache with an atomic commit protocol, and resume after a crash.

Protocol (see spec/storage.md, "Crash safety"): rows are buffered per array from the last
chunk boundary on; a commit writes whole chunks (the partial last chunk padded), fsyncs the
chunk files and their directories, publishes an index part (temp, fsync, rename), and only
then rewrites ``manifest.json`` (temp, fsync, rename). The manifest is the single source of
truth: tokens past ``committed.tokens`` and index parts it does not list do not exist.
One writer per store: zarr has no locking.
"""

from __future__ import annotations

import io
import os
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import zarr

from hscache.errors import StoreWriteError
from hscache.store import fsio
from hscache.store.layout import (
    ARRAYS_GROUP,
    FORMAT_NAME,
    FORMAT_VERSION,
    INDEX_DIR,
    MANIFEST,
    ArraySpec,
    codecs_for,
)

__all__ = ["INDEX_SCHEMA", "SequenceRows", "StoreWriter"]

INDEX_SCHEMA = pa.schema(
    [
        ("seq_id", pa.int64()),
        ("record_id", pa.string()),
        ("offset", pa.int64()),
        ("length", pa.int32()),
        ("prompt_len", pa.int32()),
        ("stop_reason", pa.string()),
        ("token_sha256", pa.string()),
        ("metadata_json", pa.string()),
    ]
)


@dataclass
class SequenceRows:
    """One sequence ready to store: per-array rows in stored dtype, plus its index fields."""

    arrays: dict[str, np.ndarray]  # name -> [T, *row_shape], stored dtype
    record_id: str
    prompt_len: int
    stop_reason: str
    token_sha256: str
    metadata_json: str

    @property
    def length(self) -> int:
        return len(self.arrays["token_ids"])


class _Appender:
    """Buffers one array's rows from the last chunk boundary on and writes whole chunks."""

    def __init__(self, array: zarr.Array, spec: ArraySpec, committed_tokens: int):
        self.array, self.spec = array, spec
        self.chunk = spec.chunk_tokens
        self.buf_start = committed_tokens // self.chunk * self.chunk
        # Reload the committed tail of a partly filled chunk: the next write rewrites that chunk.
        tail = np.asarray(array[self.buf_start : committed_tokens]) if committed_tokens > self.buf_start else None
        self.parts: list[np.ndarray] = [tail] if tail is not None else []
        self.buffered = committed_tokens - self.buf_start

    def append(self, rows: np.ndarray) -> None:
        self.parts.append(rows)
        self.buffered += len(rows)

    def flush(self) -> list[int]:
        """Write everything buffered; return the chunk indices written."""
        if self.buffered == 0:
            return []
        data = np.concatenate(self.parts) if len(self.parts) > 1 else self.parts[0]
        padded_len = -(-len(data) // self.chunk) * self.chunk
        if padded_len != len(data):  # pad to a chunk boundary: whole-chunk writes, no read-modify-write
            pad = np.zeros((padded_len - len(data), *data.shape[1:]), dtype=data.dtype)
            data_out = np.concatenate([data, pad])
        else:
            data_out = data
        end = self.buf_start + padded_len
        if self.array.shape[0] < end:
            # Grow in big steps: every resize rewrites zarr.json.
            new_rows = max(end, 2 * self.array.shape[0])
            self.array.resize((-(-new_rows // self.chunk) * self.chunk, *self.array.shape[1:]))
        self.array[self.buf_start : end] = data_out
        written = list(range(self.buf_start // self.chunk, end // self.chunk))
        full = len(data) // self.chunk * self.chunk
        self.parts = [data[full:]] if full < len(data) else []
        self.buffered = len(data) - full
        self.buf_start += full
        return written


class StoreWriter:
    """Append-only writer of one cache directory (new or resumed)."""

    def __init__(self, root: Path, specs: dict[str, ArraySpec], compression: str, manifest: dict[str, Any]):
        self.root, self.specs, self.compression = Path(root), specs, compression
        self.manifest = manifest
        self.committed_tokens = int(manifest["committed"]["tokens"])
        self.committed_sequences = int(manifest["committed"]["sequences"])
        self.pending: list[SequenceRows] = []
        self.pending_tokens = 0
        group = zarr.open_group(str(self.root / ARRAYS_GROUP), mode="a")
        self.appenders = {
            name: _Appender(self._open_array(group, spec), spec, self.committed_tokens)
            for name, spec in specs.items()
        }

    @classmethod
    def create(
        cls, root: Path, specs: dict[str, ArraySpec], compression: str, settings: dict[str, Any]
    ) -> "StoreWriter":
        manifest = {
            "format": FORMAT_NAME,
            "format_version": FORMAT_VERSION,
            "settings": settings,
            "compression": compression,
            "arrays": {name: spec.to_dict() for name, spec in specs.items()},
            "committed": {"sequences": 0, "tokens": 0},
            "index_parts": [],
            "complete": False,
            "updated_at": time.time(),
        }
        Path(root).mkdir(parents=True, exist_ok=True)
        fsio.atomic_write_json(Path(root) / MANIFEST, manifest)
        return cls(root, specs, compression, manifest)

    @classmethod
    def resume(cls, root: Path, manifest: dict[str, Any]) -> "StoreWriter":
        specs = {name: ArraySpec.from_dict(name, d) for name, d in manifest["arrays"].items()}
        _remove_leftovers(Path(root), manifest)
        manifest = dict(manifest, complete=False)
        return cls(root, specs, manifest["compression"], manifest)

    def _open_array(self, group: zarr.Group, spec: ArraySpec) -> zarr.Array:
        if spec.name in group:
            return group[spec.name]
        array = group.create_array(
            spec.name,
            shape=(0, *spec.row_shape),
            chunks=(spec.chunk_tokens, *spec.row_shape),
            dtype=spec.stored_dtype,
            fill_value=0,
            compressors=codecs_for(spec, self.compression),
            config={"write_empty_chunks": True},
        )
        array.attrs.update({"logical_dtype": spec.logical_dtype, "hscache_array": spec.name})
        return array

    def append(self, seq: SequenceRows) -> None:
        """Buffer one sequence; it becomes visible to readers at the next commit."""
        for name, appender in self.appenders.items():
            rows = seq.arrays[name]
            if rows.shape[1:] != appender.spec.row_shape or rows.dtype != np.dtype(appender.spec.stored_dtype):
                raise ValueError(f"{name}: rows {rows.shape}/{rows.dtype} do not match {appender.spec}")
            appender.append(rows)
        self.pending.append(seq)
        self.pending_tokens += seq.length

    def commit(self) -> None:
        """Make every appended sequence durable and visible (no-op when nothing is pending).

        Raises:
            StoreWriteError: a write failed (e.g. disk full); what was committed before stays intact.
        """
        if not self.pending:
            return
        try:
            self._commit()
        except OSError as exc:
            raise StoreWriteError(
                f"writing to {self.root} failed ({exc.strerror or exc}); the {self.committed_sequences} "
                "sequences committed before are intact: fix the cause and re-run the same command to resume"
            ) from exc

    def _commit(self) -> None:
        for name, appender in self.appenders.items():
            for chunk_index in appender.flush():
                self._fsync_chunk(name, appender.spec, chunk_index)
            fsio.fsync_dir(self.root / ARRAYS_GROUP / name)
        rows = self._index_rows(self.pending)
        part_name = f"{INDEX_DIR}/part-{len(self.manifest['index_parts']):06d}.parquet"
        fsio.atomic_write_bytes(self.root / part_name, _parquet_bytes(rows))
        self.committed_sequences += len(self.pending)
        self.committed_tokens += self.pending_tokens
        self.manifest["index_parts"] = [*self.manifest["index_parts"], part_name]
        self._publish_manifest()
        self.pending, self.pending_tokens = [], 0

    def _fsync_chunk(self, name: str, spec: ArraySpec, chunk_index: int) -> None:
        key = "/".join(["c", str(chunk_index), *["0"] * len(spec.row_shape)])
        path = self.root / ARRAYS_GROUP / name / key
        fsio.fsync_file(path)
        fsio.fsync_dir(path.parent)

    def _index_rows(self, seqs: Iterable[SequenceRows]) -> pa.Table:
        offset, seq_id = self.committed_tokens, self.committed_sequences
        columns: dict[str, list[Any]] = {f.name: [] for f in INDEX_SCHEMA}
        for seq in seqs:
            values = (seq_id, seq.record_id, offset, seq.length, seq.prompt_len, seq.stop_reason,
                      seq.token_sha256, seq.metadata_json)
            for field_name, value in zip(columns, values):
                columns[field_name].append(value)
            offset += seq.length
            seq_id += 1
        return pa.table(columns, schema=INDEX_SCHEMA)

    def _publish_manifest(self) -> None:
        self.manifest["committed"] = {"sequences": self.committed_sequences, "tokens": self.committed_tokens}
        self.manifest["updated_at"] = time.time()
        fsio.atomic_write_json(self.root / MANIFEST, self.manifest)

    def finish(self) -> None:
        """Commit, compact the index into one part, trim arrays to their length, mark complete."""
        self.commit()
        parts = self.manifest["index_parts"]
        if len(parts) > 1:
            table = pa.concat_tables([pq.read_table(self.root / p) for p in parts])
            compacted = f"{INDEX_DIR}/part-{len(parts):06d}.parquet"
            fsio.atomic_write_bytes(self.root / compacted, _parquet_bytes(table))
            self.manifest["index_parts"] = [compacted]
            self._publish_manifest()
            for old in parts:
                (self.root / old).unlink(missing_ok=True)
        for appender in self.appenders.values():
            if appender.array.shape[0] != self.committed_tokens:
                appender.array.resize((self.committed_tokens, *appender.array.shape[1:]))
        self.manifest["complete"] = True
        self._publish_manifest()


def _parquet_bytes(table: pa.Table) -> bytes:
    sink = io.BytesIO()
    pq.write_table(table, sink, compression="zstd", row_group_size=65536)
    return sink.getvalue()


def _remove_leftovers(root: Path, manifest: dict[str, Any]) -> None:
    """Delete what a killed run left: zarr's ``.partial`` files, our temp files, unlisted index parts."""
    listed = {root / p for p in manifest["index_parts"]}
    for dirpath, _dirnames, filenames in os.walk(root):
        for filename in filenames:
            path = Path(dirpath) / filename
            stale = filename.endswith(".partial") or fsio.TEMP_MARK in filename
            orphan_part = path.parent == root / INDEX_DIR and path not in listed
            if stale or orphan_part:
                path.unlink(missing_ok=True)
