"""From a cache to what a DFlash drafter consumes: the target head, its layers' positions in the
cache, the final norm its last layer is read after. Checks compatibility before anything is computed
(the checks and features every family shares are scorer.offline.sequences)."""

from __future__ import annotations

from functools import partial
from typing import Any

import torch

from hscache.capture.final_norm import KINDS, apply_final_norm
from hscache.store.view import CacheView
from scorer.errors import IncompatibleCacheError
from scorer.families.dflash.config import DFlashConfig
from scorer.families.dflash.model import DFlashDrafter
from scorer.offline.sequences import ContextNorm, check_fits, fit_problems

__all__ = ["attach_cache_head", "cache_fallbacks", "check_compatible", "context_norm", "feature_index"]


def cache_fallbacks(cache: CacheView) -> dict[str, Any]:
    """What a config-less checkpoint can take from the cache (reported as source "cache")."""
    target_config = cache.target_config
    rope = target_config.get("rope_parameters") or {}
    scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
    return {
        "target_layer_ids": tuple(cache.layer_ids),
        "rope_scaling": target_config.get("rope_scaling")
        or (scaling if scaling.get("rope_type", "default") != "default" else None),
        "mask_token_id": cache.mask_token_id,
        "vocab_size": cache.vocab_size,
        "rope_theta": target_config.get("rope_theta", rope.get("rope_theta")),
        "rms_norm_eps": target_config.get("rms_norm_eps"),
        "num_target_layers": target_config.get("num_hidden_layers"),
    }


def check_compatible(config: DFlashConfig, cache: CacheView, cache_name: str = "the cache") -> None:
    """Raise one IncompatibleCacheError naming every mismatch between drafter and cache."""
    layers, size, vocab = config.target_layer_ids, config.hidden_size, config.vocab_size
    problems = fit_problems(cache, cache_name, layer_ids=layers, feature_size=size, vocab_size=vocab)
    if not 0 <= config.mask_token_id < cache.vocab_size:
        problems.append(
            f"mask_token_id {config.mask_token_id} is outside the target vocabulary of {cache.vocab_size}"
        )
    check_fits(problems)


def feature_index(config: DFlashConfig, cache_layer_ids: list[int]) -> list[int]:
    """Positions in the cache's K axis of the drafter's layers, in the drafter's order."""
    return [cache_layer_ids.index(i) for i in config.target_layer_ids]


def attach_cache_head(
    drafter: DFlashDrafter, cache: CacheView, dtype: torch.dtype, device: str, own: dict | None = None
) -> None:
    """Attach the target's embedding and head from the cache, or the drafter's ``own`` ones
    (a speculators checkpoint's `embed_tokens`/`lm_head`/`d2t`) where its layout defines them."""
    own = own or {}
    head = cache.target_head() if {"embed_tokens", "lm_head"} - own.keys() else {}
    head = {**head, **own}
    embed = head["embed_tokens"].to(device=device, dtype=dtype)
    lm_head = (
        embed if head["lm_head"] is head["embed_tokens"] else head["lm_head"].to(device=device, dtype=dtype)
    )
    d2t = head.get("d2t")
    drafter.attach_target(embed, lm_head, None if d2t is None else d2t.to(device))


def context_norm(config: DFlashConfig, cache: Any, layout: str = "zlab") -> ContextNorm | None:
    """The final norm to apply to the drafter's last-target-layer feature, or None.

    z-lab and SpecForge read layer id i as transformers' ``hidden_states[i + 1]``: for the last
    layer L-1 that is after the final norm, while the cache holds the layer's raw output.
    speculators (vLLM aux ids) read the raw output, as vLLM captures it.

    Raises:
        IncompatibleCacheError: the drafter needs it and the cache has no final norm saved.
    """
    n_layers = cache.target_config.get("num_hidden_layers")
    if layout == "speculators" or n_layers is None or (n_layers - 1) not in config.target_layer_ids:
        return None
    head = cache.target_head()
    if "final_norm.weight" not in head:
        raise IncompatibleCacheError(
            f"drafter target_layer_ids {list(config.target_layer_ids)} include the last target layer "
            f"{n_layers - 1}, read as transformers' hidden_states[{n_layers}] (after the final norm), "
            "but this cache has no final norm saved (older hscache, or a norm it could not identify); "
            "re-extract it with this hscache"
        )
    kind = KINDS[int(head["final_norm.kind"][0])]
    fn = partial(apply_final_norm, kind, head["final_norm.weight"], float(head["final_norm.eps"][0]))
    return config.target_layer_ids.index(n_layers - 1), fn
