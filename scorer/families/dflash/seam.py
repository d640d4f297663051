"""The DFlash family (spec/dflash.md): block drafting from one forward, DDTree.

Its config mapping (scorer.families.dflash.config), model (scorer.families.dflash.model), layout
readers (scorer.families.dflash.checkpoint, scorer.formats) and per-sequence scoring
(scorer.families.dflash.score) are beside it; this module holds the functions of the family's row
(scorer/families/dflash/__init__.py binds them lazily): how a checkpoint is recognised, loaded and
scored on the shared replay loop, served online, costed, made and trained.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from hscache.capture.device import check_device
from hscache.store.dtypes import DTYPES
from hscache.store.view import CacheView
from scorer.errors import CheckpointError, ScorerError
from scorer.families.autoregressive import EagleTree
from scorer.families.base import (
    CheckpointProbe,
    DraftDraw,
    OnlineOptions,
    Proposer,
    attention_flops,
    check_scored_sizes,
    linear_params,
    target_head_name,
)
from scorer.families.dflash.checkpoint import (
    CheckpointVariant,
    LoadedCheckpoint,
    in_memory_checkpoint,
    load_checkpoint,
)
from scorer.families.dflash.config import DFlashConfig
from scorer.families.dflash.features import (
    attach_cache_head,
    cache_fallbacks,
    check_compatible,
    context_norm,
    feature_index,
)
from scorer.families.dflash.model import DFlashDrafter
from scorer.families.dflash.score import (
    block_drafts,
    block_tree,
    score_dflash_sequence,
    score_dflash_sequences_chain,
)
from scorer.offline.sequences import (
    CachedSequence,
    SequenceResult,
    cached_sequences,
    check_scorable,
    score_each,
    sequence_features,
)

__all__ = [
    "check_sizes",
    "claims",
    "cost",
    "dflash_proposer",
    "init",
    "load",
    "module_drafter",
    "online",
    "score_rows",
    "target_fallbacks",
    "time_round",
    "train",
]


def claims(probe: CheckpointProbe) -> bool:
    # The fallback family (Family.fallback): the registry asks it only when no other family claims
    # the checkpoint, whatever the order of FAMILIES; DFlash's loader then names what is wrong
    # with a file that turns out to be something else. A target head is never a DFlash file.
    return target_head_name(probe.path) is None


def _overrides(config: Any) -> dict[str, Any]:
    overrides = dict(config.overrides)
    if config.block_size is not None:
        overrides["block_size"] = config.block_size
    if config.num_speculative_tokens is not None:
        # vLLM's K for DFlash: its query block is the bonus token + K mask slots, every slot attending
        # to every other (vllm 0.32.0 v1/spec_decode/dflash.py:126 num_query_per_req = 1 + K; non-causal,
        # qwen3_dflash.py:86-97), and vLLM never checks K against the drafter's block_size
        # (config/speculative.py:1478-1507 reads a block size for DSpark only). Served with another K,
        # every slot drafts from another block: the offline replay must draft the block vLLM drafts.
        overrides["block_size"] = config.num_speculative_tokens + 1
    return overrides


def _plain(loaded: LoadedCheckpoint) -> DFlashDrafter:
    drafter = DFlashDrafter(loaded.config)
    drafter.load_state_dict(loaded.state_dict)
    return drafter


def load(
    checkpoint: str | Path,
    cache: CacheView,
    config: Any,
    variant: CheckpointVariant | None = None,
    build: Callable[[LoadedCheckpoint], DFlashDrafter] = _plain,
) -> tuple[DFlashDrafter, LoadedCheckpoint]:
    """Load a DFlash checkpoint of any supported layout, check it against ``cache``, ready it.
    A later variant's family (DFlash2) passes its ``variant`` keys and how to ``build`` its drafter.

    Raises:
        CheckpointError: also when a tree drafting setting is given (DFlash drafts a block), or a
            ``num_speculative_tokens`` (vLLM's K: a block of K + 1) that disagrees with ``block_size``.
    """
    if config.tree is not None:
        raise CheckpointError(
            f"{checkpoint}: --tree is for autoregressive drafters (EAGLE-3, MTP); a DFlash drafter drafts "
            "a block: use --ddtree"
        )
    k = config.num_speculative_tokens
    if k is not None and config.block_size is not None and config.block_size != k + 1:
        raise CheckpointError(
            f"{checkpoint}: --num-speculative-tokens {k} (vLLM's K: a block of {k + 1}) and --block-size "
            f"{config.block_size} disagree; give one of them"
        )
    loaded = load_checkpoint(
        checkpoint,
        overrides=_overrides(config),
        fallbacks=cache_fallbacks(cache),
        trust_checkpoint=config.trust_checkpoint,
        config_path=config.config_path,
        variant=variant,
    )
    check_compatible(loaded.config, cache, str(cache.path))
    check_sizes(loaded, cache, config)
    dtype = DTYPES[config.dtype]
    drafter = build(loaded).to(device=config.device, dtype=dtype).eval()
    attach_cache_head(drafter, cache, dtype, config.device, own=loaded.head)
    layout = "speculators" if getattr(config, "raw_last_layer", False) else loaded.report.layout
    drafter.context_norm = context_norm(loaded.config, cache, layout)
    return drafter, loaded


def check_sizes(loaded: LoadedCheckpoint, cache: CacheView, config: Any) -> None:
    """Bound every size that comes from a flag, a config or the cache before anything is allocated.

    The block size must fit the cache's longest sequence, and one forward's attention working set
    (``max_blocks_per_forward`` blocks of B queries over up to longest + B keys, float32) must fit
    ``--memory-gb``; the drafter the config describes, built on the meta device (nothing
    allocated), must hold no more than twice the checkpoint's parameters (a config claiming 10^9
    layers or a huge intermediate size is refused instead of allocated).

    Raises:
        ScorerError: naming the flag or config field and the bound (one line).
    """
    import torch

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
    context = int((cache.target_config or {}).get("max_position_embeddings") or 0) or None
    check_scored_sizes(
        longest, str(cache.path), ddtree=tuple(getattr(config, "ddtree", None) or ()), context=context
    )
    with torch.device("meta"):
        described = sum(p.numel() for p in DFlashDrafter(loaded.config).parameters())
    held = sum(t.numel() for t in loaded.state_dict.values())
    if described > 2 * held + (1 << 20):
        raise ScorerError(
            f"the drafter's config describes {described:,} parameters but the checkpoint holds {held:,}; "
            "its config.json (num_hidden_layers, hidden/intermediate sizes) does not match its weights"
        )


def module_drafter(
    module_or_state_dict: Any, cache: CacheView, config: Any, eval_config: Any
) -> tuple[DFlashDrafter, LoadedCheckpoint]:
    """An in-memory drafter readied for ``cache`` like ``load_drafter`` readies a file: a copy of
    the weights in eval mode on ``eval_config``'s device and dtype, the target head attached.

    Raises:
        CheckpointError: no config for a state_dict, or weights that do not fit the config.
        IncompatibleCacheError: the drafter does not fit the cache.
    """
    import torch

    if isinstance(module_or_state_dict, DFlashDrafter):
        state_dict = module_or_state_dict.state_dict()
        config = config if config is not None else module_or_state_dict.config
        attached = (
            module_or_state_dict.embed_weight is not None and module_or_state_dict.lm_head_weight is not None
        )
    elif isinstance(module_or_state_dict, torch.nn.Module):
        state_dict, attached = module_or_state_dict.state_dict(), False
    else:
        state_dict, attached = dict(module_or_state_dict), False
    if config is None:
        raise CheckpointError(
            "evaluate_module needs the drafter's config (a DFlashConfig or HF dict) with a state_dict"
        )
    if not isinstance(config, DFlashConfig):
        try:
            config = DFlashConfig.from_hf_config(dict(config))
        except ValueError as e:
            raise CheckpointError(f"evaluate_module config: {e}") from e
    if eval_config.block_size is not None:
        config = dataclasses.replace(config, block_size=eval_config.block_size)
    check_device(eval_config.device)
    check_scorable(cache, str(getattr(cache, "url", cache.path)))
    check_compatible(config, cache, str(cache.path))
    loaded = in_memory_checkpoint(config, {k: v.detach() for k, v in state_dict.items()})
    dtype = DTYPES[eval_config.dtype]
    drafter = DFlashDrafter(config)
    drafter.load_state_dict(loaded.state_dict)
    drafter = drafter.to(device=eval_config.device, dtype=dtype).eval()
    if attached:  # the training loop's module already holds the target head: no cache read
        source = module_or_state_dict
        drafter.attach_target(
            source.embed_weight.to(device=eval_config.device, dtype=dtype),
            source.lm_head_weight.to(device=eval_config.device, dtype=dtype),
            source.draft_to_target,
        )
        if source.draft_to_target is not None:
            drafter.draft_to_target = source.draft_to_target.to(eval_config.device)
    else:
        attach_cache_head(drafter, cache, dtype, eval_config.device)
    drafter.context_norm = context_norm(config, cache)
    return drafter, loaded


def score_rows(
    drafter: DFlashDrafter,
    cache: CacheView,
    rows: Sequence[int],
    config: Any,
    on_sequence: Callable[[SequenceResult], None] | None = None,
) -> list[SequenceResult]:
    """Score the cache's sequences ``rows`` (the unit of work the distributed path ships);
    ``on_sequence`` gets each result as it is done (progress)."""
    index = feature_index(drafter.config, cache.layer_ids)
    dtype = DTYPES[config.dtype]
    norm = getattr(drafter, "context_norm", None)  # the last layer as hidden_states[L] (features.py)

    def features(sequence: CachedSequence) -> Any:
        return sequence_features(sequence.hidden_states(), index, dtype, config.device, norm)

    if config.anchors == "chain":  # all rows' replays in lockstep: one head projection per step
        sequences = [
            {
                "features": features(seq),
                "token_ids": seq.token_ids(),
                "target_argmax": seq.target_argmax(),
                "prompt_len": seq.prompt_len,
                "row": seq.row,
                "record_id": seq.record_id,
                "category": seq.category,
            }
            for seq in cached_sequences(cache, rows)
        ]
        results = score_dflash_sequences_chain(
            drafter,
            sequences,
            ddtree_budgets=tuple(config.ddtree),
            max_blocks_per_forward=config.max_blocks_per_forward,
            memory_gb=config.memory_gb,
        )
        if on_sequence:
            for result in results:
                on_sequence(result)
        return results

    def score(seq: CachedSequence) -> SequenceResult:
        return score_dflash_sequence(
            drafter,
            features(seq),
            seq.token_ids(),
            seq.target_argmax(),
            seq.prompt_len,
            row=seq.row,
            record_id=seq.record_id,
            category=seq.category,
            ddtree_budgets=tuple(config.ddtree),
            max_blocks_per_forward=config.max_blocks_per_forward,
            anchors=config.anchors,
            memory_gb=config.memory_gb,
        )

    return score_each(cache, rows, score, on_sequence)


def target_fallbacks(target: Any) -> dict[str, Any]:
    """What a config-less checkpoint takes from a loaded target (``scorer online``)."""
    config = target.text_config
    rope = getattr(config, "rope_parameters", None) or {}
    return {
        "mask_token_id": target.mask_token_id,
        "vocab_size": int(config.vocab_size),
        "rope_theta": getattr(config, "rope_theta", None) or rope.get("rope_theta"),
        "num_target_layers": target.num_layers,
        "rms_norm_eps": getattr(config, "rms_norm_eps", None),
    }


def dflash_proposer(target: Any, drafter: DFlashDrafter, layout: str = "zlab") -> Proposer:
    """DFlash's round: one block forward at the anchor (the last layer read after the final norm
    where the layout reads transformers' hidden_states[L]). With ``ddtree=N`` (``scorer online
    --ddtree N``, the family's ``online_trees``) the proposer drafts the DDTree of N nodes built from
    that block's per-slot top-K (``score.block_tree``, the offline replay's construction), returned as
    the (tokens, parents) tree the SGLang tree loop verifies (``EagleTree``)."""
    import numpy as np
    import torch

    config = drafter.config
    layer_ids = list(config.target_layer_ids)
    last = target.num_layers - 1
    last_slot = layer_ids.index(last) if last in layer_ids and layout != "speculators" else None
    base = target.model.model
    final_norm = getattr(getattr(base, "language_model", base), "norm", None)

    def block_rows(hidden: Any, ids: list[int], p: int) -> tuple[Any, Any]:
        features = hidden  # [p, K, H] pre-norm layer outputs
        if last_slot is not None:  # z-lab reads the last layer as hidden_states[L]: after the final norm
            features = features.clone()
            with torch.no_grad():
                features[:, last_slot] = final_norm(features[:, last_slot])
        features = features.reshape(p, -1).to(drafter.fc.weight.dtype)
        block = torch.full((1, config.block_size), config.mask_token_id, dtype=torch.long)
        block[0, 0] = ids[p]
        return drafter.block_hidden(features, torch.tensor([p]), block, max_blocks_per_forward=1), block

    def propose(
        hidden: Any, ids: list[int], p: int, draw: DraftDraw | None = None, ddtree: int | None = None
    ) -> list[int] | EagleTree:
        rows, block = block_rows(hidden, ids, p)
        if ddtree is not None:
            with torch.no_grad():
                tree = block_tree(drafter, rows[0], ids[p], ddtree)
            return EagleTree(
                np.asarray(tree.token_ids, dtype=np.int64), np.asarray(tree.parents, dtype=np.int64)
            )
        if draw is not None:  # T > 0: the drafter draws the block (DFlashDrafter.drawn_block)
            return drafter.drawn_block(rows, block[:, 0], draw)
        return block_drafts(drafter, rows, block[:, 0])[0].tolist()  # d_1..d_{B-1}

    return propose


def online(
    checkpoint: str | Path,
    target: Any,
    options: OnlineOptions,
    variant: CheckpointVariant | None = None,
    build: Callable[[LoadedCheckpoint], DFlashDrafter] = _plain,
) -> tuple[list[int], Proposer, Any]:
    """``scorer online``'s DFlash loader: the drafter against the live target (its embedding/head)."""
    loaded = load_checkpoint(
        checkpoint,
        overrides=options.overrides,
        fallbacks=target_fallbacks(target),
        trust_checkpoint=options.trust_checkpoint,
        config_path=options.config_path,
        variant=variant,
    )
    model_dtype = target.model.dtype
    device = options.device
    drafter = build(loaded).to(device=device, dtype=model_dtype).eval()
    own = loaded.head  # a speculators drafter's own embed_tokens / lm_head / d2t
    drafter.attach_target(
        own["embed_tokens"].to(device, model_dtype)
        if "embed_tokens" in own
        else target.model.get_input_embeddings().weight.detach(),
        own["lm_head"].to(device, model_dtype)
        if "lm_head" in own
        else target.model.get_output_embeddings().weight.detach(),
        own["d2t"].to(device) if "d2t" in own else None,
    )
    propose = dflash_proposer(target, drafter, loaded.report.layout)
    return list(loaded.config.target_layer_ids), propose, loaded.report


def cost(drafter: DFlashDrafter, tau: float, context: float) -> dict[str, Any]:
    """One round served: ONE forward of the B-slot block (every layer), the newly verified ~tau
    context rows through fc and each layer's k/v projections, the head on the B-1 drafted slots."""
    c = drafter.config
    block = c.block_size - 1 + drafter.first_draft_slot  # the block's query rows (model.py first_draft_slot)
    kv = sum(
        linear_params(layer.self_attn.k_proj) + linear_params(layer.self_attn.v_proj)
        for layer in drafter.layers
    )
    flops = 2.0 * linear_params(drafter.layers) * block
    flops += 2.0 * (drafter.fc.weight.numel() + kv) * tau
    flops += (
        2.0
        * c.hidden_size
        * (len(drafter.draft_to_target) if drafter.draft_to_target is not None else c.vocab_size)
        * (c.block_size - 1)
    )
    flops += attention_flops(c, block, context + block)
    return {"draft_forwards_per_round": 1, "flops_per_round": flops}


def time_round(
    drafter: DFlashDrafter, features: Any, token_ids: Any, anchor: int, tau: float
) -> tuple[float, list[int]]:
    """One served round at ``anchor``: the block forward and the head over its B-1 slots, the
    context's keys/values already projected (built untimed; a round adds ~tau context rows)."""
    import time

    import torch

    c = drafter.config
    device = drafter.fc.weight.device
    features = features.to(device)
    with torch.no_grad():
        context = drafter.context_kv(features[:anchor])
        block = torch.full((1, c.block_size), c.mask_token_id, dtype=torch.long, device=device)
        block[0, 0] = int(token_ids[anchor])
        t0 = time.perf_counter()
        rows = drafter.block_hidden(
            features, torch.tensor([anchor], device=device), block, max_blocks_per_forward=1, context=context
        )
        out = block_drafts(drafter, rows, block[:, 0])[0].tolist()  # the drafter's path
        return time.perf_counter() - t0, out


def init(cache_path: str | Path, out: str | Path, **options: Any) -> DFlashConfig:
    """``scorer init --family dflash``: a random DFlash drafter (init.py), its config."""
    from scorer.families.dflash.init import init_dflash

    return init_dflash(cache_path, out, **options)[0]


def train(
    cache_path: str | Path,
    out: str | Path,
    *,
    on_step: Callable[[int, float], None] | None = None,
    on_eval: Callable[[int, dict], None] | None = None,
    evaluate: Callable[..., dict] | None = None,
    **settings: Any,
) -> dict[str, Any]:
    """``scorer init --family dflash --train-steps N``: train.py's CPU trainer, ``settings`` its
    DFlashTrainConfig's fields (with a progress callback ``on_step``, no printed loss lines unless
    ``log_every`` asks for them)."""
    from scorer.families.dflash.train import DFlashTrainConfig, train_dflash

    if on_step is not None:
        settings.setdefault("log_every", 0)
    return train_dflash(
        cache_path, out, DFlashTrainConfig(**settings), on_step=on_step, on_eval=on_eval, evaluate=evaluate
    )
