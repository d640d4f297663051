"""Running sums behind ``hscache diff``: per layer x position bucket, in float64.

Every reported mean is a ratio of sums over tokens, every extreme a running max/min, so the
result does not depend on how tokens were split into sequences or chunks.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from hscache.diff import stats as drift
from hscache.diff.report import LayerDrift, NextTokenBucket, NextTokenDrift, PositionDrift

__all__ = ["HiddenSums", "NextTokenSums"]

_F64 = torch.float64


def _ratio(num: torch.Tensor, den: torch.Tensor) -> float | None:
    return float(num / den) if float(den) > 0 else None


def _pooled_rel(sq_err: torch.Tensor, sq_ref: torch.Tensor, tokens: torch.Tensor) -> float | None:
    """sqrt(sum err^2 / sum ref^2); 0 when both are 0; None without tokens or with a zero reference."""
    if float(tokens) == 0:
        return None
    if float(sq_ref) == 0:
        return 0.0 if float(sq_err) == 0 else None
    return float((sq_err / sq_ref).sqrt())


def _extreme(value: torch.Tensor, tokens: torch.Tensor) -> float | None:
    return float(value) if float(tokens) > 0 else None


def _bucket_stop(starts: Sequence[int], j: int) -> int | None:
    return starts[j + 1] if j + 1 < len(starts) else None


class HiddenSums:
    """Sums of per-token hidden-state drift, ``[layers, buckets]``."""

    def __init__(self, num_layers: int, num_buckets: int):
        shape = (num_layers, num_buckets)
        self.tokens = torch.zeros(shape, dtype=_F64)
        self.sq_err = torch.zeros(shape, dtype=_F64)
        self.sq_ref = torch.zeros(shape, dtype=_F64)
        self.cos_sum = torch.zeros(shape, dtype=_F64)
        self.rel_sum = torch.zeros(shape, dtype=_F64)
        self.rel_n = torch.zeros(shape, dtype=_F64)
        self.max_abs = torch.zeros(shape, dtype=_F64)
        self.cos_min = torch.full(shape, float("inf"), dtype=_F64)
        self.nonfinite = torch.zeros(num_layers, dtype=torch.long)

    def add(self, layer: int, bucket: torch.Tensor, d: drift.TokenDrift) -> None:
        """Add the tokens of one chunk of one layer; ``bucket`` is each token's bucket index."""
        ok = d.finite
        self.nonfinite[layer] += int((~ok).sum())
        b = bucket[ok]
        self.tokens[layer].index_add_(0, b, torch.ones(len(b), dtype=_F64))
        self.sq_err[layer].index_add_(0, b, d.sq_err[ok])
        self.sq_ref[layer].index_add_(0, b, d.sq_ref[ok])
        self.cos_sum[layer].index_add_(0, b, d.cosine[ok])
        has_rel = ~torch.isnan(d.rel_l2[ok])  # tokens whose reference norm is 0 have no relative error
        self.rel_sum[layer].index_add_(0, b[has_rel], d.rel_l2[ok][has_rel])
        self.rel_n[layer].index_add_(0, b[has_rel], torch.ones(int(has_rel.sum()), dtype=_F64))
        self.max_abs[layer].scatter_reduce_(0, b, d.max_abs[ok], reduce="amax")
        self.cos_min[layer].scatter_reduce_(0, b, d.cosine[ok], reduce="amin")

    def _buckets(self, k: int, starts: Sequence[int]) -> tuple[PositionDrift, ...]:
        return tuple(
            PositionDrift(
                starts[j],
                _bucket_stop(starts, j),
                int(self.tokens[k, j]),
                _pooled_rel(self.sq_err[k, j], self.sq_ref[k, j], self.tokens[k, j]),
                _ratio(self.cos_sum[k, j], self.tokens[k, j]),
                _extreme(self.max_abs[k, j], self.tokens[k, j]),
            )
            for j in range(len(starts))
            if self.tokens[k, j] > 0
        )

    def result(
        self, layer_ids: Sequence[int], layer_types: Sequence[str | None], starts: Sequence[int]
    ) -> tuple[LayerDrift, ...]:
        """One ``LayerDrift`` per layer; position buckets without tokens are left out."""
        out = []
        for k, (layer_id, layer_type) in enumerate(zip(layer_ids, layer_types)):
            n = self.tokens[k].sum()
            out.append(
                LayerDrift(
                    layer_id=int(layer_id),
                    layer_type=layer_type,
                    tokens=int(n),
                    nonfinite_tokens=int(self.nonfinite[k]),
                    rel_l2=_pooled_rel(self.sq_err[k].sum(), self.sq_ref[k].sum(), n),
                    rel_l2_token_mean=_ratio(self.rel_sum[k].sum(), self.rel_n[k].sum()),
                    max_abs=_extreme(self.max_abs[k].max(), n),
                    cosine_mean=_ratio(self.cos_sum[k].sum(), n),
                    cosine_min=_extreme(self.cos_min[k].min(), n),
                    by_position=self._buckets(k, starts),
                )
            )
        return tuple(out)


class NextTokenSums:
    """Sums of next-token agreement per position bucket."""

    def __init__(self, num_buckets: int, top_k: int):
        self.top_k = top_k
        self.positions = torch.zeros(num_buckets, dtype=_F64)
        self.agree = torch.zeros(num_buckets, dtype=_F64)
        self.overlap = torch.zeros(num_buckets, dtype=_F64)
        self.kl_sum = torch.zeros(num_buckets, dtype=_F64)
        self.kl_max = torch.zeros(num_buckets, dtype=_F64)
        self.at_risk = torch.zeros(num_buckets, dtype=_F64)
        self.flips_at_risk = 0

    def add(
        self,
        bucket: torch.Tensor,
        arg_a: torch.Tensor,
        arg_b: torch.Tensor,
        topk_a: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
        topk_b: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    ) -> int:
        """Add one chunk of positions; returns how many of them agree on the argmax. ``topk_a`` /
        ``topk_b``: each cache's (top-k values [T, k], their ids [T, k], log-sum-exp [T]), the
        arguments of ``stats.topk_kl`` for that side."""
        values_a, ids_a, _ = topk_a
        values_b, ids_b, _ = topk_b
        agree = drift.argmax_agreement(arg_a, arg_b)
        kl = drift.topk_kl(*topk_a, *topk_b)
        self.positions.index_add_(0, bucket, torch.ones(len(bucket), dtype=_F64))
        self.agree.index_add_(0, bucket, agree.to(_F64))
        self.overlap.index_add_(0, bucket, drift.topk_overlap(ids_a, ids_b))
        self.kl_sum.index_add_(0, bucket, kl)
        self.kl_max.scatter_reduce_(0, bucket, kl, reduce="amax")
        if self.top_k >= 2:
            risk = drift.margin_at_risk(values_a, drift.logit_drift(values_a, ids_a, values_b, ids_b))
            self.at_risk.index_add_(0, bucket, risk.to(_F64))
            self.flips_at_risk += int((risk & ~agree).sum())
        return int(agree.sum())

    def result(self, starts: Sequence[int]) -> NextTokenDrift:
        n = self.positions.sum()
        margin = self.top_k >= 2
        buckets = tuple(
            NextTokenBucket(
                starts[j],
                _bucket_stop(starts, j),
                int(self.positions[j]),
                _ratio(self.agree[j], self.positions[j]),
                _ratio(self.kl_sum[j], self.positions[j]),
                _ratio(self.at_risk[j], self.positions[j]) if margin else None,
            )
            for j in range(len(starts))
            if self.positions[j] > 0
        )
        return NextTokenDrift(
            positions=int(n),
            top_k=self.top_k,
            argmax_agreement=_ratio(self.agree.sum(), n),
            argmax_flips=int(n - self.agree.sum()),
            topk_overlap=_ratio(self.overlap.sum(), n),
            kl_mean=_ratio(self.kl_sum.sum(), n),
            kl_max=_extreme(self.kl_max.max(), n),
            margin_at_risk=_ratio(self.at_risk.sum(), n) if margin else None,
            flips_at_risk=self.flips_at_risk,
            by_position=buckets,
        )
