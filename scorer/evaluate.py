"""The old path of ``scorer.studies.evaluate`` (moved 2026-12-03, issue 32), kept for one release so
that ``from scorer.evaluate import EvalConfig, evaluate`` still works; ``docs/renames.sed`` rewrites such
imports. New code imports ``scorer.studies.evaluate``."""

from scorer.studies.evaluate import (
    EvalConfig,
    evaluate,
    evaluate_many,
    evaluate_module,
    load_drafter,
    score_cache,
)

__all__ = ["EvalConfig", "evaluate", "evaluate_many", "evaluate_module", "load_drafter", "score_cache"]
