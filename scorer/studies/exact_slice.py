"""The codec's drift on every score of a compact cache (``--states fp8``, hscache/store/compact.py).

A compact cache keeps a few sequences (its exact slice) at the source dtype too. ``scorer eval``
(and ``evaluate_module``, distributed eval, ``scorer compare``: ``with_exact_slice``) scores those
sequences a second time from their exact states and reports the paired delta tau
(compact - exact, the same requests resampled for both: scorer/metrics.py ``paired_bootstrap_delta``)
with its 95% interval, and warns when the interval excludes 0: the codec then moved this drafter's
score. Everything else about the run (drafter, rule, anchors) is the same; only the hidden states differ.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from hscache.store.compact import exact_states
from hscache.store.row_ranges import RowRangeView, read_rows
from scorer.metrics import paired_bootstrap_delta, tau_per_request_from_totals, tau_pooled_from_totals

__all__ = ["exact_slice_drift", "exact_slice_warning", "with_exact_slice"]


def _totals(results: list[Any]) -> np.ndarray:
    return np.array([[r.chain.n_tokens, r.chain.n_rounds] for r in results], dtype=float).reshape(-1, 2)


def exact_slice_drift(
    drafter: Any, cache: Any, config: Any, results: list[Any], rule: Any, score_rows: Any
) -> dict[str, Any] | None:
    """The exact slice scored both ways: ``{"codec", "requests", "record_ids", "tau": {"exact",
    "compact"}, "delta": {"per_request", "pooled"}, "interval_excludes_zero"}``; None for a cache that
    is not compact (or sharded: its slices are per shard), or when no scored sequence is in the slice.

    ``results``: the run's results (the compact scores of those rows); ``score_rows``: the run's own
    scoring function (scorer/offline/scoring.py), called with the same drafter, config and rule.
    """
    states = cache.manifest.get("states")
    if not states or getattr(cache, "shards", None):
        return None
    by_row = {r.row: r for r in results}
    rows = [r for r in states["exact"]["rows"] if r in by_row and by_row[r].chain.n_rounds]
    if not rows:
        return None
    exact_results = []
    for row in rows:
        data = read_rows(cache, range(row, row + 1))
        data.data["hidden_states"] = exact_states(cache, row)  # the source dtype, checked
        exact_results += score_rows(
            drafter, RowRangeView(cache, data), range(row, row + 1), config, None, rule
        )
    exact, compact = _totals(exact_results), _totals([by_row[r] for r in rows])
    delta = {
        name: paired_bootstrap_delta(exact, compact, stat, config.n_boot, config.seed).to_dict()
        for name, stat in (("per_request", tau_per_request_from_totals), ("pooled", tau_pooled_from_totals))
    }
    return {
        "codec": states["codec"],
        "requests": len(rows),
        "record_ids": [by_row[r].record_id for r in rows],
        "tau": {
            "exact": {
                "per_request": tau_per_request_from_totals(exact),
                "pooled": tau_pooled_from_totals(exact),
            },
            "compact": {
                "per_request": tau_per_request_from_totals(compact),
                "pooled": tau_pooled_from_totals(compact),
            },
        },
        "delta": delta,
        "interval_excludes_zero": any(d["lo"] > 0 or d["hi"] < 0 for d in delta.values()),
    }


def exact_slice_warning(drift: dict[str, Any]) -> str | None:
    """The report's warning when the codec moved tau on the exact slice (its interval excludes 0)."""
    if not drift["interval_excludes_zero"]:
        return None
    d = drift["delta"]["per_request"]
    return (
        f"fp8 states moved tau on the exact slice ({drift['requests']} requests): per request "
        f"{d['delta']:+.3f} [{d['lo']:+.3f}, {d['hi']:+.3f}] (compact - exact); score a lossless cache "
        "(extract without --states fp8) before trusting differences this small"
    )


def with_exact_slice(
    report: dict[str, Any],
    drafter: Any,
    cache: Any,
    config: Any,
    results: list[Any],
    rule: Any,
    score_rows: Any,
) -> dict[str, Any]:
    """``report`` with its ``exact_slice`` drift (``exact_slice_drift``'s arguments) and, when the
    interval excludes 0, its warning; unchanged for a cache that is not compact. Every scoring path
    that builds a report calls this, so each says what the codec did to its score."""
    drift = exact_slice_drift(drafter, cache, config, results, rule, score_rows)
    if drift is not None:
        report["exact_slice"] = drift
        warning = exact_slice_warning(drift)
        if warning is not None:
            report["warnings"].append(warning)
    return report
