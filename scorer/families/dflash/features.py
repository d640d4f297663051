"""From a cache to what a drafter consumes: the target head, and per-sequence features in
``target_layer_ids`` order. Checks compatibility before anything is computed."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import torch

from hscache.capture.final_norm import KINDS, apply_final_norm
from hscache.store.view import CacheView
from scorer.config import DrafterConfig
from scorer.errors import IncompatibleCacheError
from scorer.model import DFlashDrafter

__all__ = [
    "ContextNorm",
    "attach_cache_head",
    "cache_fallbacks",
    "check_compatible",
    "check_scorable",
    "context_norm",
    "feature_index",
    "sequence_features",
]

# (slot in the drafter's K order, the target's final norm): turns the cached pre-norm output of
# the last target layer into transformers' hidden_states[L], what z-lab/SpecForge drafters read.
ContextNorm = tuple[int, Callable[[torch.Tensor], torch.Tensor]]


def check_scorable(cache: Any, cache_name: str = "the cache") -> None:
    """Raise one IncompatibleCacheError when ``cache`` lacks what scoring needs: the target's greedy
    tokens (``target_argmax``) and its head (``target/``). Caches imported from the peers' formats
    (``hscache import``) have neither: those files store no target logits or head."""
    imported = (cache.provenance or {}).get("imported") or {}
    origin = f" (imported from {imported['format']} files at {imported['source']})" if imported else ""
    if "target_argmax" not in cache.specs:
        raise IncompatibleCacheError(
            f"{cache_name}{origin} holds no target_argmax, and tau and acceptance compare the drafter's "
            "tokens with the target's greedy tokens: that format stores no target logits, so nothing can "
            "be scored; import speculators files with --target MODEL (computes them from their last layer) "
            "or score on a cache made by `hscache extract`"
        )
    try:
        _ = cache.vocab_size  # reads target/head.safetensors's header (sharded: the first shard's)
    except OSError as exc:
        raise IncompatibleCacheError(
            f"{cache_name}{origin} has no target/head.safetensors (the target's embedding and output "
            "head the drafter uses); score on a cache made by `hscache extract`"
        ) from exc


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


def check_compatible(config: DrafterConfig, cache: CacheView, cache_name: str = "the cache") -> None:
    """Raise one IncompatibleCacheError naming every mismatch between drafter and cache."""
    problems = []
    missing = [i for i in config.target_layer_ids if i not in cache.layer_ids]
    if missing:
        problems.append(
            f"drafter target_layer_ids {list(config.target_layer_ids)} need layers {missing} that "
            f"{cache_name} lacks (it has {cache.layer_ids}); re-extract with --layers "
            f"{','.join(map(str, config.target_layer_ids))}"
        )
    hidden = int(cache.specs["hidden_states"].row_shape[1])
    if hidden != config.hidden_size:
        problems.append(
            f"drafter hidden_size {config.hidden_size} != target hidden size {hidden} in {cache_name}"
        )
    vocab = cache.vocab_size
    if config.vocab_size != vocab:
        problems.append(
            f"drafter vocab_size {config.vocab_size} != target vocabulary {vocab} in {cache_name}"
        )
    if not 0 <= config.mask_token_id < vocab:
        problems.append(f"mask_token_id {config.mask_token_id} is outside the target vocabulary of {vocab}")
    if problems:
        raise IncompatibleCacheError("; ".join(problems))


def feature_index(config: DrafterConfig, cache_layer_ids: list[int]) -> list[int]:
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


def context_norm(config: DrafterConfig, cache: Any, layout: str = "zlab") -> ContextNorm | None:
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


def sequence_features(
    hidden_states: torch.Tensor,
    index: list[int],
    dtype: torch.dtype,
    device: str,
    norm: ContextNorm | None = None,
) -> torch.Tensor:
    """``[T, K_cache, H]`` cached states -> ``[T, K*H]`` drafter input (concatenated in drafter order).

    ``norm`` (from `context_norm`) is applied in the cache's dtype before any cast, as the target
    applied it, so the feature equals transformers' ``hidden_states[L]``.
    """
    picked = hidden_states[:, index] if index != list(range(hidden_states.shape[1])) else hidden_states
    if norm is not None:
        slot, fn = norm
        picked = picked.clone()
        picked[:, slot] = fn(picked[:, slot])
    return picked.reshape(picked.shape[0], -1).to(device=device, dtype=dtype)
