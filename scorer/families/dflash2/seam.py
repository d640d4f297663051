"""DFlash2 as a drafter family: DFlash's layouts with DFlash2's config keys and tensors.

A checkpoint is DFlash2 when its architecture names DFlash2 (NeMo's ``Qwen3DFlash2DraftModel``,
z-lab's ``DFlash2DraftModel``), its ``dflash_config`` sets a DFlash2 key, or its weights hold the
convolutions or the selector. The DFlash loader reads everything else (scorer.families.dflash);
the drafts of every anchor are the selector's paths (scorer.families.dflash.score), replayed by the shared loop.
This module holds the functions of the family's row (scorer/families/dflash2/__init__.py binds them lazily).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

from scorer.errors import CheckpointError
from scorer.families.base import CheckpointProbe, OnlineOptions, Proposer
from scorer.families.dflash import seam as dflash
from scorer.families.dflash.checkpoint import (
    CheckpointVariant,
    LoadedCheckpoint,
    load_checkpoint,
    variant_tensor_problems,
)
from scorer.families.dflash2.model import DFlash2Config, DFlash2Drafter

__all__ = ["VARIANT", "build_dflash2", "claims", "cost", "effective_config", "init", "load", "online"]

_DEFAULTS = {"conv_kernel_size": 2, "conv_group_size": 16, "selector_rank": 256, "selector_top_k": 16}
VARIANT = CheckpointVariant(
    config_keys=tuple(_DEFAULTS),
    architectures=("DFlash2DraftModel", "Qwen3DFlash2DraftModel"),
    tensor_markers=(".attention_conv.", ".mlp_conv.", "candidate_selector."),
)


def claims(probe: CheckpointProbe) -> bool:
    config = probe.config or {}
    archs = config.get("architectures") or []
    dflash_config = config.get("dflash_config") or {}
    keys = probe.weight_keys or frozenset()
    return (
        any(a in VARIANT.architectures for a in archs)
        or any(k in dflash_config for k in VARIANT.config_keys)
        or any(m in k for k in keys for m in VARIANT.tensor_markers)
    )


def build_dflash2(loaded: LoadedCheckpoint) -> DFlash2Drafter:
    """The DFlash2 drafter of a checkpoint read with VARIANT: backbone, convolutions, selector.

    Raises:
        CheckpointError: a DFlash2 setting of the wrong kind, or tensors that do not fit it
            (missing, unknown or misshapen keys, each named).
    """
    settings = {**_DEFAULTS}
    for key, value in loaded.variant_config.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise CheckpointError(
                f"{loaded.report.path}: dflash_config.{key} {value!r} must be a positive integer"
            )
        settings[key] = value
    c = loaded.config
    if c.hidden_size % settings["conv_group_size"]:
        raise CheckpointError(
            f"{loaded.report.path}: conv_group_size {settings['conv_group_size']} does not divide "
            f"hidden_size {c.hidden_size}"
        )
    if settings["selector_top_k"] > c.vocab_size:
        raise CheckpointError(
            f"{loaded.report.path}: selector_top_k {settings['selector_top_k']} exceeds the vocabulary of {c.vocab_size}"
        )
    drafter = DFlash2Drafter(DFlash2Config(c, **settings))
    want = {k: v for k, v in drafter.state_dict().items() if any(m in k for m in VARIANT.tensor_markers)}
    got = loaded.variant_state
    if problems := variant_tensor_problems(want, got):
        raise CheckpointError(
            f"{loaded.report.path}: not a DFlash2 drafter of this config: {'; '.join(problems)}"
        )
    drafter.load_state_dict({**loaded.state_dict, **got})
    return drafter


def load(checkpoint: str | Path, cache: Any, config: Any) -> tuple[DFlash2Drafter, LoadedCheckpoint]:
    return dflash.load(checkpoint, cache, config, variant=VARIANT, build=build_dflash2)


def online(checkpoint: str | Path, target: Any, options: OnlineOptions) -> tuple[list[int], Proposer, Any]:
    # No online DDTree (its row declares no online_trees), for the reason effective_config gives offline.
    return dflash.online(checkpoint, target, options, variant=VARIANT, build=build_dflash2)


def effective_config(config: Any) -> Any:
    # DFlash2 serves the selector's path; DDTree is built from per-slot top-K alone and would
    # score a different drafter, so it is not run (the report's config says so).
    return replace(config, ddtree=())


def cost(drafter: DFlash2Drafter, tau: float, context: float) -> dict[str, Any]:
    """DFlash's round plus the convolutions' projections on the B block rows (counted by the
    layers' linear parameters) and the selector's walk: the hidden projection and one rank-r
    product per candidate on each of the B-1 slots."""
    out = dflash.cost(drafter, tau, context)
    c = drafter.config
    selector = 2.0 * c.hidden_size * c.selector_rank + 2.0 * c.selector_top_k * c.selector_rank * 2
    out["flops_per_round"] += selector * (c.block_size - 1)
    return out


def init(cache_path: str | Path, out: str | Path, *, from_dir: str | Path, **options: Any) -> DFlash2Config:
    """``scorer init --family dflash2 --from DIR``: the DFlash drafter at ``from_dir`` at DFlash2's
    identity start (init.py), recording the cache's target; its config."""
    import hscache
    from scorer.families.dflash2.init import init_from_dflash
    from scorer.target_identity import cache_target_identity

    view = hscache.open_cache(cache_path)  # the parent is checked against it before anything is written
    identity = cache_target_identity(view)
    path = init_from_dflash(from_dir, out, target_identity=identity, cache=view, **options)
    return build_dflash2(load_checkpoint(path, variant=VARIANT)).config
