"""Which linear-attention kernels a target really runs, and binding the one asked for.

transformers decides once, at import of the modeling module, whether each Gated DeltaNet
kernel comes from flash-linear-attention (fla) or from its own torch code; it never checks
the device, so with fla and triton on a CPU machine every forward dies ("0 active drivers").
The decision lives in module globals of the modeling module (``torch_chunk_gated_delta_rule``
and friends are wrappers that close over ``implementation``). We read those globals to report
what is bound, and rebind them, for the duration of a run only, to the backend chosen here.
The "falling back" log line prints once per process, so it is never used as evidence.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch

from hscache.capture import BACKENDS
from hscache.errors import BackendUnavailableError, InputError

__all__ = ["BACKENDS", "KernelBinding", "fla_status", "inspect_kernels", "resolve_backend", "use_backend"]


# Module global in transformers' modeling file -> the function's path inside fla.
# Names are those of transformers 5.x (qwen3_5, qwen3_next); other models simply have none.
_FLA_KERNELS = {
    "torch_chunk_gated_delta_rule": "fla.ops.gated_delta_rule.chunk_gated_delta_rule",
    "torch_recurrent_gated_delta_rule": "fla.ops.gated_delta_rule.fused_recurrent_gated_delta_rule",
}
# Causal conv kernels come from the separate causal-conv1d package; we report them, and force
# the torch code for them only under --backend torch.
_CONV_KERNELS = ("causal_conv1d_fn", "causal_conv1d_update")


@dataclass(frozen=True)
class KernelBinding:
    """One kernel slot of a modeling module and what currently serves it."""

    name: str  # the module global, e.g. "torch_chunk_gated_delta_rule"
    backend: str  # "torch", "fla", "causal_conv1d", ...
    function: str  # fully qualified name of the callable actually invoked


def fla_status(device: str) -> tuple[bool, str]:
    """Whether fla's Gated DeltaNet ops can really run for ``device``, and why not if they cannot."""
    if not device.startswith("cuda"):
        return False, f"device is {device!r}; fla's Triton kernels need a CUDA device"
    if not torch.cuda.is_available():
        return False, "torch reports no CUDA device"
    try:
        importlib.import_module("fla.ops.gated_delta_rule")
    except Exception as exc:  # ImportError, or triton failing to find a driver
        return False, f"fla.ops.gated_delta_rule does not import ({type(exc).__name__}: {exc})"
    return True, "fla ops import and a CUDA device is present"


def resolve_backend(requested: str, device: str) -> str:
    """Map ``auto`` to ``fla`` or ``torch`` for this machine; check that ``fla`` can run.

    Raises:
        BackendUnavailableError: ``fla`` was requested where it cannot run.
    """
    if requested not in BACKENDS:
        raise InputError(f"--backend {requested!r} is unknown; choose one of {', '.join(BACKENDS)}")
    usable, reason = fla_status(device)
    if requested == "auto":
        return "fla" if usable else "torch"
    if requested == "fla" and not usable:
        raise BackendUnavailableError(
            f"--backend fla cannot run here: {reason}; use --backend torch (or auto) on this machine, "
            "or install the gpu extra (pip install 'hscache[gpu]') on a CUDA machine"
        )
    return requested


def _kernel_modules(model: torch.nn.Module) -> list[ModuleType]:
    """The modeling modules of the model and of its submodules (wrappers nest text models)."""
    names = {type(m).__module__ for m in model.modules()}
    return [sys.modules[n] for n in sorted(names) if n.startswith("transformers.models.")]


def _closure(fn: Callable) -> dict[str, Any]:
    try:
        return dict(inspect.getclosurevars(fn).nonlocals)
    except (TypeError, ValueError):
        return {}


def _describe(fn: Callable) -> tuple[str, str]:
    """(backend, qualified name) of the callable that a kernel slot will really invoke."""
    target = _closure(fn).get("implementation", fn)
    target = getattr(target, "_hscache_impl", target)
    module = getattr(target, "__module__", "") or ""
    qualname = f"{module}.{getattr(target, '__qualname__', repr(target))}"
    backend = "torch" if module.startswith("transformers.") else module.split(".")[0]
    return backend, qualname


def inspect_kernels(model: torch.nn.Module) -> dict[str, KernelBinding]:
    """Report, per kernel slot found in the model's modeling modules, what is bound now."""
    found: dict[str, KernelBinding] = {}
    for module in _kernel_modules(model):
        for name in (*_FLA_KERNELS, *_CONV_KERNELS):
            fn = getattr(module, name, None)
            if callable(fn):
                backend, qualname = _describe(fn)
                found[name] = KernelBinding(name=name, backend=backend, function=qualname)
    return found


def _with_filtered_kwargs(impl: Callable) -> Callable:
    """Call ``impl`` with only the keyword arguments it accepts, as transformers' wrapper does."""
    params = inspect.signature(impl).parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())

    @functools.wraps(impl)
    def call(*args: Any, **kwargs: Any) -> Any:
        if not takes_any:
            kwargs = {k: v for k, v in kwargs.items() if k in params}
        return impl(*args, **kwargs)

    call._hscache_impl = impl  # type: ignore[attr-defined]
    return call


def _torch_function(fn: Callable) -> Callable:
    return _closure(fn).get("torch_function") or getattr(fn, "__wrapped__", fn)


def _fla_function(path: str) -> Callable:
    module_path, func_name = path.rsplit(".", 1)
    return getattr(importlib.import_module(module_path), func_name)


@contextlib.contextmanager
def use_backend(model: torch.nn.Module, backend: str) -> Iterator[dict[str, KernelBinding]]:
    """Bind ``backend`` ("fla" or "torch") into the model's modeling modules while the block runs.

    Yields the bindings as inspected after rebinding; restores the originals on exit.
    """
    if backend not in ("fla", "torch"):
        raise InputError(f"backend {backend!r} must be resolved to 'fla' or 'torch' first")
    saved: list[tuple[ModuleType, str, Callable]] = []
    try:
        for module in _kernel_modules(model):
            for name, fla_path in _FLA_KERNELS.items():
                current = getattr(module, name, None)
                if not callable(current):
                    continue
                saved.append((module, name, current))
                impl = _fla_function(fla_path) if backend == "fla" else _torch_function(current)
                setattr(module, name, _with_filtered_kwargs(impl))
            if backend == "torch":
                for name in _CONV_KERNELS:
                    current = getattr(module, name, None)
                    if callable(current):
                        saved.append((module, name, current))
                        setattr(module, name, _with_filtered_kwargs(_torch_function(current)))
        yield inspect_kernels(model)
    finally:
        for module, name, original in reversed(saved):
            setattr(module, name, original)
