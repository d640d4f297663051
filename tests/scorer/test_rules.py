"""scorer/rules/: the one-hot rules every replay and the online loop call, against explicit loops."""

from __future__ import annotations

import numpy as np

from scorer.rules.onehot_chain import chain_depth, leading_matches, slot_matches
from scorer.rules.onehot_tree import ROOT, tree_children, tree_walk


def _accepted_by_hand(draft: list[int], target: list[int]) -> int:
    """vLLM's rejection_greedy_sample_kernel: accept slot j while draft_j == the target's token j."""
    n = 0
    for d, t in zip(draft, target):
        if d != t:
            break
        n += 1
    return n


def test_chain_depth_and_leading_matches_equal_the_kernels_loop() -> None:
    rng = np.random.default_rng(0)
    for _ in range(50):
        k, n = int(rng.integers(1, 6)), int(rng.integers(3, 12))
        x = rng.integers(0, 3, n)  # a small vocabulary: long matches happen
        a = rng.integers(0, 3, n)
        prompt_len = int(rng.integers(1, n))
        draft = rng.integers(0, 3, (max(n - 1 - prompt_len, 0), k))
        match, valid = slot_matches(draft, x, a, prompt_len)
        lead = leading_matches(match)
        for r, row in enumerate(draft.tolist()):
            p = prompt_len + r
            greedy = a[p : min(p + k, n - 1)].tolist()  # g_{p+j} = a[p+j-1], inside the sequence
            assert lead[r] == _accepted_by_hand(row, greedy) == chain_depth(row, a[: n - 1], p)


def test_leading_matches_of_no_anchor_is_empty() -> None:
    assert leading_matches(np.zeros((0, 3), dtype=bool)).tolist() == []


def test_tree_walk_follows_the_child_holding_the_targets_token() -> None:
    #        root
    #       /    \
    #   0:'5'   1:'7'
    #    |      /   \
    #  2:'1'  3:'2' 4:'9'
    parents, tokens = [ROOT, ROOT, 0, 1, 1], [5, 7, 1, 2, 9]
    children = tree_children(parents, tokens)
    assert tree_walk(children, [7, 9, 4]) == (1, 4)
    assert tree_walk(children, [5, 1]) == (0, 2)
    assert tree_walk(children, [5]) == (0,)  # the sequence ends: the walk stops there
    assert tree_walk(children, [6, 1]) == ()
    # only the kept nodes count (SGLang keeps the best N-1 candidates): without node 4, 9 is no child
    assert tree_walk(tree_children(parents, tokens, [0, 1, 2, 3]), [7, 9]) == (1,)
