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
chunk key encoding, a big-endian host): the caller then reads through zarr. A missing chunk file
under committed tokens is refused (zarr would silently read the fill value).

Integrity at memory speed: every chunk file's crc32c, and the sha256 of its committed rows that the
manifest records (store/integrity.py: a consistent rewrite with a valid crc32c), are checked the
first time this process reads it (``VERIFIED``, keyed by the file's identity: device, inode, size,
mtime and ctime, and the digest it matched), and logged for later processes (store/verified_log.py).
Later reads of the same unchanged file skip both and are one copy (or, for ``view``, none). Any
rewrite changes the identity (zarr and hscache replace files by rename: a new inode; an in-place edit
moves mtime/ctime), so a rewritten chunk is checked again before it is served. docs/storage.md
measures what this saves and says what it does not cover (a disk that changes bytes under an
unchanged file: ``hscache verify`` reads every chunk afresh).
"""

from __future__ import annotations

import hashlib
import mmap
import os
import stat
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
from hscache.store.verified_log import append_entries, log_path, read_entries, record_dir

__all__ = ["VERIFIED", "ChunkReader", "VerifiedChunks", "chunk_reader"]

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

_VERIFIED_LIMIT = 1 << 20  # file identities remembered (~100 B each); past it the record starts over


class VerifiedChunks:
    """The chunk files whose content this process has checked, by identity (see the module
    docstring): their crc32c, and the sha256 of their committed rows where the manifest records one
    (store/integrity.py), remembered with the digest it matched. Sha256-checked files are also
    appended to the user's verification log (store/verified_log.py), which ``load`` reads once per
    array directory, so a new process (a DataLoader worker, the next run) trusts a chunk this user
    verified before for as long as the file is exactly the one that was checked.

    Safe across threads; inherited by a forked child (the files it vouches for are the same files).
    """

    def __init__(self, limit: int = _VERIFIED_LIMIT):
        self._seen: dict[tuple[int, int], tuple[tuple[int, int, int], str | None]] = {}
        self._lock = threading.Lock()
        self._limit = limit
        self._loaded: set[Path] = set()  # array directories whose log this process has read
        self._load_lock = threading.Lock()

    def load(self, array_dir: Path) -> None:
        """Read the verification log of ``array_dir`` (once per process and directory). Reader
        threads call this together: the others wait until the entries are in, or they would check
        chunks that the log vouches for."""
        if array_dir in self._loaded:
            return
        with self._load_lock:
            if array_dir in self._loaded:
                return
            records = record_dir()
            entries = list(read_entries(log_path(records, array_dir))) if records is not None else []
            with self._lock:
                for _rel, key, state, sha in entries[-self._limit // 2 :]:
                    self._seen[key] = (state, sha)
                self._loaded.add(array_dir)

    @staticmethod
    def _identity(st: os.stat_result) -> tuple[tuple[int, int], tuple[int, int, int]]:
        return (st.st_dev, st.st_ino), (st.st_size, st.st_mtime_ns, st.st_ctime_ns)

    def holds(self, st: os.stat_result, sha256: str | None = None) -> bool:
        """Whether the file ``st`` describes was checked in this process and has not changed since
        (and, when ``sha256`` is given, its committed rows matched that digest)."""
        key, state = self._identity(st)
        seen = self._seen.get(key)
        return seen is not None and seen[0] == state and (sha256 is None or seen[1] == sha256)

    def add(
        self, st: os.stat_result, sha256: str | None = None, array_dir: Path | None = None, chunk: str = ""
    ) -> None:
        """Remember that the file ``st`` describes was checked (against ``sha256`` when given); with a
        digest and ``array_dir`` (``chunk``: the file's path inside it), log it for later processes."""
        key, state = self._identity(st)
        with self._lock:
            if len(self._seen) >= self._limit:
                self._seen.clear()
            self._seen[key] = (state, sha256)
        records = record_dir() if sha256 is not None and array_dir is not None else None
        if records is not None:
            append_entries(log_path(records, array_dir), [(chunk, key, state, sha256)])

    def clear(self) -> None:
        """Forget every check made or read in this process (the logs stay): the next read of each
        chunk checks it again, unless its array's log vouches for it."""
        with self._lock:
            self._seen.clear()
            self._loaded.clear()


# This process's record: one per process, because what it records (a file's bytes were checked)
# holds for every reader of that file in the process.
VERIFIED = VerifiedChunks()

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
        self._real_dir: str | None = None  # the directory with symlinks resolved, on first open

    def expect_sha256(self, chunk_sha256: list[str] | None, committed_tokens: int) -> None:
        """Check each chunk's committed rows against ``chunk_sha256`` (store/integrity.py) on first
        touch, with its crc32c: a chunk rewritten with other content and a valid crc32c is refused."""
        self._expected_sha256, self._committed = chunk_sha256, committed_tokens

    def _expected(self, index: int) -> str | None:
        """The sha256 chunk ``index``'s committed rows must have (None: nothing recorded to check)."""
        if self._expected_sha256 is None or self._committed <= index * self.chunk_tokens:
            return None
        # A chunk under committed tokens with no recorded digest cannot match: refused, never skipped.
        return self._expected_sha256[index] if index < len(self._expected_sha256) else "missing"

    def _committed_rows(self, index: int) -> int:
        """Rows of chunk ``index`` under the committed tokens (what its sha256 covers)."""
        return max(0, min(self.chunk_tokens, self._committed - index * self.chunk_tokens))

    def _committed_bytes(self, index: int) -> int:
        return self._committed_rows(index) * (self.chunk_bytes // self.chunk_tokens)

    def _verify(self, index: int, rows: np.ndarray) -> None:
        """``rows``: the whole decoded chunk ``index``; refuse it unless its committed rows match."""
        expected = self._expected(index)
        if expected is None:
            return
        if rows_sha256(rows[: self._committed_rows(index)]) != expected:
            raise CacheFormatError(
                f"{self._where(self.chunk_path(index))} does not match its sha256 recorded at commit (its "
                "crc32c is valid: the chunk was rewritten); the cache was changed after it was written: "
                "run `hscache verify` on it, then re-extract"
            )

    def _chunk_key(self, index: int) -> str:
        return f"c/{index}/{self._key_tail}" if self._key_tail else f"c/{index}"

    def chunk_path(self, index: int) -> Path:
        return self.directory / self._chunk_key(index)

    def read(self, start: int, stop: int, out: np.ndarray | None = None) -> np.ndarray:
        """Rows ``[start, stop)`` (clamped to the array, as a slice is); chunks in parallel.

        ``out``: a C-contiguous array of the rows' shape and stored dtype to read into (e.g. a
        view of a pinned or shared-memory tensor): each chunk's rows are copied there once.

        Raises:
            CacheFormatError: a chunk fails its crc32c check or does not decode (named in the message).
            ValueError: ``out`` has the wrong shape, dtype or layout.
        """
        start, stop = max(0, start), min(stop, self.length)
        shape = (max(0, stop - start), *self.row_shape)
        if out is None:
            out = np.empty(shape, self.dtype)
        elif out.shape != shape or out.dtype != self.dtype or not out.flags.c_contiguous:
            raise ValueError(
                f"{self.name}: out is {out.shape} {out.dtype}, need C-contiguous {shape} {self.dtype}"
            )
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

    def iter_blocks(
        self, start: int = 0, stop: int | None = None, copy: bool = True
    ) -> Iterator[tuple[int, np.ndarray]]:
        """``(first row, rows)`` per chunk of ``[start, stop)`` in order, the next chunks decoding
        in the background while the caller works on this one (memory: a few chunks).

        ``copy=False`` on an uncompressed array: each block is a read-only view of the mapped chunk
        file (no copy; checked on first touch like every read), valid for as long as it is referenced.
        """
        stop = self.length if stop is None else min(stop, self.length)
        if not copy and not self.compressed:
            yield from self._iter_views(max(0, start), stop)
            return
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

    def _iter_views(self, start: int, stop: int) -> Iterator[tuple[int, np.ndarray]]:
        pieces = list(self._pieces(start, stop))
        for index, _, _ in pieces[:_PREFETCH_FILES]:
            self._prefetch(index)
        for k, (index, a, b) in enumerate(pieces):
            if k + _PREFETCH_FILES < len(pieces):
                self._prefetch(pieces[k + _PREFETCH_FILES][0])
            base = index * self.chunk_tokens
            yield a, self.view(index)[a - base : b - base]

    def view(self, index: int) -> np.ndarray:
        """Chunk ``index`` of an uncompressed array as a read-only view of its mapped file, all
        ``chunk_tokens`` rows (an edge chunk's padding too); its crc32c is checked on first touch.

        Raises:
            CacheFormatError: as ``read``.
            ValueError: the array is compressed (a compressed chunk must be decoded: use ``read``).
        """
        if self.compressed:
            raise ValueError(f"{self.name} is compressed: its chunks cannot be viewed, only read")
        path = self.chunk_path(index)
        fd = self._open(path)
        try:
            st = os.fstat(fd)
            self._check_size(path, st.st_size, self.chunk_bytes + 4)
            mapped = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
        finally:
            os.close(fd)
        payload = np.frombuffer(mapped, np.uint8, count=self.chunk_bytes)
        rows = payload.view(self.dtype).reshape(self.chunk_tokens, *self.row_shape)
        expected = self._expected(index)
        VERIFIED.load(self.directory)
        if not VERIFIED.holds(st, expected):
            crc, sha = 0, hashlib.sha256() if expected is not None else None
            sha_bytes = self._committed_bytes(index)
            for k in range(0, self.chunk_bytes, _CRC_PIECE):  # both while each piece is in cache
                crc = google_crc32c.extend(crc, payload[k : k + _CRC_PIECE])
                if sha is not None and k < sha_bytes:
                    sha.update(payload[k : min(k + _CRC_PIECE, sha_bytes)])
            self._check_crc(path, crc, mapped[self.chunk_bytes :])
            if sha is not None and sha.hexdigest() != expected:
                self._verify(index, rows)  # raises, naming the rewrite
            VERIFIED.add(st, expected, self.directory, self._chunk_key(index))
        return rows

    def _open(self, path: Path) -> int:
        """The chunk file, opened for reading: refused unless it is a regular file reached without
        leaving the array's directory (a symlinked chunk or chunk folder is not the cache's data,
        and a FIFO would block the read forever; issue 36)."""
        if self._real_dir is None:
            self._real_dir = os.path.realpath(self.directory)
        if os.path.realpath(path) != os.path.join(self._real_dir, os.path.relpath(path, self.directory)):
            raise CacheFormatError(
                f"{self._where(path)} is a symlink (or lies in a symlinked folder) that leads outside the cache; "
                "hscache never writes links: run `hscache verify` on the cache, then re-extract"
            )
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
        except FileNotFoundError:
            # The writer writes every chunk (empty ones too) before a commit publishes its tokens,
            # so a missing chunk under committed tokens is damage: zeros would be wrong data.
            raise CacheFormatError(
                f"{self._where(path)} is missing; the cache is damaged: run `hscache verify` "
                "and re-extract the sequences it names"
            ) from None
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise CacheFormatError(
                f"{self._where(path)} is not a regular file (a FIFO, device or directory); the cache is damaged: "
                "run `hscache verify` on it, then re-extract"
            )
        os.set_blocking(fd, True)
        return fd

    def _prefetch(self, index: int) -> None:
        """Ask the kernel to read chunk ``index``'s file in the background (no-op when cached or missing).

        Reading many chunk files one after another waits on each file's readahead windows in
        turn: half a raw memmap's cold speed. Queuing whole files ahead keeps the disk busy.
        """
        try:
            fd = os.open(self.chunk_path(index), os.O_RDONLY | os.O_NONBLOCK)  # a FIFO must not block
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
        if not whole and not self.compressed and self._read_verified_rows(index, a, b, out):
            return
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

    def _read_verified_rows(self, index: int, a: int, b: int, out: np.ndarray) -> bool:
        """Rows ``[a, b)`` of an uncompressed chunk read straight into ``out`` (only their bytes) when
        this process has verified the file and it is unchanged; False (nothing read) otherwise: the
        first read of a chunk reads all of it, because its crc32c covers all of it."""
        path = self.chunk_path(index)
        fd = self._open(path)
        try:
            st = os.fstat(fd)
            VERIFIED.load(self.directory)
            if st.st_size != self.chunk_bytes + 4 or not VERIFIED.holds(st, self._expected(index)):
                return False
            row_bytes = self.chunk_bytes // self.chunk_tokens
            target = memoryview(out.reshape(-1).view(np.uint8))
            offset, done = (a - index * self.chunk_tokens) * row_bytes, 0
            while done < target.nbytes:
                n = os.preadv(fd, [target[done:]], offset + done)
                if n == 0:
                    raise CacheFormatError(f"{path} ended early; the chunk is truncated")
                done += n
            return True
        finally:
            os.close(fd)

    def _decode(self, index: int, a: int, b: int, out: np.ndarray) -> None:
        """Read, check and decode chunk ``index``; rows ``[a, b)`` of it into ``out``."""
        path = self.chunk_path(index)
        base = index * self.chunk_tokens
        whole = a == base and b - a == self.chunk_tokens
        fd = self._open(path)
        try:
            st = os.fstat(fd)
            size = st.st_size
            if size < 4:
                self._check_size(
                    path, size, self.chunk_bytes + 4 if not self.compressed else _BLOSC_HEADER + 4
                )
            if not self.compressed and whole:
                payload = out.reshape(-1).view(np.uint8)  # read the payload straight into the result
                self._check_size(path, size, self.chunk_bytes + 4)
            else:
                payload = _scratch("file", size - 4)
            expected = self._expected(index)
            VERIFIED.load(self.directory)
            checked = VERIFIED.holds(st, expected)
            if checked:  # verified earlier in this process and unchanged since: one copy, no hashing
                _readinto_crc(fd, payload, path, crc=False)
            elif not self.compressed and expected is not None:
                # The file's crc32c and its committed rows' sha256 in the same pass, each 1 MiB piece
                # hashed while still in cache (a second pass over the chunk cost ~40% of a cold read).
                self._check_size(path, size, self.chunk_bytes + 4)
                stored = _pread_exact(fd, 4, size - 4, path)
                crc, digest = _readinto_crc(fd, payload, path, sha_bytes=self._committed_bytes(index))
                self._check_crc(path, crc, stored)
                if digest != expected:
                    self._verify(index, payload.view(self.dtype).reshape(self.chunk_tokens, *self.row_shape))
                checked = True
                VERIFIED.add(st, expected, self.directory, self._chunk_key(index))
            else:
                stored = _pread_exact(fd, 4, size - 4, path)
                self._check_crc(path, _readinto_crc(fd, payload, path)[0], stored)
        finally:
            os.close(fd)
        if not self.compressed:
            if whole:
                rows = out
            else:
                self._check_size(path, payload.nbytes, self.chunk_bytes)
                rows = payload.view(self.dtype).reshape(self.chunk_tokens, *self.row_shape)
        else:
            self._check_frame(path, payload)
            if whole:
                blosc.decompress(payload, out.reshape(-1).view(np.uint8))
                rows = out
            else:
                decoded = _scratch("chunk", self.chunk_bytes)
                blosc.decompress(payload, decoded)
                rows = decoded.view(self.dtype).reshape(self.chunk_tokens, *self.row_shape)
        if not checked:  # the crc32c held; now the content: then the file is vouched for
            self._verify(index, rows)
            VERIFIED.add(st, expected, self.directory, self._chunk_key(index))
        if not whole:
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


def _readinto_crc(
    fd: int, target: np.ndarray, path: Path, crc: bool = True, sha_bytes: int = 0
) -> tuple[int, str | None]:
    """Fill ``target`` from the start of ``fd``; return the crc32c of what was read (0 if not ``crc``)
    and the sha256 of its first ``sha_bytes`` bytes (None if 0).

    Pieces of 1 MiB are checksummed right after their read, while still in cache: one pass over
    memory instead of two. Without a checksum, one read of the whole file.
    """
    view, done, value = memoryview(target), 0, 0
    sha = hashlib.sha256() if sha_bytes else None
    piece = _CRC_PIECE if (crc or sha) else target.nbytes
    while done < target.nbytes:
        n = os.preadv(fd, [view[done : done + piece]], done)
        if n == 0:
            raise CacheFormatError(
                f"{path} ended after {done} of {target.nbytes} bytes; the chunk is truncated"
            )
        if crc:
            value = google_crc32c.extend(value, target[done : done + n])
        if sha is not None and done < sha_bytes:
            sha.update(view[done : min(done + n, sha_bytes)])
        done += n
    return value, None if sha is None else sha.hexdigest()


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
