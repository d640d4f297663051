"""``hscache diff COMPACT --exact-slice``: a compact cache's codec error per layer, measured on its
exact slice (the sequences it also keeps at the source dtype, hscache/store/compact.py).

Relative L2 per layer over the slice: ``sqrt(sum ||fp8 - exact||^2 / sum ||exact||^2)`` over every
token of every slice sequence, one sequence in memory at a time. Against its source cache instead
(every sequence), ``hscache diff SOURCE COMPACT`` reports the same per layer (``rel_l2``).
"""

from __future__ import annotations

import os
from typing import Any

from hscache.errors import InputError
from hscache.store.compact import exact_states
from hscache.store.open import open_cache

__all__ = ["exact_slice_error", "format_exact_slice_error"]


def exact_slice_error(path: str | os.PathLike) -> dict[str, Any]:
    """``{"cache", "codec", "sequences", "tokens", "layer_ids", "rel_l2"}`` of the compact cache at ``path``.

    Raises:
        InputError: the cache is not compact (no exact slice) or is a directory of shards.
        CacheNotFoundError, CacheFormatError: as ``open_cache``; the slice fails its checks.
    """
    cache = open_cache(path)
    states = cache.manifest.get("states")
    if getattr(cache, "shards", None) or not states:
        raise InputError(
            f"{path} is not a compact cache (no exact slice): --exact-slice measures a cache made with "
            "--states fp8; compare two caches with `hscache diff A B`"
        )
    err = ref = None
    tokens = 0
    for row in states["exact"]["rows"]:
        exact = exact_states(cache, row).float()
        fp8 = cache.hidden_states(row).float()
        e, r = (fp8 - exact).pow(2).sum(dim=(0, 2)), exact.pow(2).sum(dim=(0, 2))
        err, ref = (e, r) if err is None else (err + e, ref + r)
        tokens += len(exact)
    rel = [] if err is None else [float(x) for x in (err / ref.clamp_min(1e-30)).sqrt()]
    return {
        "cache": str(path),
        "codec": states["codec"],
        "sequences": len(states["exact"]["rows"]),
        "tokens": tokens,
        "layer_ids": list(cache.layer_ids),
        "rel_l2": rel,
    }


def format_exact_slice_error(result: dict[str, Any]) -> str:
    """The per-layer table ``hscache diff --exact-slice`` prints."""
    lines = [
        f"{result['cache']}: {result['codec']} states vs its exact slice ({result['sequences']} sequences, "
        f"{result['tokens']} tokens at the source dtype)",
        "layer  rel_l2",
    ]
    lines += [f"{layer:>5}  {rel:.2e}" for layer, rel in zip(result["layer_ids"], result["rel_l2"])]
    return "\n".join(lines)
