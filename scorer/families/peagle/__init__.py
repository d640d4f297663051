"""P-EAGLE: an EAGLE-3 drafter that drafts its K tokens in ONE forward (vLLM ``parallel_drafting``; trained by
speculators 0.9 ``peagle``, SpecForge 0.2 ``algorithms/peagle``, NeMo Automodel 0.7 ``peagle_trainer``).

Built on the EAGLE-3 family (scorer/families/eagle3/): its config, loader, batched drafting and replay, with
`PEagleDrafter` (model.py) overriding the later slots' inputs (the mask token and the learned mask state)
as vLLM 0.32.0 serves them; seam.py holds the row's functions. This module is the family's row: plain data,
its functions bound lazily (importing the registry imports no torch).
"""

from __future__ import annotations

from scorer.families.base import Family, VllmServing, lazy, lazy_functions

__all__ = ["PEAGLE"]

_SEAM = "scorer.families.peagle.seam"

PEAGLE = Family(
    name="peagle",
    layouts=(
        "speculators PEagleSpeculator directory (speculators_model_type peagle, mask_hidden, mask_token_id)",
        "SpecForge PEagleDraftModel export (flat LlamaConfig; mask token added where vLLM reads it)",
        "NeMo Automodel LlamaEagle3DraftModel with parallel_drafting (keys under model., mask_token_id)",
    ),
    **lazy_functions(_SEAM, "claims", "load", "effective_config", "online", "cost", "init", "train"),
    score_rows=lazy("scorer.families.eagle3.seam", "score_rows"),
    autoregressive=True,
    proposals=lazy("scorer.families.eagle3.proposal", "eagle3_proposals"),
    display_name="P-EAGLE (parallel drafting)",
    eval_options=frozenset({"num_speculative_tokens", "mask_token_id"}),
    init_options=("num_layers", "num_speculative_tokens", "mask_token_id"),
    vllm=VllmServing(method="eagle3", settings=lazy(_SEAM, "vllm_settings"), drafter_attention=True),
)
