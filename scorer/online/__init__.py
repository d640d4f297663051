"""The target in the loop: real speculative decoding, the target verifying every round.

``greedy`` decodes at temperature 0 (``scorer online``); ``sampled`` at temperature > 0, verifying
with the engines' rules of scorer/rules/ over many seeded runs (``scorer online --runs N``). It never
imports the offline replay (scorer/offline/).
"""

from typing import Any


def __getattr__(name: str) -> Any:
    # The greedy loop's names were this package's while it was the module scorer/online.py (before
    # 2026-12-03, issue 32): refused naming scorer.online.greedy (scorer.MOVED), never re-exported.
    from scorer import MOVED, moved_error

    if f"scorer.online.{name}" in MOVED:
        raise moved_error(f"scorer.online.{name}")
    raise AttributeError(f"module 'scorer.online' has no attribute {name!r}")
