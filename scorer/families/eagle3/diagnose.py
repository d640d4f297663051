"""``scorer diagnose`` for EAGLE-3 drafters: the conventions an EAGLE-3 trainer and server can
disagree on, each replayed on the same cached sequences (scorer/diagnose/ranking.py ranks them).

- ``layer_ids`` +-1: the aux layer ids (vLLM / speculators ``eagle_aux_hidden_state_layer_ids``
  count the embedding as hidden state 0, SGLang / SpecForge ids do not: the same +1 that separates
  the two conventions, spec/families.md);
- ``final_norm``: the last aux layer, when it is the target's last layer, read after the target's
  final norm (transformers' ``hidden_states[L]``) instead of vLLM's raw ``hidden_states + residual``;
- ``rope_theta``: the target's value and the common 1e4 / 1e6;
- ``position_offset`` +-1: the drafting steps j >= 1 placed at p-1+j+k instead of vLLM's p-1+j
  (step 0 keeps the target's positions; a shift of every position is invisible to RoPE);
- ``d2t``: a reduced draft vocabulary's map read as the identity (a missing ``d2t``) or its values
  read as target ids instead of offsets.

`Eagle3Setting` is one way to replay; `Eagle3Replayer` drafts every anchor of a row for all the
settings, sharing the features among settings with the same layers and norm, and step 0 among those
that also share the rope (the position and d2t hypotheses change only the later steps).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from hscache.store.dtypes import DTYPES
from scorer.diagnose.ranking import (
    DiagnosisInputs,
    FamilyDiagnosis,
    Hypothesis,
    final_norm_alternative,
    replay_anchor_drafts,
    shifted_layer_ids,
)
from scorer.families.eagle3 import EAGLE3_KINDS
from scorer.families.eagle3.config import Eagle3Config, vllm_aux_ids
from scorer.families.eagle3.drafting import draft_every_anchor
from scorer.families.eagle3.model import Eagle3Drafter
from scorer.offline.sequences import cache_final_norm, sequence_features

__all__ = ["EAGLE3_KINDS", "Eagle3Replayer", "Eagle3Setting", "candidates", "diagnose"]

COMMON_ROPE_THETAS = (10_000.0, 1_000_000.0)
POSITION_SHIFTS = (-1, 1)
LAYER_SHIFTS = (-1, 1)


@dataclass(frozen=True)
class Eagle3Setting:
    """How to replay: the drafter config plus what no config records. ``last_layer_normed``: the
    last aux layer read after the target's final norm; ``d2t``: "configured", "identity" (draft id
    = target id) or "absolute" (the stored d2t values taken as target ids)."""

    config: Eagle3Config
    step_position_offset: int = 0
    last_layer_normed: bool = False
    d2t: str = "configured"


def candidates(
    base: Eagle3Setting, cache: Any, maps: dict[str, torch.Tensor]
) -> Iterator[tuple[Hypothesis, Eagle3Setting | str]]:
    """Every EAGLE-3 hypothesis with its setting, or a sentence saying why it is untested here.

    Args:
        maps: the draft -> target maps the d2t hypotheses may use ("identity", "absolute"); a map
            absent here is untested (``d2t_maps`` says why).
    """
    c, replace = base.config, dataclasses.replace
    n_layers = cache.target_config.get("num_hidden_layers")
    last = None if n_layers is None else int(n_layers) - 1
    for k in POSITION_SHIFTS:
        hyp = Hypothesis("position_offset", k, f"drafting steps' positions shifted by {k:+d} (step 0 kept)")
        if c.num_speculative_tokens < 2:
            yield hyp, "one drafted token per round: no later step to place (pass --num-speculative-tokens 3)"
        else:
            yield hyp, replace(base, step_position_offset=base.step_position_offset + k)
    for k in LAYER_SHIFTS:
        ids = shifted_layer_ids(c.target_layer_ids, k, cache)
        shown = [i + k for i in c.target_layer_ids]
        hyp = Hypothesis(
            "layer_ids",
            k,
            f"aux layer ids shifted by {k:+d} (eagle_aux_hidden_state_layer_ids {vllm_aux_ids(shown)}; "
            f"layer outputs {shown})",
        )
        yield hyp, ids if isinstance(ids, str) else replace(base, config=replace(c, target_layer_ids=ids))
    if last is None or last not in c.target_layer_ids:
        hyp = Hypothesis("final_norm", None, "last aux layer before/after the target's final norm")
        yield hyp, f"the drafter does not read the target's last layer ({last})"
    else:
        hyp, alt = final_norm_alternative(base.last_layer_normed, cache, f"last aux layer ({last})")
        yield hyp, alt if isinstance(alt, str) else replace(base, last_layer_normed=alt)
    rope = cache.target_config.get("rope_parameters") or {}
    target = cache.target_config.get("rope_theta", rope.get("rope_theta"))
    for theta in sorted(
        {float(t) for t in (target, *COMMON_ROPE_THETAS) if t is not None} - {float(c.rope_theta)}
    ):
        label = f"rope_theta {theta:g}" + (
            " (the target's)" if target is not None and theta == float(target) else ""
        )
        yield Hypothesis("rope_theta", theta, label), replace(base, config=replace(c, rope_theta=theta))
    labels = {
        "identity": "d2t ignored: draft id = target id (what a missing d2t reads as)",
        "absolute": "d2t's values read as target ids, not offsets",
    }
    for name, label in labels.items():
        hyp = Hypothesis("d2t", name, label)
        yield hyp, replace(base, d2t=name) if isinstance(maps.get(name), torch.Tensor) else maps[name]


def d2t_maps(configured: torch.Tensor, vocab_size: int) -> dict[str, torch.Tensor | str]:
    """The alternative draft -> target maps of a drafter whose map is ``configured`` [Vd] target ids,
    or why one cannot be tested (it is the configured map, or not a valid map)."""
    identity = torch.arange(len(configured), device=configured.device)
    offsets = configured - identity  # what the checkpoint stored as d2t
    out: dict[str, torch.Tensor | str] = {}
    if torch.equal(configured, identity):
        why = "the draft vocabulary maps to target ids unchanged (no d2t, or d2t all zero): nothing to test"
        return {"identity": why, "absolute": why}
    out["identity"] = identity
    if int(offsets.min()) < 0 or int(offsets.max()) >= vocab_size:
        out["absolute"] = "d2t's values are not target ids (outside the vocabulary)"
    elif len(torch.unique(offsets)) < len(offsets):
        out["absolute"] = "d2t's values repeat: read as target ids they would not be a vocabulary"
    else:
        out["absolute"] = offsets
    return out


class Eagle3Replayer:
    """Drafts every anchor of the sampled rows under each setting (the batched path of ``scorer
    eval``, `draft_every_anchor`), features once per (layers, norm) and step 0 once per (layers,
    norm, rope) in a row; the settings' drafters share the loaded weights."""

    def __init__(self, drafter: Eagle3Drafter, inputs: DiagnosisInputs, maps: dict[str, Any]) -> None:
        self.loaded_drafter, self.caches, self.rows = drafter, inputs.caches, inputs.rows
        self.device, self.dtype = inputs.options.device, DTYPES[inputs.options.dtype]
        self.memory_gb = inputs.options.memory_gb
        self.weights = drafter.state_dict()
        self.maps = {"configured": drafter.draft_to_target, **maps}
        self.final_norm = cache_final_norm(inputs.caches[0])
        self._drafters: dict[int, Eagle3Drafter] = {}  # the settings of the replay under way

    def drafter(self, setting: Eagle3Setting) -> Eagle3Drafter:
        """The drafter of ``setting``: the loaded weights under its config, embedding and map attached."""
        drafter = Eagle3Drafter(setting.config)
        drafter.load_state_dict(self.weights, assign=True)
        drafter = drafter.to(device=self.device, dtype=self.dtype).eval()
        drafter.embed_weight = self.loaded_drafter.embed_weight
        drafter.draft_to_target = self.maps[setting.d2t].to(self.device)
        drafter.step_position_offset = setting.step_position_offset
        return drafter

    def features(self, setting: Eagle3Setting, cache: Any, row: int) -> torch.Tensor:
        ids = setting.config.target_layer_ids
        norm = None
        if setting.last_layer_normed:
            norm = (ids.index(int(cache.target_config["num_hidden_layers"]) - 1), self.final_norm)
        index = [cache.layer_ids.index(i) for i in ids]
        return sequence_features(cache.hidden_states(row), index, self.dtype, self.device, norm)

    def drafts_of_row(self, settings: Sequence[Eagle3Setting], cache: Any, row: int) -> list[np.ndarray]:
        token_ids = cache.token_ids(row)
        prompt_len = int(cache.index.column("prompt_len")[row].as_py())
        feats: dict[tuple, torch.Tensor] = {}
        step0: dict[tuple, tuple] = {}
        out = []
        for s in settings:
            drafter = self._drafters[id(s)]
            fkey = (s.config.target_layer_ids, s.last_layer_normed)
            if fkey not in feats:
                feats[fkey] = self.features(s, cache, row)
            skey = (fkey, s.config.rope_theta)
            shared = None
            if len(token_ids) - 1 - prompt_len > 0:
                if skey not in step0:
                    with torch.no_grad():
                        step0[skey] = drafter.step0(
                            feats[fkey], token_ids.to(self.device), len(token_ids) - 2
                        )
                shared = step0[skey]
            K = s.config.num_speculative_tokens
            out.append(
                draft_every_anchor(
                    drafter, feats[fkey], token_ids, prompt_len, K, memory_gb=self.memory_gb, step0=shared
                )
            )
        return out

    def replay_many(
        self, settings: Sequence[Eagle3Setting], positions: Sequence[int], *, anchors: str | None = None
    ) -> list:
        """Per setting, ``[len(positions), 2]`` (tokens, rounds) and the training-log accept length
        (every anchor is drafted whatever ``anchors`` says: the batched path drafts them all)."""
        self._drafters = {id(s): self.drafter(s) for s in settings}
        try:
            return replay_anchor_drafts(
                settings,
                self.caches,
                self.rows,
                list(positions),
                self.drafts_of_row,
                lambda s: s.config.block_size,
            )
        finally:
            self._drafters = {}


def diagnose(inputs: DiagnosisInputs) -> FamilyDiagnosis:
    """``Family.diagnose`` of EAGLE-3 (module docstring)."""
    drafter: Eagle3Drafter = inputs.drafter
    # The replay is vLLM's chain: a SpecForge-layout drafter that vLLM feeds other layers than it was
    # trained on (Eagle3Config.vllm_layer_ids) starts from them, so the +1 layer shift finds it.
    served = drafter.config.layer_ids_served_by("vllm")
    base = Eagle3Setting(
        config=dataclasses.replace(drafter.config, target_layer_ids=served, vllm_layer_ids=None)
    )
    maps = d2t_maps(drafter.draft_to_target.cpu(), drafter.config.vocab_size)
    replayer = Eagle3Replayer(drafter, inputs, {k: v for k, v in maps.items() if isinstance(v, torch.Tensor)})
    found = list(candidates(base, inputs.caches[0], maps))
    return FamilyDiagnosis(base, found, replayer.replay_many, replayer)
