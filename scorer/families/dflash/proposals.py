"""DFlash and DFlash2 proposals along a sampled trajectory, for the probabilistic rule (scorer/served.py).

One block forward per anchor a gives the logits of all B-1 slots; they depend on the context up to
a and the mask tokens, never on the drafted values (spec/sampling.md 4.3), so the block drafted at
a is the block along y:
- DFlash: slot j proposes from q_{a,j} = softmax(l_{a,j} / T) over the whole vocabulary (vLLM
  samples each slot from its own marginal); the draft is its argmax. A reduced draft vocabulary
  (``draft_to_target``) has -inf logits outside it (``DFlashDrafter.head``): q = 0 there.
- DFlash2 (vLLM MRV2's selector walk at T > 0): slot j proposes from the softmax over the
  selector's ``top_k`` candidates of scores(prev, .) / T with prev = the previous drafted token,
  which along y is y_{a+j-1} (the anchor token for j = 1); q = 0 off the candidates. The draft is
  the candidate of the highest score (the greedy walk, fed y).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from hscache.capture.forward import head_rows
from hscache.store.dtypes import DTYPES
from hscache.store.view import CacheView
from scorer.families.dflash.features import feature_index
from scorer.sequences import sequence_features
from scorer.served import head_log_q, proposal_arrays
from scorer.verification import slot_tokens

__all__ = ["block_log_q", "block_proposals"]


def block_proposals(
    drafter: Any, cache: CacheView, row: int, config: Any, temperature: float
) -> tuple[np.ndarray, np.ndarray]:
    """The ``Family.proposals`` of DFlash and DFlash2: (drafts [A, B-1], log q [A, B-1]) of ``row``."""
    index = feature_index(drafter.config, cache.layer_ids)
    norm = getattr(drafter, "context_norm", None)
    features = sequence_features(cache.hidden_states(row), index, DTYPES[config.dtype], config.device, norm)
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
    selector = getattr(drafter, "candidate_selector", None)
    for lo in range(0, len(anchors), group):
        at = torch.as_tensor(anchors[lo : lo + group], dtype=torch.long, device=device)
        blocks = torch.full((len(at), B), drafter.config.mask_token_id, dtype=torch.long, device=device)
        blocks[:, 0] = tokens[at]
        hidden = drafter.block_hidden(
            features, at, blocks, max_blocks_per_forward=max_blocks_per_forward, context=context
        )  # [n, B-1, H]
        want = y[lo : lo + len(at)]
        if selector is None:
            arg, lq = head_log_q(
                drafter.head, hidden.reshape(-1, hidden.shape[-1]), want.reshape(-1), temperature, rows
            )
            draft[lo : lo + len(at)] = arg.reshape(-1, k)
            log_q[lo : lo + len(at)] = lq.reshape(-1, k)
        else:
            d, lq = _selector_log_q(drafter, selector, hidden, tokens[at], want, temperature, rows)
            draft[lo : lo + len(at)] = d
            log_q[lo : lo + len(at)] = lq
    return draft, log_q


def _selector_log_q(
    drafter: Any,
    selector: Any,
    hidden: torch.Tensor,
    anchor_tokens: torch.Tensor,
    want: np.ndarray,
    temperature: float,
    rows: int,
) -> tuple[np.ndarray, np.ndarray]:
    """DFlash2's walk fed y: per slot the candidates (``torch.topk`` of the draft logits in the
    drafter's dtype, as ``CandidateSelector.walk`` is fed in scorer.score), scores with the
    predecessor y_{a+j-1}, the argmax candidate and log softmax(scores / T) at y_{a+j}."""
    from hscache.capture.forward import row_chunks

    n, k, h = hidden.shape
    flat = hidden.reshape(-1, h)
    unary, candidates = [], []
    for lo, hi, new in row_chunks(flat.shape[0], rows):
        logits = drafter.head(flat[lo:hi])[new - lo :].float()
        top = torch.topk(logits.to(flat.dtype), selector.top_k, dim=-1)
        unary.append(top.values)
        candidates.append(top.indices)
    unary_t = torch.cat(unary).reshape(n, k, -1)
    cand = torch.cat(candidates).reshape(n, k, -1)
    wanted = torch.as_tensor(want, dtype=torch.long, device=hidden.device)  # [n, K], -1 past the end
    # predecessors along y: the anchor token, then y_{a+1..a+K-1} (past the end: any valid id, unused)
    prev = torch.cat([anchor_tokens[:, None], wanted[:, :-1].clamp(min=0)], dim=1)
    gate_hidden = selector.hidden_projection(hidden)  # [n, K, r]
    gate = F.embedding(prev, selector.predecessor_codebook) * gate_hidden
    scores = unary_t + torch.einsum("bkr,bkcr->bkc", gate, F.embedding(cand, selector.successor_codebook))
    draft = cand.gather(-1, scores.argmax(dim=-1, keepdim=True))[..., 0]
    logq_all = torch.log_softmax(scores.float() / temperature, dim=-1)
    hit = cand == wanted[..., None]
    picked = torch.where(hit, logq_all, torch.full_like(logq_all, -torch.inf)).amax(dim=-1)
    return draft.cpu().numpy(), picked.double().cpu().numpy()
