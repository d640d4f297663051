"""Stage two: replay drafters of any family (scorer.families) against a cache (any ``CacheView``): tau, acceptance, DDTree.

``scorer.evaluate_module(module, cache)`` scores an in-memory drafter (e.g. every N training
steps) without writing a file; it is imported on first use, so ``import scorer`` stays light.
"""

from typing import Any

__all__ = ["evaluate_module"]


def __getattr__(name: str) -> Any:
    if name == "evaluate_module":
        from scorer.studies.evaluate import evaluate_module

        return evaluate_module
    raise AttributeError(f"module 'scorer' has no attribute {name!r}")
