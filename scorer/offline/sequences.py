"""A cached sequence as every drafter family scores it (the shared layer under scorer/families/).

One definition each of what the families had copied: the per-sequence result (`SequenceResult`),
the per-row loop (`score_each`: a cache's rows -> one family's per-sequence scoring -> results,
with progress; `score_rows_with`: a family's ``score_rows`` from its per-sequence scoring alone), the result's parts of a family drafting a chain at every anchor (`chain_parts`,
`result_from_parts`), the cache
checks (`check_scorable`, `fit_problems`) and the drafter's features in its layer order
(`sequence_features`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from hscache.errors import HscacheError
from hscache.store.view import CacheView
from scorer.errors import IncompatibleCacheError
from scorer.metrics import AcceptanceCounts, AcceptLen, acceptance_counts, train_accept_len
from scorer.offline.replay import RoundLog, replay_chain

__all__ = [
    "ANCHOR_MODES",
    "CachedSequence",
    "ContextNorm",
    "OnSequence",
    "SequenceResult",
    "SequenceScorer",
    "cache_final_norm",
    "category_of",
    "cached_sequences",
    "chain_parts",
    "check_fits",
    "check_has_target",
    "check_scorable",
    "fit_problems",
    "layer_fit_problem",
    "result_from_parts",
    "result_summary",
    "score_each",
    "score_rows_with",
    "sequence_features",
]

# "all": draft at every anchor; "chain": only where the chain / DDTree replays go (DFlash's score).
ANCHOR_MODES = ("all", "chain")

# (slot in the drafter's K order, the target's final norm): turns the cached pre-norm output of
# the last target layer into transformers' hidden_states[L], what z-lab/SpecForge drafters read.
ContextNorm = tuple[int, Callable[[torch.Tensor], torch.Tensor]]


def cache_final_norm(cache: CacheView) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """The target's final norm as the cache saved it (``target/head``: kind, weight, eps), or None
    when the cache saved none (an older hscache, or a norm it could not identify)."""
    from functools import partial

    from hscache.capture.final_norm import KINDS, apply_final_norm

    head = cache.target_head()
    if "final_norm.weight" not in head:
        return None
    kind = KINDS[int(head["final_norm.kind"][0])]
    return partial(apply_final_norm, kind, head["final_norm.weight"], float(head["final_norm.eps"][0]))


@dataclass
class SequenceResult:
    """Everything the report needs from one sequence; small and picklable (dask ships it)."""

    row: int
    record_id: str
    category: str | None
    chain: RoundLog
    ddtree: dict[int, RoundLog]
    ddtree_surrogate: dict[int, tuple[float, int]]  # budget -> (sum over visited trees, trees)
    acceptance: AcceptanceCounts | None  # None with anchors="chain": it needs every anchor
    accept_len: AcceptLen | None
    chain_drafts: np.ndarray = field(repr=False)  # [rounds, B-1] the drafts of visited anchors
    drafted_anchors: int = 0  # blocks the drafter ran for this sequence
    # Family-specific numbers that add across sequences (e.g. EAGLE-3's teacher-forced counts).
    extras: dict[str, Any] = field(default_factory=dict)


def result_summary(result: SequenceResult) -> dict[str, Any]:
    """Per-request line of the report."""
    return {
        "row": result.row,
        "record_id": result.record_id,
        "category": result.category,
        "rounds": result.chain.n_rounds,
        "tokens": result.chain.n_tokens,
        "tau": result.chain.tau,
        "rounds_cut_off_greedy": result.chain.n_cut_off_greedy,
        "off_greedy_positions": result.chain.off_greedy_positions,
        "ddtree_tau": {str(b): log.tau for b, log in result.ddtree.items()},
    }


def category_of(cache: CacheView, row: int) -> str | None:
    """The index's ``category`` of ``row`` (None when the cache has no categories)."""
    if "category" not in cache.index.column_names:
        return None
    value = cache.index.column("category")[row].as_py()
    return None if value is None else str(value)


@dataclass(frozen=True)
class CachedSequence:
    """One row of a cache, as a family's per-sequence scoring sees it (arrays read on access)."""

    cache: CacheView
    row: int
    record_id: str
    prompt_len: int
    category: str | None

    def hidden_states(self) -> torch.Tensor:
        return self.cache.hidden_states(self.row)

    def token_ids(self) -> torch.Tensor:
        return self.cache.token_ids(self.row)

    def target_argmax(self) -> torch.Tensor:
        return self.cache.target_argmax(self.row)


def cached_sequences(cache: CacheView, rows: Sequence[int]) -> list[CachedSequence]:
    """The rows' index fields, read per row (a cache may index millions of sequences)."""
    record_ids, prompt_lens = (cache.index.column(c) for c in ("record_id", "prompt_len"))
    for row in rows:  # the reader keeps prompt_len in 0..length; a draft needs one prompt token before it
        if prompt_lens[row].as_py() < 1:
            raise IncompatibleCacheError(
                f"sequence {row} (record {record_ids[row].as_py()!r}) has prompt_len 0: scoring drafts the tokens "
                "after a prompt of at least one token; leave it out (--limit) or re-extract it"
            )
    return [
        CachedSequence(cache, row, record_ids[row].as_py(), prompt_lens[row].as_py(), category_of(cache, row))
        for row in rows
    ]


# (drafter, cache, eval config) -> how one of the cache's sequences is scored: what a family writes
# when it scores its sequences one at a time (`score_rows_with`); built once per call, so the layer
# index and dtype are looked up once for all the rows.
SequenceScorer = Callable[[Any, CacheView, Any], Callable[[CachedSequence], SequenceResult]]
OnSequence = Callable[[SequenceResult], None]


def score_each(
    cache: CacheView,
    rows: Sequence[int],
    score: Callable[[CachedSequence], SequenceResult],
    on_sequence: OnSequence | None = None,
) -> list[SequenceResult]:
    """The per-row loop of every family: ``score`` each of the cache's ``rows`` in order;
    ``on_sequence`` gets each result as it is done (progress)."""
    results = []
    for sequence in cached_sequences(cache, rows):
        results.append(score(sequence))
        if on_sequence:
            on_sequence(results[-1])
    return results


def score_rows_with(sequence_scorer: SequenceScorer) -> Callable[..., list[SequenceResult]]:
    """A family's ``score_rows`` (drafter, cache, rows, eval config, on_sequence) -> results, from
    how it scores one sequence: the per-row loop is `score_each`'s, the docstring the scorer's."""

    def score_rows(
        drafter: Any,
        cache: CacheView,
        rows: Sequence[int],
        config: Any,
        on_sequence: OnSequence | None = None,
    ) -> list[SequenceResult]:
        return score_each(cache, rows, sequence_scorer(drafter, cache, config), on_sequence)

    score_rows.__doc__ = sequence_scorer.__doc__
    return score_rows


def chain_parts(draft: np.ndarray, x: np.ndarray, a: np.ndarray, prompt_len: int) -> tuple:
    """The parts of the result of a family that drafts a chain of K at every anchor (``draft``
    [anchors, K]): the shared chain replay, acceptance over every anchor, no DDTree."""
    chain = replay_chain(draft, x, a, prompt_len, draft.shape[1] + 1)
    visited = np.asarray([p - prompt_len for p in chain.anchors], dtype=np.int64)
    chain_drafts = draft[visited] if len(visited) else np.zeros((0, draft.shape[1]), dtype=np.int64)
    return (
        chain,
        {},
        {},
        chain_drafts,
        acceptance_counts(draft, x, a, prompt_len),
        train_accept_len(draft, x, a, prompt_len),
        len(draft),
    )


def result_from_parts(
    row: int, record_id: str, category: str | None, parts: tuple, extras: dict[str, Any] | None = None
) -> SequenceResult:
    """A SequenceResult from the 7 parts every scoring path produces (chain, DDTree logs, DDTree
    surrogates, chain drafts, acceptance, accept_len, drafted anchors) and the family's extras."""
    chain, ddtree, surrogate, chain_drafts, acceptance, accept_len, drafted = parts
    return SequenceResult(
        row=row,
        record_id=record_id,
        category=category,
        chain=chain,
        ddtree=ddtree,
        ddtree_surrogate=surrogate,
        acceptance=acceptance,
        accept_len=accept_len,
        chain_drafts=chain_drafts,
        drafted_anchors=drafted,
        extras=extras or {},
    )


def check_scorable(cache: Any, cache_name: str = "the cache") -> None:
    """Raise one IncompatibleCacheError when ``cache`` lacks what scoring needs: the target's greedy
    tokens (``target_argmax``) and its head (``target/``). Caches imported from the peers' formats
    (``hscache import``) have neither: those files store no target logits or head."""
    imported = (cache.provenance or {}).get("imported") or {}
    origin = f" (imported from {imported['format']} files at {imported['source']})" if imported else ""
    if "target_argmax" not in cache.specs:
        raise IncompatibleCacheError(
            f"{cache_name}{origin} holds no target_argmax, and tau and acceptance compare the drafter's "
            "tokens with the target's greedy tokens: that format stores no target logits, so nothing can "
            "be scored; import speculators files with --target MODEL (computes them from their last layer) "
            "or score on a cache made by `hscache extract`"
        )
    try:
        _ = cache.vocab_size  # reads target/head.safetensors's header (sharded: the first shard's)
    except OSError as exc:
        raise IncompatibleCacheError(
            f"{cache_name}{origin} has no target/head.safetensors (the target's embedding and output "
            "head the drafter uses); score on a cache made by `hscache extract`"
        ) from exc


def check_has_target(cache: Any, cache_name: str = "the cache", *, need_argmax: bool = False) -> None:
    """Raise one IncompatibleCacheError when ``cache`` lacks ``target/`` (the target's config, which
    sizes a new drafter, and its head): an import without ``--target``. ``need_argmax``: training
    that learns the target's greedy tokens needs ``target_argmax`` too."""
    imported = (cache.provenance or {}).get("imported") or {}
    fmt = imported.get("format", "FORMAT")
    origin = f" (imported from {fmt} files at {imported['source']})" if imported else ""
    fix = (
        f"import the files again with `hscache import --format {fmt} --target MODEL` (the model that "
        "produced them), or use a cache made by `hscache extract`"
    )
    try:
        _ = cache.target_config, cache.vocab_size  # target/config.json; target/head.safetensors's header
    except (OSError, HscacheError) as exc:
        # the reader says a file it cannot read as a CacheFormatError caused by the OSError: only a
        # missing file is "no target/"; anything else (a damaged file) is said as the reader says it
        if not isinstance(exc, FileNotFoundError) and not isinstance(exc.__cause__, FileNotFoundError):
            raise
        raise IncompatibleCacheError(
            f"{cache_name}{origin} has no target/ (the target's config and head, which a drafter is "
            f"sized from and reads); {fix}"
        ) from None
    if need_argmax and "target_argmax" not in cache.specs:
        raise IncompatibleCacheError(
            f"{cache_name}{origin} holds no target_argmax (the target's greedy tokens the drafter learns); {fix}"
        )


def layer_fit_problem(
    wanted: Sequence[int], cache: CacheView, cache_name: str = "the cache", what: str = "target_layer_ids"
) -> str | None:
    """What is wrong with a drafter reading layers ``wanted`` from ``cache``, or None when it fits.

    A layer the target does not have cannot be re-extracted: that is said (the drafter's layer ids
    are wrong, or it is for another target) instead of advising ``--layers`` with it; a layer the
    cache lacks gets the ``--layers`` to re-extract with (the cache's and the drafter's, so the new
    cache still serves what this one did).
    """
    wanted = [int(i) for i in wanted]
    missing = [i for i in wanted if i not in cache.layer_ids]
    if not missing:
        return None
    n_layers = int((cache.target_config or {}).get("num_hidden_layers") or 0)
    beyond = [i for i in missing if i < 0 or (n_layers and i >= n_layers)]
    if beyond:
        return (
            f"drafter {what} {wanted} include {beyond}, which the target of {cache_name} does not have "
            f"(it has {n_layers} layers, ids 0-{n_layers - 1}); fix the layer ids (--target-layer-ids), "
            "or score the drafter on a cache of the target it was built for"
        )
    return (
        f"drafter {what} {wanted} need layers {missing} that {cache_name} lacks (it has "
        f"{cache.layer_ids}); re-extract with --layers "
        f"{','.join(map(str, sorted(set(cache.layer_ids) | set(wanted))))}"
    )


def fit_problems(
    cache: CacheView,
    cache_name: str,
    *,
    layer_ids: Sequence[int],
    feature_size: int,
    vocab_size: int,
    layers_field: str = "target_layer_ids",
    feature_field: str = "hidden_size",
) -> list[str]:
    """What keeps a drafter from reading ``cache``, one phrase each (empty: it fits): target layers
    the cache lacks (with the ``--layers`` to re-extract with: the cache's and the drafter's, so the
    new cache still serves what this one did), the hidden size, the vocabulary."""
    problems = []
    if layers := layer_fit_problem(layer_ids, cache, cache_name, layers_field):
        problems.append(layers)
    hidden = int(cache.specs["hidden_states"].row_shape[1])
    if hidden != feature_size:
        problems.append(
            f"drafter {feature_field} {feature_size} != target hidden size {hidden} in {cache_name}"
        )
    if vocab_size != cache.vocab_size:
        problems.append(
            f"drafter vocab_size {vocab_size} != target vocabulary {cache.vocab_size} in {cache_name}"
        )
    return problems


def check_fits(problems: list[str]) -> None:
    """One IncompatibleCacheError naming every problem (``fit_problems`` and a family's own), if any."""
    if problems:
        raise IncompatibleCacheError("; ".join(problems))


def sequence_features(
    hidden_states: torch.Tensor,
    index: list[int],
    dtype: torch.dtype,
    device: str,
    norm: ContextNorm | None = None,
) -> torch.Tensor:
    """``[T, K_cache, H]`` cached states -> ``[T, K*H]`` drafter input (concatenated in drafter order).

    ``norm`` (DFlash's ``context_norm``) is applied in the cache's dtype before any cast, as the
    target applied it, so the feature equals transformers' ``hidden_states[L]``.
    """
    picked = hidden_states[:, index] if index != list(range(hidden_states.shape[1])) else hidden_states
    if norm is not None:
        slot, fn = norm
        picked = picked.clone()
        picked[:, slot] = fn(picked[:, slot])
    return picked.reshape(picked.shape[0], -1).to(device=device, dtype=dtype)
