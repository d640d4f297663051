"""Block verification judged by vLLM: the DFlash drafter served with ``rejection_sample_method="block"``
(tests/judge/conftest.py ``dflash-block``, in the one vLLM process), scored offline with
``--rejection-sample-method block``, equal round for round at T 0 and at the seeded T 0.7.

What vLLM CPU runs there: its V1 model runner takes the method and verifies with the standard rule
(v1/sample/rejection_sampler.py:84-96 reads only "synthetic"; block is the V2 runner's,
scorer/rules/block_verify.py), so with the same seeds it serves the standard engine's very text. The
offline replay is right for either: with greedy drafts block verification accepts the leading match of
the served text too (tests/scorer/test_block_verification.py, on the transcription of V2's kernels).
"""

from __future__ import annotations

import pytest
from vllm_env import NEEDS_VLLM

from scorer.errors import ScorerError
from scorer.studies.vllm_judge import ServedConfig, plan_served, score_served

pytestmark = NEEDS_VLLM


@pytest.mark.parametrize("setting", ["t0", "t0.7"])
def test_block_verification_offline_equals_vllm_round_for_round(served, setting):
    run = served["dflash-block"][setting]
    assert run.spec["rejection_sample_method"] == "block"
    assert run.eval_config.rejection_sample_method == "block"
    report = score_served(run)
    assert report["verdict"] == "equal" and report["differences"] == []
    assert len(report["per_request"]) == (4 if setting == "t0" else 8)
    # vLLM CPU served the standard engine's text and rounds: the V1 runner ignored the method
    standard = served["dflash"][setting]
    assert [r["token_ids"] for r in run.requests] == [r["token_ids"] for r in standard.requests]
    assert [r["rounds"] for r in run.requests] == [r["rounds"] for r in standard.requests]


def test_a_swapped_block_rule_is_refused_before_vllm_starts(
    judge_caches, judge_drafters, tmp_path, vllm_python
):
    """Block verification with probabilistic drafts: V1 would verify it with the standard rule and no
    cache gives its tau, so ``scorer served`` refuses it by name before any engine is built."""
    config = ServedConfig(
        vllm_python=vllm_python, rejection_sample_method="block", draft_sampling="probabilistic"
    )
    with pytest.raises(
        ScorerError, match="--rejection-sample-method block with --draft-sampling probabilistic"
    ):
        plan_served([judge_drafters["dflash"]], [judge_caches["t0.7"]], tmp_path, config)
