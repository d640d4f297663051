"""scorer.layers: the shared norm against transformers' own modules, and the seeded drafter init."""

from __future__ import annotations

import pytest
import torch
from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5RMSNorm

from scorer.layers import RMSNorm, seeded_init


@pytest.mark.parametrize(
    ("reference", "kind"),
    [(Qwen3RMSNorm(16, eps=1e-6), "rms_weight"), (Qwen3_5RMSNorm(16, eps=1e-6), "rms_one_plus_weight")],
)
def test_rms_norm_of_each_kind_is_transformers_bit_for_bit(reference: torch.nn.Module, kind: str) -> None:
    ours = RMSNorm(16, 1e-6, kind=kind)
    x = 3 * torch.randn(5, 16, generator=torch.Generator().manual_seed(0))
    assert torch.equal(ours(x), reference(x))  # both fresh: the identity scale
    with torch.no_grad():
        reference.weight.copy_(torch.randn(16, generator=torch.Generator().manual_seed(1)))
        ours.weight.copy_(reference.weight)
    for dtype in (torch.float32, torch.bfloat16):
        assert torch.equal(ours.to(dtype)(x.to(dtype)), reference.to(dtype)(x.to(dtype)))


def test_rms_norm_refuses_an_unknown_kind_by_name() -> None:
    with pytest.raises(
        ValueError, match="unknown RMSNorm kind 'layer'; known: rms_weight, rms_one_plus_weight"
    ):
        RMSNorm(16, 1e-6, kind="layer")


def test_seeded_init_depends_on_the_seed_only_and_leaves_the_global_rng() -> None:
    def make() -> torch.nn.Module:
        return torch.nn.Sequential(torch.nn.Linear(64, 64), RMSNorm(64, 1e-6))

    torch.manual_seed(5)
    state = torch.get_rng_state()
    a, b = seeded_init(make, 3, std=0.02), seeded_init(make, 3, std=0.02)
    assert torch.equal(torch.get_rng_state(), state)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    assert not torch.equal(a[0].weight, seeded_init(make, 4, std=0.02)[0].weight)
    assert abs(float(a[0].weight.detach().std()) - 0.02) < 0.002  # 4096 draws of N(0, 0.02)
    assert torch.equal(a[1].weight, torch.ones(64))  # 1-D: as built without a norm range
    ranged = seeded_init(make, 3, std=0.02, norm_range=(0.8, 1.2))[1].weight
    assert bool(((ranged >= 0.8) & (ranged <= 1.2)).all()) and not torch.equal(ranged, torch.ones(64))
