"""Offline verification rules on sampled trajectories (spec/sampling.md 4.1-4.4), on hand-made inputs.

One-hot and tree rounds through the existing replay against a direct simulation of spec 4.4; the
probabilistic DP against brute-force enumeration of every acceptance-coin outcome.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from scorer.families.autoregressive import greedy_walk
from scorer.families.dflash.ddtree import Tree, build_tree, replay_ddtree, replay_trees
from scorer.offline.replay import replay_chain, round_loop
from scorer.rules.expectation import (
    all_anchor_acceptance,
    depth_acceptance,
    draft_log_q,
    onehot_acceptance,
    rounds_from_log,
    sampled_match_targets,
    sequence_rounds,
    slot_acceptance,
    slot_tokens,
    target_to_draft_index,
)


def _simulate(matches, seq_len: int, prompt_len: int, k: int) -> list[tuple[int, int, int]]:
    """Spec 4.4's loop written out: (anchor, acc, tokens) per round; ``matches(a, j)`` is slot j's test."""
    rounds, a = [], prompt_len
    while a < seq_len - 1:
        avail = seq_len - 1 - a
        acc = 0
        while acc < min(k, avail) and matches(a, acc + 1):
            acc += 1
        tokens = min(acc + 1, avail)
        rounds.append((a, acc, tokens))
        a += tokens
    return rounds


def _walk_depth(matches, a: int, limit: int) -> int:
    d = 0
    while d < limit and matches(a, d + 1):
        d += 1
    return d


def _sampled(rng: np.random.Generator, seq_len: int, vocab: int) -> np.ndarray:
    return rng.integers(0, vocab, size=seq_len)


def _chain_drafts(rng, y, prompt_len, k, p_ok, vocab):
    """[A, K] drafts: y_{a+j} with probability p_ok, another token otherwise (or anything past the end)."""
    want = slot_tokens(y, prompt_len, k)
    wrong = (np.maximum(want, 0) + 1 + rng.integers(0, vocab - 1, size=want.shape)) % vocab
    return np.where((rng.random(want.shape) < p_ok) & (want >= 0), want, wrong)


def test_sampled_match_targets_shift_the_trajectory() -> None:
    y = np.array([4, 7, 1, 1, 9])
    assert sampled_match_targets(y).tolist() == [7, 1, 1, 9, 9]
    assert sampled_match_targets(torch.tensor([3])).tolist() == [3]
    with pytest.raises(ValueError, match="token_ids is empty; a sequence needs at least its prompt"):
        sampled_match_targets(np.zeros(0, dtype=np.int64))


@pytest.mark.parametrize("seed", range(12))
def test_chain_rounds_on_a_sampled_trajectory_equal_direct_simulation(seed: int) -> None:
    rng = np.random.default_rng(seed)
    k, prompt_len = int(rng.integers(1, 6)), int(rng.integers(1, 8))
    y = _sampled(rng, prompt_len + int(rng.integers(1, 60)), 6)
    draft = _chain_drafts(rng, y, prompt_len, k, 0.7, 6)
    log = replay_chain(draft, y, sampled_match_targets(y), prompt_len, k + 1)
    want = _simulate(lambda a, j: draft[a - prompt_len, j - 1] == y[a + j], len(y), prompt_len, k)
    assert list(zip(log.anchors, log.accepted, log.tokens)) == want
    assert log.n_cut_off_greedy == 0 and log.off_greedy_positions == 0
    rounds = rounds_from_log(log, k)
    assert rounds.expected_rounds == len(want)
    # The DP on the 0/1 alphas of the one-hot rule reproduces the deterministic rounds.
    dp = sequence_rounds(onehot_acceptance(draft, y, prompt_len), prompt_len, len(y))
    assert dp == rounds
    assert dp.served_accepted == tuple(float(sum(acc >= i for _, acc, _ in want)) for i in range(1, k + 1))


def test_round_loop_never_cuts_a_sampled_trajectory() -> None:
    y = np.array([5, 2, 2, 8, 1, 0, 3])
    loop = round_loop(y, sampled_match_targets(y), 1)
    while not loop.done:
        loop.step(10)  # a drafter that always matches: the data never stops it
    log = loop.log()
    assert log.tokens == (5,) and log.cut_off_greedy == (False,) and log.hit_end == (True,)


def _tree_children(tree: Tree) -> dict[int, set[int]]:
    kids: dict[int, set[int]] = {}
    for parent, token in zip(tree.parents, tree.token_ids):
        kids.setdefault(parent, set()).add(token)
    return kids


def _tree_match(trees, y, prompt_len):
    """Slot j of the round at a continues iff y_{a+j} is a child of the node reached by y_{a+1..a+j-1}."""

    def matches(a: int, j: int) -> bool:
        tree = trees[a - prompt_len]
        node = -1
        for d in range(1, j):
            node = tree.child(node, int(y[a + d]))
        return int(y[a + j]) in _tree_children(tree).get(node, set())

    return matches


@pytest.mark.parametrize("seed", range(8))
def test_ddtree_rounds_on_a_sampled_trajectory_equal_direct_simulation(seed: int) -> None:
    rng = np.random.default_rng(100 + seed)
    vocab, depth, budget, prompt_len = 5, 3, int(rng.choice([2, 5, 9])), 2
    y = _sampled(rng, prompt_len + 30, vocab)
    n_anchor = len(y) - 1 - prompt_len
    lp = np.sort(np.log(rng.dirichlet(np.ones(vocab), size=(n_anchor, depth))), axis=-1)[..., ::-1].copy()
    ids = np.argsort(rng.random((n_anchor, depth, vocab)), axis=-1)
    log = replay_ddtree(lp, ids, y, sampled_match_targets(y), prompt_len, budget)
    trees = [build_tree(lp[r], ids[r], budget) for r in range(n_anchor)]
    want = _simulate(_tree_match(trees, y, prompt_len), len(y), prompt_len, depth)
    assert list(zip(log.anchors, log.accepted, log.tokens)) == want
    assert replay_trees(trees, y, sampled_match_targets(y), prompt_len) == log
    # Per-anchor walk depths -> 0/1 alphas -> the DP gives the same rounds.
    matches = _tree_match(trees, y, prompt_len)
    depths = [_walk_depth(matches, a, min(depth, len(y) - 1 - a)) for a in range(prompt_len, len(y) - 1)]
    assert sequence_rounds(depth_acceptance(depths, depth), prompt_len, len(y)) == rounds_from_log(log, depth)


def test_sglang_tree_walk_matches_children_along_the_sampled_tokens() -> None:
    # Kept candidates: root children {3 (node 0), 4 (node 1)}, node 0's children {1 (node 2)}.
    tokens = np.array([3, 4, 1, 2])
    parents = np.array([-1, -1, 0, 1])
    kept = {0, 1, 2}  # node 3 (token 2 under node 1) was not kept
    y = np.array([9, 9, 3, 1, 5, 4, 2])
    a_prime = sampled_match_targets(y)
    assert greedy_walk(kept, tokens, parents, a_prime, 1, len(y)) == 2  # y2=3 (node 0), y3=1 (node 2)
    assert greedy_walk(kept, tokens, parents, a_prime, 4, len(y)) == 1  # y5=4 (node 1), y6=2 not kept
    assert greedy_walk(kept, tokens, parents, a_prime, 3, len(y)) == 0  # y4=5 is no root child


def _brute_force(alpha: np.ndarray, prompt_len: int, seq_len: int) -> tuple[float, np.ndarray]:
    """E[R] and E[#rounds with acc >= i] by enumerating every coin matrix (independent coins per slot)."""
    n_anchor, k = alpha.shape
    expected_rounds, served = 0.0, np.zeros(k)
    for coins in itertools.product((0, 1), repeat=n_anchor * k):
        c = np.array(coins).reshape(n_anchor, k)
        weight = float(np.prod(np.where(c == 1, alpha, 1 - alpha)))
        if weight == 0.0:
            continue
        rounds = _simulate(lambda a, j, c=c: c[a - prompt_len, j - 1] == 1, seq_len, prompt_len, k)
        expected_rounds += weight * len(rounds)
        for _, acc, _ in rounds:
            served[:acc] += weight
    return expected_rounds, served


@pytest.mark.parametrize(
    ("prompt_len", "seq_len", "k", "seed"),
    [(1, 6, 3, 0), (2, 8, 3, 1), (3, 7, 4, 2), (1, 5, 5, 3), (4, 9, 2, 4), (2, 3, 3, 5)],
)
def test_dp_equals_brute_force_enumeration_of_coins(prompt_len: int, seq_len: int, k: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    alpha = rng.random((seq_len - 1 - prompt_len, k))
    alpha[rng.random(alpha.shape) < 0.15] = 0.0
    alpha[rng.random(alpha.shape) < 0.15] = 1.0
    got = sequence_rounds(alpha, prompt_len, seq_len)
    want_rounds, want_served = _brute_force(alpha, prompt_len, seq_len)
    assert got.tokens == seq_len - 1 - prompt_len
    assert got.expected_rounds == pytest.approx(want_rounds, rel=1e-12, abs=1e-12)
    np.testing.assert_allclose(got.served_accepted, want_served, rtol=1e-12, atol=1e-12)


def test_dp_by_hand_two_positions() -> None:
    # T=4, P=1: anchors 1, 2; K=2. Round at 1: acc 0 -> anchor 2 (then 1 more round); acc >= 1 ends.
    alpha = np.array([[0.25, 0.5], [0.8, 0.3]])
    got = sequence_rounds(alpha, 1, 4)
    assert got.expected_rounds == pytest.approx(1 + 0.75 * 1)
    # served acc >= 1: 0.25 (round at 1) + 0.75 * 0.8 (round at 2); acc >= 2: 0.25 * 0.5 (avail at 2 is 1)
    assert got.served_accepted == pytest.approx((0.25 + 0.6, 0.125))
    sums, counts = all_anchor_acceptance(alpha, 1, 4)
    assert sums.tolist() == pytest.approx([0.25 + 0.8, 0.125]) and counts.tolist() == [2, 1]


def test_slot_acceptance_is_min_one_q_over_p() -> None:
    # T=5, P=1: anchors 1..3, K=2; log p of positions 2..4.
    logp = np.log([1.0, 1.0, 0.5, 0.2, 0.4])
    logq = np.log([[0.25, 0.9], [0.3, 0.1], [0.8, 0.7]])
    logq[1, 1] = -np.inf  # y_4 outside q's support
    alpha = slot_acceptance(logq, logp, 1)
    want = np.array([[0.5, 1.0], [1.0, 0.0], [1.0, 0.0]])  # row 2 slot 2 lies past the end
    np.testing.assert_allclose(alpha, want, rtol=1e-15)
    bad = logp.copy()
    bad[3] = -np.inf
    with pytest.raises(ValueError, match="a realised token with p = 0 means the trajectory was not sampled"):
        slot_acceptance(logq, bad, 1)
    with pytest.raises(
        ValueError, match=r"log_q has 2 anchor rows but a sequence of length 5 with prompt_len 1 has 3"
    ):
        slot_acceptance(logq[:2], logp, 1)


def test_slot_tokens_and_onehot_acceptance() -> None:
    y = np.array([0, 1, 2, 3, 4])
    assert slot_tokens(y, 2, 3).tolist() == [[3, 4, -1], [4, -1, -1]]
    draft = np.array([[3, 9, 4], [4, 4, 4]])
    assert onehot_acceptance(draft, y, 2).tolist() == [[1.0, 0.0, 0.0], [1.0, 0.0, 0.0]]


def test_draft_log_q_is_log_softmax_at_temperature_in_chunks() -> None:
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(37, 50, generator=g) * 3).to(torch.bfloat16)
    cols = torch.randint(0, 50, (37,), generator=g)
    cols[5] = -1
    want = torch.log_softmax(logits.float() / 0.7, dim=-1).gather(1, cols.clamp(min=0)[:, None])[:, 0]
    for chunk in (1, 8, 1000):
        got = draft_log_q(logits, cols, 0.7, chunk_rows=chunk)
        assert got.dtype == torch.float32 and got[5] == -torch.inf
        keep = cols >= 0
        torch.testing.assert_close(got[keep], want[keep], rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match=r"temperature 0.0 must be > 0 \(at T = 0 use the one-hot rule\)"):
        draft_log_q(logits, cols, 0.0)


def test_reduced_vocabulary_maps_target_ids_and_gives_minus_inf_outside() -> None:
    inverse = target_to_draft_index([7, 2, 5], 9)
    assert inverse.tolist() == [-1, -1, 1, -1, -1, 2, -1, 0, -1]
    logits = torch.tensor([[1.0, 2.0, 3.0], [0.0, 0.0, 0.0]])
    got = draft_log_q(logits, inverse[torch.tensor([5, 4])], 1.0)
    assert got[0].item() == pytest.approx(3.0 - float(torch.logsumexp(logits[0], 0)), rel=1e-6)
    assert got[1].item() == -np.inf
    with pytest.raises(ValueError, match=r"draft_to_target holds ids outside the target vocabulary 0\.\.8"):
        target_to_draft_index([9], 9)
