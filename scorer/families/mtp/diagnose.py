"""``scorer diagnose`` for the target's MTP head: the two conventions a trainer and a server of the
same head can disagree on, replayed on the same cached sequences.

- ``final_norm``: the target's last layer read after the final norm (``target:mtp``, as vLLM serves
  it) or before it (``target:mtp-prenorm``, as speculators trains MTP): the other one of the two;
- ``position_offset`` +-1: the drafting steps j >= 1 placed at p-1+j+k instead of vLLM's p-1+j
  (step 0 keeps the target's positions).

The head's step 0 over a sequence (`mtp_context`) is computed once per hidden-state variant and
shared by the position hypotheses, which change only the later steps.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from hscache.store.dtypes import DTYPES
from scorer.diagnose.ranking import (
    DiagnosisInputs,
    FamilyDiagnosis,
    Hypothesis,
    final_norm_alternative,
    replay_anchor_drafts,
)
from scorer.families.mtp import MTP_KINDS
from scorer.families.mtp.draft import draft_anchors, mtp_context
from scorer.families.mtp.model import MtpHead
from scorer.offline.sequences import cache_final_norm

__all__ = ["MTP_KINDS", "MtpReplayer", "MtpSetting", "candidates", "diagnose"]

POSITION_SHIFTS = (-1, 1)
_CKPT = {True: "target:mtp, as vLLM serves it", False: "target:mtp-prenorm, as speculators trains it"}


@dataclass(frozen=True)
class MtpSetting:
    """How to replay the head: its last-layer input after (True) or before (False) the final norm,
    and the offset of the drafting steps' positions."""

    post_norm: bool
    step_position_offset: int = 0


def candidates(base: MtpSetting, cache: Any, K: int) -> Iterator[tuple[Hypothesis, MtpSetting | str]]:
    """Every MTP hypothesis with its setting, or why it is untested here."""
    for k in POSITION_SHIFTS:
        hyp = Hypothesis("position_offset", k, f"drafting steps' positions shifted by {k:+d} (step 0 kept)")
        if K < 2:
            yield hyp, "one drafted token per round: no later step to place (pass --num-speculative-tokens 3)"
        else:
            yield hyp, dataclasses.replace(base, step_position_offset=base.step_position_offset + k)
    hyp, alt = final_norm_alternative(base.post_norm, cache, "the target's last layer")
    hyp = dataclasses.replace(hyp, label=f"{hyp.label} ({_CKPT[not base.post_norm]})")
    yield hyp, alt if isinstance(alt, str) else dataclasses.replace(base, post_norm=alt)


class MtpReplayer:
    """Drafts every anchor of the sampled rows under each setting (``scorer eval``'s path), step 0
    once per hidden-state variant in a row; the settings' heads share the loaded weights."""

    def __init__(self, head: MtpHead, inputs: DiagnosisInputs) -> None:
        self.head, self.caches, self.rows = head, inputs.caches, inputs.rows
        self.device, self.dtype = inputs.options.device, DTYPES[inputs.options.dtype]
        self.memory_gb = inputs.options.memory_gb
        self.final_norm = cache_final_norm(inputs.caches[0])

    def drafter(self, setting: MtpSetting) -> MtpHead:
        """The loaded head under ``setting`` (a shallow copy: the same modules and weights)."""
        head = copy.copy(self.head)
        head.final_norm = self.final_norm if setting.post_norm else None
        head.step_position_offset = setting.step_position_offset
        return head

    def drafts_of_row(self, settings: Sequence[MtpSetting], cache: Any, row: int) -> list[np.ndarray]:
        token_ids = cache.token_ids(row)
        prompt_len = int(cache.index.column("prompt_len")[row].as_py())
        anchors = np.arange(prompt_len, len(token_ids) - 1)
        K = self.head.config.num_speculative_tokens
        contexts: dict[bool, Any] = {}
        out = []
        for s in settings:
            if not len(anchors):
                out.append(np.zeros((0, K), dtype=np.int64))
                continue
            head = self.drafter(s)
            with torch.no_grad():
                if s.post_norm not in contexts:
                    last = cache.hidden_states(row)[
                        :, cache.layer_ids.index(head.config.num_target_layers - 1)
                    ]
                    if head.final_norm is not None:
                        last = head.final_norm(last)
                    hidden = last.to(device=self.device, dtype=self.dtype)
                    contexts[s.post_norm] = mtp_context(head, hidden, token_ids.to(self.device))
                out.append(draft_anchors(head, contexts[s.post_norm], anchors, K, self.memory_gb))
        return out

    def replay_many(
        self, settings: Sequence[MtpSetting], positions: Sequence[int], *, anchors: str | None = None
    ) -> list:
        """Per setting, ``[len(positions), 2]`` (tokens, rounds) and the training-log accept length
        (every anchor is drafted whatever ``anchors`` says)."""
        K1 = self.head.config.num_speculative_tokens + 1
        return replay_anchor_drafts(
            settings, self.caches, self.rows, list(positions), self.drafts_of_row, lambda s: K1
        )


def diagnose(inputs: DiagnosisInputs) -> FamilyDiagnosis:
    """``Family.diagnose`` of the MTP head (module docstring)."""
    head: MtpHead = inputs.drafter
    base = MtpSetting(post_norm=head.final_norm is not None)
    replayer = MtpReplayer(head, inputs)
    found = list(candidates(base, inputs.caches[0], head.config.num_speculative_tokens))
    return FamilyDiagnosis(base, found, replayer.replay_many, replayer)
