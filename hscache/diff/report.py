"""What ``hscache diff`` returns: frozen dataclasses, their JSON form and a plain-text summary.

The JSON form (``DiffReport.to_dict``) is described by ``schemas/diff_report.schema.json``;
``save_json`` validates before it writes. Numbers stay numbers; a statistic that is undefined
(no tokens in a bucket, a reference of zero norm) is ``None``/null, never NaN.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "DIFF_SCHEMA_VERSION",
    "CacheSide",
    "DiffReport",
    "LayerDrift",
    "LayerMatch",
    "NextTokenBucket",
    "NextTokenDrift",
    "PositionDrift",
    "ProvenanceDiff",
    "ProvenanceRow",
    "SequenceDrift",
    "SequenceMatch",
    "format_report",
    "save_json",
]

DIFF_SCHEMA_VERSION = 1


def _clean(value: Any) -> Any:
    """NaN/inf -> None so the document is strict JSON; recurse through containers."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    return value


@dataclass(frozen=True)
class CacheSide:
    """One compared cache: where it is and what it holds."""

    path: str
    sequences: int
    tokens: int
    layer_ids: tuple[int, ...]
    dtype: str
    backend: str
    device: str
    digest: str = ""  # hscache.cache_digest: pin it, check it with --expect-digest
    sampling: str = "greedy (temperature 0)"  # hscache.store.sampling: SamplingSetting.describe()


@dataclass(frozen=True)
class SequenceMatch:
    """Which sequences were compared; the others by record id (only with ``intersect``)."""

    compared: int
    tokens: int
    only_in_a: tuple[str, ...]
    only_in_b: tuple[str, ...]
    token_mismatch: tuple[str, ...]


@dataclass(frozen=True)
class LayerMatch:
    compared: tuple[int, ...]
    only_in_a: tuple[int, ...]
    only_in_b: tuple[int, ...]


@dataclass(frozen=True)
class PositionDrift:
    """Hidden-state drift of one layer over positions ``start <= p < stop`` (stop None: open)."""

    start: int
    stop: int | None
    tokens: int
    rel_l2: float | None
    cosine_mean: float | None
    max_abs: float | None


@dataclass(frozen=True)
class LayerDrift:
    """Hidden-state drift of one captured layer over every compared token.

    ``rel_l2`` is pooled: sqrt(sum_t ||a_t - b_t||^2 / sum_t ||a_t||^2); ``rel_l2_token_mean`` is the
    mean over tokens of ||a_t - b_t|| / ||a_t|| (tokens with ||a_t|| = 0 left out). Tokens with a
    non-finite value in either cache are counted in ``nonfinite_tokens`` and left out of the rest.
    """

    layer_id: int
    layer_type: str | None
    tokens: int
    nonfinite_tokens: int
    rel_l2: float | None
    rel_l2_token_mean: float | None
    max_abs: float | None
    cosine_mean: float | None
    cosine_min: float | None
    by_position: tuple[PositionDrift, ...]


@dataclass(frozen=True)
class NextTokenBucket:
    start: int
    stop: int | None
    positions: int
    argmax_agreement: float | None
    kl_mean: float | None
    margin_at_risk: float | None


@dataclass(frozen=True)
class NextTokenDrift:
    """The target's next-token data compared; definitions in ``hscache.diff.stats``.

    ``argmax_flips`` positions predict different tokens; ``flips_at_risk`` of them had A's
    top-1/top-2 margin below twice the observed logit drift (all of them, unless the flipped token
    left the common top-k). ``margin_at_risk`` is None when a cache stores top-1 only.
    """

    positions: int
    top_k: int
    argmax_agreement: float | None
    argmax_flips: int
    topk_overlap: float | None
    kl_mean: float | None
    kl_max: float | None
    margin_at_risk: float | None
    flips_at_risk: int
    by_position: tuple[NextTokenBucket, ...]


@dataclass(frozen=True)
class SequenceDrift:
    """One compared sequence: its pooled relative error at its worst layer, and argmax agreement."""

    record_id: str
    row_a: int
    row_b: int
    tokens: int
    worst_layer: int
    worst_rel_l2: float | None
    argmax_agreement: float | None


@dataclass(frozen=True)
class ProvenanceRow:
    """One flattened provenance key; status is "same", "differs" or "expected" (differs, harmlessly)."""

    key: str
    a: Any
    b: Any
    status: str


@dataclass(frozen=True)
class ProvenanceDiff:
    rows: tuple[ProvenanceRow, ...]
    differing: tuple[str, ...]
    expected: tuple[str, ...]


@dataclass(frozen=True)
class DiffReport:
    """Everything ``diff_caches`` measured, with the config and versions that produced it."""

    schema_version: int
    hscache_version: str
    hscache_git_commit: str | None
    config: dict[str, Any]
    cache_a: CacheSide
    cache_b: CacheSide
    sequences: SequenceMatch
    layers: LayerMatch
    hidden_states: tuple[LayerDrift, ...]
    next_token: NextTokenDrift
    per_sequence: tuple[SequenceDrift, ...]
    provenance: ProvenanceDiff
    # Both caches' target identities and "match" / "mismatch" (compared with --allow-target-mismatch)
    # / "unknown" (diff/compare.py match_targets).
    target: dict[str, Any] = field(
        default_factory=lambda: {"status": "unknown", "a": {}, "b": {}, "differences": []}
    )

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict matching ``schemas/diff_report.schema.json``."""
        return _clean(asdict(self))

    def worst_layer(self) -> LayerDrift | None:
        """The compared layer with the largest pooled relative error (None if all undefined)."""
        defined = [layer for layer in self.hidden_states if layer.rel_l2 is not None]
        return max(defined, key=lambda layer: layer.rel_l2) if defined else None


def save_json(report: DiffReport, path: str | os.PathLike) -> Path:
    """Validate ``report`` against its schema, then write it atomically to ``path``.

    Raises:
        schemas.SchemaError: the document breaks the schema (a bug, not a user error).
    """
    from hscache import schemas
    from hscache.store.fsio import atomic_write_json

    document = report.to_dict()
    schemas.validate(document, "diff_report")
    atomic_write_json(Path(path), document)
    return Path(path)


def _fmt(x: float | None, spec: str = ".3e") -> str:
    return "-" if x is None or (isinstance(x, float) and not math.isfinite(x)) else format(x, spec)


def format_report(report: DiffReport) -> str:
    """A readable plain-text summary (the CLI's output)."""
    a, b, seqs = report.cache_a, report.cache_b, report.sequences
    lines = []
    if report.target["status"] == "mismatch":
        lines.append(
            f"WARNING: A and B come from different targets ({'; '.join(report.target['differences'])}), compared "
            "anyway (--allow-target-mismatch): the distances below are not drift"
        )
    lines += [
        f"A  {a.path}  ({a.dtype}, backend {a.backend}, {a.device})",
        f"B  {b.path}  ({b.dtype}, backend {b.backend}, {b.device})",
        f"compared {seqs.compared} sequences, {seqs.tokens} tokens, layers {list(report.layers.compared)}",
    ]
    skipped = {
        "only in A": seqs.only_in_a,
        "only in B": seqs.only_in_b,
        "with different token ids": seqs.token_mismatch,
    }
    lines += [
        f"  skipped {len(ids)} {why}: {', '.join(ids[:5])}{' ...' if len(ids) > 5 else ''}"
        for why, ids in skipped.items()
        if ids
    ]
    if report.layers.only_in_a or report.layers.only_in_b:
        lines.append(
            f"  layers not compared: only in A {list(report.layers.only_in_a)}, "
            f"only in B {list(report.layers.only_in_b)}"
        )
    lines += [
        "",
        f"{'layer':>5}  {'type':<16} {'rel_l2':>9} {'tok_mean':>9} {'max_abs':>9} "
        f"{'cos_mean':>10} {'cos_min':>10}",
    ]
    for layer in report.hidden_states:
        lines.append(
            f"{layer.layer_id:>5}  {layer.layer_type or '?':<16} {_fmt(layer.rel_l2, '9.2e')} "
            f"{_fmt(layer.rel_l2_token_mean, '9.2e')} {_fmt(layer.max_abs, '9.2e')} "
            f"{_fmt(layer.cosine_mean, '10.7f')} {_fmt(layer.cosine_min, '10.7f')}"
        )
    nt = report.next_token
    lines += [
        "",
        f"next token over {nt.positions} positions (top-{nt.top_k}): "
        f"argmax agreement {_fmt(nt.argmax_agreement, '.2%')} ({nt.argmax_flips} flips), "
        f"top-k overlap {_fmt(nt.topk_overlap, '.2%')}, "
        f"KL mean {_fmt(nt.kl_mean)} max {_fmt(nt.kl_max)}, "
        f"margin at risk {_fmt(nt.margin_at_risk, '.2%')}",
    ]
    prov = report.provenance
    lines.append("")
    if prov.differing:
        lines.append("provenance differs:")
        rows = {row.key: row for row in prov.rows}
        lines += [
            f"  {key}: {json.dumps(rows[key].a)} -> {json.dumps(rows[key].b)}" for key in prov.differing
        ]
    else:
        lines.append("provenance: no differences")
    if prov.expected:
        lines.append(f"  (expected differences not shown: {', '.join(prov.expected)})")
    return "\n".join(lines)
