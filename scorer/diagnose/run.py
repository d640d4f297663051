"""``scorer diagnose``: replay a drafter as configured, then once per hypothesis, and rank them.

Named steps: load the drafter like ``scorer eval`` (same warnings) -> order the cache's sequences
(a seeded permutation) -> measure the second cache's drift, if any -> the family's ``diagnose``
hook (scorer.families.base.Family) lists its hypotheses and gives the replayer -> replay the
baseline and every hypothesis on the first ``DEFAULT_SAMPLE`` (or ``limit``) of them, sharing the
drafter passes the family can share -> rank (scorer/diagnose/ranking.py) ->
without ``limit``, grow the sample to what the observed variance says separates
``RESOLUTION`` tau (at most ``MAX_SAMPLE``), replaying only the new sequences, and rank again ->
the training-metric gap, ablation notes -> the JSON-ready report
(``schemas/diagnose_report.schema.json``).

On a SAMPLED cache (extracted at T > 0) every replay runs on ``scorer.offline.sampled_view.SampledView``: drafts
along the cached sampled trajectory, matched against the cached sampled tokens (the one-hot rule
every engine serves by default), and the report's ``sampling`` block says so.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch

import hscache
from hscache import schemas
from hscache.capture.provenance import utc_now
from hscache.store.integrity import cache_digest
from hscache.store.sampling import sampling_setting
from hscache.store.view import CacheView
from scorer.diagnose.ranking import (
    DEFAULT_ALPHA,
    DEFAULT_SAMPLE,
    MAX_SAMPLE,
    RESOLUTION,
    DiagnosisInputs,
    Outcome,
    rank_outcomes,
    verdict,
)
from scorer.errors import IncompatibleCacheError, ScorerError
from scorer.families import FAMILIES, family_for, probe_checkpoint
from scorer.metrics import AcceptLen
from scorer.offline.sampled_view import RULE_DEFINITIONS, is_sampled, served_rule
from scorer.offline.scoring import EvalConfig, load_drafter
from scorer.offline.sequences import check_fits, check_scorable, layer_fit_problem

__all__ = ["DIAGNOSE_SCHEMA_VERSION", "DiagnoseConfig", "Plan", "diagnose_checkpoint", "prepare_diagnosis"]

DIAGNOSE_SCHEMA_VERSION = 3


@dataclass(frozen=True)
class DiagnoseConfig:
    """What ``scorer diagnose`` takes besides the checkpoint and caches; flags mirror the names."""

    device: str = "cpu"
    dtype: str = "fp32"
    block_size: int | None = None
    limit: int | None = (
        None  # sequences sampled (default: DEFAULT_SAMPLE, grown to what separates RESOLUTION)
    )
    seed: int = 0
    n_boot: int = 1000
    alpha: float = DEFAULT_ALPHA
    train_metric: float | None = None
    max_blocks_per_forward: int = 64
    memory_gb: float = 2.0
    # "all": every anchor drafted once per distinct drafter input, shared by the hypotheses;
    # "chain": only where each replay goes, one small forward per round (families/dflash/diagnose.py)
    anchors: str = "all"
    num_speculative_tokens: int | None = None  # chain families (EAGLE-3, MTP): K drafted per round
    trust_checkpoint: bool = False
    config_path: str | None = None
    overrides: dict[str, Any] = field(default_factory=dict)

    def eval_config(self) -> EvalConfig:
        return EvalConfig(
            device=self.device,
            dtype=self.dtype,
            block_size=self.block_size,
            num_speculative_tokens=self.num_speculative_tokens,
            ddtree=(),
            anchors="all",  # for the loader only: the replays take ``anchors`` (chain families refuse "chain")
            memory_gb=self.memory_gb,
            max_blocks_per_forward=self.max_blocks_per_forward,
            trust_checkpoint=self.trust_checkpoint,
            config_path=self.config_path,
            overrides=self.overrides,
        )

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["overrides"] = {k: list(v) if isinstance(v, tuple) else v for k, v in self.overrides.items()}
        return d


def sample_order(cache: CacheView, seed: int) -> list[int]:
    """Every row with a generated region (T-1 > P) in a seeded order: a sample of n is the first
    n, so a sample that grows keeps the sequences it has replayed."""
    lengths = cache.index.column("length").to_numpy()
    prompts = cache.index.column("prompt_len").to_numpy()
    eligible = np.flatnonzero(lengths - 1 - prompts > 0)
    if len(eligible) == 0:
        raise IncompatibleCacheError(
            f"{cache.path}: no sequence has a generated region to draft on (every length - 1 <= prompt_len)"
        )
    return [int(r) for r in np.random.default_rng(seed).permutation(eligible)]


def _align(cache: CacheView, other: CacheView, rows: list[int]) -> tuple[list[int], list[int]]:
    """The sampled rows whose record id ``other`` also holds with a generated region, and their
    rows in ``other`` (a request without rounds cannot enter a paired bootstrap)."""
    ids = [cache.index.column("record_id")[r].as_py() for r in rows]
    hits = np.flatnonzero(pc.is_in(other.index.column("record_id"), value_set=pa.array(ids)).to_numpy())
    where = {other.index.column("record_id")[int(r)].as_py(): int(r) for r in hits}
    lengths, prompts = other.index.column("length"), other.index.column("prompt_len")
    kept = [
        (r, where[i])
        for r, i in zip(rows, ids)
        if i in where and lengths[where[i]].as_py() - 1 - prompts[where[i]].as_py() > 0  # has a round
    ]
    return [a for a, _ in kept], [b for _, b in kept]


def measure_drift(
    cache: CacheView, other: CacheView, rows: Sequence[int], rows2: Sequence[int], layer_ids: Sequence[int]
) -> dict[int, float]:
    """Relative L2 ``||h2 - h1|| / ||h1||`` per target layer over the paired rows (fp32), over each
    pair's common token prefix: where two greedy continuations part, their states are not the same
    positions' any more, and that is divergence, not numerical drift."""
    num = dict.fromkeys(layer_ids, 0.0)
    den = dict.fromkeys(layer_ids, 0.0)
    for r1, r2 in zip(rows, rows2):
        x1, x2 = cache.token_ids(r1), other.token_ids(r2)
        n = min(len(x1), len(x2))
        differ = torch.nonzero(x1[:n] != x2[:n])
        n = int(differ[0]) if len(differ) else n
        a, b = cache.hidden_states(r1)[:n].float(), other.hidden_states(r2)[:n].float()
        for layer in layer_ids:
            x, y = a[:, cache.layer_ids.index(layer)], b[:, other.layer_ids.index(layer)]
            num[layer] += float((y - x).pow(2).sum())
            den[layer] += float(x.pow(2).sum())
    return {layer: (num[layer] / den[layer]) ** 0.5 if den[layer] else 0.0 for layer in layer_ids}


def _ablation_notes(rows: list[dict], base_tau: float, last_layer: int | None) -> list[str]:
    drops = sorted(((-r["gain"], r["value"]) for r in rows if r["kind"] == "feature_ablation"), reverse=True)
    if not drops or base_tau <= 1:
        return []
    notes = []
    (top, layer), rest = drops[0], drops[1:]
    second = rest[0][0] if rest else 0.0
    if top > 0.5 * (base_tau - 1) and top > 2 * max(second, 0.0):
        notes.append(
            f"the drafter leans on target layer {layer}: replacing it by its mean costs {top:.2f} of "
            f"tau {base_tau:.2f} (the next largest cost: {second:.2f})"
        )
        if layer == last_layer:
            notes.append(
                f"layer {layer} is the target's last layer, the one its output head (and a distillation "
                "loss) reads: a drafter that copies it takes a shortcut that tau on other data may not reward"
            )
    return notes


@dataclass
class Plan:
    """Everything a diagnosis replays, before any replay: the drafter as configured (``base``),
    the tested hypotheses with their settings, the untested ones, and the ordered sequences;
    ``replay_many`` and ``replayer`` are the family's (scorer.diagnose.ranking.FamilyDiagnosis)."""

    family: str
    kinds: tuple[str, ...]
    loaded: Any
    cache: CacheView
    second: str | None
    replay_many: Callable[..., list[tuple[np.ndarray, AcceptLen | None]]]
    replayer: Any
    base: Any
    hypotheses: list
    settings: list
    untested: list[Outcome]
    available: int  # sequences with a generated region (in both caches with two)
    first: int  # the first sample: --limit, else DEFAULT_SAMPLE (at most ``available``)
    drift: dict[int, float] | None
    last_layer: int | None
    sampling: dict[str, Any]
    notes: list[str]


def _sampling_block(cache: CacheView) -> dict[str, Any]:
    """How the replays match drafts: the one-hot rule along a sampled cache's trajectory, or the
    target's argmax on a greedy cache (the report's ``sampling``)."""
    setting = sampling_setting(cache)
    rule = served_rule(cache, None).name  # diagnose replays drafts as served: the one-hot rule
    return {
        "setting": setting.to_dict(),
        "described": setting.describe(),
        "rule": rule,
        "definition": RULE_DEFINITIONS[rule]
        if rule in RULE_DEFINITIONS
        else "drafts are the drafter's argmax along the cached greedy path; a round accepts the longest "
        "prefix of drafts equal to the target's argmax, plus one token",
    }


def prepare_diagnosis(
    checkpoint: str | Path, cache_paths: Sequence[str | Path], config: DiagnoseConfig = DiagnoseConfig()
) -> Plan:
    """Load the drafter like ``scorer eval``, order the sequences, measure the drift, and let the
    drafter's family list its hypotheses (bench/diagnose.py times replays of this plan's settings).

    Raises:
        ScorerError subclasses with one-line messages (bad checkpoint, incompatible cache, flags).
    """
    if not 1 <= len(cache_paths) <= 2:
        raise ScorerError(
            f"diagnose takes one --cache, or two to test the drift between them; got {len(cache_paths)}"
        )
    cache = hscache.open_cache(cache_paths[0])
    eval_config = config.eval_config()
    family = family_for(probe_checkpoint(checkpoint, eval_config.config_path))
    if family.diagnose is None:
        known = ", ".join(f.name for f in FAMILIES if f.diagnose is not None)
        raise ScorerError(
            f"{checkpoint} is a {family.name} drafter; scorer diagnose tests the hypotheses of {known} "
            "drafters so far: score it with scorer eval / scorer compare"
        )
    second = str(cache_paths[1]) if len(cache_paths) == 2 else None
    if second is not None and "dtype" not in family.diagnose_kinds:
        raise ScorerError(
            f"a second --cache tests the drift between two caches, a hypothesis {family.name} drafters do not "
            "declare; diagnose it on one --cache"
        )
    drafter, loaded = load_drafter(checkpoint, cache, eval_config)
    layer_ids = list(drafter.config.target_layer_ids)
    n_layers = cache.target_config.get("num_hidden_layers")
    last_layer = None if n_layers is None else n_layers - 1
    order = sample_order(cache, config.seed)
    caches, row_sets, drift = [cache], [order], None
    first = min(config.limit or DEFAULT_SAMPLE, len(order))
    if second is not None:
        other = hscache.open_cache(second)
        check_scorable(other, second)
        if is_sampled(cache) or is_sampled(other):
            raise IncompatibleCacheError(
                f"the drift comparison pairs the two caches' sequences by record id over their common token "
                f"prefix, and {second if is_sampled(other) else cache_paths[0]} was sampled "
                f"({sampling_setting(other if is_sampled(other) else cache).describe()}): its trajectories part "
                "from the other cache's at the first sampled token; measure drift between greedy caches"
            )
        check_fits([p for p in [layer_fit_problem(layer_ids, other, second)] if p])
        order, order2 = _align(cache, other, order)
        if not order:
            raise IncompatibleCacheError(
                f"{second} holds none of the sampled records of {cache_paths[0]}; the drift comparison "
                "needs the same record ids in both caches"
            )
        first = min(first, len(order))
        # measured on the first sample: the drift-noise hypothesis needs it before any replay
        drift = measure_drift(cache, other, order[:first], order2[:first], layer_ids)
        caches, row_sets = [cache, other], [order, order2]
    # A sampled cache is replayed along its sampled trajectory: target_argmax is the next token.
    views = [served_rule(c, None).view(c) for c in caches]
    diagnosis = family.diagnose(
        DiagnosisInputs(
            checkpoint=str(checkpoint),
            drafter=drafter,
            loaded=loaded,
            caches=views,
            rows=row_sets,
            options=config,
            second_cache=second,
            drift=tuple(sorted(drift.items())) if drift else (),
        )
    )
    del drafter
    hypotheses, untested, settings = [], [], []
    for hyp, setting in diagnosis.candidates:
        if isinstance(setting, str):
            untested.append(Outcome(hyp, untested=setting))
        else:
            hypotheses.append(hyp)
            settings.append(setting)
    return Plan(
        family.name, family.diagnose_kinds, loaded, cache, second, diagnosis.replay_many, diagnosis.replayer,
        diagnosis.base, hypotheses, settings, untested, len(order), first, drift, last_layer,
        _sampling_block(cache), list(diagnosis.notes),
    )  # fmt: skip


def diagnose_checkpoint(
    checkpoint: str | Path,
    cache_paths: Sequence[str | Path],
    config: DiagnoseConfig = DiagnoseConfig(),
    on_hypothesis: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Diagnose ``checkpoint`` on the first cache (the second, if given, for the drift hypothesis).

    Raises:
        ScorerError subclasses with one-line messages (bad checkpoint, incompatible cache, flags).
    """
    t0 = time.perf_counter()
    plan = prepare_diagnosis(checkpoint, cache_paths, config)
    family, kinds, loaded, cache, second, drift = (
        plan.family, plan.kinds, plan.loaded, plan.cache, plan.second, plan.drift
    )  # fmt: skip
    replay_many, base, hypotheses, settings, untested = (
        plan.replay_many, plan.base, plan.hypotheses, plan.settings, plan.untested
    )  # fmt: skip
    available, first, notes = plan.available, plan.first, list(plan.notes)
    per_prompt = sampling_setting(cache).samples_per_prompt
    if per_prompt > 1:
        notes.append(
            f"the cache holds {per_prompt} sampled trajectories per prompt; the intervals resample trajectories, "
            "not prompts (scorer eval's sampled tau resamples prompts), so with correlated trajectories they "
            "are somewhat narrower than by prompt"
        )
    replayed = [(np.zeros((0, 2), dtype=np.int64), None) for _ in range(len(settings) + 1)]
    # the configured value of each kind the config states under the kind's own name (DFlash:
    # mask_token_id, block_size), for a verdict that names it ("the configured mask token id 0")
    stated = getattr(base, "config", None)
    configured = {
        k: getattr(stated, k) for k in kinds if isinstance(getattr(stated, k, None), (int, float, str))
    }

    def replay(upto: int) -> dict[str, Any]:
        done = len(replayed[0][0])
        if on_hypothesis:
            on_hypothesis(f"{upto - done} sequences x {len(settings) + 1} settings (baseline + hypotheses)")
        new = replay_many([base, *settings], range(done, upto))
        for j, (totals, accept) in enumerate(new):
            old_totals, old_accept = replayed[j]
            both = accept if old_accept is None or accept is None else old_accept + accept
            replayed[j] = (np.concatenate([old_totals, totals]), both)
        outcomes = [Outcome(h, totals=t) for h, (t, _) in zip(hypotheses, replayed[1:])] + untested
        return rank_outcomes(
            replayed[0][0],
            outcomes,
            n_boot=config.n_boot,
            seed=config.seed,
            alpha=config.alpha,
            resolution=RESOLUTION,
            available=available,
            configured=configured,
        )

    ranked = replay(first)
    if config.limit is None:  # grow to the sample the first one's variance asks for
        grown = min(ranked["sample_needed"], available, MAX_SAMPLE)
        if grown > first:
            ranked = replay(grown)
    n_replayed = ranked["baseline"]["n_requests"]
    notes += _ablation_notes(ranked["hypotheses"], ranked["baseline"]["tau_pooled"], plan.last_layer)
    report = {
        "schema_version": DIAGNOSE_SCHEMA_VERSION,
        "family": family,
        "kinds": list(kinds),
        **ranked,
        "verdict": verdict(ranked),
        "sample": {
            "sequences": n_replayed,
            "of": len(cache),
            "first": first,
            "needed": ranked["sample_needed"],
            "limit": config.limit,
            "seed": config.seed,
            "default": DEFAULT_SAMPLE,
            "max": MAX_SAMPLE,
            "resolution": RESOLUTION,
            "anchors": config.anchors,
        },
        "drift": _drift_block(second, drift, ranked["hypotheses"]),
        "sampling": plan.sampling,
        "train_metric": None,
        "notes": notes,
        "warnings": list(loaded.report.warnings),
        "config": config.to_dict(),
        "checkpoint": loaded.report.to_dict(),
        "cache": {
            "path": str(getattr(cache, "url", cache.path)),
            "digest": cache_digest(cache),
            "sequences": len(cache),
            "layer_ids": cache.layer_ids,
        },
        "seconds": 0.0,
        "created_at": utc_now(),
    }
    if config.train_metric is not None:
        accept = [a for _, a in replayed]
        if accept[0] is None:  # chain anchors draft only where the replay went: every anchor now
            accept = [a for _, a in replay_many([base, *settings], range(n_replayed), anchors="all")]
        pairs = list(zip(hypotheses, accept[1:]))
        report["train_metric"] = _train_metric_block(config.train_metric, accept[0], ranked, pairs)
    report["seconds"] = time.perf_counter() - t0
    schemas.validate(report, "diagnose_report")
    return report


def _drift_block(second: str | None, drift: dict[int, float] | None, rows: list[dict]) -> dict | None:
    if second is None or drift is None:
        return None
    by_value = {r["value"]: r for r in rows if r["kind"] == "dtype"}
    cache_row, noise_row = by_value.get(f"cache:{second}"), by_value.get("drift-noise")
    explained = None
    if cache_row and noise_row and abs(cache_row["gain"]) > 1e-12:
        explained = noise_row["gain"] / cache_row["gain"]
    return {
        "cache": second,
        "per_layer_rel_l2": {str(k): v for k, v in drift.items()},
        "tau_delta": None if cache_row is None else {"delta": cache_row["gain"], "ci": cache_row["ci"]},
        "noise_tau_delta": None if noise_row is None else {"delta": noise_row["gain"], "ci": noise_row["ci"]},
        "explained_fraction": explained,
    }


def _train_metric_block(metric: float, base: AcceptLen, ranked: dict, pairs: list) -> dict[str, Any]:
    """The dashboard's accept length set against the same metric (every anchor) on this cache,
    as configured and under the best fix: read off the drafts the replay already made."""
    best = ranked["finding"] or next((r for r in ranked["hypotheses"] if r["fix"]), None)
    base_len = base.mean
    best_len = base_len
    if best is not None:
        best_len = next(a for h, a in pairs if h.kind == best["kind"] and h.value == best["value"]).mean
    return {
        "value": metric,
        "definition": "training-log accept length: leading correct slots over every anchor, no +1",
        "train_accept_len": base_len,
        "best_kind": None if best is None else best["kind"],
        "best_value": None if best is None else best["value"],
        "train_accept_len_best": best_len,
        "gap": None if base_len is None else metric - base_len,
        "gap_after_best": None if best_len is None else metric - best_len,
    }
