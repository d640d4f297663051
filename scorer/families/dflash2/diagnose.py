"""``scorer diagnose`` for DFlash2 drafters: DFlash's replays (scorer/families/dflash/diagnose.py)
of the DFlash2 drafter, plus the path selector's hypotheses.

- ``selector off``: each slot's argmax drafted from the same block (DFlash's drafting, the
  convolutions kept): names a selector whose weights are not the trained ones (a conversion that
  dropped or mis-mapped its codebooks), or one that hurts;
- ``selector 16``: the selector walking NeMo's default top-16 candidates per slot, when the config
  says another ``selector_top_k``.

DFlash2 drafts every anchor here (the selector walks each block's path), whatever ``--anchors``
says; the selector changes only how a block's drafts are read off its hidden rows, so every
selector hypothesis shares the baseline's features, context and block forward inputs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import torch

from scorer.diagnose.ranking import DiagnosisInputs, FamilyDiagnosis, Hypothesis
from scorer.families.dflash.diagnose import Setting
from scorer.families.dflash.diagnose import diagnose as diagnose_dflash
from scorer.families.dflash.score import block_drafts
from scorer.families.dflash2 import DFLASH2_KINDS
from scorer.families.dflash2.model import DFlash2Drafter

__all__ = ["DFLASH2_KINDS", "SELECTOR_TOP_K", "diagnose"]

SELECTOR_TOP_K = 16  # NeMo Automodel's selector_top_k default (DFlash2 trains with it)
OFF = "off"


def _selector_candidates(configured_top_k: int, vocab_size: int):
    def candidates(base: Setting) -> Iterator[tuple[Hypothesis, Setting]]:
        yield (
            Hypothesis("selector", OFF, "the per-slot argmax drafted, without the path selector"),
            dataclasses.replace(base, variant=OFF),
        )
        if configured_top_k != SELECTOR_TOP_K and SELECTOR_TOP_K <= vocab_size:
            yield (
                Hypothesis(
                    "selector",
                    SELECTOR_TOP_K,
                    f"the selector walking its top {SELECTOR_TOP_K} (NeMo's default)",
                ),
                dataclasses.replace(base, variant=SELECTOR_TOP_K),
            )

    return candidates


def _draft_blocks(
    setting: Setting, drafter: DFlash2Drafter, hidden: torch.Tensor, anchor_tokens: torch.Tensor
) -> torch.Tensor:
    """The drafts [n, B-1] of blocks with final rows ``hidden`` [n, B-1, H]: the selector's path as
    ``scorer eval`` drafts it, or with the selector off each slot's argmax."""
    if setting.variant == OFF:
        return (
            drafter.head(hidden.reshape(-1, hidden.shape[-1])).float().argmax(-1).reshape(hidden.shape[:-1])
        )
    return torch.as_tensor(block_drafts(drafter, hidden, anchor_tokens))


def diagnose(inputs: DiagnosisInputs) -> FamilyDiagnosis:
    """``Family.diagnose`` of DFlash2 (module docstring)."""
    built: DFlash2Drafter = inputs.drafter
    loaded = inputs.loaded
    configured = built.candidate_selector.top_k

    def build(setting: Setting) -> DFlash2Drafter:
        drafter = DFlash2Drafter(dataclasses.replace(built.config, base=setting.config))
        if isinstance(setting.variant, int):  # another top-k: the same selector walking more candidates
            drafter.candidate_selector.top_k = setting.variant
        return drafter

    return diagnose_dflash(
        inputs,
        kinds=DFLASH2_KINDS,
        build=build,
        weights={**loaded.state_dict, **loaded.variant_state},
        draft_blocks=_draft_blocks,
        variant_candidates=_selector_candidates(configured, built.config.vocab_size),
    )
