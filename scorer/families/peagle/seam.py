"""The P-EAGLE family on the seam: EAGLE-3's loader, drafting and replay with `PEagleDrafter` (model.py),
its speculators layout (``speculators_model_type: peagle``, speculators 0.9 ``PEagleSpeculatorConfig``), and
``scorer init --family peagle``."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import hscache
from hscache.store.view import CacheView
from scorer.drafter_dir import check_drafter_dir
from scorer.errors import CheckpointError, IncompatibleCacheError, ScorerError
from scorer.families.base import CheckpointProbe, OnlineOptions, Proposer, checkpoint_model
from scorer.families.eagle3.config import NEMO_ARCHITECTURE
from scorer.families.eagle3.init import eagle3_config_for_cache, publish_eagle3
from scorer.families.eagle3.layouts import Eagle3Variant, load_eagle3
from scorer.families.eagle3.online import captured_layers, eagle3_proposer, load_online
from scorer.families.eagle3.seam import cost as eagle3_cost
from scorer.families.peagle.model import PEagleDrafter
from scorer.formats.files import read_json, resolve_files
from scorer.layers import seeded_init
from scorer.offline.sequences import layer_fit_problem

__all__ = [
    "SPECULATORS_TYPE",
    "claims",
    "cost",
    "effective_config",
    "init",
    "load",
    "online",
    "served_mask_token",
    "train",
    "vllm_settings",
]

SPECULATORS_TYPE = "peagle"  # speculators 0.9 models/peagle/config.py; vLLM's speculators reader knows it
# EAGLE-3's loaders read P-EAGLE as: its speculators type, its module, vLLM's embedding rule for it.
VARIANT = Eagle3Variant(SPECULATORS_TYPE, PEagleDrafter, own_embedding_unless_identical=True)
ARCHITECTURES = ("PEagleSpeculator", "PEagleDraftModel")
# Options vLLM's speculators reader does not pass on for a speculators peagle config (configs/speculators/algos.py:53-87 sets
# draft_vocab_size, target_hidden_size, norm_before_residual, norm_before_fc and the mask token only), so
# vLLM serves such a drafter without them: refused by name rather than scored as it was not trained.
_NOT_SERVED = ("fc_norm", "norm_output")


def claims(probe: CheckpointProbe) -> bool:
    config = probe.config or {}
    archs = config.get("architectures") or []
    return (
        config.get("speculators_model_type") == SPECULATORS_TYPE
        or any(a in ARCHITECTURES for a in archs)
        or (NEMO_ARCHITECTURE in archs and bool(config.get("parallel_drafting")))  # NeMo's P-EAGLE
    )


def effective_config(config: Any) -> Any:
    # One forward drafts a chain of K at every anchor; trees and DDTree are other families' modes.
    return dataclasses.replace(config, ddtree=(), anchors="all", tree=None)


def load(checkpoint: str | Path, cache: CacheView, config: Any) -> tuple[PEagleDrafter, Any]:
    """EAGLE-3's loader with the P-EAGLE module, its mask token from the config, and vLLM's embedding rule.

    Raises:
        CheckpointError: no mask_token_id, an option vLLM does not serve for peagle, or what EAGLE-3's
            loader refuses (one line each).
    """
    if config.tree is not None:
        raise CheckpointError(
            f"{checkpoint}: --tree does not apply to P-EAGLE (one forward drafts a chain of K)"
        )
    mask = _config_mask_token(checkpoint, config.config_path, config.overrides)
    plain = dataclasses.replace(
        config, overrides={k: v for k, v in config.overrides.items() if k != "mask_token_id"}
    )
    drafter, loaded = load_eagle3(
        checkpoint,
        cache,
        plain,
        variant=VARIANT,
    )
    _set_mask_token(checkpoint, drafter, mask)
    return drafter, loaded


def online(checkpoint: str | Path, target: Any, options: OnlineOptions) -> tuple[list[int], Proposer, Any]:
    """``scorer online`` for P-EAGLE: the loader's checks and mask token, read against the live target; the
    proposer is EAGLE-3's (``eagle3_proposer``), whose ``draft_one_anchor`` is P-EAGLE's one-forward first
    pass (model.py), the same code the offline replay is checked against (tests/scorer/test_peagle.py).

    Raises:
        CheckpointError: a setting other than --mask-token-id, no mask token, or an option vLLM does not
            serve for peagle (one line each); IncompatibleCacheError: a mismatch with the target.
    """
    if other := sorted(key for key in options.overrides if key != "mask_token_id"):
        flags = ", ".join("--" + name.replace("_", "-") for name in other)
        raise CheckpointError(
            f"{checkpoint}: {flags} do not apply to a P-EAGLE drafter (drafting: --num-speculative-tokens K, "
            "--mask-token-id ID)"
        )
    mask = _config_mask_token(checkpoint, options.config_path, options.overrides)
    drafter, report = load_online(
        checkpoint,
        target,
        options,
        variant=VARIANT,
    )
    _set_mask_token(checkpoint, drafter, mask)
    return captured_layers(drafter)[0], eagle3_proposer(drafter), report


def _config_mask_token(checkpoint: str | Path, config_path: str | None, overrides: dict[str, Any]) -> int:
    """The parallel slots' token: ``--mask-token-id``, else where vLLM reads it (``served_mask_token``).

    Raises:
        CheckpointError: an option vLLM does not pass to a peagle drafter, or no mask token (named).
    """
    _, _, raw = resolve_files(Path(checkpoint))
    raw = (read_json(Path(config_path)) if config_path else raw) or {}
    # A flat (SpecForge, NeMo) config reaches vLLM's llama_eagle3.py as it is, which reads fc_norm (line 231)
    # and whose parallel drafting feeds no state back (norm_output changes nothing).
    speculators = "speculators_model_type" in raw
    served_off = [key for key in _NOT_SERVED if speculators and raw.get(key)]
    if served_off:
        raise CheckpointError(
            f"{checkpoint}: {', '.join(served_off)} set, which vLLM 0.32.0 does not pass to a peagle drafter "
            "(transformers_utils/configs/speculators/algos.py update_peagle): it would serve another model"
        )
    mask = overrides.get("mask_token_id", served_mask_token(raw))
    if mask is None:
        raise CheckpointError(
            f"{checkpoint}: no mask_token_id in its config; vLLM's parallel drafting needs it (the token of "
            "the parallel slots; SpecForge resolves one at training time and saves none): add "
            '"mask_token_id": ID to config.json or pass --mask-token-id'
        )
    return int(mask)


def _set_mask_token(checkpoint: str | Path, drafter: PEagleDrafter, mask: int) -> None:
    if not 0 <= mask < drafter.config.vocab_size:
        raise CheckpointError(
            f"{checkpoint}: mask_token_id {mask} is outside the vocabulary 0..{drafter.config.vocab_size - 1}"
        )
    drafter.pard_token = mask


def served_mask_token(raw: dict[str, Any]) -> int | None:
    """The parallel slots' token as vLLM 0.32.0 reads it from the drafter's config.json, in its order
    (``v1/spec_decode/llm_base_proposer.py`` ``_init_parallel_drafting_params``, lines 362-373):
    ``dflash_config.mask_token_id`` (where SpecForge's trainer also looks, training/model_utils.py),
    ``mask_token_id`` (speculators), ``dspark_noise_token_id``, ``pard_token``, ``ptd_token_id``; None: none."""
    dflash = raw.get("dflash_config")
    if isinstance(dflash, dict) and "mask_token_id" in dflash:
        return dflash["mask_token_id"]
    if raw.get("mask_token_id") is not None:
        return raw["mask_token_id"]
    for key in ("dspark_noise_token_id", "pard_token", "ptd_token_id"):
        if key in raw:
            return raw[key]
    return None


def cost(drafter: PEagleDrafter, tau: float, context: float) -> dict[str, Any]:
    """One served round: EAGLE-3's rows (the ~tau newly verified ones and K-1 more, the head on K), all in
    ONE forward (the K-1 mask slots instead of K-1 chained steps)."""
    return {**eagle3_cost(drafter, tau, context), "draft_forwards_per_round": 1}


def vllm_settings(checkpoint: str | Path, drafter: Any) -> dict[str, Any]:
    """``VllmServing.settings``: EAGLE-3 with ``parallel_drafting`` (what vLLM's speculators reader makes of a
    peagle config, transformers_utils/configs/speculators/base.py:133-134; the method must be named:
    without it vLLM 0.32.0 takes the directory for a ``draft_model``)."""
    return {**checkpoint_model(checkpoint, drafter), "parallel_drafting": True}


def _config_json(config: Any, mask_token_id: int) -> dict[str, Any]:
    """What speculators' PEagleSpeculatorConfig adds to / changes in an Eagle3Speculator config."""
    return {
        "speculators_model_type": SPECULATORS_TYPE,
        "architectures": ["PEagleSpeculator"],
        "mask_token_id": int(mask_token_id),
        "speculators_config": {
            "algorithm": SPECULATORS_TYPE,
            "proposal_methods": [
                {"proposal_type": "greedy", "speculative_tokens": config.num_speculative_tokens}
            ],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": None, "architectures": []},
        },
    }


def _mask_token(cache: CacheView, cache_path: str | Path, mask_token_id: int | None) -> int:
    mask = mask_token_id if mask_token_id is not None else cache.mask_token_id
    if mask is None:
        raise ScorerError(
            f"{cache_path} records no mask token; pass --mask-token-id ID (a token id the target never "
            "emits, e.g. its tokenizer's mask or an unused special token)"
        )
    return int(mask)


def _make(mask: int) -> Callable[[Any], PEagleDrafter]:
    def make(config: Any) -> PEagleDrafter:
        drafter = PEagleDrafter(config)
        drafter.pard_token = mask
        return drafter

    return make


def _publisher(mask: int) -> Callable[..., None]:
    """EAGLE-3's publisher writing speculators' P-EAGLE layout (mask_hidden is in the state dict)."""

    def publish(
        out: str | Path, overwrite: bool, cache: CacheView, config: Any, *rest: Any, extra_config: Any = None
    ) -> None:
        extra = {**(extra_config or {}), **_config_json(config, mask)}
        publish_eagle3(out, overwrite, cache, config, *rest, extra_config=extra)

    return publish


def init(
    cache_path: str | Path,
    out: str | Path,
    *,
    seed: int = 0,
    overwrite: bool = False,
    mask_token_id: int | None = None,
    **options: Any,
) -> Any:
    """``scorer init --family peagle``: a random P-EAGLE drafter in speculators' layout (an Eagle3Speculator
    directory with ``speculators_model_type: peagle``, ``mask_token_id`` and ``mask_hidden``), which vLLM
    loads as written. The mask token: ``--mask-token-id``, else the cache's (its tokenizer's mask token).

    Raises:
        ScorerError: no mask token known, or what EAGLE-3's init refuses (layers, sizes).
    """
    check_drafter_dir(out, overwrite)
    cache = hscache.open_cache(cache_path)
    mask = _mask_token(cache, cache_path, mask_token_id)
    config = eagle3_config_for_cache(cache, layout="speculators", **options)
    if layers := layer_fit_problem(config.target_layer_ids, cache, str(cache_path), what="target layers"):
        raise IncompatibleCacheError(layers)
    # Norms near 1, but not exactly (as EAGLE-3's init); mask_hidden N(0, 1) as speculators draws it.
    drafter = seeded_init(lambda: _make(mask)(config), seed, std=0.05, norm_range=(0.8, 1.2))
    with torch.no_grad():
        drafter.mask_hidden.copy_(
            torch.randn(drafter.mask_hidden.shape, generator=torch.Generator().manual_seed(seed))
        )
    _publisher(mask)(out, overwrite, cache, config, drafter.state_dict(), "speculators")
    return config


def train(
    cache_path: str | Path, out: str | Path, *, mask_token_id: int | None = None, **options: Any
) -> dict[str, Any]:
    """``scorer init --family peagle --train-steps N``: EAGLE-3's CPU trainer with the P-EAGLE module, whose
    later slots are fed the mask token and state (model.py), so its TTT steps train the parallel slots."""
    from scorer.families.eagle3.train import train_eagle3

    cache = hscache.open_cache(cache_path)
    mask = _mask_token(cache, cache_path, mask_token_id)
    options.pop("layout", None)
    options.setdefault("ttt_steps", int(options.get("num_speculative_tokens", 3)))  # every parallel slot
    return train_eagle3(
        cache_path, out, layout="speculators", make_drafter=_make(mask), publish=_publisher(mask), **options
    )
