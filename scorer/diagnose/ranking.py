"""``scorer diagnose``, the pure part: which hypotheses a drafter family gets, how counterfactual
replays are ranked against the baseline, which one (if any) is the finding, and the one verdict line.

A hypothesis is one setting changed before the same sequences are replayed again. Each drafter
family declares the kinds that apply to it (``Family.diagnose_kinds``) and applies them in its own
``diagnose`` hook (``scorer/families/<family>/diagnose.py``), which gets a `DiagnosisInputs` and
returns a `FamilyDiagnosis`: the configured setting, the candidate hypotheses and a replayer. Ranking is by the gain in
pooled tau over the baseline, with a paired bootstrap over requests (``metrics.paired_bootstrap_delta``:
the same resampled requests for both, so per-request difficulty cancels). ``significant`` means
the interval's lower end is above zero at a Bonferroni-corrected level (``1 - alpha / tested``):
with a dozen alternatives tried at 95 % each, one would look "better" by chance every other run.
Only hypotheses that can be a fix (``fix=True``) become the finding; ablations and the
second-cache replay are reported next to them.

The finding is the top-ranked fix only when it beats both the baseline and the runner-up fix
beyond their intervals (each a paired bootstrap on the same requests). Otherwise the verdict is
"inconclusive between X and Y" with the ``--limit`` that would separate them, estimated from the
observed per-request variance (delta method, 80 % power at the same level), or "no setting tried
beats the configured one" when the best alternative's interval rules out a gain of ``RESOLUTION``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from statistics import NormalDist
from typing import Any

import numpy as np

from scorer.metrics import (
    AcceptLen,
    paired_bootstrap_delta,
    request_totals,
    tau_pooled_from_totals,
    train_accept_len,
)
from scorer.offline.replay import RoundLog, replay_chain

__all__ = [
    "DEFAULT_ALPHA",
    "DEFAULT_SAMPLE",
    "HYPOTHESIS_KINDS",
    "MAX_SAMPLE",
    "POWER",
    "RESOLUTION",
    "DiagnosisInputs",
    "FamilyDiagnosis",
    "Hypothesis",
    "Outcome",
    "final_norm_alternative",
    "paired_se",
    "rank_outcomes",
    "replay_anchor_drafts",
    "sequences_needed",
    "shifted_layer_ids",
    "verdict",
]

# Without --limit, DEFAULT_SAMPLE sequences are replayed first; the sample then grows (up to
# MAX_SAMPLE and the cache) to what the observed variance says separates RESOLUTION tau.
DEFAULT_SAMPLE = 32
MAX_SAMPLE = 256  # bounds the default's time: about 1.2 CPU-s a sequence for a tiny drafter
RESOLUTION = 0.15  # tau difference the default sample is sized to separate; smaller gains are "none"
POWER = 0.8  # chance the suggested --limit separates a difference of the observed size
DEFAULT_ALPHA = 0.05  # family-wise: each interval is at level 1 - alpha / (hypotheses tested)

# Every kind the diagnosis knows, in the order the terminal explains them. A family declares the
# ones that apply to it (``Family.diagnose_kinds``); kinds it does not list are never tried.
HYPOTHESIS_KINDS = (
    "position_offset",  # value: shift added to the drafted positions (DFlash: the block's; chains: steps >= 1)
    "layer_ids",  # value: shift added to every target layer id
    "final_norm",  # value: "pre" / "post" (last target layer before / after the final norm)
    "mask_token_id",  # value: the candidate id
    "rope_theta",  # value: the candidate theta
    "block_size",  # value: the candidate block size
    "d2t",  # value: how draft ids map to target ids ("identity", "absolute")
    "selector",  # value: DFlash2's path selector "off" (per-slot argmax) or another top-k
    "dtype",  # value: "fp32" / "bf16" replay, or "cache:<path>" / "drift-noise" (not fixes)
    "feature_ablation",  # value: the target layer id replaced by its mean (not a fix)
)


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


def shifted_layer_ids(ids: Sequence[int], shift: int, cache: Any) -> tuple[int, ...] | str:
    """Target layer ``ids`` shifted by ``shift`` (the layer-id hypotheses of every family), or why
    they cannot be replayed on ``cache``: outside the target, or missing from the cache (with the
    ``--layers`` to re-extract with)."""
    shifted = tuple(int(i) + shift for i in ids)
    n_layers = cache.target_config.get("num_hidden_layers")
    outside = [i for i in shifted if i < 0 or (n_layers is not None and i >= n_layers)]
    if outside:  # only the offending ids (was: every id, as if all fell outside)
        return (
            f"layer ids {list(shifted)}: {', '.join(map(str, outside))} "
            f"{'falls' if len(outside) == 1 else 'fall'} outside the target's 0..{(n_layers or 1) - 1}"
        )
    if missing := [i for i in shifted if i not in cache.layer_ids]:
        have = sorted(set(cache.layer_ids) | set(shifted))
        return f"the cache lacks layers {missing}; re-extract with --layers {','.join(map(str, have))} to test it"
    return shifted


def final_norm_alternative(normed: bool, cache: Any, what: str) -> tuple[Hypothesis, bool | str]:
    """The ``final_norm`` hypothesis of a drafter that reads the target's last layer (``what``, as
    the label names it) after (``normed``) or before the final norm: the other one, or why it cannot
    be replayed (reading it after the norm needs the norm the cache saved)."""
    alt = not normed
    where = "after" if alt else "before"
    hyp = Hypothesis("final_norm", "post" if alt else "pre", f"{what} read {where} the final norm")
    if alt and "final_norm.weight" not in cache.target_head():
        return hyp, "the cache saved no final norm; re-extract it with this hscache"
    return hyp, alt


@dataclass
class DiagnosisInputs:
    """What ``scorer diagnose`` hands a family's ``diagnose`` hook (``scorer.families.base.Family``).

    Attributes:
        checkpoint: the CKPT as given (a path, or ``target:<head>``).
        drafter, loaded: what the family's loader returned for ``caches[0]`` (as ``scorer eval``).
        caches: one cache, or two (the second for the drift hypotheses); on a SAMPLED cache a view
            whose ``target_argmax`` is the cached sampled next token (``scorer.offline.sampled_view.SampledView``).
        rows: per cache, its rows in sampling order (aligned by record id with two caches).
        second_cache: the second ``--cache`` path, or None; ``drift`` its measured per-layer
            relative L2 as ((layer, rel), ...).
        options: the run's ``DiagnoseConfig`` (device, dtype, seed, anchors, memory_gb,
            max_blocks_per_forward, trust_checkpoint, ...), read by attribute.
    """

    checkpoint: str
    drafter: Any
    loaded: Any
    caches: list[Any]
    rows: list[list[int]]
    options: Any
    second_cache: str | None = None
    drift: tuple[tuple[int, float], ...] = ()

    @property
    def last_layer(self) -> int | None:
        """The target's last layer id, or None when the cache's target config does not say."""
        n_layers = self.caches[0].target_config.get("num_hidden_layers")
        return None if n_layers is None else int(n_layers) - 1


@dataclass
class FamilyDiagnosis:
    """What a family's ``diagnose`` hook returns: the drafter as configured (``base``, a setting of
    the family's own kind), every hypothesis of its declared kinds with its setting or a sentence
    saying why it is untested here, and ``replay_many(settings, positions, *, anchors=None)`` ->
    per setting ``([len(positions), 2]`` (tokens, rounds) per request, the training-log AcceptLen
    over them or None)`` on the rows at ``positions`` of ``DiagnosisInputs.rows``; ``replayer``
    the object behind it (benches and tests reach its parts); ``notes`` lines for the report."""

    base: Any
    candidates: list[tuple[Hypothesis, Any]]
    replay_many: Callable[..., list[tuple[np.ndarray, AcceptLen | None]]]
    replayer: Any = None
    notes: list[str] = field(default_factory=list)


def replay_anchor_drafts(
    settings: Sequence[Any],
    caches: Sequence[Any],
    rows: Sequence[Sequence[int]],
    positions: Sequence[int],
    drafts_of_row: Callable[[Sequence[Any], Any, int], list[np.ndarray]],
    slots: Callable[[Any], int],
    cache_of: Callable[[Any], int] = lambda setting: 0,
) -> list[tuple[np.ndarray, AcceptLen]]:
    """The shared replay of a family that drafts every anchor at once (chains, blocks).

    ``drafts_of_row(settings, cache, row)`` gives, per setting, its drafts ``[A, K]`` at anchors
    P..T-2 of one row (a family shares what settings have in common there); each is replayed as
    ``scorer eval`` replays it (``replay_chain`` with ``slots(setting)`` = K + 1 slots) and its
    training-log accept length read off the same drafts.
    """
    logs: list[list[RoundLog]] = [[] for _ in settings]
    accept = [AcceptLen(0, 0) for _ in settings]
    by_cache: dict[int, list[int]] = {}
    for j, s in enumerate(settings):
        by_cache.setdefault(cache_of(s), []).append(j)
    for i in positions:
        for c, members in by_cache.items():
            cache, row = caches[c], rows[c][i]
            x, a = cache.token_ids(row).numpy(), cache.target_argmax(row).numpy()
            prompt_len = int(cache.index.column("prompt_len")[row].as_py())
            drafts = drafts_of_row([settings[j] for j in members], cache, row)
            for j, draft in zip(members, drafts):
                logs[j].append(replay_chain(draft, x, a, prompt_len, slots(settings[j])))
                accept[j] = accept[j] + train_accept_len(draft, x, a, prompt_len)
    return [(request_totals(log), acc) for log, acc in zip(logs, accept)]


def paired_se(a_totals: Any, b_totals: Any) -> float:
    """Standard error of ``tau_pooled(b) - tau_pooled(a)`` over the same requests (delta method).

    A request's influence on a pooled tau ``sum(t) / sum(r)`` is ``(t_i - tau r_i) / mean(r)``;
    the paired difference's standard error is the spread of the influence differences over
    sqrt(R). It plans sample sizes; the intervals themselves stay bootstrap ones. ``inf`` for
    fewer than two requests (no spread to measure).
    """
    a, b = np.asarray(a_totals, dtype=np.float64), np.asarray(b_totals, dtype=np.float64)
    if len(a) < 2:
        return math.inf

    def influence(t: np.ndarray) -> np.ndarray:
        tau = t[:, 0].sum() / t[:, 1].sum()
        return (t[:, 0] - tau * t[:, 1]) / t[:, 1].mean()

    return float(np.std(influence(b) - influence(a), ddof=1) / math.sqrt(len(a)))


def sequences_needed(
    n: int, se: float | None, margin: float, level: float, power: float = POWER
) -> int | None:
    """Requests at which a difference ``margin`` away from where the interval must not reach is
    resolved with probability ``power``: the interval's half-width (z_level * se) plus the power
    term (z_power * se) shrink as 1/sqrt(n), so ``n * ((z_level + z_power) * se / margin) ** 2``.

    None when it cannot be estimated (``se`` infinite) or nothing separates them (no margin and
    no spread: the two replay identically).
    """
    if se is None or not math.isfinite(se):
        return None
    if se == 0:
        return None if margin == 0 else n
    if margin <= 0:
        return None
    z = NormalDist().inv_cdf(1 - (1 - level) / 2) + NormalDist().inv_cdf(power)
    return max(1, math.ceil(n * (z * se / margin) ** 2))


def _json_se(se: float) -> float | None:
    return se if math.isfinite(se) else None  # JSON has no Infinity


def _brief(row: dict[str, Any]) -> dict[str, Any]:
    return {k: row[k] for k in ("kind", "value", "label")}


def rank_outcomes(
    baseline_totals: Any,
    outcomes: Sequence[Outcome],
    *,
    n_boot: int = 1000,
    seed: int = 0,
    alpha: float = DEFAULT_ALPHA,
    resolution: float = RESOLUTION,
    available: int | None = None,
    configured: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Rank replayed hypotheses by pooled-tau gain over the baseline and decide the finding.

    Args:
        baseline_totals: [R, 2] (tokens, rounds) per request of the baseline replay.
        outcomes: one per hypothesis; tested ones carry totals over the same R requests.
        n_boot, seed: the paired bootstrap's resamples and seed (the same resamples for every
            comparison).
        alpha: family-wise error; each interval is at level ``1 - alpha / tested``.
        resolution: a best alternative whose interval's upper end is below this is no finding
            ("none"); the default sample is sized to separate a difference this large.
        available: sequences the cache could supply (the verdict says when a suggested
            ``--limit`` exceeds them); None: unknown.
        configured: the configured value of each kind the drafter's config states (the verdict
            names it when the top fix is not separated from the configured setting).

    Returns:
        ``{"baseline", "level", "resolution", "hypotheses", "untested", "finding",
        "runner_up", "inconclusive", "sample_needed", "available"}``; hypotheses sorted by gain
        (largest first), each ``{kind, value, label, fix, tau_pooled, gain, ci, se, significant}``.
        ``finding`` is the top fix when it beats the baseline and ``runner_up`` (the top fix
        minus the next fix, paired) beyond their intervals; ``inconclusive`` names the two it is
        between and the ``--limit`` estimated to separate them; ``sample_needed`` is the sample
        that separates a difference of ``max(|observed|, resolution)`` against the baseline and, when
        the top fix gains at least ``resolution``, against the runner-up.

    Raises:
        ValueError: a tested outcome covers other requests than the baseline.
    """
    base = np.asarray(baseline_totals, dtype=np.int64)
    n = int(len(base))
    tested = [o for o in outcomes if o.totals is not None]
    level = 1.0 - alpha / max(len(tested), 1)
    rows, totals = [], {}
    for outcome in tested:
        hyp = outcome.hypothesis
        mine = np.asarray(outcome.totals, dtype=np.int64)
        delta = paired_bootstrap_delta(base, mine, tau_pooled_from_totals, n_boot, seed, level)
        row = {
            "kind": hyp.kind,
            "value": hyp.value,
            "label": hyp.label,
            "fix": hyp.fix,
            "tau_pooled": tau_pooled_from_totals(mine),
            "gain": delta.delta,
            "ci": [delta.lo, delta.hi],
            "se": _json_se(paired_se(base, mine)),
            "significant": bool(delta.lo > 0),
        }
        rows.append(row)
        totals[id(row)] = mine
    rows.sort(key=lambda r: (-r["gain"], r["kind"], str(r["value"])))
    fixes = [r for r in rows if r["fix"]]
    top = fixes[0] if fixes else None
    runner = fixes[1] if len(fixes) > 1 else None

    def versus(row: dict, other: dict) -> dict[str, Any]:
        a, b = totals[id(other)], totals[id(row)]
        d = paired_bootstrap_delta(a, b, tau_pooled_from_totals, n_boot, seed, level)
        return {**_brief(other), "delta": d.delta, "ci": [d.lo, d.hi], "se": _json_se(paired_se(a, b))}

    runner_up = None if top is None or runner is None else versus(top, runner)
    finding, inconclusive, needed = None, None, n
    if top is not None:
        # Sized to separate max(|observed|, resolution): a large effect needs no more requests
        # than it has, a small one as many as a resolution-sized one would. The runner-up
        # matters only when the top fix gains a resolution's worth (else the verdict is none).
        compared = [{"se": top["se"], "delta": top["gain"]}]
        if runner_up is not None and top["gain"] >= resolution:
            compared.append(runner_up)
        needed = max(
            sequences_needed(n, c["se"], max(abs(c["delta"]), resolution), level) or n for c in compared
        )
        finding, inconclusive = _decide(top, runner_up, fixes, totals, level, resolution, n)
    if inconclusive is not None:
        inconclusive["available"] = available
        if inconclusive["between"][1] is None and top["kind"] in (configured or {}):
            inconclusive["configured"] = {"kind": top["kind"], "value": configured[top["kind"]]}
    return {
        "baseline": {"tau_pooled": tau_pooled_from_totals(base), "n_requests": n},
        "level": level,
        "resolution": resolution,
        "hypotheses": rows,
        "untested": [
            {"kind": o.hypothesis.kind, "value": o.hypothesis.value, "reason": o.untested}
            for o in outcomes
            if o.totals is None
        ],
        "finding": None
        if finding is None
        else {k: finding[k] for k in ("kind", "value", "label", "tau_pooled", "gain", "ci")},
        "runner_up": runner_up,
        "inconclusive": inconclusive,
        "sample_needed": needed,
        "available": available,
    }


def _decide(
    top: dict,
    runner_up: dict | None,
    fixes: list[dict],
    totals: dict[int, np.ndarray],
    level: float,
    resolution: float,
    n: int,
) -> tuple[dict | None, dict | None]:
    """(finding, inconclusive): see ``rank_outcomes``. A suggested limit is at least twice the
    current sample: a comparison still open at n is not closed by one more request."""

    def limit(*needs: int | None) -> int | None:
        return None if any(x is None for x in needs) else max(2 * n, *needs)

    # Against the baseline an interval closes either way: above 0 (a gain) or below the
    # resolution (no gain worth naming), whichever is nearer the observed difference.
    gain = top["gain"]
    versus_base = sequences_needed(n, top["se"], max(gain, resolution - gain), level)
    if top["ci"][0] > 0:
        if runner_up is None or runner_up["ci"][0] > 0:
            return top, None
        need = sequences_needed(n, runner_up["se"], runner_up["delta"], level)
        return None, {"between": [_brief(top), _brief(runner_up)], "limit": limit(need)}
    ahead = [r for r in fixes if r["ci"][0] > 0]  # a lower-ranked fix that does beat the baseline
    if ahead:
        other = ahead[0]
        se = paired_se(totals[id(other)], totals[id(top)])
        need = sequences_needed(n, se, top["gain"] - other["gain"], level)
        return None, {"between": [_brief(top), _brief(other)], "limit": limit(versus_base, need)}
    if top["ci"][1] < resolution:
        return None, None
    return None, {"between": [_brief(top), None], "limit": limit(versus_base)}


def verdict(ranked: dict[str, Any]) -> str:
    """One line: the finding with its interval (and its lead over the runner-up), the two it is
    inconclusive between with the ``--limit`` to run, or why none was named."""
    base = ranked["baseline"]["tau_pooled"]
    finding, open_, runner_up = ranked["finding"], ranked.get("inconclusive"), ranked.get("runner_up")
    if finding is not None:
        lo, hi = finding["ci"]
        line = (
            f"{finding['label']}: tau {base:.2f} -> {finding['tau_pooled']:.2f} "
            f"(gain {finding['gain']:+.2f}, [{lo:+.2f}, {hi:+.2f}] at {ranked['level']:.1%}"
        )
        if runner_up is not None:
            rlo, rhi = runner_up["ci"]
            line += f"; ahead of {runner_up['label']} by {runner_up['delta']:+.2f} [{rlo:+.2f}, {rhi:+.2f}]"
        return line + ")"
    if open_ is not None:
        rows = {(r["kind"], str(r["value"])): r for r in ranked["hypotheses"]}

        def named(who: dict | None) -> str:
            if who is None:
                mine = open_.get("configured")
                if mine is not None:  # "the configured mask token id 0"
                    return f"the configured {mine['kind'].replace('_', ' ')} {mine['value']} (tau {base:.2f})"
                return f"the configured setting (tau {base:.2f})"
            r = rows[(who["kind"], str(who["value"]))]
            return f"{r['label']} (gain {r['gain']:+.2f} [{r['ci'][0]:+.2f}, {r['ci'][1]:+.2f}])"

        x, y = open_["between"]
        line = f"inconclusive between {named(x)} and {named(y)}: "
        n, have = open_["limit"], open_.get("available")
        if n is None:
            return line + (
                f"{ranked['baseline']['n_requests']} sequence(s) cannot say how many would separate them "
                "(they replay identically, or too few to measure a spread)"
            )
        line += f"run with --limit {n}"
        if have is not None and n > have:
            line += f" (the cache has {have} sequences with a generated region: extract more)"
        return line
    best = next((r for r in ranked["hypotheses"] if r["fix"]), None)
    if best is None:
        return f"no hypothesis could be tested (tau {base:.2f}); see the untested list"
    return (
        f"no setting tried beats the configured one beyond its interval (tau {base:.2f}; best "
        f"alternative {best['label']}: {best['gain']:+.2f} [{best['ci'][0]:+.2f}, {best['ci'][1]:+.2f}], "
        f"below the {ranked.get('resolution', RESOLUTION):.2f} resolution)"
    )
