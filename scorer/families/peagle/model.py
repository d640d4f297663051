"""The P-EAGLE drafter: an EAGLE-3 drafter whose K drafts come from ONE forward (vLLM ``parallel_drafting``).

How vLLM 0.32.0 serves it (``method: eagle3`` with ``parallel_drafting: true``; a speculators ``peagle``
config maps to exactly that, ``transformers_utils/configs/speculators/base.py:133-134``):

- the first pass of a round (``v1/spec_decode/llm_base_proposer.py`` ``set_inputs_first_pass``, lines
  835-905, kernel ``utils.py`` ``copy_and_expand_eagle_inputs_kernel``, lines 466-560, with
  ``shift_input_ids`` True and K padding slots per request, lines 113-119) lays out, per request, the
  verified rows as EAGLE-3's step 0 (target state of position i with token i+1 at position i), the bonus
  row (state of p-1, token x_p, position p-1), then K-1 parallel-drafting slots at positions p..p+K-2 whose
  token is the mask token (``parallel_drafting_token_id``: the config's ``pard_token``, which vLLM's
  speculators reader sets from ``mask_token_id``, ``configs/speculators/algos.py:83``) and whose hidden
  state is ``combine_hidden_states(mask_hidden)`` (``llm_base_proposer.py:1401-1412``: fc of the learned
  ``mask_hidden`` [1, K_aux * H_t], after input_norm / fc_norm as configured);
- one forward, causal over the KV cache and these rows; the bonus row and the K-1 mask rows are sampled
  (``token_indices_to_sample``: bonus + parallel slots, kernel lines 532-541), each by argmax
  (``propose`` lines 629-637: ``if self.num_speculative_tokens == 1 or self.parallel_drafting``: one
  ``_sample_draft_tokens`` over all K rows, no later steps).

So slot j+1 (j >= 1) is EAGLE-3's step j with its inputs replaced: the mask token and the mask state
instead of d_j and the previous step's fed-back state, at the same position p-1+j and attending to the
same keys (step-0 rows 0..p-1 and the slots before it). ``PEagleDrafter.step_inputs`` makes EAGLE-3's
step exactly that, so every EAGLE-3 drafting path (scorer/families/eagle3/drafting.py, proposal.py) drafts P-EAGLE as served.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from scorer.families.eagle3.config import Eagle3Config
from scorer.families.eagle3.model import Eagle3Drafter

__all__ = ["PEagleDrafter"]


class PEagleDrafter(Eagle3Drafter):
    """An EAGLE-3 drafter with a learned ``mask_hidden`` [1, 1, K_aux * H_t] (speculators' shape) and a mask
    token id (``pard_token``, set by the loader from ``mask_token_id``): its later slots are fed those, never its own drafts."""

    family = "peagle"

    def __init__(self, config: Eagle3Config) -> None:
        super().__init__(config)
        width = config.num_features * config.feature_size
        # N(0, 1) as speculators initialises it (models/peagle/core.py ``torch.randn(1, 1, ...)``)
        self.mask_hidden = nn.Parameter(torch.randn(1, 1, width))
        self.pard_token: int | None = None  # vLLM's name for the token (configs/speculators/algos.py:83)

    def step_inputs(
        self, rows: torch.Tensor, tokens: torch.Tensor, fed: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Parallel-drafting slots are fed the mask token and the mask state, whatever ``tokens`` / ``fed``
        the chain would have fed (module docstring); ``step`` places them at position row + j."""
        if self.pard_token is None:
            raise RuntimeError(
                "PEagleDrafter.pard_token (the mask token) is not set (the loader sets it from the config)"
            )
        del tokens, fed  # the parallel slots never see the drafts
        n = len(rows)
        mask_tokens = torch.full((n,), int(self.pard_token), dtype=torch.long, device=rows.device)
        mask_state = self.combine(self.mask_hidden.reshape(1, -1)).expand(n, -1)
        return mask_tokens, mask_state

    @torch.no_grad()
    def draft_one_anchor(
        self,
        features: torch.Tensor,
        token_ids: torch.Tensor,
        anchor: int,
        num_tokens: int,
        draw: Callable[[torch.Tensor], int] | None = None,
    ) -> list[int]:
        """vLLM's first pass for one request at anchor p, literally (the reference): rows 0..p-1 (feature
        F[i], token x[i+1], position i) and K-1 parallel slots (the mask state and token, positions
        p..p+K-2) in ONE causal forward; the K drafts are the argmax (or ``draw``) of rows p-1..p+K-2.

        ``features`` [>= p, K*Ht] rows 0..p-1; ``token_ids`` [>= p+1] tokens 0..p.
        """
        if self.pard_token is None:
            raise RuntimeError("PEagleDrafter.pard_token (the mask token) is not set")
        p, k = int(anchor), int(num_tokens)
        mask_state = self.combine(self.mask_hidden.reshape(1, -1)).expand(k - 1, -1)
        h = torch.cat([self.combine(features[:p]), mask_state])
        slots = torch.full((k - 1,), int(self.pard_token), dtype=torch.long, device=token_ids.device)
        h, _ = self.causal_forward(self._embed(torch.cat([token_ids[1 : p + 1], slots])), h)
        normed, _ = self.finish(h[p - 1 :])
        return [self._pick(normed[i : i + 1], draw) for i in range(k)]
