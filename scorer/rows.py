"""Score rows of one cache with one drafter: the unit of work shared by local and distributed eval.

`load_drafter` readies a checkpoint for a cache (config-less fields from the cache, checked against
it); `score_rows` replays the given sequences (score.py). `scorer.evaluate` runs them in one
process, `scorer.distributed` ships them to dask workers.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from hscache.capture.forward import DEFAULT_MEMORY_GB
from hscache.capture.target import check_device
from hscache.store.dtypes import DTYPES, SCORER_DTYPES
from hscache.store.view import CacheView
from scorer.checkpoint import LoadedCheckpoint, load_checkpoint
from scorer.errors import IncompatibleCacheError, ScorerError
from scorer.features import (
    attach_cache_head,
    cache_fallbacks,
    check_compatible,
    check_scorable,
    context_norm,
    feature_index,
    sequence_features,
)
from scorer.model import DFlashDrafter
from scorer.score import ANCHOR_MODES, SequenceResult, score_sequence, score_sequences_chain

__all__ = ["EvalConfig", "load_drafter", "score_rows"]


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
    anchors: str = "all"  # "chain": draft only where the chain / DDTree replays go (score.py)
    memory_gb: float = DEFAULT_MEMORY_GB  # [rows, V] logits working set beyond the weights
    trust_checkpoint: bool = False
    config_path: str | None = None  # a separate draft config (--config), e.g. SpecForge's
    overrides: dict[str, Any] = field(default_factory=dict)  # target_layer_ids, mask_token_id, rope_theta
    expect_digest: str | None = None  # refuse a cache whose root digest differs (hscache.cache_digest)
    allow_unsealed: bool = False  # read a cache without checksums (written before them)

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
    checkpoint: str | Path, cache: CacheView, config: EvalConfig
) -> tuple[DFlashDrafter, LoadedCheckpoint]:
    """Load, check against ``cache`` and ready a drafter (target head attached, eval mode).

    Raises:
        CheckpointError / UntrustedCheckpointError / IncompatibleCacheError with one-line messages.
    """
    if config.dtype not in SCORER_DTYPES:
        raise ScorerError(f"--dtype {config.dtype!r}; choose one of {', '.join(SCORER_DTYPES)}")
    if config.anchors not in ANCHOR_MODES:
        raise ScorerError(f"--anchors {config.anchors!r}; choose {' or '.join(ANCHOR_MODES)}")
    if not config.memory_gb > 0:
        raise ScorerError(f"--memory-gb {config.memory_gb}; pass a positive budget in GB, e.g. 2")
    if len(cache) == 0:
        # Every metric would be "-": say why instead of printing an empty report with exit 0.
        raise IncompatibleCacheError(
            f"cache {cache.path} has no committed sequences, so there is nothing to score; "
            f"see `hscache info {cache.path}` (an extraction still starting, or one that wrote nothing)"
        )
    check_device(config.device)
    check_scorable(cache, str(getattr(cache, "url", cache.path)))
    loaded = load_checkpoint(
        checkpoint,
        overrides=_overrides(config),
        fallbacks=cache_fallbacks(cache),
        trust_checkpoint=config.trust_checkpoint,
        config_path=config.config_path,
    )
    check_compatible(loaded.config, cache, str(cache.path))
    check_sizes(loaded, cache, config)
    dtype = DTYPES[config.dtype]
    drafter = DFlashDrafter(loaded.config)
    drafter.load_state_dict(loaded.state_dict)
    drafter = drafter.to(device=config.device, dtype=dtype).eval()
    attach_cache_head(drafter, cache, dtype, config.device, own=loaded.head)
    drafter.context_norm = context_norm(loaded.config, cache, loaded.report.layout)
    return drafter, loaded


def check_sizes(loaded: LoadedCheckpoint, cache: CacheView, config: EvalConfig) -> None:
    """Bound every size that comes from a flag, a config or the cache before anything is allocated.

    The block size must fit the cache's longest sequence, and one forward's attention working set
    (``max_blocks_per_forward`` blocks of B queries over up to longest + B keys, float32) must fit
    ``--memory-gb``; the drafter the config describes, built on the meta device (nothing
    allocated), must hold no more parameters than the checkpoint's weights (a config claiming
    10^9 layers or a huge intermediate size is refused instead of allocated).

    Raises:
        ScorerError: naming the flag or config field and the bound (one line).
    """
    B = int(loaded.config.block_size)
    longest = int(cache.index.column("length").to_numpy().max())
    source = "--block-size" if config.block_size is not None else "the drafter's block_size"
    if B > longest:
        raise ScorerError(
            f"{source} {B} is longer than the longest sequence in the cache ({longest} tokens); no block "
            f"could ever be drafted: pass a block size of at most {longest} (drafters use 4-16)"
        )
    working = config.max_blocks_per_forward * B * (longest + B) * 4
    if working > config.memory_gb * 2**30:
        raise ScorerError(
            f"{source} {B} needs ~{working / 2**30:.1f} GB per forward ({config.max_blocks_per_forward} blocks "
            f"of {B} queries over up to {longest + B} keys), more than --memory-gb {config.memory_gb}: pass a "
            "smaller block size or a larger --memory-gb"
        )
    import torch

    with torch.device("meta"):
        described = sum(p.numel() for p in DFlashDrafter(loaded.config).parameters())
    held = sum(t.numel() for t in loaded.state_dict.values())
    if described > 2 * held + (1 << 20):
        raise ScorerError(
            f"the drafter's config describes {described:,} parameters but the checkpoint holds {held:,}; "
            "its config.json (num_hidden_layers, hidden/intermediate sizes) does not match its weights"
        )


def _category(cache: CacheView, row: int) -> str | None:
    if "category" not in cache.index.column_names:
        return None
    value = cache.index.column("category")[row].as_py()
    return None if value is None else str(value)


def score_rows(
    drafter: DFlashDrafter,
    cache: CacheView,
    rows: Sequence[int],
    config: EvalConfig,
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
                "category": _category(cache, row),
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
                category=_category(cache, row),
                ddtree_budgets=tuple(config.ddtree),
                max_blocks_per_forward=config.max_blocks_per_forward,
                anchors=config.anchors,
                memory_gb=config.memory_gb,
            )
        )
        if on_sequence:
            on_sequence(lengths[row].as_py() - prompt_lens[row].as_py())
    return results
