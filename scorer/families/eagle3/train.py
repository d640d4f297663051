"""A few CPU steps of EAGLE-3 training on a cache (tests and the docs walkthrough need a drafter
that accepts something; this is not a production trainer).

The objective is speculators' TTT loop: step 0 over every row, then steps 1..S-1 fed the
ground-truth tokens, each step's row i trained towards the target's greedy token at i + 2 + j.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

import hscache
from scorer.drafter_dir import check_drafter_dir
from scorer.errors import IncompatibleCacheError, ScorerError
from scorer.families.eagle3.init import eagle3_config_for_cache, publish_eagle3
from scorer.families.eagle3.model import Eagle3Drafter
from scorer.layers import seeded_init
from scorer.offline.sequences import check_has_target, layer_fit_problem

__all__ = ["train_eagle3"]


def train_eagle3(
    cache_path: str | Path,
    out: str | Path,
    *,
    steps: int = 100,
    ttt_steps: int = 3,
    lr: float = 3e-3,
    seed: int = 0,
    layout: str = "speculators",
    overwrite: bool = False,
    on_step: Callable[[int, float], None] | None = None,
    **config_options: Any,
) -> dict[str, Any]:
    """Train an EAGLE-3 drafter for ``steps`` optimizer steps on the cache and save it in ``layout``
    (whole, as scorer/drafter_dir.py publishes drafters: a non-empty ``out`` needs ``overwrite``);
    ``on_step(step, loss)`` after each optimizer step (progress)."""
    check_drafter_dir(out, overwrite)  # before the training, not after it
    cache = hscache.open_cache(cache_path)
    check_has_target(cache, str(cache_path), need_argmax=True)
    config = eagle3_config_for_cache(cache, layout=layout, **config_options)
    if config.draft_vocab_size != config.vocab_size:  # the loss below is over target ids
        raise ScorerError(
            f"train_eagle3: draft_vocab_size {config.draft_vocab_size} is a reduced vocabulary (the target's "
            f"is {config.vocab_size}); this trainer trains the full one: leave draft_vocab_size unset, or "
            "write an untrained reduced-vocabulary drafter with init_eagle3"
        )
    if layers := layer_fit_problem(config.target_layer_ids, cache, str(cache_path), what="target layers"):
        raise IncompatibleCacheError(layers)  # was: ValueError "4 is not in list" from the index below
    index = [cache.layer_ids.index(i) for i in config.target_layer_ids]
    head = cache.target_head()
    sequences = [
        (
            cache.hidden_states(row)[:, index].reshape(len(cache.token_ids(row)), -1).float(),
            cache.token_ids(row).long(),
            cache.target_argmax(row).long(),
        )
        for row in range(len(cache))
    ]
    drafter = seeded_init(lambda: Eagle3Drafter(config), seed, std=0.05)
    drafter.attach_embedding(head["embed_tokens"].float(), None)
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=lr)
    loss = torch.tensor(0.0)
    for step in range(steps):
        features, x, a = sequences[step % len(sequences)]
        rows = len(x) - 2
        normed, fed, kv0 = drafter.step0(features, x, rows)
        index_rows = torch.arange(rows)
        loss = F.cross_entropy(drafter.head_logits(normed), a[1 : rows + 1])
        own: list[list] = [[] for _ in drafter.layers]
        for j in range(1, ttt_steps):
            tokens = x[torch.clamp(index_rows + 1 + j, max=len(x) - 1)]
            normed, fed = drafter.step(index_rows, tokens, fed, j, kv0, own)
            target = a[torch.clamp(index_rows + 1 + j, max=len(x) - 1)]
            valid = index_rows + 1 + j <= len(x) - 1
            loss = loss + F.cross_entropy(drafter.head_logits(normed)[valid], target[valid])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if on_step is not None:
            on_step(step + 1, float(loss.detach()))
    publish_eagle3(out, overwrite, cache, config, drafter.state_dict(), layout)
    return {"final_loss": float(loss.detach()), "config": config}
