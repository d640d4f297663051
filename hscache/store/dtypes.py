"""Dtypes by name, one table: the ``--dtype`` flag names, the logical names a cache records, torch's.

``--dtype bf16`` (CLI/config) <-> ``"bfloat16"`` (an array's ``logical_dtype`` in the manifest)
<-> ``torch.bfloat16``. How each logical dtype is stored on disk is layout.LOGICAL_TO_STORED.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:  # torch is imported on first use: `hscache --help` and `info` never need it
    import torch

__all__ = [
    "DTYPE_NAMES",
    "LOGICAL_DTYPES",
    "SCORER_DTYPES",
    "stored_view",
    "tensor_from_stored",
    "torch_dtype_of_logical",
]

# --dtype flag names: what a target can run and a cache can hold (DTYPES maps them to torch dtypes).
DTYPE_NAMES = ("bf16", "fp16", "fp32")
# --dtype flag name -> the logical dtype name recorded for the hidden-state array.
LOGICAL_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
# The dtypes the scorer computes in (``scorer eval --dtype``): fp16 drafter replays are not supported.
SCORER_DTYPES = ("bf16", "fp32")


def __getattr__(name: str) -> Any:
    """``DTYPES`` (flag name -> torch dtype), built on first use so that importing this is torch-free."""
    if name == "DTYPES":
        import torch

        return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def torch_dtype_of_logical(logical: str) -> torch.dtype:
    """The torch dtype of a logical dtype name (``"bfloat16"``, ``"float32"``, ``"int32"``...)."""
    import torch

    return getattr(torch, logical)


def tensor_from_stored(raw: np.ndarray, logical: str) -> torch.Tensor:
    """Rows as read from disk -> a tensor of the logical dtype, without copying when contiguous.

    bfloat16 is stored as its raw 16 bits (uint16, see layout.LOGICAL_TO_STORED): viewed back bit-exactly.
    """
    import torch

    tensor = torch.from_numpy(np.ascontiguousarray(raw))
    return tensor.view(torch.bfloat16) if logical == "bfloat16" else tensor


def stored_view(tensor: torch.Tensor, stored: str) -> np.ndarray:
    """A contiguous CPU tensor's memory as a numpy array of the stored dtype (no copy): the ``out``
    of a read. bfloat16 is viewed as its raw 16 bits, as it is stored.

    Raises:
        ValueError: not a contiguous CPU tensor, or its dtype is not stored as ``stored``.
    """
    import torch

    if tensor.device.type != "cpu" or not tensor.is_contiguous():
        raise ValueError(
            f"out must be a contiguous CPU tensor, got {tensor.device} contiguous={tensor.is_contiguous()}"
        )
    raw = (
        tensor.view(torch.int16).numpy().view(np.uint16) if tensor.dtype == torch.bfloat16 else tensor.numpy()
    )
    if raw.dtype != np.dtype(stored):
        raise ValueError(f"out has dtype {tensor.dtype}; the array is stored as {stored}")
    return raw
