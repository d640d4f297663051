"""vLLM's n-gram (prompt lookup) proposer as a drafter family: no weights.

propose.py is the proposer (vLLM ``ngram_proposer.py``), replay.py its rounds on a cached sequence
through the shared round loop, drafter.py its place on the seam (load, score_rows, summarize).
``scorer eval ngram --cache C --num-speculative-tokens K --prompt-lookup-min N --prompt-lookup-max M``;
in ``scorer compare`` it is the free baseline a trained drafter should beat.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from scorer.families.base import Family
from scorer.families.ngram import drafter

__all__ = ["NGRAM"]


def _effective(config: Any) -> Any:
    # DDTree is a block-family mode and SGLang's tree needs a model's top-k: a chain of K only,
    # drafted at every anchor (a lookup, no forward).
    return dataclasses.replace(config, ddtree=(), anchors="all", tree=None)


NGRAM = Family(
    name="ngram",
    layouts=("no checkpoint: the word ngram, with vLLM's settings as flags",),
    claims=drafter.claims,
    load=drafter.load,
    score_rows=drafter.score_rows,
    effective_config=_effective,
    autoregressive=True,
    display_name="n-gram (vLLM prompt lookup)",
    eval_options=frozenset({"num_speculative_tokens", *drafter.SETTINGS}),
    summarize=drafter.summarize,
    online=drafter.online,
    time_round=drafter.time_round,
    bound_to_target=True,
)
