"""Token-position buckets' starts checked without torch: ``hscache diff --position-buckets`` refuses a bad
list before the comparison imports anything heavy (hscache/diff/stats.py buckets the positions)."""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["MAX_POSITION", "check_bucket_starts"]

# A token position fits the index's int32 lengths: a start past it names no token (and one past
# int64 overflowed in torch.tensor, issue 52).
MAX_POSITION = 2**31 - 1


def check_bucket_starts(starts: Sequence[int]) -> None:
    """Position bucket starts begin at 0, increase strictly and stay within ``MAX_POSITION``.

    Raises:
        ValueError: otherwise (one line, naming the rule).
    """
    if not starts or starts[0] != 0 or any(b <= a for a, b in zip(starts, starts[1:])):
        raise ValueError(
            f"position bucket starts must begin at 0 and increase strictly, got {list(starts)[:12]}"
        )
    if starts[-1] > MAX_POSITION:
        raise ValueError(
            f"position bucket start {starts[-1]} is past the longest possible sequence ({MAX_POSITION} tokens)"
        )
