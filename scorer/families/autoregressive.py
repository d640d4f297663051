"""What the autoregressive families (EAGLE-3, the target's MTP head) share: memory-bounded row
chunks of their batched later steps, and SGLang's EAGLE tree replayed at every anchor.

A drafter here is anything with the autoregressive drafting interface (``step0``, ``step``,
``head_logits``, ``to_target``, ``layers``, ``config.num_attention_heads``,
``config.draft_vocab_size``): scorer/families/eagle3/model.py and scorer/families/mtp/ implement it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from hscache.capture.logit_rows import DEFAULT_MEMORY_GB, head_rows
from scorer.errors import ScorerError
from scorer.rules.onehot_tree import tree_children, tree_walk

__all__ = [
    "EagleTree",
    "candidate_trees",
    "check_tree",
    "eagle_tree",
    "greedy_walk",
    "rows_per_chunk",
    "tree_depths",
]


def check_tree(tree: tuple[int, int, int] | None) -> tuple[int, int, int] | None:
    """SGLang's tree settings as SGLang takes them: topk 1 means a chain of steps + 1 tokens
    (server_args adjusts speculative_num_draft_tokens), and N - 1 candidates must exist.

    Raises:
        ScorerError: more draft tokens than the tree has candidates (named).
    """
    if tree is None:
        return None
    steps, topk, tokens = tree
    if topk == 1:
        return (steps, 1, steps + 1)
    candidates = topk + (steps - 1) * topk * topk
    if not 2 <= tokens <= candidates + 1:
        raise ScorerError(
            f"--tree {steps},{topk},{tokens}: TOKENS must be 2..{candidates + 1} (the root plus at most "
            f"the {candidates} candidates of {steps} steps with topk {topk})"
        )
    return tree


def rows_per_chunk(drafter: Any, seq_len: int, memory_gb: float, max_rows: int) -> int:
    """Rows of a drafter's later steps per chunk (``drafter.config``: ``num_attention_heads``,
    ``draft_vocab_size``): their [rows, Vd] logits and their [rows, heads, T] attention
    scores (fp32, with the softmax's copy) both within ``memory_gb``."""
    scores_per_row = 2 * 4 * drafter.config.num_attention_heads * seq_len
    by_attention = int(memory_gb * 2**30) // max(1, scores_per_row)
    return max(1, min(max_rows, head_rows(drafter.config.draft_vocab_size, memory_gb), by_attention))


@dataclass(frozen=True)
class EagleTree:
    """One anchor's SGLang EAGLE tree as SGLang verifies it: the kept candidates in candidate order
    (``organize_draft_results`` sorts the kept indices, so a parent precedes its children and siblings
    are tried in that order).

    Attributes:
        tokens: [M] int64 target token ids of the nodes.
        parents: [M] int64 index of each node's parent in ``tokens``, -1 for a child of the root.
    """

    tokens: np.ndarray
    parents: np.ndarray


def candidate_trees(
    drafter: Any,
    normed0: torch.Tensor,
    fed0: torch.Tensor,
    kv0: Any,
    rows: torch.Tensor,
    tree: tuple[int, int, int],
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """SGLang's EAGLE tree drafted at step-0 rows ``rows`` [n] (anchor p = row + 1): every candidate's
    target token and parent candidate ([n, C] each, C = k + (S-1) k^2, candidate order) and the kept
    candidates ([n, N-1] indices). ``tree_depths``' docstring gives SGLang's construction."""
    steps, topk, tokens = tree
    device = rows.device
    n = len(rows)
    probs = torch.softmax(drafter.head_logits(normed0[rows]).float(), dim=-1)
    if topk > probs.shape[-1]:  # torch.topk's "selected index k out of range", as one line
        raise ScorerError(
            f"--tree {steps},{topk},{tokens}: TOPK {topk} is more than the drafter's {probs.shape[-1]}-token "
            f"draft vocabulary; choose TOPK <= {probs.shape[-1]}"
        )
    top = torch.topk(probs, topk, dim=-1)
    scores = top.values  # [n, k]
    frontier_tokens = drafter.to_target(top.indices)  # [n, k]
    frontier_ids = torch.arange(topk, device=device).expand(n, topk)
    cand_scores, cand_tokens, cand_parents = (
        [scores],
        [frontier_tokens],
        [torch.full_like(frontier_ids, -1)],
    )
    hidden = fed0[rows].repeat_interleave(topk, dim=0)  # [n*k, H], slot-major per row
    slot_rows = rows.repeat_interleave(topk)
    own: list[list] = [[] for _ in drafter.layers]
    for i in range(1, steps):
        normed, fed = drafter.step(slot_rows, frontier_tokens.reshape(-1), hidden, i, kv0, own)
        child = torch.topk(torch.softmax(drafter.head_logits(normed).float(), dim=-1), topk, dim=-1)
        expand = scores[:, :, None] * child.values.view(n, topk, topk)  # [n, k(parent), k(child)]
        child_tokens = drafter.to_target(child.indices).view(n, topk * topk)
        cand_scores.append(expand.reshape(n, -1))
        cand_tokens.append(child_tokens)
        cand_parents.append(frontier_ids.repeat_interleave(topk, dim=1))
        best = torch.topk(expand.reshape(n, -1), topk, dim=-1)
        scores = best.values
        frontier_tokens = torch.gather(child_tokens, 1, best.indices)
        parent_slot = best.indices // topk
        hidden = fed.view(n, topk, -1)[torch.arange(n, device=device)[:, None], parent_slot].reshape(
            n * topk, -1
        )
        frontier_ids = best.indices + (topk + (i - 1) * topk * topk)
    all_scores = torch.cat(cand_scores, dim=1)
    keep = torch.topk(all_scores, min(tokens - 1, all_scores.shape[1]), dim=-1).indices.cpu().numpy()
    return torch.cat(cand_tokens, dim=1).cpu().numpy(), torch.cat(cand_parents, dim=1).cpu().numpy(), keep


@torch.no_grad()
def tree_depths(
    drafter: Any,
    features: torch.Tensor,
    token_ids: torch.Tensor,
    target_argmax: torch.Tensor,
    prompt_len: int,
    tree: tuple[int, int, int],
    *,
    memory_gb: float = DEFAULT_MEMORY_GB,
    max_rows: int = 256,
) -> np.ndarray:
    """Nodes the greedy walk accepts in SGLang's EAGLE tree drafted at every anchor: ``[A]``.

    SGLang (``eagle_worker.py draft_forward``, ``eagle_utils.py select_top_k_tokens`` and
    ``organize_draft_results``), tree = (steps S, topk k, draft tokens N):
    - step 0 (the draft extend): the root's top-k tokens by softmax probability are the first
      k candidates and the k frontier slots;
    - step i = 1..S-1: each frontier slot runs one forward (token: its candidate, hidden: the state
      its parent's forward fed back, position p-1+i), giving top-k children; their scores are the
      parent's score times the child's probability; all k*k are candidates, the best k become the
      new frontier slots. A slot attends to the prefix and to the keys ITS SLOT wrote at earlier
      steps (``generate_draft_decode_kv_indices``: per (request, topk_id) the prefix plus ``iters``
      slot entries), which for k > 1 need not be the node's ancestors: scored as served;
    - the tree is the N-1 candidates of highest score (``torch.topk(score_list, N - 1)``);
      greedy verification walks from the root following the target's greedy token.
    """
    seq_len = len(token_ids)
    anchors = seq_len - 1 - prompt_len
    if anchors <= 0:
        return np.zeros(0, dtype=np.int64)
    device = drafter.fc.weight.device
    token_ids = token_ids.to(device)
    greedy = target_argmax.cpu().numpy()
    normed0, fed0, kv0 = drafter.step0(features.to(device), token_ids, seq_len - 2)
    chunk = max(1, rows_per_chunk(drafter, seq_len, memory_gb, max_rows) // tree[1])
    depths = np.zeros(anchors, dtype=np.int64)
    for lo in range(0, anchors, chunk):
        rows = torch.arange(prompt_len - 1 + lo, prompt_len - 1 + min(anchors, lo + chunk), device=device)
        all_tokens, all_parents, keep = candidate_trees(drafter, normed0, fed0, kv0, rows, tree)
        for r in range(len(rows)):
            p = prompt_len + lo + r
            depths[lo + r] = greedy_walk(
                set(keep[r].tolist()), all_tokens[r], all_parents[r], greedy, p, seq_len
            )
    return depths


@torch.no_grad()
def eagle_tree(
    drafter: Any, features: torch.Tensor, token_ids: torch.Tensor, anchor: int, tree: tuple[int, int, int]
) -> EagleTree:
    """SGLang's EAGLE tree at one anchor p from the verified prefix (``scorer online --tree``): the
    same construction as ``tree_depths`` (step 0 over rows 0..p-1, causal, so row p-1 is what the
    offline replay computes for p), kept candidates in candidate order. A kept candidate whose parent
    was not kept (a score tie at the cut) is unreachable and dropped, as the greedy walk never
    reaches it.

    Args:
        features: [>= p, ...] the drafter's step-0 inputs of positions 0..p-1.
        token_ids: [>= p + 1] tokens 0..p.
    """
    p = int(anchor)
    device = drafter.fc.weight.device
    normed0, fed0, kv0 = drafter.step0(features[:p].to(device), token_ids[: p + 1].to(device), p)
    rows = torch.tensor([p - 1], device=device)
    all_tokens, all_parents, keep = candidate_trees(drafter, normed0, fed0, kv0, rows, check_tree(tree))
    where: dict[int, int] = {-1: -1}
    tokens, parents = [], []
    for c in sorted(keep[0].tolist()):
        if int(all_parents[0, c]) in where:
            where[c] = len(tokens)
            tokens.append(int(all_tokens[0, c]))
            parents.append(where[int(all_parents[0, c])])
    return EagleTree(np.asarray(tokens, dtype=np.int64), np.asarray(parents, dtype=np.int64))


def greedy_walk(
    kept: set[int], tokens: np.ndarray, parents: np.ndarray, greedy: np.ndarray, p: int, seq_len: int
) -> int:
    """Depth the target's greedy path reaches in the kept tree (g_{p+d} = a[p+d-1], d <= T-1-p)."""
    # the one-hot tree rule over the kept candidates, g_{p+1} .. g_{T-1}
    targets = np.asarray(greedy)[p : seq_len - 1].tolist()
    return len(tree_walk(tree_children(parents, tokens, sorted(kept)), targets))
