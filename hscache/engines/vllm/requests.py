"""What hscache asks vLLM to sample, in one place: a sampling setting as ``SamplingParams`` fields, the
per-request seed rule, and a request's processed logprobs as plain lists.

Shared by the judge (``scorer served``, whose engine side is worker.py) and ``hscache extract --engine
vllm`` (capture.py), so both draw the same request with the same seed. Pure Python; ``sampling_params``
imports vLLM when called.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hscache.store.sampling import SamplingSetting

__all__ = [
    "LOGPROB_FLOOR",
    "SEED_RULE",
    "position_logprobs",
    "returned",
    "request_seed",
    "sampling_fields",
    "sampling_params",
    "sequence_seed",
]

# vLLM's OpenAI layer writes a masked (-inf) logprob as this (ChatCompletionLogProb); the worker does too.
LOGPROB_FLOOR = -9999.0
SEED_RULE = (
    "vLLM per-request seed = setting seed + prompt * samples_per_prompt + sample (prompt: the record's "
    "0-based number among the records read, after --limit and before --shard; sample: 0-based)"
)


def request_seed(setting_seed: int | None, prompt: int, sample: int, samples: int) -> int | None:
    """vLLM's per-request seed of sample ``sample`` of prompt ``prompt`` (``SEED_RULE``); None: unseeded."""
    return None if setting_seed is None else setting_seed + prompt * samples + sample


def sequence_seed(setting: SamplingSetting, n: int, shard: tuple[int, int] | None = None) -> int | None:
    """``request_seed`` of the ``n``-th sequence an extraction reads (a record's samples consecutive), the
    record numbered among all records read: shard (I, N) holds records I, I + N, ..., so the shards of a
    sharded run draw with the seeds one run would."""
    samples = setting.samples_per_prompt
    record, sample = divmod(n, samples)
    if shard is not None:
        index, count = shard
        record = record * count + index
    return request_seed(setting.seed, record, sample, samples)


def sampling_fields(setting: SamplingSetting, vocab_size: int, max_tokens: int) -> dict[str, Any]:
    """``SamplingParams`` fields of ``setting`` (vLLM's own names), ``max_tokens`` and, when sampled, the
    logprobs that hold its whole processed support: ``support_width`` + 1 (one entry past the support
    shows it is complete: vLLM returns a masked token at -inf), at most the vocabulary."""
    s = setting
    if s.greedy:
        return {"temperature": 0.0, "max_tokens": max_tokens}
    return {
        "temperature": s.temperature, "top_p": s.top_p, "top_k": s.top_k, "min_p": s.min_p,
        "presence_penalty": s.presence_penalty, "frequency_penalty": s.frequency_penalty,
        "repetition_penalty": s.repetition_penalty, "max_tokens": max_tokens,
        "logprobs": min(s.support_width + 1, vocab_size),
    }  # fmt: skip


def sampling_params(fields: Mapping[str, Any], seed: int | None, **extra: Any) -> Any:
    """``vllm.SamplingParams`` of ``sampling_fields``' output, the request's seed and ``extra`` fields
    (``stop_token_ids``, ``max_tokens`` ...), which override ``fields``.

    ``detokenize=False``: hscache reads token ids and logprob values only (``returned``), never the text
    or a logprob's decoded token, which vLLM would otherwise decode for every logprob of every position
    (vllm 0.32.0 v1/engine/output_processor.py:250, logprobs.py:97-101; ~0.2 CPU-s of an engine's ~0.7 on
    the tests' tiny target with 41 logprobs a position). What vLLM samples and returns as ids and
    logprobs is the same; stopping is on token ids (``stop_token_ids``, EOS), checked without the text.
    """
    from vllm import SamplingParams

    values = {**fields, **extra}
    logprobs = values.pop("logprobs", None)
    return SamplingParams(**values, seed=seed, logprobs=logprobs or None, detokenize=False)


def position_logprobs(entry: Mapping[int, Any]) -> list[list[float]]:
    """One generated position's returned logprobs as ``[[id, logprob], ...]``, a masked one at the floor."""
    rows = []
    for token, lp in entry.items():
        value = float(lp.logprob)
        rows.append([int(token), value if value > LOGPROB_FLOOR else LOGPROB_FLOOR])
    return rows


def returned(completion: Any) -> dict[str, Any]:
    """What one vLLM ``CompletionOutput`` returned, as plain data: ``token_ids``, ``finish_reason`` and
    per position ``logprobs`` (``position_logprobs``; None when none were requested)."""
    logprobs = completion.logprobs
    return {
        "token_ids": [int(t) for t in completion.token_ids],
        "finish_reason": completion.finish_reason,
        "logprobs": [position_logprobs(e) for e in logprobs] if logprobs else None,
    }
