"""The target's final norm, saved next to its head so a reader can rebuild transformers'
``hidden_states[L]`` (the last layer AFTER the final norm) from the cached pre-norm output.

The cache stores layer i as decoder layer i's raw output; z-lab and SpecForge drafters read
layer id i as ``hidden_states[i + 1]``, which for the last layer is post-norm. The norm's
formula is identified at extraction by comparing candidate formulas with the module's own
output bit for bit; an unknown norm is not saved, and a reader then refuses instead of guessing.
"""

from __future__ import annotations

import torch

__all__ = ["KINDS", "apply_final_norm", "describe_final_norm", "final_norm_module"]

# kind -> how the fp32-normalised rows n are scaled and cast back (x: the input, w: the weight).
KINDS = (
    "rms_weight",
    "rms_one_plus_weight",
)  # Llama/Qwen3: w * n.to(dtype); Qwen3.5/Gemma: (n * (1 + w)).to(dtype)


def apply_final_norm(kind: str, weight: torch.Tensor, eps: float, x: torch.Tensor) -> torch.Tensor:
    """The target's final RMSNorm on ``x`` [..., H], op for op as transformers computes it."""
    x32 = x.float()
    n = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    w = weight.to(x.device)
    if kind == "rms_weight":
        return w * n.to(x.dtype)
    if kind == "rms_one_plus_weight":
        return (n * (1.0 + w.float())).type_as(x)
    raise ValueError(f"unknown final norm kind {kind!r}; known: {', '.join(KINDS)}")


def describe_final_norm(module: torch.nn.Module | None) -> dict[str, torch.Tensor]:
    """Tensors for head.safetensors (``final_norm.weight``, ``final_norm.eps`` fp64 [1],
    ``final_norm.kind`` uint8 [1] = index in KINDS), or {} when no formula reproduces the module."""
    weight = getattr(module, "weight", None)
    eps = getattr(module, "variance_epsilon", getattr(module, "eps", None))
    if weight is None or eps is None:
        return {}
    weight = weight.detach()
    probe = 3 * torch.randn(
        8, weight.shape[-1], generator=torch.Generator().manual_seed(0), dtype=torch.float32
    ).to(device=weight.device, dtype=weight.dtype)
    with torch.no_grad():
        want = module(probe)
    for n, kind in enumerate(KINDS):
        if torch.equal(apply_final_norm(kind, weight, float(eps), probe), want):
            return {
                "final_norm.weight": weight.cpu().contiguous(),
                "final_norm.eps": torch.tensor([float(eps)], dtype=torch.float64),
                "final_norm.kind": torch.tensor([n], dtype=torch.uint8),
            }
    return {}


def final_norm_module(model: torch.nn.Module) -> torch.nn.Module | None:
    """The final norm of a causal LM (or of a multimodal wrapper's language model), or None:
    its output is transformers' ``hidden_states[L]`` and what vLLM's runner hands a drafter."""
    base = getattr(model, "model", None)
    return getattr(getattr(base, "language_model", base), "norm", None)
