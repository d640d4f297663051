"""A fresh drafter of any family sized for a cache's target, and a trained one: what ``scorer init``
writes. The family makes it (``Family.init`` / ``Family.train``, scorer/families/); these are the
Python entry points (a keyword the family's function does not take is a TypeError naming it;
``scorer init`` refuses a flag that does not apply to the family by name, from ``Family.init_options``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from scorer.errors import ScorerError
from scorer.families import family_named

__all__ = ["init_drafter"]


def init_drafter(cache_path: str | Path, out: str | Path, *, family: str = "dflash", **options: Any) -> Any:
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
