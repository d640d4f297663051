"""Real serving engines driven from hscache: ``vllm/`` runs a target in vLLM."""
