"""Drafter families on one seam (scorer.families.base): a registry and the dispatch.

Order matters: the first family whose ``claims`` accepts a checkpoint reads it; DFlash, the
default, comes last. A family added later (MTP, DFlash2) registers here.
"""

from __future__ import annotations

from scorer.errors import CheckpointError
from scorer.families.base import TARGET_PREFIX, CheckpointProbe, Family, probe_checkpoint
from scorer.families.dflash import DFLASH
from scorer.families.eagle3 import EAGLE3

__all__ = ["FAMILIES", "CheckpointProbe", "Family", "family_for", "family_named", "probe_checkpoint"]

FAMILIES: tuple[Family, ...] = (EAGLE3, DFLASH)
# Heads that ship inside the target (CKPT "target:<name>") and the family that will read them.
TARGET_HEADS = {"mtp": "mtp"}
# speculators_model_type values some family reads; any other is refused by name, not guessed.
SPECULATORS_TYPES = ("dflash", "eagle3")


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


def family_for(probe: CheckpointProbe) -> Family:
    """The family that reads the probed checkpoint.

    Raises:
        CheckpointError: ``target:<head>`` names an unknown head, or one whose family is not built.
    """
    if probe.path.startswith(TARGET_PREFIX):
        head = probe.path[len(TARGET_PREFIX) :]
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
    for family in FAMILIES:
        if family.claims(probe):
            return family
    raise CheckpointError(f"{probe.path}: no drafter family reads this checkpoint")  # pragma: no cover
