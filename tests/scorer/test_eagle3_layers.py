"""The layers a new EAGLE-3 drafter reads (``scorer init --family eagle3``): distinct on every target depth.

The engines' default [2, L//2, L-3] (vLLM aux ids) repeats a layer below 7 layers (6: [2, 3, 3]); vLLM 0.32.0
loads such a drafter and fails at its first forward. Measured 2026-12-07: a 6-layer Qwen3 (the built-in's
first 6 layers, ``scorer init --family draft_model --draft-layers 6``), ``scorer init --family eagle3
--train-steps 25`` wrote aux ids [2, 3, 5] and ``scorer served`` found vLLM equal to the replay round for
round (4 requests, 37 rounds)."""

from __future__ import annotations

import pytest

import hscache
from scorer.errors import IncompatibleCacheError
from scorer.families.eagle3.config import default_layer_ids, new_drafter_layer_ids, vllm_aux_ids
from scorer.families.eagle3.init import eagle3_config_for_cache


@pytest.mark.parametrize("depth", range(3, 65))
def test_new_drafters_read_three_distinct_layers(depth):
    ids = new_drafter_layer_ids(depth)
    assert len(set(ids)) == 3 and all(0 <= i < depth for i in ids) and ids == sorted(ids)
    default = default_layer_ids(depth)
    if len(set(default)) == 3 and min(default) >= 0:
        assert ids == default  # the engines' choice wherever it is a valid one
    else:
        assert depth < 7  # only shallow targets part from it


def test_the_six_layer_case_of_issue_47():
    assert vllm_aux_ids(default_layer_ids(6)) == [2, 3, 3]
    assert vllm_aux_ids(new_drafter_layer_ids(6)) == [2, 3, 5]


def test_too_shallow_or_repeated_layers_are_refused(qwen3_cache):
    with pytest.raises(ValueError, match="the target has 2 layer"):
        new_drafter_layer_ids(2)
    cache = hscache.open_cache(qwen3_cache)
    with pytest.raises(IncompatibleCacheError, match=r"target layers \[1, 3, 3\] repeat a layer"):
        eagle3_config_for_cache(cache, layer_ids=[1, 3, 3])
