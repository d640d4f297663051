"""The metrics scorer watch adds to scorer eval's, on hand-made rounds (issue 48 item 3): vLLM's
per-request acceptance histogram, tokens per round from a report's accepted counts, tau by context
length."""

from __future__ import annotations

import numpy as np
import pytest

from scorer.metrics import (
    ContextBucketTau,
    acceptance_histogram,
    round_tokens_from_accepted,
    tau_by_context_length,
)
from scorer.offline.replay import replay_chain


def test_acceptance_histogram_counts_rounds_by_accepted_drafts():
    # vLLM RequestSpecDecodeMetrics.observe: histogram[num_accepted] += 1, length K + 1
    assert acceptance_histogram([0, 2, 2, 3, 0, 0], 3) == [3, 0, 2, 1]
    assert acceptance_histogram([], 4) == [0, 0, 0, 0, 0]
    # vLLM's mean_acceptance_length = 1 + sum(j * count) / steps: tau when no round is cut by the end
    hist = acceptance_histogram([0, 2, 2, 3], 3)
    assert 1 + sum(j * c for j, c in enumerate(hist)) / sum(hist) == pytest.approx((1 + 3 + 3 + 4) / 4)
    with pytest.raises(ValueError, match="a round accepted 4 drafts; with 3 drafted it lies in 0..3"):
        acceptance_histogram([1, 4], 3)


def test_round_tokens_from_accepted_cuts_only_the_last_round():
    assert round_tokens_from_accepted([2, 0, 3], 8) == [3, 1, 4]  # every round whole
    assert round_tokens_from_accepted([2, 0, 3], 6) == [3, 1, 2]  # the end cut the last round
    assert round_tokens_from_accepted([], 0) == []
    with pytest.raises(ValueError, match="the last round would commit 5, outside 1..4"):
        round_tokens_from_accepted([2, 0, 3], 9)
    with pytest.raises(ValueError, match="would commit 0"):
        round_tokens_from_accepted([2, 0, 3], 4)


def test_round_tokens_equal_the_replays_own_where_the_sequence_end_cuts_the_last_round():
    # T = 8, P = 2, block 4, every draft right: rounds at anchors 2 and 5; the second reaches T - 1
    x = np.arange(10, 18)
    a = np.append(x[1:], 99)  # greedy text: a[t] = x[t + 1]
    padded = np.append(a, [0, 0])  # slots past the end draft anything
    draft = np.stack([padded[p : p + 3] for p in range(2, 7)])  # [A = T - 1 - P, B - 1]
    log = replay_chain(draft, x, a, 2, 4)
    assert log.tokens == (4, 1) and log.accepted == (3, 1)  # the end cut round 2 to one token
    assert round_tokens_from_accepted(log.accepted, log.n_tokens) == list(log.tokens)


def test_tau_by_context_length_groups_rounds_by_their_anchor():
    buckets = tau_by_context_length([[4, 7, 130], [0, 200]], [[3, 1, 2], [4, 2]], edges=(0, 8, 128))
    # contexts (anchor + 1): 5, 8, 131 and 1, 201
    assert buckets == [
        ContextBucketTau(start=0, stop=8, n_rounds=2, n_tokens=7, tau_pooled=3.5),
        ContextBucketTau(start=8, stop=128, n_rounds=1, n_tokens=1, tau_pooled=1.0),
        ContextBucketTau(start=128, stop=None, n_rounds=2, n_tokens=4, tau_pooled=2.0),
    ]
    assert tau_by_context_length([[10]], [[2]], edges=(0, 4, 64, 128)) == [ContextBucketTau(4, 64, 1, 2, 2.0)]
    with pytest.raises(ValueError, match="must start at 0 and increase"):
        tau_by_context_length([[1]], [[1]], edges=(0, 8, 8))
    with pytest.raises(ValueError, match="2 anchors for 1 rounds"):
        tau_by_context_length([[1, 2]], [[1]])
