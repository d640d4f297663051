"""Aggregate per-sequence results into the eval report (a JSON-ready dict; schema
``schemas/eval_report.schema.json``), and compare two reports of one checkpoint."""

from __future__ import annotations

import functools
import operator
import random
from collections.abc import Sequence
from typing import Any

import numpy as np

from hscache import schemas
from hscache.store.info import cache_completeness
from hscache.store.view import CacheView
from scorer.documents import cache_block, run_stamp
from scorer.families import family_named
from scorer.metrics import (
    AcceptLen,
    acceptance_rates,
    bootstrap_ci,
    paired_bootstrap_delta,
    per_category_tau,
    pipeline_warnings,
    request_totals,
    tau_per_request_from_totals,
    tau_pooled_from_totals,
    tokens_per_round_histogram,
)
from scorer.offline import sampled_view
from scorer.offline.sequences import SequenceResult, result_summary
from scorer.report.text import token_pieces

__all__ = [
    "REPORT_SCHEMA_VERSION",
    "TAU_DEFINITIONS",
    "build_report",
    "compare_reports",
    "merge_results",
    "off_greedy_warning",
]

REPORT_SCHEMA_VERSION = 2  # 2: sampling.modes.*.n_sequences -> n_requests (issue 32)
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


TEACHER_FORCED_DEFINITION = (
    "training-style drafting (speculators' TTT loop): step j > 0 is fed the ground-truth token x[p+j] "
    "instead of the drafter's own d_j; accept_len is the mean count of leading correct slots (no +1). "
    "Served drafts (tau, acceptance) feed the drafter's own tokens, as vLLM does."
)


def merge_results(results: Sequence[SequenceResult]) -> list[SequenceResult]:
    """Results in cache row order, whatever order workers returned them in."""
    return sorted(results, key=lambda r: r.row)


def _samples(
    results: list[SequenceResult], cache: CacheView, n: int, seed: int, block_size: int
) -> list[dict]:
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
        out.append(
            {
                "record_id": result.record_id,
                "anchor": p,
                "accepted": acc,
                "tokens": result.chain.tokens[k],
                "context_tail": tokenizer.decode(x[max(0, p - 15) : p + 1]),
                # Per slot, the text each token adds (never a lone U+FFFD), and each run whole.
                "drafted": token_pieces(tokenizer, drafted, context=x[max(0, p - 15) : p + 1]),
                "target": token_pieces(tokenizer, target, context=x[max(0, p - 15) : p + 1]),
                "drafted_ids": drafted,
                "target_ids": target,
                "drafted_text": tokenizer.decode(drafted),
                "target_text": tokenizer.decode(target),
                "diverged_at_slot": acc + 1 if acc < avail else None,
            }
        )
    return out


def off_greedy_warning(rounds_cut: int, settings: dict[str, Any]) -> str:
    """The report's warning for rounds cut where the cached text leaves the target's greedy path, with
    the cause the cache's settings point to: a text the target did not generate (``--max-new-tokens 0``),
    or a half-precision cache, whose ``generate`` (incremental decode) can leave the teacher-forced argmax
    at near-ties (docs/extract.md): re-extracting it with --max-new-tokens would change nothing."""
    said = (
        f"{rounds_cut} rounds were cut short where the cached text leaves the target's greedy path; "
        "offline tau is then a lower bound"
    )
    dtype = settings.get("dtype")
    if not settings.get("max_new_tokens"):
        return f"{said} (the cached text is not the target's own: build the cache with --max-new-tokens N)"
    if dtype in ("bf16", "fp16"):
        return (
            f"{said} (a {dtype} cache: its greedy generation left the teacher-forced argmax at near-ties, "
            "docs/extract.md; an fp32 cache of the same prompts has none on the built-in targets)"
        )
    return f"{said} (the cached continuation is not the teacher-forced argmax path)"


def build_report(
    results: Sequence[SequenceResult],
    *,
    cache: CacheView,
    drafter: Any,
    loaded: Any,
    config: Any,
    seconds: float,
    rule: sampled_view.ServedRule | None = None,
) -> dict[str, Any]:
    """The eval report: every number, the config used, checkpoint hash, cache provenance, versions.

    ``rule``: the rule the run chose once (``sampled_view.served_rule``; None: chosen here from the
    cache and config); it gives the view the samples are matched on and adds its part of the report."""
    rule = sampled_view.served_rule(cache, config) if rule is None else rule
    results = merge_results(results)
    B = drafter.config.block_size
    chains = [r.chain for r in results]
    # anchors="chain" drafts only where the replays go: no per-slot acceptance, no train_accept_len.
    every_anchor = all(r.acceptance is not None for r in results)
    counts = (
        functools.reduce(operator.add, (r.acceptance for r in results)) if results and every_anchor else None
    )
    accept_len = sum((r.accept_len for r in results), AcceptLen(0, 0)) if every_anchor else AcceptLen(0, 0)
    acceptance = acceptance_rates(counts) if counts is not None else None
    tau = _tau_block(chains, config.n_boot, config.seed)
    # A proposer without weights has no training for its all-anchor accept length to be checked against
    # (a lookup's drafts run long inside repeated text, where one round covers many anchors).
    weighted = not hasattr(drafter, "parameters") or next(iter(drafter.parameters()), None) is not None
    warnings = pipeline_warnings(
        acceptance=acceptance,
        tau_pooled=tau["pooled"],
        train_accept_len=accept_len.mean if weighted else None,
        target_layer_ids=drafter.config.target_layer_ids,
        cache_layer_ids=cache.layer_ids,
    )
    warnings += list(getattr(loaded.report, "warnings", ()))  # drafter config vs this cache
    if not every_anchor:
        warnings.append(
            "--anchors chain drafted only the anchors the replays visit: per-position acceptance and "
            "train_accept_len need every anchor and are not reported (use --anchors all)"
        )
    notes, target_check = _target_notes(drafter, warnings)
    completeness = cache_completeness(cache)
    if not completeness["complete"]:
        warnings.append(_incomplete_warning(completeness))
    cut = sum(c.n_cut_off_greedy for c in chains)
    if cut:
        warnings.append(off_greedy_warning(cut, cache.settings))
    ddtree = {
        str(b): _tau_block([r.ddtree[b] for r in results], config.n_boot, config.seed) for b in config.ddtree
    }
    surrogate = {}
    for b in config.ddtree:
        total = sum(r.ddtree_surrogate[b][0] for r in results)
        count = sum(r.ddtree_surrogate[b][1] for r in results)
        surrogate[str(b)] = total / count if count else None
    # Records without a category still count, under their own name (sorting mixed None fails).
    categories = [r.category if r.category is not None else "(none)" for r in results]
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
        "anchors": {
            "mode": "all" if every_anchor else "chain",
            "drafted": sum(r.drafted_anchors for r in results),
        },
        "off_greedy": {"positions": sum(c.off_greedy_positions for c in chains), "rounds_cut_short": cut},
        "per_category": (
            {k: v.to_dict() for k, v in per_category_tau(chains, categories).items()}
            if any(r.category is not None for r in results)
            else {}
        ),
        "warnings": warnings,
        "notes": notes,
        "target_check": target_check,
        # on a sampled cache the drafts were matched against the sampled tokens: show those
        "samples": _samples(results, rule.view(cache), config.samples, config.seed, B),
        "per_request": [
            dict(
                result_summary(r),
                anchors=list(r.chain.anchors),
                accepted=list(r.chain.accepted),
                token_sha256=_token_sha256(cache, r.row),
            )
            for r in results
        ],
        "definitions": TAU_DEFINITIONS,
        "config": config.to_dict(),
        "drafter": {
            **drafter.config.to_hf_config(),
            "family": drafter.family,
            "attention_backend": drafter.backend_used,
        },
        "checkpoint": loaded.report.to_dict(),
        "cache": {
            **cache_block(cache),
            "provenance": cache.provenance,
            "complete": completeness["complete"],
            "committed_sequences": completeness["committed_sequences"],
            "expected_sequences": completeness["expected_sequences"],
        },
        **run_stamp(seconds),
    }
    summarize = family_named(drafter.family).summarize
    if summarize is not None:
        report["family_metrics"] = summarize(list(results))
    forced = _teacher_forced(results, B)
    if forced is not None:
        report["teacher_forced"] = forced
    trees = [r.extras.get("tree") for r in results]
    if config.tree is not None and all(t is not None for t in trees):
        steps, topk, tokens = config.tree
        report["tree"] = {
            "steps": steps,
            "topk": topk,
            "draft_tokens": tokens,
            "definition": "SGLang's EAGLE tree (speculative_num_steps, speculative_eagle_topk, "
            "speculative_num_draft_tokens): tokens per round of its greedy verification",
            "tau": _tau_block(trees, config.n_boot, config.seed),
        }
    rule.add_to_report(report, results, cache, config)
    schemas.validate(report, "eval_report")
    return report


def _teacher_forced(results: Sequence[SequenceResult], B: int) -> dict[str, Any] | None:
    """The training-style number beside the served one (EAGLE-3: ground-truth tokens into steps > 0)."""
    extras = [r.extras for r in results if r.extras.get("teacher_forced_acceptance") is not None]
    if not extras or len(extras) != len(results):
        return None
    counts = functools.reduce(operator.add, (e["teacher_forced_acceptance"] for e in extras))
    length = sum((e["teacher_forced_accept_len"] for e in extras), AcceptLen(0, 0))
    return {
        "definition": TEACHER_FORCED_DEFINITION,
        "acceptance": _acceptance_dict(acceptance_rates(counts), B),
        "accept_len": length.mean,
    }


def _target_notes(drafter: Any, warnings: list[str]) -> tuple[list[str], dict[str, Any] | None]:
    """The target-identity check (scorer/target_identity.py): a mismatch scored anyway is a warning,
    an unchecked target a note; returns (notes, the check as a dict)."""
    check = getattr(drafter, "target_check", None)
    if check is None:
        return [], None
    message = check.message()
    if check.status == "mismatch":
        warnings.append(message)
        return [], check.to_dict()
    return ([message] if message else []), check.to_dict()


def _incomplete_warning(completeness: dict[str, Any]) -> str:
    expected = completeness["expected_sequences"]
    of = f" of {expected}" if expected else ""
    why = (
        "a writer is still running"
        if completeness["writer"] is not None
        else "its extraction stopped before the end (resume it with the same extract command)"
    )
    return (
        f"the cache is INCOMPLETE: {completeness['committed_sequences']}{of} sequences committed, {why}; "
        "these numbers cover only the committed sequences"
    )


def _acceptance_dict(acceptance: Any, B: int) -> dict[str, Any]:
    if acceptance is None:
        return {"conditional": [None] * (B - 1), "unconditional": [None] * (B - 1), "counts": {}}
    return {
        "conditional": list(acceptance.conditional),
        "unconditional": list(acceptance.unconditional),
        "counts": acceptance.counts.to_dict(),
    }


def _token_sha256(cache: CacheView, row: int) -> str | None:
    """The sequence's token hash from the index, so that a comparison pairs only identical texts."""
    if "token_sha256" not in cache.index.column_names:
        return None
    return cache.index.column("token_sha256")[row].as_py()


def _keyed(report: dict[str, Any]) -> dict[tuple[str, int], dict[str, Any]]:
    """Per-request rows by (record id, n-th occurrence): a repeated record id still pairs up in order."""
    seen: dict[str, int] = {}
    rows = {}
    for row in report["per_request"]:
        n = seen.get(row["record_id"], 0)
        seen[row["record_id"]] = n + 1
        rows[(row["record_id"], n)] = row
    return rows


def _pair_requests(base: dict[str, Any], other: dict[str, Any]) -> tuple[list, dict[str, list[str]]]:
    """Requests both reports scored on the same token ids, and the others by reason.

    A request whose text differs between the caches (e.g. a bf16 greedy continuation that left the
    fp32 one) is not paired: its rounds sit at different anchors of a different sequence.
    """
    a_rows, b_rows = _keyed(base), _keyed(other)
    pairs, left_out = [], {"missing": [], "different_tokens": [], "no_rounds": []}
    for key in a_rows.keys() | b_rows.keys():
        a, b = a_rows.get(key), b_rows.get(key)
        if a is None or b is None:
            left_out["missing"].append(key[0])
        elif a.get("token_sha256") != b.get("token_sha256"):
            left_out["different_tokens"].append(key[0])
        elif not (a["rounds"] and b["rounds"]):
            left_out["no_rounds"].append(key[0])
        else:
            pairs.append((a, b))
    pairs.sort(key=lambda pair: pair[0]["row"])
    return pairs, {why: sorted(ids) for why, ids in left_out.items()}


def compare_reports(base: dict[str, Any], other: dict[str, Any], config: Any) -> dict[str, Any]:
    """Paired comparison of one checkpoint on two caches: tau deltas and rounds that changed.

    Requests pair up by record id and token ids (``requests_left_out`` lists the rest). Rounds are
    compared at the anchors both chains visit (``rounds_compared``): after a round's accepted count
    changes, the two chains step to different anchors until they meet again.

    Returns:
        base/other cache paths, ``requests_compared``, ``requests_left_out``, both tau blocks,
        ``delta`` (per_request, pooled: other - base with a paired bootstrap 95% interval, None when
        no request pairs up), ``rounds_compared``, ``rounds_with_changed_acceptance``, ``first_changes``.
    """
    pairs, left_out = _pair_requests(base, other)
    a_tot = np.array([[a["tokens"], a["rounds"]] for a, _ in pairs], dtype=float).reshape(-1, 2)
    b_tot = np.array([[b["tokens"], b["rounds"]] for _, b in pairs], dtype=float).reshape(-1, 2)
    deltas = {}
    for name, stat in (("per_request", tau_per_request_from_totals), ("pooled", tau_pooled_from_totals)):
        deltas[name] = (
            paired_bootstrap_delta(a_tot, b_tot, stat, config.n_boot, config.seed).to_dict()
            if pairs
            else None
        )
    compared, changed, first = 0, 0, []
    for a, b in pairs:
        a_acc, b_acc = dict(zip(a["anchors"], a["accepted"])), dict(zip(b["anchors"], b["accepted"]))
        common = a_acc.keys() & b_acc.keys()
        diff = sorted(p for p in common if a_acc[p] != b_acc[p])
        compared += len(common)
        changed += len(diff)
        if diff:
            first.append(
                {"record_id": a["record_id"], "anchor": diff[0], "accepted": [a_acc[diff[0]], b_acc[diff[0]]]}
            )
    return {
        "base": base["cache"]["path"],
        "other": other["cache"]["path"],
        "requests_compared": len(pairs),
        "requests_left_out": left_out,
        "tau": {"base": base["tau"], "other": other["tau"]},
        "delta": deltas,
        "rounds_compared": compared,
        "rounds_with_changed_acceptance": changed,
        "first_changes": first[:20],
    }
