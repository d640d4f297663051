"""The other engines' verification rules at temperature > 0, as batched torch reference kernels.

Two readings beside vLLM's (scorer/rules/vllm_chain.py), for the online reference loop:

- SGLang's target-only tree rule (spec/sampling.md 1.2), ``sgl-kernel/csrc/speculative/
  speculative_sampling.cuh`` ``TreeSpeculativeSamplingTargetOnly`` (indexed commit b227f632; the
  spec read 120affb9): the kernel at L39; one coin per node, ``uniform_samples[node]`` (L66, L84);
  the children tried in sibling order with ``prob_acc += p(child)`` and accepted iff ``coin <=
  prob_acc / threshold_acc || p(child) >= threshold_single`` (L78-L80); a rejected sibling's target
  probability copied into ``draft_probs`` (L92, ``// FIXME: leverage draft probs``); the final token
  drawn from ``relu(target_probs - draft_probs)`` with a DIFFERENT coin,
  ``uniform_samples_for_final_sampling`` (L100-L101), by inverse CDF. With both thresholds 1 (the
  defaults, and the only lossless setting) this is: z ~ p, accept the child equal to z, else emit z.
  SGLang's DFlash and EAGLE chains call the same kernel (a chain is a tree of one child per node).
- The z-lab reference (z-lab/dflash ``dflash/model.py``, snapshot 44947fbf): ``sample()`` L48-54
  (multinomial of softmax(logits / T)), the draft is argmax (L121), the target SAMPLES every block
  position independently (``posterior``, L134), the exact-match prefix is accepted (L135) and the
  posterior at the first mismatch (or the bonus) is emitted (L137). Equal in distribution to vLLM's
  one-hot rule (spec 1.3, 4.1 B).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from scorer.rules.vllm_chain import VerifiedRounds

__all__ = ["TreeRounds", "sglang_target_only_verify", "zlab_verify"]


@dataclass(frozen=True)
class TreeRounds:
    """B verified tree rounds.

    Attributes:
        accepted: [B] int64, tree nodes accepted (the depth reached).
        path: [B, D] int64 node indices accepted, depth 1 first, then -1 (D = the deepest tree).
        tokens: [B, D+1] int64: the accepted nodes' tokens, then the final token, then -1.
    """

    accepted: torch.Tensor
    path: torch.Tensor
    tokens: torch.Tensor

    def emitted(self, b: int) -> list[int]:
        return self.tokens[b, : int(self.accepted[b]) + 1].tolist()


def _tree_depth(parents: torch.Tensor) -> int:
    depth = torch.zeros(parents.shape, dtype=torch.long)
    for i in range(parents.shape[1]):
        par = parents[:, i]
        has = par >= 0
        depth[:, i] = torch.where(has, depth.gather(1, par.clamp(min=0)[:, None])[:, 0] + 1, 1)
    return int(depth.max()) if depth.numel() else 0


def _check_tree(target_probs: torch.Tensor, parents: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    if (
        tokens.ndim != 2
        or target_probs.ndim != 3
        or target_probs.shape[:2] != (tokens.shape[0], tokens.shape[1] + 1)
    ):
        raise ValueError(
            f"target_probs {tuple(target_probs.shape)} must be [B, N+1, V] for tokens {tuple(tokens.shape)} [B, N] "
            "(row 0: the root, row i+1: node i)"
        )
    par = parents.long().expand(tokens.shape) if parents.ndim == 1 else parents.long()
    if par.shape != tokens.shape:
        raise ValueError(
            f"parents {tuple(parents.shape)} must be [N] or [B, N] like tokens {tuple(tokens.shape)}"
        )
    order = torch.arange(tokens.shape[1])[None, :]
    if ((par >= order) | (par < -1)).any():
        raise ValueError(
            "parents must be -1 (the root) or an EARLIER node index: a parent precedes its children"
        )
    return par


def sglang_target_only_verify(
    target_probs: torch.Tensor,
    parents: torch.Tensor,
    tokens: torch.Tensor,
    coins: torch.Tensor,
    final_coins: torch.Tensor,
    *,
    threshold_single: float = 1.0,
    threshold_acc: float = 1.0,
) -> TreeRounds:
    """SGLang's ``TreeSpeculativeSamplingTargetOnly`` for B trees (one request each).

    The kernel walks ``retrive_next_token`` / ``retrive_next_sibling``; here siblings are tried in
    node-index order, and because a parent precedes its children one pass over the nodes in index
    order performs the whole walk.

    Args:
        target_probs: [B, N+1, V] processed target probabilities; row 0 at the root (the anchor's next
            position), row i+1 at node i (given the path to node i).
        parents: [N] or [B, N] parent node index, -1 for a child of the root.
        tokens: [B, N] drafted token per node; -1 pads a tree smaller than N (never a child).
        coins: [B, N+1] uniforms in [0, 1): the coin used among the children of the root (col 0) and
            of node i (col i+1).
        final_coins: [B] the separate uniform of the final (recovered or bonus) draw.
        threshold_single, threshold_acc: SGLang's thresholds; 1.0 is lossless, < 1 is not.

    Returns:
        TreeRounds.
    """
    par = _check_tree(target_probs, parents, tokens)
    b, n = tokens.shape
    p = target_probs.double()
    rows = torch.arange(b)
    cur = torch.full((b,), -1, dtype=torch.long)
    coin = coins[:, 0].double()
    prob_acc = torch.zeros(b, dtype=torch.float64)
    tried = torch.zeros(p.shape[0], p.shape[2], dtype=torch.bool)  # draft_probs != 0 at the current row
    depth_max = _tree_depth(par)
    path = torch.full((b, depth_max), -1, dtype=torch.long)
    accepted = torch.zeros(b, dtype=torch.long)
    for i in range(n):
        tok = tokens[:, i].long()
        child = (par[:, i] == cur) & (tok >= 0)
        tok = tok.clamp(min=0)
        single = p[rows, cur + 1, tok]
        acc_now = prob_acc + single
        take = child & ((coin <= acc_now / max(threshold_acc, 1e-9)) | (single >= threshold_single))
        miss = child & ~take
        tried[rows[miss], tok[miss]] = True
        prob_acc = torch.where(take, 0.0, torch.where(child, acc_now, prob_acc))
        path[rows[take], accepted[take]] = i
        accepted = accepted + take.long()
        cur = torch.where(take, i, cur)
        coin = torch.where(take, coins[:, i + 1].double(), coin)
        tried[take] = False  # the new row's draft_probs were never written
    final = p[rows, cur + 1] * (~tried)  # relu(target_probs - draft_probs)
    cdf = torch.cumsum(final, dim=1)
    u = final_coins.double() * cdf[:, -1]
    last = torch.searchsorted(cdf, u[:, None], right=True)[:, 0].clamp(max=p.shape[2] - 1)
    out = torch.full((b, depth_max + 1), -1, dtype=torch.long)
    keep = path >= 0
    out[:, :depth_max] = torch.where(keep, tokens.long().gather(1, path.clamp(min=0)), -1)
    out[rows, accepted] = last
    return TreeRounds(accepted, path, out)


def zlab_verify(drafts: torch.Tensor, target_samples: torch.Tensor) -> VerifiedRounds:
    """The z-lab reference round: accept the exact-match prefix of independent target samples.

    Args:
        drafts: [B, K] drafted tokens (argmax in the reference).
        target_samples: [B, K+1] y_j ~ p_j sampled independently at every position of the block
            (position j given the anchor and drafts 1..j-1; the last is the bonus position).

    Returns:
        VerifiedRounds: drafts[:acc] then target_samples[acc].
    """
    if drafts.ndim != 2 or target_samples.shape != (drafts.shape[0], drafts.shape[1] + 1):
        raise ValueError(
            f"target_samples {tuple(target_samples.shape)} must be [B, K+1] for drafts {tuple(drafts.shape)} [B, K]"
        )
    b, k = drafts.shape
    x, y = drafts.long(), target_samples.long()
    accepted = torch.cumprod((x == y[:, :k]).long(), dim=1).sum(dim=1)
    tokens = torch.full((b, k + 1), -1, dtype=torch.long)
    tokens[:, :k] = torch.where(torch.arange(k)[None, :] < accepted[:, None], x, -1)
    tokens[torch.arange(b), accepted] = y[torch.arange(b), accepted]
    return VerifiedRounds(accepted, tokens)
