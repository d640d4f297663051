"""Where vLLM's bf16 hybrid parts from itself: near-ties of the target, measured in fp32 nats.

vLLM serves the hybrid in bf16 with its own kernels (Gated DeltaNet, attention); with a drafter it
verifies K + 1 tokens per forward, without one it decodes one at a time, and the two round differently,
so a greedy decision whose top two candidates are closer than bf16 rounding (issue 33: greedy outputs
flip at top-2 margins < 0.04 nats) may go either way. A difference at a larger margin is a real one.
(The offline replay against vLLM needs no such allowance for the target: it verifies against vLLM's
own tokens; its draft-side ties are judged by vLLM's own logits, scorer.studies.vllm_judge.)"""

from __future__ import annotations

import functools
from typing import Any

import torch

# Two candidates this close (fp32 nats) may swap between vLLM's bf16 runs with and without a drafter.
# Measured: 0.015 (the target's output with and without its MTP head).
BF16_TIE_NATS = 0.1


@functools.lru_cache(maxsize=2)
def _fp32_target(model: str) -> Any:
    from hscache.capture.target import load_target

    return load_target(model, "fp32")  # once per model for the session, however many requests part


def target_log_probs(model: str, ids: list[int]) -> torch.Tensor:
    """The target's fp32 next-token log-probabilities after ``ids`` (transformers, recomputed)."""
    with torch.no_grad():
        return _fp32_target(model).model(torch.tensor([ids])).logits[0, -1].float().log_softmax(-1)
