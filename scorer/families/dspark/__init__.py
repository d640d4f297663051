"""DSpark as a drafter family: DFlash's block backbone plus a sequential Markov head and a confidence head
(vLLM 0.32.0 ``Qwen3DSparkModel``; speculators 0.9 and SpecForge 0.2 ``DSparkDraftModel``).

This module is the family's row in the registry: plain data, its functions bound lazily
(scorer.families.base.lazy) so that importing the registry imports no torch. They live in seam.py
(built on DFlash's: scorer/families/dflash/seam.py), model.py and init.py.
"""

from __future__ import annotations

from scorer.families.base import Family, lazy
from scorer.families.dflash import EVAL_OPTIONS

__all__ = ["DSPARK"]

_SEAM = "scorer.families.dspark.seam"
_DFLASH_SEAM = "scorer.families.dflash.seam"

DSPARK = Family(
    name="dspark",
    layouts=(
        "vLLM dense DSpark (Qwen3DSparkModel: DFlash layout + markov_head / confidence_head)",
        "speculators DSpark (speculators_model_type dspark)",
        "SpecForge DSpark export (dflash_config markov_* keys)",
    ),
    claims=lazy(_SEAM, "claims"),
    load=lazy(_SEAM, "load"),
    score_rows=lazy(_DFLASH_SEAM, "score_rows"),
    effective_config=lazy(_SEAM, "effective_config"),
    online=lazy(_SEAM, "online"),
    cost=lazy(_SEAM, "cost"),
    time_round=lazy(_DFLASH_SEAM, "time_round"),
    proposals=lazy("scorer.families.dflash.proposals", "block_proposals"),
    display_name="DSpark",
    eval_options=EVAL_OPTIONS,
    init=lazy(_SEAM, "init"),
    init_options=("num_layers", "block_size", "mask_token_id", "markov_rank"),
)
