"""``hscache diff``: how far apart are two caches of the same tokens, layer by layer and position by position.

Named steps: open both caches -> prove they are comparable (same sequences by record id and
token hash, common layers, same hidden size) -> stream the matched sequences one at a time,
summing per-token drift (``hscache.diff.stats``) per layer and position bucket -> turn the sums into
a ``DiffReport`` with the provenance of both caches side by side.

    >>> report = diff_caches("cache_fp32/", "cache_bf16/")          # doctest: +SKIP
    >>> [round(layer.rel_l2, 4) for layer in report.hidden_states]  # doctest: +SKIP
"""

from __future__ import annotations

import importlib.metadata
import os
from collections.abc import Sequence
from typing import Any

import torch

from hscache.capture.provenance import git_commit
from hscache.diff import stats as drift
from hscache.diff.report import (
    DIFF_SCHEMA_VERSION,
    CacheSide,
    DiffReport,
    LayerMatch,
    ProvenanceDiff,
    ProvenanceRow,
    SequenceDrift,
    SequenceMatch,
)
from hscache.diff.sums import HiddenSums, NextTokenSums
from hscache.errors import CacheMismatchError
from hscache.progress import NO_PROGRESS
from hscache.store.integrity import cache_digest
from hscache.store.open import open_cache
from hscache.store.run_log import provenance_with_runs, read_run_log
from hscache.store.sampling import sampling_setting
from hscache.store.target_identity import cache_target_identity, identity_differences, target_name
from hscache.store.view import CacheView

__all__ = [
    "DEFAULT_POSITION_BUCKETS",
    "EXPECTED_DIFFERENCES",
    "check_diff_arrays",
    "compare_provenance",
    "diff_caches",
    "holds_logprobs",
    "match_layers",
    "match_sequences",
    "match_targets",
]

# Bucket starts (token positions); the last bucket is open-ended.
DEFAULT_POSITION_BUCKETS: tuple[int, ...] = (0, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
# Provenance keys (and their sub-keys) that differ between any two runs; shown, not flagged.
EXPECTED_DIFFERENCES: tuple[str, ...] = ("timestamps", "command_line", "hardware.hostname")


def _fix(cache_a: CacheView) -> str:
    """How to get comparable caches: a subset now, or B re-extracted on A's very tokens."""
    return (
        "compare only the sequences both caches hold with --intersect, or compare on identical tokens: "
        f"re-extract B from A's tokens with `hscache extract --tokens-from {cache_a.path} --out B2` "
        "and B's --model/--dtype/--backend/--device/--layers"
    )


def _keys(cache: CacheView) -> list[tuple[str, int]]:
    """(record_id, n-th occurrence) per row, so that a repeated record id still pairs up in order."""
    seen: dict[str, int] = {}
    keys = []
    for rid in cache.index.column("record_id").to_pylist():
        keys.append((rid, seen.get(rid, 0)))
        seen[rid] = seen.get(rid, 0) + 1
    return keys


def _token_difference(cache_a: CacheView, row_a: int, cache_b: CacheView, row_b: int) -> str:
    ta, tb = cache_a.token_ids(row_a), cache_b.token_ids(row_b)
    n = min(len(ta), len(tb))
    differs = (ta[:n] != tb[:n]).nonzero()
    where = "one is a prefix of the other"
    if len(differs):
        where = f"first difference at position {int(differs[0])}"
    return f"different token ids (A row {row_a}: {len(ta)} tokens, B row {row_b}: {len(tb)} tokens, {where})"


def match_sequences(
    cache_a: CacheView, cache_b: CacheView, *, intersect: bool = False
) -> tuple[list[tuple[int, int]], SequenceMatch]:
    """Pair rows of A and B holding the same record id and the same token ids (by token_sha256).

    Returns:
        ``[(row_a, row_b), ...]`` in A's order, and what was left out.

    Raises:
        CacheMismatchError: without ``intersect``, the first sequence that is missing from one cache
            or has different token ids, by record id; with it, when no sequence matches.
    """
    keys_a, keys_b = _keys(cache_a), _keys(cache_b)
    sha_a = cache_a.index.column("token_sha256").to_pylist()
    sha_b = cache_b.index.column("token_sha256").to_pylist()
    row_of_b = {key: row for row, key in enumerate(keys_b)}
    pairs, only_a, mismatch = [], [], []
    for row_a, key in enumerate(keys_a):
        row_b = row_of_b.get(key)
        if row_b is None:
            only_a.append(key[0])
            if not intersect:
                raise CacheMismatchError(
                    f"caches are not comparable: sequence {key[0]!r} is in A "
                    f"({cache_a.path}) but not in B ({cache_b.path}); {_fix(cache_a)}"
                )
        elif sha_a[row_a] != sha_b[row_b]:
            mismatch.append(key[0])
            if not intersect:
                what = _token_difference(cache_a, row_a, cache_b, row_b)
                raise CacheMismatchError(
                    f"caches are not comparable: sequence {key[0]!r} has {what}; {_fix(cache_a)}"
                )
        else:
            pairs.append((row_a, row_b))
    set_a = set(keys_a)  # built once: a set per key made this quadratic in the sequence count
    only_b = [key[0] for key in keys_b if key not in set_a]
    if only_b and not intersect:
        raise CacheMismatchError(
            f"caches are not comparable: sequence {only_b[0]!r} is in B "
            f"({cache_b.path}) but not in A ({cache_a.path}); {_fix(cache_a)}"
        )
    if not pairs:
        raise CacheMismatchError(
            f"caches have no sequence in common (same record id and token ids): A has "
            f"{len(keys_a)}, B has {len(keys_b)}; extract both from the same prompts"
        )
    tokens = sum(int(cache_a.index.column("length")[row].as_py()) for row, _ in pairs)
    return pairs, SequenceMatch(len(pairs), tokens, tuple(only_a), tuple(only_b), tuple(mismatch))


def match_layers(cache_a: CacheView, cache_b: CacheView) -> LayerMatch:
    """The captured layers both caches hold (compared), and the rest.

    Raises:
        CacheMismatchError: no layer in common, or the hidden sizes differ.
    """
    ha, hb = cache_a.specs["hidden_states"].row_shape[-1], cache_b.specs["hidden_states"].row_shape[-1]
    if ha != hb:
        raise CacheMismatchError(
            f"caches are not comparable: hidden size {ha} in A, {hb} in B; "
            "they come from different target models"
        )
    ids_a, ids_b = cache_a.layer_ids, cache_b.layer_ids
    common = tuple(i for i in ids_a if i in ids_b)
    if not common:
        raise CacheMismatchError(
            f"caches have no layer in common: A has {ids_a}, B has {ids_b}; "
            "extract both with overlapping --layers"
        )
    only_a = tuple(i for i in ids_a if i not in ids_b)
    return LayerMatch(common, only_a, tuple(i for i in ids_b if i not in ids_a))


# What hscache diff reads of each cache besides hidden_states and token_ids.
_DIFF_ARRAYS = ("target_argmax", "target_topk_values", "target_topk_ids", "target_logsumexp")


def check_diff_arrays(cache: CacheView, side: str) -> None:
    """Refuse a cache without the next-token arrays diff compares (an import without ``--target``).

    Raises:
        CacheMismatchError: naming what the cache lacks and the command that supplies it.
    """
    missing = [name for name in ("hidden_states", "token_ids", *_DIFF_ARRAYS) if name not in cache.specs]
    if not missing:
        return
    imported = (cache.provenance or {}).get("imported")
    fix = (
        f"re-import it with `hscache import --format {imported['format']} {imported['source']} --out NEW "
        "--target MODEL` (the model that produced the files), which computes them"
        if imported
        else "re-extract it with `hscache extract`"
    )
    raise CacheMismatchError(
        f"cache {side} ({cache.path}) holds no {', '.join(missing)}, which hscache diff compares; {fix}"
    )


def match_targets(cache_a: CacheView, cache_b: CacheView, *, allow_mismatch: bool) -> dict[str, Any]:
    """Both caches' target identities (store/target_identity.py) and whether they agree: the
    report's ``target``.

    Raises:
        CacheMismatchError: they differ and ``allow_mismatch`` is False.
    """
    a, b = cache_target_identity(cache_a), cache_target_identity(cache_b)
    differences = identity_differences(a, b)
    status = "mismatch" if differences else "match" if set(a) & set(b) else "unknown"
    if differences and not allow_mismatch:
        raise CacheMismatchError(
            f"A ({cache_a.path}) and B ({cache_b.path}) come from different targets: {target_name(cache_a)} "
            f"vs {target_name(cache_b)} ({'; '.join(differences)}), so their distance is not drift; compare "
            "caches of one target, or pass --allow-target-mismatch to compare them anyway (the report says so)"
        )
    return {
        "status": status,
        "a": {"name": target_name(cache_a), **a},
        "b": {"name": target_name(cache_b), **b},
        "differences": differences,
    }


def _flatten(doc: Any, prefix: str = "") -> dict[str, Any]:
    """Nested dicts -> {"a.b.c": leaf}; lists are leaves (compared whole)."""
    if not isinstance(doc, dict):
        return {prefix: doc}
    out: dict[str, Any] = {}
    for key, value in doc.items():
        out.update(_flatten(value, f"{prefix}.{key}" if prefix else str(key)))
    return out


def compare_provenance(prov_a: dict[str, Any], prov_b: dict[str, Any]) -> ProvenanceDiff:
    """Both provenance documents flattened to dotted keys, side by side, differences listed.

    A key missing from one side reads as None there. Keys under ``EXPECTED_DIFFERENCES`` that
    differ get status "expected" and are listed apart from the real differences.
    """
    flat_a, flat_b = _flatten(prov_a), _flatten(prov_b)
    rows, differing, expected = [], [], []
    for key in sorted(flat_a.keys() | flat_b.keys()):
        a, b = flat_a.get(key), flat_b.get(key)
        status = "same"
        if a != b or (key in flat_a) != (key in flat_b):
            harmless = any(key == p or key.startswith(p + ".") for p in EXPECTED_DIFFERENCES)
            status = "expected" if harmless else "differs"
            (expected if harmless else differing).append(key)
        rows.append(ProvenanceRow(key, a, b, status))
    return ProvenanceDiff(tuple(rows), tuple(differing), tuple(expected))


def holds_logprobs(cache: CacheView) -> bool:
    """Whether ``cache``'s top-k values are log-probabilities (logsumexp 0), not logits: a serving
    engine's cache (``hscache extract --engine vllm``: provenance ``capture.engine.logits``)."""
    return bool(((cache.provenance or {}).get("capture") or {}).get("engine"))


def _side(cache: CacheView) -> CacheSide:
    s = cache.settings
    return CacheSide(
        str(cache.path),
        len(cache),
        cache.num_tokens,
        tuple(cache.layer_ids),
        str(s["dtype"]),
        str(s["backend"]),
        str(s["device"]),
        cache_digest(cache),
        sampling_setting(cache).describe(),
    )


def _compare_sequence(
    cache_a: CacheView,
    cache_b: CacheView,
    rows: tuple[int, int],
    cols: tuple[list[int], list[int]],
    hidden: HiddenSums,
    nexttok: NextTokenSums,
    starts: Sequence[int],
    chunk_tokens: int,
    logprobs: bool = False,
) -> SequenceDrift:
    """Add one matched sequence to the sums, a chunk of positions at a time (bounded float64 memory).
    ``logprobs``: compare top-k values as log-probabilities (one side stores nothing else)."""
    row_a, row_b = rows
    hs_a, hs_b = cache_a.hidden_states(row_a), cache_b.hidden_states(row_b)  # [T, K, H]
    top_a, top_b = cache_a.target_topk(row_a), cache_b.target_topk(row_b)
    lse_a, lse_b = cache_a.target_logsumexp(row_a), cache_b.target_logsumexp(row_b)
    if logprobs:  # value - lse: the same probabilities, the same margins, an offset both sides share
        top_a, lse_a = (top_a[0] - lse_a[:, None], top_a[1]), torch.zeros_like(lse_a)
        top_b, lse_b = (top_b[0] - lse_b[:, None], top_b[1]), torch.zeros_like(lse_b)
    arg_a, arg_b = cache_a.target_argmax(row_a), cache_b.target_argmax(row_b)
    k = min(top_a[0].shape[-1], top_b[0].shape[-1])  # top-k sorted descending: the first k are top-k
    seq_err = torch.zeros(len(cols[0]), dtype=torch.float64)
    seq_ref = torch.zeros_like(seq_err)
    agree = 0
    for start in range(0, hs_a.shape[0], chunk_tokens):
        span = slice(start, start + chunk_tokens)
        bucket = drift.bucket_positions(torch.arange(start, min(start + chunk_tokens, hs_a.shape[0])), starts)
        for layer, (ka, kb) in enumerate(zip(*cols)):
            d = drift.token_drift(hs_a[span, ka], hs_b[span, kb])
            hidden.add(layer, bucket, d)
            seq_err[layer] += d.sq_err[d.finite].sum()
            seq_ref[layer] += d.sq_ref[d.finite].sum()
        agree += nexttok.add(
            bucket,
            arg_a[span],
            arg_b[span],
            (top_a[0][span, :k], top_a[1][span, :k], lse_a[span]),
            (top_b[0][span, :k], top_b[1][span, :k], lse_b[span]),
        )
    rel = torch.where(seq_ref > 0, (seq_err / seq_ref).sqrt(), torch.where(seq_err > 0, torch.inf, 0.0))
    worst = int(rel.argmax())
    record_id = str(cache_a.index.column("record_id")[row_a].as_py())
    length = int(hs_a.shape[0])
    return SequenceDrift(
        record_id,
        row_a,
        row_b,
        length,
        int(cache_a.layer_ids[cols[0][worst]]),
        float(rel[worst]),
        agree / length if length else None,
    )


def diff_caches(
    path_a: str | os.PathLike,
    path_b: str | os.PathLike,
    *,
    intersect: bool = False,
    position_buckets: Sequence[int] = DEFAULT_POSITION_BUCKETS,
    chunk_tokens: int = 2048,
    progress: Any = NO_PROGRESS,
    allow_target_mismatch: bool = False,
) -> DiffReport:
    """Compare two caches of the same tokens; A is the reference (e.g. fp32, or the torch kernels).

    Args:
        path_a, path_b: cache directories.
        intersect: compare only the sequences both hold with identical token ids, instead of
            refusing caches whose sequences differ.
        position_buckets: bucket starts in token positions, from 0, increasing; the last is open.
        chunk_tokens: positions converted to float64 at a time (memory bound, not a result knob).
        progress: hears of each compared sequence (hscache.progress.StepProgress).
        allow_target_mismatch: compare caches of different targets anyway (the report says so);
            by default they are refused: their distance is not drift.

    Returns:
        A ``DiffReport``; ``.to_dict()`` is JSON, ``hscache.report.html.write_report`` draws it.

    Raises:
        CacheNotFoundError, CacheFormatError: a path holds no readable cache.
        CacheMismatchError: the caches are not comparable (see ``match_sequences``, ``match_layers``,
            ``match_targets``, ``check_diff_arrays``).
        ValueError: ``position_buckets`` is not increasing from 0.
    """
    starts = tuple(int(s) for s in position_buckets)
    drift.bucket_positions(torch.zeros(1), starts)  # validate before any work
    cache_a, cache_b = open_cache(path_a), open_cache(path_b)
    for side, cache in (("A", cache_a), ("B", cache_b)):
        check_diff_arrays(cache, side)
    target = match_targets(cache_a, cache_b, allow_mismatch=allow_target_mismatch)
    layers = match_layers(cache_a, cache_b)
    pairs, seq_match = match_sequences(cache_a, cache_b, intersect=intersect)
    cols = (
        [cache_a.layer_ids.index(i) for i in layers.compared],
        [cache_b.layer_ids.index(i) for i in layers.compared],
    )
    top_k = min(cache.specs["target_topk_ids"].row_shape[-1] for cache in (cache_a, cache_b))
    hidden, nexttok = HiddenSums(len(layers.compared), len(starts)), NextTokenSums(len(starts), top_k)
    progress.start(len(pairs))
    per_sequence = []
    logprobs = holds_logprobs(cache_a) or holds_logprobs(cache_b)
    for rows in pairs:
        per_sequence.append(
            _compare_sequence(cache_a, cache_b, rows, cols, hidden, nexttok, starts, chunk_tokens, logprobs)
        )
        progress.advance(1, secondary=int(cache_a.index.column("length")[rows[0]].as_py()))
    per_sequence = tuple(per_sequence)
    layer_types = cache_a.provenance.get("model", {}).get("layer_types") or []
    types = [layer_types[i] if i < len(layer_types) else None for i in layers.compared]
    return DiffReport(
        schema_version=DIFF_SCHEMA_VERSION,
        hscache_version=importlib.metadata.version("hscache"),
        hscache_git_commit=git_commit(),
        config={
            "intersect": intersect,
            "position_buckets": list(starts),
            "allow_target_mismatch": allow_target_mismatch,
        },
        cache_a=_side(cache_a),
        cache_b=_side(cache_b),
        sequences=seq_match,
        layers=layers,
        hidden_states=hidden.result(layers.compared, types, starts),
        next_token=nexttok.result(starts),
        per_sequence=per_sequence,
        provenance=compare_provenance(_described(cache_a), _described(cache_b)),
        target=target,
    )


def _described(cache: CacheView) -> dict[str, Any]:
    """The cache's provenance with what its runs did (store/run_log.py), laid out as before the run log."""
    return provenance_with_runs(cache.provenance, read_run_log(cache.path))
