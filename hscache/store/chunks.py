"""Read a local cache's chunk files directly: the fast path for scans, block reads and sequences.

zarr-python decodes one chunk at a time through its asyncio pipeline; a full scan ran at
0.14-0.20 of a raw memmap of the same bytes (bench/scale.py). For the codec chains hscache
writes (``layout.codecs_for``: zarr v3 ``bytes`` little endian, optionally ``blosc``, then
``crc32c``) a chunk file is

    payload || crc32c(payload) as 4 little-endian bytes
    payload = the whole chunk (``chunk_tokens`` rows, edge chunks too) in C order, or one blosc frame of it

so this module reads the file into a reused buffer, checks the crc32c (google_crc32c, hardware
accelerated), decompresses with numcodecs straight into the output array (a whole uncompressed
chunk is read straight into it), and reads further chunks in a small thread pool (file reads,
blosc and crc32c release the GIL), overlapping I/O and decoding. ``tests/hscache/test_chunks.py``
checks it bit for bit against zarr's own reads.

``chunk_reader(array)`` returns None for anything else (a remote store, another codec, another
chunk key encoding, a big-endian host): the caller then reads through zarr. Like zarr, a missing
chunk file reads as the fill value; ``hscache verify`` names missing chunks.
"""

from __future__ import annotations

import os
import sys
import threading
from collections import OrderedDict, deque
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import google_crc32c
import numpy as np
from numcodecs import blosc

from hscache.errors import CacheFormatError
from hscache.store.integrity import rows_sha256

__all__ = ["ChunkReader", "chunk_reader"]

_BLOSC_HEADER = 16  # blosc1 frame header: version, versionlz, flags, typesize, nbytes, blocksize, cbytes
_MAX_REUSED_BUFFER = 64 << 20  # larger chunks (e.g. full logits) get a fresh buffer per read
# Reader threads and chunks decoded ahead of the consumer in ``iter_blocks``: decoding ("fast":
# lz4 + bitshuffle, ~2.5 GB/s a core) is what bounds a compressed scan, so both grow with the cores.
_THREADS = max(2, min(8, os.cpu_count() or 1))
_READ_AHEAD = _THREADS
_CRC_PIECE = 1 << 20  # bytes read and checksummed at a time (fits in L2)
_PREFETCH_FILES = 4  # chunk files whose reading the kernel is asked to start ahead of decoding
# Decoded chunks kept per reader for partial reads (one sequence at a time: small arrays such as
# token_ids hold ~1M tokens per chunk, so without this every sequence re-decodes a whole chunk).
# Committed rows never change and a Cache never reads past its own manifest, so entries never go stale.
_DECODED_CACHE_BYTES = 32 << 20

_pool: ThreadPoolExecutor | None = None
_pool_pid = 0
_pool_lock = threading.Lock()
_local = threading.local()


def _executor() -> ThreadPoolExecutor:
    """The module's reader threads (recreated in a forked child, where the parent's are gone)."""
    global _pool, _pool_pid
    with _pool_lock:
        if _pool is None or _pool_pid != os.getpid():
            _pool = ThreadPoolExecutor(max_workers=_THREADS, thread_name_prefix="hscache-read")
            _pool_pid = os.getpid()
        return _pool


def _scratch(slot: str, nbytes: int) -> np.ndarray:
    """A per-thread byte buffer of at least ``nbytes`` (reused: fresh pages cost a fault each)."""
    if nbytes > _MAX_REUSED_BUFFER:
        return np.empty(nbytes, np.uint8)
    buf = getattr(_local, slot, None)
    if buf is None or buf.nbytes < nbytes:
        buf = np.empty(max(nbytes, 1 << 20), np.uint8)
        setattr(_local, slot, buf)
    return buf[:nbytes]


def _known_chain(codecs: list[dict[str, Any]], itemsize: int) -> bool | None:
    """True: bytes+blosc+crc32c; False: bytes+crc32c; None: a chain this module does not read."""
    names = [c.get("name") for c in codecs]
    if not names or names[0] != "bytes" or names[-1] != "crc32c":
        return None
    endian = (codecs[0].get("configuration") or {}).get("endian", "little")
    if itemsize > 1 and endian != "little":
        return None
    if names[1:-1] == []:
        return False
    if names[1:-1] == ["blosc"]:
        return True
    return None


class ChunkReader:
    """Reads rows of one local, unsharded, token-chunked zarr v3 array without zarr.

    Rows are read in the array's stored dtype (bfloat16 stays raw uint16, as through zarr).
    """

    def __init__(
        self,
        directory: Path,
        name: str,
        length: int,
        chunk_tokens: int,
        row_shape: tuple[int, ...],
        dtype: np.dtype,
        compressed: bool,
        fill_value: Any,
    ):
        self.directory, self.name, self.length = Path(directory), name, length
        self.chunk_tokens, self.row_shape, self.dtype = chunk_tokens, row_shape, np.dtype(dtype)
        self.compressed, self.fill_value = compressed, fill_value
        self.chunk_bytes = chunk_tokens * int(np.prod(row_shape, dtype=np.int64)) * self.dtype.itemsize
        self._key_tail = "/".join(["0"] * len(row_shape))
        self._decoded: OrderedDict[int, np.ndarray] = OrderedDict()  # LRU of whole decoded chunks
        self._decoded_lock = threading.Lock()
        self._keep_decoded = 2 * self.chunk_bytes <= _DECODED_CACHE_BYTES
        self._expected_sha256: list[str] | None = None  # per chunk, of its committed rows
        self._committed = length
        self._verified: set[int] = set()  # chunks whose hash matched (committed rows never change)

    def expect_sha256(self, chunk_sha256: list[str] | None, committed_tokens: int) -> None:
        """Check each chunk's committed rows against ``chunk_sha256`` (store/integrity.py) the first
        time it is decoded: a chunk rewritten with other content and a valid crc32c is refused."""
        self._expected_sha256, self._committed = chunk_sha256, committed_tokens

    def _verify(self, index: int, rows: np.ndarray) -> None:
        """``rows``: the whole decoded chunk ``index``."""
        if self._expected_sha256 is None or index in self._verified:
            return
        n = min(self.chunk_tokens, self._committed - index * self.chunk_tokens)
        if n <= 0:
            return
        expected = self._expected_sha256[index] if index < len(self._expected_sha256) else None
        if rows_sha256(rows[:n]) != expected:
            raise CacheFormatError(
                f"{self._where(self.chunk_path(index))} does not match its sha256 recorded at commit (its "
                "crc32c is valid: the chunk was rewritten); the cache was changed after it was written: "
                "run `hscache verify` on it, then re-extract"
            )
        self._verified.add(index)

    def chunk_path(self, index: int) -> Path:
        return self.directory / "c" / (f"{index}/{self._key_tail}" if self._key_tail else str(index))

    def read(self, start: int, stop: int) -> np.ndarray:
        """Rows ``[start, stop)`` (clamped to the array, as a slice is); chunks in parallel.

        Raises:
            CacheFormatError: a chunk fails its crc32c check or does not decode (named in the message).
        """
        start, stop = max(0, start), min(stop, self.length)
        out = np.empty((max(0, stop - start), *self.row_shape), self.dtype)
        pieces = list(self._pieces(start, stop))
        for index, _, _ in pieces[1:]:
            self._prefetch(index)
        if len(pieces) <= 1:
            for index, a, b in pieces:
                self._read_chunk(index, a, b, out[a - start : b - start])
            return out
        futures = [
            _executor().submit(self._read_chunk, index, a, b, out[a - start : b - start])
            for index, a, b in pieces
        ]
        for future in futures:
            future.result()
        return out

    def iter_blocks(self, start: int = 0, stop: int | None = None) -> Iterator[tuple[int, np.ndarray]]:
        """``(first row, rows)`` per chunk of ``[start, stop)`` in order, the next chunks decoding
        in the background while the caller works on this one (memory: a few chunks)."""
        stop = self.length if stop is None else min(stop, self.length)
        pending: deque[tuple[int, Future]] = deque()
        pieces = list(self._pieces(max(0, start), stop))
        pool = _executor()
        for index, _, _ in pieces[:_PREFETCH_FILES]:
            self._prefetch(index)
        for k, (index, a, b) in enumerate(pieces):
            if k + _PREFETCH_FILES < len(pieces):
                self._prefetch(pieces[k + _PREFETCH_FILES][0])
            # Allocated here, not on a pool thread: freed blocks then return to this thread's malloc
            # arena and are reused, instead of every block costing fresh page faults.
            out = np.empty((b - a, *self.row_shape), self.dtype)
            pending.append((a, pool.submit(self._read_into, index, a, b, out)))
            if len(pending) > _READ_AHEAD:
                first, future = pending.popleft()
                yield first, future.result()
        while pending:
            first, future = pending.popleft()
            yield first, future.result()

    def _prefetch(self, index: int) -> None:
        """Ask the kernel to read chunk ``index``'s file in the background (no-op when cached or missing).

        Reading many chunk files one after another waits on each file's readahead windows in
        turn: half a raw memmap's cold speed. Queuing whole files ahead keeps the disk busy.
        """
        try:
            fd = os.open(self.chunk_path(index), os.O_RDONLY)
        except OSError:
            return
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
        except OSError:
            pass
        finally:
            os.close(fd)

    def _pieces(self, start: int, stop: int) -> Iterator[tuple[int, int, int]]:
        """(chunk index, first row, end row) of every chunk overlapping ``[start, stop)``."""
        ct = self.chunk_tokens
        for index in range(start // ct, -(-stop // ct) if stop > start else start // ct):
            yield index, max(start, index * ct), min(stop, (index + 1) * ct)

    def _read_into(self, index: int, a: int, b: int, out: np.ndarray) -> np.ndarray:
        self._read_chunk(index, a, b, out)
        return out

    def _read_chunk(self, index: int, a: int, b: int, out: np.ndarray) -> None:
        """Rows ``[a, b)`` of chunk ``index`` into ``out`` (``b - a`` rows, C-contiguous)."""
        base = index * self.chunk_tokens
        whole = a == base and b - a == self.chunk_tokens
        if whole or not self._keep_decoded:
            self._decode(index, a, b, out)
            return
        with self._decoded_lock:
            rows = self._decoded.get(index)
            if rows is not None:
                self._decoded.move_to_end(index)
        if rows is None:
            rows = np.empty((self.chunk_tokens, *self.row_shape), self.dtype)
            self._decode(index, base, base + self.chunk_tokens, rows)
            with self._decoded_lock:
                self._decoded[index] = rows
                while len(self._decoded) * self.chunk_bytes > _DECODED_CACHE_BYTES:
                    self._decoded.popitem(last=False)
        out[...] = rows[a - base : b - base]

    def _decode(self, index: int, a: int, b: int, out: np.ndarray) -> None:
        """Read, check and decode chunk ``index``; rows ``[a, b)`` of it into ``out``."""
        path = self.chunk_path(index)
        base = index * self.chunk_tokens
        whole = a == base and b - a == self.chunk_tokens
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            # The writer writes every chunk (empty ones too) before a commit publishes its tokens,
            # so a missing chunk under committed tokens is damage: zeros would be wrong data.
            raise CacheFormatError(
                f"{self._where(path)} is missing; the cache is damaged: run `hscache verify` "
                "and re-extract the sequences it names"
            ) from None
        try:
            size = os.fstat(fd).st_size
            if size < 4:
                self._check_size(
                    path, size, self.chunk_bytes + 4 if not self.compressed else _BLOSC_HEADER + 4
                )
            if not self.compressed and whole:
                payload = out.reshape(-1).view(np.uint8)  # read the payload straight into the result
                self._check_size(path, size, self.chunk_bytes + 4)
            else:
                payload = _scratch("file", size - 4)
            stored = _pread_exact(fd, 4, size - 4, path)
            computed = _readinto_crc(fd, payload, path)
        finally:
            os.close(fd)
        self._check_crc(path, computed, stored)
        if not self.compressed:
            if not whole:
                self._check_size(path, payload.nbytes, self.chunk_bytes)
                rows = payload.view(self.dtype).reshape(self.chunk_tokens, *self.row_shape)
                self._verify(index, rows)
                out[...] = rows[a - base : b - base]
            else:
                self._verify(index, out)
            return
        self._check_frame(path, payload)
        if whole:
            blosc.decompress(payload, out.reshape(-1).view(np.uint8))
            self._verify(index, out)
            return
        decoded = _scratch("chunk", self.chunk_bytes)
        blosc.decompress(payload, decoded)
        rows = decoded.view(self.dtype).reshape(self.chunk_tokens, *self.row_shape)
        self._verify(index, rows)
        out[...] = rows[a - base : b - base]

    def _where(self, path: Path) -> str:
        return f"{self.name} chunk {path.relative_to(self.directory).as_posix()} ({path})"

    def _check_size(self, path: Path, size: int, expected: int) -> None:
        if size != expected:
            raise CacheFormatError(
                f"{self._where(path)} holds {size} bytes, expected {expected}; the chunk is "
                "truncated or damaged: run `hscache verify` on the cache"
            )

    def _check_crc(self, path: Path, computed: int, stored: bytes) -> None:
        if computed != int.from_bytes(stored, "little"):
            raise CacheFormatError(
                f"{self._where(path)} fails its crc32c check (stored {stored.hex()}, computed "
                f"{computed.to_bytes(4, 'little').hex()}); the chunk is damaged: run `hscache verify` on the cache"
            )

    def _check_frame(self, path: Path, payload: np.ndarray) -> None:
        if payload.nbytes < _BLOSC_HEADER:
            raise CacheFormatError(
                f"{self._where(path)} is too short for a blosc frame; the chunk is damaged"
            )
        header = payload[:_BLOSC_HEADER].tobytes()
        nbytes, cbytes = int.from_bytes(header[4:8], "little"), int.from_bytes(header[12:16], "little")
        if nbytes != self.chunk_bytes or cbytes != payload.nbytes:
            raise CacheFormatError(
                f"{self._where(path)} decodes to {nbytes} bytes in a {cbytes}-byte frame, "
                f"expected {self.chunk_bytes} in {payload.nbytes}; the chunk is damaged"
            )


def _readinto_crc(fd: int, target: np.ndarray, path: Path) -> int:
    """Fill ``target`` from the start of ``fd``; return the crc32c of what was read.

    Pieces of 1 MiB are checksummed right after their read, while still in cache: one pass over
    memory instead of two.
    """
    view, done, crc = memoryview(target), 0, 0
    while done < target.nbytes:
        n = os.preadv(fd, [view[done : done + _CRC_PIECE]], done)
        if n == 0:
            raise CacheFormatError(
                f"{path} ended after {done} of {target.nbytes} bytes; the chunk is truncated"
            )
        crc = google_crc32c.extend(crc, target[done : done + n])
        done += n
    return crc


def _pread_exact(fd: int, n: int, offset: int, path: Path) -> bytes:
    data = os.pread(fd, n, offset)
    if len(data) != n:
        raise CacheFormatError(f"{path} ended before its crc32c; the chunk is truncated")
    return data


def chunk_reader(array: Any) -> ChunkReader | None:
    """A ``ChunkReader`` for the zarr array ``array`` when its chunks can be read directly, else None
    (not a local store, unknown codecs, chunked along a row dimension, big-endian host)."""
    from zarr.storage import LocalStore

    store = getattr(array, "store", None)
    if sys.byteorder != "little" or not isinstance(store, LocalStore):
        return None
    meta = array.metadata.to_dict()
    if meta.get("zarr_format") != 3 or meta.get("storage_transformers"):
        return None
    grid, keys = meta.get("chunk_grid") or {}, meta.get("chunk_key_encoding") or {}
    chunk_shape = tuple((grid.get("configuration") or {}).get("chunk_shape") or ())
    shape = tuple(meta["shape"])
    separator = (keys.get("configuration") or {}).get("separator", "/")
    if (
        grid.get("name") != "regular"
        or keys.get("name") != "default"
        or separator != "/"
        or len(chunk_shape) != len(shape)
        or not shape
        or chunk_shape[1:] != shape[1:]
    ):
        return None
    dtype = np.dtype(array.dtype)
    if dtype.kind not in "fiu":
        return None
    compressed = _known_chain(list(meta.get("codecs") or []), dtype.itemsize)
    if compressed is None:
        return None
    directory = Path(str(store.root)) / array.path
    return ChunkReader(
        directory,
        array.path.rsplit("/", 1)[-1],
        int(shape[0]),
        int(chunk_shape[0]),
        tuple(int(s) for s in shape[1:]),
        dtype.newbyteorder("<"),
        compressed,
        meta.get("fill_value") or 0,
    )
