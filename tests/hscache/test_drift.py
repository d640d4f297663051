"""Drift statistics on hand-made inputs whose answers were worked out by hand."""

from __future__ import annotations

import math

import pytest
import torch

from hscache.diff.stats import (
    argmax_agreement,
    bucket_positions,
    logit_drift,
    margin_at_risk,
    token_drift,
    topk_kl,
    topk_overlap,
)


def _t(rows):
    return torch.tensor(rows, dtype=torch.float32)


# ---------------------------------------------------------------- hidden states


def test_token_drift_by_hand() -> None:
    # a = (3, 4), b = (3, 0): a - b = (0, 4); ||a|| = 5, ||b|| = 3, a.b = 9
    d = token_drift(_t([[3, 4]]), _t([[3, 0]]))
    assert d.sq_err.tolist() == [16.0] and d.sq_ref.tolist() == [25.0]
    assert d.rel_l2.tolist() == [0.8]
    assert d.cosine.tolist() == [pytest.approx(0.6, abs=1e-15)]
    assert d.max_abs.tolist() == [4.0]
    assert d.finite.tolist() == [True]
    assert d.sq_err.dtype == torch.float64


def test_token_drift_orthogonal_opposite_and_identical() -> None:
    d = token_drift(_t([[1, 0], [1, 0], [0.1, -7]]), _t([[0, 1], [-2, 0], [0.1, -7]]))
    assert d.rel_l2.tolist() == [pytest.approx(math.sqrt(2)), 3.0, 0.0]
    assert d.cosine.tolist() == [0.0, -1.0, 1.0]
    assert d.max_abs.tolist() == [1.0, 3.0, 0.0]


def test_token_drift_zero_vectors_and_non_finite_rows() -> None:
    nan, inf = float("nan"), float("inf")
    d = token_drift(_t([[0, 0], [0, 0], [nan, 1], [1, 1]]), _t([[0, 0], [1, 0], [1, 1], [inf, 1]]))
    assert d.cosine[:2].tolist() == [1.0, 0.0]  # two zero vectors agree; zero vs non-zero does not
    assert math.isnan(d.rel_l2[0]) and math.isnan(d.rel_l2[1])  # no relative error against a zero reference
    assert d.sq_err[:2].tolist() == [0.0, 1.0]
    assert d.finite.tolist() == [True, True, False, False]


def test_token_drift_of_bf16_rows_is_exact_in_float64() -> None:
    a = torch.tensor([[1.0, 2.0]], dtype=torch.bfloat16)
    b = torch.tensor([[1.0, 2.015625]], dtype=torch.bfloat16)  # 2 + one bf16 ulp (2 ** -6) at 2
    d = token_drift(a, b)
    assert d.sq_err.tolist() == [2.0**-12]
    assert d.rel_l2.tolist() == [2.0**-6 / math.sqrt(5)]


def test_token_drift_rejects_mismatched_shapes() -> None:
    with pytest.raises(ValueError, match=r"tensors of one shape, got \(2, 3\) and \(2, 4\)"):
        token_drift(torch.zeros(2, 3), torch.zeros(2, 4))


def test_bucket_positions_by_hand() -> None:
    assert bucket_positions(torch.arange(10), (0, 4, 8)).tolist() == [0, 0, 0, 0, 1, 1, 1, 1, 2, 2]
    assert bucket_positions(torch.tensor([0, 5000]), (0,)).tolist() == [0, 0]


@pytest.mark.parametrize("starts", [(), (1, 4), (0, 4, 4), (0, 8, 4)])
def test_bucket_positions_rejects_bad_starts(starts) -> None:
    with pytest.raises(ValueError, match="must begin at 0 and increase strictly"):
        bucket_positions(torch.arange(3), starts)


# ---------------------------------------------------------------- next token


def test_argmax_agreement_and_topk_overlap_by_hand() -> None:
    assert argmax_agreement(torch.tensor([1, 2, 3]), torch.tensor([1, 5, 3])).tolist() == [True, False, True]
    ids_a = torch.tensor([[1, 2, 3, 4], [1, 2, 3, 4]])
    ids_b = torch.tensor([[4, 3, 9, 8], [5, 6, 7, 8]])
    assert topk_overlap(ids_a, ids_b).tolist() == [0.5, 0.0]
    with pytest.raises(ValueError, match="top-k id shapes differ"):
        topk_overlap(ids_a, ids_b[:, :2])


def _topk(probs: list[float], k: int, shift: float = 0.0):
    """Top-k (values, ids, lse) of the logits log(p) + shift, as a cache stores them."""
    logits = torch.tensor(probs, dtype=torch.float64).log() + shift
    values, ids = logits.topk(k)
    return values[None], ids[None], torch.logsumexp(logits, 0)[None]


def test_topk_kl_same_top_set_by_hand() -> None:
    # p = (.5, .25, .125, .125), q = (.25, .5, .125, .125); common top-2 = {0, 1}, rest .25 in both
    # KL = .5 ln 2 + .25 ln .5 + .25 ln 1 = .25 ln 2 (here exactly the full KL)
    a = _topk([0.5, 0.25, 0.125, 0.125], 2, shift=7.0)  # the stored lse removes any shift
    b = _topk([0.25, 0.5, 0.125, 0.125], 2, shift=-3.0)
    assert topk_kl(*a, *b).tolist() == [pytest.approx(0.25 * math.log(2), abs=1e-15)]


def test_topk_kl_partial_overlap_is_a_lower_bound_by_hand() -> None:
    p, q = [0.5, 0.25, 0.125, 0.125], [0.4, 0.1, 0.3, 0.2]
    # A's top-2 = {0, 1}, B's = {0, 2}; common {0}: buckets {0}, rest with masses (.5, .5) vs (.4, .6)
    expected = 0.5 * math.log(0.5 / 0.4) + 0.5 * math.log(0.5 / 0.6)
    kl = topk_kl(*_topk(p, 2), *_topk(q, 2))
    assert kl.tolist() == [pytest.approx(expected, abs=1e-15)]
    full = sum(x * math.log(x / y) for x, y in zip(p, q))
    assert kl.item() <= full


def test_topk_kl_identical_is_exactly_zero_and_disjoint_is_zero() -> None:
    a = _topk([0.5, 0.25, 0.125, 0.125], 2)
    assert topk_kl(*a, *a).tolist() == [0.0]
    b = _topk([0.1, 0.1, 0.4, 0.4], 2)  # top-2 {2, 3}: nothing in common, one rest bucket of mass 1
    assert topk_kl(*a, *b).tolist() == [0.0]


def test_topk_kl_bounds_full_kl_and_equals_it_when_k_covers_the_vocabulary() -> None:
    g = torch.Generator().manual_seed(0)
    la = torch.randn(64, 32, generator=g, dtype=torch.float64)
    lb = la + 0.3 * torch.randn(64, 32, generator=g, dtype=torch.float64)
    full = (la.softmax(-1) * (la.log_softmax(-1) - lb.log_softmax(-1))).sum(-1)
    for k in (4, 16, 32):
        va, ia = la.topk(k)
        vb, ib = lb.topk(k)
        kl = topk_kl(va, ia, la.logsumexp(-1), vb, ib, lb.logsumexp(-1))
        assert (kl >= 0).all() and (kl <= full + 1e-12).all()
    assert torch.allclose(kl, full, rtol=0, atol=1e-9)  # k = V: the partition is the vocabulary


def test_logit_drift_by_hand() -> None:
    values_a, ids_a = _t([[5.0, 3.0], [5.0, 3.0]]), torch.tensor([[0, 1], [0, 1]])
    values_b, ids_b = _t([[3.5, 4.75], [9.0, 8.0]]), torch.tensor([[1, 0], [7, 8]])
    # row 0: token 0 moved 5 -> 4.75 (.25), token 1 moved 3 -> 3.5 (.5); row 1: nothing in common
    assert logit_drift(values_a, ids_a, values_b, ids_b).tolist() == [0.5, math.inf]


def test_margin_at_risk_by_hand() -> None:
    values_a = _t([[5.0, 3.0], [5.0, 4.5], [5.0, 5.0], [5.0, 4.0]])
    drift = torch.tensor([0.5, 0.5, 0.0, math.inf], dtype=torch.float64)
    # margins 2, .5, 0, 1 against 2 * drift = 1, 1, 0, inf: a tie with no drift is not at risk
    assert margin_at_risk(values_a, drift).tolist() == [False, True, False, True]
    with pytest.raises(ValueError, match="needs top-k with k >= 2, got k = 1"):
        margin_at_risk(values_a[:, :1], drift)
