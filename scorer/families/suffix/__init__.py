"""vLLM's suffix decoding (Arctic Inference's suffix trees) as a drafter family: no weights.

tree.py and cache.py transcribe Arctic Inference 0.3.0's suffix tree and cache (the C++ and Python vLLM
0.32.0 imports), propose.py how vLLM's proposer feeds them over a cache's sequences (one at a time, in row
order: the global tree holds the earlier rows' responses), drafter.py its place on the seam.
``scorer eval suffix --cache C`` (vLLM's defaults: tree depth 24, K = the depth, 10,000 cached
responses, spec factor 1, min token probability 0.1; each a flag under vLLM's name); ``scorer compare``
takes it beside the n-gram proposer as a free baseline; ``scorer served suffix`` judges it.

This module is the family's row: plain data, its functions bound lazily (importing the registry
imports no torch); its flags are declared here and become options of the scoring commands.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from scorer.families.base import Family, FamilyFlag, VllmServing, lazy

__all__ = ["FLAGS", "SUFFIX"]

# vLLM's names (vllm/config/speculative.py:505-520); EvalConfig.overrides keys, read by drafter.py.
FLAGS = (
    FamilyFlag(
        "suffix_decoding_max_tree_depth",
        int,
        "suffix (CKPT 'suffix', vLLM's suffix decoding): the longest suffix its trees store and the "
        "context it matches (vLLM's default 24; K defaults to it).",
        minimum=1,
    ),
    FamilyFlag(
        "suffix_decoding_max_cached_requests",
        int,
        "suffix: earlier responses kept in the global tree, oldest evicted first (vLLM's default 10000; "
        "0: the prompt tree only).",
        minimum=0,
    ),
    FamilyFlag(
        "suffix_decoding_max_spec_factor",
        float,
        "suffix: at most this many tokens per matched context token (vLLM's default 1.0).",
        minimum=0,
    ),
    FamilyFlag(
        "suffix_decoding_min_token_prob",
        float,
        "suffix: drafting stops where the estimated probability falls below it (vLLM's default 0.1).",
        minimum=0,
    ),
)
_DRAFTER = "scorer.families.suffix.drafter"
_SERVED = "scorer.families.suffix.served"


def _effective(config: Any) -> Any:
    # DDTree is a block-family mode and SGLang's tree needs a model's top-k: vLLM verifies suffix
    # decoding's chain (propose.py), drafted at every anchor (a lookup, no forward).
    return dataclasses.replace(config, ddtree=(), anchors="all", tree=None)


SUFFIX = Family(
    name="suffix",
    layouts=("no checkpoint: the word suffix, with vLLM's settings as flags",),
    claims=lazy(_DRAFTER, "claims"),
    load=lazy(_DRAFTER, "load"),
    score_rows=lazy(_DRAFTER, "score_rows"),
    effective_config=_effective,
    autoregressive=True,
    display_name="suffix decoding (vLLM, Arctic Inference)",
    eval_options=frozenset({"num_speculative_tokens"}),
    flags=FLAGS,
    summarize=lazy(_DRAFTER, "summarize"),
    bound_to_target=True,
    # One request at a time, an engine per run, its steps without a draft placed from vLLM's own
    # proposals: served.py says why.
    vllm=VllmServing(
        method="suffix",
        settings=lazy(_SERVED, "settings"),
        sequential_requests=True,
        proposals_recorded=True,
    ),
)
