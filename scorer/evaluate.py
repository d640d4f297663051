"""``scorer eval``: replay a drafter checkpoint against one or more caches.

Named steps: load the checkpoint (config-less fields from the cache, reported) -> check it
against the cache -> score each sequence (score.py) -> aggregate the report (report.py).
The target model is never loaded: its embedding and output head come from the cache.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

import hscache
from hscache.capture.target import check_device
from hscache.store.blocks import BlockView, plan_row_ranges, read_rows
from scorer.checkpoint import LoadedCheckpoint, load_checkpoint
from scorer.errors import ScorerError
from scorer.features import (
    attach_cache_head,
    cache_fallbacks,
    check_compatible,
    check_scorable,
    feature_index,
    sequence_features,
)
from scorer.model import DFlashDrafter
from scorer.report.build import build_report, compare_reports
from scorer.score import SequenceResult, score_sequence

__all__ = ["EvalConfig", "evaluate", "evaluate_many", "load_drafter", "score_rows"]

_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
_BLOCK_TOKENS = 2048  # tokens read at once: memory stays bounded by a few chunks whatever the cache size


@dataclass(frozen=True)
class EvalConfig:
    """Everything ``scorer eval`` takes besides the checkpoint and caches; flags mirror the names."""

    device: str = "cpu"
    dtype: str = "fp32"
    block_size: int | None = None
    ddtree: tuple[int, ...] = (8, 32, 128)
    limit: int | None = None
    samples: int = 0
    seed: int = 0
    n_boot: int = 1000
    max_blocks_per_forward: int = 64
    trust_checkpoint: bool = False
    overrides: dict[str, Any] = field(default_factory=dict)  # target_layer_ids, mask_token_id, rope_theta

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["ddtree"] = list(self.ddtree)
        d["overrides"] = {k: list(v) if isinstance(v, tuple) else v for k, v in self.overrides.items()}
        return d


def _overrides(config: EvalConfig) -> dict[str, Any]:
    overrides = dict(config.overrides)
    if config.block_size is not None:
        overrides["block_size"] = config.block_size
    return overrides


def load_drafter(
    checkpoint: str | Path, cache: Any, config: EvalConfig
) -> tuple[DFlashDrafter, LoadedCheckpoint]:
    """Load, check against ``cache`` and ready a drafter (target head attached, eval mode).

    Raises:
        CheckpointError / UntrustedCheckpointError / IncompatibleCacheError with one-line messages.
    """
    if config.dtype not in _DTYPES:
        raise ScorerError(f"--dtype {config.dtype!r}; choose bf16 or fp32")
    check_device(config.device)
    check_scorable(cache, str(getattr(cache, "url", cache.path)))
    loaded = load_checkpoint(
        checkpoint,
        overrides=_overrides(config),
        fallbacks=cache_fallbacks(cache),
        trust_checkpoint=config.trust_checkpoint,
    )
    check_compatible(loaded.config, cache, str(cache.path))
    dtype = _DTYPES[config.dtype]
    drafter = DFlashDrafter(loaded.config)
    drafter.load_state_dict(loaded.state_dict)
    drafter = drafter.to(device=config.device, dtype=dtype).eval()
    attach_cache_head(drafter, cache, dtype, config.device)
    return drafter, loaded


def _category(cache: Any, row: int) -> str | None:
    if "category" not in cache.index.column_names:
        return None
    value = cache.index.column("category")[row].as_py()
    return None if value is None else str(value)


def score_rows(
    drafter: DFlashDrafter,
    cache: Any,
    rows: Sequence[int],
    config: EvalConfig,
    on_sequence: Callable[[int], None] | None = None,
) -> list[SequenceResult]:
    """Score the cache's sequences ``rows`` (the unit of work the distributed path ships)."""
    index = feature_index(drafter.config, cache.layer_ids)
    dtype = _DTYPES[config.dtype]
    record_ids = cache.index.column("record_id").to_pylist()
    prompt_lens = cache.index.column("prompt_len").to_pylist()
    lengths = cache.index.column("length").to_pylist()
    results = []
    for row in rows:
        features = sequence_features(cache.hidden_states(row), index, dtype, config.device)
        results.append(
            score_sequence(
                drafter,
                features,
                cache.token_ids(row),
                cache.target_argmax(row),
                prompt_lens[row],
                row=row,
                record_id=record_ids[row],
                category=_category(cache, row),
                ddtree_budgets=tuple(config.ddtree),
                max_blocks_per_forward=config.max_blocks_per_forward,
            )
        )
        if on_sequence:
            on_sequence(lengths[row] - prompt_lens[row])
    return results


def _rows(cache: Any, limit: int | None) -> list[int]:
    n = len(cache)
    return list(range(n if limit is None else min(limit, n)))


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
    cache = hscache.open_cache(cache_path)
    drafter, loaded = load_drafter(checkpoint, cache, config)
    results = []
    # One slice per array per block of rows: per-sequence reads would decode each chunk many times.
    lengths = cache.index.column("length").to_pylist()[: len(_rows(cache, config.limit))]
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
) -> dict[str, Any]:
    """Score one checkpoint on several caches: a report per cache plus paired deltas vs the first.

    Args:
        client: a ``distributed.Client``: score on that cluster (scorer/distributed.py), same reports.
    """
    if client is not None:
        from scorer.distributed import evaluate_distributed  # lazy: distributed imports this module

        reports = [
            evaluate_distributed(checkpoint, path, config, client, on_sequence=on_sequence)
            for path in cache_paths
        ]
    else:
        reports = [evaluate(checkpoint, path, config, on_sequence) for path in cache_paths]
    return {
        "reports": reports,
        "comparisons": [compare_reports(reports[0], other, config) for other in reports[1:]],
    }
