"""Where the bf16 hybrid's two engines may part: near-ties, measured in fp32 nats.

vLLM serves the hybrid in bf16 with its own kernels (Gated DeltaNet, attention) and verifies K + 1
tokens per forward; the offline side reads states transformers computed in bf16 for the same text.
The two sets of states differ by bf16 rounding (docs/drift.md: 0.3-0.9 % relative on the trained target), so a decision
whose top two candidates are closer than that may go either way: the target's greedy token (issue 33:
greedy outputs flip at top-2 margins < 0.04 nats) or the MTP head's draft. A difference at a larger
margin is a real one (a swapped rule, a wrong position, a wrong layer)."""

from __future__ import annotations

import functools
from typing import Any

import torch

import hscache

# Two candidates this close (fp32 nats) may swap between the engines' bf16 states. Measured: 0.015
# (the target's output with and without its MTP head) and 0.03 (the MTP head's draft at T 0.7).
BF16_TIE_NATS = 0.1


@functools.lru_cache(maxsize=2)
def _fp32_target(model: str) -> Any:
    from hscache.capture.target import load_target

    return load_target(model, "fp32")  # once per model for the session, however many requests part


def target_log_probs(model: str, ids: list[int]) -> torch.Tensor:
    """The target's fp32 next-token log-probabilities after ``ids`` (transformers, recomputed)."""
    with torch.no_grad():
        return _fp32_target(model).model(torch.tensor([ids])).logits[0, -1].float().log_softmax(-1)


def mtp_first_difference_margins(served: Any, difference: dict) -> dict[str, float]:
    """At the first round where the offline MTP replay (K 1) and vLLM part, the fp32 margins of the two
    decisions that round rests on: ``head`` (the head's draft against the best other token, on the
    served cache's states) and ``target`` (at T 0: the served token against the cache's argmax, which
    the replay verifies against; at T > 0 the served token is the reference: no target decision)."""
    from scorer.families.mtp.draft import mtp_context
    from scorer.families.mtp.seam import mtp_hidden
    from scorer.offline.scoring import load_drafter

    assert difference["offline_anchor"] == difference["vllm_anchor"], difference  # the rounds before: equal
    cache = hscache.open_cache(served.served_cache)
    row = cache.index.column("record_id").to_pylist().index(difference["record_id"])
    tokens, p = cache.token_ids(row), difference["offline_anchor"]
    head, _ = load_drafter(served.checkpoint, cache, served.eval_config)
    hidden = mtp_hidden(head, cache.hidden_states(row), cache.layer_ids, torch.float32, "cpu")
    with torch.no_grad():
        lp = head.logits(mtp_context(head, hidden, tokens).out[p - 1 : p]).float().log_softmax(-1)[0]
    top = torch.topk(lp, 2).values
    margins = {"head": float(top[0] - top[1])}
    if cache.sampling.greedy:
        served_token, argmax = int(tokens[p + 1]), int(cache.target_argmax(row)[p])
        logp = target_log_probs(cache.settings["model"], tokens[: p + 1].tolist())
        margins["target"] = abs(float(logp[served_token] - logp[argmax]))
    return margins
