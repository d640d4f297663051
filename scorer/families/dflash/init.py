"""``scorer init``: a fresh, randomly initialised DFlash drafter sized for a cache's target."""

from __future__ import annotations

from pathlib import Path

import hscache
from hscache.store.view import CacheView
from scorer.drafter_dir import check_drafter_dir, staged_drafter_dir
from scorer.errors import ScorerError
from scorer.families.base import check_new_drafter_sizes
from scorer.families.dflash.checkpoint import save_hf_checkpoint
from scorer.families.dflash.config import DFlashConfig
from scorer.families.dflash.model import DFlashDrafter
from scorer.layers import seeded_init
from scorer.offline.sequences import check_has_target
from scorer.target_identity import IDENTITY_KEY, cache_target_identity

__all__ = ["dflash_config_for_cache", "init_dflash"]


def dflash_config_for_cache(
    cache: CacheView,
    *,
    num_layers: int = 1,
    block_size: int = 8,
    layer_ids: list[int] | None = None,
    mask_token_id: int | None = None,
) -> DFlashConfig:
    """A Qwen3-style drafter config matching the cache's target (hidden size, vocab, rope, mask id);
    ``mask_token_id`` (``scorer init --mask-token-id``) chooses the mask id when the target's
    tokenizer names none, or replaces the one it names.

    Raises:
        ScorerError: no mask id (the tokenizer names none and none was given), or one outside the
            vocabulary.
    """
    check_has_target(cache, str(cache.path))
    check_new_drafter_sizes(cache, num_layers=num_layers, block_size=block_size)
    target = cache.target_config
    hidden = int(target["hidden_size"])
    heads = int(target.get("num_attention_heads", max(1, hidden // 64)))
    head_dim = int(target.get("head_dim") or hidden // heads)
    rope = target.get("rope_parameters") or {}
    if mask_token_id is None:
        if cache.mask_token_id is None:
            # z-lab's and SpecForge's DFlash configs carry mask_token_id explicitly for such targets
            raise ScorerError(
                f"{cache.path} has no mask token id (its tokenizer defines none): choose one with "
                f"scorer init --mask-token-id ID (an id below the vocabulary of {cache.vocab_size} "
                "the drafter never has to draft, e.g. an unused special token)"
            )
        mask_token_id = int(cache.mask_token_id)
    if not 0 <= int(mask_token_id) < cache.vocab_size:
        raise ScorerError(
            f"--mask-token-id {mask_token_id} is outside the target's vocabulary of {cache.vocab_size} "
            f"(ids 0-{cache.vocab_size - 1}); choose an id in it"
        )
    return DFlashConfig(
        hidden_size=hidden,
        intermediate_size=int(target.get("intermediate_size", 4 * hidden)),
        num_hidden_layers=num_layers,
        num_attention_heads=heads,
        num_key_value_heads=int(target.get("num_key_value_heads", heads)),
        head_dim=head_dim,
        rms_norm_eps=float(target.get("rms_norm_eps", 1e-6)),
        rope_theta=float(target.get("rope_theta", rope.get("rope_theta", 10000.0))),
        rope_scaling=None,
        vocab_size=cache.vocab_size,
        attention_bias=False,
        block_size=block_size,
        mask_token_id=int(mask_token_id),
        target_layer_ids=tuple(layer_ids if layer_ids is not None else cache.layer_ids),
        num_target_layers=int(target.get("num_hidden_layers", 0)) or None,
    )


def init_dflash(
    cache_path: str | Path,
    out: str | Path,
    *,
    num_layers: int = 1,
    block_size: int = 8,
    mask_token_id: int | None = None,
    seed: int = 0,
    overwrite: bool = False,
) -> tuple[DFlashConfig, DFlashDrafter]:
    """Write a random drafter for the cache at ``cache_path`` as an HF directory at ``out``.

    ``out`` is written whole (scorer/drafter_dir.py): a non-empty directory needs ``overwrite``;
    its config records the cache's target (``hscache_target``, scorer/target_identity.py) and the
    mask id (``mask_token_id``: the target tokenizer's unless given).
    """
    check_drafter_dir(out, overwrite)
    cache = hscache.open_cache(cache_path)
    config = dflash_config_for_cache(
        cache, num_layers=num_layers, block_size=block_size, mask_token_id=mask_token_id
    )
    drafter = seeded_init(lambda: DFlashDrafter(config), seed, std=0.02)  # norms stay at 1
    with staged_drafter_dir(out, overwrite) as staging:
        save_hf_checkpoint(
            staging, config, drafter.state_dict(), extra_config={IDENTITY_KEY: cache_target_identity(cache)}
        )
    return config, drafter
