"""Drift statistics between two captures of the same tokens: small pure tensor functions.

Tensors in, per-token tensors out (float64); ``hscache.diff.compare`` sums them over tokens so that
aggregates are exact (a ratio of sums, never a mean of means). Cache A is the reference: a
relative error divides by A's norm, a KL is KL(A || B), a margin is A's margin.

Next-token definitions (the cache stores, per position, the target's top-k logits sorted
descending, their token ids and the log-sum-exp of the full-vocabulary logits):

* probability of a top-k token: ``p(v) = exp(logit(v) - lse)``, exact for the full vocabulary.
* ``topk_kl``: KL(A || B) over the partition {each token in both top-k sets} + {one "rest"
  bucket}. Every bucket's mass is exact under both distributions (the rest is one minus the
  common tokens' mass), so this is the exact KL of the coarse-grained distributions and, by the
  data-processing inequality, a lower bound on the full-vocabulary KL(A || B). Tokens in only one
  top-k set go to the rest bucket because the other cache does not know their logit.
* ``logit_drift``: the largest |logit_B(v) - logit_A(v)| over the common top-k tokens.
* ``margin_at_risk``: A's top-1 minus top-2 logit margin is below ``2 * logit_drift``; when every
  logit moves by at most d the gap between two tokens moves by at most 2d, so a position with a
  smaller margin could have its argmax flipped by drift of the size observed there.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from hscache.diff.buckets import check_bucket_starts

__all__ = [
    "REST_MASS_FLOOR",
    "TokenDrift",
    "argmax_agreement",
    "bucket_positions",
    "logit_drift",
    "margin_at_risk",
    "token_drift",
    "topk_kl",
    "topk_overlap",
]

# The rest bucket's mass is clamped to at least this, so that float32 rounding of a stored
# log-sum-exp (top-k masses summing to 1 + 1e-7 when k covers the vocabulary) cannot make a
# KL term infinite. Identical inputs still give exactly 0.
REST_MASS_FLOOR = 1e-12


@dataclass(frozen=True)
class TokenDrift:
    """Per-token drift of one layer, all ``[T]`` float64.

    ``sq_err`` = ||a - b||^2 and ``sq_ref`` = ||a||^2 (their sums give the pooled relative error),
    ``rel_l2`` = ||a - b|| / ||a|| (NaN where ||a|| = 0), ``cosine`` in [-1, 1], ``max_abs`` =
    max_h |a_h - b_h|, ``finite`` = every element of both rows is finite.
    """

    sq_err: torch.Tensor
    sq_ref: torch.Tensor
    rel_l2: torch.Tensor
    cosine: torch.Tensor
    max_abs: torch.Tensor
    finite: torch.Tensor


def token_drift(a: torch.Tensor, b: torch.Tensor) -> TokenDrift:
    """Per-token drift of hidden states ``a`` (reference) and ``b``, both ``[T, H]``.

    Cosine of two zero vectors is 1 (they agree), of one zero and one non-zero vector 0. Rows with a
    non-finite element give NaN statistics and ``finite`` False; callers drop them before summing.

    Raises:
        ValueError: the shapes differ or are not 2-D.
    """
    if a.shape != b.shape or a.dim() != 2:
        raise ValueError(
            f"expected two [T, H] tensors of one shape, got {tuple(a.shape)} and {tuple(b.shape)}"
        )
    a64, b64 = a.to(torch.float64), b.to(torch.float64)
    finite = torch.isfinite(a64).all(-1) & torch.isfinite(b64).all(-1)
    diff = a64 - b64
    sq_err = (diff * diff).sum(-1)
    sq_ref = (a64 * a64).sum(-1)
    sq_b = (b64 * b64).sum(-1)
    rel = torch.where(sq_ref > 0, (sq_err / sq_ref).sqrt(), torch.full_like(sq_ref, float("nan")))
    denom = (sq_ref * sq_b).sqrt()
    cos = torch.where(denom > 0, (a64 * b64).sum(-1) / denom, (sq_ref == sq_b).to(torch.float64))
    max_abs = diff.abs().amax(-1) if diff.shape[-1] else torch.zeros_like(sq_err)
    return TokenDrift(sq_err, sq_ref, rel, cos.clamp(-1.0, 1.0), max_abs, finite)


def bucket_positions(positions: torch.Tensor, starts: Sequence[int]) -> torch.Tensor:
    """Bucket index of each token position: bucket i holds ``starts[i] <= p < starts[i + 1]``.

    The last bucket is open-ended. ``starts`` must begin at 0 and increase strictly.

    Raises:
        ValueError: ``starts`` is empty, does not begin at 0 or is not strictly increasing.
    """
    check_bucket_starts(starts)
    edges = torch.tensor(list(starts), dtype=torch.long)
    return torch.bucketize(positions.long(), edges, right=True) - 1


def argmax_agreement(argmax_a: torch.Tensor, argmax_b: torch.Tensor) -> torch.Tensor:
    """``[T]`` bool: both caches predict the same next token at each position."""
    return argmax_a.long() == argmax_b.long()


def _common(ids_a: torch.Tensor, ids_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[T, k, k]`` bool match[t, i, j] = ids_a[t, i] == ids_b[t, j]; and ``[T, k]`` in-B mask of A's ids."""
    match = ids_a.long().unsqueeze(-1) == ids_b.long().unsqueeze(-2)
    return match, match.any(-1)


def topk_overlap(ids_a: torch.Tensor, ids_b: torch.Tensor) -> torch.Tensor:
    """``[T]`` float64: |top-k(A) ∩ top-k(B)| / k for ``[T, k]`` id tensors (ids unique per row).

    Raises:
        ValueError: the shapes differ.
    """
    if ids_a.shape != ids_b.shape:
        raise ValueError(f"top-k id shapes differ: {tuple(ids_a.shape)} and {tuple(ids_b.shape)}")
    _, in_b = _common(ids_a, ids_b)
    return in_b.sum(-1).to(torch.float64) / max(1, ids_a.shape[-1])


def _aligned_b(values_b: torch.Tensor, match: torch.Tensor) -> torch.Tensor:
    """``[T, k]`` B's logit of each of A's top-k tokens (0 where B does not know it)."""
    # gather, not a masked sum: 0 * -inf would turn a masked-out logit into NaN
    j = match.to(torch.uint8).argmax(-1)
    found = torch.gather(values_b.to(torch.float64), -1, j)
    return torch.where(match.any(-1), found, torch.zeros_like(found))


def topk_kl(
    values_a: torch.Tensor,
    ids_a: torch.Tensor,
    lse_a: torch.Tensor,
    values_b: torch.Tensor,
    ids_b: torch.Tensor,
    lse_b: torch.Tensor,
) -> torch.Tensor:
    """``[T]`` float64 KL(A || B) over {common top-k tokens} + {rest}; see the module docstring.

    Args:
        values_a, values_b: ``[T, k]`` top-k logits.
        ids_a, ids_b: ``[T, k]`` their token ids.
        lse_a, lse_b: ``[T]`` log-sum-exp of each cache's full-vocabulary logits.

    Returns:
        Non-negative KL in nats, exactly 0 where the two caches hold identical data.
    """
    match, in_b = _common(ids_a, ids_b)
    logp_a = values_a.to(torch.float64) - lse_a.to(torch.float64).unsqueeze(-1)
    logp_b = _aligned_b(values_b, match) - lse_b.to(torch.float64).unsqueeze(-1)
    common = in_b.to(torch.float64)
    p_a, p_b = logp_a.exp() * common, logp_b.exp() * common
    terms = torch.where(in_b, p_a * (logp_a - logp_b), torch.zeros_like(p_a)).sum(-1)
    rest_a = (1.0 - p_a.sum(-1)).clamp(min=REST_MASS_FLOOR)
    rest_b = (1.0 - p_b.sum(-1)).clamp(min=REST_MASS_FLOOR)
    return (terms + rest_a * (rest_a.log() - rest_b.log())).clamp(min=0.0)


def logit_drift(
    values_a: torch.Tensor, ids_a: torch.Tensor, values_b: torch.Tensor, ids_b: torch.Tensor
) -> torch.Tensor:
    """``[T]`` float64: max |logit_B(v) - logit_A(v)| over the tokens in both top-k sets (inf if none)."""
    match, in_b = _common(ids_a, ids_b)
    delta = (_aligned_b(values_b, match) - values_a.to(torch.float64)).abs()
    delta = torch.where(in_b, delta, torch.full_like(delta, float("-inf"))).amax(-1)
    return torch.where(in_b.any(-1), delta, torch.full_like(delta, float("inf")))


def margin_at_risk(values_a: torch.Tensor, drift: torch.Tensor) -> torch.Tensor:
    """``[T]`` bool: A's top-1 minus top-2 logit margin is below ``2 * drift`` (see module docstring).

    Raises:
        ValueError: fewer than 2 logits per position, so there is no margin.
    """
    if values_a.shape[-1] < 2:
        raise ValueError(f"a top-1/top-2 margin needs top-k with k >= 2, got k = {values_a.shape[-1]}")
    v = values_a.to(torch.float64)
    return (v[..., 0] - v[..., 1]) < 2.0 * drift
