"""Building blocks the drafter families' modules share, in plain torch: Qwen3's RMSNorm, the SwiGLU
MLP and the rotary half-rotation. Attribute names are the checkpoints' (``weight``, ``gate_proj``,
``up_proj``, ``down_proj``), so every family's state_dict keys stay what its layout writes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch
import torch.nn.functional as F
from torch import nn

from hscache.capture.final_norm import KINDS, apply_final_norm

__all__ = ["RMSNorm", "SwiGLU", "rotate_half", "seeded_init"]

M = TypeVar("M", bound=nn.Module)


class RMSNorm(nn.Module):
    """RMSNorm of either kind a target's own norms use (``hscache.capture.final_norm.KINDS``), op
    for op the same formula: ``"rms_weight"`` (Qwen3 / Llama: normalise in fp32, cast back, then
    scale by ``weight``, ones at init) or ``"rms_one_plus_weight"`` (Qwen3.5, the MTP head: scale
    by (1 + weight) in fp32, then cast back; zeros at init). Both are the identity scale at init."""

    def __init__(self, dim: int, eps: float, kind: str = "rms_weight") -> None:
        super().__init__()
        if kind not in KINDS:
            raise ValueError(f"unknown RMSNorm kind {kind!r}; known: {', '.join(KINDS)}")
        self.weight = nn.Parameter(torch.ones(dim) if kind == "rms_weight" else torch.zeros(dim))
        self.eps = eps
        self.kind = kind

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return apply_final_norm(self.kind, self.weight, self.eps, x)


class SwiGLU(nn.Module):
    """``down_proj(silu(gate_proj(x)) * up_proj(x))``."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """The rotary embedding's (-x2, x1) over the last dimension's two halves (neox style)."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def seeded_init(
    make: Callable[[], M], seed: int, std: float, norm_range: tuple[float, float] | None = None
) -> M:
    """``make()`` built and initialised from ``seed`` alone (a fresh drafter for ``scorer init``), the
    caller's global RNG left as it was: every 2-D parameter (Linear weights) N(0, std); the others
    (norms, biases) U(norm_range) when given, else as ``make`` built them."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        module = make()
        for param in module.parameters():
            if param.ndim == 2:
                torch.nn.init.normal_(param, std=std)
            elif norm_range is not None:
                torch.nn.init.uniform_(param, *norm_range)
    return module
