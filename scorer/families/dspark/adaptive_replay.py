"""The adaptive-verification chain of a scored DSpark sequence (scorer/families/dspark/adaptive.py): the
Markov walk's drafts and the confidence head's values at every anchor, then the round loop with each
round's verify budget. Everything else a result holds (per-slot acceptance, the training-log metric) is
the drafter's, whatever the budget: it is kept from DFlash's scoring."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import torch

from hscache.store.dtypes import DTYPES
from scorer.families.dflash.features import feature_index
from scorer.families.dflash.score import draft_all_anchors
from scorer.families.dspark.adaptive import draft_budget
from scorer.families.dspark.model import DSparkDrafter
from scorer.offline.replay import replay_walk
from scorer.offline.sequences import cached_sequences, sequence_features
from scorer.rules.onehot_chain import leading_matches, slot_matches

__all__ = ["adaptive_results", "anchor_confidences"]


@torch.no_grad()
def anchor_confidences(
    drafter: DSparkDrafter,
    features: torch.Tensor,
    token_ids: torch.Tensor,
    prompt_len: int,
    drafts: np.ndarray,
) -> np.ndarray:
    """The confidence of every drafted slot at anchors P..T-2 [A, K] (DSparkDrafter.confidence): each
    block's rows and its slots' predecessors along the walk (the anchor token, then the drafts),
    as vLLM computes them while drafting (dspark/speculator.py:192-199)."""
    anchors = np.arange(prompt_len, len(token_ids) - 1)
    out = np.zeros(drafts.shape, dtype=np.float64)
    B, K = drafter.config.block_size, drafts.shape[1]
    for lo in range(0, len(anchors), 64):
        at = torch.as_tensor(anchors[lo : lo + 64], dtype=torch.long)
        blocks = torch.full((len(at), B), drafter.config.mask_token_id, dtype=torch.long)
        blocks[:, 0] = token_ids[at]
        rows = drafter.block_hidden(features, at, blocks)  # [n, K, H]
        walked = torch.as_tensor(drafts[lo : lo + len(at)], dtype=torch.long)
        prev = torch.cat([blocks[:, :1], walked[:, :-1]], dim=1)
        conf = drafter.confidence(rows.reshape(-1, rows.shape[-1]), prev.reshape(-1)).reshape(len(at), K)
        out[lo : lo + len(at)] = conf.double().cpu().numpy()
    return out


def _budgeted_chain(
    lead: list[int], confidences: np.ndarray, x: np.ndarray, a: np.ndarray, prompt_len: int, cost: float
) -> tuple[Any, list[int]]:
    """The round loop with each round verifying ``draft_budget`` of its drafts, the budget from the
    previous round's confidences (1.0 before the first): (its RoundLog, the budgets)."""
    k = confidences.shape[1]
    stale: Any = [1.0] * k
    budgets: list[int] = []

    def walk(p: int, avail: int) -> int:
        nonlocal stale
        budgets.append(draft_budget(stale, k, cost))
        stale = confidences[p - prompt_len]
        return min(lead[p - prompt_len], budgets[-1])

    return replay_walk(walk, x, a, prompt_len), budgets


def adaptive_results(
    drafter: DSparkDrafter, cache: Any, results: list[Any], config: Any, cost: float
) -> list[Any]:
    """``results`` (DFlash's scoring of the same rows) with each chain replayed under the budget."""
    index = feature_index(drafter.config, cache.layer_ids)
    dtype = DTYPES[config.dtype]
    rows = [r.row for r in results]
    out = []
    for result, seq in zip(results, cached_sequences(cache, rows), strict=True):
        features = sequence_features(seq.hidden_states(), index, dtype, config.device, drafter.context_norm)
        tokens = seq.token_ids()
        x, a, prompt_len = tokens.cpu().numpy(), seq.target_argmax().cpu().numpy(), seq.prompt_len
        drafts, _, _ = draft_all_anchors(drafter, features, tokens, prompt_len, tree_k=0)
        confidences = anchor_confidences(drafter, features, tokens, prompt_len, drafts)
        lead = leading_matches(slot_matches(drafts, x, a, prompt_len)[0]).tolist()
        chain, budgets = _budgeted_chain(lead, confidences, x, a, prompt_len, cost)
        visited = np.asarray([p - prompt_len for p in chain.anchors], dtype=np.int64)
        extras = {**result.extras, "adaptive_budgets": budgets}
        out.append(dataclasses.replace(result, chain=chain, chain_drafts=drafts[visited], extras=extras))
    return out
