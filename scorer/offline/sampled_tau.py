"""tau as served at temperature > 0, over many sampled sequences (spec/sampling.md 4.4, 4.6.5).

With trajectories y sampled from the served p, tau = sum L_gen / sum E[R | y]: both sums are
unbiased for their expectations and the ratio is consistent (the vLLM / SGLang pooled convention,
tokens per round with the bonus token). The only randomness left is y itself, so the interval
resamples PROMPTS: a prompt's trajectories (several samples per prompt shrink the interval) stay
together, exactly as ``scorer.metrics.bootstrap_ci`` resamples requests.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from scorer.metrics import bootstrap_ci
from scorer.rules.expectation import SequenceRounds

__all__ = ["SampledTau", "prompt_totals", "sampled_tau", "sampled_tau_from_totals"]


def prompt_totals(
    prompt_ids: Sequence[str], rounds: Sequence[SequenceRounds]
) -> tuple[tuple[str, ...], np.ndarray]:
    """Sum each prompt's trajectories: (prompt ids in first-seen order, float64 [n_prompts, 2 + K]).

    Columns: tokens, E[rounds], then E[#rounds with acc >= i] for i = 1..K; the bootstrap unit.

    Raises:
        ValueError: on mismatched lengths or sequences scored with different K.
    """
    if len(prompt_ids) != len(rounds):
        raise ValueError(
            f"{len(prompt_ids)} prompt ids for {len(rounds)} sequences; give one id per sequence"
        )
    widths = {len(r.served_accepted) for r in rounds}
    if len(widths) > 1:
        raise ValueError(f"sequences were scored with different slot counts {sorted(widths)}; use one K")
    k = widths.pop() if widths else 0
    order: dict[str, int] = {}
    rows: list[np.ndarray] = []
    for pid, r in zip(prompt_ids, rounds):
        row = np.array([r.tokens, r.expected_rounds, *r.served_accepted], dtype=np.float64)
        if pid in order:
            rows[order[pid]] += row
        else:
            order[pid] = len(rows)
            rows.append(row)
    return tuple(order), np.asarray(rows, dtype=np.float64).reshape(-1, 2 + k)


def _bootstrap_over_prompts(totals: np.ndarray, n_boot: int, seed: int, level: float) -> tuple[float, float]:
    """``bootstrap_ci(totals, sampled_tau_from_totals, ...)`` in one vectorised pass: the same resampled
    prompt indices (numpy's default_rng(seed), [n_boot, n]), each resample's sums row by row (the same
    summation as the 1-D sums), the same percentiles. A report bootstraps every mode at 1000 resamples:
    a Python call per resample would cost more than scoring a small cache."""
    if totals.shape[0] == 0:
        return bootstrap_ci(
            totals, sampled_tau_from_totals, n_boot=n_boot, seed=seed, level=level
        )  # its error
    idx = np.random.default_rng(seed).integers(0, totals.shape[0], size=(n_boot, totals.shape[0]))
    tokens = totals[:, 0][idx].sum(axis=1)
    rounds = totals[:, 1][idx].sum(axis=1)
    lo, hi = np.quantile(tokens / rounds, [(1 - level) / 2, (1 + level) / 2])
    return float(lo), float(hi)


def sampled_tau_from_totals(totals: np.ndarray) -> float:
    """sum tokens / sum E[rounds] over the rows of ``prompt_totals`` (a bootstrap statistic)."""
    rounds = float(np.asarray(totals)[:, 1].sum())
    if rounds <= 0:
        raise ValueError("no sequence has a round; tau is undefined (every sequence has T-1 <= P)")
    return float(np.asarray(totals)[:, 0].sum() / rounds)


@dataclass(frozen=True)
class SampledTau:
    """tau over sampled trajectories, its interval over prompts, and the served acceptance profile.

    Attributes:
        tau: sum tokens / sum E[rounds].
        lo, hi: percentile bootstrap interval, prompts resampled with replacement.
        n_prompts, n_requests: the units (prompts; requests, one per sampled trajectory).
        expected_rounds: sum E[rounds].
        served_acceptance: per slot i, sum E[#rounds with acc >= i] / sum E[rounds]: the acceptance
            of the rounds a server runs (not the all-anchor average, spec 4.7).
    """

    tau: float
    lo: float
    hi: float
    n_prompts: int
    n_requests: int
    expected_rounds: float
    served_acceptance: tuple[float, ...]

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "served_acceptance": list(self.served_acceptance)}


def sampled_tau(
    prompt_ids: Sequence[str],
    rounds: Sequence[SequenceRounds],
    *,
    n_boot: int = 1000,
    seed: int = 0,
    level: float = 0.95,
) -> SampledTau:
    """tau as served from sampled sequences, with a bootstrap interval over prompts.

    Args:
        prompt_ids: per sequence, the prompt it was sampled from (repeats: several trajectories).
        rounds: per sequence, ``sequence_rounds(...)`` or ``rounds_from_log(...)``.
        n_boot, seed, level: as ``scorer.metrics.bootstrap_ci``.

    Raises:
        ValueError: on no sequences, or no rounds at all.
    """
    if not rounds:
        raise ValueError("no sequences to score; tau needs at least one sampled trajectory")
    ids, totals = prompt_totals(prompt_ids, rounds)
    keep = totals[totals[:, 1] > 0]  # prompts whose sequences have no round (T-1 <= P) carry no tau
    tau = sampled_tau_from_totals(totals)
    lo, hi = _bootstrap_over_prompts(keep, n_boot, seed, level)
    expected = float(totals[:, 1].sum())
    served = tuple(float(v) for v in totals[:, 2:].sum(axis=0) / expected)
    return SampledTau(tau, lo, hi, len(ids), len(rounds), expected, served)
