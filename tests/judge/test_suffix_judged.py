"""Suffix decoding (vLLM ``suffix``, Arctic Inference's trees) judged by vLLM 0.32.0: the offline replay of what
vLLM served equals vLLM's own counters round for round, at T 0 and at a seeded T 0.7, and so do the draft
lengths of every round (0 where vLLM drafted nothing and recorded no step); drafting from a context one token
late, or letting the global tree win a tie, does not.

vLLM serves the requests one at a time in the cache's row order, each run in a fresh engine
(scorer/families/suffix/served.py), so its global tree holds the earlier requests' responses exactly as the
offline replay's (scorer/families/suffix/propose.py)."""

from __future__ import annotations

import numpy as np
import pytest
from method_families import assert_equal_round_for_round
from vllm_env import NEEDS_VLLM

import hscache
from scorer.families.suffix import cache as suffix_cache
from scorer.families.suffix.propose import ServedProposer, SuffixConfig
from scorer.studies.vllm_judge import score_served

pytestmark = NEEDS_VLLM


@pytest.mark.parametrize(("setting", "requests"), [("t0", 4), ("t0.7", 8)])
def test_suffix_equals_vllm_round_for_round(served, setting, requests):
    run = served["suffix"][setting]
    report = assert_equal_round_for_round(run, requests)
    spec = report["vllm"]["speculative_config"]
    assert spec["method"] == "suffix" and spec["num_speculative_tokens"] == 24  # vLLM's defaults
    # vLLM's drafted count per round (what its proposer returned: draft_record.py) is the offline proposer's
    cache = hscache.open_cache(run.served_cache)
    proposer = ServedProposer(SuffixConfig.resolve(None))
    drafted = []
    for row, request in enumerate(report["per_request"]):
        prompt_len = request["prompt_len"]
        _, lengths = proposer.drafts(row, np.asarray(cache.token_ids(row)), prompt_len)
        assert [int(lengths[a - prompt_len]) for a in request["offline"]["anchors"]] == request["vllm"][
            "drafted"
        ]
        drafted += request["vllm"]["drafted"]
    assert 0 in drafted and max(drafted) > 1  # steps without a draft, and drafts longer than a token


@pytest.mark.parametrize("setting", ["t0", "t0.7"])
def test_a_context_one_token_late_differs(served, setting, monkeypatch):
    speculate = suffix_cache.SuffixCache.speculate
    monkeypatch.setattr(
        suffix_cache.SuffixCache,
        "speculate",
        lambda self, rid, context, *a: speculate(self, rid, context[:-1], *a),
    )
    report = score_served(served["suffix"][setting])
    assert report["equal"] is False and report["differences"]


def test_the_global_tree_winning_ties_differs(served, monkeypatch):
    """cache.py:308 keeps the prompt tree's draft on a tie; the other way round parts from vLLM at T 0."""

    def global_wins_ties(self, rid, context, k, factor, offset, floor):
        context = context[-self.max_tree_depth :]
        local = self._local_trees[rid].speculate(context, k, factor, offset, floor)
        shared = self._global_tree.speculate(context, k, factor, offset, floor)
        return shared if shared.score >= local.score else local

    monkeypatch.setattr(suffix_cache.SuffixCache, "speculate", global_wins_ties)
    report = score_served(served["suffix"]["t0"])
    assert report["equal"] is False and report["differences"]
