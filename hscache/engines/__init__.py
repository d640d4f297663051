"""Real serving engines driven from hscache: ``vllm/`` runs a target (and a drafter) in vLLM."""
