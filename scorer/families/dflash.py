"""The DFlash family (spec/dflash.md): block drafting from one forward, DDTree.

Its config mapping (scorer.config), model (scorer.model), layout readers (scorer.checkpoint,
scorer.formats) and per-sequence scoring (scorer.score) predate the family seam and stay where
they are; this module is the family's entry in the registry: how it is recognised, loaded and
scored on the shared replay loop.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from hscache.store.dtypes import DTYPES
from hscache.store.view import CacheView
from scorer.checkpoint import LoadedCheckpoint, load_checkpoint
from scorer.families.base import CheckpointProbe, Family
from scorer.features import (
    attach_cache_head,
    cache_fallbacks,
    check_compatible,
    context_norm,
    feature_index,
    sequence_features,
)
from scorer.model import DFlashDrafter
from scorer.score import SequenceResult, score_sequence, score_sequences_chain

__all__ = ["DFLASH", "category_of"]


def _claims(probe: CheckpointProbe) -> bool:
    # The default family: anything that is not a target head (DFlash's loader names what is
    # wrong with a file that turns out to be something else).
    return not probe.path.startswith("target:")


def _overrides(config: Any) -> dict[str, Any]:
    overrides = dict(config.overrides)
    if config.block_size is not None:
        overrides["block_size"] = config.block_size
    return overrides


def load(checkpoint: str | Path, cache: CacheView, config: Any) -> tuple[DFlashDrafter, LoadedCheckpoint]:
    """Load a DFlash checkpoint of any supported layout, check it against ``cache``, ready it."""
    loaded = load_checkpoint(
        checkpoint,
        overrides=_overrides(config),
        fallbacks=cache_fallbacks(cache),
        trust_checkpoint=config.trust_checkpoint,
        config_path=config.config_path,
    )
    check_compatible(loaded.config, cache, str(cache.path))
    dtype = DTYPES[config.dtype]
    drafter = DFlashDrafter(loaded.config)
    drafter.load_state_dict(loaded.state_dict)
    drafter = drafter.to(device=config.device, dtype=dtype).eval()
    attach_cache_head(drafter, cache, dtype, config.device, own=loaded.head)
    drafter.context_norm = context_norm(loaded.config, cache, loaded.report.layout)
    return drafter, loaded


def category_of(cache: CacheView, row: int) -> str | None:
    """The index's ``category`` of ``row`` (None when the cache has no categories)."""
    if "category" not in cache.index.column_names:
        return None
    value = cache.index.column("category")[row].as_py()
    return None if value is None else str(value)


def score_rows(
    drafter: DFlashDrafter,
    cache: CacheView,
    rows: Sequence[int],
    config: Any,
    on_sequence: Callable[[int], None] | None = None,
) -> list[SequenceResult]:
    """Score the cache's sequences ``rows`` (the unit of work the distributed path ships)."""
    index = feature_index(drafter.config, cache.layer_ids)
    dtype = DTYPES[config.dtype]
    # Per row, never the whole index as Python lists (a cache may index millions of sequences).
    record_ids, prompt_lens, lengths = (cache.index.column(c) for c in ("record_id", "prompt_len", "length"))
    norm = getattr(drafter, "context_norm", None)  # the last layer as hidden_states[L] (features.py)
    if config.anchors == "chain":  # all rows' replays in lockstep: one head projection per step
        sequences = [
            {
                "features": sequence_features(cache.hidden_states(row), index, dtype, config.device, norm),
                "token_ids": cache.token_ids(row),
                "target_argmax": cache.target_argmax(row),
                "prompt_len": prompt_lens[row].as_py(),
                "row": row,
                "record_id": record_ids[row].as_py(),
                "category": category_of(cache, row),
            }
            for row in rows
        ]
        results = score_sequences_chain(
            drafter,
            sequences,
            ddtree_budgets=tuple(config.ddtree),
            max_blocks_per_forward=config.max_blocks_per_forward,
            memory_gb=config.memory_gb,
        )
        if on_sequence:
            for row in rows:
                on_sequence(lengths[row].as_py() - prompt_lens[row].as_py())
        return results
    results = []
    for row in rows:
        features = sequence_features(cache.hidden_states(row), index, dtype, config.device, norm)
        results.append(
            score_sequence(
                drafter,
                features,
                cache.token_ids(row),
                cache.target_argmax(row),
                prompt_lens[row].as_py(),
                row=row,
                record_id=record_ids[row].as_py(),
                category=category_of(cache, row),
                ddtree_budgets=tuple(config.ddtree),
                max_blocks_per_forward=config.max_blocks_per_forward,
                anchors=config.anchors,
                memory_gb=config.memory_gb,
            )
        )
        if on_sequence:
            on_sequence(lengths[row].as_py() - prompt_lens[row].as_py())
    return results


DFLASH = Family(
    name="dflash",
    layouts=(
        "z-lab DFlash HF directory",
        "SpecForge DFlash export / training_state.pt",
        "speculators DFlash",
        "training pickles (.pt/.pth/.bin)",
    ),
    claims=_claims,
    load=load,
    score_rows=score_rows,
)
