"""Pure metrics on hand-made inputs whose answers were worked out by hand."""

from __future__ import annotations

import json

import numpy as np
import pytest

from scorer.metrics import (
    AcceptanceCounts,
    AcceptLen,
    PipelineWarningThresholds,
    acceptance_counts,
    acceptance_per_position,
    acceptance_rates,
    bootstrap_ci,
    paired_bootstrap_delta,
    per_category_tau,
    pipeline_warnings,
    request_totals,
    tau_per_request,
    tau_per_request_from_totals,
    tau_pooled,
    tau_pooled_from_totals,
    tokens_per_round_histogram,
    train_accept_len,
)
from scorer.offline.replay import RoundLog, replay_chain

# ---------------------------------------------------------------- tau


def test_tau_single_request_by_hand() -> None:
    assert tau_per_request([[4, 1, 2]]) == 7 / 3  # 3 rounds of 4, 1, 2 tokens
    assert tau_pooled([[4, 1, 2]]) == 7 / 3


def test_tau_conventions_differ_by_hand() -> None:
    rounds = [[4, 1, 2], [3, 3]]
    assert tau_per_request(rounds) == pytest.approx(8 / 3)  # (7/3 + 6/2) / 2
    assert tau_pooled(rounds) == 13 / 5  # 13 tokens / 5 rounds


def test_tau_skips_requests_without_rounds_and_accepts_round_logs() -> None:
    log = RoundLog(2, 10, (2, 6, 7), (3, 0, 1), (4, 1, 2), (False,) * 3, (False, False, True), 0)
    assert tau_per_request([log, []]) == 7 / 3
    assert tau_pooled([log, []]) == 7 / 3
    assert request_totals([log, [], [1]]).tolist() == [[7, 3], [0, 0], [1, 1]]
    with pytest.raises(ValueError, match="no request has a round"):
        tau_per_request([[], []])
    with pytest.raises(ValueError, match="no request has a round"):
        tau_pooled([])


def test_tau_from_totals_matches() -> None:
    totals = np.array([[7, 3], [6, 2]])
    assert tau_per_request_from_totals(totals) == pytest.approx(8 / 3)
    assert tau_pooled_from_totals(totals) == 13 / 5


def test_histogram_by_hand() -> None:
    assert tokens_per_round_histogram([[4, 1, 2], [3, 3]], 4) == [1, 1, 2, 1]
    assert tokens_per_round_histogram([[], [1]], 2) == [1, 0]
    with pytest.raises(ValueError, match=r"must lie in 1\.\.4, got 1\.\.5"):
        tokens_per_round_histogram([[1, 5]], 4)


# ---------------------------------------------------------------- bootstrap


def test_bootstrap_pooled_interval_by_hand() -> None:
    # Two requests: A = 10 tokens / 5 rounds, B = 2 / 2. A resample is AA (tau 2, p=1/4),
    # AB (12/7, p=1/2) or BB (1, p=1/4), so the 2.5% and 97.5% percentiles are 1 and 2.
    totals = np.array([[10, 5], [2, 2]])
    assert bootstrap_ci(totals, tau_pooled_from_totals, n_boot=2000, seed=0) == (1.0, 2.0)


def test_bootstrap_is_seeded_and_degenerate_on_identical_requests() -> None:
    assert bootstrap_ci([3.0] * 20, np.mean, seed=1) == (3.0, 3.0)
    values = np.random.default_rng(0).normal(size=50)
    assert bootstrap_ci(values, np.mean, seed=5) == bootstrap_ci(values, np.mean, seed=5)


def test_bootstrap_width_matches_normal_theory() -> None:
    values = np.random.default_rng(0).normal(size=400)
    lo, hi = bootstrap_ci(values, np.mean, n_boot=2000, seed=0)
    assert lo < values.mean() < hi
    assert hi - lo == pytest.approx(2 * 1.96 * values.std() / 20, rel=0.15)


def test_bootstrap_rejects_empty_and_roundless_requests() -> None:
    with pytest.raises(ValueError, match="has no requests"):
        bootstrap_ci(np.zeros((0, 2)), tau_pooled_from_totals)
    with pytest.raises(ValueError, match="holds requests with no rounds; drop them"):
        bootstrap_ci(np.array([[3, 1], [0, 0]]), tau_pooled_from_totals)


def test_paired_delta_by_hand_and_tighter_than_unpaired() -> None:
    rng = np.random.default_rng(0)
    rounds = rng.integers(5, 50, size=200)
    a = np.stack([rounds * rng.uniform(1.5, 6.0, size=200).round().astype(int), rounds], axis=1)
    b = a + np.stack([rounds, np.zeros_like(rounds)], axis=1)  # every request: +1 token per round
    d = paired_bootstrap_delta(a, b, n_boot=500, seed=0)
    assert d.delta == pytest.approx(1.0) and d.lo == pytest.approx(1.0) and d.hi == pytest.approx(1.0)
    assert d.n_requests == 200
    # Unpaired intervals of a and b are wide (request difficulty varies); the paired one is not.
    lo_a, hi_a = bootstrap_ci(a, tau_pooled_from_totals, n_boot=500, seed=0)
    assert hi_a - lo_a > 0.1
    d = paired_bootstrap_delta(a, b, stat=tau_per_request_from_totals, n_boot=200, seed=1)
    assert d.delta == pytest.approx(1.0) and d.hi - d.lo < 1e-9


def test_the_vectorised_pooled_bootstrap_gives_the_per_resample_statistic_exactly() -> None:
    """The pooled tau's bootstrap is one vectorised pass; a wrapper of the same function takes the
    per-resample path (one call per resample, as before): the same resamples give the same floats,
    for integer totals and for the real-valued rounds of the probabilistic rule."""

    def one_by_one(t: np.ndarray) -> float:
        return tau_pooled_from_totals(t)

    rng = np.random.default_rng(3)
    rounds = rng.integers(1, 40, size=57)
    a = np.stack([rounds + rng.integers(0, 30, size=57), rounds], axis=1)
    b = a + np.stack([rng.integers(0, 9, size=57), np.zeros_like(rounds)], axis=1)
    for x, y in ((a, b), (a * 0.37 + 0.01, b * 0.41 + 0.02)):
        fast = paired_bootstrap_delta(x, y, n_boot=300, seed=4, level=0.9)
        assert fast == paired_bootstrap_delta(x, y, stat=one_by_one, n_boot=300, seed=4, level=0.9)
        assert fast.hi > fast.lo  # a real interval, not a constant
        assert bootstrap_ci(y, tau_pooled_from_totals, n_boot=300, seed=2) == bootstrap_ci(
            y, one_by_one, n_boot=300, seed=2
        )


def test_the_vectorised_per_request_bootstrap_gives_the_per_resample_statistic_exactly() -> None:
    """The per-request tau's bootstrap is one vectorised pass too: against a wrapper that takes the
    one-call-per-resample path, every interval is the same floats, at request counts around numpy's
    pairwise-summation blocks (8, 128) and beyond, for integer and real-valued totals, at several
    levels (each a pair of order statistics of the 400 resampled taus)."""

    def one_by_one(t: np.ndarray) -> float:
        return tau_per_request_from_totals(t)

    rng = np.random.default_rng(5)
    for n in (1, 2, 7, 8, 9, 16, 17, 127, 128, 129, 300, 1000):
        rounds = rng.integers(1, 40, size=n)
        a = np.stack([rounds + rng.integers(0, 30, size=n), rounds], axis=1)
        for x in (a, a * 0.37 + 0.01):
            for level in (0.5, 0.8, 0.95, 0.99):
                fast = bootstrap_ci(x, tau_per_request_from_totals, n_boot=400, seed=n, level=level)
                assert fast == bootstrap_ci(x, one_by_one, n_boot=400, seed=n, level=level), (n, level)
                assert n == 1 or fast[1] > fast[0]
        b = a + np.stack([rng.integers(0, 9, size=n), np.zeros_like(rounds)], axis=1)
        fast = paired_bootstrap_delta(a, b, stat=tau_per_request_from_totals, n_boot=300, seed=2)
        assert fast == paired_bootstrap_delta(a, b, stat=one_by_one, n_boot=300, seed=2)


def test_paired_delta_errors() -> None:
    msg = r"a_totals \(2, 2\) and b_totals \(3, 2\) must cover the same requests"
    with pytest.raises(ValueError, match=msg):
        paired_bootstrap_delta(np.ones((2, 2)), np.ones((3, 2)))


# ---------------------------------------------------------------- acceptance per slot


def _hand_case():
    # T=5, P=1, anchors p = 1, 2, 3, B-1 = 3 slots; g_{p+j} = a[p+j-1].
    x = np.array([0, 1, 2, 3, 4])
    a = np.array([1, 2, 3, 4, 9])
    draft = np.array(
        [
            [2, 0, 4],  # p=1: g = 2, 3, 4 -> ok, wrong, ok
            [3, 4, 7],  # p=2: g = 3, 4, (out of range) -> ok, ok, -
            [0, 7, 7],  # p=3: g = 4, -, - -> wrong, -, -
        ]
    )
    return draft, x, a


def test_acceptance_by_hand() -> None:
    stats = acceptance_per_position(*_hand_case(), 1)
    c = stats.counts
    assert c.uncond_den == (3, 2, 1) and c.uncond_num == (2, 1, 1)
    assert c.cond_den == (3, 2, 0) and c.cond_num == (2, 1, 0)
    assert stats.unconditional == (2 / 3, 1 / 2, 1.0)
    assert stats.conditional == (2 / 3, 1 / 2, None)  # no anchor had slots 1-2 right with slot 3 in range


def test_acceptance_counts_add_across_sequences() -> None:
    c = acceptance_counts(*_hand_case(), 1)
    both = acceptance_rates(c + c)
    assert both.counts.uncond_den == (6, 4, 2)
    assert both.unconditional == (2 / 3, 1 / 2, 1.0)
    with pytest.raises(ValueError, match="cannot add counts for 3 and 2 slots"):
        c + AcceptanceCounts((1, 1), (1, 1), (1, 1), (1, 1))
    assert json.loads(json.dumps(both.to_dict()))["conditional"] == [2 / 3, 1 / 2, None]


def test_acceptance_oracle_and_always_wrong() -> None:
    draft, x, a = _hand_case()
    oracle = np.array([[2, 3, 4], [3, 4, 0], [4, 0, 0]])
    assert acceptance_per_position(oracle, x, a, 1).conditional == (1.0, 1.0, 1.0)
    wrong = np.full_like(draft, 8)
    stats = acceptance_per_position(wrong, x, a, 1)
    assert stats.unconditional == (0.0, 0.0, 0.0) and stats.conditional == (0.0, None, None)


def test_train_accept_len_by_hand() -> None:
    acc = train_accept_len(*_hand_case(), 1)
    assert acc == AcceptLen(total=3, n_anchors=3)  # leading correct: 1, 2, 0 (no +1)
    assert acc.mean == 1.0
    assert (acc + AcceptLen(5, 1)).mean == 2.0
    assert AcceptLen(0, 0).mean is None
    assert acc.to_dict() == {"total": 3, "n_anchors": 3, "mean": 1.0}


def test_train_accept_len_differs_from_chain_tau_minus_one() -> None:
    # Chain on the hand case: p=1 acc 1 (2 tokens) -> p=3, acc 0 with 1 position left (1 token).
    draft, x, a = _hand_case()
    log = replay_chain(draft, x, a, 1, 4)
    assert log.tokens == (2, 1) and log.tau - 1 == 0.5  # vs train_accept_len 1.0 on the same drafts


# ---------------------------------------------------------------- diagnostics


def _stats(uncond_num, uncond_den):
    num, den = tuple(uncond_num), tuple(uncond_den)
    return acceptance_rates(AcceptanceCounts(num, den, num, den))


def test_pipeline_warnings_rising_accuracy() -> None:
    warnings = pipeline_warnings(acceptance=_stats([50, 80, 30], [100, 100, 100]))
    assert warnings == [
        "per-slot accuracy rises with position (slot 1: 0.500; slot 2: 0.800); drafts are usually "
        "best at slot 1, so check position ids and the draft-to-label alignment "
        "(`scorer diagnose` replays shifted positions)"
    ]


@pytest.mark.parametrize(
    ("num", "den"),
    [
        ([50, 40, 30], [100, 100, 100]),  # falling: healthy
        ([50, 53, 30], [100, 100, 100]),  # within the margin
        ([5, 8, 3], [10, 10, 10]),  # too few anchors to tell
        ([50, 30, 0], [100, 100, 0]),  # empty slot is skipped
    ],
)
def test_pipeline_warnings_quiet_on_healthy_or_thin_acceptance(num, den) -> None:
    assert pipeline_warnings(acceptance=_stats(num, den)) == []


def test_pipeline_warnings_tau_far_below_train_accept_len() -> None:
    assert pipeline_warnings(tau_pooled=1.4, train_accept_len=1.5) == [
        "tau_pooled - 1 = 0.400 is below 0.5 x the training-log accept length 1.500; replay may "
        "not match training (features, layers, positions or mask; `scorer diagnose` tests each)"
    ]
    assert pipeline_warnings(tau_pooled=2.0, train_accept_len=1.5) == []
    assert pipeline_warnings(tau_pooled=1.0, train_accept_len=0.5) == []  # below the floor
    assert pipeline_warnings(
        tau_pooled=1.0, train_accept_len=0.5, thresholds=PipelineWarningThresholds(accept_len_floor=0.1)
    )


def test_pipeline_warnings_missing_layers() -> None:
    assert pipeline_warnings(target_layer_ids=[1, 9, 17, 25, 33], cache_layer_ids=[25, 1, 9, 17]) == [
        "drafter needs target layers [33] that the cache lacks (cache has [1, 9, 17, 25]); "
        "re-extract the cache with these layers"
    ]
    assert pipeline_warnings(target_layer_ids=[1, 9], cache_layer_ids=[0, 1, 9]) == []
    assert pipeline_warnings() == []


# ---------------------------------------------------------------- per category


def test_per_category_tau_by_hand() -> None:
    rounds = [[4, 1, 2], [3, 3], [1, 1], []]
    out = per_category_tau(rounds, ["math", "code", "math", "chat"])
    assert list(out) == ["chat", "code", "math"]
    math_ = out["math"]
    assert (math_.n_requests, math_.n_rounds, math_.n_tokens) == (2, 5, 9)
    assert math_.tau_per_request == pytest.approx(5 / 3)  # (7/3 + 1) / 2
    assert math_.tau_pooled == 9 / 5
    assert out["code"].to_dict() == {
        "n_requests": 1, "n_rounds": 2, "n_tokens": 6, "tau_per_request": 3.0, "tau_pooled": 3.0,
    }  # fmt: skip
    assert out["chat"].tau_pooled is None and out["chat"].n_requests == 1
    with pytest.raises(ValueError, match="2 categories for 4 requests"):
        per_category_tau(rounds, ["a", "b"])
