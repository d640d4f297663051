"""The rounds of a proposer whose drafts vary in length, and vLLM's counters of them.

vLLM's proposers without weights draft 0..K tokens a round, from the tokens alone: nothing where no
match was found, and then the request takes a plain decode step. ``replay_drafted`` runs the shared round loop
(scorer.offline.replay) over one cached sequence with such a proposer, drafting lazily at the anchors
it visits; ``DraftedRounds`` keeps each round's draft length beside the RoundLog.

vLLM's metrics count only rounds WITH drafts: the scheduler calls ``make_spec_decoding_stats``
only when the request had scheduled spec tokens (vllm/v1/core/sched/scheduler.py,
Scheduler.update_from_output, ``if scheduled_spec_token_ids and generated_token_ids`` at
b4622cf9), and ``SpecDecodingStats.observe_draft`` adds one draft per call
(vllm/v1/spec_decode/metrics.py at ee4ceaae). Its logged mean acceptance length is
``1 + num_accepted_tokens / num_drafts`` (SpecDecodingLogging.log, same file), so

    mean_acceptance_length = 1 + sum(acc over drafted rounds) / (number of drafted rounds)
    tau                    = sum(tokens over ALL rounds) / (number of rounds)

and with rounds that drafted nothing, mean_acceptance_length > tau. Both are reported.
Offline, acc stops at the sequence end and before off-greedy data (scorer.offline.replay), so the last
round of a sequence can count fewer accepted tokens than vLLM's counter, which counts what the
rejection sampler accepted before a stop string or max_tokens trims the output.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from scorer.offline.replay import round_loop
from scorer.rules.onehot_chain import RoundLog, chain_depth

__all__ = ["DraftedRounds", "counters_summary", "mean_acceptance_length", "replay_drafted"]


@dataclass(frozen=True)
class DraftedRounds:
    """The rounds of one sequence under a proposer whose drafts vary in length (0..K tokens, 0 where
    nothing matched).

    Attributes:
        log: the shared RoundLog (tau over every round, off-greedy cuts, ...).
        draft_lengths: tokens proposed per round (0: no match, a plain decode step).
    """

    log: RoundLog
    draft_lengths: tuple[int, ...]

    @property
    def drafted(self) -> tuple[bool, ...]:
        """Per round, whether the proposer drafted anything (vLLM counts only these)."""
        return tuple(n > 0 for n in self.draft_lengths)

    @property
    def num_drafts(self) -> int:
        """vLLM's ``num_drafts``: rounds with a draft."""
        return sum(self.drafted)

    @property
    def num_draft_tokens(self) -> int:
        """vLLM's ``num_draft_tokens``: tokens proposed over the drafted rounds."""
        return sum(self.draft_lengths)

    @property
    def num_accepted_tokens(self) -> int:
        """vLLM's ``num_accepted_tokens``; rounds without a draft accept 0, so the sum is the same."""
        return sum(self.log.accepted)

    @property
    def draft_acceptance_rate(self) -> float | None:
        """vLLM's "Avg Draft acceptance rate": accepted / drafted tokens, None with no draft."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else None

    def accepted_per_position(self, k: int) -> list[int]:
        """vLLM's ``num_accepted_tokens_per_pos``: drafted rounds whose acc reached position i+1.

        vLLM divides these by num_drafts, so a draft shorter than K counts as rejected at the
        positions it never proposed.
        """
        counts = [0] * k
        for accepted in self.log.accepted:
            for position in range(min(accepted, k)):
                counts[position] += 1
        return counts

    @property
    def mean_acceptance_length(self) -> float | None:
        """vLLM's 1 + accepted / num_drafts, None when no round drafted."""
        return mean_acceptance_length([self])

    def to_dict(self) -> dict[str, Any]:
        return {
            **self.log.to_dict(),
            "draft_lengths": list(self.draft_lengths),
            "num_drafts": self.num_drafts,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "draft_acceptance_rate": self.draft_acceptance_rate,
            "mean_acceptance_length": self.mean_acceptance_length,
        }


def mean_acceptance_length(rounds: Sequence[DraftedRounds]) -> float | None:
    """vLLM's mean acceptance length pooled over sequences: 1 + sum accepted / sum drafts.

    The pooling is vLLM's (its logger sums the counters over an interval, then divides); None
    when no round of any sequence drafted (vLLM would log nothing useful there).
    """
    drafts = sum(r.num_drafts for r in rounds)
    return 1 + sum(r.num_accepted_tokens for r in rounds) / drafts if drafts else None


def replay_drafted(
    draft_at: Callable[[int], Sequence[int]], token_ids: Any, target_argmax: Any, prompt_len: int
) -> DraftedRounds:
    """Replay a variable-length proposer over one cached sequence.

    Args:
        draft_at: anchor p -> the proposer's draft there (0..K token ids; empty: a plain decode step),
            called once per visited anchor, in increasing order.
        token_ids: [T] token ids x (prompt, then the generated tokens).
        target_argmax: [T] target argmax a (a[t] predicts position t+1).
        prompt_len: P; the first round's anchor is P (x_P is the first generated token).

    Returns:
        DraftedRounds: the RoundLog (acc = leading draft tokens equal to g_{p+j} = a[p+j-1], cut at
        the sequence end and before off-greedy data) and the draft length of every round.

    Raises:
        ValueError: mismatched token_ids / target_argmax or prompt_len out of range (scorer.offline.replay).
    """
    loop = round_loop(token_ids, target_argmax, prompt_len)
    if hasattr(target_argmax, "detach"):  # torch tensor -> numpy without importing torch here
        target_argmax = target_argmax.detach().cpu().numpy()
    argmax = np.asarray(target_argmax)  # round_loop checked it: 1-D integer, as long as token_ids
    lengths: list[int] = []
    while not loop.done:
        draft = draft_at(loop.p)
        lengths.append(len(draft))
        loop.step(chain_depth(draft, argmax, loop.p) if len(draft) else 0)
    return DraftedRounds(loop.log(), tuple(lengths))


def counters_summary(
    rounds_of: Callable[[Any], dict[str, int]], results: Sequence[Any]
) -> dict[str, dict[str, Any]]:
    """A family's ``summarize``: vLLM's spec-decode counters pooled over the sequences, as its logger
    pools an interval; ``rounds_of(result)`` gives a result's ``num_drafts``, ``num_draft_tokens`` and
    ``num_accepted_tokens`` (what the family put in its extras)."""
    counts = [rounds_of(r) for r in results]
    drafts = sum(c["num_drafts"] for c in counts)
    drafted_tokens = sum(c["num_draft_tokens"] for c in counts)
    accepted = sum(c["num_accepted_tokens"] for c in counts)
    return {
        "mean_acceptance_length": {
            "label": "vLLM mean_acceptance_length (rounds with a draft)",
            "value": 1 + accepted / drafts if drafts else None,
            "definition": "vLLM's 1 + accepted tokens / rounds that drafted (SpecDecodingLogging); "
            "tau also counts the rounds where the proposer found no match, as 1 token each",
        },
        "rounds_with_a_draft": {
            "label": "rounds with a draft (vLLM num_drafts)",
            "value": drafts,
            "definition": "rounds in which the proposer found a match and drafted at least one token",
        },
        "draft_acceptance_rate": {
            "label": "draft acceptance rate (accepted / drafted tokens)",
            "value": accepted / drafted_tokens if drafted_tokens else None,
            "definition": "vLLM's Avg Draft acceptance rate: accepted / proposed tokens over drafted rounds",
        },
    }
