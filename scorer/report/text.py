"""Token ids as text a person can read: whole runs decoded, per-token pieces that never split a character.

A byte-level BPE token can hold part of a UTF-8 character; decoded alone it prints as U+FFFD.
``token_pieces`` decodes the run incrementally (as streaming detokenizers do): a token whose bytes
end mid-character gets an empty piece, and the token that completes the character gets all of it,
so the pieces concatenate to exactly the decoded run.

``readable`` quotes a piece for a terminal: what is not printable (control characters, and the
U+FFFD a tokenizer decodes invalid bytes to, e.g. a random tokenizer's lone bytes) is escaped,
so a table shows ``'\\ufffdD'`` rather than raw replacement glyphs or a cursor jump.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["readable", "token_pieces"]

_INCOMPLETE = "\ufffd"


def token_pieces(tokenizer: Any, ids: Sequence[int], context: Sequence[int] = ()) -> list[str]:
    """The text each token of ``ids`` adds after ``context`` (ids before them, for word boundaries)."""
    context = list(context)
    base = tokenizer.decode(context)
    emitted = len(base.rstrip(_INCOMPLETE)) if base.endswith(_INCOMPLETE) else len(base)
    pieces = []
    for j in range(len(ids)):
        text = tokenizer.decode(context + list(ids[: j + 1]))
        if text.endswith(_INCOMPLETE) and j + 1 < len(ids):
            pieces.append("")  # this token ends mid-character: the next one completes it
            continue
        pieces.append(text[emitted:])
        emitted = len(text)
    return pieces


def readable(text: str) -> str:
    """``text`` quoted as Python would (``repr``), with U+FFFD escaped too: ``repr`` keeps it (it is
    a printable symbol), but on screen it hides which bytes the tokenizer could not decode."""
    return repr(text).replace(_INCOMPLETE, "\\ufffd")
