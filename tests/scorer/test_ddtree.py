"""DDTree construction (spec section 4) against brute force, the tie rule, the walk, the surrogate."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from scorer.families.dflash.ddtree import ROOT, Tree, build_tree, surrogate_tau, walk_tree


def _random_lp(rng: np.random.Generator, depth: int, vocab: int) -> tuple[np.ndarray, np.ndarray]:
    """Per-slot log_softmax over the full vocabulary, sorted descending: ([L, V] vals, [L, V] ids)."""
    logits = rng.normal(scale=2.0, size=(depth, vocab))
    lp = logits - np.log(np.exp(logits).sum(axis=1, keepdims=True))
    ids = np.argsort(-lp, axis=1, kind="stable")
    return np.take_along_axis(lp, ids, axis=1).astype(np.float32), ids


def _brute_force_top(vals: np.ndarray, ids: np.ndarray, budget: int) -> list[tuple[int, ...]]:
    """Enumerate every prefix up to depth L, rank by (-sum log-prob, rank path), keep the best N."""
    depth, vocab = vals.shape
    lp = vals.astype(np.float64)
    scored = []
    for d in range(1, depth + 1):
        for ranks in itertools.product(range(vocab), repeat=d):
            score = sum(lp[i][r] for i, r in enumerate(ranks))
            scored.append((-score, ranks))
    scored.sort()
    return [tuple(int(ids[i][r]) for i, r in enumerate(ranks)) for _, ranks in scored[:budget]]


def _token_paths(tree: Tree) -> list[tuple[int, ...]]:
    return [tree.token_path(i) for i in range(len(tree))]


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("budget", [1, 2, 5, 8, 13, 30])
def test_tree_equals_brute_force_top_prefixes(seed: int, budget: int) -> None:
    rng = np.random.default_rng(seed)
    depth, vocab = (3, 6) if seed % 2 else (4, 5)
    vals, ids = _random_lp(rng, depth, vocab)
    tree = build_tree(vals, ids, budget)
    expected = _brute_force_top(vals, ids, budget)
    assert len(tree) == budget
    assert set(_token_paths(tree)) == set(expected)
    # Without ties the pop order is the global score order as well.
    assert _token_paths(tree) == expected


def test_tree_structure_is_consistent() -> None:
    vals, ids = _random_lp(np.random.default_rng(7), 4, 6)
    tree = build_tree(vals, ids, 20)
    for i in range(len(tree)):
        parent, path = tree.parents[i], tree.rank_paths[i]
        assert tree.depths[i] == len(path)
        assert tree.token_ids[i] == ids[len(path) - 1][path[-1]]
        assert math.isclose(tree.cum_logprobs[i], sum(float(vals[d][r]) for d, r in enumerate(path)))
        if parent == ROOT:
            assert len(path) == 1
        else:
            assert parent < i and tree.rank_paths[parent] == path[:-1]


def test_budget_larger_than_all_prefixes_gives_every_prefix() -> None:
    vals, ids = _random_lp(np.random.default_rng(3), 2, 3)
    tree = build_tree(vals, ids, 100)
    assert len(tree) == 3 + 9


def test_fewer_columns_than_budget_uses_k_equal_columns() -> None:
    # K = min(N, columns): with 2 columns only ranks 0 and 1 ever appear.
    vals, ids = _random_lp(np.random.default_rng(4), 3, 5)
    tree = build_tree(vals[:, :2], ids[:, :2], 6)
    assert len(tree) == 6 and all(max(p) <= 1 for p in tree.rank_paths)


def test_ties_are_broken_by_rank_path_lexicographically() -> None:
    # Scores by hand: (0,)=-1, (1,)=-1, then (0,0), (0,1), (1,0), (1,1), (2,) all = -2.
    vals = np.array([[-1.0, -1.0, -2.0], [-1.0, -1.0, -2.0]], dtype=np.float32)
    ids = np.array([[10, 11, 12], [20, 21, 22]])
    tree = build_tree(vals, ids, 7)
    assert list(tree.rank_paths) == [(0,), (1,), (0, 0), (0, 1), (1, 0), (1, 1), (2,)]
    assert _token_paths(tree) == [(10,), (11,), (10, 20), (10, 21), (11, 20), (11, 21), (12,)]
    assert list(tree.parents) == [ROOT, ROOT, 0, 0, 1, 1, ROOT]
    assert list(tree.cum_logprobs) == [-1.0, -1.0, -2.0, -2.0, -2.0, -2.0, -2.0]
    assert _token_paths(build_tree(vals, ids, 4)) == [(10,), (11,), (10, 20), (10, 21)]


def test_zero_budget_and_bad_input() -> None:
    vals, ids = _random_lp(np.random.default_rng(0), 2, 3)
    assert len(build_tree(vals, ids, 0)) == 0
    with pytest.raises(ValueError, match="budget -1 is negative"):
        build_tree(vals, ids, -1)
    with pytest.raises(ValueError, match=r"must both be \[L, K\]"):
        build_tree(vals, ids[:, :2], 3)


def _hand_tree() -> Tree:
    #        root
    #       /    \
    #     5(0)   7(1)
    #    /   \      \
    #  8(2)  9(3)   8(4)
    #  |
    #  4(5)
    return Tree(
        parents=(ROOT, ROOT, 0, 0, 1, 2),
        depths=(1, 1, 2, 2, 2, 3),
        token_ids=(5, 7, 8, 9, 8, 4),
        cum_logprobs=tuple(math.log(q) for q in (0.5, 0.25, 0.25, 0.125, 0.125, 0.1)),
        rank_paths=((0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)),
    )


@pytest.mark.parametrize(
    ("greedy", "expected"),
    [
        ([5, 8, 4], (0, 2, 5)),
        ([5, 8, 4, 1], (0, 2, 5)),  # deeper than the tree
        ([5, 9, 4], (0, 3)),
        ([7, 8, 9], (1, 4)),
        ([7, 9], (1,)),
        ([6, 8], ()),
        ([5], (0,)),  # sequence end after one depth
        ([], ()),
    ],
)
def test_walk_tree_on_hand_built_tree(greedy: list[int], expected: tuple[int, ...]) -> None:
    assert walk_tree(_hand_tree(), greedy) == expected


def test_surrogate_tau_by_hand() -> None:
    # 1 + 0.5 + 0.25 + 0.25 + 0.125 + 0.125 + 0.1
    assert surrogate_tau(_hand_tree()) == pytest.approx(2.35)
    assert surrogate_tau(build_tree(np.zeros((2, 1)), np.zeros((2, 1), dtype=int), 5)) == 3.0


def test_tree_to_dict_is_plain() -> None:
    d = _hand_tree().to_dict()
    assert d["parents"] == [-1, -1, 0, 0, 1, 2] and d["rank_paths"][5] == [0, 0, 0]
