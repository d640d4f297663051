"""Small statistics the sampling tests share: a chi-square goodness-of-fit p-value, standard errors."""

from __future__ import annotations

import numpy as np
import torch


def chi_square_pvalue(counts: np.ndarray, probs: np.ndarray) -> float:
    """Upper-tail p-value of Pearson's chi-square of observed ``counts`` against ``probs``.

    Cells with expected count 0 must be empty (else the p-value is 0); df = non-empty cells - 1.
    The tail is the regularised upper incomplete gamma Q(df/2, X/2) (torch.special.gammaincc).
    """
    counts = np.asarray(counts, dtype=np.float64).reshape(-1)
    probs = np.asarray(probs, dtype=np.float64).reshape(-1)
    expected = probs * counts.sum()
    if (counts[expected == 0] > 0).any():
        return 0.0
    live = expected > 0
    stat = float((((counts - expected) ** 2)[live] / expected[live]).sum())
    df = int(live.sum()) - 1
    if df <= 0:
        return 1.0
    return float(
        torch.special.gammaincc(
            torch.tensor(df / 2, dtype=torch.float64), torch.tensor(stat / 2, dtype=torch.float64)
        )
    )


def mean_and_se(values: np.ndarray) -> tuple[float, float]:
    v = np.asarray(values, dtype=np.float64)
    return float(v.mean()), float(v.std(ddof=1) / np.sqrt(len(v)))
