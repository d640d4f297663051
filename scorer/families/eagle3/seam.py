"""The EAGLE-3 family: config mapping (config.py), model (model.py), layout readers (layouts.py),
batched drafting (drafting.py), scored on the shared replay loop and report. This module holds the
functions of the family's row (scorer/families/eagle3/__init__.py binds them lazily)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from hscache.store.dtypes import DTYPES
from hscache.store.view import CacheView
from scorer.families.autoregressive import check_tree, tree_depths
from scorer.families.base import CheckpointProbe, attention_flops, linear_params
from scorer.families.eagle3.config import is_eagle3_config
from scorer.families.eagle3.drafting import draft_every_anchor
from scorer.families.eagle3.model import Eagle3Drafter
from scorer.metrics import acceptance_counts, train_accept_len
from scorer.offline.replay import round_loop
from scorer.offline.sequences import (
    CachedSequence,
    SequenceResult,
    chain_parts,
    result_from_parts,
    score_rows_with,
    sequence_features,
)

__all__ = [
    "claims",
    "cost",
    "effective_config",
    "init",
    "score_rows",
    "score_sequence_eagle3",
    "time_round",
    "train",
]


def claims(probe: CheckpointProbe) -> bool:
    if probe.config is not None:
        return is_eagle3_config(probe.config)
    keys = probe.weight_keys or frozenset()
    return any(k.endswith(("midlayer.hidden_norm.weight", "layers.0.hidden_norm.weight")) for k in keys)


def score_sequence_eagle3(
    drafter: Eagle3Drafter,
    features: Any,
    token_ids: Any,
    target_argmax: Any,
    prompt_len: int,
    *,
    row: int = 0,
    record_id: str = "",
    category: str | None = None,
    memory_gb: float = 2.0,
    teacher_forced: bool = True,
    tree: tuple[int, int, int] | None = None,
    tree_features: Any = None,
) -> SequenceResult:
    """Served chain drafts at every anchor, the shared replay, and the teacher-forced counts beside.

    ``features`` are the layers vLLM feeds the drafter (its chain), ``tree_features`` SGLang's (its
    tree; None: the same), which differ for a SpecForge-layout config (``Eagle3Config.vllm_layer_ids``).
    """
    K = drafter.config.num_speculative_tokens
    x, a = token_ids.cpu().numpy(), target_argmax.cpu().numpy()
    draft = draft_every_anchor(drafter, features, token_ids, prompt_len, K, memory_gb=memory_gb)
    if not len(draft):
        draft = np.zeros((0, K), dtype=np.int64)
    extras = {}
    if teacher_forced:
        forced = draft_every_anchor(
            drafter, features, token_ids, prompt_len, K, teacher_forced=True, memory_gb=memory_gb
        )
        extras = {
            "teacher_forced_acceptance": acceptance_counts(forced, x, a, prompt_len),
            "teacher_forced_accept_len": train_accept_len(forced, x, a, prompt_len),
        }
    if tree is not None:
        on = features if tree_features is None else tree_features
        depths = tree_depths(drafter, on, token_ids, target_argmax, prompt_len, tree, memory_gb=memory_gb)
        loop = round_loop(x, a, prompt_len)
        while not loop.done:
            loop.step(int(depths[loop.p - prompt_len]))
        extras["tree"] = loop.log()
    return result_from_parts(row, record_id, category, chain_parts(draft, x, a, prompt_len), extras)


def _sequence_scorer(
    drafter: Eagle3Drafter, cache: CacheView, config: Any
) -> Callable[[CachedSequence], SequenceResult]:
    """Score the cache's sequences ``rows``: features in the drafter's layer order, raw layer outputs
    (vLLM captures aux states as ``hidden_states + residual``, before any final norm); the chain on the
    layers vLLM feeds the drafter, SGLang's tree on SGLang's."""
    index = [cache.layer_ids.index(i) for i in drafter.config.layer_ids_served_by("vllm")]
    tree_index = [cache.layer_ids.index(i) for i in drafter.config.layer_ids_served_by("sglang")]
    dtype = DTYPES[config.dtype]

    def score(seq: CachedSequence) -> SequenceResult:
        hidden = seq.hidden_states()
        tree_features = None
        if config.tree is not None and tree_index != index:
            tree_features = sequence_features(hidden, tree_index, dtype, config.device, None)
        return score_sequence_eagle3(
            drafter,
            sequence_features(hidden, index, dtype, config.device, None),
            seq.token_ids(),
            seq.target_argmax(),
            seq.prompt_len,
            row=seq.row,
            record_id=seq.record_id,
            category=seq.category,
            memory_gb=config.memory_gb,
            tree=config.tree,
            tree_features=tree_features,
        )

    return score


score_rows = score_rows_with(_sequence_scorer)


def effective_config(config: Any) -> Any:
    # DDTree is a block-family mode; the batched EAGLE-3 path always drafts every anchor.
    return dataclasses.replace(config, ddtree=(), anchors="all", tree=check_tree(config.tree))


def cost(drafter: Eagle3Drafter, tau: float, context: float) -> dict[str, Any]:
    """One chain round served (vLLM propose): step 0 over the ~tau newly verified rows (fc and every
    layer; the head on the last row only), then K-1 one-row steps; K forwards in all."""
    c = drafter.config
    k = c.num_speculative_tokens
    rows = tau + k - 1
    flops = 2.0 * drafter.fc.weight.numel() * tau + 2.0 * linear_params(drafter.layers) * rows
    flops += 2.0 * drafter.lm_head.weight.numel() * k
    flops += attention_flops(c, rows, context)
    return {"draft_forwards_per_round": k, "flops_per_round": flops}


def time_round(
    drafter: Eagle3Drafter, features: Any, token_ids: Any, anchor: int, tau: float
) -> tuple[float, list[int]]:
    """One served chain round at ``anchor``: step 0 over the ~tau newly verified rows against the
    cached prefix (``extend``), then K-1 one-row steps; the prefix's step-0 keys are built untimed."""
    import time

    import torch

    k = drafter.config.num_speculative_tokens
    new = max(1, min(anchor, round(tau)))
    start = anchor - new
    device = drafter.fc.weight.device
    tokens, feats = token_ids.to(device), features.to(device)
    c = drafter.config
    with torch.no_grad():
        if start:
            _, _, cache = drafter.step0(feats, tokens, start)
        else:
            empty = feats.new_zeros(0, c.num_key_value_heads, c.head_dim)
            cache = [(empty, empty) for _ in drafter.layers]
        t0 = time.perf_counter()
        normed, fed, kv = drafter.extend(feats[start:anchor], tokens[start + 1 : anchor + 1], start, cache)
        row = torch.tensor([anchor - 1], device=device)
        token = drafter.to_target(drafter.head_logits(normed[-1:]).float().argmax(-1))
        drafted, fed, own = [token], fed[-1:], [[] for _ in drafter.layers]
        for j in range(1, k):
            normed, fed = drafter.step(row, drafted[-1], fed, j, kv, own)
            drafted.append(drafter.to_target(drafter.head_logits(normed).float().argmax(-1)))
        out = torch.cat(drafted).tolist()  # .tolist() waits for the device
        return time.perf_counter() - t0, out


def _layout_options(layout: str, options: dict[str, Any]) -> dict[str, Any]:
    # SpecForge and the original release hold the Llama layer: no q/k norms.
    return {**options, "layout": layout, **({} if layout == "speculators" else {"qk_norm": False})}


def init(cache_path: str | Path, out: str | Path, *, layout: str = "speculators", **options: Any) -> Any:
    """``scorer init --family eagle3``: a random drafter in ``layout`` (init.py), its config."""
    from scorer.families.eagle3.init import init_eagle3

    return init_eagle3(cache_path, out, **_layout_options(layout, options))[0]


def train(cache_path: str | Path, out: str | Path, *, layout: str = "speculators", **options: Any) -> dict:
    """``scorer init --family eagle3 --train-steps N``: train.py's CPU trainer (TTT steps)."""
    from scorer.families.eagle3.train import train_eagle3

    return train_eagle3(cache_path, out, **_layout_options(layout, options))
