"""The ranges of a drafter config's numbers, one table for the CLI flags and every family's loader.

``--rope-theta 0`` is refused by the flag; the same ``rope_theta: 0`` in a drafter's config.json was
scored (tau 1.000, exit 0), as were NaN, ``rms_norm_eps: -1`` and ``block_size: 8.5`` (a TypeError
deep in scoring) (issue 52). Each number has one range here: scorer/cli/shared.py builds the flags'
click types from it (``flag_type``), and each family's config checks its fields with
``check_config_numbers`` when it is built, whatever the source (config.json, a pickle, an override).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["DRAFTER_NUMBERS", "NumberRange", "check_config_numbers"]


@dataclass(frozen=True)
class NumberRange:
    """An integer or finite float of at least ``minimum`` (above it with ``min_open``)."""

    integer: bool
    minimum: float
    min_open: bool = False

    def describe(self) -> str:
        kind = "an integer" if self.integer else "a finite number"
        return f"{kind} {'>' if self.min_open else '>='} {self.minimum:g}"

    def accepts(self, value: Any) -> bool:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return False
        if self.integer and not isinstance(value, int):
            return False
        if not math.isfinite(value):
            return False
        return value > self.minimum if self.min_open else value >= self.minimum


_POSITIVE_INT = NumberRange(integer=True, minimum=1)
# Field name -> range, as the CLI flag of the same name checks it (--rope-theta, --block-size,
# --mask-token-id); the shapes have no flag but the same rule: a positive integer.
DRAFTER_NUMBERS: dict[str, NumberRange] = {
    "rope_theta": NumberRange(integer=False, minimum=0, min_open=True),
    "rms_norm_eps": NumberRange(integer=False, minimum=0, min_open=True),
    "block_size": NumberRange(integer=True, minimum=2),
    "mask_token_id": NumberRange(integer=True, minimum=0),
    "hidden_size": _POSITIVE_INT,
    "intermediate_size": _POSITIVE_INT,
    "num_hidden_layers": _POSITIVE_INT,
    "num_attention_heads": _POSITIVE_INT,
    "num_key_value_heads": _POSITIVE_INT,
    "head_dim": _POSITIVE_INT,
    "vocab_size": _POSITIVE_INT,
    "draft_vocab_size": _POSITIVE_INT,
    "num_target_layers": _POSITIVE_INT,
    "num_speculative_tokens": _POSITIVE_INT,
}


def check_config_numbers(fields: Mapping[str, Any], where: str) -> None:
    """Every field of ``fields`` that ``DRAFTER_NUMBERS`` names is in its range (None: not set).

    Raises:
        ValueError: naming ``where``, the field, its value and the range (one line).
    """
    for name, value in fields.items():
        wanted = DRAFTER_NUMBERS.get(name)
        if wanted is not None and value is not None and not wanted.accepts(value):
            flag = (
                f" (as --{name.replace('_', '-')} is)"
                if name in ("rope_theta", "block_size", "mask_token_id")
                else ""
            )
            raise ValueError(f"{where}: {name} {repr(value)[:40]} must be {wanted.describe()}{flag}")
