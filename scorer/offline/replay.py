"""Exact offline replay of the greedy speculative-decoding round loop (spec section 3).

The round loop over a cached sequence; what a round accepts is the one-hot rule's
(scorer/rules/onehot_chain.py: ``chain_depth``, ``slot_matches``; ``RoundLog`` is defined there and
re-exported here).

Data model, for one cached sequence of length T with prompt length P:
    token_ids x [T], target_argmax a [T]: a[t] is the target's greedy prediction for t+1,
    so the target's greedy token at position p+j is g_{p+j} = a[p+j-1].
    The drafter runs once per anchor p in [P, T-2]; row r of its outputs is anchor p = P + r.

The round loop (identical for a chain and a tree, e.g. DFlash's DDTree in
scorer/families/dflash/ddtree.py; only the per-round match count differs):

    p = P                      # x_P, the first generated token, is the first bonus token
    while p < T - 1:
        avail = T - 1 - p      # positions left after the anchor
        acc   = matched drafted tokens, at most avail (stop at the sequence end), and
                stopping BEFORE the first position p+j where the data leaves the greedy
                path (x[p+j] != g_{p+j}): the cache has no features past that point
        tokens = min(acc + 1, avail)   # acc drafted + 1 bonus; the bonus is dropped
                                       # when acc already reaches position T-1
        p += tokens

So the rounds of a sequence always commit exactly T-1-P tokens. A round is "cut short by
off-greedy data" when the draft DID match g_{p+j} at the first off-greedy position p+j: the
online loop would have accepted it and gone on, so the offline count is a lower bound there.
When the draft missed at that position the round ends there anyway and nothing is lost.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from scorer.rules.onehot_chain import (
    RoundLog,
    chain_depth,
    check_anchor_rows,
    check_sequence,
    leading_matches,
    slot_matches,
)

__all__ = [
    "RoundLog",
    "RoundLoop",
    "chain_depth",
    "check_anchor_rows",
    "check_sequence",
    "replay_chain",
    "replay_walk",
    "round_loop",
    "slot_matches",
]


def _next_off_greedy(x: np.ndarray, a: np.ndarray) -> np.ndarray:
    # nxt[t] = smallest t' >= t with x[t'] != a[t'-1] (data leaves the greedy path), T if none.
    n = len(x)
    off = np.zeros(n + 1, dtype=bool)
    off[1:n] = x[1:] != a[:-1]
    idx = np.where(off, np.arange(n + 1), n)
    return np.minimum.accumulate(idx[::-1])[::-1]


class RoundLoop:
    """The round loop of the module docstring, one round at a time, so that a caller can
    draft lazily: ``p`` is the anchor of the next round, ``step(matched)`` commits it.

    Several loops over one sequence (the chain and each DDTree budget) can advance in
    lockstep, drafting only the anchors some loop visits (``scorer eval --anchors chain``).
    """

    def __init__(self, x: np.ndarray, a: np.ndarray, prompt_len: int) -> None:
        self._x, self._a, self._n, self._prompt_len = x, a, len(x), prompt_len
        self._nxt = _next_off_greedy(x, a)
        self.p = prompt_len
        self._rounds: tuple[list, ...] = ([], [], [], [], [])

    @property
    def done(self) -> bool:
        return self.p >= self._n - 1

    @property
    def avail(self) -> int:
        """Positions left after the current anchor."""
        return self._n - 1 - self.p

    def step(self, walked: int) -> None:
        """Commit the round at ``p`` given the match depth the draft reached, ignoring data."""
        p, avail = self.p, self.avail
        matched = min(walked, avail)
        first_off = int(self._nxt[p + 1]) - p  # depth j of the first off-greedy position (> avail if none)
        acc = min(matched, first_off - 1)
        tokens = min(acc + 1, avail)
        for column, value in zip(self._rounds, (p, acc, tokens, first_off <= matched, acc == avail)):
            column.append(value)
        self.p += tokens

    def log(self) -> RoundLog:
        x, a, n, prompt_len = self._x, self._a, self._n, self._prompt_len
        off_count = int(np.count_nonzero(x[prompt_len + 1 :] != a[prompt_len : n - 1]))
        return RoundLog(prompt_len, n, *(tuple(c) for c in self._rounds), off_count)


def round_loop(token_ids: Any, target_argmax: Any, prompt_len: int) -> RoundLoop:
    """A checked ``RoundLoop`` over one cached sequence."""
    return RoundLoop(*check_sequence(token_ids, target_argmax, prompt_len), prompt_len)


def replay_walk(walk: Callable[[int, int], int], x: np.ndarray, a: np.ndarray, prompt_len: int) -> RoundLog:
    """Run the round loop; ``walk(p, avail)`` gives the match depth at anchor p, ignoring data."""
    loop = RoundLoop(x, a, prompt_len)
    while not loop.done:
        loop.step(walk(loop.p, loop.avail))
    return loop.log()


def replay_chain(
    draft: Any, token_ids: Any, target_argmax: Any, prompt_len: int, block_size: int
) -> RoundLog:
    """Replay the chain (plain DFlash) round loop over one cached sequence.

    Args:
        draft: [A, B-1] argmax draft tokens, A = T-1-P anchors (row r is anchor P + r).
        token_ids: [T] token ids x.
        target_argmax: [T] target argmax a.
        prompt_len: P.
        block_size: B; ``draft`` must have B-1 columns.

    Returns:
        The RoundLog; acc is the count of leading slots with draft_j == g_{p+j}, see the
        module docstring for the sequence-end and off-greedy rules.

    Raises:
        ValueError: on mismatched shapes.
    """
    match, _ = slot_matches(draft, token_ids, target_argmax, prompt_len)
    if match.shape[1] != block_size - 1:
        raise ValueError(
            f"draft has {match.shape[1]} slot columns; block_size {block_size} needs {block_size - 1}"
        )
    x, a = check_sequence(token_ids, target_argmax, prompt_len)
    lead = leading_matches(match).tolist()  # the one-hot chain rule: leading correct slots per anchor
    return replay_walk(lambda p, avail: lead[p - prompt_len], x, a, prompt_len)
