"""Aggregate per-sequence results into the eval report (a JSON-ready dict; schema
``schemas/eval_report.schema.json``), and compare two reports of one checkpoint."""

from __future__ import annotations

import functools
import operator
import random
from collections.abc import Sequence
from typing import Any

import numpy as np

import schemas
from hscache.provenance import git_commit, package_versions, utc_now
from scorer.metrics import (
    AcceptLen,
    acceptance_rates,
    bootstrap_ci,
    diagnose,
    paired_bootstrap_delta,
    per_category_tau,
    request_totals,
    tau_per_request_from_totals,
    tau_pooled_from_totals,
    tokens_per_round_histogram,
)
from scorer.score import SequenceResult, result_summary

__all__ = ["REPORT_SCHEMA_VERSION", "TAU_DEFINITIONS", "build_report", "compare_reports", "merge_results"]

REPORT_SCHEMA_VERSION = 1
TAU_DEFINITIONS = {
    "per_request": "tokens per round incl. the bonus token, mean per request then over requests (DFlash benchmarks)",
    "pooled": "total tokens / total rounds over all requests (vLLM / SGLang)",
    "train_accept_len": "mean over ALL anchors of leading correct draft slots, no +1 (training dashboards)",
    "ddtree_surrogate": "draft-only estimate 1 + sum of tree-node path probabilities; needs no target",
}


def _tau_block(logs: list, n_boot: int, seed: int) -> dict[str, Any]:
    logs = [log for log in logs if log.n_rounds]
    if not logs:
        return {"per_request": None, "pooled": None, "per_request_ci95": None, "pooled_ci95": None}
    totals = request_totals(logs)
    return {
        "per_request": tau_per_request_from_totals(totals),
        "pooled": tau_pooled_from_totals(totals),
        "per_request_ci95": list(bootstrap_ci(totals, tau_per_request_from_totals, n_boot, seed)),
        "pooled_ci95": list(bootstrap_ci(totals, tau_pooled_from_totals, n_boot, seed)),
    }


def merge_results(results: Sequence[SequenceResult]) -> list[SequenceResult]:
    """Results in cache row order, whatever order workers returned them in."""
    return sorted(results, key=lambda r: r.row)


def _samples(results: list[SequenceResult], cache: Any, n: int, seed: int, block_size: int) -> list[dict]:
    rounds = [(r, k) for r in results for k in range(r.chain.n_rounds)]
    if not n or not rounds:
        return []
    tokenizer = cache.tokenizer()
    picked = sorted(random.Random(seed).sample(rounds, min(n, len(rounds))), key=lambda t: (t[0].row, t[1]))
    out = []
    for result, k in picked:
        p, acc = result.chain.anchors[k], result.chain.accepted[k]
        x, a = cache.token_ids(result.row).tolist(), cache.target_argmax(result.row).tolist()
        avail = min(block_size - 1, len(x) - 1 - p)
        drafted = result.chain_drafts[k][:avail].tolist()
        target = a[p : p + avail]  # g_{p+j} = a[p+j-1], j = 1..avail
        out.append({
            "record_id": result.record_id, "anchor": p, "accepted": acc, "tokens": result.chain.tokens[k],
            "context_tail": tokenizer.decode(x[max(0, p - 15) : p + 1]),
            "drafted": [tokenizer.decode([t]) for t in drafted],
            "target": [tokenizer.decode([t]) for t in target],
            "diverged_at_slot": acc + 1 if acc < avail else None,
        })
    return out


def build_report(results: Sequence[SequenceResult], *, cache: Any, drafter: Any, loaded: Any, config: Any,
                 seconds: float) -> dict[str, Any]:
    """The eval report: every number, the config used, checkpoint hash, cache provenance, versions."""
    results = merge_results(results)
    B = drafter.config.block_size
    chains = [r.chain for r in results]
    counts = functools.reduce(operator.add, (r.acceptance for r in results)) if results else None
    accept_len = sum((r.accept_len for r in results), AcceptLen(0, 0))
    acceptance = acceptance_rates(counts) if counts is not None else None
    tau = _tau_block(chains, config.n_boot, config.seed)
    warnings = diagnose(acceptance=acceptance, tau_pooled=tau["pooled"], train_accept_len=accept_len.mean,
                        target_layer_ids=drafter.config.target_layer_ids, cache_layer_ids=cache.layer_ids)
    cut = sum(c.n_cut_off_greedy for c in chains)
    if cut:
        warnings.append(f"{cut} rounds were cut short where the cached text leaves the target's greedy path; "
                        "offline tau is then a lower bound (build the cache with --max-new-tokens for exact replay)")
    ddtree = {str(b): _tau_block([r.ddtree[b] for r in results], config.n_boot, config.seed) for b in config.ddtree}
    surrogate = {}
    for b in config.ddtree:
        total = sum(r.ddtree_surrogate[b][0] for r in results)
        count = sum(r.ddtree_surrogate[b][1] for r in results)
        surrogate[str(b)] = total / count if count else None
    categories = [r.category for r in results]
    report = {
        "schema_version": REPORT_SCHEMA_VERSION,
        "tau": tau,
        "rounds": sum(c.n_rounds for c in chains),
        "tokens": sum(c.n_tokens for c in chains),
        "requests": len(results),
        "tokens_per_round_histogram": tokens_per_round_histogram(chains, B) if chains else [0] * B,
        "acceptance": _acceptance_dict(acceptance, B),
        "train_accept_len": accept_len.mean,
        "ddtree": {b: block["per_request"] for b, block in ddtree.items()},
        "ddtree_detail": ddtree,
        "ddtree_surrogate": surrogate,
        "off_greedy": {"positions": sum(c.off_greedy_positions for c in chains), "rounds_cut_short": cut},
        "per_category": ({k: v.to_dict() for k, v in per_category_tau(chains, categories).items()}
                         if any(c is not None for c in categories) else {}),
        "warnings": warnings,
        "samples": _samples(results, cache, config.samples, config.seed, B),
        "per_request": [dict(result_summary(r), anchors=list(r.chain.anchors), accepted=list(r.chain.accepted))
                        for r in results],
        "definitions": TAU_DEFINITIONS,
        "config": config.to_dict(),
        "drafter": {**drafter.config.to_hf_config(), "attention_backend": drafter.backend_used},
        "checkpoint": loaded.report.to_dict(),
        "cache": {"path": str(cache.path), "sequences": len(cache), "layer_ids": cache.layer_ids,
                  "settings": cache.settings, "provenance": cache.provenance},
        "versions": package_versions(),
        "hscache_git_commit": git_commit(),
        "seconds": seconds,
        "created_at": utc_now(),
    }
    schemas.validate(report, "eval_report")
    return report


def _acceptance_dict(acceptance: Any, B: int) -> dict[str, Any]:
    if acceptance is None:
        return {"conditional": [None] * (B - 1), "unconditional": [None] * (B - 1), "counts": {}}
    return {"conditional": list(acceptance.conditional), "unconditional": list(acceptance.unconditional),
            "counts": acceptance.counts.to_dict()}


def compare_reports(base: dict[str, Any], other: dict[str, Any], config: Any) -> dict[str, Any]:
    """Paired comparison of one checkpoint on two caches: tau deltas and rounds that changed."""
    a_rows = {r["record_id"]: r for r in base["per_request"] if r["rounds"]}
    b_rows = {r["record_id"]: r for r in other["per_request"] if r["rounds"]}
    common = [k for k in a_rows if k in b_rows]
    a_tot = np.array([[a_rows[k]["tokens"], a_rows[k]["rounds"]] for k in common], dtype=float).reshape(-1, 2)
    b_tot = np.array([[b_rows[k]["tokens"], b_rows[k]["rounds"]] for k in common], dtype=float).reshape(-1, 2)
    deltas = {}
    for name, stat in (("per_request", tau_per_request_from_totals), ("pooled", tau_pooled_from_totals)):
        deltas[name] = (paired_bootstrap_delta(a_tot, b_tot, stat, config.n_boot, config.seed).to_dict()
                        if common else None)
    changed, first = 0, []
    for k in common:
        a_acc = dict(zip(a_rows[k]["anchors"], a_rows[k]["accepted"]))
        b_acc = dict(zip(b_rows[k]["anchors"], b_rows[k]["accepted"]))
        diff = sorted(p for p in a_acc.keys() & b_acc.keys() if a_acc[p] != b_acc[p])
        changed += len(diff)
        if diff:
            first.append({"record_id": k, "anchor": diff[0], "accepted": [a_acc[diff[0]], b_acc[diff[0]]]})
    return {
        "base": base["cache"]["path"], "other": other["cache"]["path"], "requests_compared": len(common),
        "tau": {"base": base["tau"], "other": other["tau"]}, "delta": deltas,
        "rounds_with_changed_acceptance": changed, "first_changes": first[:20],
    }
