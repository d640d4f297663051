"""Data checks, streamed chunk by chunk: memory stays bounded by one chunk, not the cache size.

Quick scan: token-id hashes against the index, and per cached layer NaN/Inf counts, exact
zeros, and per-token L2 norm statistics with robust outliers. Deep: decode every stored chunk
of every array (crc32c catches flipped bits, the compressor and crc32c catch truncation) and
map each bad chunk to the sequences whose tokens it holds.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from hscache.progress import NO_PROGRESS
from hscache.store.compact import SCALE_ARRAY, dequantise_numpy
from hscache.store.integrity import chunk_sha256_of, rows_sha256
from hscache.store.layout import SAMPLED_ARRAYS
from hscache.verify.report import LayerStats, Problem, VerifyReport
from hscache.verify.structure import CacheLayout, sequences_in

__all__ = ["as_float32", "hashed_by_scan", "deep_decode", "robust_outliers", "scan_sequences"]

# A sequence's mean token norm is an outlier when its robust z-score (median/MAD) exceeds this.
OUTLIER_Z = 6.0
# ... and only with enough sequences for a median/MAD to mean anything (7 is too few: the MAD of
# near-identical prompts is tiny), and only when the deviation is large in itself: real damage
# (zeroed layers, a wrong layer, overflow) moves the norm by far more than this fraction.
_MIN_SEQUENCES_FOR_OUTLIERS = 10
OUTLIER_MIN_RELATIVE = 0.25


def hashed_by_scan(manifest: dict[str, Any]) -> tuple[str, ...]:
    """The arrays whose rows' sha256 the quick scan checks: a compact cache's scales with its states."""
    return (
        ("token_ids", "hidden_states", SCALE_ARRAY)
        if "states" in manifest
        else ("token_ids", "hidden_states")
    )


def as_float32(raw: np.ndarray, logical_dtype: str) -> np.ndarray:
    """Stored rows as float32 (bfloat16 is stored as raw uint16 bits, see store/layout.py)."""
    if logical_dtype == "bfloat16":
        return (raw.astype(np.uint32) << 16).view(np.float32)
    return raw.astype(np.float32, copy=False)


@dataclass
class _Accumulators:
    """Per-sequence [S, K] and per-layer [K] running sums of the quick scan."""

    num_sequences: int
    num_layers: int
    nan: np.ndarray = field(init=False)
    inf: np.ndarray = field(init=False)
    zero_rows: np.ndarray = field(init=False)
    norm_sum: np.ndarray = field(init=False)
    finite_rows: np.ndarray = field(init=False)
    zeros: np.ndarray = field(init=False)
    elements: np.ndarray = field(init=False)
    norm_sq_sum: np.ndarray = field(init=False)  # [S, K]
    unreadable: set[int] = field(default_factory=set)  # sequences with a chunk that failed to decode
    tried: dict[tuple[str, int], bool] = field(default_factory=dict)  # (array, chunk) -> decoded fine
    reported: set[tuple[str, int, int]] = field(default_factory=set)  # (array, chunk, sequence) named

    def __post_init__(self) -> None:
        shape = (self.num_sequences, self.num_layers)
        self.nan, self.inf, self.zero_rows = (np.zeros(shape, np.int64) for _ in range(3))
        self.norm_sum, self.norm_sq_sum = np.zeros(shape), np.zeros(shape)
        self.finite_rows = np.zeros(shape, np.int64)
        self.zeros, self.elements = np.zeros(self.num_layers, np.int64), np.zeros(self.num_layers, np.int64)

    def add_block(self, x: np.ndarray, seq_of_row: np.ndarray) -> None:
        """Fold hidden rows ``x`` [n, K, H] float32 whose sequences are ``seq_of_row`` [n]."""
        finite = np.isfinite(x).all(axis=2)  # [n, K]
        clean = np.where(finite[..., None], x, 0.0).astype(np.float64)  # float64: no overflow in squares
        norms = np.sqrt(np.einsum("nkh,nkh->nk", clean, clean))
        zero = (x == 0).sum(axis=2)  # [n, K]
        per_row = {
            "nan": np.isnan(x).sum(axis=2),
            "inf": np.isinf(x).sum(axis=2),
            "zero_rows": zero == x.shape[2],
            "norm_sum": norms,
            "norm_sq_sum": norms**2,
            "finite_rows": finite,
        }
        for name, values in per_row.items():
            np.add.at(getattr(self, name), seq_of_row, values)
        self.zeros += zero.sum(axis=0)
        self.elements += x.shape[0] * x.shape[2]


class _ChunkHashes:
    """Checks rows of one array, fed in order, against its recorded per-chunk sha256 (any block size)."""

    def __init__(self, layout: CacheLayout, report: VerifyReport, name: str):
        self.layout, self.report, self.name = layout, report, name
        self.expected = chunk_sha256_of(layout.manifest, name)
        self.step = layout.specs[name].chunk_tokens
        self.chunk, self.hasher = -1, hashlib.sha256()  # type: ignore[var-annotated]

    def feed(self, start: int, rows: np.ndarray | None) -> None:
        """Rows from token ``start`` on, within one chunk of this array (the scan's blocks are
        hidden_states chunks; every other array's chunks are whole multiples of them: powers of two
        of at least as many tokens). None: unreadable, named by the chunks check already."""
        if self.expected is None:
            return
        chunk = start // self.step
        if chunk != self.chunk:
            self.finish()
            self.chunk, self.hasher = chunk, hashlib.sha256()
        if rows is None:
            self.hasher = None
        elif self.hasher is not None:
            committed = rows[: max(0, self.layout.committed_tokens - start)]
            self.hasher.update(np.ascontiguousarray(committed).tobytes())

    def finish(self) -> None:
        if self.chunk < 0 or self.hasher is None:
            return
        chunk, got = self.chunk, self.hasher.hexdigest()
        self.chunk = -1
        if chunk >= len(self.expected) or got != self.expected[chunk]:
            check_chunk_hash(self.layout, self.report, self.name, chunk, ok=False)


def check_chunk_hash(layout: CacheLayout, report: VerifyReport, name: str, chunk: int, ok: bool) -> None:
    """Name the sequences of a chunk whose committed rows do not match their recorded sha256."""
    if ok:
        return
    step = layout.specs[name].chunk_tokens
    message = (
        f"{name} chunk {chunk} does not match its sha256 recorded at commit (its crc32c is valid: the chunk "
        "was rewritten after it was written)"
    )
    seqs = sequences_in(layout, chunk * step, min((chunk + 1) * step, layout.committed_tokens))
    if not seqs:
        report.add(Problem("chunks", message, array=name, chunk=chunk))
    for seq in seqs:
        report.add(layout.problem("chunks", message, seq, array=name, chunk=chunk))


def scan_sequences(
    layout: CacheLayout, report: VerifyReport, progress: Any = NO_PROGRESS
) -> dict[tuple[str, int], bool]:
    """Run the quick data checks over every committed sequence; return the chunks it decoded
    (``(array, chunk) -> True``) or failed to decode (``False``).

    Sequences whose chunks fail to decode are named by a "chunks" problem and left out of the
    statistics (their numbers cannot be trusted). Skipped when the index is unusable or
    inconsistent: tokens could not be attributed to sequences.
    """
    if layout.index is None or report.checks["index"] == "failed":
        return {}
    if not {"hidden_states", "token_ids"} <= set(layout.arrays):
        return {}
    spec = layout.specs["hidden_states"]
    acc = _Accumulators(len(layout.offsets), len(report.layer_ids))
    hashers: dict[int, Any] = {}
    ends = layout.offsets + layout.lengths
    chunk_hashes = {name: _ChunkHashes(layout, report, name) for name in hashed_by_scan(layout.manifest)}
    progress.start(layout.committed_tokens, label="verify", unit="tokens")
    for start in range(0, layout.committed_tokens, spec.chunk_tokens):
        stop = min(start + spec.chunk_tokens, layout.committed_tokens)
        progress.advance(stop - start)
        seq_of_row = np.searchsorted(ends, np.arange(start, stop), side="right")
        ids = _read(layout, report, "token_ids", start, stop, acc)
        block = _read(layout, report, "hidden_states", start, stop, acc)
        chunk_hashes["token_ids"].feed(start, ids)
        chunk_hashes["hidden_states"].feed(start, block)
        if block is not None and "states" in layout.manifest:  # fp8 states: statistics of what readers get
            scales = _read(layout, report, SCALE_ARRAY, start, stop, acc)
            chunk_hashes[SCALE_ARRAY].feed(start, scales)
            if scales is not None:
                acc.add_block(dequantise_numpy(block, scales), seq_of_row)
        elif block is not None:
            acc.add_block(as_float32(block, spec.logical_dtype), seq_of_row)
        if ids is not None:
            # seq_of_row is sorted: split the block at sequence boundaries.
            cuts = np.flatnonzero(np.diff(seq_of_row)) + 1
            for seq, piece in zip(seq_of_row[np.r_[0, cuts]], np.split(ids, cuts)):
                hashers.setdefault(int(seq), hashlib.sha256()).update(piece.astype("<i4").tobytes())
    for hashes in chunk_hashes.values():
        hashes.finish()
    _check_hashes(layout, report, hashers, acc.unreadable)
    _report_layers(layout, report, acc)
    return acc.tried


def _read(
    layout: CacheLayout, report: VerifyReport, name: str, start: int, stop: int, acc: _Accumulators
) -> np.ndarray | None:
    """Rows ``[start, stop)`` of array ``name`` (within one chunk), or None and a problem per sequence."""
    chunk = start // layout.specs[name].chunk_tokens
    try:
        unsafe = layout.chunk_problem(name, chunk)
        if unsafe is not None:
            raise ValueError(unsafe)  # never handed to zarr: it would block on a FIFO, follow the link
        rows = np.asarray(layout.arrays[name][start:stop])
    except Exception as exc:  # zarr raises ValueError for a bad checksum, codec errors for truncation
        for seq in sequences_in(layout, start, stop):
            if (name, chunk, seq) not in acc.reported:  # a sequence may span two blocks of one chunk
                acc.reported.add((name, chunk, seq))
                report.add(
                    layout.problem(
                        "chunks",
                        f"{name} chunk {chunk} does not decode ({exc})",
                        seq,
                        array=name,
                        chunk=chunk,
                    )
                )
            acc.unreadable.add(seq)
        acc.tried[(name, chunk)] = False
        return None
    acc.tried[(name, chunk)] = True
    return rows


def _check_hashes(layout: CacheLayout, report: VerifyReport, hashers: dict, unreadable: set[int]) -> None:
    expected = layout.index.column("token_sha256")  # per row: never the whole index as Python objects
    for seq, hasher in sorted(hashers.items()):
        if seq not in unreadable and hasher.hexdigest() != expected[seq].as_py():
            report.add(
                layout.problem(
                    "token_hash", "token ids do not match the index's token_sha256", seq, array="token_ids"
                )
            )
    report.passed("token_hash")


def _report_layers(layout: CacheLayout, report: VerifyReport, acc: _Accumulators) -> None:
    trusted = np.ones(acc.num_sequences, bool)
    trusted[list(acc.unreadable)] = False
    for k, layer_id in enumerate(report.layer_ids):
        for seq in np.flatnonzero(trusted & ((acc.nan[:, k] > 0) | (acc.inf[:, k] > 0))):
            report.add(
                layout.problem(
                    "nonfinite",
                    f"layer {layer_id} holds {acc.nan[seq, k]} NaN and {acc.inf[seq, k]} Inf values",
                    int(seq),
                    array="hidden_states",
                    layer_id=layer_id,
                )
            )
        for seq in np.flatnonzero(trusted & (acc.zero_rows[:, k] > 0)):
            report.add(
                layout.problem(
                    "zeros",
                    f"layer {layer_id}: {acc.zero_rows[seq, k]} of "
                    f"{layout.lengths[seq]} tokens are all exact zeros (unwritten or "
                    "zeroed states)",
                    int(seq),
                    array="hidden_states",
                    layer_id=layer_id,
                )
            )
        report.layers.append(_layer_stats(layout, report, acc, k, layer_id, trusted))
    for check in ("nonfinite", "zeros", "norms"):
        report.passed(check)


def _layer_stats(
    layout: CacheLayout, report: VerifyReport, acc: _Accumulators, k: int, layer_id: int, trusted: np.ndarray
) -> LayerStats:
    rows = int(acc.finite_rows[trusted, k].sum())
    mean = float(acc.norm_sum[trusted, k].sum() / rows) if rows else None
    std = float(np.sqrt(max(0.0, acc.norm_sq_sum[trusted, k].sum() / rows - mean**2))) if rows else None
    outliers = robust_outliers(acc.norm_sum[:, k], acc.finite_rows[:, k], trusted)
    for seq in outliers:
        report.add(
            layout.problem(
                "norms",
                f"layer {layer_id}: mean token norm "
                f"{acc.norm_sum[seq, k] / max(1, acc.finite_rows[seq, k]):.4g} is an outlier "
                f"(layer mean {mean:.4g}; robust z > {OUTLIER_Z} and over {OUTLIER_MIN_RELATIVE:.0%} "
                "from the median)",
                seq,
                array="hidden_states",
                layer_id=layer_id,
            ),
            warning=True,
        )
    return LayerStats(
        layer_id,
        int(acc.nan[:, k].sum()),
        int(acc.inf[:, k].sum()),
        float(acc.zeros[k] / max(1, acc.elements[k])),
        int(acc.zero_rows[:, k].sum()),
        mean,
        std,
        outliers,
    )


def robust_outliers(norm_sum: np.ndarray, rows: np.ndarray, trusted: np.ndarray) -> list[int]:
    """Sequences whose mean norm is > OUTLIER_Z robust standard deviations (1.4826 * MAD) and more
    than OUTLIER_MIN_RELATIVE of the median away from the median."""
    usable = trusted & (rows > 0)
    if usable.sum() < _MIN_SEQUENCES_FOR_OUTLIERS:
        return []
    means = np.where(usable, norm_sum / np.maximum(rows, 1), np.nan)
    median = np.nanmedian(means)
    mad = np.nanmedian(np.abs(means - median)) * 1.4826
    if not mad > 0:
        return []
    deviation = np.abs(means - median)
    far = (deviation > OUTLIER_Z * mad) & (deviation > OUTLIER_MIN_RELATIVE * abs(median))
    return [int(s) for s in np.flatnonzero(usable & far)]


def deep_decode(
    layout: CacheLayout, report: VerifyReport, tried: dict[tuple[str, int], bool], progress: Any = NO_PROGRESS
) -> None:
    """Decode every stored chunk of every array (those the scan ``tried`` are not re-read).

    A bad chunk that holds committed tokens is a problem for each of its sequences; one past
    the committed tokens (padding, or rows a killed run wrote) is a warning: resume rewrites it.
    Float arrays other than hidden_states are also checked for NaN/Inf per sequence.
    """
    chunks = {name: len(layout.stored_chunks(name)) for name in layout.arrays}
    progress.start(sum(chunks.values()), label="verify --deep", unit="chunks")
    for name, array in layout.arrays.items():
        spec = layout.specs[name]
        expected = chunk_sha256_of(layout.manifest, name)
        # The chunk files that exist (listed once), never every index a zarr.json's shape allows.
        for chunk in sorted(layout.stored_chunks(name)):
            progress.advance(1)
            if (name, chunk) in tried:
                continue  # missing committed chunks were reported by the files check
            start = chunk * spec.chunk_tokens
            stop = min(start + spec.chunk_tokens, array.shape[0])
            if start >= stop:
                continue  # a stray file past the array's rows: no reader ever reads it
            try:
                unsafe = layout.chunk_problem(name, chunk)
                if unsafe is not None:
                    raise ValueError(unsafe)  # see _read
                rows = np.asarray(array[start:stop])
            except Exception as exc:  # see _read
                _bad_chunk(layout, report, name, chunk, start, stop, exc)
                continue
            report.chunks_decoded += 1
            committed = max(0, min(len(rows), layout.committed_tokens - start))
            if expected is not None and committed:
                ok = chunk < len(expected) and rows_sha256(rows[:committed]) == expected[chunk]
                check_chunk_hash(layout, report, name, chunk, ok)
            # sampled_token_prob is NaN by design where no token was drawn (verify/sampled.py checks it).
            if rows.dtype.kind == "f" and name not in ("hidden_states", SAMPLED_ARRAYS[2]):
                _nonfinite_rows(layout, report, name, start, rows)
    report.chunks_decoded += sum(tried.values())
    report.passed("chunks")


def _bad_chunk(
    layout: CacheLayout, report: VerifyReport, name: str, chunk: int, start: int, stop: int, exc: Exception
) -> None:
    seqs = sequences_in(layout, start, min(stop, layout.committed_tokens))
    if start >= layout.committed_tokens or not seqs:
        report.add(
            Problem(
                "chunks",
                f"{name} chunk {chunk} past the committed tokens does not decode ({exc}); "
                "it holds no committed data",
                array=name,
                chunk=chunk,
            ),
            warning=True,
        )
        return
    for seq in seqs:
        report.add(
            layout.problem(
                "chunks", f"{name} chunk {chunk} does not decode ({exc})", seq, array=name, chunk=chunk
            )
        )


def _nonfinite_rows(
    layout: CacheLayout, report: VerifyReport, name: str, start: int, rows: np.ndarray
) -> None:
    n = max(0, min(len(rows), layout.committed_tokens - start))
    bad = np.flatnonzero(~np.isfinite(rows[:n].reshape(n, -1)).all(axis=1))
    if not len(bad) or layout.index is None:
        return
    seq_of_row = np.searchsorted(layout.offsets + layout.lengths, start + bad, side="right")
    for seq, count in zip(*np.unique(seq_of_row, return_counts=True)):
        report.add(
            layout.problem(
                "nonfinite",
                f"{name} holds {count} non-finite rows in chunk {start // layout.specs[name].chunk_tokens}",
                int(seq),
                array=name,
            )
        )
