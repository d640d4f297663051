"""What vLLM produced, as the records ``hscache extract`` reads: a served cache of vLLM's own text.

A sampled run becomes ``--responses-from`` lines (capture/responses.py): one line per prompt, one
choice per sample, the request's sampling fields, token ids named ``token_id:N`` and the processed
logprobs vLLM returned (``logprobs_mode="processed_logprobs"``; a masked entry at vLLM's -9999 floor).
A greedy run becomes prompt records ``{"id", "input_ids": prompt + output, "prompt_len"}``, extracted
with ``--max-new-tokens 0`` (the responses path refuses greedy requests). Pure Python.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["completion_choice", "greedy_record", "responses_record"]

_FINISH = ("stop", "length")
_REQUEST_FIELDS = (
    "temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty",
)  # fmt: skip


def _name(token: int) -> str:
    return f"token_id:{int(token)}"


def completion_choice(index: int, request: Mapping[str, Any]) -> dict[str, Any]:
    """One worker request (``token_ids``, ``finish_reason``, ``logprobs``) as a completions choice."""
    ids = list(request["token_ids"])
    positions = request["logprobs"]
    if positions is None or len(positions) != len(ids):
        raise ValueError(f"a sampled vLLM request returned {0 if positions is None else len(positions)} logprob "
                         f"positions for {len(ids)} tokens; run it with logprobs")  # fmt: skip
    own = []
    for token, entries in zip(ids, positions):
        table = {int(t): float(lp) for t, lp in entries}
        own.append(table.get(int(token), -9999.0))
    return {
        "index": index,
        "token_ids": ids,
        "finish_reason": request["finish_reason"] if request["finish_reason"] in _FINISH else "length",
        "logprobs": {
            "tokens": [_name(t) for t in ids],
            "token_logprobs": own,
            "top_logprobs": [{_name(t): float(lp) for t, lp in entries} for entries in positions],
        },
    }


def responses_record(
    record_id: str,
    prompt_ids: Sequence[int],
    samples: Sequence[Mapping[str, Any]],
    sampling: Mapping[str, Any],
    metadata: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """One ``--responses-from`` line: a prompt and its samples (worker requests, in sample order).

    Args:
        sampling: the setting's fields (temperature, top_p, top_k, min_p, penalties, seed, logprobs).
        metadata: kept as the record's other keys (a prompt's category, vLLM's per-request seeds).
    """
    request = {k: sampling[k] for k in _REQUEST_FIELDS if k in sampling}
    request.update(
        prompt=list(prompt_ids), n=len(samples), seed=sampling.get("seed"), logprobs=sampling.get("logprobs")
    )
    response = {
        "prompt_token_ids": list(prompt_ids),
        "choices": [completion_choice(n, s) for n, s in enumerate(samples)],
    }
    return {**dict(metadata or {}), "id": record_id, "request": request, "response": response}


def greedy_record(
    record_id: str,
    prompt_ids: Sequence[int],
    request: Mapping[str, Any],
    metadata: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """One prompts-file record of a greedy run: the prompt and vLLM's output as ``input_ids``."""
    ids = [*map(int, prompt_ids), *map(int, request["token_ids"])]
    return {**dict(metadata or {}), "id": record_id, "input_ids": ids, "prompt_len": len(prompt_ids)}
