"""A drafter of any family made for a cache: a fresh one sized for its target (``init_drafter``) or one
trained on its sequences (``train_drafter``), what ``scorer init [--train-steps N]`` writes. The family
makes it (``Family.init`` / ``Family.train``, scorer/families/); these are the Python entry points,
exported as ``scorer.init_drafter`` and ``scorer.train_drafter``. A keyword the family's function does
not take is a TypeError naming it; ``scorer init`` refuses a flag that does not apply to the family by
name, from ``Family.init_options``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from scorer.errors import ScorerError
from scorer.families import DEFAULT_FAMILY, family_named

__all__ = ["init_drafter", "train_drafter"]


def init_drafter(
    cache_path: str | Path, out: str | Path, *, family: str = DEFAULT_FAMILY, **options: Any
) -> Any:
    """Write a randomly initialised drafter of ``family`` for the cache at ``cache_path`` to ``out``
    and return its config. ``options``: ``seed``, ``overwrite`` and the family's ``init_options``
    (DFlash: ``num_layers``, ``block_size``; EAGLE-3: ``layout``, ``num_layers``,
    ``num_speculative_tokens``; DFlash2: ``from_dir``, the DFlash drafter it starts from).

    Raises:
        ScorerError: the family writes no drafter (its head ships inside the target, or it has no
            weights).
    """
    chosen = family_named(family)
    if chosen.init is None:
        raise ScorerError(
            f"--family {family}: {chosen.display_name} has no weights of its own to write "
            "(score it directly: see docs/families.md)"
        )
    return chosen.init(cache_path, out, **options)


def train_drafter(
    cache_path: str | Path, out: str | Path, *, family: str = DEFAULT_FAMILY, **options: Any
) -> dict:
    """Train a drafter of ``family`` on the cache's sequences and save it at ``out`` (written whole:
    a non-empty ``out`` needs ``overwrite``). ``options``: ``steps``, ``seed``, ``overwrite``,
    ``on_step(step, loss)`` and the family's own (DFlash: ``num_layers``, ``block_size``, ``lr``,
    ``eval_every``, ``eval_limit``, ``on_eval(step, report)``, ... see
    scorer/families/dflash/train.py); ``eval_every`` watches it with ``scorer.evaluate_module``.

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
        from scorer.studies.evaluate import evaluate_module

        options = {**options, "evaluate": evaluate_module}
    return chosen.train(cache_path, out, **options)
