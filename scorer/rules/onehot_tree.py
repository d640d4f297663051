"""The one-hot tree rule (SGLang's greedy tree verification; the EAGLE repo; DDTree): from the root, a
round follows the child whose drafted token equals the target's committed token at that depth, and
accepts the nodes it reaches, plus one token from the target.

SGLang: ``python/sglang/srt/speculative/eagle_info.py`` ``EagleVerifyInput.verify`` (commit 0007d13b;
spec/sampling.md 1.2) calls ``verify_tree_greedy`` for greedy requests: the walk below. DDTree (the
z-lab reference's tree verification, families/dflash/ddtree.py) walks its tree the same way. At T > 0
the same rule holds along the target's SAMPLED tokens (spec/sampling.md 4.1 C;
``scorer.rules.expectation.sampled_match_targets``). A chain is the tree of one child per node
(scorer/rules/onehot_chain.py).

Pure functions: a tree is its ``children`` map, (parent node, token) -> child node (parent -1 is the
root), built once per tree by ``tree_children``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

__all__ = ["ROOT", "tree_children", "tree_walk"]

ROOT = -1  # the parent index of a depth-1 node


def tree_children(parents: Sequence[int], tokens: Sequence[int], nodes: Iterable[int] | None = None) -> dict:
    """(parent, token) -> node of ``nodes`` (default: every node). A parent's children hold distinct
    tokens (each is one of its top-k); should two share one, the later node is the child."""
    chosen = range(len(parents)) if nodes is None else nodes
    return {(int(parents[i]), int(tokens[i])): int(i) for i in chosen}


def tree_walk(children: Mapping[tuple[int, int], int], targets: Iterable[int]) -> tuple[int, ...]:
    """The nodes the one-hot rule accepts: from the root, the child holding the target's token at each
    depth (``targets``: g_{p+1}, g_{p+2}, ..., as long as the sequence allows), until none does.

    Returns:
        The accepted node indices, depth 1 first; the round commits len(result) + 1 tokens.
    """
    matched: list[int] = []
    node = ROOT
    for token in targets:
        nxt = children.get((node, int(token)))
        if nxt is None:
            break
        matched.append(nxt)
        node = nxt
    return tuple(matched)
