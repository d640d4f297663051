"""Score one cached sequence: drafts at every anchor in one batched pass, then the replays.

The drafter runs once per anchor p in [P, T-2] (all anchors of the generated region), in
chunks of blocks per forward. Every metric is a pure function of those drafts (spec 3-4):
the chain replay visits a subset of anchors, per-position acceptance and the training-log
metric use all of them, DDTree replays from the per-slot top-K log-probs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from scorer.ddtree import surrogate_tau
from scorer.metrics import AcceptanceCounts, AcceptLen, acceptance_counts, train_accept_len
from scorer.model import DFlashDrafter
from scorer.replay import RoundLog, replay_chain, replay_ddtree

__all__ = ["SequenceResult", "draft_all_anchors", "score_sequence"]

_HEAD_ROWS = 4096  # anchors x slots projected onto the vocabulary at once (bounds [rows, V] logits)


@dataclass
class SequenceResult:
    """Everything the report needs from one sequence; small and picklable (dask ships it)."""

    row: int
    record_id: str
    category: str | None
    chain: RoundLog
    ddtree: dict[int, RoundLog]
    ddtree_surrogate: dict[int, tuple[float, int]]  # budget -> (sum over visited trees, trees)
    acceptance: AcceptanceCounts
    accept_len: AcceptLen
    chain_drafts: np.ndarray = field(repr=False)  # [rounds, B-1] the drafts of visited anchors


def draft_all_anchors(
    drafter: DFlashDrafter,
    features: torch.Tensor,
    token_ids: torch.Tensor,
    prompt_len: int,
    tree_k: int,
    max_blocks_per_forward: int = 64,
) -> tuple[np.ndarray, np.ndarray | None, np.ndarray | None]:
    """Drafts for anchors P..T-2: argmax ``[A, B-1]`` and, when ``tree_k`` > 0, top-K log-probs.

    Args:
        features: ``[T, K*H]`` drafter-ordered target features on the drafter's device.
        token_ids: ``[T]`` cached token ids (CPU).
        tree_k: K of the per-slot top-K log-probs kept for DDTree (0: none).

    Returns:
        (draft int64 ``[A, B-1]``, lp_vals float32 ``[A, B-1, K]`` or None, lp_ids or None).
    """
    config = drafter.config
    B, T = config.block_size, len(token_ids)
    device = features.device
    anchors = torch.arange(prompt_len, T - 1, device=device)
    blocks = torch.full((len(anchors), B), config.mask_token_id, dtype=torch.long, device=device)
    blocks[:, 0] = token_ids.to(device)[anchors]
    hidden = drafter.block_hidden(features, anchors, blocks, max_blocks_per_forward=max_blocks_per_forward)
    flat = hidden.reshape(-1, hidden.shape[-1])  # [A*(B-1), H]
    drafts, vals, ids = [], [], []
    for start in range(0, flat.shape[0], _HEAD_ROWS):
        logits = drafter.head(flat[start : start + _HEAD_ROWS]).float()
        drafts.append(logits.argmax(-1))
        if tree_k:
            top = torch.topk(torch.log_softmax(logits, dim=-1), k=min(tree_k, logits.shape[-1]), dim=-1)
            vals.append(top.values)
            ids.append(top.indices)
    shape = (len(anchors), B - 1)
    draft = torch.cat(drafts).reshape(shape).cpu().numpy()
    if not tree_k:
        return draft, None, None
    lp_vals = torch.cat(vals).reshape(*shape, -1).cpu().numpy()
    lp_ids = torch.cat(ids).reshape(*shape, -1).cpu().numpy()
    return draft, lp_vals, lp_ids


def score_sequence(
    drafter: DFlashDrafter,
    features: torch.Tensor,
    token_ids: torch.Tensor,
    target_argmax: torch.Tensor,
    prompt_len: int,
    *,
    row: int = 0,
    record_id: str = "",
    category: str | None = None,
    ddtree_budgets: tuple[int, ...] = (),
    max_blocks_per_forward: int = 64,
) -> SequenceResult:
    """Drafts at every anchor, then chain replay, DDTree replays and acceptance counts."""
    B = drafter.config.block_size
    x, a = token_ids.cpu().numpy(), target_argmax.cpu().numpy()
    tree_k = max(ddtree_budgets, default=0)
    if len(x) - 1 - prompt_len <= 0:  # no generated region: nothing to draft
        draft = np.zeros((0, B - 1), dtype=np.int64)
        lp_vals = lp_ids = np.zeros((0, B - 1, max(tree_k, 1)), dtype=np.float32)
    else:
        draft, lp_vals, lp_ids = draft_all_anchors(
            drafter, features, token_ids, prompt_len, tree_k, max_blocks_per_forward
        )
    chain = replay_chain(draft, x, a, prompt_len, B)
    ddtree, surrogate = {}, {}
    for budget in ddtree_budgets:
        trees: dict[int, Any] = {}  # the trees the replay built, one per visited anchor
        ddtree[budget] = replay_ddtree(lp_vals, lp_ids, x, a, prompt_len, budget, built=trees)
        surrogate[budget] = (float(sum(surrogate_tau(t) for t in trees.values())), len(trees))
    visited = np.asarray([p - prompt_len for p in chain.anchors], dtype=np.int64)
    return SequenceResult(
        row=row,
        record_id=record_id,
        category=category,
        chain=chain,
        ddtree=ddtree,
        ddtree_surrogate=surrogate,
        acceptance=acceptance_counts(draft, x, a, prompt_len),
        accept_len=train_accept_len(draft, x, a, prompt_len),
        chain_drafts=draft[visited] if len(visited) else np.zeros((0, B - 1), dtype=np.int64),
    )


def result_summary(result: SequenceResult) -> dict[str, Any]:
    """Per-request line of the report."""
    return {
        "row": result.row,
        "record_id": result.record_id,
        "category": result.category,
        "rounds": result.chain.n_rounds,
        "tokens": result.chain.n_tokens,
        "tau": result.chain.tau,
        "rounds_cut_off_greedy": result.chain.n_cut_off_greedy,
        "off_greedy_positions": result.chain.off_greedy_positions,
        "ddtree_tau": {str(b): log.tau for b, log in result.ddtree.items()},
    }
