"""``hscache verify --deep`` on a sampled cache: the stored distributions agree with the drawn tokens.

A sampled cache stores, per row t, the processed distribution of token t + 1 (``sampled_support_ids``
/ ``sampled_support_probs``, -1 / 0 past the support) and the probability of the token drawn there
(``sampled_token_prob``: NaN where no token was drawn, i.e. the prompt's rows and the last row). Checked
per generated position, chunk-sized blocks at a time (memory: one block):

- the drawn token's stored probability is finite and equals its support entry, or 0 when the drawn
  token is outside the stored support (it can be: the generation and the teacher-forced forward may
  differ in the last bits, capture/sampling.py ``realised_counts``);
- the support is a distribution: its probabilities lie in [0, 1] and sum to 1 within
  ``MASS_TOLERANCE``; the entries past it are -1 / 0;
- rows where no token was drawn hold NaN (the intended NaN rows, which are not damage);
- the counts ``provenance.json`` records (drawn positions, those outside the support; what
  ``hscache info`` prints) are those of the data.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from hscache.store.layout import PROVENANCE, SAMPLED_ARRAYS
from hscache.verify.report import Problem, VerifyReport
from hscache.verify.structure import CacheLayout

__all__ = ["MASS_TOLERANCE", "check_sampling"]

# float32 probabilities of up to a few hundred entries sum to 1 within ~1e-6; a server's logprobs
# within the 1e-4 that --responses-from accepts.
MASS_TOLERANCE = 1e-3
_BLOCK_TOKENS = 1 << 16


def check_sampling(layout: CacheLayout, report: VerifyReport, provenance: dict[str, Any] | None) -> None:
    """Add a "sampling" problem per sequence whose stored distributions disagree with its tokens."""
    if not set(SAMPLED_ARRAYS) <= set(layout.arrays) or "token_ids" not in layout.arrays:
        return
    if layout.index is None or report.checks["index"] == "failed" or report.checks["chunks"] == "failed":
        return  # rows cannot be attributed, or cannot be read: named by those checks
    ids_a, probs_a, real_a = (layout.arrays[name] for name in SAMPLED_ARRAYS)
    tokens_a, committed = layout.arrays["token_ids"], layout.committed_tokens
    prompt_len = np.asarray(layout.index.column("prompt_len").to_numpy(), dtype=np.int64)
    first = layout.offsets + np.maximum(prompt_len, 1) - 1  # the first row whose next token was drawn
    last = layout.offsets + layout.lengths - 2  # the last such row
    ends = layout.offsets + layout.lengths
    found: dict[int, str] = {}
    positions = outside = 0
    for start in range(0, committed, _BLOCK_TOKENS):
        stop = min(start + _BLOCK_TOKENS, committed)
        rows = np.arange(start, stop)
        seq = np.searchsorted(ends, rows, side="right")
        drawn_here = (rows >= first[seq]) & (rows <= last[seq])
        tokens = np.asarray(tokens_a[start : min(stop + 1, committed)]).astype(np.int64)
        nxt = np.full(stop - start, -2, np.int64)
        nxt[: len(tokens) - 1] = tokens[1:]
        ids = np.asarray(ids_a[start:stop]).astype(np.int64)
        probs = np.asarray(probs_a[start:stop]).astype(np.float64)
        realised = np.asarray(real_a[start:stop]).astype(np.float64)
        in_support = ids >= 0
        match = ids == nxt[:, None]
        entry = np.where(match, probs, 0.0).sum(axis=1)
        inside = match.any(axis=1)
        mass = np.where(in_support, probs, 0.0).sum(axis=1)
        with np.errstate(invalid="ignore"):
            checks = (
                ("a drawn token's stored probability is not finite", drawn_here & ~np.isfinite(realised)),
                (
                    "the stored probability of the drawn token differs from its support entry",
                    drawn_here & np.isfinite(realised) & ~np.isclose(realised, entry, rtol=2e-4, atol=1e-7),
                ),
                (
                    "a support's probabilities do not sum to 1",
                    drawn_here & ~(np.abs(mass - 1) <= MASS_TOLERANCE),
                ),
                (
                    "a support holds a probability outside [0, 1], or an entry past it that is not -1 / 0",
                    drawn_here
                    & (
                        ~((probs >= 0) & (probs <= 1)).all(axis=1)
                        | ((ids < -1).any(axis=1))
                        | (~in_support & (probs != 0)).any(axis=1)
                    ),
                ),
                (
                    "a row where no token was drawn holds a probability (not NaN)",
                    ~drawn_here & ~np.isnan(realised),
                ),
            )
        for message, bad in checks:
            for s in np.unique(seq[bad]):
                found.setdefault(int(s), message)
        positions += int(drawn_here.sum())
        outside += int((drawn_here & ~inside).sum())
    for s, message in sorted(found.items()):
        report.add(
            layout.problem("sampling", f"{message} (sampled arrays vs token_ids)", s, array=SAMPLED_ARRAYS[2])
        )
    recorded = (provenance or {}).get("sampling") or {}
    if layout.manifest.get("complete") and recorded.get("sampled_positions") is not None:
        want = (recorded.get("sampled_positions"), recorded.get("realised_outside_support"))
        if want != (positions, outside):
            report.add(
                Problem(
                    "sampling",
                    f"{PROVENANCE} records {want[1]} of {want[0]} drawn tokens outside the stored support (what "
                    f"`hscache info` prints), but the data hold {outside} of {positions}",
                    array=SAMPLED_ARRAYS[2],
                )
            )
    report.passed("sampling")
