"""DSpark as a drafter family: DFlash's layouts with DSpark's config keys and heads.

A checkpoint is DSpark when its architecture names DSpark (vLLM's ``Qwen3DSparkModel``, speculators'
``DSparkSpeculator``, SpecForge's ``DSparkDraftModel``), its speculators_model_type is ``dspark``, its
config sets a Markov key, or its weights hold the Markov or confidence head. The DFlash loader reads
everything else (scorer.families.dflash, ``CheckpointVariant``); the drafts of every anchor are the Markov
walk (scorer/families/dspark/model.py), replayed by the shared loop. This module holds the functions of
the family's row (scorer/families/dspark/__init__.py binds them lazily).

Which layout vLLM serves (``sample_from_anchor``): vLLM reads the config's top-level key, True when
absent (v1/worker/gpu/spec_decode/dspark/speculator.py:49-51) for the dense layout; a speculators config
without it is read as False (transformers_utils/configs/speculators/algos.py:186-188). Scored as served.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from scorer.errors import CheckpointError
from scorer.families.base import CheckpointProbe, OnlineOptions, Proposer
from scorer.families.dflash import seam as dflash
from scorer.families.dflash.checkpoint import (
    CheckpointVariant,
    LoadedCheckpoint,
    variant_tensor_problems,
)
from scorer.families.dspark.model import DSparkConfig, DSparkDrafter

__all__ = [
    "ADAPTIVE",
    "VARIANT",
    "build_dspark",
    "claims",
    "cost",
    "effective_config",
    "init",
    "load",
    "online",
    "score_rows",
    "summarize",
]

VARIANT = CheckpointVariant(
    config_keys=(
        "markov_rank",
        "markov_head_type",
        "enable_confidence_head",
        "confidence_head_with_markov",
        "sample_from_anchor",
        "dspark_bonus_anchor",
        "dspark_draft_topk",
        "draft_vocab_size",
        "projector_type",
        "confidence_head_alpha",
    ),
    architectures=("Qwen3DSparkModel", "DSparkSpeculator", "DSparkDraftModel"),
    tensor_markers=("markov_head.", "confidence_head."),
    speculators_type="dspark",
)
_MARKER_KEYS = ("markov_rank", "markov_head_type", "enable_confidence_head")


def claims(probe: CheckpointProbe) -> bool:
    config = probe.config or {}
    archs = config.get("architectures") or []
    nested = config.get("dflash_config") or {}
    keys = probe.weight_keys or frozenset()
    return (
        any(a in VARIANT.architectures for a in archs)
        or config.get("speculators_model_type") == "dspark"
        or any(k in config or k in nested for k in _MARKER_KEYS)
        or any(m in k for k in keys for m in VARIANT.tensor_markers)
    )


def _flag(loaded: LoadedCheckpoint, key: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise CheckpointError(f"{loaded.report.path}: {key} {value!r} must be true or false")
    return value


def dspark_config(loaded: LoadedCheckpoint) -> DSparkConfig:
    """DSpark's settings from a checkpoint read with VARIANT, on its DFlash config.

    Raises:
        CheckpointError: a setting of the wrong kind, a Markov head vLLM 0.32.0 does not serve, or a
            top-k outside the draft vocabulary (each named).
    """
    found, path = loaded.variant_config, loaded.report.path
    head_type = found.get("markov_head_type", "vanilla")
    if head_type != "vanilla":
        raise CheckpointError(
            f"{path}: markov_head_type {head_type!r}: vLLM 0.32.0 serves the vanilla Markov head only "
            "(model_executor/models/qwen3_dspark.py:48-93 has no gate or recurrence), so its drafts cannot "
            "be replayed as served; train a vanilla head"
        )
    rank = found.get("markov_rank")
    if rank is None:
        w1 = loaded.variant_state.get("markov_head.markov_w1.weight")
        rank = None if w1 is None else int(w1.shape[1])
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise CheckpointError(
            f"{path}: markov_rank {rank!r}: a DSpark drafter needs a positive Markov rank (0 is DFlash: "
            "score it as one)"
        )
    c = loaded.config
    w2 = loaded.variant_state.get("markov_head.markov_w2.weight")
    draft_vocab = int(found.get("draft_vocab_size") or (w2.shape[0] if w2 is not None else c.vocab_size))
    anchor = found.get("sample_from_anchor")
    if anchor is None:  # the module docstring: what vLLM reads when the key is absent
        anchor = loaded.report.layout != "speculators"
    anchor = _flag(loaded, "sample_from_anchor", anchor)
    if (
        "dspark_bonus_anchor" in found
        and _flag(loaded, "dspark_bonus_anchor", found["dspark_bonus_anchor"]) == anchor
    ):
        raise CheckpointError(
            f"{path}: dspark_bonus_anchor {found['dspark_bonus_anchor']} and sample_from_anchor {anchor} "
            "disagree (vLLM writes one as the other's negation, speculators/algos.py:187-188)"
        )
    topk = found.get("dspark_draft_topk")
    if topk is not None and (
        not isinstance(topk, int) or isinstance(topk, bool) or not 1 <= topk <= draft_vocab
    ):
        raise CheckpointError(
            f"{path}: dspark_draft_topk {topk!r} must be between 1 and the draft vocabulary ({draft_vocab}) "
            "(vllm/config/speculative.py:1520-1529)"
        )
    block = c.block_size
    if anchor and loaded.report.field_sources.get("block_size") != "override":
        block += 1  # the anchor layout drafts its whole query block: N drafts, the seam's block N + 1
    return DSparkConfig(
        dataclasses.replace(c, block_size=block),
        markov_rank=rank,
        draft_vocab_size=draft_vocab,
        enable_confidence_head=_flag(
            loaded, "enable_confidence_head", found.get("enable_confidence_head", False)
        ),
        confidence_head_with_markov=_flag(
            loaded, "confidence_head_with_markov", found.get("confidence_head_with_markov", False)
        ),
        sample_from_anchor=anchor,
        dspark_draft_topk=topk,
    )


def build_dspark(loaded: LoadedCheckpoint) -> DSparkDrafter:
    """The DSpark drafter of a checkpoint read with VARIANT: backbone, Markov head, confidence head.

    vLLM drops a confidence head the config does not enable, and enables none the weights lack
    (qwen3_dspark.py:366-368): so does this.

    Raises:
        CheckpointError: tensors that do not fit the config (missing, unknown or misshapen, each named).
    """
    config = dspark_config(loaded)
    got = dict(loaded.variant_state)
    if not any(k.startswith("confidence_head.") for k in got):
        config = dataclasses.replace(config, enable_confidence_head=False)
    if not config.enable_confidence_head:
        got = {k: v for k, v in got.items() if not k.startswith("confidence_head.")}
    drafter = DSparkDrafter(config)
    want = {k: v for k, v in drafter.state_dict().items() if any(m in k for m in VARIANT.tensor_markers)}
    if problems := variant_tensor_problems(want, got):
        raise CheckpointError(
            f"{loaded.report.path}: not a DSpark drafter of this config: {'; '.join(problems)}"
        )
    drafter.load_state_dict({**loaded.state_dict, **got})
    return drafter


# The family's flag (Family.flags): vLLM's enable_adaptive_verification replayed (adaptive.py), its value
# a round's fixed cost in verified tokens (the cost model vLLM profiles on its own machine).
ADAPTIVE = "adaptive_verification"


def _adaptive(config: Any) -> tuple[Any, float | None]:
    """``config`` without the adaptive flag (DFlash's loader reads overrides as config fields), and its value."""
    overrides = dict(getattr(config, "overrides", {}) or {})
    cost = overrides.pop(ADAPTIVE, None)
    return dataclasses.replace(config, overrides=overrides), cost


def load(checkpoint: str | Path, cache: Any, config: Any) -> tuple[DSparkDrafter, LoadedCheckpoint]:
    """DFlash's loader with DSpark's variant; ``--adaptive-verification`` checked against the drafter.

    Raises:
        CheckpointError: adaptive verification asked of a drafter without a confidence head (vLLM then
            sizes budgets with its online acceptance estimator, v1/worker/gpu/spec_decode/
            acceptance_estimator.py, which is not transcribed) or with probabilistic drafts.
    """
    config, cost = _adaptive(config)
    drafter, loaded = dflash.load(checkpoint, cache, config, variant=VARIANT, build=build_dspark)
    if cost is not None and drafter.confidence_head is None:
        raise CheckpointError(
            f"{checkpoint}: --adaptive-verification needs the drafter's confidence head, and this one has none "
            "(vLLM then sizes the budget with its online acceptance estimator, v1/worker/gpu/spec_decode/"
            "acceptance_estimator.py, which the scorer does not replay); drop the flag"
        )
    if cost is not None and getattr(config, "draft_sampling", "greedy") == "probabilistic":
        raise CheckpointError(
            "--adaptive-verification replays greedy drafts (the budget cuts the leading match); with "
            "--draft-sampling probabilistic drop one of them"
        )
    return drafter, loaded


def score_rows(
    drafter: DSparkDrafter, cache: Any, rows: Any, config: Any, on_sequence: Any = None
) -> list[Any]:
    """DFlash's scoring of the Markov walk's drafts; with ``--adaptive-verification C`` the chain replays
    vLLM's confidence-sized budget per round instead (adaptive.py: each round verifies the budget the
    previous round's confidences give, accepting at most that many), the budgets in the results' extras."""
    config, cost = _adaptive(config)
    if cost is None:
        return dflash.score_rows(drafter, cache, rows, config, on_sequence)
    from scorer.families.dspark.adaptive_replay import adaptive_results

    results = adaptive_results(drafter, cache, dflash.score_rows(drafter, cache, rows, config), config, cost)
    if on_sequence:
        for result in results:
            on_sequence(result)
    return results


def summarize(results: list[Any]) -> dict[str, dict[str, Any]]:
    """Under ``--adaptive-verification``: the drafts vLLM's budget verified per round, on average."""
    budgets = [b for r in results for b in r.extras.get("adaptive_budgets", ())]
    if not budgets:
        return {}
    return {
        "adaptive_budget": {
            "label": "drafts verified per round (adaptive verification)",
            "value": sum(budgets) / len(budgets),
            "definition": "mean over rounds of the verify budget vLLM's adaptive verification chose from the "
            "previous round's confidences (scorer/families/dspark/adaptive.py)",
        }
    }


def online(checkpoint: str | Path, target: Any, options: OnlineOptions) -> tuple[list[int], Proposer, Any]:
    if ADAPTIVE in options.overrides:
        raise CheckpointError(
            "--adaptive-verification: scorer online verifies every draft; the confidence-sized budget is "
            "replayed offline (scorer eval), where vLLM's rounds are"
        )
    return dflash.online(checkpoint, target, options, variant=VARIANT, build=build_dspark)


def effective_config(config: Any) -> Any:
    # vLLM serves the Markov walk; DDTree is built from per-slot marginals alone and would score
    # another drafter, so it is not run (the report's config says so).
    return dataclasses.replace(config, ddtree=())


def cost(drafter: DSparkDrafter, tau: float, context: float) -> dict[str, Any]:
    """DFlash's round (its block of block_size - 1 + first_draft_slot query rows) plus the Markov walk:
    one rank-r embedding and one [r -> Vd] projection per drafted slot (the whole draft vocabulary, or
    the top-k candidates), and the confidence head's dot product per slot."""
    out = dflash.cost(drafter, tau, context)
    c = drafter.config
    columns = c.dspark_draft_topk or c.draft_vocab_size
    per_slot = 2.0 * c.markov_rank * columns
    if drafter.confidence_head is not None:
        per_slot += 2.0 * drafter.confidence_head.proj.weight.numel()
    out["flops_per_round"] += per_slot * c.num_draft_tokens
    return out


def init(cache_path: str | Path, out: str | Path, **options: Any) -> DSparkConfig:
    """``scorer init --family dspark``: a random DSpark drafter for the cache (init.py ``init_dspark``, its
    options), its config."""
    from scorer.families.dspark.init import init_dspark

    return init_dspark(cache_path, out, **options)


def train(
    cache_path: str | Path,
    out: str | Path,
    *,
    on_step: Any = None,
    on_eval: Any = None,
    evaluate: Any = None,
    markov_rank: int = 32,
    **settings: Any,
) -> dict[str, Any]:
    """``scorer init --family dspark --train-steps N``: DFlash's CPU trainer (scorer/families/dflash/train.py)
    on a DSpark drafter in the anchor layout: the drafts' cross-entropy with the Markov bias of each
    slot's teacher-forced predecessor, plus the confidence head's BCE (model.py); saved in the dense
    layout vLLM reads (init.py)."""
    from scorer.families.dflash.train import DFlashTrainConfig, train_dflash
    from scorer.families.dspark.init import dspark_config_from, save_dspark

    if on_step is not None:
        settings.setdefault("log_every", 0)

    def save(staging: Path, drafter: Any, extra: dict[str, Any]) -> None:
        save_dspark(staging, drafter.config, drafter, extra)

    return train_dflash(
        cache_path,
        out,
        DFlashTrainConfig(**settings),
        on_step=on_step,
        on_eval=on_eval,
        evaluate=evaluate,
        make=lambda base: DSparkDrafter(dspark_config_from(base, markov_rank)),
        save=save,
    )
