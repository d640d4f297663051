"""The target in the loop: real speculative decoding, the target verifying every round.

``greedy`` decodes at temperature 0 (``scorer online``); ``sampled`` at temperature > 0, verifying
with the engines' rules of scorer/rules/ over many seeded runs (``scorer online --runs N``). It never
imports the offline replay (scorer/offline/).
"""

from typing import Any

# ``from scorer.online import OnlineConfig, run_online`` (the module scorer/online.py before it became
# this package, 2026-12-03, issue 32) keeps working for one release: the greedy loop's public names,
# imported on first use so that ``import scorer.online.sampled`` stays what it was.
_GREEDY_NAMES = frozenset(
    {
        "ONLINE_SCHEMA_VERSION",
        "OnlineConfig",
        "OnlineRequest",
        "OnlineSession",
        "commit_round",
        "eos_ids",
        "open_online",
        "request_row",
        "run_online",
        "speculative_decode",
        "tau_of_requests",
    }
)


def __getattr__(name: str) -> Any:
    if name in _GREEDY_NAMES:
        from scorer.online import greedy

        return getattr(greedy, name)
    raise AttributeError(f"module 'scorer.online' has no attribute {name!r}")
