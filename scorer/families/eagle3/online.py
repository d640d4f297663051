"""``scorer online`` for EAGLE-3: the drafter against a live target, vLLM's propose loop per round."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from scorer.errors import CheckpointError, IncompatibleCacheError
from scorer.families.autoregressive import EagleTree, eagle_tree
from scorer.families.base import DraftDraw, OnlineOptions, Proposer
from scorer.families.eagle3.layouts import EAGLE3, Eagle3Variant, read_eagle3
from scorer.families.eagle3.model import Eagle3Drafter

__all__ = ["captured_layers", "eagle3_proposer", "load_online", "online"]


def captured_layers(drafter: Eagle3Drafter) -> tuple[list[int], list[int], list[int]]:
    """(the target layers to capture, the positions in them of vLLM's chain layers, of SGLang's tree
    layers): the two engines feed a SpecForge-layout drafter other layers (``vllm_layer_ids``)."""
    chain = list(drafter.config.layer_ids_served_by("vllm"))
    tree = list(drafter.config.layer_ids_served_by("sglang"))
    layers = chain + [i for i in tree if i not in chain]
    return layers, [layers.index(i) for i in chain], [layers.index(i) for i in tree]


def eagle3_proposer(drafter: Eagle3Drafter) -> Proposer:
    """One round at anchor p: ``Eagle3Drafter.draft_one_anchor`` on the verified prefix's features,
    or with ``tree`` SGLang's EAGLE tree there (``autoregressive.eagle_tree``, the offline replay's).
    ``hidden`` holds the ``captured_layers`` of the prefix, [p, layers, H]."""
    layers, chain, sglang = captured_layers(drafter)

    def propose(
        hidden: torch.Tensor,
        ids: list[int],
        p: int,
        draw: DraftDraw | None = None,
        tree: tuple[int, int, int] | None = None,
    ) -> list[int] | EagleTree:
        picked = hidden[:, sglang if tree is not None else chain] if len(layers) > len(chain) else hidden
        features = picked.reshape(p, -1).to(drafter.fc.weight.dtype)  # raw layer outputs, as vLLM captures
        if tree is not None:
            return eagle_tree(drafter, features, torch.tensor(ids), p, tree)
        K = drafter.config.num_speculative_tokens
        return drafter.draft_one_anchor(features, torch.tensor(ids), p, K, draw=draw)

    return propose


def load_online(
    checkpoint: str | Path,
    target: Any,
    options: OnlineOptions,
    *,
    variant: Eagle3Variant = EAGLE3,
) -> tuple[Eagle3Drafter, Any]:
    """(the drafter on the target's device and dtype, its LoadReport): the checkpoint read, checked against
    the live target, its embedding attached. ``variant``: as ``layouts.load_eagle3`` (a family built on
    this one).

    Raises:
        IncompatibleCacheError: hidden size, vocabulary or layers do not fit the target (all named).
    """
    config, weights, head, report = read_eagle3(
        checkpoint,
        num_target_layers=target.num_layers,
        num_speculative_tokens=options.num_speculative_tokens,
        trust_checkpoint=options.trust_checkpoint,
        config_path=options.config_path,
        variant=variant,
    )
    embed = target.model.get_input_embeddings().weight.detach()
    problems = [
        f"drafter {name} {mine} != target {name} {theirs}"
        for name, mine, theirs in (
            ("hidden size", config.feature_size, embed.shape[1]),
            ("vocab_size", config.vocab_size, embed.shape[0]),
        )
        if mine != theirs
    ]
    wanted = sorted({*config.target_layer_ids, *config.layer_ids_served_by("vllm")})
    if bad := [i for i in wanted if not 0 <= i < target.num_layers]:
        problems.append(f"drafter target layers {bad} do not exist in a {target.num_layers}-layer target")
    if problems:
        raise IncompatibleCacheError("; ".join(problems))
    drafter = variant.drafter_class(config)
    drafter.load_state_dict(weights)
    drafter = drafter.to(device=options.device, dtype=target.model.dtype).eval()
    own = head.get("embed_tokens.weight")
    # vLLM shares the target's embedding when the shapes match (and, for a family that asks, when the
    # shipped one equals it): the same rule as the offline loader (layouts.load_eagle3).
    if own is not None and (
        tuple(own.shape) != tuple(embed.shape)
        or (
            variant.own_embedding_unless_identical
            and not torch.equal(own.to(embed.device, embed.dtype), embed)
        )
    ):
        embed = own.to(options.device, target.model.dtype)
    drafter.attach_embedding(embed, head.get("d2t"))
    return drafter, report


def online(checkpoint: str | Path, target: Any, options: OnlineOptions) -> tuple[list[int], Proposer, Any]:
    """Read the checkpoint, check it against the target, attach the target's embedding.

    Raises:
        CheckpointError: a DFlash override was given (named); IncompatibleCacheError: a mismatch.
    """
    if options.overrides:
        flags = ", ".join("--" + name.replace("_", "-") for name in sorted(options.overrides))
        raise CheckpointError(
            f"{checkpoint}: {flags} set DFlash settings; an EAGLE-3 drafter takes them from its config "
            "(drafting: --num-speculative-tokens K)"
        )
    drafter, report = load_online(checkpoint, target, options)
    return captured_layers(drafter)[0], eagle3_proposer(drafter), report
