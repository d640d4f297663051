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
from scorer.errors import IncompatibleCacheError
from scorer.families.eagle3.config import Eagle3Config
from scorer.families.eagle3.init import eagle3_config_for_cache, publish_eagle3
from scorer.families.eagle3.model import Eagle3Drafter
from scorer.layers import seeded_init
from scorer.offline.sequences import check_has_target, layer_fit_problem
from scorer.rules.expectation import target_to_draft_index
from scorer.training_stop import TrainingInterrupted, stop_on_interrupt, trained_steps

__all__ = ["draft_vocabulary", "train_eagle3"]


def draft_vocabulary(
    argmax_rows: list[torch.Tensor], vocab_size: int, draft_vocab_size: int
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """The reduced draft vocabulary a trainer drafts over: the ``draft_vocab_size`` target tokens the
    target predicts most often in the cache (ties: the lower id), ascending, as SpecForge chooses its
    draft vocabulary from token counts of the training data.

    Returns:
        (``d2t`` offsets [Vd] as the layouts store them (draft id d is target id d + d2t[d]), or None for
        the full vocabulary; target id -> draft id [V], -1 for a target id outside it, as
        ``target_to_draft_index`` inverts it for the scorer).
    """
    if draft_vocab_size >= vocab_size:
        return None, torch.arange(vocab_size)
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for a in argmax_rows:
        counts += torch.bincount(a.long(), minlength=vocab_size)
    ids = torch.argsort(counts, descending=True, stable=True)[:draft_vocab_size].sort().values
    return ids - torch.arange(draft_vocab_size), target_to_draft_index(ids, vocab_size)


def _cross_entropy(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over the rows whose target the draft vocabulary holds (0 where none does)."""
    held = target >= 0
    return F.cross_entropy(logits[held], target[held]) if bool(held.any()) else logits.sum() * 0.0


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
    make_drafter: Callable[[Eagle3Config], Eagle3Drafter] = Eagle3Drafter,
    publish: Callable[..., None] = publish_eagle3,
    **config_options: Any,
) -> dict[str, Any]:
    """Train an EAGLE-3 drafter for ``steps`` optimizer steps on the cache and save it in ``layout``
    (whole, as scorer/drafter_dir.py publishes drafters: a non-empty ``out`` needs ``overwrite``);
    ``on_step(step, loss)`` after each optimizer step (progress). A first Ctrl-C stops after the
    step in progress, saves that drafter (its config.json records the steps done and requested, as
    every trained one's does) and raises TrainingInterrupted (scorer/training_stop.py). A family
    built on EAGLE-3 trains its own drafter through this: ``make_drafter(config)`` builds it (its
    ``step`` defines what the later slots are fed) and ``publish`` (``publish_eagle3``'s arguments)
    writes it."""
    check_drafter_dir(out, overwrite)  # before the training, not after it
    cache = hscache.open_cache(cache_path)
    check_has_target(cache, str(cache_path), need_argmax=True)
    config = eagle3_config_for_cache(cache, layout=layout, **config_options)
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
    d2t, to_draft = draft_vocabulary([a for _, _, a in sequences], config.vocab_size, config.draft_vocab_size)
    drafter = seeded_init(lambda: make_drafter(config), seed, std=0.05)
    drafter.attach_embedding(head["embed_tokens"].float(), d2t)
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=lr)
    loss = torch.tensor(0.0)
    done = 0
    with stop_on_interrupt() as stop:  # Ctrl-C: finish the step in progress, save, say so
        for step in range(steps):
            features, x, a = sequences[step % len(sequences)]
            a = to_draft[a]  # the head's classes: draft ids, -1 where the draft vocabulary lacks the token
            rows = len(x) - 2
            normed, fed, kv0 = drafter.step0(features, x, rows)
            index_rows = torch.arange(rows)
            loss = _cross_entropy(drafter.head_logits(normed), a[1 : rows + 1])
            own: list[list] = [[] for _ in drafter.layers]
            for j in range(1, ttt_steps):
                tokens = x[torch.clamp(index_rows + 1 + j, max=len(x) - 1)]
                normed, fed = drafter.step(index_rows, tokens, fed, j, kv0, own)
                target = a[torch.clamp(index_rows + 1 + j, max=len(x) - 1)]
                valid = index_rows + 1 + j <= len(x) - 1
                loss = loss + _cross_entropy(drafter.head_logits(normed)[valid], target[valid])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            if on_step is not None:
                on_step(step + 1, float(loss.detach()))
            done = step + 1
            if stop.requested:
                break
    publish(
        out,
        overwrite,
        cache,
        config,
        drafter.state_dict(),
        layout,
        d2t,
        extra_config=trained_steps(done, steps),
    )
    if done < steps:
        raise TrainingInterrupted(done, steps, out)
    return {"final_loss": float(loss.detach()), "config": config}
