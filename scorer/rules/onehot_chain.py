"""The one-hot chain rule (vLLM's default ``draft_sample_method=greedy``, SGLang's default, the z-lab
reference at T = 0): a round accepts the longest prefix of drafted tokens equal to the target's
committed tokens, plus one token from the target (the bonus, or the token at the first mismatch).

vLLM: ``vllm/v1/sample/rejection_sampler.py`` ``rejection_greedy_sample_kernel`` L726-L780 (vllm 0.32.0 as
installed in .vllm: ``rejected = draft_token_id != target_argmax_id`` L768, the target's token stored at
every slot up to the first rejection L764-L772, the bonus appended when none was rejected L774-L780);
SGLang: ``python/sglang/srt/speculative/eagle_info.py`` ``EagleVerifyInput.verify`` (commit 0007d13b;
spec/sampling.md 1.2) calls ``verify_tree_greedy`` for greedy requests, on a chain a tree of one child
per node (the tree walk: scorer/rules/onehot_tree.py). At T > 0 the same rule holds along the target's
SAMPLED tokens (spec/sampling.md 4.1 B, C; ``scorer.rules.expectation.sampled_match_targets``).

Pure functions over (drafts, the target's committed tokens): ``chain_depth`` (one round),
``slot_matches`` and ``leading_matches`` (every anchor at once), and ``RoundLog``, the record of a
sequence's rounds that the offline replay (scorer/offline/replay.py) writes and the metrics and the
expectation read. The round loop itself (where rounds start, the off-greedy cut of a cached
sequence) is the offline replay's.

Data model: token_ids x [T], target_argmax a [T] (a[t] is the target's token for t+1, so g_{p+j} =
a[p+j-1]); the drafter runs once per anchor p in [P, T-2]; row r of its outputs is anchor p = P + r.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = [
    "RoundLog",
    "as_int_array",
    "chain_depth",
    "check_anchor_rows",
    "check_sequence",
    "leading_matches",
    "n_anchors",
    "slot_matches",
]


@dataclass(frozen=True)
class RoundLog:
    """The rounds of one replayed sequence.

    Attributes:
        prompt_len: P.
        seq_len: T.
        anchors: anchor position p of each round.
        accepted: acc per round (matched drafted tokens that were committed).
        tokens: tokens committed per round, min(acc + 1, T-1-p); they sum to T-1-P.
        cut_off_greedy: per round, True when off-greedy data stopped a round whose draft
            still matched the target there (the offline count undercounts that round).
        hit_end: per round, True when acc reached position T-1 (the last round, cut).
        off_greedy_positions: generated positions t in [P+1, T-1] with x[t] != a[t-1].
    """

    prompt_len: int
    seq_len: int
    anchors: tuple[int, ...]
    accepted: tuple[int, ...]
    tokens: tuple[int, ...]
    cut_off_greedy: tuple[bool, ...]
    hit_end: tuple[bool, ...]
    off_greedy_positions: int

    @property
    def n_rounds(self) -> int:
        return len(self.tokens)

    @property
    def n_tokens(self) -> int:
        return sum(self.tokens)

    @property
    def n_cut_off_greedy(self) -> int:
        return sum(self.cut_off_greedy)

    @property
    def tau(self) -> float | None:
        """Mean tokens per round of this sequence, None when it has no rounds (T-1 <= P)."""
        return self.n_tokens / self.n_rounds if self.tokens else None

    def to_dict(self) -> dict[str, Any]:
        """Return per-round lists and the sequence summary as plain numbers."""
        return {
            "prompt_len": self.prompt_len,
            "seq_len": self.seq_len,
            "n_rounds": self.n_rounds,
            "n_tokens": self.n_tokens,
            "tau": self.tau,
            "n_cut_off_greedy": self.n_cut_off_greedy,
            "off_greedy_positions": self.off_greedy_positions,
            "anchors": list(self.anchors),
            "accepted": list(self.accepted),
            "tokens": list(self.tokens),
            "cut_off_greedy": list(self.cut_off_greedy),
            "hit_end": list(self.hit_end),
        }


def as_int_array(name: str, value: Any, ndim: int) -> np.ndarray:
    if hasattr(value, "detach"):  # torch tensor -> numpy without importing torch here
        value = value.detach().cpu().numpy()
    arr = np.asarray(value)
    if arr.ndim != ndim or not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"{name} must be a {ndim}-D integer array, got shape {arr.shape} {arr.dtype}")
    return arr.astype(np.int64, copy=False)


def check_sequence(token_ids: Any, target_argmax: Any, prompt_len: int) -> tuple[np.ndarray, np.ndarray]:
    x = as_int_array("token_ids", token_ids, 1)
    a = as_int_array("target_argmax", target_argmax, 1)
    if x.shape != a.shape:
        raise ValueError(f"token_ids has length {len(x)} but target_argmax has {len(a)}; they must match")
    if not 1 <= prompt_len <= len(x):
        raise ValueError(f"prompt_len {prompt_len} out of range for a sequence of length {len(x)}")
    return x, a


def n_anchors(seq_len: int, prompt_len: int) -> int:
    return max(seq_len - 1 - prompt_len, 0)  # anchors p in [P, T-2]


def check_anchor_rows(name: str, rows: int, seq_len: int, prompt_len: int) -> None:
    expected = n_anchors(seq_len, prompt_len)
    if rows != expected:
        raise ValueError(
            f"{name} has {rows} anchor rows but a sequence of length {seq_len} with prompt_len "
            f"{prompt_len} has {expected} anchors; run the drafter once per anchor p in [P, T-2]"
        )


def slot_matches(
    draft: Any, token_ids: Any, target_argmax: Any, prompt_len: int
) -> tuple[np.ndarray, np.ndarray]:
    """Compare every draft slot with the target's greedy token, over all anchors.

    Args:
        draft: [A, B-1] argmax draft tokens of slots 1..B-1; row r is anchor p = P + r.
        token_ids: [T] token ids x.
        target_argmax: [T] target argmax a (a[t] predicts position t+1).
        prompt_len: P.

    Returns:
        (match, valid), both bool [A, B-1]: valid[r, j-1] is p+j <= T-1 (the slot lies inside
        the sequence); match[r, j-1] is valid and draft_j == g_{p+j} = a[p+j-1].

    Raises:
        ValueError: on mismatched shapes or a wrong number of anchor rows.
    """
    x, a = check_sequence(token_ids, target_argmax, prompt_len)
    d = as_int_array("draft", draft, 2)
    check_anchor_rows("draft", d.shape[0], len(x), prompt_len)
    # pos[r, s] = p + j - 1 with p = P + r, j = s + 1: the index of a holding g_{p+j}.
    pos = prompt_len + np.arange(d.shape[0])[:, None] + np.arange(d.shape[1])[None, :]
    valid = pos <= len(x) - 2
    match = valid & (d == a[np.minimum(pos, len(x) - 1)])
    return match, valid


def chain_depth(draft_row: Any, target_argmax: np.ndarray, p: int) -> int:
    """Leading drafted slots of the block at anchor ``p`` equal to g_{p+j} = a[p+j-1]."""
    row = np.asarray(draft_row)
    g = target_argmax[p : p + len(row)]
    miss = np.flatnonzero(row[: len(g)] != g)
    return int(miss[0]) if len(miss) else len(g)


def leading_matches(match: np.ndarray) -> np.ndarray:
    """The one-hot chain rule at every anchor at once: per row of ``match`` (bool [A, K], e.g.
    ``slot_matches``'s), the count of leading True slots, int64 [A] (``chain_depth`` of each row)."""
    return np.cumprod(match, axis=1).sum(axis=1)
