"""The MTP head's proposals along a sampled trajectory, for the probabilistic rule (scorer/offline/sampled_view.py).

As EAGLE-3 (spec/sampling.md 4.3): each step j > 0 is fed y_{a+j} and the head's own previous
normed output, so the proposal equals the served one on every matched prefix; q_{a,j} =
softmax(MTP logits / T) over the target vocabulary. Same grouping as draft.draft_anchors.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from hscache.capture.logit_rows import head_rows
from scorer.families.mtp.draft import chain_outputs, mtp_context
from scorer.offline.sampled_view import head_log_q, proposal_arrays
from scorer.rules.expectation import slot_tokens

__all__ = ["mtp_log_q"]

_SCORE_BYTES = 4  # fp32 attention scores (draft.py's grouping)


@torch.no_grad()
def mtp_log_q(
    head: Any,
    hidden: torch.Tensor,
    token_ids: torch.Tensor,
    prompt_len: int,
    temperature: float,
    *,
    memory_gb: float = 2.0,
) -> tuple[np.ndarray, np.ndarray]:
    """Teacher-forced drafts and log q_{a,j}(y_{a+j}) at every anchor p in [P, T-2]."""
    K = head.config.num_speculative_tokens
    anchors, draft, log_q = proposal_arrays(prompt_len, len(token_ids), K)
    if not len(anchors):
        return draft, log_q
    device = hidden.device
    tokens = token_ids.to(device)
    y = slot_tokens(token_ids, prompt_len, K)
    context = mtp_context(head, hidden, tokens)
    rows = head_rows(head.config.vocab_size, memory_gb)
    n = context.keys.shape[0]
    per_anchor = head.config.num_attention_heads * (n + K) * _SCORE_BYTES * 3
    group = max(1, min(rows, int(memory_gb * 1e9) // max(per_anchor, 1)))
    for lo in range(0, len(anchors), group):
        at = torch.as_tensor(anchors[lo : lo + group], dtype=torch.long, device=device)
        hi = lo + len(at)
        idx = (at[:, None] + torch.arange(1, K, device=device)[None]).clamp(max=len(tokens) - 1)
        _, states = chain_outputs(head, context, at, K, rows, tokens[idx])  # [n, K, H]
        arg, lq = head_log_q(
            head.logits, states.reshape(-1, states.shape[-1]), y[lo:hi].reshape(-1), temperature, rows
        )
        draft[lo:hi], log_q[lo:hi] = arg.reshape(-1, K), lq.reshape(-1, K)
    return draft, log_q
