"""Drafter families on one seam (scorer.families.base): a registry and the dispatch.

The only module outside a family's folder that imports it (tests/test_architecture.py). Order
does not matter: exactly one family claims a checkpoint, or none and the fallback (DFlash) reads
it. A new family is its folder plus its row in FAMILIES.

Importing the registry imports no torch (tests/test_lazy_imports.py): each family's package is its
row in plain data with its functions bound lazily (scorer.families.base.lazy), so the command line
reads the families' flags (``Family.flags``) for ``--help`` without loading a model library.
"""

from __future__ import annotations

from scorer.errors import CheckpointError
from scorer.families.base import TARGET_PREFIX, CheckpointProbe, Family, probe_checkpoint, target_head_name
from scorer.families.dflash import DFLASH
from scorer.families.dflash2 import DFLASH2
from scorer.families.draft_model import DRAFT_MODEL
from scorer.families.dspark import DSPARK
from scorer.families.eagle3 import EAGLE3
from scorer.families.mtp import MTP
from scorer.families.ngram import NGRAM
from scorer.families.peagle import PEAGLE
from scorer.families.suffix import SUFFIX

__all__ = [
    "DEFAULT_FAMILY",
    "FAMILIES",
    "CheckpointProbe",
    "Family",
    "display_name",
    "family_for",
    "family_named",
    "probe_checkpoint",
]

FAMILIES: tuple[Family, ...] = (MTP, EAGLE3, DFLASH2, DSPARK, DFLASH, NGRAM, DRAFT_MODEL, PEAGLE, SUFFIX)
# The family made (scorer init, scorer.train_drafter) or read (scorer.evaluate_module) when none is named.
DEFAULT_FAMILY = DFLASH.name
# Heads that ship inside the target (CKPT "target:<name>") and the family that will read them;
# "mtp-prenorm" is the same head fed the last layer before the final norm (as speculators trains).
TARGET_HEADS = {"mtp": "mtp", "mtp-prenorm": "mtp"}
# speculators_model_type values some family reads; any other is refused by name, not guessed.
SPECULATORS_TYPES = ("dflash", "dspark", "eagle3", "peagle")


def family_named(name: str) -> Family:
    """The registered family called ``name``.

    Raises:
        CheckpointError: no family of that name in this build (one line naming the known ones).
    """
    for family in FAMILIES:
        if family.name == name:
            return family
    raise CheckpointError(
        f"drafter family {name!r} is not in this build of the scorer; known families: "
        f"{', '.join(f.name for f in FAMILIES)}"
    )


def display_name(name: str) -> str:
    """The family's name on screen ("EAGLE-3"); a name this build does not know, as written."""
    return next((f.display_name for f in FAMILIES if f.name == name), name)


def family_for(probe: CheckpointProbe) -> Family:
    """The family that reads the probed checkpoint.

    Raises:
        CheckpointError: ``target:<head>`` names an unknown head, or one whose family is not built.
    """
    head = target_head_name(probe.path)
    if head is not None:
        if head not in TARGET_HEADS:
            raise CheckpointError(
                f"{probe.path}: unknown target head {head!r}; the target heads a CKPT can name are "
                f"{', '.join(TARGET_PREFIX + h for h in TARGET_HEADS)}"
            )
        return family_named(TARGET_HEADS[head])
    kind = (probe.config or {}).get("speculators_model_type")
    if kind is not None and kind not in SPECULATORS_TYPES:
        raise CheckpointError(
            f"{probe.path}: speculators_model_type {kind!r} is not a drafter layout this scorer reads "
            f"(known: {', '.join(SPECULATORS_TYPES)})"
        )
    claimed = [f for f in FAMILIES if not f.fallback and f.claims(probe)]
    if len(claimed) > 1:  # two families' claims overlap: a bug in one of them, not in the file
        raise CheckpointError(
            f"{probe.path}: claimed by {' and '.join(f.name for f in claimed)}, whose claims overlap (a scorer bug: please report it)"
        )
    fallback = [f for f in FAMILIES if f.fallback and f.claims(probe)]
    if claimed or fallback:
        return (claimed or fallback)[0]
    raise CheckpointError(f"{probe.path}: no drafter family reads this checkpoint")  # pragma: no cover
