"""A fresh DSpark drafter for a cache (``scorer init --family dspark``), written in the dense HF layout
vLLM 0.32.0 loads as ``Qwen3DSparkModel`` (model.py ``DSparkConfig.to_hf_config``)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

import hscache
from hscache.store.fsio import atomic_write_with
from scorer.drafter_dir import check_drafter_dir, staged_drafter_dir
from scorer.errors import ScorerError
from scorer.families.dflash.config import DFlashConfig
from scorer.families.dflash.init import dflash_config_for_cache
from scorer.families.dspark.model import DSparkConfig, DSparkDrafter
from scorer.layers import seeded_init
from scorer.target_identity import IDENTITY_KEY, cache_target_identity

__all__ = ["dspark_config_from", "init_dspark", "save_dspark"]


def dspark_config_from(base: DFlashConfig, markov_rank: int) -> DSparkConfig:
    """The DSpark drafter this project writes around a DFlash config: the anchor layout vLLM defaults to,
    a full vocabulary, a confidence head reading the Markov embedding (as speculators builds one).

    Raises:
        ScorerError: a Markov rank below 1.
    """
    if markov_rank < 1:
        raise ScorerError(
            f"markov_rank {markov_rank}: a DSpark drafter needs a Markov rank of at least 1 (e.g. 32)"
        )
    return DSparkConfig(
        base,
        markov_rank=markov_rank,
        draft_vocab_size=base.vocab_size,
        enable_confidence_head=True,
        confidence_head_with_markov=True,
        sample_from_anchor=True,
    )


def save_dspark(out: Path, config: DSparkConfig, drafter: DSparkDrafter, extra: dict | None = None) -> None:
    """``out/config.json`` + ``out/model.safetensors`` (already staged: the caller writes ``out`` whole)."""
    from safetensors.torch import save_file

    hf = {**config.to_hf_config(), **(extra or {})}
    text = json.dumps(hf, indent=2)
    tensors = {k: v.detach().cpu().contiguous() for k, v in sorted(drafter.state_dict().items())}
    atomic_write_with(out / "config.json", lambda p: p.write_text(text))
    atomic_write_with(
        out / "model.safetensors", lambda p: save_file(tensors, str(p), metadata={"format": "pt"})
    )


def init_dspark(
    cache_path: str | Path,
    out: str | Path,
    *,
    num_layers: int = 1,
    block_size: int = 8,
    mask_token_id: int | None = None,
    markov_rank: int = 32,
    seed: int = 0,
    overwrite: bool = False,
) -> DSparkConfig:
    """Write a random DSpark drafter (the anchor layout vLLM defaults to, a confidence head reading the
    Markov embedding, as speculators builds one) for the cache at ``cache_path``. ``block_size`` is the
    seam's: block_size - 1 drafted tokens, the query block vLLM runs (its ``block_size`` in config.json).

    Raises:
        ScorerError: a Markov rank below 1, a block too small to draft, or what DFlash's sizing refuses.
    """
    if block_size < 2:
        raise ScorerError(f"--block-size {block_size}: a block drafts block_size - 1 tokens; pass at least 2")
    check_drafter_dir(out, overwrite)
    cache = hscache.open_cache(cache_path)
    base = dflash_config_for_cache(
        cache, num_layers=num_layers, block_size=block_size, mask_token_id=mask_token_id
    )
    config = dspark_config_from(base, markov_rank)
    drafter = seeded_init(lambda: DSparkDrafter(config), seed, std=0.02)
    with torch.no_grad():  # speculators' MarkovHead init: markov_w1 N(0, 0.01) (model_definitions.py)
        gen = torch.Generator().manual_seed(seed + 1)
        drafter.markov_head.markov_w1.weight.copy_(
            torch.randn(drafter.markov_head.markov_w1.weight.shape, generator=gen) * 0.01
        )
    with staged_drafter_dir(out, overwrite) as staging:
        save_dspark(staging, config, drafter, {IDENTITY_KEY: cache_target_identity(cache)})
    return config
