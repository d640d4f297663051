"""The quick verify's chunk check: every stored chunk file's crc32c, without decoding it.

Every chunk hscache writes ends in the crc32c of the bytes before it (layout.codecs_for: the last
codec), so a flipped or lost byte in any array shows without decompressing anything: one read of
each file, checksummed at memory speed (google_crc32c). The scan decodes hidden_states and
token_ids (and checks their rows' sha256) anyway; this covers every other array, whose chunks
(with codec ``none``, the top-k ones) can be the largest files. ``--deep`` also decodes every
chunk and checks the sha256 of every array's rows (scan.deep_decode).
"""

from __future__ import annotations

from typing import Any

import google_crc32c

from hscache.progress import NO_PROGRESS
from hscache.store.fsio import open_regular
from hscache.store.layout import ARRAYS_GROUP, chunk_key
from hscache.verify.report import Problem, VerifyReport
from hscache.verify.structure import CacheLayout, sequences_in

__all__ = ["check_chunk_crcs"]

_PIECE = 1 << 22  # bytes read and checksummed at a time: memory stays bounded by it, not the chunk


def check_chunk_crcs(
    layout: CacheLayout, report: VerifyReport, tried: dict[tuple[str, int], bool], progress: Any = NO_PROGRESS
) -> None:
    """Check the crc32c of every stored chunk file the scan did not decode (``tried``); name the
    sequences of each bad one (a chunk past the committed tokens is a warning: resume rewrites it).
    A remote cache's chunks are decoded through zarr instead, which checks the same crc32c."""
    todo = [
        (name, chunk)
        for name in layout.arrays
        for chunk in sorted(layout.stored_chunks(name))
        if (name, chunk) not in tried
    ]
    progress.start(len(todo), label="verify chunks", unit="chunks")
    for name, chunk in todo:
        progress.advance(1)
        error = _remote_error(layout, name, chunk) if layout.url else _crc_error(layout, name, chunk)
        if error is not None:
            _report(layout, report, name, chunk, error)
    report.passed("chunks")


def _crc_error(layout: CacheLayout, name: str, chunk: int) -> str | None:
    path = layout.root / ARRAYS_GROUP / name / chunk_key(layout.specs[name], chunk)
    try:
        with open_regular(path) as f:
            size = path.stat().st_size
            if size < 4:
                return f"holds {size} bytes, too few for its crc32c (truncated)"
            crc, left = 0, size - 4
            while left:
                piece = f.read(min(_PIECE, left))
                if not piece:
                    return "ended early (truncated)"
                crc = google_crc32c.extend(crc, piece)
                left -= len(piece)
            stored = f.read(4)
    except OSError as exc:
        return f"cannot be read ({exc.strerror or exc})"
    if crc != int.from_bytes(stored, "little"):
        return (
            f"fails its crc32c check (stored {stored.hex()}, computed {crc.to_bytes(4, 'little').hex()}): "
            "a byte changed or was lost after it was written"
        )
    return None


def _remote_error(layout: CacheLayout, name: str, chunk: int) -> str | None:
    step = layout.specs[name].chunk_tokens
    array = layout.arrays[name]
    try:
        array[chunk * step : min((chunk + 1) * step, array.shape[0])]
    except Exception as exc:  # zarr raises ValueError for a bad checksum, codec errors for truncation
        return f"does not decode ({exc})"
    return None


def _report(layout: CacheLayout, report: VerifyReport, name: str, chunk: int, error: str) -> None:
    step = layout.specs[name].chunk_tokens
    start = chunk * step
    seqs = sequences_in(layout, start, min(start + step, layout.committed_tokens))
    if start >= layout.committed_tokens or not seqs:
        message = f"{name} chunk {chunk} past the committed tokens {error}; it holds no committed data"
        report.add(Problem("chunks", message, array=name, chunk=chunk), warning=True)
        return
    for seq in seqs:
        report.add(layout.problem("chunks", f"{name} chunk {chunk} {error}", seq, array=name, chunk=chunk))
