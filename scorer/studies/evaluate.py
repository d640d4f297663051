"""``scorer eval``: replay a drafter checkpoint against one or more caches.

Named steps: load the checkpoint (config-less fields from the cache, reported) -> check it
against the cache -> score each sequence (score.py) -> aggregate the report (report.py).
The target model is never loaded: its embedding and output head come from the cache.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

import hscache
from hscache.store.integrity import check_expected_digest
from hscache.store.row_ranges import RowRangeView, check_other_arrays, plan_row_ranges, read_rows
from hscache.store.view import CacheView
from scorer.errors import ScorerError
from scorer.families import DEFAULT_FAMILY, family_named
from scorer.families.base import Drafter
from scorer.offline.scoring import EvalConfig, effective_config, load_drafter, score_rows, served_rule
from scorer.offline.sequences import SequenceResult
from scorer.report.build import build_report, compare_reports
from scorer.studies.distributed import evaluate_distributed
from scorer.studies.exact_slice import with_exact_slice

__all__ = ["EvalConfig", "evaluate", "evaluate_many", "evaluate_module", "load_drafter", "score_cache"]

_BLOCK_TOKENS = 2048  # tokens read at once: memory stays bounded by a few chunks whatever the cache size


def _rows(cache: CacheView, limit: int | None) -> range:
    n = len(cache)
    return range(n if limit is None else min(limit, n))


def score_cache(
    drafter: Any,
    cache: CacheView,
    config: EvalConfig,
    on_sequence: Callable[[SequenceResult], None] | None = None,
    rule: Any = None,
) -> list:
    """Every sequence of ``cache`` (up to ``config.limit``) scored by a loaded drafter, in row order,
    under ``rule`` (``served_rule``; None: chosen here once for the whole cache).

    The scored rows of the arrays no drafter reads (the target's top-k and logsumexp) are read too
    (``check_other_arrays``): a report that carries the cache's digest vouches for every row it covers.
    """
    rule = served_rule(cache, config) if rule is None else rule
    results = []
    # One slice per array per range of rows: per-sequence reads would decode each chunk many times.
    lengths = cache.index.column("length").to_numpy()[: len(_rows(cache, config.limit))]
    for rows in plan_row_ranges(lengths, _BLOCK_TOKENS):
        view = RowRangeView(cache, read_rows(cache, rows))
        results += score_rows(drafter, view, rows, config, on_sequence, rule)
        check_other_arrays(cache, rows)
    return results


def evaluate(
    checkpoint: str | Path,
    cache_path: str | Path,
    config: EvalConfig = EvalConfig(),
    on_sequence: Callable[[SequenceResult], None] | None = None,
    on_start: Callable[[int], None] | None = None,
) -> dict[str, Any]:
    """Score ``checkpoint`` against the cache at ``cache_path``; return the JSON-ready report.

    Progress: ``on_start(sequences)`` once the drafter is loaded, ``on_sequence(result)`` per sequence.

    Example:
        >>> report = evaluate("drafter/", "cache/")          # doctest: +SKIP
        >>> report["tau"]["per_request"], report["tau"]["pooled"]  # doctest: +SKIP
    """
    t0 = time.perf_counter()
    cache = hscache.open_cache(cache_path, allow_unsealed=config.allow_unsealed)
    check_expected_digest(cache, config.expect_digest, str(cache_path))
    drafter, loaded = load_drafter(checkpoint, cache, config)
    config = effective_config(drafter, config)
    rule = served_rule(cache, config)  # greedy, one-hot or probabilistic: chosen once for the run
    if on_start is not None:
        on_start(len(_rows(cache, config.limit)))
    results = score_cache(drafter, cache, config, on_sequence, rule)
    seconds = time.perf_counter() - t0
    report = build_report(
        results, cache=cache, drafter=drafter, loaded=loaded, config=config, seconds=seconds, rule=rule
    )
    # A compact cache (--states fp8): its exact slice scored from the source-dtype states too.
    return with_exact_slice(report, drafter, cache, config, results, rule, score_rows)


def evaluate_module(
    module_or_state_dict: torch.nn.Module | Mapping[str, torch.Tensor],
    cache: str | Path | CacheView,
    config: Any | Mapping[str, Any] | None = None,
    eval_config: EvalConfig | None = None,
    *,
    limit: int | None = None,
    family: str = DEFAULT_FAMILY,
) -> dict[str, Any]:
    """Score an in-memory drafter (a training loop's module, or its state_dict) without writing a file.

    Args:
        module_or_state_dict: a drafter module of a family with ``Family.from_module`` (its config is used
            when ``config`` is None; a target head it already has attached is reused, no cache read), or
            a state_dict with the checkpoint's keys.
        cache: a cache path/URL or an open ``CacheView`` (open it once outside the loop).
        config: the drafter's config (the family's config object) or HF config dict; required with a state_dict.
        eval_config: defaults to chain anchors and no DDTree (tau only, the cheapest replay).
        limit: only the first N sequences (wins over ``eval_config.limit``).
        family: the family of a state_dict (a module says its own: ``Drafter.family``; default the
            registry's ``DEFAULT_FAMILY``).

    Returns:
        The ``scorer eval`` report (``report["tau"]["pooled"]``...), checkpoint format "module".
        The module itself is not modified (a copy of its weights is scored, in eval mode).

    Raises:
        ScorerError subclasses: a config is missing or does not fit the weights or the cache.

    Example:
        >>> report = evaluate_module(drafter, cache)          # doctest: +SKIP
        >>> report["tau"]["pooled"]                           # doctest: +SKIP
    """
    t0 = time.perf_counter()
    eval_config = eval_config or EvalConfig(ddtree=(), anchors="chain")
    if limit is not None:
        eval_config = dataclasses.replace(eval_config, limit=limit)
    view = cache if isinstance(cache, CacheView) else hscache.open_cache(cache)
    name = module_or_state_dict.family if isinstance(module_or_state_dict, Drafter) else family
    readied = family_named(name)
    if readied.from_module is None:
        raise ScorerError(
            f"evaluate_module scores in-memory drafters of the families that have one; {name} has none"
        )
    drafter, loaded = readied.from_module(module_or_state_dict, view, config, eval_config)
    rule = served_rule(view, eval_config)
    results = score_cache(drafter, view, eval_config, rule=rule)
    report = build_report(
        results,
        cache=view,
        drafter=drafter,
        loaded=loaded,
        config=eval_config,
        seconds=time.perf_counter() - t0,
        rule=rule,
    )
    return with_exact_slice(report, drafter, view, eval_config, results, rule, score_rows)


def evaluate_many(
    checkpoint: str | Path,
    cache_paths: Sequence[str | Path],
    config: EvalConfig = EvalConfig(),
    on_sequence: Callable[[SequenceResult], None] | None = None,
    client: Any = None,
    on_start: Callable[[str, int], None] | None = None,
    expect_digests: Sequence[str] = (),
) -> dict[str, Any]:
    """Score one checkpoint on several caches: a report per cache plus paired deltas vs the first.

    Args:
        client: a ``distributed.Client``: score on that cluster (scorer/studies/distributed.py), same reports.
        on_start: ``on_start(cache_path, sequences)`` when scoring of a cache begins (progress).
        expect_digests: one pinned digest per cache (``--expect-digest``, in ``--cache`` order), or none.

    Raises:
        ScorerError: as many digests as caches are needed.
    """

    def started(path: str | Path) -> Callable[[int], None] | None:
        return None if on_start is None else lambda n: on_start(str(path), n)

    if expect_digests and len(expect_digests) != len(cache_paths):
        raise ScorerError(
            f"{len(expect_digests)} --expect-digest for {len(cache_paths)} --cache: give one per cache, in order"
        )
    configs = [replace(config, expect_digest=d) for d in expect_digests] or [config] * len(cache_paths)
    for path, c in zip(cache_paths, configs):  # every --cache said before the first is scored
        hscache.open_cache(path, allow_unsealed=c.allow_unsealed)
    if client is not None:
        reports = [
            evaluate_distributed(checkpoint, path, c, client, on_sequence=on_sequence, on_start=started(path))
            for path, c in zip(cache_paths, configs)
        ]
    else:
        reports = [
            evaluate(checkpoint, path, c, on_sequence, started(path)) for path, c in zip(cache_paths, configs)
        ]
    return {
        "reports": reports,
        "comparisons": [compare_reports(reports[0], other, config) for other in reports[1:]],
    }
