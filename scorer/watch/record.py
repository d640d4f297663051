"""One record of the watch log (schemas/watch_record.schema.json) from one ``scorer eval`` report.

Every number a record holds is the report's own (``scorer.studies.evaluate.evaluate`` for a
checkpoint, ``evaluate_module`` for a module in memory), or computed from its per-request rounds by
the pure functions of scorer/metrics.py (tau by context length, vLLM's per-request acceptance
histogram): a record at step S equals ``scorer eval`` on that checkpoint.
"""

from __future__ import annotations

from typing import Any

from scorer.documents import run_stamp
from scorer.metrics import acceptance_histogram, round_tokens_from_accepted, tau_by_context_length

__all__ = ["WATCH_SCHEMA_VERSION", "metrics_of", "refused_record", "scored_record"]

WATCH_SCHEMA_VERSION = 1


def _rounds_metrics(report: dict[str, Any]) -> tuple[list[dict] | None, dict[str, Any] | None]:
    """(tau by context-length bucket, acceptance histograms) from the report's per-request rounds."""
    drafts = len(report["tokens_per_round_histogram"]) - 1  # B - 1 drafts per round
    requests = report["per_request"]
    try:
        tokens = [round_tokens_from_accepted(r["accepted"], r["tokens"]) for r in requests]
        buckets = tau_by_context_length([r["anchors"] for r in requests], tokens)
        per_request = [acceptance_histogram(r["accepted"], drafts) for r in requests]
    except (ValueError, TypeError):  # a rule whose rounds are not whole counts (probabilistic DP)
        return None, None
    total = [sum(column) for column in zip(*per_request)] if per_request else [0] * (drafts + 1)
    histogram = {"num_spec_tokens": drafts, "total": total, "per_request": per_request}
    return [b.to_dict() for b in buckets], histogram


def metrics_of(report: dict[str, Any]) -> dict[str, Any]:
    """What the watch logs of one eval report: tau (both conventions, intervals, per request, per
    category, by context length), acceptance per slot, vLLM's acceptance histogram, DDTree-B (DFlash,
    per budget), and on a sampled cache tau as served at its setting."""
    buckets, histogram = _rounds_metrics(report)
    sampling = report.get("sampling")
    return {
        "tau": report["tau"],
        "tau_requests": [
            {"record_id": r["record_id"], "category": r["category"], "tau": r["tau"], "rounds": r["rounds"]}
            for r in report["per_request"]
        ],
        "acceptance": {
            "conditional": report["acceptance"]["conditional"],
            "unconditional": report["acceptance"]["unconditional"],
        },
        "train_accept_len": report["train_accept_len"],
        "per_category": report["per_category"],
        "context_length": buckets,
        "acceptance_histogram": histogram,
        "ddtree": report["ddtree_detail"],
        "rule": sampling["rule"] if sampling else "greedy",
        "served": sampling["modes"] if sampling else None,
        "rounds": report["rounds"],
        "tokens": report["tokens"],
        "requests": report["requests"],
    }


def _common(checkpoint: dict[str, Any], cache: dict[str, Any], eval_config: dict[str, Any]) -> dict[str, Any]:
    return {
        "schema_version": WATCH_SCHEMA_VERSION,
        "checkpoint": checkpoint["path"],
        "checkpoint_sha256": checkpoint["sha256"],
        "step": checkpoint["step"],
        "step_source": checkpoint["step_source"],
        "layout": checkpoint["layout"],
        "source": checkpoint.get("source", "watch"),
        "cache": cache,
        "eval": eval_config,
    }


def scored_record(
    checkpoint: dict[str, Any], cache: dict[str, Any], eval_config: dict[str, Any], report: dict[str, Any]
) -> dict[str, Any]:
    """The record of a scored checkpoint. ``checkpoint``: path, sha256, step, step_source, layout
    (and source: "watch" or "callback"); ``cache``: path and digest; ``eval_config``: EvalConfig.to_dict()."""
    return {
        **_common(checkpoint, cache, eval_config),
        "status": "scored",
        "metrics": metrics_of(report),
        **run_stamp(report["seconds"]),
    }


def refused_record(
    checkpoint: dict[str, Any],
    cache: dict[str, Any],
    eval_config: dict[str, Any],
    reason: str,
    seconds: float,
) -> dict[str, Any]:
    """The record of a checkpoint that could not be loaded or scored (reported once: a restarted
    watch reads it and does not try the same content again)."""
    return {
        **_common(checkpoint, cache, eval_config),
        "status": "refused",
        "reason": reason,
        **run_stamp(seconds),
    }
