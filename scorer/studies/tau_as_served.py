"""``tau_as_served``: one drafter, one sampled cache, one rule and mode -> tau as served offline.

The Python entry point of what ``scorer eval`` reports in its ``sampling`` block, with the
per-sequence E[rounds | y] kept, so that an online reference (``scorer online --temperature``) can be
set against it sequence by sequence or in the pooled mean (docs/sampling.md).

    >>> served = tau_as_served("drafter/", "t06/", rule="probabilistic")      # doctest: +SKIP
    >>> served.tau.tau, (served.tau.lo, served.tau.hi)                        # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import hscache
from hscache.store.sampling import SamplingSetting, sampling_setting
from scorer.errors import ScorerError
from scorer.offline.sampled_tau import SampledTau, sampled_tau
from scorer.offline.scoring import EvalConfig, effective_config, load_drafter
from scorer.rules.expectation import SequenceRounds
from scorer.studies.evaluate import score_cache

__all__ = ["RULES", "ServedSequence", "ServedTau", "tau_as_served"]

RULES = {"one-hot": "greedy", "probabilistic": "probabilistic"}  # rule -> --draft-sampling


@dataclass(frozen=True)
class ServedSequence:
    """One cached trajectory: its row, prompt (record id), sample index and E[rounds | y]."""

    row: int
    record_id: str
    sample: int
    rounds: SequenceRounds


@dataclass(frozen=True)
class ServedTau:
    """tau as served offline: the pooled tau with its interval over prompts, and every sequence."""

    rule: str
    mode: str
    setting: SamplingSetting
    tau: SampledTau
    sequences: tuple[ServedSequence, ...]


def tau_as_served(
    checkpoint: str | Path,
    cache: str | Path,
    *,
    rule: str = "one-hot",
    mode: str = "chain",
    config: EvalConfig | None = None,
) -> ServedTau:
    """Score ``checkpoint`` on the SAMPLED cache at ``cache`` under ``rule`` in ``mode``.

    Args:
        rule: "one-hot" (argmax drafts, every engine's default at T > 0) or "probabilistic"
            (drafts ~ softmax(logits / T), min(1, p/q); chains only).
        mode: "chain" (the drafter's chain or block), "ddtree-N" (a block drafter's DDTree with budget
            N) or "tree" (SGLang's EAGLE tree: pass ``config.tree``).
        config: everything else (device, dtype, limit, K, n_boot, seed...); its ``draft_sampling``
            is set from ``rule``.

    Raises:
        ScorerError: a greedy cache, an unknown rule or mode, and every refusal of ``scorer eval``.
    """
    if rule not in RULES:
        raise ScorerError(f"rule {rule!r}; choose {' or '.join(RULES)}")
    config = dataclasses.replace(config or EvalConfig(ddtree=()), draft_sampling=RULES[rule])
    if mode.startswith("ddtree-"):
        try:
            config = dataclasses.replace(config, ddtree=(int(mode[len("ddtree-") :]),))
        except ValueError:
            raise ScorerError(f"mode {mode!r}: DDTree modes are ddtree-N with N the node budget") from None
    elif mode == "tree" and config.tree is None:
        raise ScorerError("mode 'tree' scores SGLang's EAGLE tree: pass config.tree = (steps, topk, tokens)")
    elif mode not in ("chain", "tree"):
        raise ScorerError(f"mode {mode!r}; choose chain, ddtree-N or tree")
    view = hscache.open_cache(cache, allow_unsealed=config.allow_unsealed)
    setting = sampling_setting(view)
    if setting.greedy:
        raise ScorerError(
            f"{cache} is greedy (temperature 0): tau as served at T > 0 needs a cache sampled at the served "
            "setting (hscache extract --sampling PRESET or --temperature T ...); at T = 0 use scorer eval"
        )
    drafter, _ = load_drafter(checkpoint, view, config)
    used: Any = effective_config(drafter, config)
    results = score_cache(drafter, view, used)
    samples = (
        view.index.column("sample").to_pylist() if "sample" in view.index.column_names else [0] * len(view)
    )
    missing = [r.row for r in results if mode not in r.extras.get("served", {})]
    if missing:
        raise ScorerError(f"mode {mode!r} was not scored for this drafter (rows {missing[:3]}...)")
    sequences = tuple(
        ServedSequence(r.row, r.record_id, int(samples[r.row]), r.extras["served"][mode]) for r in results
    )
    tau = sampled_tau(
        [s.record_id for s in sequences], [s.rounds for s in sequences], n_boot=used.n_boot, seed=used.seed
    )
    return ServedTau(rule, mode, setting, tau, sequences)
