"""``scorer diagnose``, the pure part: which hypotheses a drafter family gets, how counterfactual
replays are ranked against the baseline, and the one verdict line.

A hypothesis is one setting changed before the same sequences are replayed again (see
``scorer/diagnose_dflash.py`` for how DFlash applies each kind). Ranking is by the gain in
pooled tau over the baseline, with a paired bootstrap over requests (``metrics.paired_bootstrap_delta``:
the same resampled requests for both, so per-request difficulty cancels). ``significant`` means
the interval's lower end is above zero at a Bonferroni-corrected level (``1 - alpha / tested``):
with a dozen alternatives tried at 95 % each, one would look "better" by chance every other run.
Only hypotheses that can be a fix (``fix=True``) become the finding; ablations and the
second-cache replay are reported next to them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from scorer.metrics import paired_bootstrap_delta, tau_pooled_from_totals

__all__ = [
    "DEFAULT_ALPHA",
    "DEFAULT_SAMPLE",
    "FAMILY_HYPOTHESES",
    "HYPOTHESIS_KINDS",
    "Hypothesis",
    "Outcome",
    "hypothesis_kinds",
    "rank_outcomes",
    "verdict",
]

DEFAULT_SAMPLE = 32  # sequences replayed per hypothesis unless --limit says otherwise
DEFAULT_ALPHA = 0.05  # family-wise: each interval is at level 1 - alpha / (hypotheses tested)

# Every kind the diagnosis knows, in the order the terminal explains them.
HYPOTHESIS_KINDS = (
    "position_offset",  # value: shift added to the block's RoPE positions
    "layer_ids",  # value: shift added to every target layer id
    "final_norm",  # value: "pre" / "post" (last target layer before / after the final norm)
    "mask_token_id",  # value: the candidate id
    "rope_theta",  # value: the candidate theta
    "block_size",  # value: the candidate block size
    "dtype",  # value: "fp32" / "bf16" replay, or "cache:<path>" / "drift-noise" (not fixes)
    "feature_ablation",  # value: the target layer id replaced by its mean (not a fix)
)

# Which kinds apply to which drafter family. A new family adds its row (and a module that
# applies them, like scorer/diagnose_dflash.py); kinds it does not list are never tried.
FAMILY_HYPOTHESES: dict[str, tuple[str, ...]] = {
    "dflash": HYPOTHESIS_KINDS,
}


def hypothesis_kinds(family: str) -> tuple[str, ...]:
    """The hypothesis kinds declared for ``family``.

    Raises:
        ValueError: the family declares none.
    """
    if family not in FAMILY_HYPOTHESES:
        raise ValueError(
            f"no diagnosis hypotheses declared for drafter family {family!r}; "
            f"known: {', '.join(sorted(FAMILY_HYPOTHESES))}"
        )
    return FAMILY_HYPOTHESES[family]


@dataclass(frozen=True)
class Hypothesis:
    """One alternative setting. ``value`` is JSON-ready; ``label`` reads as a sentence fragment
    ("block positions shifted by +1"); ``fix`` is False for what is reported but never the cause."""

    kind: str
    value: Any
    label: str
    fix: bool = True


@dataclass(frozen=True)
class Outcome:
    """A hypothesis and its replay: ``totals`` [R, 2] (tokens, rounds) per request in the baseline's
    request order, or None with ``untested`` saying why (and what would test it)."""

    hypothesis: Hypothesis
    totals: np.ndarray | None = None
    untested: str | None = None


def rank_outcomes(
    baseline_totals: Any,
    outcomes: Sequence[Outcome],
    *,
    n_boot: int = 1000,
    seed: int = 0,
    alpha: float = DEFAULT_ALPHA,
) -> dict[str, Any]:
    """Rank replayed hypotheses by pooled-tau gain over the baseline.

    Args:
        baseline_totals: [R, 2] (tokens, rounds) per request of the baseline replay.
        outcomes: one per hypothesis; tested ones carry totals over the same R requests.
        n_boot, seed: the paired bootstrap's resamples and seed.
        alpha: family-wise error; each interval is at level ``1 - alpha / tested``.

    Returns:
        ``{"baseline": {"tau_pooled", "n_requests"}, "level", "hypotheses": [...], "untested":
        [...], "finding": {...} or None}``; hypotheses sorted by gain (largest first), each
        ``{kind, value, label, fix, tau_pooled, gain, ci: [lo, hi], significant}``; the finding
        is the top significant fix.

    Raises:
        ValueError: a tested outcome covers other requests than the baseline.
    """
    base = np.asarray(baseline_totals, dtype=np.int64)
    tested = [o for o in outcomes if o.totals is not None]
    level = 1.0 - alpha / max(len(tested), 1)
    rows = []
    for outcome in tested:
        hyp = outcome.hypothesis
        delta = paired_bootstrap_delta(
            base, np.asarray(outcome.totals, dtype=np.int64), tau_pooled_from_totals, n_boot, seed, level
        )
        rows.append(
            {
                "kind": hyp.kind,
                "value": hyp.value,
                "label": hyp.label,
                "fix": hyp.fix,
                "tau_pooled": tau_pooled_from_totals(outcome.totals),
                "gain": delta.delta,
                "ci": [delta.lo, delta.hi],
                "significant": bool(delta.lo > 0),
            }
        )
    rows.sort(key=lambda r: (-r["gain"], r["kind"], str(r["value"])))
    finding = next((r for r in rows if r["fix"] and r["significant"]), None)
    return {
        "baseline": {"tau_pooled": tau_pooled_from_totals(base), "n_requests": int(len(base))},
        "level": level,
        "hypotheses": rows,
        "untested": [
            {"kind": o.hypothesis.kind, "value": o.hypothesis.value, "reason": o.untested}
            for o in outcomes
            if o.totals is None
        ],
        "finding": None
        if finding is None
        else {k: finding[k] for k in ("kind", "value", "label", "tau_pooled", "gain", "ci")},
    }


def verdict(ranked: dict[str, Any]) -> str:
    """One line: the finding with its interval, or why none was named."""
    base = ranked["baseline"]["tau_pooled"]
    finding = ranked["finding"]
    if finding is not None:
        lo, hi = finding["ci"]
        return (
            f"{finding['label']}: tau {base:.2f} -> {finding['tau_pooled']:.2f} "
            f"(gain {finding['gain']:+.2f}, [{lo:+.2f}, {hi:+.2f}] at {ranked['level']:.1%})"
        )
    best = next((r for r in ranked["hypotheses"] if r["fix"]), None)
    if best is None:
        return f"no hypothesis could be tested (tau {base:.2f}); see the untested list"
    return (
        f"no setting tried beats the configured one beyond its interval (tau {base:.2f}; best "
        f"alternative {best['label']}: {best['gain']:+.2f} [{best['ci'][0]:+.2f}, {best['ci'][1]:+.2f}])"
    )
