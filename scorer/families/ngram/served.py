"""How vLLM 0.32.0 serves the n-gram proposer (the family's ``VllmServing``, scorer.families.base).

Two things of vLLM's engine set it apart from the drafters with weights, and the engine worker
(hscache/engines/vllm/worker.py) learns both from its job as data:

- vLLM does not record a step where its proposer found no match: the request takes a plain decode
  step and ``spec_decode_metrics`` gets no entry for it. The worker places those steps by running
  vLLM's own proposer (vllm/v1/spec_decode/ngram_proposer.py:210
  ``_find_longest_matched_ngram_and_propose_tokens``) on the context before each step
  (``unrecorded_steps``).
- Its engines start last (``start_rank`` 1, after the others' 0): each engine start makes vLLM rebind its CPU kernel
  overrides by scanning every module's namespace (vllm 0.32.0 triton_utils/dispatcher.py:125-139,
  ``vars(value).get("kernel")``); once an n-gram engine has run, numba's JIT has left llvmlite
  ``_lib_fn_wrapper`` objects in module namespaces, which that scan cannot read, and every later
  engine fails to build ("'_lib_fn_wrapper' object has no attribute 'get'"). Measured: the three
  engines built after an n-gram one in one process (a target alone, an MTP one) were all refused
  so; with n-gram last, every engine built (or was refused for its own reason).
"""

from __future__ import annotations

from typing import Any

__all__ = ["settings", "unrecorded_steps"]

# vLLM's proposer as the worker imports it: called as (context, min_ngram, max_ngram, max_model_len, k).
_PROPOSER = "vllm.v1.spec_decode.ngram_proposer:_find_longest_matched_ngram_and_propose_tokens"


def settings(checkpoint: str, drafter: Any) -> dict[str, Any]:
    """The proposer's own ``speculative_config`` keys: vLLM's prompt lookup bounds."""
    proposer = drafter.config.proposer
    return {"prompt_lookup_min": proposer.prompt_lookup_min, "prompt_lookup_max": proposer.prompt_lookup_max}


def unrecorded_steps(spec: dict[str, Any], max_model_len: int) -> dict[str, Any]:
    """The worker's ``unrecorded_steps`` entry: a step is unrecorded where vLLM's proposer, with the
    engine's settings, proposes nothing on the context."""
    lo, hi = int(spec.get("prompt_lookup_min") or 1), int(spec.get("prompt_lookup_max") or 1)
    return {"proposer": _PROPOSER, "args": [lo, hi, int(max_model_len), int(spec["num_speculative_tokens"])]}
