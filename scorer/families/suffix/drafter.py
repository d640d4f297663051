"""Suffix decoding on the family seam: ``scorer eval suffix --cache C``.

No checkpoint and no weights: CKPT is the word ``suffix`` and the settings are vLLM's
(``--num-speculative-tokens``, ``--suffix-decoding-max-tree-depth``, ``--suffix-decoding-max-cached-requests``,
``--suffix-decoding-max-spec-factor``, ``--suffix-decoding-min-token-prob``). The drafts at every anchor
come from propose.py's ``ServedProposer``, which the loaded drafter owns: it carries the global tree from
one row to the next, so a drafter scores a cache's rows once, in order. The rounds are the shared
variable-length replay's (scorer.offline.drafted_rounds).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from hscache.store.view import CacheView
from scorer.errors import CheckpointError
from scorer.families.base import CheckpointProbe, check_scored_sizes, longest_sequence
from scorer.families.suffix import FLAGS
from scorer.families.suffix.propose import ServedProposer, SuffixConfig
from scorer.formats.checkpoint_io import LoadReport
from scorer.metrics import acceptance_counts, train_accept_len
from scorer.offline.drafted_rounds import DraftedRounds, counters_summary, replay_drafted
from scorer.offline.sequences import CachedSequence, SequenceResult, result_from_parts, score_rows_with

__all__ = ["CHECKPOINT", "SuffixDrafter", "claims", "load", "score_rows", "score_sequence", "summarize"]

CHECKPOINT = "suffix"  # the CKPT that names this family (it has no file)
SETTINGS = tuple(flag.name for flag in FLAGS)  # the EvalConfig.overrides keys this family reads


def claims(probe: CheckpointProbe) -> bool:
    return probe.path == CHECKPOINT


@dataclass(frozen=True)
class SuffixSettings:
    """What the shared code reads off a drafter's config (``DrafterSettings``)."""

    proposer: SuffixConfig

    @property
    def block_size(self) -> int:  # K drafted slots + the bonus token
        return self.proposer.num_speculative_tokens + 1

    @property
    def target_layer_ids(self) -> tuple[int, ...]:  # reads no hidden state
        return ()

    def to_hf_config(self) -> dict[str, Any]:
        """vLLM's speculative config of this proposer (``--speculative-config``)."""
        settings = self.proposer.to_dict()
        return {"method": "suffix", **settings}


class SuffixDrafter:
    """The loaded proposer: its settings and its trees (``proposer``); no module, no parameters."""

    family = "suffix"
    backend_used = None

    def __init__(self, config: SuffixConfig) -> None:
        self.config = SuffixSettings(config)
        self.proposer = ServedProposer(config)

    def parameters(self) -> Iterator[Any]:
        return iter(())


class LoadedSettings:
    """What the report reads from a load: ``.report`` (``.config``: the proposer's settings)."""

    def __init__(self, config: SuffixConfig, report: LoadReport) -> None:
        self.config, self.report = config, report


def load(checkpoint: str, cache: CacheView, config: Any) -> tuple[SuffixDrafter, LoadedSettings]:
    """The proposer with vLLM's settings from the eval config.

    Raises:
        CheckpointError: a setting vLLM refuses, or a flag this proposer does not read (named).
    """
    refused = [
        flag
        for flag, given in (
            ("--block-size", config.block_size is not None),
            ("--tree", config.tree is not None),
            ("--anchors chain", config.anchors == "chain"),
            ("--config", config.config_path is not None),
            *((f"--{key.replace('_', '-')}", True) for key in config.overrides if key not in SETTINGS),
        )
        if given
    ]
    if refused:
        raise CheckpointError(
            f"{checkpoint}: {', '.join(refused)} do not apply to suffix decoding (no weights, a chain of at "
            "most K): pass --num-speculative-tokens K and the --suffix-decoding-* settings"
        )
    settings = {key: config.overrides.get(key) for key in SETTINGS}
    try:
        proposer = SuffixConfig.resolve(config.num_speculative_tokens, **settings)
    except ValueError as exc:
        raise CheckpointError(f"{checkpoint}: {exc}") from None
    check_scored_sizes(
        longest_sequence(cache), str(cache.path), num_speculative_tokens=proposer.num_speculative_tokens
    )
    described = json.dumps(proposer.to_dict(), sort_keys=True).encode()
    sources = {
        "num_speculative_tokens": "override" if config.num_speculative_tokens is not None else "default"
    }
    sources.update({key: "override" if settings[key] is not None else "default" for key in SETTINGS})
    report = LoadReport(
        path=CHECKPOINT,
        format="no_weights",
        file_sha256={},
        sha256=hashlib.sha256(described).hexdigest(),  # the settings name the proposer
        weights_sha256=hashlib.sha256(b"").hexdigest(),
        field_sources=sources,
        stripped_prefixes=(),
        dropped_keys=(),
        notes=(
            "vLLM suffix_decoding.py with Arctic Inference 0.3.0's suffix trees: the prompt tree and the "
            "global tree of the earlier rows' responses (rows served one at a time, in order)",
        ),
        layout="vllm",
    )
    return SuffixDrafter(proposer), LoadedSettings(proposer, report)


def score_sequence(
    drafter: SuffixDrafter, row: int, token_ids: Any, target_argmax: Any, prompt_len: int
) -> tuple[tuple, DraftedRounds]:
    """The 7 parts of a SequenceResult (scorer.offline.sequences) and the rounds of one sequence."""
    x, a = np.asarray(token_ids), np.asarray(target_argmax)
    drafts, lengths = drafter.proposer.drafts(row, x, prompt_len)
    rounds = replay_drafted(lambda p: drafts[p - prompt_len, : lengths[p - prompt_len]], x, a, prompt_len)
    k = drafter.config.proposer.num_speculative_tokens
    visited = np.asarray([p - prompt_len for p in rounds.log.anchors], dtype=np.int64)
    parts = (
        rounds.log,
        {},
        {},
        drafts[visited] if len(visited) else np.zeros((0, k), dtype=np.int64),
        acceptance_counts(drafts, x, a, prompt_len),
        train_accept_len(drafts, x, a, prompt_len),
        len(drafts),  # every anchor's proposal (per-position acceptance needs them all)
    )
    return parts, rounds


def _sequence_scorer(
    drafter: SuffixDrafter, cache: CacheView, config: Any
) -> Callable[[CachedSequence], SequenceResult]:
    """Score the cache's sequences ``rows``, in row order: token ids only (no hidden state is read)."""

    def score(seq: CachedSequence) -> SequenceResult:
        parts, rounds = score_sequence(drafter, seq.row, seq.token_ids(), seq.target_argmax(), seq.prompt_len)
        counts = {
            "num_drafts": rounds.num_drafts,
            "num_draft_tokens": rounds.num_draft_tokens,
            "num_accepted_tokens": rounds.num_accepted_tokens,
        }
        return result_from_parts(seq.row, seq.record_id, seq.category, parts, {"suffix": counts})

    return score


score_rows = score_rows_with(_sequence_scorer)


def summarize(results: list[SequenceResult]) -> dict[str, dict[str, Any]]:
    """vLLM's spec-decode counters pooled over the sequences, as its logger pools an interval."""
    return counters_summary(lambda r: r.extras["suffix"], results)
