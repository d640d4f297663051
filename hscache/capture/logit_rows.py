"""How many rows of a ``[rows, vocab]`` logits product are computed at once (extract and scorer).

Light on purpose (no transformers): the scorer's replay imports it without loading a target.
"""

from __future__ import annotations

from collections.abc import Iterator

__all__ = ["BYTES_PER_LOGIT", "DEFAULT_MEMORY_GB", "head_rows", "row_chunks"]

DEFAULT_MEMORY_GB = 2.0  # --memory-gb: the [rows, V] logits working set of extract and scorer
# Bytes held per logit while a row chunk is live: the logits in the run dtype (<= 4), their
# float32 copy (4) and the float32 temporary of logsumexp / log_softmax (4).
BYTES_PER_LOGIT = 12


# Row chunks are whole multiples of this: CPU GEMM kernels compute a row the same way in any
# chunk of >= 48 rows, but not in chunks of 1-3 rows (measured, see row_chunks).
_ROW_QUANTUM = 48


def head_rows(vocab_size: int, memory_gb: float, bytes_per_logit: int = BYTES_PER_LOGIT) -> int:
    """Rows projected onto the vocabulary at once so that ``[rows, V]`` temporaries fit ``memory_gb``.

    A whole multiple of 48, at least 48: 624 rows at V = 248,320 and 2 GB.
    """
    if memory_gb <= 0:
        raise ValueError(f"memory budget {memory_gb} GB must be positive")
    rows = int(memory_gb * 1e9) // (int(vocab_size) * bytes_per_logit)
    return max(_ROW_QUANTUM, rows // _ROW_QUANTUM * _ROW_QUANTUM)


def row_chunks(n: int, rows: int) -> Iterator[tuple[int, int, int]]:
    """``(start, stop, first_new)`` chunks covering ``n`` rows, each exactly ``rows`` long when n > rows.

    The last chunk is shifted back to overlap its predecessor (only rows from ``first_new`` on
    are new) instead of being a ragged tail: CPU GEMM computes a row of a 1-3 row product with
    other kernels than inside a large one, so a ragged tail would change low bits with the
    budget. This way every row's logits are bit-identical for any budget (tested).
    """
    start = 0
    while start < n:
        stop = min(start + rows, n)
        yield max(0, stop - rows), stop, start
        start = stop
