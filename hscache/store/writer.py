"""Append sequences to a cache with an atomic commit protocol, and resume after a crash.

Protocol (see spec/storage.md, "Crash safety"): rows are buffered per array from the last
chunk boundary on; a commit writes whole chunks (the partial last chunk padded), fsyncs the
chunk files and their directories, publishes an index part (temp, fsync, rename), and only
then rewrites ``manifest.json`` (temp, fsync, rename). The manifest is the single source of
truth: tokens past ``committed.tokens`` and index parts it does not list do not exist.
One writer per store: zarr has no locking.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import zarr

from hscache import schemas
from hscache.errors import CacheFormatError, StoreWriteError
from hscache.store import fsio, integrity
from hscache.store.index import INDEX_SCHEMA, parquet_bytes
from hscache.store.layout import (
    ARRAYS_GROUP,
    CREATING_MARK,
    FORMAT_NAME,
    FORMAT_VERSION,
    INDEX_DIR,
    MANIFEST,
    PROVENANCE,
    RUN_LOG,
    TARGET_DIR,
    ArraySpec,
    chunk_key,
    codecs_for,
)

__all__ = ["SequenceRows", "StoreWriter", "publish_manifest", "write_error"]


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
    """Buffers one array's rows from the last chunk boundary on and writes whole chunks.

    Chunks are written as soon as they fill (memory stays bounded by the chunk size, not by
    the commit interval); the partial last chunk is written, padded, only at a commit. Rows
    written past ``committed.tokens`` are invisible to readers until the manifest says so.
    """

    def __init__(
        self, array: zarr.Array, spec: ArraySpec, committed_tokens: int, chunk_sha256: list[str] | None
    ):
        self.array, self.spec = array, spec
        self.chunk = spec.chunk_tokens
        self.buf_start = committed_tokens // self.chunk * self.chunk
        # SHA-256 of each chunk's rows as written (store/integrity.py), hashed here from the rows in
        # memory: no read-back. None: a resumed cache from before chunk hashes (kept without them).
        self.chunk_sha256: dict[int, str] | None = (
            dict(enumerate(chunk_sha256)) if chunk_sha256 is not None else None
        )
        # Reload the committed tail of a partly filled chunk: the next write rewrites that chunk.
        tail = (
            np.asarray(array[self.buf_start : committed_tokens])
            if committed_tokens > self.buf_start
            else None
        )
        tail_index = self.buf_start // self.chunk
        if (
            tail is not None
            and self.chunk_sha256 is not None
            and self.chunk_sha256.get(tail_index) != integrity.rows_sha256(tail)
        ):
            # Resuming would re-hash (and so vouch for) rows that are not what was committed.
            raise CacheFormatError(
                f"{spec.name} chunk {tail_index} does not match its sha256 recorded at commit; the cache "
                "was changed after it was written: run `hscache verify` on it, then re-extract with --overwrite"
            )
        self.parts: list[np.ndarray] = [tail] if tail is not None else []
        self.buffered = committed_tokens - self.buf_start
        self.written: set[int] = set()  # chunk indices written since the last flush (to fsync)
        self.resized = False  # zarr.json rewritten since the last flush (to fsync)

    def append(self, rows: np.ndarray) -> None:
        self.parts.append(rows)
        self.buffered += len(rows)
        if self.buffered >= self.chunk:
            self._write(pad_tail=False)

    def flush(self) -> tuple[set[int], bool]:
        """Write everything buffered; return (chunks written since the last flush, resized)."""
        if self.buffered:
            self._write(pad_tail=True)
        written, resized = self.written, self.resized
        self.written, self.resized = set(), False
        return written, resized

    def _write(self, pad_tail: bool) -> None:
        data = np.concatenate(self.parts) if len(self.parts) > 1 else self.parts[0]
        full = len(data) // self.chunk * self.chunk
        out_len = -(-len(data) // self.chunk) * self.chunk if pad_tail else full
        if out_len == 0:
            return
        if out_len > len(data):  # pad to a chunk boundary: whole-chunk writes, no read-modify-write
            pad = np.zeros((out_len - len(data), *data.shape[1:]), dtype=data.dtype)
            data_out = np.concatenate([data, pad])
        else:
            data_out = data[:out_len]
        end = self.buf_start + out_len
        if self.array.shape[0] < end:
            # Grow in big steps: every resize rewrites zarr.json.
            new_rows = max(end, 2 * self.array.shape[0])
            self.array.resize((-(-new_rows // self.chunk) * self.chunk, *self.array.shape[1:]))
            self.resized = True
        self.array[self.buf_start : end] = data_out
        first = self.buf_start // self.chunk
        self.written.update(range(first, end // self.chunk))
        if self.chunk_sha256 is not None:
            for k in range(-(-len(data) // self.chunk) if pad_tail else full // self.chunk):
                # Only rows that hold data: the padding of a partial last chunk is never read.
                self.chunk_sha256[first + k] = integrity.rows_sha256(
                    data[k * self.chunk : (k + 1) * self.chunk]
                )
        # Copy the remainder so the concatenated block can be freed.
        self.parts = [data[full:].copy()] if full < len(data) else []
        self.buffered = len(data) - full
        self.buf_start += full


@dataclass(frozen=True)
class _PendingRow:
    """The index fields of an appended, not yet committed sequence (its arrays are already buffered)."""

    record_id: str
    length: int
    prompt_len: int
    stop_reason: str
    token_sha256: str
    metadata_json: str


class StoreWriter:
    """Append-only writer of one cache directory (new or resumed).

    Every method that touches the disk raises ``StoreWriteError`` on an ``OSError`` (disk full,
    permissions); after one, the writer is unusable and the committed part is intact on disk.
    """

    def __init__(self, root: Path, specs: dict[str, ArraySpec], compression: str, manifest: dict[str, Any]):
        self.root, self.specs, self.compression = Path(root), specs, compression
        self.manifest = manifest
        self.committed_tokens = int(manifest["committed"]["tokens"])
        self.committed_sequences = int(manifest["committed"]["sequences"])
        self.pending: list[_PendingRow] = []
        self.pending_tokens = 0
        with self._store_errors():
            group = zarr.open_group(str(self.root / ARRAYS_GROUP), mode="a", zarr_format=3)
            self.appenders = {
                name: _Appender(
                    self._open_array(group, spec),
                    spec,
                    self.committed_tokens,
                    integrity.chunk_sha256_of(manifest, name) if name in manifest["arrays"] else [],
                )
                for name, spec in specs.items()
            }

    @classmethod
    def create(
        cls, root: Path, specs: dict[str, ArraySpec], compression: str, settings: dict[str, Any]
    ) -> StoreWriter:
        """Start a new cache at ``root``: arrays first, then the first manifest (so a reader that
        finds a manifest always finds the arrays it names).

        Raises:
            StoreWriteError: the directory could not be written.
        """
        manifest = {
            "format": FORMAT_NAME,
            "format_version": FORMAT_VERSION,
            "settings": settings,
            "compression": compression,
            "arrays": {name: {**spec.to_dict(), "chunk_sha256": []} for name, spec in specs.items()},
            "committed": {"sequences": 0, "tokens": 0},
            "index_parts": [],
            "complete": False,
            "updated_at": time.time(),
            # Every non-chunk file, as written (store/integrity.py); target/ and provenance.json
            # when they exist already (hscache extract writes target/ first).
            "checksums": {
                rel: integrity.digest_file(Path(root) / rel)
                for rel in integrity.files_under(Path(root), [TARGET_DIR, PROVENANCE])
            },
        }
        try:
            Path(root).mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise write_error(Path(root), 0, exc) from exc
        writer = cls(root, specs, compression, manifest)
        with writer._store_errors():
            writer._record_array_metadata()
            writer._fsync_metadata()
            writer._publish_manifest()
            (writer.root / CREATING_MARK).unlink(missing_ok=True)
        return writer

    @classmethod
    def resume(cls, root: Path, manifest: dict[str, Any]) -> StoreWriter:
        """Reopen the cache at ``root`` after deleting whatever a killed run left behind."""
        specs = {name: ArraySpec.from_dict(name, d) for name, d in manifest["arrays"].items()}
        try:
            _remove_leftovers(Path(root), manifest)
        except OSError as exc:
            raise write_error(Path(root), int(manifest["committed"]["sequences"]), exc) from exc
        manifest = dict(manifest, complete=False)
        return cls(root, specs, manifest["compression"], manifest)

    def _open_array(self, group: zarr.Group, spec: ArraySpec) -> zarr.Array:
        if spec.name in group:
            # write_empty_chunks is a runtime setting, not stored: without it a resumed run would
            # delete (not write) an all-zero chunk, which then reads as "missing" to verify.
            return group[spec.name].with_config({"write_empty_chunks": True})
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

    @contextlib.contextmanager
    def _store_errors(self) -> Iterator[None]:
        try:
            yield
        except StoreWriteError:
            raise
        except OSError as exc:
            raise write_error(self.root, self.committed_sequences, exc) from exc

    def append(self, seq: SequenceRows) -> None:
        """Buffer one sequence; it becomes visible to readers at the next commit.

        Raises:
            ValueError: the rows do not match the arrays' shapes or dtypes.
            StoreWriteError: writing a filled chunk failed.
        """
        for name, appender in self.appenders.items():
            rows = seq.arrays[name]
            if rows.shape[1:] != appender.spec.row_shape or rows.dtype != np.dtype(
                appender.spec.stored_dtype
            ):
                raise ValueError(f"{name}: rows {rows.shape}/{rows.dtype} do not match {appender.spec}")
        with self._store_errors():
            for name, appender in self.appenders.items():
                appender.append(seq.arrays[name])
        self.pending.append(
            _PendingRow(
                seq.record_id,
                seq.length,
                seq.prompt_len,
                seq.stop_reason,
                seq.token_sha256,
                seq.metadata_json,
            )
        )
        self.pending_tokens += seq.length

    def commit(self) -> None:
        """Make every appended sequence durable and visible (no-op when nothing is pending).

        Raises:
            StoreWriteError: a write failed (e.g. disk full); what was committed before stays intact.
        """
        if not self.pending:
            return
        with self._store_errors():
            self._commit()

    def _commit(self) -> None:
        # Order is the protocol: chunks durable -> index part durable -> manifest (the commit).
        for name, appender in self.appenders.items():
            written, resized = appender.flush()
            for chunk_index in sorted(written):
                self._fsync_chunk(name, appender.spec, chunk_index)
            if resized:
                fsio.fsync_file(self.root / ARRAYS_GROUP / name / "zarr.json")
        part_name = self._next_part_name()
        part = parquet_bytes(self._index_rows(self.pending))
        fsio.atomic_write_bytes(self.root / part_name, part)
        self.manifest["index_parts"] = [*self.manifest["index_parts"], part_name]
        self._record(part_name, part)
        self._publish_manifest(
            self.committed_sequences + len(self.pending), self.committed_tokens + self.pending_tokens
        )
        self.committed_sequences += len(self.pending)
        self.committed_tokens += self.pending_tokens
        self.pending, self.pending_tokens = [], 0

    def _next_part_name(self) -> str:
        """One past the highest listed part: never the name of a listed (or compacted) part."""
        numbers = [int(p.rsplit("-", 1)[1].split(".")[0]) for p in self.manifest["index_parts"]]
        return f"{INDEX_DIR}/part-{max(numbers, default=-1) + 1:06d}.parquet"

    def _fsync_chunk(self, name: str, spec: ArraySpec, chunk_index: int) -> None:
        array_dir = self.root / ARRAYS_GROUP / name
        fsio.fsync_file_and_parents(array_dir / chunk_key(spec, chunk_index), array_dir)

    def _record_array_metadata(self) -> None:
        """Record each array's zarr.json (less its growing row count) and the group's zarr.json."""
        arrays = self.root / ARRAYS_GROUP
        for name in self.specs:
            meta = json.loads((arrays / name / "zarr.json").read_bytes())
            self.manifest["arrays"][name]["zarr_json_sha256"] = integrity.zarr_json_sha256(meta)
        self.manifest["checksums"][integrity.ARRAY_GROUP_META] = integrity.digest_file(arrays / "zarr.json")

    def _fsync_metadata(self) -> None:
        arrays = self.root / ARRAYS_GROUP
        for name in self.specs:
            fsio.fsync_file(arrays / name / "zarr.json")
            fsio.fsync_dir(arrays / name)
        fsio.fsync_file(arrays / "zarr.json")
        fsio.fsync_dir(arrays)
        fsio.fsync_dir(self.root)

    def _index_rows(self, seqs: Iterable[_PendingRow]) -> pa.Table:
        offset, seq_id = self.committed_tokens, self.committed_sequences
        columns: dict[str, list[Any]] = {f.name: [] for f in INDEX_SCHEMA}
        for seq in seqs:
            values = (
                seq_id,
                seq.record_id,
                offset,
                seq.length,
                seq.prompt_len,
                seq.stop_reason,
                seq.token_sha256,
                seq.metadata_json,
            )
            for field_name, value in zip(columns, values):
                columns[field_name].append(value)
            offset += seq.length
            seq_id += 1
        return pa.table(columns, schema=INDEX_SCHEMA)

    def _publish_manifest(self, sequences: int | None = None, tokens: int | None = None) -> None:
        sequences = self.committed_sequences if sequences is None else sequences
        tokens = self.committed_tokens if tokens is None else tokens
        if tokens != self.manifest["committed"]["tokens"]:
            # Only at a commit: between commits the appenders also hash chunks of pending rows (and
            # another thread may publish a side file meanwhile), so the committed list is a snapshot.
            for name, appender in self.appenders.items():
                if appender.chunk_sha256 is not None:
                    chunks = -(-tokens // appender.chunk)
                    self.manifest["arrays"][name]["chunk_sha256"] = [
                        appender.chunk_sha256[i] for i in range(chunks)
                    ]
        self.manifest["committed"] = {"sequences": sequences, "tokens": tokens}
        publish_manifest(self.root, self.manifest)

    def _record(self, rel: str, data: bytes, replaces: Iterable[str] = ()) -> None:
        """Note ``rel``'s checksum for the next manifest (caches from before checksums: nothing)."""
        checksums = self.manifest.get("checksums")
        if checksums is None:
            return
        for old in replaces:
            checksums.pop(old, None)
        checksums[rel] = integrity.digest_bytes(data)

    def write_file(self, rel: str, data: bytes) -> None:
        """Publish a side file (e.g. provenance.json) atomically and record its checksum in a new
        manifest, so that the cache never holds a file its manifest does not vouch for.

        Raises:
            StoreWriteError: a write failed.
        """
        with self._store_errors():
            fsio.atomic_write_bytes(self.root / rel, data)
            self._record(rel, data)
            self._publish_manifest()

    def write_run_log(self, data: bytes) -> None:
        """Publish ``runs.json`` (store/run_log.py) atomically and record its checksum under the
        manifest's ``run_log``: sealed like every file, left out of the digest.

        Raises:
            StoreWriteError: a write failed.
        """
        with self._store_errors():
            fsio.atomic_write_bytes(self.root / RUN_LOG, data)
            if "checksums" in self.manifest:  # a cache from before checksums stays unsealed
                self.manifest["run_log"] = integrity.digest_bytes(data)
            self._publish_manifest()

    def record_files(self, rels: Iterable[str]) -> None:
        """Record the checksums of files written by others (directories: every file below)."""
        with self._store_errors():
            if "checksums" in self.manifest:
                for rel in integrity.files_under(self.root, rels):
                    self.manifest["checksums"][rel] = integrity.digest_file(self.root / rel)
            self._publish_manifest()

    def finish(self) -> None:
        """Commit, compact the index into one part, trim arrays to their length, mark complete.

        Each step is safe to kill: the compacted part is published by one manifest write (a
        reader sees the old parts or the compacted one, never both) and a resume deletes
        whichever parts the manifest no longer lists.

        Raises:
            StoreWriteError: a write failed; the committed part stays intact and resumable.
        """
        self.commit()
        with self._store_errors():
            self._compact_index()
            for name, appender in self.appenders.items():
                if appender.array.shape[0] != self.committed_tokens:
                    appender.array.resize((self.committed_tokens, *appender.array.shape[1:]))
                    fsio.fsync_file(self.root / ARRAYS_GROUP / name / "zarr.json")
            self.manifest["complete"] = True
            self._publish_manifest()

    def _compact_index(self) -> None:
        """Leave the index as one part named ``FINAL_PART`` whatever the commits were: how often a
        run committed depends on its speed, and the part names are in the digest, so the same rows
        must end in the same part. Two steps when ``FINAL_PART`` is listed among several (the first
        commit's part): compact into a new part, then rewrite that under the final name. Each step
        is one manifest write; a resume deletes the parts the manifest no longer lists."""
        while self.manifest["index_parts"] and self.manifest["index_parts"] != [FINAL_PART]:
            parts = self.manifest["index_parts"]
            table = pa.concat_tables([pq.read_table(self.root / p) for p in parts]).combine_chunks()
            name = self._next_part_name() if FINAL_PART in parts else FINAL_PART
            data = parquet_bytes(table)
            fsio.atomic_write_bytes(self.root / name, data)
            self.manifest["index_parts"] = [name]
            self._record(name, data, replaces=parts)
            self._publish_manifest()
            for old in parts:
                (self.root / old).unlink(missing_ok=True)


# Where a finished cache's index ends (StoreWriter._compact_index).
FINAL_PART = f"{INDEX_DIR}/part-000000.parquet"


def publish_manifest(root: Path, manifest: dict[str, Any]) -> None:
    """Stamp, seal (store/integrity.py), validate and atomically replace ``root``'s manifest: the
    last step of every change to a cache."""
    manifest["updated_at"] = time.time()
    integrity.seal(manifest)
    schemas.validate(manifest, "manifest")
    fsio.atomic_write_json(Path(root) / MANIFEST, manifest)


def write_error(root: Path, committed_sequences: int, exc: OSError) -> StoreWriteError:
    """The one-line ``StoreWriteError`` for an ``OSError`` while writing the cache at ``root``."""
    return StoreWriteError(
        f"writing to {root} failed{fsio.failure(exc)}; the {committed_sequences} sequences "
        "committed before are intact: fix the cause (e.g. free disk space) and re-run the same command to resume"
    )


def _remove_leftovers(root: Path, manifest: dict[str, Any]) -> None:
    """Delete what a killed run left: zarr's ``.partial`` files, our temp files and directories
    (e.g. a half-written ``target`` staging dir), unlisted index parts, the creation mark."""
    listed = {root / p for p in manifest["index_parts"]}
    (root / CREATING_MARK).unlink(missing_ok=True)
    for dirpath, dirnames, filenames in os.walk(root):
        for dirname in list(dirnames):
            if fsio.TEMP_MARK in dirname:
                shutil.rmtree(Path(dirpath) / dirname, ignore_errors=True)
                dirnames.remove(dirname)
        for filename in filenames:
            path = Path(dirpath) / filename
            stale = filename.endswith(".partial") or fsio.TEMP_MARK in filename
            orphan_part = path.parent == root / INDEX_DIR and path not in listed
            if stale or orphan_part:
                path.unlink(missing_ok=True)
