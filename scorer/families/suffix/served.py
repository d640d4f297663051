"""How vLLM 0.32.0 serves suffix decoding (the family's ``VllmServing``, scorer.families.base).

- Its proposer keeps state across requests (the global tree of past responses), so what a request drafts
  depends on which requests ran before it. The judge serves this family's requests one at a time
  (``sequential_requests``: vLLM's ``max_num_seqs`` 1, FCFS in the cache's row order, each run in an engine
  of its own), which is what the offline replay models (propose.py: row r sees rows 0..r-1's responses).
- vLLM does not record a step where the proposer drafted nothing (as for n-gram), and whether it drafts
  depends on that state, so no function of the context alone can place those steps: the worker records
  the proposer's own drafts per request and step (``proposals_recorded``).
- Its settings are vLLM's ``suffix_decoding_*`` keys (the default num_speculative_tokens is the tree
  depth: vllm/config/speculative.py:1600-1609).
"""

from __future__ import annotations

from typing import Any

__all__ = ["settings"]


def settings(checkpoint: str, drafter: Any) -> dict[str, Any]:
    """The proposer's own ``speculative_config`` keys: vLLM's suffix decoding settings."""
    return {k: v for k, v in drafter.config.proposer.to_dict().items() if k != "num_speculative_tokens"}
