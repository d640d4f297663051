"""vLLM as an engine: the runtime checks and settings (runtime.py), the CPU patch of vLLM 0.32.0
(cpu_patch.py), the engine-side worker (worker.py, run in vLLM's interpreter) and the translation of
its outputs into what ``hscache extract --responses-from`` reads (outputs.py); for ``hscache extract
--engine vllm``: the CUDA-free hidden-states connector (connector.py), its files (files.py), the capture
(capture.py) and its worker in vLLM's interpreter (extract_worker.py).

Importing this package imports neither torch nor vLLM. Its names are imported from their modules
(``from hscache.engines.vllm.runtime import preflight_target``): the package re-exports none.
"""
