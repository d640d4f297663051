"""Block drafters' proposals along a sampled trajectory, for the probabilistic rule (scorer/offline/sampled_view.py).

One block forward per anchor a gives the rows of all B-1 slots; they depend on the context up to
a and the mask tokens, never on the drafted values (spec/sampling.md 4.3), so the block drafted at
a is the block along y. The drafter's ``proposal_log_q`` turns the rows into each slot's draft and
log q_{a,j}(y_{a+j}). DFlash's: slot j proposes from q_{a,j} = softmax(l_{a,j} / T) over the whole
vocabulary (vLLM samples each slot from its own marginal); the draft is its argmax. A reduced draft
vocabulary (``draft_to_target``) has -inf logits outside it (``DFlashDrafter.head``): q = 0 there.
A variant that drafts otherwise overrides ``teacher_forced_log_q`` (given each slot's predecessor along y).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from hscache.capture.logit_rows import head_rows
from hscache.store.dtypes import DTYPES
from hscache.store.view import CacheView
from scorer.families.dflash.features import feature_index
from scorer.offline.sampled_view import proposal_arrays
from scorer.offline.sequences import sequence_features
from scorer.rules.expectation import slot_tokens

__all__ = ["block_log_q", "block_proposals"]


def block_proposals(
    drafter: Any, cache: CacheView, row: int, config: Any, temperature: float
) -> tuple[np.ndarray, np.ndarray]:
    """The ``Family.proposals`` of DFlash and the variants built on it: (drafts [A, B-1],
    log q [A, B-1]) of ``row``."""
    index = feature_index(drafter.config, cache.layer_ids)
    features = sequence_features(
        cache.hidden_states(row), index, DTYPES[config.dtype], config.device, drafter.context_norm
    )
    prompt_len = int(cache.index.column("prompt_len")[row].as_py())
    return block_log_q(
        drafter,
        features,
        cache.token_ids(row),
        prompt_len,
        temperature,
        max_blocks_per_forward=config.max_blocks_per_forward,
        memory_gb=config.memory_gb,
    )


@torch.no_grad()
def block_log_q(
    drafter: Any,
    features: torch.Tensor,
    token_ids: torch.Tensor,
    prompt_len: int,
    temperature: float,
    *,
    max_blocks_per_forward: int = 64,
    memory_gb: float = 2.0,
) -> tuple[np.ndarray, np.ndarray]:
    """Drafts and log q_{a,j}(y_{a+j}) at every anchor of one sequence (see the module docstring).

    Anchors go through the drafter in groups of whole forwards that fill about one head chunk, as
    the greedy scorer drafts them (scorer.score), so memory stays bounded for any length.
    """
    B = drafter.config.block_size
    k = B - 1
    seq_len = len(token_ids)
    anchors, draft, log_q = proposal_arrays(prompt_len, seq_len, k)
    if not len(anchors):
        return draft, log_q
    y = slot_tokens(token_ids, prompt_len, k)  # [A, K], -1 past the end
    device = features.device
    tokens = token_ids.to(device)
    rows = head_rows(drafter.config.vocab_size, memory_gb)
    context = drafter.context_kv(features[: max(seq_len - 2, 1)])
    group = max_blocks_per_forward * max(1, rows // (k * max_blocks_per_forward))
    for lo in range(0, len(anchors), group):
        at = torch.as_tensor(anchors[lo : lo + group], dtype=torch.long, device=device)
        blocks = torch.full((len(at), B), drafter.config.mask_token_id, dtype=torch.long, device=device)
        blocks[:, 0] = tokens[at]
        hidden = drafter.block_hidden(
            features, at, blocks, max_blocks_per_forward=max_blocks_per_forward, context=context
        )  # [n, B-1, H]
        d, lq = drafter.proposal_log_q(hidden, tokens[at], y[lo : lo + len(at)], temperature, rows)
        draft[lo : lo + len(at)] = d
        log_q[lo : lo + len(at)] = lq
    return draft, log_q
