"""vLLM as an engine: runtime checks and settings (runtime.py), the CUDA-free hidden-states connector
(connector.py), its files (files.py) and ``hscache extract --engine vllm``'s capture (capture.py).

Importing this package imports neither torch nor vLLM.
"""
