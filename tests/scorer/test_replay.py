"""Offline round replay (spec sections 3 and 4) against hand-computed cases and slow reference loops."""

from __future__ import annotations

import numpy as np
import pytest

from scorer.families.dflash.ddtree import ROOT, build_tree, replay_ddtree, replay_trees, walk_tree
from scorer.offline.replay import RoundLog, replay_chain, slot_matches


def _greedy_sequence(rng: np.random.Generator, seq_len: int, vocab: int, off_rate: float = 0.0):
    """Random (x, a): x[t] == a[t-1] for every generated t except a fraction ``off_rate``."""
    a = rng.integers(0, vocab, size=seq_len)
    x = np.empty(seq_len, dtype=np.int64)
    x[0] = rng.integers(0, vocab)
    x[1:] = a[:-1]
    off = rng.random(seq_len - 1) < off_rate
    x[1:][off] = (a[:-1][off] + 1) % vocab  # dataset text leaving the greedy path
    return x, a


def _drafts(rng: np.random.Generator, a: np.ndarray, prompt_len: int, block: int, p_ok: float, vocab: int):
    """[A, B-1] drafts: slot j at anchor p is g_{p+j} = a[p+j-1] with probability p_ok, else wrong."""
    n_anchor = max(len(a) - 1 - prompt_len, 0)
    pos = np.minimum(prompt_len + np.arange(n_anchor)[:, None] + np.arange(block - 1)[None, :], len(a) - 1)
    g = a[pos]
    ok = rng.random(g.shape) < p_ok
    return np.where(ok, g, (g + 1 + rng.integers(0, vocab - 1, size=g.shape)) % vocab)


def _reference_chain(draft, x, a, prompt_len, block):
    """Slow, obviously correct round loop: spec section 3 written out with plain ints."""
    rounds = []
    p, n = prompt_len, len(x)
    while p < n - 1:
        avail = n - 1 - p
        acc, cut = 0, False
        for j in range(1, min(block - 1, avail) + 1):
            g = a[p + j - 1]
            if draft[p - prompt_len][j - 1] != g:
                break
            if x[p + j] != g:  # target accepts, but the cached data goes elsewhere: stop
                cut = True
                break
            acc += 1
        tokens = min(acc + 1, avail)
        rounds.append((p, acc, tokens, cut, acc == avail))
        p += tokens
    return rounds


def _as_rows(log: RoundLog):
    return list(zip(log.anchors, log.accepted, log.tokens, log.cut_off_greedy, log.hit_end))


# ---------------------------------------------------------------- chain


@pytest.mark.parametrize(
    ("n_gen", "expected_tokens"),
    [
        (40, (16, 16, 8)),  # 2 full rounds, then 8 positions left: acc 8, no bonus -> 40/3
        (32, (16, 16)),  # exactly two full rounds: acc 15 + bonus each -> 16
        (15, (15,)),  # one round, 15 slots reach T-1: bonus dropped -> 15
        (1, (1,)),
    ],
)
def test_oracle_drafter_gives_maximum_tau(n_gen: int, expected_tokens: tuple[int, ...]) -> None:
    prompt_len, block = 5, 16
    x, a = _greedy_sequence(np.random.default_rng(0), prompt_len + 1 + n_gen, 50)
    draft = _drafts(np.random.default_rng(1), a, prompt_len, block, p_ok=1.0, vocab=50)
    log = replay_chain(draft, x, a, prompt_len, block)
    assert log.tokens == expected_tokens
    assert log.tau == sum(expected_tokens) / len(expected_tokens)
    assert log.hit_end[-1] == (n_gen % block != 0)
    assert log.n_cut_off_greedy == 0 and log.off_greedy_positions == 0


def test_oracle_tau_literal() -> None:
    x, a = _greedy_sequence(np.random.default_rng(2), 5 + 1 + 40, 50)
    draft = _drafts(np.random.default_rng(3), a, 5, 16, p_ok=1.0, vocab=50)
    assert replay_chain(draft, x, a, 5, 16).tau == pytest.approx(13.333333333333334)


def test_always_wrong_drafter_gives_tau_exactly_one() -> None:
    x, a = _greedy_sequence(np.random.default_rng(4), 60, 30)
    draft = _drafts(np.random.default_rng(5), a, 10, 16, p_ok=0.0, vocab=30)
    log = replay_chain(draft, x, a, 10, 16)
    assert log.tau == 1.0
    assert log.n_rounds == 60 - 1 - 10 and set(log.accepted) == {0}
    assert log.anchors == tuple(range(10, 59))


def test_hand_made_off_greedy_case() -> None:
    # T=8, P=2, B=4. Position 4 leaves the greedy path: x[4]=12 but g_4 = a[3] = 99.
    x = np.array([9, 9, 10, 11, 12, 13, 14, 15])
    a = np.array([9, 10, 11, 99, 13, 14, 15, 0])
    draft = np.zeros((5, 3), dtype=np.int64)  # anchors 2..6; rows 1 and 3 are never visited
    draft[0] = [11, 99, 13]  # p=2: slot 1 ok; slot 2 matches g_4 but data is off-greedy -> cut
    draft[2] = [13, 0, 15]  # p=4: slot 1 ok, slot 2 wrong -> acc 1
    draft[4] = [15, 1, 1]  # p=6: only one position left, matched -> acc 1, no bonus
    log = replay_chain(draft, x, a, 2, 4)
    assert log.anchors == (2, 4, 6)
    assert log.accepted == (1, 1, 1)
    assert log.tokens == (2, 2, 1)
    assert log.cut_off_greedy == (True, False, False)
    assert log.hit_end == (False, False, True)
    assert log.off_greedy_positions == 1
    assert log.tau == 5 / 3
    # A draft that misses at the off-greedy position is not "cut": the round ends there anyway.
    draft[0] = [11, 7, 13]
    log = replay_chain(draft, x, a, 2, 4)
    assert log.tokens == (2, 2, 1) and log.cut_off_greedy == (False, False, False)


@pytest.mark.parametrize("seed", range(40))
def test_chain_equals_reference_loop(seed: int) -> None:
    rng = np.random.default_rng(seed)
    block = int(rng.choice([2, 4, 8, 16]))
    prompt_len = int(rng.integers(1, 20))
    seq_len = prompt_len + int(rng.integers(0, 120))
    x, a = _greedy_sequence(rng, seq_len, 20, off_rate=[0.0, 0.03, 0.2][seed % 3])
    draft = _drafts(rng, a, prompt_len, block, p_ok=0.7, vocab=20)
    log = replay_chain(draft, x, a, prompt_len, block)
    assert _as_rows(log) == _reference_chain(draft, x, a, prompt_len, block)
    assert log.n_tokens == max(seq_len - 1 - prompt_len, 0)  # rounds commit every position once
    assert all(1 <= t <= block for t in log.tokens)


def test_no_generated_tokens_gives_no_rounds() -> None:
    x, a = _greedy_sequence(np.random.default_rng(0), 6, 10)
    log = replay_chain(np.zeros((0, 3), dtype=np.int64), x, a, 5, 4)
    assert log.n_rounds == 0 and log.tau is None
    assert log.to_dict()["tau"] is None


def test_torch_inputs_are_accepted() -> None:
    torch = pytest.importorskip("torch")
    x, a = _greedy_sequence(np.random.default_rng(0), 30, 10)
    draft = _drafts(np.random.default_rng(1), a, 4, 4, 0.7, 10)
    log = replay_chain(torch.from_numpy(draft), torch.from_numpy(x), torch.from_numpy(a), 4, 4)
    assert log == replay_chain(draft, x, a, 4, 4)


def test_shape_errors_name_the_fix() -> None:
    x, a = _greedy_sequence(np.random.default_rng(0), 20, 10)
    msg = r"draft has 14 anchor rows but a sequence of length 20 with prompt_len 4 has 15 anchors"
    with pytest.raises(ValueError, match=msg):
        replay_chain(np.zeros((14, 3), dtype=np.int64), x, a, 4, 4)
    with pytest.raises(ValueError, match="block_size 8 needs 7"):
        replay_chain(np.zeros((15, 3), dtype=np.int64), x, a, 4, 8)
    with pytest.raises(ValueError, match="target_argmax has 19"):
        replay_chain(np.zeros((15, 3), dtype=np.int64), x, a[:-1], 4, 4)


def test_slot_matches_marks_the_sequence_end() -> None:
    x = np.array([0, 1, 2, 3, 4])
    a = np.array([1, 2, 3, 4, 9])
    draft = np.array([[2, 3, 4], [3, 0, 9], [4, 9, 9]])  # anchors 1, 2, 3
    match, valid = slot_matches(draft, x, a, 1)
    assert valid.tolist() == [[True, True, True], [True, True, False], [True, False, False]]
    assert match.tolist() == [[True, True, True], [True, False, False], [True, False, False]]


# ---------------------------------------------------------------- DDTree


def _random_lp(rng, n_anchor: int, depth: int, k: int, vocab: int, peak: float = 2.0):
    """[A, L, K] sorted log-probs over a small vocabulary and their token ids."""
    logits = rng.normal(scale=peak, size=(n_anchor, depth, vocab))
    lp = logits - np.log(np.exp(logits).sum(axis=-1, keepdims=True))
    ids = np.argsort(-lp, axis=-1)[..., :k]
    return np.take_along_axis(lp, ids, axis=-1).astype(np.float32), ids


def _reference_ddtree(vals, ids, x, a, prompt_len, budget):
    rounds = []
    p, n = prompt_len, len(x)
    while p < n - 1:
        avail = n - 1 - p
        tree = build_tree(vals[p - prompt_len], ids[p - prompt_len], budget)
        node, acc, cut = ROOT, 0, False
        for j in range(1, avail + 1):
            g = a[p + j - 1]
            kids = [i for i in range(len(tree)) if tree.parents[i] == node and tree.token_ids[i] == g]
            if not kids:
                break
            if x[p + j] != g:
                cut = True
                break
            acc, node = acc + 1, kids[0]
        tokens = min(acc + 1, avail)
        rounds.append((p, acc, tokens, cut, acc == avail))
        p += tokens
    return rounds


@pytest.mark.parametrize("seed", range(20))
def test_ddtree_equals_reference_loop(seed: int) -> None:
    rng = np.random.default_rng(100 + seed)
    prompt_len, vocab, block = int(rng.integers(1, 10)), 6, int(rng.choice([3, 5]))
    seq_len = prompt_len + int(rng.integers(0, 60))
    x, a = _greedy_sequence(rng, seq_len, vocab, off_rate=[0.0, 0.1][seed % 2])
    budget = int(rng.choice([1, 3, 8, 12]))
    vals, ids = _random_lp(rng, max(seq_len - 1 - prompt_len, 0), block - 1, min(budget, vocab), vocab)
    log = replay_ddtree(vals, ids, x, a, prompt_len, budget)
    assert _as_rows(log) == _reference_ddtree(vals, ids, x, a, prompt_len, budget)
    trees = [build_tree(v, i, budget) for v, i in zip(vals, ids)]
    assert replay_trees(trees, x, a, prompt_len) == log


def test_ddtree_that_is_exactly_the_chain_replays_like_the_chain() -> None:
    # Peaked slots (argmax prob ~0.99): the top-L prefixes are the argmax chain, so with
    # budget L the tree IS the chain and every round must match replay_chain.
    rng = np.random.default_rng(9)
    prompt_len, block, vocab = 3, 6, 8
    x, a = _greedy_sequence(rng, 80, vocab, off_rate=0.05)
    vals, ids = _random_lp(rng, 80 - 1 - prompt_len, block - 1, 2, vocab, peak=1.0)
    vals[..., 0], vals[..., 1] = np.log(0.99), np.log(0.005)
    assert all(len(build_tree(v, i, block - 1)) == block - 1 for v, i in zip(vals, ids))
    chain = replay_chain(ids[..., 0], x, a, prompt_len, block)
    assert replay_ddtree(vals, ids, x, a, prompt_len, block - 1) == chain


def test_oracle_ddtree_gives_maximum_tau() -> None:
    prompt_len, block, vocab = 2, 4, 7
    x, a = _greedy_sequence(np.random.default_rng(1), prompt_len + 1 + 10, vocab)
    n_anchor = 10
    pos = np.minimum(prompt_len + np.arange(n_anchor)[:, None] + np.arange(block - 1)[None, :], len(a) - 1)
    ids = np.stack([a[pos], (a[pos] + 1) % vocab], axis=-1)  # rank 0 is the greedy token
    vals = np.broadcast_to(np.log([0.6, 0.3]).astype(np.float32), ids.shape).copy()
    log = replay_ddtree(vals, ids, x, a, prompt_len, 4)
    assert log.tokens == (4, 4, 2)  # 10 positions: 4 + 4, then 2 left (acc 2, no bonus)


def test_ddtree_matches_at_least_the_chain_per_anchor_when_it_contains_the_chain() -> None:
    # True per anchor: if the tree holds the argmax path, the walk gets at least as deep as
    # the chain's leading-correct count. (Not true for tau, see the next test.)
    rng = np.random.default_rng(11)
    prompt_len, block, vocab, budget = 2, 5, 5, 10
    x, a = _greedy_sequence(rng, 60, vocab)
    vals, ids = _random_lp(rng, 60 - 1 - prompt_len, block - 1, 5, vocab, peak=3.0)
    match, _ = slot_matches(ids[..., 0], x, a, prompt_len)
    lead = np.cumprod(match, axis=1).sum(axis=1)
    contained = 0
    for r in range(len(vals)):
        tree = build_tree(vals[r], ids[r], budget)
        p, avail = prompt_len + r, 60 - 1 - prompt_len - r
        if tuple(ids[r, :, 0]) in {tree.token_path(i) for i in range(len(tree))}:
            contained += 1
            assert len(walk_tree(tree, a[p : p + avail].tolist())) >= lead[r]
    assert contained >= 10


def test_ddtree_tau_can_be_below_chain_tau_even_when_the_tree_contains_the_chain() -> None:
    # T=7, P=1, B=4 (L=3), greedy data x = [100, 0, 1, 2, 3, 4, 5]. Budget 4: every tree is
    # the argmax chain (3 nodes, cum -0.1/-0.2/-0.3) plus the depth-1 rank-1 token (-2.5).
    x = np.array([100, 0, 1, 2, 3, 4, 5])
    a = np.array([0, 1, 2, 3, 4, 5, 99])
    vals = np.tile(np.array([-0.1, -2.5], dtype=np.float32), (5, 3, 1))
    ids = np.array(
        [
            [[50, 1], [51, 52], [53, 54]],  # p=1: argmax wrong; rank 1 at depth 1 is g_2 = 1
            [[2, 60], [3, 61], [4, 62]],  # p=2: argmax chain all correct
            [[70, 71], [72, 73], [74, 75]],  # p=3..5: nothing correct
            [[70, 71], [72, 73], [74, 75]],
            [[70, 71], [72, 73], [74, 75]],
        ]
    )
    chain = replay_chain(ids[..., 0], x, a, 1, 4)
    tree = replay_ddtree(vals, ids, x, a, 1, 4)
    assert chain.tokens == (1, 4) and chain.tau == 2.5  # p=1 -> 2 -> 6
    assert tree.tokens == (2, 1, 1, 1) and tree.tau == 1.25  # p=1 -> 3 -> 4 -> 5 -> 6
    assert tree.tokens[0] > chain.tokens[0]  # the first round does dominate


def test_ddtree_rejects_bad_input() -> None:
    x, a = _greedy_sequence(np.random.default_rng(0), 10, 5)
    vals, ids = _random_lp(np.random.default_rng(1), 5, 3, 2, 5)
    with pytest.raises(ValueError, match="has 5 anchor rows"):
        replay_ddtree(vals, ids, x, a, 2, 4)
    with pytest.raises(ValueError, match="budget -2 is negative"):
        replay_ddtree(vals, ids, x, a, 4, -2)
