"""``scorer compare``: several drafters, any families, scored on the same cache and the same rounds.

Every drafter replays the same cached sequences (same tokens, same target greedy path) through the
shared round loop, so per-request tau pairs up exactly: deltas against the first drafter come from
a paired bootstrap over requests (scorer.report.build.compare_reports). Drafting settings
(``num_speculative_tokens``, ``tree``) apply to the drafters they fit (autoregressive families);
block families keep their own block. Cost per round is the family's serving estimate (draft
forwards, FLOPs from the shapes) next to the measured offline scoring time on this device.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

import hscache
from hscache import schemas
from scorer.documents import cache_block, run_stamp
from scorer.errors import ScorerError
from scorer.families import family_for, probe_checkpoint
from scorer.offline.scoring import (
    EvalConfig,
    drafter_family,
    effective_config,
    load_drafter,
    score_rows,
    served_rule,
)
from scorer.offline.sequences import SequenceResult
from scorer.report.build import build_report, compare_reports
from scorer.studies.evaluate import score_cache
from scorer.studies.exact_slice import with_exact_slice
from scorer.target_identity import cache_target_identity, check_target, recorded_target_identity

__all__ = [
    "COMPARE_SCHEMA_VERSION",
    "TIMING_REPEATS",
    "WARMUP_ROUNDS",
    "compare_drafters",
    "round_time_summary",
]

COMPARE_SCHEMA_VERSION = 1


def _config_for(family: Any, config: EvalConfig) -> EvalConfig:
    # A family's own settings (Family.eval_options: e.g. n-gram's prompt lookup) reach it only.
    config = dataclasses.replace(
        config, overrides={k: v for k, v in config.overrides.items() if k in family.eval_options}
    )
    if family.autoregressive:
        return config
    return dataclasses.replace(config, num_speculative_tokens=None, tree=None)


def _drafting(report: dict[str, Any], family: Any) -> dict[str, Any]:
    sources = report["checkpoint"]["field_sources"]
    slots = len(report["acceptance"]["unconditional"])
    if family.autoregressive:
        return {"mode": "chain", "draft_slots": slots, "source": sources.get("num_speculative_tokens")}
    return {"mode": "block", "draft_slots": slots, "source": sources.get("block_size")}


def _mean_context(report: dict[str, Any]) -> float:
    anchors = [p for r in report["per_request"] for p in r["anchors"]]
    return sum(anchors) / len(anchors) if anchors else 0.0


# Timing a round: the first calls of a drafter pay one-time costs (kernel selection, allocator
# growth, lazy imports), and one call of a tiny drafter is short enough for a scheduler hiccup to
# multiply it: 198 ms and 19 ms were measured for the same drafter in one run with one warm-up
# call and one timing per round. So: a few untimed rounds first, each timed round run
# TIMING_REPEATS times keeping its fastest (the least disturbed), and the median over the rounds
# reported with half their interquartile range as the spread. On CPU the rounds run on one thread:
# a round of a small drafter is a few hundred tiny ops, and with torch's default thread pool each
# parallel op waits for every pool thread to be scheduled, which on a busy machine turned 1 ms
# rounds into 95 ms ones, steadily for a whole run (measured: the same compare, 94.6 then 1.1 ms).
WARMUP_ROUNDS = 3
TIMING_REPEATS = 3


@contextlib.contextmanager
def _one_thread_on_cpu(device: str) -> Iterator[None]:
    if not str(device).startswith("cpu"):
        yield
        return
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def round_time_summary(times: Sequence[float]) -> tuple[float | None, float | None]:
    """(median, half the interquartile range) of per-round seconds; (None, None) without any."""
    if not len(times):
        return None, None
    q1, median, q3 = np.percentile(np.asarray(times, dtype=np.float64), [25, 50, 75])
    return float(median), float(q3 - q1) / 2


def _time_rounds(
    family: Any, drafter: Any, cache: Any, report: dict[str, Any], tau: float, config: EvalConfig, rounds: int
) -> tuple[float | None, float | None, int]:
    """(median seconds, spread, rounds timed) of ``rounds`` served rounds (the first anchors the
    replay visited, spread over the first sequences): WARMUP_ROUNDS untimed rounds first, then each
    round's fastest of TIMING_REPEATS runs."""
    if family.time_round is None or rounds <= 0:  # timed_rounds=0: no timing asked for
        return None, None, 0
    from hscache.store.dtypes import DTYPES
    from scorer.offline.sequences import sequence_features

    index = [cache.layer_ids.index(i) for i in drafter.config.target_layer_ids]
    norm = getattr(drafter, "context_norm", None)
    picks = []
    for request in report["per_request"]:
        picks += [(request["row"], p) for p in request["anchors"][: max(1, rounds // 4)]]
        if len(picks) >= rounds:
            break
    if not picks:
        return None, None, 0
    picks = picks[:rounds]
    loaded: dict[int, Any] = {}

    def run(row: int, anchor: int) -> float:
        nonlocal loaded
        if row not in loaded:
            features = sequence_features(
                cache.hidden_states(row), index, DTYPES[config.dtype], config.device, norm
            )
            loaded = {row: (features, cache.token_ids(row))}
        features, tokens = loaded[row]
        seconds, _ = family.time_round(drafter, features, tokens, anchor, tau)
        return seconds

    with _one_thread_on_cpu(config.device):
        for n in range(WARMUP_ROUNDS):
            run(*picks[n % len(picks)])
        times = [min(run(row, anchor) for _ in range(TIMING_REPEATS)) for row, anchor in picks]
    median, spread = round_time_summary(times)
    return median, spread, len(times)


def compare_drafters(
    checkpoints: Sequence[str | Path],
    cache_path: str | Path,
    config: EvalConfig = EvalConfig(ddtree=()),
    on_sequence: Callable[[SequenceResult], None] | None = None,
    timed_rounds: int = 16,
    on_start: Callable[[str, int], None] | None = None,
) -> dict[str, Any]:
    """Score every checkpoint on ``cache_path``; one row per drafter, deltas against the first.

    Progress: ``on_start(checkpoint, sequences)`` when a drafter is loaded and its scoring begins,
    ``on_sequence(result)`` per sequence scored.

    Returns:
        The compare document (schemas/compare_report.schema.json); ``reports`` holds each
        drafter's full eval report.

    Raises:
        ScorerError (and its subclasses) with one-line messages: no checkpoint, a bad checkpoint,
        a drafter that does not fit the cache.
    """
    if not checkpoints:
        raise ScorerError("scorer compare needs at least one CKPT")
    t_start = time.perf_counter()
    cache = hscache.open_cache(cache_path)
    # Every CKPT's family and target said before the first is scored (a bad last one used to be
    # refused only after the others had been replayed).
    for checkpoint in checkpoints:
        probe = probe_checkpoint(checkpoint, config.config_path)
        family_for(probe)
        if not probe.path.startswith("target:"):  # a target head is the cache's own target
            check_target(
                recorded_target_identity(checkpoint, config.config_path),
                cache_target_identity(cache),
                allow_mismatch=config.allow_target_mismatch,
                where=str(getattr(cache, "url", cache.path)),
            )
    # Every drafter loaded, and so checked against the cache (its layers, sizes, vocabulary), before
    # the first is scored (a second drafter's missing layer was found only after the first's replay).
    loaded_drafters = []
    for checkpoint in checkpoints:
        family = family_for(probe_checkpoint(checkpoint, config.config_path))
        loaded_drafters.append(
            (checkpoint, family, *load_drafter(checkpoint, cache, _config_for(family, config)))
        )
    reports, rows = [], []
    for checkpoint, family, drafter, loaded in loaded_drafters:
        used = effective_config(drafter, _config_for(family, config))
        if on_start is not None:
            on_start(str(checkpoint), min(len(cache), used.limit or len(cache)))
        t0 = time.perf_counter()
        rule = served_rule(cache, used)  # chosen once per drafter
        results = score_cache(drafter, cache, used, on_sequence, rule)
        seconds = time.perf_counter() - t0
        report = build_report(
            results, cache=cache, drafter=drafter, loaded=loaded, config=used, seconds=seconds, rule=rule
        )
        with_exact_slice(report, drafter, cache, used, results, rule, score_rows)  # a compact cache's drift
        reports.append(report)
        family = drafter_family(drafter)
        tau = report["tau"]["pooled"] or 1.0
        cost = family.cost(drafter, tau, _mean_context(report)) if family.cost else {}
        params = sum(p.numel() for p in drafter.parameters())
        flops = cost.get("flops_per_round")
        round_seconds, spread, timed = _time_rounds(family, drafter, cache, report, tau, used, timed_rounds)
        rows.append(
            {
                "checkpoint": str(checkpoint),
                "family": family.name,
                "layout": report["checkpoint"].get("layout"),
                "checkpoint_sha256": report["checkpoint"]["sha256"],
                "drafting": _drafting(report, family),
                "requests": report["requests"],
                "rounds": report["rounds"],
                "tau": report["tau"],
                "delta_vs_first": None,
                "acceptance": {k: report["acceptance"][k] for k in ("conditional", "unconditional")},
                "train_accept_len": report["train_accept_len"],
                "teacher_forced": report.get("teacher_forced"),
                "ddtree": report["ddtree"],
                "tree": report.get("tree"),
                "cost": {
                    "draft_params": params,
                    "draft_forwards_per_round": cost.get("draft_forwards_per_round"),
                    "flops_per_round": flops,
                    "tau_per_gflop": (tau / (flops / 1e9)) if flops else None,
                    "draft_seconds_per_round": round_seconds,
                    "draft_seconds_per_round_spread": spread,
                    "timed_rounds": timed,
                    "timed_repeats": TIMING_REPEATS if timed else 0,
                    "scoring_seconds": seconds,
                    "scoring_seconds_per_round": seconds / report["rounds"] if report["rounds"] else None,
                },
                "warnings": report["warnings"],
            }
        )
    for row, report in zip(rows[1:], reports[1:]):
        comparison = compare_reports(reports[0], report, config)
        row["delta_vs_first"] = {
            "per_request": comparison["delta"]["per_request"],
            "pooled": comparison["delta"]["pooled"],
            "requests_compared": comparison["requests_compared"],
        }
    document = {
        "schema_version": COMPARE_SCHEMA_VERSION,
        "cache": cache_block(cache),
        "settings": {
            "num_speculative_tokens": config.num_speculative_tokens,
            "tree": None if config.tree is None else list(config.tree),
            "ddtree": list(config.ddtree),
            "dtype": config.dtype,
            "device": config.device,
            "limit": config.limit,
            "n_boot": config.n_boot,
            "seed": config.seed,
        },
        "definitions": {
            **reports[0]["definitions"],
            "delta_vs_first": "this drafter minus the first, paired bootstrap 95% interval over requests",
            "flops_per_round": "the family's serving estimate from the shapes: matmuls of the tokens a round "
            "pushes through the drafter, its head, and attention at the cache's mean anchor position",
            "scoring_seconds_per_round": "measured wall time of this offline replay on this device / rounds",
            "draft_seconds_per_round": "measured on this device: the median over timed_rounds served rounds of "
            "the drafter's work from the newly verified tokens to its last draft, its context already cached; "
            f"after {WARMUP_ROUNDS} untimed rounds, each round's fastest of timed_repeats runs",
            "draft_seconds_per_round_spread": "half the interquartile range of those timed rounds",
        },
        "drafters": rows,
        "reports": reports,
        **run_stamp(time.perf_counter() - t_start),
    }
    schemas.validate(document, "compare_report")
    return document
