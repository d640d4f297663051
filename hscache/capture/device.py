"""A clear error for a ``--device`` torch cannot use here. Light (torch only, no transformers):
the scorer checks its device without loading a target."""

from __future__ import annotations

import torch

from hscache.errors import InputError

__all__ = ["check_device"]


def check_device(device: str) -> None:
    """A clear error for a device torch cannot use here (a typo, or CUDA on a CPU-only machine)."""
    try:
        parsed = torch.device(device)
    except (RuntimeError, TypeError):
        raise InputError(f"--device {device!r} is not a torch device; use cpu or cuda[:N]") from None
    if parsed.type == "cuda" and not torch.cuda.is_available():
        raise InputError(f"--device {device}: torch reports no CUDA device on this machine; use --device cpu")
    if parsed.type == "cuda" and parsed.index is not None and parsed.index >= torch.cuda.device_count():
        raise InputError(f"--device {device}: this machine has {torch.cuda.device_count()} CUDA device(s)")
