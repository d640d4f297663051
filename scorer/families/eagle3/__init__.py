"""The EAGLE-3 family: config mapping (config.py), model (model.py), layout readers (layouts.py),
batched drafting (drafting.py), scored on the shared replay loop and report.

This module is the family's row in the registry: plain data, its functions bound lazily
(scorer.families.base.lazy) so that importing the registry imports no torch. They live in seam.py,
layouts.py, online.py, proposal.py and diagnose.py.
"""

from __future__ import annotations

from scorer.families.base import Family, VllmServing, checkpoint_model, lazy, lazy_functions

__all__ = ["EAGLE3", "EAGLE3_KINDS", "EVAL_OPTIONS"]

# The EvalConfig fields a drafter of K chained tokens reads (MTP reads the same).
EVAL_OPTIONS = frozenset({"num_speculative_tokens", "tree"})
# scorer.diagnose.ranking.HYPOTHESIS_KINDS order.
EAGLE3_KINDS = ("position_offset", "layer_ids", "final_norm", "rope_theta", "d2t")
_SEAM = "scorer.families.eagle3.seam"

EAGLE3 = Family(
    name="eagle3",
    layouts=(
        "speculators Eagle3Speculator directory",
        "SpecForge LlamaForCausalLMEagle3 export / training checkpoints",
        "original EAGLE-3 release (config.json + pytorch_model.bin)",
    ),
    **lazy_functions(
        _SEAM, "claims", "score_rows", "effective_config", "cost", "time_round", "init", "train"
    ),
    load=lazy("scorer.families.eagle3.layouts", "load_eagle3"),
    autoregressive=True,
    online=lazy("scorer.families.eagle3.online", "online"),
    online_trees=frozenset({"tree"}),
    proposals=lazy("scorer.families.eagle3.proposal", "eagle3_proposals"),
    display_name="EAGLE-3",
    eval_options=EVAL_OPTIONS,
    init_options=("layout", "num_layers", "num_speculative_tokens"),
    diagnose_kinds=EAGLE3_KINDS,
    diagnose=lazy("scorer.families.eagle3.diagnose", "diagnose"),
    # vLLM loads the drafter from its directory and runs its attention in its own kernels.
    vllm=VllmServing(method="eagle3", settings=checkpoint_model, drafter_attention=True),
)
