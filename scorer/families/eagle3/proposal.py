"""EAGLE-3 proposals along a sampled trajectory, for the probabilistic rule (scorer/offline/sampled_view.py).

Spec/sampling.md 4.3: teacher-force the drafter on y from each anchor: step j is fed y_{a+j} and the
drafter's OWN previous fed-back state, as at inference, so on the matched prefix (the only one that
matters: a slot counts only while the earlier ones were accepted, and then the drafts ARE y) the
proposal is exactly the served one. q_{a,j} = softmax(draft logits / T) over the draft vocabulary;
a target token outside a reduced vocabulary (d2t) has q = 0. Same batching as drafting.py.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from hscache.capture.logit_rows import head_rows
from hscache.store.dtypes import DTYPES
from hscache.store.view import CacheView
from scorer.families.autoregressive import rows_per_chunk
from scorer.offline.sampled_view import head_log_q, proposal_arrays
from scorer.offline.sequences import sequence_features
from scorer.rules.expectation import slot_tokens, target_to_draft_index

__all__ = ["eagle3_log_q", "eagle3_proposals"]


def eagle3_proposals(
    drafter: Any, cache: CacheView, row: int, config: Any, temperature: float
) -> tuple[np.ndarray, np.ndarray]:
    """The ``Family.proposals`` of EAGLE-3: (drafts [A, K] target ids, log q [A, K]) of ``row``."""
    index = [cache.layer_ids.index(i) for i in drafter.config.target_layer_ids]
    features = sequence_features(cache.hidden_states(row), index, DTYPES[config.dtype], config.device, None)
    prompt_len = int(cache.index.column("prompt_len")[row].as_py())
    return eagle3_log_q(
        drafter, features, cache.token_ids(row), prompt_len, temperature, memory_gb=config.memory_gb
    )


@torch.no_grad()
def eagle3_log_q(
    drafter: Any,
    features: torch.Tensor,
    token_ids: torch.Tensor,
    prompt_len: int,
    temperature: float,
    *,
    memory_gb: float = 2.0,
    max_rows: int = 1024,
) -> tuple[np.ndarray, np.ndarray]:
    """Teacher-forced drafts and log q_{a,j}(y_{a+j}) at every anchor of one sequence."""
    K = drafter.config.num_speculative_tokens
    seq_len = len(token_ids)
    at, draft, log_q = proposal_arrays(prompt_len, seq_len, K)
    anchors = len(at)
    if not anchors:
        return draft, log_q
    device = drafter.fc.weight.device
    tokens = token_ids.to(device)
    y = slot_tokens(token_ids, prompt_len, K)  # [A, K] target ids, -1 past the end
    inverse = target_to_draft_index(drafter.draft_to_target.cpu(), drafter.config.vocab_size).numpy()
    columns = np.where(y >= 0, inverse[np.maximum(y, 0)], -1)  # draft columns, -1 outside
    head = head_rows(drafter.config.draft_vocab_size, memory_gb)
    normed0, fed0, kv0 = drafter.step0(features.to(device), tokens, seq_len - 2)
    chunk = rows_per_chunk(drafter, seq_len, memory_gb, max_rows)
    for lo in range(0, anchors, chunk):
        rows = torch.arange(prompt_len - 1 + lo, prompt_len - 1 + min(anchors, lo + chunk), device=device)
        hi = lo + len(rows)
        arg, lq = head_log_q(drafter.head_logits, normed0[rows], columns[lo:hi, 0], temperature, head)
        draft[lo:hi, 0], log_q[lo:hi, 0] = (
            drafter.to_target(torch.as_tensor(arg, device=device)).cpu().numpy(),
            lq,
        )
        fed, own = fed0[rows], [[] for _ in drafter.layers]
        for j in range(1, K):
            fed_tokens = tokens[torch.clamp(rows + 1 + j, max=seq_len - 1)]  # y_{p+j}, p = row + 1
            normed, fed = drafter.step(rows, fed_tokens, fed, j, kv0, own)
            arg, lq = head_log_q(drafter.head_logits, normed, columns[lo:hi, j], temperature, head)
            draft[lo:hi, j] = drafter.to_target(torch.as_tensor(arg, device=device)).cpu().numpy()
            log_q[lo:hi, j] = lq
    return draft, log_q
