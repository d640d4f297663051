"""Stage two: replay drafters of any family (scorer.families) against a cache (any ``CacheView``): tau, acceptance, DDTree.

The Python API's entry points, imported on first use so that ``import scorer`` stays light:
``scorer.init_drafter`` / ``scorer.train_drafter`` (scorer/make.py: a drafter of any family made for a
cache) and ``scorer.evaluate_module(module, cache)`` (scorer/studies/evaluate.py: an in-memory drafter
scored, e.g. every N training steps, without writing a file).

Import paths that moved fail naming the new one (``MOVED``; docs/renames.sed rewrites such imports).
"""

import sys
from importlib import import_module
from typing import Any

__all__ = ["MOVED", "evaluate_module", "init_drafter", "train_drafter"]

_API = {
    "evaluate_module": "scorer.studies.evaluate",
    "init_drafter": "scorer.make",
    "train_drafter": "scorer.make",
}
# old import path -> the new one. A module here has no file: importing it fails with a
# ModuleNotFoundError naming its new path (``_Moved``); a name here is refused so by its package's
# ``__getattr__`` (scorer/online/__init__.py).
MOVED = {
    "scorer.evaluate": "scorer.studies.evaluate",
    "scorer.online_sampled": "scorer.online.sampled",
    "scorer.init": "scorer.make",  # init_drafter, also scorer.init_drafter
    "scorer.train": "scorer.make",  # train_drafter, also scorer.train_drafter
    **{
        f"scorer.online.{name}": f"scorer.online.greedy.{name}"
        for name in (
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
        )
    },  # fmt: skip
}


def moved_error(old: str) -> ModuleNotFoundError:
    """The one-line refusal of an old import path (``MOVED``), naming the new one (Python's own message
    first, as an import of a missing name reads)."""
    return ModuleNotFoundError(
        f"No module named {old!r}: it moved to {MOVED[old]} (docs/renames.sed rewrites such imports)",
        name=old,
    )


class _Moved:
    """A finder first on ``sys.meta_path``: it refuses a moved module by name (``MOVED``), even where a
    stale copy of it could still be found (an older editable install's tree), and passes on every other
    name (one dict lookup per import)."""

    @staticmethod
    def find_spec(fullname: str, path: Any = None, target: Any = None) -> None:
        if fullname in MOVED:
            raise moved_error(fullname)


if not any(isinstance(finder, _Moved) for finder in sys.meta_path):
    sys.meta_path.insert(0, _Moved())


def __getattr__(name: str) -> Any:
    if name in _API:
        return getattr(import_module(_API[name]), name)
    raise AttributeError(f"module 'scorer' has no attribute {name!r}")
