"""Scoring one drafter on one cache: EvalConfig, the loader entry point (load_drafter) and the unit of
work shared by local and distributed eval (score the given rows of a cache).

`load_drafter` readies a checkpoint for a cache (config-less fields from the cache, checked against
it); `score_rows` replays the given sequences with the family's score_rows. `scorer.studies.evaluate` runs them in one
process, `scorer.studies.distributed` ships them to dask workers.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from hscache.capture.device import check_device
from hscache.capture.logit_rows import DEFAULT_MEMORY_GB
from hscache.store.dtypes import SCORER_DTYPES
from hscache.store.view import CacheView
from scorer.errors import IncompatibleCacheError, ScorerError
from scorer.families import Family, family_for, family_named, probe_checkpoint
from scorer.families.base import Drafter
from scorer.offline import sampled_view
from scorer.offline.sequences import ANCHOR_MODES, SequenceResult, check_scorable
from scorer.target_identity import cache_target_identity, check_target, recorded_target_identity

__all__ = ["EvalConfig", "drafter_family", "effective_config", "load_drafter", "score_rows", "served_rule"]


@dataclass(frozen=True)
class EvalConfig:
    """Everything ``scorer eval`` takes besides the checkpoint and caches; flags mirror the names."""

    device: str = "cpu"
    dtype: str = "fp32"
    block_size: int | None = None
    ddtree: tuple[int, ...] = (8, 32, 128)
    limit: int | None = None
    samples: int = 0
    seed: int = 0
    n_boot: int = 1000
    max_blocks_per_forward: int = 64
    anchors: str = "all"  # "chain": draft only where the chain / DDTree replays go (score.py)
    memory_gb: float = DEFAULT_MEMORY_GB  # [rows, V] logits working set beyond the weights
    trust_checkpoint: bool = False
    # Score a drafter whose recorded target differs from the cache's (scorer/target_identity.py).
    allow_target_mismatch: bool = False
    config_path: str | None = None  # a separate draft config (--config), e.g. SpecForge's
    overrides: dict[str, Any] = field(default_factory=dict)  # target_layer_ids, mask_token_id, rope_theta
    expect_digest: str | None = None  # refuse a cache whose root digest differs (hscache.cache_digest)
    allow_unsealed: bool = False  # read a cache without checksums (written before them)
    # Autoregressive families (EAGLE-3, MTP): chain of K drafted tokens (vLLM's
    # num_speculative_tokens) and SGLang's EAGLE tree (steps, topk, draft tokens); None = the
    # checkpoint's config or the engines' default, reported with its source.
    num_speculative_tokens: int | None = None
    tree: tuple[int, int, int] | None = None
    # Scoring at T > 0 (scorer/offline/sampled_view.py): vLLM's draft_sample_method, and the sampling flags given
    # on the command line (a preset and/or fields), checked against the cache's setting, never applied.
    draft_sampling: str = "greedy"
    sampling: dict[str, Any] = field(default_factory=dict)
    # vLLM's rejection_sample_method (scorer/rules/block_verify.py): "block" replays as "standard" with
    # greedy drafts (the same accepted counts given the text) and is refused with probabilistic ones.
    rejection_sample_method: str = "standard"
    # DFlash: read the last target layer raw, as vLLM 0.32.0 captures it (the residual stream after the
    # layer, never the final norm: vllm/model_executor/models/qwen2.py:420-434, interfaces.py:1601-1611),
    # not transformers' hidden_states[L] that z-lab checkpoints are trained on (features.context_norm).
    # The vLLM judge replays what vLLM served with it; False = the checkpoint's own convention.
    raw_last_layer: bool = False
    # On a greedy cache, the target's token for t+1: "argmax" (the cache's own logits) or "text" (the
    # text's own next token x[t+1]: the text after the prompt is a serving engine's greedy output, as in
    # scorer served's served cache, so that engine's decisions are the text; sampled_view.GREEDY_ON_TEXT_RULE).
    greedy_reference: str = "argmax"

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        # At their defaults they are left out: a greedy report and a sweep's result keys stay as before.
        if d["draft_sampling"] == "greedy":
            del d["draft_sampling"]
        if d["rejection_sample_method"] == "standard":
            del d["rejection_sample_method"]
        if not d["sampling"]:
            del d["sampling"]
        if not d["raw_last_layer"]:
            del d["raw_last_layer"]
        if d["greedy_reference"] == "argmax":
            del d["greedy_reference"]
        d["ddtree"] = list(self.ddtree)
        d["tree"] = None if self.tree is None else list(self.tree)
        d["overrides"] = {k: list(v) if isinstance(v, tuple) else v for k, v in self.overrides.items()}
        return d


def load_drafter(checkpoint: str | Path, cache: CacheView, config: EvalConfig) -> tuple[Any, Any]:
    """The loader entry point of every family: check the flags and the cache, pick the checkpoint's
    family (scorer.families), and let it load, check against ``cache`` and ready its drafter.

    ``checkpoint`` is a path, or ``target:<head>`` for a head shipped inside the cache's target.

    Raises:
        CheckpointError / UntrustedCheckpointError / IncompatibleCacheError with one-line messages.
    """
    if config.dtype not in SCORER_DTYPES:
        raise ScorerError(f"--dtype {config.dtype!r}; choose one of {', '.join(SCORER_DTYPES)}")
    if config.anchors not in ANCHOR_MODES:
        raise ScorerError(f"--anchors {config.anchors!r}; choose {' or '.join(ANCHOR_MODES)}")
    if not config.memory_gb > 0:
        raise ScorerError(f"--memory-gb {config.memory_gb}; pass a positive budget in GB, e.g. 2")
    if len(cache) == 0:
        # Every metric would be "-": say why instead of printing an empty report with exit 0.
        raise IncompatibleCacheError(
            f"cache {cache.path} has no committed sequences, so there is nothing to score; "
            f"see `hscache info {cache.path}` (an extraction still starting, or one that wrote nothing)"
        )
    check_device(config.device)
    check_scorable(cache, str(getattr(cache, "url", cache.path)))
    probe = probe_checkpoint(checkpoint, config.config_path)
    family = family_for(probe)
    sampled_view.check_request(cache, config, family, str(getattr(cache, "url", cache.path)))
    cache_identity = cache_target_identity(cache)
    # A target head (target:mtp) is the cache's own target: it matches by construction.
    bound = family.bound_to_target
    recorded = cache_identity if bound else recorded_target_identity(checkpoint, config.config_path)
    # Before the family's load and its shape and layer checks: a drafter of another target must
    # hear that, not "re-extract with --layers ..." (a re-extraction that ends in this refusal).
    target_check = check_target(
        recorded,
        cache_identity,
        allow_mismatch=config.allow_target_mismatch,
        where=str(getattr(cache, "url", cache.path)),
    )
    drafter, loaded = family.load(checkpoint, cache, config)
    drafter.target_check = target_check  # for the report (build.py)
    return drafter, loaded


def drafter_family(drafter: Drafter) -> Family:
    """The family of a loaded drafter (every family's drafter says its name: ``Drafter.family``)."""
    return family_named(drafter.family)


def effective_config(drafter: Any, config: EvalConfig) -> EvalConfig:
    """The eval config the drafter's family actually scores with (reported as ``config``)."""
    return sampled_view.effective_config(drafter_family(drafter).effective_config(config))


def served_rule(cache: CacheView, config: EvalConfig) -> sampled_view.ServedRule:
    """The rule ``cache`` is scored under with ``config`` (greedy, one-hot or probabilistic), chosen
    once at the top of a run and handed to ``score_rows`` and ``build_report``."""
    return sampled_view.served_rule(cache, config)


def score_rows(
    drafter: Any,
    cache: CacheView,
    rows: Sequence[int],
    config: EvalConfig,
    on_sequence: Callable[[SequenceResult], None] | None = None,
    rule: sampled_view.ServedRule | None = None,
) -> list[SequenceResult]:
    """Score the cache's sequences ``rows`` with the drafter's family (the distributed unit of work);
    ``on_sequence`` gets each result as it is done (progress). ``rule``: the rule the run chose once
    (``sampled_view.served_rule``; None: chosen here): a sampled cache is scored as served at its
    setting (scorer/offline/sampled_view.py)."""
    rule = sampled_view.served_rule(cache, config) if rule is None else rule
    job = sampled_view.RowsToScore(drafter_family(drafter), drafter, cache, rows, config, on_sequence)
    return rule.score(job)
