"""What the proposers without weights share: a CKPT that is a word, vLLM's settings as flags.

A weightless family (its folder owns the proposer and its settings class) loads no file: the word
names it, the eval config's flags give vLLM's settings, and the load report hashes those settings
(they are what names the proposer). Its drafts vary in length, so its rounds are
``scorer.offline.drafted_rounds``'; what a sequence's result holds is built here, once.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from scorer.formats.checkpoint_io import LoadReport
from scorer.metrics import acceptance_counts, train_accept_len
from scorer.offline.drafted_rounds import DraftedRounds, counters_summary
from scorer.offline.sequences import CachedSequence, SequenceResult, result_from_parts, score_rows_with

__all__ = [
    "ProposerSettings",
    "WeightlessDrafter",
    "counters",
    "refused_flags",
    "rows_scorer",
    "sequence_parts",
    "settings_report",
    "summarize_counters",
]


class VllmSettings(Protocol):
    """A weightless proposer's settings: K and the rest of vLLM's speculative config."""

    num_speculative_tokens: int

    def to_dict(self) -> dict[str, Any]: ...


@dataclass(frozen=True)
class ProposerSettings:
    """What the shared code reads off a drafter's config (``DrafterSettings``): ``method`` is vLLM's."""

    proposer: Any  # the family's settings (VllmSettings)
    method: str

    @property
    def block_size(self) -> int:  # K drafted slots + the bonus token
        return self.proposer.num_speculative_tokens + 1

    @property
    def target_layer_ids(self) -> tuple[int, ...]:  # reads no hidden state
        return ()

    def to_hf_config(self) -> dict[str, Any]:
        """vLLM's speculative config of this proposer (``--speculative-config``)."""
        return {"method": self.method, **self.proposer.to_dict()}


class WeightlessDrafter:
    """The loaded proposer: its settings; no module, no parameters (``family``: the registry's name)."""

    backend_used = None

    def __init__(self, family: str, proposer: Any) -> None:
        self.family = family
        self.config = ProposerSettings(proposer, family)

    def parameters(self) -> Iterator[Any]:
        return iter(())


def refused_flags(config: Any, settings: tuple[str, ...]) -> list[str]:
    """The eval config's flags a weightless proposer does not read (``settings``: the ones it does)."""
    return [
        flag
        for flag, given in (
            ("--block-size", config.block_size is not None),
            ("--tree", config.tree is not None),
            ("--anchors chain", config.anchors == "chain"),
            ("--config", config.config_path is not None),
            *((f"--{key.replace('_', '-')}", True) for key in config.overrides if key not in settings),
        )
        if given
    ]


def settings_report(checkpoint: str, proposer: Any, sources: dict[str, str], note: str) -> LoadReport:
    """The load report of a proposer named by its settings (sha256 of their JSON; no weight file)."""
    described = json.dumps(proposer.to_dict(), sort_keys=True).encode()
    return LoadReport(
        path=checkpoint,
        format="no_weights",
        file_sha256={},
        sha256=hashlib.sha256(described).hexdigest(),  # the settings name the proposer
        weights_sha256=hashlib.sha256(b"").hexdigest(),
        field_sources=sources,
        stripped_prefixes=(),
        dropped_keys=(),
        notes=(note,),
        layout="vllm",
    )


def sequence_parts(
    rounds: DraftedRounds,
    drafts: np.ndarray,
    token_ids: np.ndarray,
    target_argmax: np.ndarray,
    prompt_len: int,
) -> tuple:
    """The 7 parts of a SequenceResult (scorer.offline.sequences) from the rounds and the proposals
    ``drafts [anchors, K]`` at every anchor (short ones padded with -1, which never matches)."""
    k = drafts.shape[1]
    visited = np.asarray([p - prompt_len for p in rounds.log.anchors], dtype=np.int64)
    return (
        rounds.log,
        {},
        {},
        drafts[visited] if len(visited) else np.zeros((0, k), dtype=np.int64),
        acceptance_counts(drafts, token_ids, target_argmax, prompt_len),
        train_accept_len(drafts, token_ids, target_argmax, prompt_len),
        len(drafts),  # every anchor's proposal (per-position acceptance needs them all)
    )


def counters(rounds: DraftedRounds) -> dict[str, int]:
    """vLLM's per-request spec-decode counters of these rounds (a result's extras)."""
    return {
        "num_drafts": rounds.num_drafts,
        "num_draft_tokens": rounds.num_draft_tokens,
        "num_accepted_tokens": rounds.num_accepted_tokens,
    }


def rows_scorer(
    family: str, score_sequence: Callable[[Any, CachedSequence], tuple[tuple, DraftedRounds]]
) -> Any:
    """A family's ``score_rows``: ``score_sequence(drafter, seq) -> (parts, rounds)`` on each sequence
    (token ids only: no hidden state is read), vLLM's counters kept under ``extras[family]``."""

    def sequence_scorer(drafter: Any, cache: Any, config: Any) -> Callable[[CachedSequence], SequenceResult]:
        def score(seq: CachedSequence) -> SequenceResult:
            parts, rounds = score_sequence(drafter, seq)
            return result_from_parts(seq.row, seq.record_id, seq.category, parts, {family: counters(rounds)})

        return score

    return score_rows_with(sequence_scorer)


def summarize_counters(family: str, results: list[SequenceResult]) -> dict[str, dict[str, Any]]:
    """vLLM's spec-decode counters pooled over the sequences, as its logger pools an interval."""
    return counters_summary(lambda r: r.extras[family], results)
