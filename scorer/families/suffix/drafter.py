"""Suffix decoding on the family seam: ``scorer eval suffix --cache C``.

No checkpoint and no weights: CKPT is the word ``suffix`` and the settings are vLLM's
(``--num-speculative-tokens``, ``--suffix-decoding-max-tree-depth``, ``--suffix-decoding-max-cached-requests``,
``--suffix-decoding-max-spec-factor``, ``--suffix-decoding-min-token-prob``). The drafts at every anchor
come from propose.py's ``ServedProposer``, which the loaded drafter owns: it carries the global tree from
one row to the next, so a drafter scores a cache's rows once, in order. The rounds are the shared
variable-length replay's (scorer.offline.drafted_rounds).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from hscache.store.view import CacheView
from scorer.errors import CheckpointError
from scorer.families import weightless
from scorer.families.base import CheckpointProbe, Loaded, check_scored_sizes, longest_sequence
from scorer.families.suffix import FLAGS
from scorer.families.suffix.propose import ServedProposer, SuffixConfig
from scorer.families.weightless import WeightlessDrafter
from scorer.offline.drafted_rounds import DraftedRounds, replay_drafted
from scorer.offline.sequences import SequenceResult

__all__ = ["CHECKPOINT", "SuffixDrafter", "claims", "load", "score_rows", "score_sequence", "summarize"]

CHECKPOINT = "suffix"  # the CKPT that names this family (it has no file)
SETTINGS = tuple(flag.name for flag in FLAGS)  # the EvalConfig.overrides keys this family reads


def claims(probe: CheckpointProbe) -> bool:
    return probe.path == CHECKPOINT


class SuffixDrafter(WeightlessDrafter):
    """The loaded proposer: its settings and its trees (``proposer``); no module, no parameters."""

    def __init__(self, config: SuffixConfig) -> None:
        super().__init__("suffix", config)
        self.proposer = ServedProposer(config)


def load(checkpoint: str, cache: CacheView, config: Any) -> tuple[SuffixDrafter, Loaded]:
    """The proposer with vLLM's settings from the eval config.

    Raises:
        CheckpointError: a setting vLLM refuses, or a flag this proposer does not read (named).
    """
    refused = weightless.refused_flags(config, SETTINGS)
    if refused:
        raise CheckpointError(
            f"{checkpoint}: {', '.join(refused)} do not apply to suffix decoding (no weights, a chain of at "
            "most K): pass --num-speculative-tokens K and --suffix-decoding-max-tree-depth and its kin (scorer eval --help)"
        )
    settings = {key: config.overrides.get(key) for key in SETTINGS}
    try:
        proposer = SuffixConfig.resolve(config.num_speculative_tokens, **settings)
    except ValueError as exc:
        raise CheckpointError(f"{checkpoint}: {exc}") from None
    check_scored_sizes(
        longest_sequence(cache), str(cache.path), num_speculative_tokens=proposer.num_speculative_tokens
    )
    sources = {
        "num_speculative_tokens": "override" if config.num_speculative_tokens is not None else "default"
    }
    sources.update({key: "override" if settings[key] is not None else "default" for key in SETTINGS})
    report = weightless.settings_report(
        CHECKPOINT,
        proposer,
        sources,
        "vLLM suffix_decoding.py with Arctic Inference 0.3.0's suffix trees: the prompt tree and the "
        "global tree of the earlier rows' responses (rows served one at a time, in order)",
    )
    return SuffixDrafter(proposer), Loaded(proposer, report)


def score_sequence(
    drafter: SuffixDrafter, row: int, token_ids: Any, target_argmax: Any, prompt_len: int
) -> tuple[tuple, DraftedRounds]:
    """The 7 parts of a SequenceResult (scorer.offline.sequences) and the rounds of one sequence."""
    x, a = np.asarray(token_ids), np.asarray(target_argmax)
    drafts, lengths = drafter.proposer.drafts(row, x, prompt_len)
    rounds = replay_drafted(lambda p: drafts[p - prompt_len, : lengths[p - prompt_len]], x, a, prompt_len)
    parts = weightless.sequence_parts(rounds, drafts, x, a, prompt_len)
    return parts, rounds


# Rows in row order: each row's global tree holds the earlier rows' responses (propose.py).
score_rows = weightless.rows_scorer(
    "suffix",
    lambda drafter, seq: score_sequence(
        drafter, seq.row, seq.token_ids(), seq.target_argmax(), seq.prompt_len
    ),
)


def summarize(results: list[SequenceResult]) -> dict[str, dict[str, Any]]:
    """vLLM's spec-decode counters pooled over the sequences, as its logger pools an interval."""
    return weightless.summarize_counters("suffix", results)
