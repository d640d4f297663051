"""The n-gram proposer's rounds on one greedy cached sequence, through the shared round loop.

An n-gram draft depends only on the tokens, so on a cached sequence the draft at anchor p is
``propose(x[:p+1])`` exactly: the replay drafts lazily, only at the anchors it visits
(``scorer.offline.replay.RoundLoop``), from one ``NgramIndex`` of the sequence. A round whose proposal is
empty is a plain decode step: acc = 0, one token committed, and tau counts it as a round of 1.

The rounds and vLLM's counters of them (which leave the rounds without a draft out) are the shared
scorer.offline.drafted_rounds'.
"""

from __future__ import annotations

from typing import Any

from scorer.families.ngram.propose import NgramConfig, NgramIndex
from scorer.offline.drafted_rounds import DraftedRounds, mean_acceptance_length, replay_drafted

__all__ = ["NgramRounds", "mean_acceptance_length", "replay_ngram"]


NgramRounds = DraftedRounds  # the n-gram proposer's rounds: the shared record of variable-length drafts


def replay_ngram(token_ids: Any, target_argmax: Any, prompt_len: int, config: NgramConfig) -> NgramRounds:
    """Replay vLLM's n-gram speculative decoding over one cached sequence.

    Args:
        token_ids: [T] token ids x (prompt, then the generated tokens).
        target_argmax: [T] target argmax a (a[t] predicts position t+1).
        prompt_len: P; the first round's anchor is P (x_P is the first generated token).
        config: the proposer's settings.

    Returns:
        NgramRounds: the RoundLog (acc = leading draft tokens equal to g_{p+j} = a[p+j-1], cut at
        the sequence end and before off-greedy data) and the draft length of every round.

    Raises:
        ValueError: mismatched token_ids / target_argmax or prompt_len out of range (scorer.offline.replay).
    """
    index = NgramIndex(token_ids, config.prompt_lookup_min, config.prompt_lookup_max)
    return replay_drafted(
        lambda p: index.draft(p, config.num_speculative_tokens, config.max_model_len),
        token_ids,
        target_argmax,
        prompt_len,
    )
