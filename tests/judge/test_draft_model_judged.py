"""The standalone draft model (vLLM ``draft_model``) judged by vLLM 0.32.0: the offline replay of what vLLM
served equals vLLM's own counters round for round, at T 0 and at a seeded T 0.7; drafting one position late
(an off-by-one in scorer/families/draft_model/drafter.py ``draft_positions``) does not."""

from __future__ import annotations

import pytest
from method_families import assert_equal_round_for_round
from vllm_env import NEEDS_VLLM

from scorer.families.draft_model import drafter as draft_model
from scorer.studies.vllm_judge import score_served

pytestmark = NEEDS_VLLM


@pytest.mark.parametrize(("setting", "requests"), [("t0", 4), ("t0.7", 8)])
def test_draft_model_equals_vllm_round_for_round(served, setting, requests):
    report = assert_equal_round_for_round(served["draft_model"][setting], requests)
    assert report["vllm"]["speculative_config"]["method"] == "draft_model"


def test_an_off_by_one_draft_position_differs(served, monkeypatch):
    """Slot j read one position later (p + j instead of p + j - 1): vLLM's rounds are no longer matched."""
    positions = draft_model.draft_positions

    def late(prompt_len, seq_len, k):
        pos = positions(prompt_len, seq_len, k)
        return pos + (pos >= 0) * (pos < seq_len - 2)

    monkeypatch.setattr(draft_model, "draft_positions", late)
    report = score_served(served["draft_model"]["t0"])
    assert report["equal"] is False and report["differences"]
