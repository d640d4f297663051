"""DFlash2 as a drafter family: DFlash's layouts with DFlash2's config keys and tensors.

This module is the family's row in the registry: plain data, its functions bound lazily
(scorer.families.base.lazy) so that importing the registry imports no torch. They live in seam.py
(built on DFlash's: scorer/families/dflash/seam.py), model.py, init.py and diagnose.py.
"""

from __future__ import annotations

from scorer.families.base import Family, lazy
from scorer.families.dflash import DFLASH_KINDS, EVAL_OPTIONS

__all__ = ["DFLASH2", "DFLASH2_KINDS"]

# DFlash's hypotheses plus the path selector (scorer.diagnose.ranking.HYPOTHESIS_KINDS order).
DFLASH2_KINDS = (*DFLASH_KINDS[:6], "selector", *DFLASH_KINDS[6:])
_SEAM = "scorer.families.dflash2.seam"
_DFLASH_SEAM = "scorer.families.dflash.seam"

DFLASH2 = Family(
    name="dflash2",
    layouts=(
        "NeMo Automodel Qwen3DFlash2DraftModel (save_pretrained)",
        "z-lab DFlash2 (DFlash layout + dflash_config conv_* / selector_* keys)",
    ),
    claims=lazy(_SEAM, "claims"),
    load=lazy(_SEAM, "load"),
    score_rows=lazy(_DFLASH_SEAM, "score_rows"),
    effective_config=lazy(_SEAM, "effective_config"),
    online=lazy(_SEAM, "online"),
    cost=lazy(_SEAM, "cost"),
    time_round=lazy(_DFLASH_SEAM, "time_round"),
    proposals=lazy("scorer.families.dflash.proposals", "block_proposals"),
    display_name="DFlash2",
    eval_options=EVAL_OPTIONS,
    init=lazy(_SEAM, "init"),
    init_options=("from_dir",),
    diagnose_kinds=DFLASH2_KINDS,
    diagnose=lazy("scorer.families.dflash2.diagnose", "diagnose"),
)
