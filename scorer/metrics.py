"""Pure metrics over replayed rounds and draft slots: tau, intervals, acceptance, diagnostics.

Numbers follow spec section 3:
- tau = tokens per round INCLUDING the bonus token. Two conventions, always labelled:
  ``tau_per_request`` (DFlash benchmark: mean over requests of each request's mean) and
  ``tau_pooled`` (vLLM / SGLang: total tokens / total rounds).
- ``train_accept_len``: the training-dashboard "accept length", the mean over ALL anchors
  of the count of leading correct slots, no +1. A different number from tau - 1.

Counts are returned as sums (numerator, denominator) so they add across sequences; ratios
with a zero denominator are reported as None, never as NaN or 0.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from scorer.rules.onehot_chain import RoundLog, leading_matches, slot_matches

__all__ = [
    "RoundsPerSeq", "request_totals", "tau_per_request", "tau_pooled", "tau_per_request_from_totals",
    "tau_pooled_from_totals", "bootstrap_ci", "DeltaCI", "paired_bootstrap_delta",
    "tokens_per_round_histogram", "AcceptanceCounts", "AcceptanceStats", "acceptance_counts",
    "acceptance_rates", "acceptance_per_position", "AcceptLen", "train_accept_len",
    "PipelineWarningThresholds", "pipeline_warnings", "CategoryTau", "per_category_tau",
    "acceptance_histogram", "round_tokens_from_accepted", "CONTEXT_LENGTH_EDGES", "ContextBucketTau",
    "tau_by_context_length",
]  # fmt: skip

RoundsPerSeq = Sequence[RoundLog | Sequence[int]]  # per request: a RoundLog or its tokens per round


# ---------------------------------------------------------------- tau (two conventions)


def _round_tokens(rounds: RoundLog | Sequence[int]) -> np.ndarray:
    return np.asarray(rounds.tokens if isinstance(rounds, RoundLog) else rounds, dtype=np.int64).reshape(-1)


def request_totals(rounds_per_seq: RoundsPerSeq) -> np.ndarray:
    """Return int64 [R, 2]: (total tokens, number of rounds) per request, the bootstrap unit."""
    rows = [(int(t.sum()), len(t)) for t in map(_round_tokens, rounds_per_seq)]
    return np.asarray(rows, dtype=np.int64).reshape(-1, 2)


def tau_per_request_from_totals(totals: np.ndarray) -> float:
    """DFlash convention on [R, 2] totals; requests with no rounds are skipped.

    Raises:
        ValueError: when no request has a round.
    """
    t = np.asarray(totals)
    keep = t[:, 1] > 0
    if not keep.any():
        raise ValueError("no request has a round; tau is undefined (every sequence has T-1 <= P)")
    return float(np.mean(t[keep, 0] / t[keep, 1]))


def tau_pooled_from_totals(totals: np.ndarray) -> float:
    """vLLM / SGLang convention on [R, 2] totals: sum of tokens / sum of rounds.

    Raises:
        ValueError: when there are no rounds at all.
    """
    t = np.asarray(totals)
    rounds = t[:, 1].sum()  # not int(): E[rounds | y] of the probabilistic rule is a real number
    if rounds == 0:
        raise ValueError("no request has a round; tau is undefined (every sequence has T-1 <= P)")
    return float(t[:, 0].sum() / rounds)


def tau_per_request(rounds_per_seq: RoundsPerSeq) -> float:
    """tau, DFlash benchmark convention: mean over requests of each request's tokens per round.

    Args:
        rounds_per_seq: per request, a RoundLog or its tokens per round. Requests without a
            round (T-1 <= P) are skipped.

    Returns:
        The mean over requests of (request tokens / request rounds).

    Raises:
        ValueError: when no request has a round.
    """
    return tau_per_request_from_totals(request_totals(rounds_per_seq))


def tau_pooled(rounds_per_seq: RoundsPerSeq) -> float:
    """tau, vLLM / SGLang convention: all tokens / all rounds, pooled over requests.

    Raises:
        ValueError: when there are no rounds at all.
    """
    return tau_pooled_from_totals(request_totals(rounds_per_seq))


# ---------------------------------------------------------------- bootstrap over requests


def _check_boot_input(values: np.ndarray, name: str) -> None:
    if values.shape[0] == 0:
        raise ValueError(f"{name} has no requests; a bootstrap needs at least one")
    if values.ndim == 2 and values.shape[1] == 2 and (values[:, 1] <= 0).any():
        raise ValueError(
            f"{name} holds requests with no rounds; drop them (in both caches when paired) first"
        )


def _resamples(n_requests: int, n_boot: int, seed: int) -> np.ndarray:
    # [n_boot, R] request indices drawn with replacement; the request is the unit of resampling.
    return np.random.default_rng(seed).integers(0, n_requests, size=(n_boot, n_requests))


def _resampled_stats(values: np.ndarray, stat: Callable[[np.ndarray], float], idx: np.ndarray) -> np.ndarray:
    """``stat`` on each resample ``values[i]``, ``i`` a row of ``idx`` (``_resamples``).

    Both taus (bootstrapped several times per eval, diagnose or compare report) are one vectorised
    pass over [R, 2] totals, the same floats as calling the stat once per resample: the pooled tau
    is per resample its summed tokens over its summed rounds, the sums ``tau_pooled_from_totals``
    takes; the per-request tau the mean of each request's tokens / rounds along the resample's row,
    numpy's pairwise sum over the same ratios in the same order that ``np.mean`` of the resample adds
    (tests/scorer/test_metrics.py compares them bit for bit). Requests with no rounds never get here
    (``_check_boot_input``). A 1000-resample loop was half of a small ``scorer eval``'s CPU time.
    """
    if values.ndim == 2 and values.shape[1] == 2:
        tokens, rounds = np.ascontiguousarray(values[:, 0]), np.ascontiguousarray(values[:, 1])
        if stat is tau_pooled_from_totals:
            return tokens[idx].sum(axis=1) / rounds[idx].sum(axis=1)
        if stat is tau_per_request_from_totals:
            return (tokens / rounds)[idx].mean(axis=1)
    return np.asarray([stat(values[i]) for i in idx], dtype=np.float64)


def _percentiles(stats: Any, level: float) -> tuple[float, float]:
    lo, hi = np.quantile(np.asarray(stats, dtype=np.float64), [(1 - level) / 2, (1 + level) / 2])
    return float(lo), float(hi)


def bootstrap_ci(
    per_request_values: Any,
    stat: Callable[[np.ndarray], float],
    n_boot: int = 1000,
    seed: int = 0,
    level: float = 0.95,
) -> tuple[float, float]:
    """Percentile bootstrap interval, resampling REQUESTS with replacement.

    Args:
        per_request_values: [R, ...] one row per request, e.g. ``request_totals(...)`` [R, 2]
            (tokens, rounds), or [R] per-request numbers.
        stat: maps a resampled [R, ...] array to a number, e.g. ``tau_pooled_from_totals``
            (recomputes the pooled ratio on each resample) or ``np.mean``.
        n_boot: bootstrap resamples.
        seed: numpy Generator seed; same seed, same interval.
        level: two-sided coverage, 0.95 gives the 2.5% and 97.5% percentiles.

    Returns:
        (lo, hi).

    Raises:
        ValueError: on no requests, or a [R, 2] totals array holding a request with no rounds.
    """
    values = np.asarray(per_request_values)
    _check_boot_input(values, "per_request_values")
    return _percentiles(_resampled_stats(values, stat, _resamples(len(values), n_boot, seed)), level)


@dataclass(frozen=True)
class DeltaCI:
    """stat(b) - stat(a) on the same requests, with a paired percentile bootstrap interval."""

    delta: float
    lo: float
    hi: float
    n_requests: int

    def to_dict(self) -> dict[str, Any]:
        return {"delta": self.delta, "lo": self.lo, "hi": self.hi, "n_requests": self.n_requests}


def paired_bootstrap_delta(
    a_totals: Any,
    b_totals: Any,
    stat: Callable[[np.ndarray], float] = tau_pooled_from_totals,
    n_boot: int = 1000,
    seed: int = 0,
    level: float = 0.95,
) -> DeltaCI:
    """Compare two caches scored by one drafter on the same requests (e.g. drift).

    The same resampled request indices are applied to both, so per-request difficulty
    cancels and the interval is much tighter than two independent intervals.

    Args:
        a_totals: [R, 2] (tokens, rounds) per request for cache A (``request_totals``).
        b_totals: [R, 2] for cache B, same requests in the same order.
        stat: e.g. ``tau_pooled_from_totals`` or ``tau_per_request_from_totals``.
        n_boot, seed, level: as ``bootstrap_ci``.

    Returns:
        DeltaCI with delta = stat(b) - stat(a).

    Raises:
        ValueError: when the request counts differ or a request has no rounds.
    """
    a, b = np.asarray(a_totals), np.asarray(b_totals)
    if a.shape != b.shape:
        raise ValueError(f"a_totals {a.shape} and b_totals {b.shape} must cover the same requests")
    _check_boot_input(a, "a_totals")
    _check_boot_input(b, "b_totals")
    idx = _resamples(len(a), n_boot, seed)  # the same requests for both
    lo, hi = _percentiles(_resampled_stats(b, stat, idx) - _resampled_stats(a, stat, idx), level)
    return DeltaCI(float(stat(b) - stat(a)), float(lo), float(hi), int(a.shape[0]))


def tokens_per_round_histogram(rounds_per_seq: RoundsPerSeq, block_size: int) -> list[int]:
    """Return counts of rounds yielding 1, 2, ..., B tokens (index i holds i+1 tokens).

    Raises:
        ValueError: when a round has fewer than 1 or more than B tokens.
    """
    counts = np.zeros(block_size + 1, dtype=np.int64)
    for tokens in map(_round_tokens, rounds_per_seq):
        if tokens.size and (tokens.min() < 1 or tokens.max() > block_size):
            got = f"{tokens.min()}..{tokens.max()}"
            raise ValueError(f"round token counts must lie in 1..{block_size}, got {got}")
        counts += np.bincount(tokens, minlength=block_size + 1)
    return counts[1:].tolist()


# ---------------------------------------------------------------- per-slot acceptance, all anchors


def _ratio(num: int, den: int) -> float | None:
    return num / den if den else None


@dataclass(frozen=True)
class AcceptanceCounts:
    """Per-slot sums over anchors, for slots j = 1..B-1 (index j-1); add with ``+``.

    A slot j is "in range" at anchor p when p+j <= T-1; "correct" is draft_j == g_{p+j}.
    - uncond_den[j-1]: anchors with slot j in range; uncond_num: of those, slot j correct.
    - cond_den[j-1]: anchors with slot j in range and slots 1..j-1 all correct;
      cond_num: of those, slot j correct too.
    """

    cond_num: tuple[int, ...]
    cond_den: tuple[int, ...]
    uncond_num: tuple[int, ...]
    uncond_den: tuple[int, ...]

    def __add__(self, other: AcceptanceCounts) -> AcceptanceCounts:
        if len(self.cond_num) != len(other.cond_num):
            raise ValueError(f"cannot add counts for {len(self.cond_num)} and {len(other.cond_num)} slots")
        add = lambda u, v: tuple(i + j for i, j in zip(u, v))
        return AcceptanceCounts(
            add(self.cond_num, other.cond_num), add(self.cond_den, other.cond_den),
            add(self.uncond_num, other.uncond_num), add(self.uncond_den, other.uncond_den),
        )  # fmt: skip

    def to_dict(self) -> dict[str, Any]:
        return {k: list(getattr(self, k)) for k in ("cond_num", "cond_den", "uncond_num", "uncond_den")}


@dataclass(frozen=True)
class AcceptanceStats:
    """Per-slot rates (index j-1 for slot j); None where the denominator is 0."""

    conditional: tuple[float | None, ...]
    unconditional: tuple[float | None, ...]
    counts: AcceptanceCounts

    def to_dict(self) -> dict[str, Any]:
        return {
            "conditional": list(self.conditional),
            "unconditional": list(self.unconditional),
            "counts": self.counts.to_dict(),
        }


def acceptance_counts(draft: Any, token_ids: Any, target_argmax: Any, prompt_len: int) -> AcceptanceCounts:
    """Sum per-slot acceptance over ALL anchors p in [P, T-2] of one sequence.

    Correctness is against the target's greedy token g_{p+j} = a[p+j-1] whatever the data
    holds (no off-greedy cut, unlike replay): this is the quantity training dashboards show.

    Args:
        draft: [A, B-1] draft tokens, row r is anchor P + r.
        token_ids, target_argmax: [T] each.
        prompt_len: P.

    Returns:
        AcceptanceCounts (see its docstring for the exact denominators).
    """
    match, valid = slot_matches(draft, token_ids, target_argmax, prompt_len)
    prefix_ok = np.ones_like(match)  # prefix_ok[:, j-1]: slots 1..j-1 all correct
    prefix_ok[:, 1:] = np.cumprod(match, axis=1)[:, :-1].astype(bool)
    cond_den = valid & prefix_ok
    as_tuple = lambda m: tuple(int(v) for v in m.sum(axis=0))
    return AcceptanceCounts(as_tuple(cond_den & match), as_tuple(cond_den), as_tuple(match), as_tuple(valid))


def acceptance_rates(counts: AcceptanceCounts) -> AcceptanceStats:
    """Finish summed counts into per-slot conditional and unconditional rates (None if 0/0)."""
    cond = tuple(_ratio(n, d) for n, d in zip(counts.cond_num, counts.cond_den))
    uncond = tuple(_ratio(n, d) for n, d in zip(counts.uncond_num, counts.uncond_den))
    return AcceptanceStats(cond, uncond, counts)


def acceptance_per_position(
    draft: Any, token_ids: Any, target_argmax: Any, prompt_len: int
) -> AcceptanceStats:
    """One sequence's per-slot acceptance; for many, sum ``acceptance_counts`` then rate them."""
    return acceptance_rates(acceptance_counts(draft, token_ids, target_argmax, prompt_len))


@dataclass(frozen=True)
class AcceptLen:
    """Training-log accept length as a sum: ``total`` leading-correct slots over ``n_anchors``."""

    total: int
    n_anchors: int

    @property
    def mean(self) -> float | None:
        return _ratio(self.total, self.n_anchors)

    def __add__(self, other: AcceptLen) -> AcceptLen:
        return AcceptLen(self.total + other.total, self.n_anchors + other.n_anchors)

    def to_dict(self) -> dict[str, Any]:
        return {"total": self.total, "n_anchors": self.n_anchors, "mean": self.mean}


def train_accept_len(draft: Any, token_ids: Any, target_argmax: Any, prompt_len: int) -> AcceptLen:
    """Training-log "accept length": leading correct slots per anchor, NO bonus +1, all anchors.

    Anchors near the end have fewer in-range slots, which caps their count (training
    usually samples full blocks only, so on short sequences this reads slightly lower).

    Returns:
        AcceptLen(total, n_anchors); add across sequences, then read ``.mean``.
    """
    match, _ = slot_matches(draft, token_ids, target_argmax, prompt_len)
    return AcceptLen(int(leading_matches(match).sum()), int(match.shape[0]))


# ---------------------------------------------------------------- diagnostics


@dataclass(frozen=True)
class PipelineWarningThresholds:
    """Thresholds of ``pipeline_warnings``; the defaults are deliberately loose (warn on clear signals).

    Attributes:
        min_count: anchors a slot needs (slot 1 and slot j) before rule 1 looks at it.
        margin: rule 1 fires when slot j's unconditional accuracy exceeds slot 1's by more
            than max(margin, z * standard error of the difference).
        z: standard errors for rule 1.
        tau_ratio: rule 2 fires when tau_pooled - 1 < tau_ratio * train_accept_len ...
        accept_len_floor: ... and train_accept_len >= this (below it both are noise-level).
    """

    min_count: int = 50
    margin: float = 0.05
    z: float = 3.0
    tau_ratio: float = 0.5
    accept_len_floor: float = 1.0


def _rising_slots(acc: AcceptanceStats, th: PipelineWarningThresholds) -> list[int]:
    c, u = acc.counts, acc.unconditional
    if not u or c.uncond_den[0] < th.min_count or u[0] is None:
        return []
    p1, n1 = u[0], c.uncond_den[0]
    rising = []
    for j in range(1, len(u)):
        pj, nj = u[j], c.uncond_den[j]
        if pj is None or nj < th.min_count:
            continue
        se = math.sqrt(p1 * (1 - p1) / n1 + pj * (1 - pj) / nj)
        if pj - p1 > max(th.margin, th.z * se):
            rising.append(j + 1)
    return rising


def pipeline_warnings(
    *,
    acceptance: AcceptanceStats | None = None,
    tau_pooled: float | None = None,
    train_accept_len: float | None = None,
    target_layer_ids: Sequence[int] | None = None,
    cache_layer_ids: Sequence[int] | None = None,
    thresholds: PipelineWarningThresholds = PipelineWarningThresholds(),
) -> list[str]:
    """Warnings that point at a broken pipeline rather than a weak drafter. Checks run only
    when their inputs are given.

    1. Rising per-slot accuracy: a slot j >= 2 clearly above slot 1 (unconditional). A
       drafter's accuracy falls with distance; rising accuracy is the signature of a
       position-id / label off-by-one (slot j scored against the token of slot j-1 or so).
    2. tau_pooled - 1 < tau_ratio * train_accept_len (with train_accept_len >= floor). For a
       correct pipeline both average the same per-anchor leading-correct count, tau - 1 over
       the anchors the chain visits, the training metric over all anchors; the visited
       anchors follow rejections and include end-cut / off-greedy-cut rounds, so the two
       differ by tens of percent, not by 2x. A 2x gap means replay does not see what
       training saw (features, layers, RoPE positions, mask). Compare like with like:
       ``train_accept_len`` from the same data when possible.
    3. A layer in the drafter's target_layer_ids missing from the cache's layer_ids.

    Returns:
        Human-readable warnings; empty when nothing looks wrong.
    """
    th, warnings = thresholds, []
    if acceptance is not None and (rising := _rising_slots(acceptance, th)):
        u1 = acceptance.unconditional[0]
        detail = ", ".join(f"slot {j}: {acceptance.unconditional[j - 1]:.3f}" for j in rising)
        warnings.append(
            f"per-slot accuracy rises with position (slot 1: {u1:.3f}; {detail}); drafts are "
            "usually best at slot 1, so check position ids and the draft-to-label alignment "
            "(`scorer diagnose` replays shifted positions)"
        )
    if tau_pooled is not None and train_accept_len is not None:
        if train_accept_len >= th.accept_len_floor and tau_pooled - 1 < th.tau_ratio * train_accept_len:
            warnings.append(
                f"tau_pooled - 1 = {tau_pooled - 1:.3f} is below {th.tau_ratio} x the training-log "
                f"accept length {train_accept_len:.3f}; replay may not match training (features, "
                "layers, positions or mask; `scorer diagnose` tests each)"
            )
    if target_layer_ids is not None and cache_layer_ids is not None:
        missing = sorted(set(target_layer_ids) - set(cache_layer_ids))
        if missing:
            warnings.append(
                f"drafter needs target layers {missing} that the cache lacks (cache has "
                f"{sorted(cache_layer_ids)}); re-extract the cache with these layers"
            )
    return warnings


# ---------------------------------------------------------------- per-category breakdown


@dataclass(frozen=True)
class CategoryTau:
    """tau of one category (both conventions) with its counts; tau is None without rounds."""

    n_requests: int
    n_rounds: int
    n_tokens: int
    tau_per_request: float | None
    tau_pooled: float | None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def per_category_tau(rounds_per_seq: RoundsPerSeq, categories: Sequence[str]) -> dict[str, CategoryTau]:
    """Group requests by category and compute tau in both conventions per group.

    Args:
        rounds_per_seq: per request, a RoundLog or its tokens per round.
        categories: one category name per request, same order.

    Returns:
        {category: CategoryTau}, keys sorted. ``n_requests`` counts every request,
        including ones without rounds (which tau skips).

    Raises:
        ValueError: when the two lengths differ.
    """
    totals = request_totals(rounds_per_seq)
    if len(categories) != len(totals):
        raise ValueError(f"{len(categories)} categories for {len(totals)} requests; give one per request")
    cats = np.asarray(categories, dtype=object)
    out = {}
    for name in sorted(set(categories)):
        t = totals[cats == name]
        has_rounds = bool(t[:, 1].sum())
        out[name] = CategoryTau(
            n_requests=int(len(t)),
            n_rounds=int(t[:, 1].sum()),
            n_tokens=int(t[:, 0].sum()),
            tau_per_request=tau_per_request_from_totals(t) if has_rounds else None,
            tau_pooled=tau_pooled_from_totals(t) if has_rounds else None,
        )
    return out


# ---------------------------------------------------------------- vLLM's per-request histogram


def acceptance_histogram(accepted_per_round: Sequence[int], num_spec_tokens: int) -> list[int]:
    """vLLM's per-request ``acceptance_histogram`` (``--per-request-spec-decode-metrics``): index j
    counts the verify steps that accepted exactly j draft tokens, the bonus token excluded; length
    ``num_spec_tokens + 1`` (vllm/v1/metrics/stats.py:380-388, ``RequestSpecDecodeMetrics.new`` /
    ``observe``: ``histogram[num_accepted] += 1``).

    Raises:
        ValueError: a round accepted fewer than 0 or more than ``num_spec_tokens`` drafts.
    """
    counts = [0] * (num_spec_tokens + 1)
    for j in accepted_per_round:
        if not 0 <= j <= num_spec_tokens:
            raise ValueError(
                f"a round accepted {j} drafts; with {num_spec_tokens} drafted it lies in 0..{num_spec_tokens}"
            )
        counts[j] += 1
    return counts


# ---------------------------------------------------------------- tau by context length


def round_tokens_from_accepted(accepted_per_round: Sequence[int], total_tokens: int) -> list[int]:
    """Tokens committed per round, from a request's accepted drafts per round and its total tokens
    (the eval report's ``per_request`` ``accepted`` and ``tokens``): every round commits its accepted
    drafts + the bonus token, but the last, which the sequence's end may cut
    (RoundLog.tokens = min(acc + 1, T - 1 - p): only the last round can reach T - 1).

    Raises:
        ValueError: the last round would commit fewer than 1 or more than acc + 1 tokens.
    """
    tokens = [a + 1 for a in accepted_per_round]
    if tokens:
        last = total_tokens - sum(tokens[:-1])
        if not 1 <= last <= tokens[-1]:
            raise ValueError(
                f"{total_tokens} tokens over rounds accepting {list(accepted_per_round)}: the last round "
                f"would commit {last}, outside 1..{tokens[-1]}"
            )
        tokens[-1] = last
    elif total_tokens:
        raise ValueError(f"{total_tokens} tokens without a round")
    return tokens


# Context lengths (tokens before and at the anchor) where a round's bucket starts; the last is open.
CONTEXT_LENGTH_EDGES = (0, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)


@dataclass(frozen=True)
class ContextBucketTau:
    """Pooled tau of the rounds drafted at a context length in [start, stop) (stop None: open)."""

    start: int
    stop: int | None
    n_rounds: int
    n_tokens: int
    tau_pooled: float

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def tau_by_context_length(
    anchors_per_request: Sequence[Sequence[int]],
    tokens_per_request: Sequence[Sequence[int]],
    edges: Sequence[int] = CONTEXT_LENGTH_EDGES,
) -> list[ContextBucketTau]:
    """Pooled tau (tokens / rounds) of the rounds grouped by the context the drafter saw: a round
    anchored at position p drafts after p + 1 tokens (prompt and accepted text up to the anchor).
    Rounds, not requests, are grouped: one long request spans several buckets. Empty buckets are
    left out.

    Raises:
        ValueError: edges not increasing from 0, or a request's anchors and tokens of different lengths.
    """
    if not edges or edges[0] != 0 or any(b <= a for a, b in zip(edges, edges[1:])):
        raise ValueError(f"context-length edges {list(edges)} must start at 0 and increase")
    if len(anchors_per_request) != len(tokens_per_request):
        raise ValueError(f"{len(anchors_per_request)} anchor lists for {len(tokens_per_request)} requests")
    rounds = np.zeros(len(edges), dtype=np.int64)
    tokens = np.zeros(len(edges), dtype=np.int64)
    for anchors, committed in zip(anchors_per_request, tokens_per_request):
        if len(anchors) != len(committed):
            raise ValueError(f"{len(anchors)} anchors for {len(committed)} rounds; give one per round")
        bucket = np.searchsorted(np.asarray(edges), np.asarray(anchors, dtype=np.int64) + 1, side="right") - 1
        np.add.at(rounds, bucket, 1)
        np.add.at(tokens, bucket, np.asarray(committed, dtype=np.int64))
    stops = [*edges[1:], None]
    return [
        ContextBucketTau(
            int(edges[i]), stops[i], int(rounds[i]), int(tokens[i]), float(tokens[i] / rounds[i])
        )
        for i in range(len(edges))
        if rounds[i]
    ]
