"""DDTree: a draft tree built from ONE DFlash forward, its greedy walk, a draft-only surrogate, and
the DDTree round loop replayed (on the shared round loop of scorer.offline.replay).

Spec section 4. The drafter gives per-slot distributions q_1..q_L (L = B-1, one per block
slot; they are per-slot marginals, so every node at depth d has the same candidate children,
the top tokens of q_{d+1}). With a budget of N nodes (the root, i.e. the bonus token, is not
counted) the best tree is the N prefixes with the highest product probability; those are
prefix-closed, and a best-first heap over log-probs finds them exactly.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from scorer.offline.replay import replay_walk
from scorer.rules.onehot_chain import RoundLog, check_anchor_rows, check_sequence
from scorer.rules.onehot_tree import ROOT, tree_children, tree_walk

__all__ = [
    "ROOT",
    "Tree",
    "build_tree",
    "replay_ddtree",
    "replay_trees",
    "surrogate_tau",
    "tree_depth",
    "walk_tree",
]

# ROOT (-1): the parent index of depth-1 nodes: the root (the round's bonus token) is not a node.


@dataclass(frozen=True)
class Tree:
    """A draft tree: node i has parent ``parents[i]`` (``ROOT`` or an earlier node index).

    Nodes are stored in the order the heap popped them (best first), so a parent always
    precedes its children.

    Attributes:
        parents: parent node index per node, ``ROOT`` (-1) for depth-1 nodes.
        depths: depth per node, 1..L (depth d drafts position p + d).
        token_ids: drafted token per node (``lp_ids[depth-1, rank]``).
        cum_logprobs: sum of the slot log-probs along the path from the root (float64).
        rank_paths: per node, the rank of each token along its path, e.g. (0, 2).
    """

    parents: tuple[int, ...]
    depths: tuple[int, ...]
    token_ids: tuple[int, ...]
    cum_logprobs: tuple[float, ...]
    rank_paths: tuple[tuple[int, ...], ...]
    # (parent index, token) -> child index; derived, so excluded from eq/repr.
    _children: dict[tuple[int, int], int] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_children", tree_children(self.parents, self.token_ids))

    def __len__(self) -> int:
        return len(self.parents)

    def child(self, parent: int, token: int) -> int | None:
        """Return the index of ``parent``'s child holding ``token`` (``ROOT`` for depth 1), or None."""
        return self._children.get((parent, int(token)))

    def token_path(self, node: int) -> tuple[int, ...]:
        """Return the drafted tokens from depth 1 down to ``node``."""
        tokens: list[int] = []
        while node != ROOT:
            tokens.append(self.token_ids[node])
            node = self.parents[node]
        return tuple(reversed(tokens))

    def to_dict(self) -> dict[str, Any]:
        """Return the tree as plain lists (JSON-ready)."""
        return {
            "parents": list(self.parents),
            "depths": list(self.depths),
            "token_ids": list(self.token_ids),
            "cum_logprobs": list(self.cum_logprobs),
            "rank_paths": [list(p) for p in self.rank_paths],
        }


def _check_lp(lp_vals: Any, lp_ids: Any, budget: int) -> tuple[np.ndarray, np.ndarray]:
    if hasattr(lp_vals, "detach"):  # torch tensors -> numpy, without importing torch here
        lp_vals, lp_ids = lp_vals.detach().cpu().numpy(), lp_ids.detach().cpu().numpy()
    vals, ids = np.asarray(lp_vals), np.asarray(lp_ids)
    if vals.ndim != 2 or vals.shape != ids.shape or vals.shape[0] == 0 or vals.shape[1] == 0:
        raise ValueError(
            f"lp_vals {vals.shape} and lp_ids {ids.shape} must both be [L, K] with L, K >= 1 "
            "(top-K log-probs per block slot 1..L, sorted descending)"
        )
    if budget < 0:
        raise ValueError(f"budget {budget} is negative; pass the number of tree nodes N >= 0")
    return vals, ids


def build_tree(lp_vals: Any, lp_ids: Any, budget: int) -> Tree:
    """Build the DDTree of ``budget`` nodes with the heap algorithm of spec section 4.

    Args:
        lp_vals: [L, K] float log-probs (log_softmax over the FULL vocabulary) of each slot's
            top-K tokens, sorted descending per slot. Pass at least min(budget, V) columns;
            with fewer, the tree is the best one over the columns given.
        lp_ids: [L, K] int token ids matching ``lp_vals``; distinct within a row.
        budget: N, the number of nodes (the root is not counted).

    Returns:
        The tree of the min(N, #prefixes) highest-probability prefixes. Equal scores are
        ordered by comparing rank paths lexicographically (smaller first).

    Raises:
        ValueError: on malformed shapes or a negative budget.
    """
    vals, ids = _check_lp(lp_vals, lp_ids, budget)
    n_depth = vals.shape[0]
    k = min(budget, vals.shape[1])  # K = min(N, V): more than N siblings can never be used
    lp = vals.astype(np.float64).tolist()  # float32 in, float64 sums: exact per-term values
    tok = ids.tolist()
    parents: list[int] = []
    depths: list[int] = []
    tokens: list[int] = []
    cums: list[float] = []
    paths: list[tuple[int, ...]] = []
    # Heap entries: (-cum logprob, rank path, parent index, parent cum). Rank paths are unique,
    # so comparison never reaches the parent fields; equal scores pop in lexicographic path order.
    heap: list[tuple[float, tuple[int, ...], int, float]] = []
    if budget > 0:
        heap.append((-lp[0][0], (0,), ROOT, 0.0))
    while heap and len(parents) < budget:
        neg, path, parent, parent_cum = heapq.heappop(heap)
        node, depth, rank = len(parents), len(path), path[-1]
        parents.append(parent)
        depths.append(depth)
        tokens.append(int(tok[depth - 1][rank]))
        cums.append(-neg)
        paths.append(path)
        if rank + 1 < k:  # next sibling: same parent, next rank at this depth
            sib = parent_cum + lp[depth - 1][rank + 1]
            heapq.heappush(heap, (-sib, path[:-1] + (rank + 1,), parent, parent_cum))
        if depth < n_depth:  # first child: best token of the next slot
            heapq.heappush(heap, (-(-neg + lp[depth][0]), path + (0,), node, -neg))
    return Tree(tuple(parents), tuple(depths), tuple(tokens), tuple(cums), tuple(paths))


def walk_tree(tree: Tree, greedy_tokens_by_depth: Sequence[int]) -> tuple[int, ...]:
    """Greedy verification: from the root, follow the child holding the target's greedy token.

    Args:
        tree: the draft tree.
        greedy_tokens_by_depth: g_{p+1}, g_{p+2}, ...: the target's greedy token at each depth.
            It may be shorter than the tree is deep (the sequence ends); the walk stops there.

    Returns:
        The matched node indices, depth 1 first; the round yields len(result) + 1 tokens.
    """
    return tree_walk(tree._children, greedy_tokens_by_depth)  # the one-hot tree rule


def surrogate_tau(tree: Tree) -> float:
    """DRAFT-ONLY ESTIMATE of tokens per round: 1 + sum over nodes of their path probability.

    It needs no target: it is what the round would yield in expectation if the drafter's
    per-slot distributions were the truth. Label it as an estimate, never as tau.
    """
    return 1.0 + math.fsum(math.exp(c) for c in tree.cum_logprobs)


def tree_depth(tree: Tree, target_argmax: np.ndarray, p: int, avail: int) -> int:
    """Nodes the greedy walk matches in the tree drafted at anchor ``p``."""
    return _tree_walk(tree, target_argmax, p, avail)


def _tree_walk(tree: Tree, a: np.ndarray, p: int, avail: int) -> int:
    # Depth j is checked against g_{p+j} = a[p+j-1], j = 1..avail.
    return len(walk_tree(tree, a[p : p + avail].tolist()))


def replay_trees(trees: Sequence[Tree], token_ids: Any, target_argmax: Any, prompt_len: int) -> RoundLog:
    """Replay the DDTree round loop (spec section 4) with one prebuilt tree per anchor.

    Args:
        trees: A = T-1-P trees; ``trees[r]`` is the tree drafted at anchor P + r.
        token_ids: [T] token ids x.
        target_argmax: [T] target argmax a.
        prompt_len: P.

    Returns:
        The RoundLog; acc is the number of nodes matched by the greedy walk (``walk_tree``).

    Raises:
        ValueError: on mismatched shapes.
    """
    x, a = check_sequence(token_ids, target_argmax, prompt_len)
    check_anchor_rows("trees", len(trees), len(x), prompt_len)
    return replay_walk(lambda p, avail: _tree_walk(trees[p - prompt_len], a, p, avail), x, a, prompt_len)


def replay_ddtree(
    lp_vals: Any,
    lp_ids: Any,
    token_ids: Any,
    target_argmax: Any,
    prompt_len: int,
    budget: int,
    built: dict[int, Tree] | None = None,
) -> RoundLog:
    """Replay DDTree-``budget`` from per-slot top-K log-probs, building trees only where visited.

    Args:
        lp_vals: [A, B-1, K] float log-probs (log_softmax over the full vocabulary, sorted
            descending per slot); row r is anchor P + r.
        lp_ids: [A, B-1, K] token ids matching ``lp_vals``.
        token_ids: [T] token ids x.
        target_argmax: [T] target argmax a.
        prompt_len: P.
        budget: N tree nodes per round (root not counted).
        built: if given, filled with the trees the replay built, keyed by anchor row r, so a
            caller (e.g. the draft-only surrogate) can reuse them instead of building them again.

    Returns:
        The RoundLog, as ``replay_trees`` with ``build_tree(lp_vals[r], lp_ids[r], budget)``.

    Raises:
        ValueError: on mismatched shapes or a negative budget.
    """
    if hasattr(lp_vals, "detach"):
        lp_vals, lp_ids = lp_vals.detach().cpu().numpy(), lp_ids.detach().cpu().numpy()
    vals, ids = np.asarray(lp_vals), np.asarray(lp_ids)
    x, a = check_sequence(token_ids, target_argmax, prompt_len)
    if vals.ndim != 3 or vals.shape != ids.shape:
        raise ValueError(f"lp_vals {vals.shape} and lp_ids {ids.shape} must both be [A, B-1, K]")
    check_anchor_rows("lp_vals", vals.shape[0], len(x), prompt_len)
    if budget < 0:
        raise ValueError(f"budget {budget} is negative; pass the number of tree nodes N >= 0")

    def walk(p: int, avail: int) -> int:
        r = p - prompt_len
        tree = build_tree(vals[r], ids[r], budget)
        if built is not None:
            built[r] = tree
        return _tree_walk(tree, a, p, avail)

    return replay_walk(walk, x, a, prompt_len)
