"""Verification rules at temperature > 0, scored exactly from a SAMPLED cache (spec/sampling.md 4).

Data model, for one cached sequence of length T with prompt length P, sampled at the served
settings (the cache holds y = token_ids and, per generated position t, log p(y_t | y_<t)):
    anchors a in [P, T-2]; row r of a per-anchor array is anchor a = P + r (A = T-1-P rows);
    slot j = 1..K of the round at anchor a drafts position a+j; it exists while a+j <= T-1.

Given y, every rule makes a slot continue with a known probability alpha[a, j] (spec 4.1):
- one-hot (every engine's default: draft argmax, accept w.p. p(x), residual p without x):
  alpha = 1{y_{a+j} == the drafter's argmax, drafted along y}; rounds are deterministic and the
  existing greedy replay (scorer/offline/replay.py) counts them exactly when it matches against
  ``sampled_match_targets(y)`` instead of the target's argmax;
- deterministic trees (SGLang target-only, EAGLE repo): alpha = 1{y_{a+j} in the children of the
  node reached along y}: the tree walks of families/dflash/ddtree.py and families/autoregressive.py, fed
  ``sampled_match_targets(y)``;
- probabilistic (vLLM draft_sample_method=probabilistic, SGLang --speculative-use-rejection-
  sampling, DFlash2 on vLLM MRV2): alpha = min(1, q_{a,j}(y_{a+j}) / p(y_{a+j})), q the drafter's
  temperature-only proposal; ``slot_acceptance`` builds it from an [A, K] array of log q.

``sequence_rounds`` then gives E[rounds | y] (the DP of spec 4.4, with the round loop's sequence
end: a round at anchor a commits min(acc + 1, T-1-a) tokens) and the served-round acceptance
profile (spec 4.7): the expectation over the anchors where rounds START, not over all anchors.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from scorer.rules.onehot_chain import RoundLog

if TYPE_CHECKING:  # torch is imported where a function needs it: the replay path stays numpy-only
    import torch

__all__ = [
    "SequenceRounds",
    "all_anchor_acceptance",
    "depth_acceptance",
    "draft_log_q",
    "onehot_acceptance",
    "probabilistic_rounds",
    "rounds_from_log",
    "sampled_match_targets",
    "sequence_rounds",
    "slot_acceptance",
    "slot_tokens",
    "target_to_draft_index",
]


def _int_array(name: str, value: Any, ndim: int) -> np.ndarray:
    if hasattr(value, "detach"):
        value = value.detach().cpu().numpy()
    arr = np.asarray(value)
    if arr.ndim != ndim or not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"{name} must be a {ndim}-D integer array, got shape {arr.shape} {arr.dtype}")
    return arr.astype(np.int64, copy=False)


def _float_array(name: str, value: Any, ndim: int) -> np.ndarray:
    if hasattr(value, "detach"):
        value = value.detach().cpu().double().numpy()
    arr = np.asarray(value, dtype=np.float64)
    if arr.ndim != ndim:
        raise ValueError(f"{name} must be a {ndim}-D float array, got shape {arr.shape}")
    return arr


def _check_anchor_rows(name: str, rows: int, seq_len: int, prompt_len: int) -> None:
    if not 1 <= prompt_len <= seq_len:
        raise ValueError(f"prompt_len {prompt_len} out of range for a sequence of length {seq_len}")
    expected = max(seq_len - 1 - prompt_len, 0)
    if rows != expected:
        raise ValueError(
            f"{name} has {rows} anchor rows but a sequence of length {seq_len} with prompt_len "
            f"{prompt_len} has {expected} anchors; give one row per anchor a in [P, T-2]"
        )


def _slot_positions(n_anchors: int, k: int, prompt_len: int) -> np.ndarray:
    # pos[r, j-1] = a + j with a = P + r: the position slot j of the round at anchor a drafts.
    return prompt_len + np.arange(n_anchors)[:, None] + np.arange(1, k + 1)[None, :]


# ---------------------------------------------------------------- one-hot and tree rules


def sampled_match_targets(token_ids: Any) -> np.ndarray:
    """What the greedy replay matches against on a sampled trajectory: a'[t] = y[t+1].

    scorer/offline/replay.py reads ``target_argmax[t]`` as the token the target commits at t+1. On a
    sampled cache that token is the realised y[t+1] (spec 4.4: the one-hot rule accepts draft x iff
    the target's own sample equals x), so passing a' as ``target_argmax`` to ``replay_chain``,
    ``replay_trees``, ``replay_ddtree``, ``RoundLoop``, ``slot_matches``, ``tree_depths`` or
    ``greedy_walk`` scores the one-hot rule exactly, and the data never leaves that path: no round is
    cut off-greedy. a'[T-1] (the token after the sequence) is never compared; it repeats y[T-1] so
    that every entry is a valid token id.

    Args:
        token_ids: [T] the sampled trajectory y.

    Returns:
        int64 [T].
    """
    y = _int_array("token_ids", token_ids, 1)
    if len(y) == 0:
        raise ValueError("token_ids is empty; a sequence needs at least its prompt")
    return np.concatenate([y[1:], y[-1:]])


def slot_tokens(token_ids: Any, prompt_len: int, k: int) -> np.ndarray:
    """[A, K] int64: y_{a+j} for anchor row r (a = P + r) and slot j; -1 past the sequence end.

    The tokens at which a family evaluates log q_{a,j} (``draft_log_q``) or compares its drafts.
    """
    y = _int_array("token_ids", token_ids, 1)
    n = max(len(y) - 1 - prompt_len, 0)
    _check_anchor_rows("token_ids", n, len(y), prompt_len)
    pos = _slot_positions(n, k, prompt_len)
    return np.where(pos <= len(y) - 1, y[np.minimum(pos, len(y) - 1)], -1)


def onehot_acceptance(draft: Any, token_ids: Any, prompt_len: int) -> np.ndarray:
    """alpha [A, K] of the one-hot rule: 1.0 where draft[r, j-1] == y_{a+j}, 0.0 otherwise.

    ``draft`` holds the drafter's argmax at every anchor and slot, drafted along y (on the matched
    prefix the drafted tokens ARE y). Slots past the sequence end are 0.
    """
    d = _int_array("draft", draft, 2)
    y = _int_array("token_ids", token_ids, 1)
    _check_anchor_rows("draft", d.shape[0], len(y), prompt_len)
    return (d == slot_tokens(y, prompt_len, d.shape[1])).astype(np.float64)


def depth_acceptance(depths: Any, k: int) -> np.ndarray:
    """alpha [A, K] of a deterministic tree: slot j continues iff the walk along y reached depth j.

    Args:
        depths: [A] nodes the walk matched per anchor (e.g. ``len(walk_tree(tree, a'[a:a+avail]))``
            or ``tree_depths(..., target_argmax=sampled_match_targets(y))``).
        k: the tree's depth, the K of the [A, K] result.
    """
    d = _int_array("depths", depths, 1)
    if d.size and (d.min() < 0 or d.max() > k):
        raise ValueError(f"depths must lie in 0..{k} (the tree depth), got {d.min()}..{d.max()}")
    return (np.arange(1, k + 1)[None, :] <= d[:, None]).astype(np.float64)


# ---------------------------------------------------------------- probabilistic rule


def target_to_draft_index(draft_to_target: Any, target_vocab: int) -> torch.Tensor:
    """Invert a reduced draft vocabulary (EAGLE-3 d2t as target ids): [V_target] -> draft column, -1 outside.

    Args:
        draft_to_target: [Vd] the target token id of each draft column.
        target_vocab: V of the target.
    """
    import torch

    d2t = torch.as_tensor(draft_to_target, dtype=torch.long).reshape(-1)
    if d2t.numel() and (int(d2t.min()) < 0 or int(d2t.max()) >= target_vocab):
        raise ValueError(f"draft_to_target holds ids outside the target vocabulary 0..{target_vocab - 1}")
    inverse = torch.full((target_vocab,), -1, dtype=torch.long)
    inverse[d2t] = torch.arange(len(d2t))
    return inverse


def draft_log_q(
    logits: torch.Tensor,
    columns: torch.Tensor,
    temperature: float,
    *,
    chunk_rows: int = 256,
) -> torch.Tensor:
    """log q(token) = log softmax(logits / T) at one column per row, over the drafter's WHOLE vocabulary.

    vLLM and SGLang draft from the temperature-only proposal (no top-k/top-p/penalties; spec 1.1,
    4.2), so that is the q of the probabilistic rule. Rows go through a float32 copy in chunks of
    ``chunk_rows``: memory is chunk_rows x Vd x 4 bytes whatever the number of rows, and a family
    feeds [A x K] flattened rows of head logits without ever holding [A, K, V].

    Args:
        logits: [N, Vd] draft head logits (any float dtype, any device).
        columns: [N] the draft column of the token to evaluate (``target_to_draft_index`` of y for a
            reduced vocabulary); -1 (outside the draft vocabulary) gives log q = -inf.
        temperature: T > 0.
        chunk_rows: rows per float32 chunk.

    Returns:
        float32 [N] on the logits' device.
    """
    import torch

    if temperature <= 0:
        raise ValueError(f"temperature {temperature} must be > 0 (at T = 0 use the one-hot rule)")
    if logits.ndim != 2 or columns.shape != logits.shape[:1]:
        raise ValueError(
            f"logits {tuple(logits.shape)} must be [N, Vd] and columns {tuple(columns.shape)} [N]"
        )
    cols = columns.to(logits.device, torch.long)
    if cols.numel() and int(cols.max()) >= logits.shape[1]:
        raise ValueError(
            f"columns hold ids >= the draft vocabulary {logits.shape[1]}; map them to draft columns"
        )
    out = torch.empty(len(cols), dtype=torch.float32, device=logits.device)
    step = max(1, chunk_rows)
    with torch.no_grad():
        for lo in range(0, len(cols), step):
            rows = logits[lo : lo + step].float() / temperature
            c = cols[lo : lo + step]
            picked = rows.gather(1, c.clamp(min=0)[:, None])[:, 0]
            out[lo : lo + len(c)] = torch.where(c >= 0, picked - torch.logsumexp(rows, dim=1), -torch.inf)
    return out


def slot_acceptance(log_q: Any, target_logp: Any, prompt_len: int) -> np.ndarray:
    """alpha [A, K] of the probabilistic rule: min(1, q_{a,j}(y_{a+j}) / p(y_{a+j} | y_<a+j)).

    Args:
        log_q: [A, K] log q_{a,j}(y_{a+j}), q the drafter's proposal for slot j at anchor a with the
            drafted prefix set to y (``draft_log_q``; DFlash2's selector walk gives it directly).
            -inf where y_{a+j} is outside the proposal's support. Entries past the sequence end
            are ignored.
        target_logp: [T] log p(y_t | y_<t) of the served (processed) p at every position; entries at
            t <= P are ignored.
        prompt_len: P.

    Returns:
        float64 [A, K] in [0, 1]; 0 past the sequence end.

    Raises:
        ValueError: on mismatched shapes, a NaN, or a realised token with p = 0 (a trajectory not
            sampled from the stored p).
    """
    lq = _float_array("log_q", log_q, 2)
    lp = _float_array("target_logp", target_logp, 1)
    _check_anchor_rows("log_q", lq.shape[0], len(lp), prompt_len)
    gen = lp[prompt_len + 1 :]
    if np.isnan(gen).any() or np.isneginf(gen).any() or (gen > 1e-6).any():
        raise ValueError(
            "target_logp must be finite log-probabilities <= 0 at every generated position: a "
            "realised token with p = 0 means the trajectory was not sampled from the stored p"
        )
    pos = _slot_positions(lq.shape[0], lq.shape[1], prompt_len)
    valid = pos <= len(lp) - 1
    if np.isnan(lq[valid]).any():
        raise ValueError("log_q holds NaN inside the sequence; pass -inf for tokens outside q's support")
    ratio = np.where(valid, lq - lp[np.minimum(pos, len(lp) - 1)], -np.inf)
    return np.exp(np.minimum(ratio, 0.0))


# ---------------------------------------------------------------- the round process given y


@dataclass(frozen=True)
class SequenceRounds:
    """The rounds of one sampled sequence under one rule, as sums that add across sequences.

    Attributes:
        tokens: tokens the rounds commit, T-1-P (the first generated token comes from prefill).
        expected_rounds: E[rounds | y] (the round count itself under a deterministic rule).
        served_accepted: per slot i = 1..K, E[#rounds with acc >= i | y]; acc is capped at the
            sequence end as in ``RoundLog.accepted``.
    """

    tokens: int
    expected_rounds: float
    served_accepted: tuple[float, ...]

    @property
    def expected_accepted(self) -> float:
        """E[sum of acc over the rounds | y] = sum_i E[#rounds with acc >= i]."""
        return float(sum(self.served_accepted))

    def to_dict(self) -> dict[str, Any]:
        return {
            "tokens": self.tokens,
            "expected_rounds": self.expected_rounds,
            "served_accepted": list(self.served_accepted),
        }


def _round_outcomes(alpha: np.ndarray, prompt_len: int, seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    """(P(acc = n) [A, K+1] for n = 0..K, w(i) [A, K] for i = 1..K) of the round at every anchor.

    acc = min(N, avail) with P(N >= n) = w(n) = prod_{j<=n} alpha_j (w(0) = 1, w(K+1) = 0); slots past
    the sequence end never run (spec 4.4; replay.RoundLoop caps acc there), so w is 0 beyond avail.
    """
    n_anchor, k = alpha.shape
    valid = _slot_positions(n_anchor, k, prompt_len) <= seq_len - 1
    w = np.cumprod(np.where(valid, alpha, 0.0), axis=1)
    survive = np.concatenate([np.ones((n_anchor, 1)), w], axis=1)  # w(0..K)
    return survive - np.concatenate([w, np.zeros((n_anchor, 1))], axis=1), w


def sequence_rounds(alpha: Any, prompt_len: int, seq_len: int) -> SequenceRounds:
    """E[rounds | y] and the served acceptance profile, exactly (spec 4.4 and 4.7).

    A forward DP over round starts: s[P] = 1 and s[b] = sum_a s[a] P(the round at a ends at b);
    a round at anchor a with acc = n commits min(n + 1, T-1-a) tokens, so it moves to
    min(a + n + 1, T-1), and T-1 ends the sequence. Then E[R | y] = sum_a s[a] and
    E[#rounds with acc >= i | y] = sum_a s[a] w_a(i). With 0/1 alphas (one-hot, trees) s is the
    indicator of the anchors the deterministic round loop visits, so this reproduces the replay.
    Cost O(A K), a Python loop over anchors with K + 1 scalar updates each.

    Args:
        alpha: [A, K] slot continuation probabilities (``slot_acceptance``, ``onehot_acceptance``,
            ``depth_acceptance``), A = T-1-P.
        prompt_len: P.
        seq_len: T.

    Returns:
        SequenceRounds.
    """
    al = _float_array("alpha", alpha, 2)
    _check_anchor_rows("alpha", al.shape[0], seq_len, prompt_len)
    if np.isnan(al).any() or (al < 0).any() or (al > 1).any():
        raise ValueError("alpha must hold probabilities in [0, 1]")
    probs, w = _round_outcomes(al, prompt_len, seq_len)
    end = seq_len - 1
    start = [0.0] * (seq_len + 1)
    start[prompt_len] = 1.0
    for r, row in enumerate(probs.tolist()):
        a = prompt_len + r
        s = start[a]
        if s == 0.0:
            continue
        for n, pn in enumerate(row):
            if pn:
                start[min(a + n + 1, end)] += s * pn
    reach = np.asarray(start[prompt_len:end], dtype=np.float64)  # P(a round starts at anchor a | y)
    return SequenceRounds(
        tokens=max(end - prompt_len, 0),
        expected_rounds=float(reach.sum()),
        served_accepted=tuple(float(v) for v in reach @ w),
    )


def probabilistic_rounds(
    draft: np.ndarray, log_q: np.ndarray, token_ids: np.ndarray, logp: np.ndarray, prompt_len: int
) -> tuple[SequenceRounds, np.ndarray]:
    """E[rounds | y] of the probabilistic rule and its alpha [A, K] (``slot_acceptance``)."""
    alpha = slot_acceptance(log_q, logp, prompt_len)
    return sequence_rounds(alpha, prompt_len, len(token_ids)), alpha


def rounds_from_log(log: RoundLog, k: int) -> SequenceRounds:
    """The deterministic rounds of a replay (one-hot rule, trees) as ``SequenceRounds``.

    For a replay run with ``sampled_match_targets``: its RoundLog has no off-greedy cuts, and its
    round count is E[R | y] exactly.
    """
    if log.n_cut_off_greedy:
        raise ValueError(
            f"the replay cut {log.n_cut_off_greedy} rounds off-greedy: score a sampled cache with "
            "target_argmax=sampled_match_targets(token_ids)"
        )
    acc = np.asarray(log.accepted, dtype=np.int64)
    served = tuple(float(np.count_nonzero(acc >= i)) for i in range(1, k + 1))
    return SequenceRounds(tokens=log.n_tokens, expected_rounds=float(log.n_rounds), served_accepted=served)


def all_anchor_acceptance(alpha: Any, prompt_len: int, seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    """The per-anchor diagnostic (spec 4.2): sums over ALL anchors of P(N_a >= i | y), and counts.

    Returns (sums [K], counts [K]): counts[i-1] is the number of anchors where slot i lies inside
    the sequence. Their ratio is NOT the served profile (spec 4.7: rounds start at a biased subset
    of anchors); it is what a training dashboard averages.
    """
    al = _float_array("alpha", alpha, 2)
    _check_anchor_rows("alpha", al.shape[0], seq_len, prompt_len)
    valid = _slot_positions(al.shape[0], al.shape[1], prompt_len) <= seq_len - 1
    survive = np.cumprod(np.where(valid, al, 0.0), axis=1)
    return survive.sum(axis=0), valid.sum(axis=0).astype(np.float64)
