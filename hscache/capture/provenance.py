"""Provenance: how a cache's rows were computed (provenance.json, schemas/provenance.schema.json),
and the record of one run that wrote them (runs.json, store/run_log.py).

provenance.json holds only what fixes the content (model, weights and tokenizer hashes, layers,
kernels, the capture settings, the prompts' hash): it is the same for every run that writes the
same rows, so it is inside the digest. What a run did (times, host, versions, command line, the paths
it read) goes into its ``run_record`` in the run log, outside the digest.
"""

from __future__ import annotations

import datetime as _dt
import functools
import hashlib
import importlib.metadata
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

from hscache.capture.backend import KernelBinding

__all__ = [
    "LAYER_CONVENTION",
    "SCHEMA_VERSION",
    "build_provenance",
    "git_commit",
    "model_path",
    "run_record",
    "package_versions",
    "utc_now",
]

SCHEMA_VERSION = 2  # 1: run facts (timestamps, versions, ...) in provenance.json itself
LAYER_CONVENTION = (
    "layer i = output of decoder layer i (0-based) = transformers hidden_states[i + 1], "
    "captured by a forward hook, before the final norm"
)
_VERSIONED = (
    "hscache",
    "torch",
    "transformers",
    "flash-linear-attention",
    "triton",
    "causal-conv1d",
    "zarr",
    "numcodecs",
    "pyarrow",
    "numpy",
    "safetensors",
    "tokenizers",
    "dask",
)


def utc_now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def package_versions() -> dict[str, str | None]:
    """Installed version of each package that can change what a cache holds (None: absent), read
    once per process (a fresh dict each call): the packages that run are those imported at start,
    and the metadata lookups cost ~20 ms a report."""
    return dict(_versions_read_once())


@functools.cache
def _versions_read_once() -> tuple[tuple[str, str | None], ...]:
    versions: dict[str, str | None] = {"python": platform.python_version()}
    for name in _VERSIONED:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    versions["cuda"] = torch.version.cuda
    return tuple(versions.items())


@functools.cache
def git_commit() -> str | None:
    """The hscache source commit when running from a git checkout, else None; asked of git once per
    process (a subprocess each time before): the code that runs is the code imported at start, even if
    the checkout moves on."""
    repo = Path(__file__).resolve().parents[1]
    if not (repo / ".git").exists():
        return None
    try:
        out = subprocess.run(
            ["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None


def tokenizer_sha256(tokenizer: Any) -> str:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    text = backend.to_str() if backend is not None else repr(sorted(tokenizer.get_vocab().items()))
    return hashlib.sha256(text.encode()).hexdigest()


def _hardware(device: str) -> dict[str, Any]:
    gpu = torch.cuda.get_device_name(0) if device.startswith("cuda") and torch.cuda.is_available() else None
    return {
        "device": device,
        "gpu_name": gpu,
        "cpu": platform.processor() or platform.machine(),
        "hostname": platform.node(),
    }


def build_provenance(
    *,
    target: Any,
    settings: dict[str, Any],
    kernels: dict[str, KernelBinding],
    num_records: int,
) -> dict[str, Any]:
    """The provenance document of one extraction: what fixes the cache's content, nothing a run did."""
    config = target.text_config
    return {
        "schema_version": SCHEMA_VERSION,
        "model": {
            "name": target.name,
            "weights_sha256": target.weights_sha256,
            "model_type": getattr(target.model.config, "model_type", "unknown"),
            "architecture": type(target.model).__name__,
            "layer_path": target.layer_path,
            "num_layers": target.num_layers,
            "hidden_size": int(config.hidden_size),
            "vocab_size": int(config.vocab_size),
            "layer_types": target.layer_types,
            "tokenizer_sha256": tokenizer_sha256(target.tokenizer),
            "mask_token_id": target.mask_token_id,
        },
        "capture": {
            "layer_ids": list(settings["layer_ids"]),
            "layer_convention": LAYER_CONVENTION,
            "dtype": settings["dtype"],
            "device": settings["device"],
            "backend_requested": settings["backend_requested"],
            "backend": settings["backend"],
            "kernels": {
                k: {"backend": b.backend, "function": b.function} for k, b in sorted(kernels.items())
            },
            "attn_implementation": str(getattr(target.model.config, "_attn_implementation", None)),
            "max_new_tokens": settings["max_new_tokens"],
            "max_length": settings["max_length"],
            "top_k": settings["top_k"],
            "full_logits": settings["full_logits"],
            "batch_tokens": settings["batch_tokens"],
            "generate_batch": settings["generate_batch"],
        },
        "prompts": {"sha256": settings["prompts_sha256"], "records": num_records},
    }


def run_record(
    *, command: str, device: str, sequences_at_start: int, inputs: dict[str, str | None]
) -> dict[str, Any]:
    """The run log entry (schemas/run_log.schema.json) of a run starting now; ``finished_at`` and
    ``sequences_at_finish`` are filled in when it finishes. ``inputs``: the paths it read, by name
    (``model``: a local directory, None for a built-in; ``prompts``: the prompts file or source)."""
    return {
        "command": command,
        "command_line": list(sys.argv),
        "started_at": utc_now(),
        "finished_at": None,
        "sequences_at_start": sequences_at_start,
        "sequences_at_finish": None,
        "hscache_git_commit": git_commit(),
        "versions": package_versions(),
        "hardware": _hardware(device),
        "inputs": inputs,
    }


def model_path(name: str) -> str | None:
    """The resolved directory of ``--model`` for the run log; None for a built-in target."""
    return None if name.startswith("builtin:") else str(Path(name).resolve())
