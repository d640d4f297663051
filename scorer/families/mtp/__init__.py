"""The target's own MTP head as a drafter family: ``target:mtp`` scores the head stored in the
cache's ``target/mtp.safetensors`` (hscache/capture/mtp.py) as vLLM serves it.

This module is the family's row in the registry: plain data, its functions bound lazily
(scorer.families.base.lazy) so that importing the registry imports no torch. They live in seam.py
(config from the cache's target config, weight names checked, drafts for every anchor handed to
the shared replay), model.py (the head, vLLM ``qwen3_5_mtp.py``), draft.py (vLLM's method "mtp"),
proposal.py and diagnose.py.
"""

from __future__ import annotations

from scorer.families.base import Family, VllmServing, lazy, lazy_functions

__all__ = ["MTP", "MTP_KINDS"]

MTP_KINDS = ("position_offset", "final_norm")  # scorer.diagnose.ranking.HYPOTHESIS_KINDS order
_SEAM = "scorer.families.mtp.seam"

MTP = Family(
    name="mtp",
    layouts=(
        "the target's own MTP head (mtp.* in a Qwen3.5/3.6/Qwen3-Next checkpoint, stored by hscache extract)",
    ),
    **lazy_functions(
        _SEAM, "claims", "score_rows", "effective_config", "online", "cost", "time_round", "proposals"
    ),
    load=lazy(_SEAM, "load_mtp"),
    autoregressive=True,
    online_trees=frozenset({"tree"}),
    display_name="MTP head",
    bound_to_target=True,
    eval_options=frozenset({"num_speculative_tokens", "tree"}),
    diagnose_kinds=MTP_KINDS,
    diagnose=lazy("scorer.families.mtp.diagnose", "diagnose"),
    vllm=VllmServing(method="mtp"),  # the head ships inside the target vLLM serves
)
