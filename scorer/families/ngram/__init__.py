"""vLLM's n-gram (prompt lookup) proposer as a drafter family: no weights.

propose.py is the proposer (vLLM ``ngram_proposer.py``), replay.py its rounds on a cached sequence
through the shared round loop, drafter.py its place on the seam (load, score_rows, summarize).
``scorer eval ngram --cache C --num-speculative-tokens K --prompt-lookup-min N --prompt-lookup-max M``;
in ``scorer compare`` it is the free baseline a trained drafter should beat.

This module is the family's row: plain data, its functions bound lazily (importing the registry
imports no torch); its flags are declared here and become options of the scoring commands.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from scorer.families.base import Family, FamilyFlag, VllmServing, lazy

__all__ = ["FLAGS", "NGRAM"]

# vLLM's names; EvalConfig.overrides keys, read by drafter.py.
FLAGS = (
    FamilyFlag(
        "prompt_lookup_min",
        int,
        "ngram (CKPT 'ngram', vLLM's prompt lookup): the shortest suffix n-gram matched; with "
        "--prompt-lookup-max unset both default to vLLM's (5), one given sets the other.",
        minimum=1,
    ),
    FamilyFlag(
        "prompt_lookup_max",
        int,
        "ngram: the longest suffix n-gram tried (the longest that occurred earlier wins).",
        minimum=1,
    ),
)
_DRAFTER = "scorer.families.ngram.drafter"
_SERVED = "scorer.families.ngram.served"


def _effective(config: Any) -> Any:
    # DDTree is a block-family mode and SGLang's tree needs a model's top-k: a chain of K only,
    # drafted at every anchor (a lookup, no forward).
    return dataclasses.replace(config, ddtree=(), anchors="all", tree=None)


NGRAM = Family(
    name="ngram",
    layouts=("no checkpoint: the word ngram, with vLLM's settings as flags",),
    claims=lazy(_DRAFTER, "claims"),
    load=lazy(_DRAFTER, "load"),
    score_rows=lazy(_DRAFTER, "score_rows"),
    effective_config=_effective,
    autoregressive=True,
    display_name="n-gram (vLLM prompt lookup)",
    eval_options=frozenset({"num_speculative_tokens"}),
    flags=FLAGS,
    summarize=lazy(_DRAFTER, "summarize"),
    online=lazy(_DRAFTER, "online"),
    time_round=lazy(_DRAFTER, "time_round"),
    bound_to_target=True,
    # vLLM records no step without a match, and its engines start last: served.py says why.
    vllm=VllmServing(
        method="ngram",
        settings=lazy(_SERVED, "settings"),
        unrecorded_steps=lazy(_SERVED, "unrecorded_steps"),
        start_rank=1,
    ),
)
