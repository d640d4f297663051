"""``scorer eval``: replay a drafter checkpoint against one or more caches.

Named steps: load the checkpoint (config-less fields from the cache, reported) -> check it
against the cache -> score each sequence (score.py) -> aggregate the report (report.py).
The target model is never loaded: its embedding and output head come from the cache.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import hscache
from hscache.store.blocks import BlockView, plan_row_ranges, read_rows
from hscache.store.integrity import check_expected_digest
from hscache.store.view import CacheView
from scorer.distributed import evaluate_distributed
from scorer.errors import ScorerError
from scorer.report.build import build_report, compare_reports
from scorer.rows import EvalConfig, load_drafter, score_rows

__all__ = ["EvalConfig", "evaluate", "evaluate_many"]

_BLOCK_TOKENS = 2048  # tokens read at once: memory stays bounded by a few chunks whatever the cache size


def _rows(cache: CacheView, limit: int | None) -> range:
    n = len(cache)
    return range(n if limit is None else min(limit, n))


def evaluate(
    checkpoint: str | Path,
    cache_path: str | Path,
    config: EvalConfig = EvalConfig(),
    on_sequence: Callable[[int], None] | None = None,
) -> dict[str, Any]:
    """Score ``checkpoint`` against the cache at ``cache_path``; return the JSON-ready report.

    Example:
        >>> report = evaluate("drafter/", "cache/")          # doctest: +SKIP
        >>> report["tau"]["per_request"], report["tau"]["pooled"]  # doctest: +SKIP
    """
    t0 = time.perf_counter()
    cache = hscache.open_cache(cache_path, allow_unsealed=config.allow_unsealed)
    check_expected_digest(cache, config.expect_digest, str(cache_path))
    drafter, loaded = load_drafter(checkpoint, cache, config)
    results = []
    # One slice per array per block of rows: per-sequence reads would decode each chunk many times.
    lengths = cache.index.column("length").to_numpy()[: len(_rows(cache, config.limit))]
    for rows in plan_row_ranges(lengths, _BLOCK_TOKENS):
        results += score_rows(drafter, BlockView(cache, read_rows(cache, rows)), rows, config, on_sequence)
    return build_report(
        results, cache=cache, drafter=drafter, loaded=loaded, config=config, seconds=time.perf_counter() - t0
    )


def evaluate_many(
    checkpoint: str | Path,
    cache_paths: Sequence[str | Path],
    config: EvalConfig = EvalConfig(),
    on_sequence: Callable[[int], None] | None = None,
    client: Any = None,
    expect_digests: Sequence[str] = (),
) -> dict[str, Any]:
    """Score one checkpoint on several caches: a report per cache plus paired deltas vs the first.

    Args:
        client: a ``distributed.Client``: score on that cluster (scorer/distributed.py), same reports.
        expect_digests: one pinned digest per cache (``--expect-digest``, in ``--cache`` order), or none.

    Raises:
        ScorerError: as many digests as caches are needed.
    """
    if expect_digests and len(expect_digests) != len(cache_paths):
        raise ScorerError(
            f"{len(expect_digests)} --expect-digest for {len(cache_paths)} --cache: give one per cache, in order"
        )
    configs = [replace(config, expect_digest=d) for d in expect_digests] or [config] * len(cache_paths)
    if client is not None:
        reports = [
            evaluate_distributed(checkpoint, path, c, client, on_sequence=on_sequence)
            for path, c in zip(cache_paths, configs)
        ]
    else:
        reports = [evaluate(checkpoint, path, c, on_sequence) for path, c in zip(cache_paths, configs)]
    return {
        "reports": reports,
        "comparisons": [compare_reports(reports[0], other, config) for other in reports[1:]],
    }
