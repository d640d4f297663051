"""Building blocks the drafter families' modules share, in plain torch: Qwen3's RMSNorm, the SwiGLU
MLP and the rotary half-rotation. Attribute names are the checkpoints' (``weight``, ``gate_proj``,
``up_proj``, ``down_proj``), so every family's state_dict keys stay what its layout writes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["RMSNorm", "SwiGLU", "rotate_half"]


class RMSNorm(nn.Module):
    """Qwen3 / Llama RMSNorm: normalise in fp32, cast back, then scale by ``weight`` (ones at init).

    Not Qwen3.5's norm, which scales by (1 + weight) in fp32 (the MTP head has its own)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


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
