"""A DFlash2 drafter at DFlash2's identity start, made from a DFlash checkpoint.

NeMo Automodel builds a fresh DFlash2 draft so that it "starts out numerically equal to plain
DFlash" (``draft_qwen3_dflash2.py``: unit self-tap, zero dynamic correction, zero successor
codebook; the predecessor codebook N(0, 0.02)): training moves it from there. `init_from_dflash`
writes exactly that start around a DFlash drafter's weights, in NeMo's key layout, so a DFlash2
run can be compared with its DFlash parent on one cache (the drafts are equal until trained).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from hscache.store.fsio import atomic_write_with
from hscache.store.view import CacheView
from scorer.drafter_dir import check_drafter_dir, staged_drafter_dir
from scorer.families.dflash.checkpoint import load_checkpoint
from scorer.families.dflash.features import check_compatible
from scorer.families.dflash2.model import DFlash2Config, DFlash2Drafter
from scorer.target_identity import (
    IDENTITY_KEY,
    cache_target_identity,
    check_target,
    recorded_target_identity,
)

__all__ = ["init_from_dflash"]


def init_from_dflash(
    dflash_checkpoint: str | Path,
    out: str | Path,
    *,
    selector_rank: int = 256,
    selector_top_k: int = 16,
    conv_group_size: int = 16,
    seed: int = 0,
    overwrite: bool = False,
    target_identity: dict[str, str] | None = None,
    cache: CacheView | None = None,
) -> Path:
    """Write ``out/config.json`` + ``out/model.safetensors``: the DFlash drafter's weights plus the
    identity convolutions and a no-op selector (NeMo's ``reset_parameters``). ``out`` is written
    whole (scorer/drafter_dir.py: a non-empty ``out`` needs ``overwrite``); its config records
    ``target_identity`` when given (scorer/target_identity.py). ``cache``: the cache it is made
    for; the DFlash drafter must fit it (its target, layers, sizes), checked before anything is
    written, so a drafter that cannot be scored there is never saved.

    Raises:
        CheckpointError: the DFlash checkpoint cannot be read.
        IncompatibleCacheError: the DFlash drafter was built for another target than ``cache``'s,
            or reads layers (or sizes) the cache does not have.
        ScorerError: ``out`` is a file, or a non-empty directory without ``overwrite``.
    """
    from safetensors.torch import save_file

    check_drafter_dir(out, overwrite)
    loaded = load_checkpoint(dflash_checkpoint)
    if cache is not None:
        where = str(getattr(cache, "url", cache.path))
        recorded = recorded_target_identity(dflash_checkpoint)
        check_target(recorded, cache_target_identity(cache), allow_mismatch=False, where=where)
        check_compatible(loaded.config, cache, where)
    config = DFlash2Config(
        loaded.config,
        conv_group_size=conv_group_size,
        selector_rank=selector_rank,
        selector_top_k=min(selector_top_k, loaded.config.vocab_size),
    )
    drafter = DFlash2Drafter(config)
    state = drafter.state_dict()
    state.update(loaded.state_dict)
    gen = torch.Generator().manual_seed(seed)
    for key, value in state.items():
        if key.endswith("base_kernel"):
            value.zero_()
            value[:, 0, :] = 1.0  # unit self-tap
        elif key.endswith("kernel_projection.weight") or key.endswith("successor_codebook"):
            value.zero_()
        elif key.endswith("predecessor_codebook"):
            value.copy_(torch.randn(value.shape, generator=gen) * 0.02)
        elif key.endswith("hidden_projection.weight"):
            value.copy_(torch.randn(value.shape, generator=gen) * 0.02)  # NeMo: the model init, std 0.02
    hf_config = config.to_hf_config()
    if target_identity:
        hf_config[IDENTITY_KEY] = target_identity
    text = json.dumps(hf_config, indent=2)
    tensors = {k: v.detach().cpu().contiguous() for k, v in sorted(state.items())}
    with staged_drafter_dir(out, overwrite) as staging:
        atomic_write_with(staging / "config.json", lambda p: p.write_text(text))
        atomic_write_with(
            staging / "model.safetensors", lambda p: save_file(tensors, str(p), metadata={"format": "pt"})
        )
    return Path(out)
