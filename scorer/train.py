"""A drafter of any family trained on a cache (``scorer init --train-steps N``): the family trains
(``Family.train``, scorer/families/), and ``eval_every`` watches it with ``scorer.evaluate_module``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from scorer.errors import ScorerError
from scorer.families import family_named
from scorer.studies.evaluate import evaluate_module

__all__ = ["train_drafter"]


def train_drafter(cache_path: str | Path, out: str | Path, *, family: str = "dflash", **options: Any) -> dict:
    """Train a drafter of ``family`` on the cache's sequences and save it at ``out`` (written whole:
    a non-empty ``out`` needs ``overwrite``). ``options``: ``steps``, ``seed``, ``overwrite``,
    ``on_step(step, loss)`` and the family's own (DFlash: ``num_layers``, ``block_size``, ``lr``,
    ``eval_every``, ``eval_limit``, ``on_eval(step, report)``, ... see
    scorer/families/dflash/train.py).

    Returns:
        The family's result: {"config", "steps", "final_loss", "seconds", ...} (DFlash adds
        "tau_history": [(step, pooled tau), ...]).

    Raises:
        ScorerError: the family has no trainer.
    """
    chosen = family_named(family)
    if chosen.train is None:
        raise ScorerError(f"--family {family}: {chosen.display_name} has no trainer in the scorer")
    if options.get("eval_every"):  # the family's trainer scores its module in memory with this
        options = {**options, "evaluate": evaluate_module}
    return chosen.train(cache_path, out, **options)
