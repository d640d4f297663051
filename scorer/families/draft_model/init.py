"""``scorer init --family draft_model``: a draft LM made from the cache's own target by keeping its first
``--draft-layers N`` decoder layers (its embedding, final norm and head unchanged): an untrained
standalone draft model of the target's tokenizer that vLLM loads as written (``method: draft_model``).

It needs the target's full weights (the cache holds only its head): the cache's ``model`` (a built-in or a
local HF directory) is loaded and checked against the cache's recorded weights digest.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import hscache
from scorer.drafter_dir import check_drafter_dir, staged_drafter_dir
from scorer.errors import ScorerError

__all__ = ["WrittenDraftModel", "init_draft_model"]

DEFAULT_LAYERS = 2


@dataclass(frozen=True)
class WrittenDraftModel:
    """What ``scorer init --family draft_model`` wrote: the LM's config and a line saying so."""

    config: dict[str, Any]
    init_summary: str


def init_draft_model(
    cache_path: str | Path,
    out: str | Path,
    *,
    num_layers: int | None = None,
    overwrite: bool = False,
    seed: int = 0,
) -> WrittenDraftModel:
    """Write the first ``num_layers`` layers of the cache's target as an HF causal-LM directory.

    Returns:
        The written config (config.json's content) and the line ``scorer init`` prints.

    Raises:
        ScorerError: ``out`` exists (without ``overwrite``), the target cannot be loaded or is not the
            cache's, or ``num_layers`` is outside 1..the target's depth (one line each).
    """
    from hscache.capture.target import load_target
    from hscache.errors import HscacheError

    del seed  # nothing random: the layers are the target's
    check_drafter_dir(out, overwrite)
    cache = hscache.open_cache(cache_path)
    name = str(cache.settings.get("model"))
    try:
        target = load_target(name, dtype="fp32")
    except HscacheError as exc:
        raise ScorerError(
            f"the cache's target {name} cannot be loaded ({exc}); a draft model is cut from its weights"
        ) from exc
    if target.weights_sha256 != cache.settings.get("weights_sha256"):
        raise ScorerError(
            f"{name}'s weights are not the ones {cache.path} was extracted from (weights_sha256 differs): "
            "point the cache at its own target"
        )
    model = target.model
    depth = int(model.config.num_hidden_layers)
    layers = DEFAULT_LAYERS if num_layers is None else int(num_layers)
    if not 1 <= layers <= depth:
        raise ScorerError(f"--draft-layers {layers}: the target has {depth} layers; pass 1..{depth}")
    body = model.base_model
    body.layers = body.layers[:layers]
    model.config.num_hidden_layers = layers
    if getattr(model.config, "layer_types", None):
        model.config.layer_types = list(model.config.layer_types[:layers])
    with staged_drafter_dir(out, overwrite) as staging:  # published whole by one rename
        model.save_pretrained(str(staging))
        target.tokenizer.save_pretrained(str(staging))
    return WrittenDraftModel(
        model.config.to_dict(),
        f"a draft model of {name}'s first {layers} of {depth} layers (its embedding, final norm and head; "
        f"untrained; vLLM method draft_model, K set when served)",
    )
