"""The n-gram proposer on the family seam: ``scorer eval ngram --num-speculative-tokens K``.

No checkpoint and no weights: CKPT is the word ``ngram`` and the settings are vLLM's
(``--num-speculative-tokens``, ``--prompt-lookup-min``, ``--prompt-lookup-max``). The chain
replay is replay.py's (drafts only where the rounds go); per-position acceptance uses the drafts
at every anchor (``NgramIndex.propose_at``, a short proposal padded with -1, which never matches).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from hscache.store.view import CacheView
from scorer.errors import CheckpointError
from scorer.families.base import (
    CheckpointProbe,
    Loaded,
    OnlineOptions,
    Proposer,
    check_scored_sizes,
    longest_sequence,
)
from scorer.families.ngram import FLAGS
from scorer.families.ngram.propose import NgramConfig, NgramIndex, propose
from scorer.families.ngram.replay import NgramRounds, replay_ngram
from scorer.families.weightless import (
    WeightlessDrafter,
    refused_flags,
    rows_scorer,
    sequence_parts,
    settings_report,
    summarize_counters,
)
from scorer.formats.checkpoint_io import LoadReport
from scorer.offline.sequences import SequenceResult

__all__ = ["CHECKPOINT", "NgramDrafter", "claims", "load", "online", "score_rows", "summarize", "time_round"]

CHECKPOINT = "ngram"  # the CKPT that names this family (it has no file)
# The EvalConfig.overrides keys this family reads (its flags, --prompt-lookup-min / -max).
SETTINGS = tuple(flag.name for flag in FLAGS)


def claims(probe: CheckpointProbe) -> bool:
    return probe.path == CHECKPOINT


class NgramDrafter(WeightlessDrafter):
    """The loaded proposer: its settings (``config.proposer``: an NgramConfig); no module."""

    def __init__(self, proposer: NgramConfig) -> None:
        super().__init__("ngram", proposer)


def load(checkpoint: str, cache: CacheView, config: Any) -> tuple[NgramDrafter, Loaded]:
    """The proposer with vLLM's settings from the eval config.

    Raises:
        CheckpointError: no --num-speculative-tokens (vLLM has no default for ngram), a setting vLLM
            refuses, or a flag of a weighted drafter (named).
    """
    refused = refused_flags(config, SETTINGS)
    if refused:
        raise CheckpointError(
            f"{checkpoint}: {', '.join(refused)} do not apply to the n-gram proposer (no weights, a chain "
            "of K): pass --num-speculative-tokens K and --prompt-lookup-min/--prompt-lookup-max"
        )
    proposer, report = _settings(checkpoint, config.num_speculative_tokens, config.overrides)
    check_scored_sizes(
        longest_sequence(cache),
        str(cache.path),
        num_speculative_tokens=proposer.num_speculative_tokens,
        prompt_lookup_max=proposer.prompt_lookup_max,
    )
    return NgramDrafter(proposer), Loaded(proposer, report)


def _settings(checkpoint: str, k: int | None, overrides: dict[str, Any]) -> tuple[NgramConfig, LoadReport]:
    """vLLM's settings from the flags, and the load report that names them."""
    if k is None:
        raise CheckpointError(
            f"{checkpoint}: pass --num-speculative-tokens K (vLLM's ngram method has no default K)"
        )
    settings = {key: overrides.get(key) for key in SETTINGS}
    proposer = NgramConfig.resolve(k, **settings)
    sources = {"num_speculative_tokens": "override"}
    sources.update({key: "override" if settings[key] is not None else "default" for key in SETTINGS})
    report = settings_report(
        CHECKPOINT,
        proposer,
        sources,
        "vLLM ngram_proposer.py: the longest suffix n-gram that occurred earlier, its earliest match",
    )
    return proposer, report


def online(checkpoint: str, target: Any, options: OnlineOptions) -> tuple[list[int], Proposer, LoadReport]:
    """``scorer online ngram``: the proposer over the verified tokens (it reads no hidden state;
    the target's capture is asked for its first layer, which the proposer ignores)."""
    unknown = sorted(key for key in options.overrides if key not in SETTINGS)
    if unknown:
        flags = ", ".join(f"--{key.replace('_', '-')}" for key in unknown)
        raise CheckpointError(f"{checkpoint}: {flags} do not apply to the n-gram proposer")
    proposer, report = _settings(checkpoint, options.num_speculative_tokens, options.overrides)

    def draft(hidden: Any, ids: list[int], p: int) -> list[int]:
        return propose(
            ids[: p + 1],
            proposer.prompt_lookup_min,
            proposer.prompt_lookup_max,
            proposer.num_speculative_tokens,
            proposer.max_model_len,
        )

    return [0], draft, report


def time_round(
    drafter: NgramDrafter, features: Any, token_ids: Any, anchor: int, tau: float
) -> tuple[float, list[int]]:
    """One served round's proposal at ``anchor``: vLLM's lookup over the verified tokens (CPU)."""
    import time

    p = drafter.config.proposer
    context = np.asarray(token_ids[: anchor + 1])
    t0 = time.perf_counter()
    out = propose(
        context, p.prompt_lookup_min, p.prompt_lookup_max, p.num_speculative_tokens, p.max_model_len
    )
    return time.perf_counter() - t0, out


def score_sequence_ngram(
    proposer: NgramConfig, token_ids: Any, target_argmax: Any, prompt_len: int
) -> tuple[tuple, NgramRounds]:
    """The 7 parts of a SequenceResult (scorer.offline.sequences) and the n-gram rounds of one sequence."""
    x, a = np.asarray(token_ids), np.asarray(target_argmax)
    rounds = replay_ngram(x, a, prompt_len, proposer)
    k = proposer.num_speculative_tokens
    anchors = np.arange(prompt_len, len(x) - 1)
    index = NgramIndex(x, proposer.prompt_lookup_min, proposer.prompt_lookup_max)
    drafts = (
        index.propose_at(anchors, k, proposer.max_model_len)[0]
        if len(anchors)
        else np.zeros((0, k), np.int64)
    )
    parts = sequence_parts(rounds, drafts, x, a, prompt_len)
    return parts, rounds


score_rows = rows_scorer(
    "ngram",
    lambda drafter, seq: score_sequence_ngram(
        drafter.config.proposer, np.asarray(seq.token_ids()), np.asarray(seq.target_argmax()), seq.prompt_len
    ),
)


def summarize(results: list[SequenceResult]) -> dict[str, dict[str, Any]]:
    """vLLM's spec-decode counters pooled over the sequences, as its logger pools an interval."""
    return summarize_counters("ngram", results)
