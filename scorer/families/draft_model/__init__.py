"""vLLM's standalone draft model (``method: draft_model``; SGLang's STANDALONE) as a drafter family: a
small causal LM of the target's tokenizer drafting K tokens autoregressively on its own KV cache.

CKPT is the draft LM: ``draft:<model>`` for any model hscache loads (``draft:builtin:tiny-qwen3``, an HF
directory), a bare built-in (``builtin:tiny-qwen3``), or an HF causal-LM directory (its config names a
``*ForCausalLM`` and nothing of a drafter layout). ``--num-speculative-tokens K`` is vLLM's K.
drafter.py holds how vLLM drafts (cited there) and the replay; the draft LM reads no target hidden
state, only the verified tokens, so the one thing it shares with the target is the tokenizer (checked).

This module is the family's row: plain data, its functions bound lazily (importing the registry imports
no torch).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from scorer.families.base import Family, VllmServing, lazy, lazy_functions

__all__ = ["DRAFT_MODEL"]

_DRAFTER = "scorer.families.draft_model.drafter"


def _effective(config: Any) -> Any:
    # A chain of K drafted at every anchor from one teacher-forced forward; DDTree is a block-family
    # mode and SGLang's tree is an EAGLE tree.
    return dataclasses.replace(config, ddtree=(), anchors="all", tree=None)


DRAFT_MODEL = Family(
    name="draft_model",
    layouts=(
        "draft:<model>: any causal LM hscache loads (builtin:<name> or an HF directory) with the target's tokenizer",
        "an HF causal-LM directory (config.json architectures *ForCausalLM, no drafter layout keys)",
    ),
    **lazy_functions(_DRAFTER, "claims", "load", "score_rows", "online", "cost", "proposals"),
    effective_config=_effective,
    autoregressive=True,
    display_name="draft model (standalone LM)",
    eval_options=frozenset({"num_speculative_tokens"}),
    init=lazy("scorer.families.draft_model.init", "init_draft_model"),
    init_options=("num_layers",),
    bound_to_target=True,  # reads no target state; the tokenizer is checked on load instead
    # vLLM 0.32.0 method draft_model (v1/spec_decode/draft_model.py); its attention runs in vLLM CPU's kernels
    vllm=VllmServing(method="draft_model", settings=lazy(_DRAFTER, "vllm_settings"), drafter_attention=True),
)
