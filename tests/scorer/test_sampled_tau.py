"""tau over sampled trajectories: pooled over prompts, with a bootstrap that keeps a prompt's
trajectories together (spec/sampling.md 4.4, 4.6.5)."""

from __future__ import annotations

import numpy as np
import pytest

from scorer.metrics import bootstrap_ci
from scorer.offline.sampled_tau import prompt_totals, sampled_tau, sampled_tau_from_totals
from scorer.rules.expectation import SequenceRounds

ROUNDS = [
    SequenceRounds(tokens=10, expected_rounds=4.0, served_accepted=(3.0, 1.0)),
    SequenceRounds(tokens=8, expected_rounds=5.5, served_accepted=(2.0, 0.5)),
    SequenceRounds(tokens=12, expected_rounds=3.25, served_accepted=(3.0, 2.0)),
    SequenceRounds(tokens=6, expected_rounds=6.0, served_accepted=(0.0, 0.0)),
]


def test_prompt_totals_sum_each_prompts_trajectories() -> None:
    ids, totals = prompt_totals(["b", "a", "b", "c"], ROUNDS)
    assert ids == ("b", "a", "c")
    np.testing.assert_array_equal(totals, [[22, 7.25, 6, 3], [8, 5.5, 2, 0.5], [6, 6, 0, 0]])


def test_tau_is_total_tokens_over_total_expected_rounds() -> None:
    got = sampled_tau(["b", "a", "b", "c"], ROUNDS, n_boot=200, seed=3)
    assert got.tau == pytest.approx(36 / 18.75)
    assert got.n_prompts == 3 and got.n_requests == 4 and got.expected_rounds == 18.75
    assert got.served_acceptance == pytest.approx((8 / 18.75, 3.5 / 18.75))
    assert got.lo <= got.tau <= got.hi


def test_interval_resamples_prompts_not_trajectories() -> None:
    ids = ["b", "a", "b", "c"]
    got = sampled_tau(ids, ROUNDS, n_boot=300, seed=5)
    _, totals = prompt_totals(ids, ROUNDS)
    assert (got.lo, got.hi) == bootstrap_ci(totals, sampled_tau_from_totals, n_boot=300, seed=5)
    # An independent percentile bootstrap over the three prompts gives the same interval.
    picks = np.random.default_rng(5).integers(0, 3, size=(300, 3))
    stats = [totals[i, 0].sum() / totals[i, 1].sum() for i in picks]
    assert (got.lo, got.hi) == pytest.approx(tuple(np.quantile(stats, [0.025, 0.975])), rel=1e-12)
    # Treating the two trajectories of prompt "b" as independent prompts gives another interval.
    alone = sampled_tau(["b1", "a", "b2", "c"], ROUNDS, n_boot=300, seed=5)
    assert alone.tau == got.tau and (alone.lo, alone.hi) != (got.lo, got.hi)


def test_bad_input_is_named() -> None:
    with pytest.raises(ValueError, match="^3 prompt ids for 4 sequences; give one id per sequence$"):
        prompt_totals(["a", "b", "c"], ROUNDS)
    with pytest.raises(ValueError, match=r"different slot counts \[1, 2\]; use one K"):
        prompt_totals(["a", "b"], [ROUNDS[0], SequenceRounds(3, 1.0, (1.0,))])
    with pytest.raises(
        ValueError, match="^no sequences to score; tau needs at least one sampled trajectory$"
    ):
        sampled_tau([], [])


def test_vectorised_interval_equals_the_per_resample_bootstrap_on_many_prompts() -> None:
    """The interval is computed in one vectorised pass (a report bootstraps every mode 1000 times):
    on 57 prompts of random sizes it equals bootstrap_ci's per-resample loop."""
    gen = np.random.default_rng(11)
    rounds = [
        SequenceRounds(int(t), float(r), (float(r) / 2,))
        for t, r in zip(gen.integers(5, 200, 57), gen.uniform(2, 100, 57))
    ]
    ids = [f"p{i}" for i in range(57)]
    got = sampled_tau(ids, rounds, n_boot=1000, seed=4)
    _, totals = prompt_totals(ids, rounds)
    assert (got.lo, got.hi) == pytest.approx(
        bootstrap_ci(totals, sampled_tau_from_totals, n_boot=1000, seed=4), rel=1e-13
    )
