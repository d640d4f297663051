"""vLLM as an engine: the runtime checks and settings (runtime.py), the CPU patch of vLLM 0.32.0
(cpu_patch.py), the engine-side worker (worker.py, run in vLLM's interpreter) and the translation of
its outputs into what ``hscache extract --responses-from`` reads (outputs.py); for ``hscache extract
--engine vllm``: the CUDA-free hidden-states connector (connector.py), its files (files.py), the capture
(capture.py) and its worker in vLLM's interpreter (extract_worker.py).

Importing this package imports neither torch nor vLLM.
"""

from hscache.engines.vllm.runtime import (
    CPU_ATTENTION_HEAD_DIMS,
    CPU_GDN_HEAD_DIMS,
    TRANSCRIBED_VERSIONS,
    VllmError,
    VllmTargetError,
    VllmUnavailableError,
    VllmVersionError,
    VllmWorkerError,
    check_version,
    engine_env,
    engine_kwargs,
    interpreter_version,
    preflight_target,
    require_vllm,
    run_worker,
    vllm_python,
)

__all__ = [
    "CPU_ATTENTION_HEAD_DIMS",
    "CPU_GDN_HEAD_DIMS",
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
    "preflight_target",
    "require_vllm",
    "run_worker",
    "vllm_python",
]
