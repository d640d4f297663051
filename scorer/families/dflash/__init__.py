"""The DFlash family (spec/dflash.md): block drafting from one forward, DDTree.

This module is the family's row in the registry: plain data, its functions bound lazily
(scorer.families.base.lazy) so that importing the registry imports no torch. They live in seam.py
(recognise, load, score, online, cost, init, train), proposals.py and diagnose.py; the config
mapping, model, layout readers and block scoring beside them (config.py, model.py, checkpoint.py,
score.py).
"""

from __future__ import annotations

from scorer.families.base import Family, VllmServing, checkpoint_model, lazy, lazy_functions

__all__ = ["DFLASH", "DFLASH_KINDS", "EVAL_OPTIONS"]

# The EvalConfig fields a block drafter reads (DFlash2 reads the same).
EVAL_OPTIONS = frozenset(
    {
        "block_size",
        "ddtree",
        "anchors",
        "max_blocks_per_forward",
        "target_layer_ids",
        "mask_token_id",
        "rope_theta",
    }
)
# The hypotheses of a DFlash drafter (DFlash2 adds "selector"), in scorer.diagnose.ranking.HYPOTHESIS_KINDS order.
DFLASH_KINDS = (
    "position_offset",
    "layer_ids",
    "final_norm",
    "mask_token_id",
    "rope_theta",
    "block_size",
    "dtype",
    "feature_ablation",
)
_SEAM = "scorer.families.dflash.seam"

DFLASH = Family(
    name="dflash",
    layouts=(
        "z-lab DFlash HF directory",
        "SpecForge DFlash export / training_state.pt",
        "speculators DFlash",
        "training pickles (.pt/.pth/.bin)",
    ),
    **lazy_functions(_SEAM, "claims", "load", "score_rows", "online", "cost", "time_round", "init", "train"),
    online_trees=frozenset({"ddtree"}),
    proposals=lazy("scorer.families.dflash.proposals", "block_proposals"),
    display_name="DFlash",
    eval_options=EVAL_OPTIONS,
    init_options=("num_layers", "block_size", "mask_token_id", "eval_every", "on_eval", "prompt_anchors"),
    from_module=lazy(_SEAM, "module_drafter"),
    fallback=True,
    diagnose_kinds=DFLASH_KINDS,
    diagnose=lazy("scorer.families.dflash.diagnose", "diagnose"),
    # vLLM loads the drafter from its directory, drafts a block of K + 1 and runs its attention.
    vllm=VllmServing(method="dflash", settings=checkpoint_model, k_sets_block=True, drafter_attention=True),
)
