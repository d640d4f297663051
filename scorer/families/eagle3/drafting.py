"""EAGLE-3 drafts of one cached sequence at every anchor, batched (see model.py for the math).

Anchor p (P <= p <= T-2) is step-0 row i = p-1. Step 0 runs once over rows 0..T-3; steps 1..K-1
run for all anchors together, in chunks of rows sized so the [rows, Vd] logits fit ``memory_gb``.
``teacher_forced`` feeds the ground-truth token x[p+j] into step j instead of the drafter's own
d_j (speculators' training loop, ``Eagle3DraftModel.forward``: "feed the ground-truth tokens ...
into the next TTT step"), keeping the drafter's own fed-back state, as training does.
"""

from __future__ import annotations

import numpy as np
import torch

from hscache.capture.logit_rows import DEFAULT_MEMORY_GB
from scorer.families.autoregressive import rows_per_chunk
from scorer.families.eagle3.model import Eagle3Drafter

__all__ = ["draft_every_anchor", "draft_every_anchor_one_by_one"]


@torch.no_grad()
def draft_every_anchor(
    drafter: Eagle3Drafter,
    features: torch.Tensor,
    token_ids: torch.Tensor,
    prompt_len: int,
    num_tokens: int,
    *,
    teacher_forced: bool = False,
    memory_gb: float = DEFAULT_MEMORY_GB,
    max_rows: int = 1024,
    step0: tuple | None = None,
) -> np.ndarray:
    """Target-id drafts ``[A, K]`` for anchors P..T-2 (A = T-1-P), chain of K = ``num_tokens``.

    Args:
        features: ``[T, K_feat*Ht]`` target features in the drafter's layer order.
        token_ids: ``[T]`` cached tokens.
        teacher_forced: training-style steps > 0 (ground-truth tokens in), for the beside-number.
        max_rows: at most this many anchors per chunk of later steps (attention is [rows, T]).
        step0: ``drafter.step0(features, token_ids, T - 2)`` when already computed (``scorer
            diagnose`` shares it among settings that change only the later steps).
    """
    seq_len = len(token_ids)
    anchors = seq_len - 1 - prompt_len
    if anchors <= 0:
        return np.zeros((0, num_tokens), dtype=np.int64)
    device = drafter.fc.weight.device
    token_ids = token_ids.to(device)
    normed0, fed0, kv0 = step0 or drafter.step0(features.to(device), token_ids, seq_len - 2)
    chunk = rows_per_chunk(drafter, seq_len, memory_gb, max_rows)
    out = np.zeros((anchors, num_tokens), dtype=np.int64)
    for lo in range(0, anchors, chunk):
        rows = torch.arange(prompt_len - 1 + lo, prompt_len - 1 + min(anchors, lo + chunk), device=device)
        drafted = drafter.to_target(drafter.head_logits(normed0[rows]).float().argmax(-1))
        columns = [drafted]
        fed = fed0[rows]
        own: list[list] = [[] for _ in drafter.layers]
        for j in range(1, num_tokens):
            if teacher_forced:  # x[p + j] = x[i + 1 + j]; past the end the slot is out of range anyway
                tokens = token_ids[torch.clamp(rows + 1 + j, max=seq_len - 1)]
            else:
                tokens = columns[-1]
            normed, fed = drafter.step(rows, tokens, fed, j, kv0, own)
            columns.append(drafter.to_target(drafter.head_logits(normed).float().argmax(-1)))
        out[lo : lo + len(rows)] = torch.stack(columns, dim=1).cpu().numpy()
    return out


def draft_every_anchor_one_by_one(
    drafter: Eagle3Drafter, features: torch.Tensor, token_ids: torch.Tensor, prompt_len: int, num_tokens: int
) -> np.ndarray:
    """The same drafts from vLLM's loop run once per anchor (``draft_one_anchor``): the reference."""
    seq_len = len(token_ids)
    rows = [
        drafter.draft_one_anchor(features, token_ids, p, num_tokens) for p in range(prompt_len, seq_len - 1)
    ]
    return np.asarray(rows, dtype=np.int64).reshape(-1, num_tokens)
