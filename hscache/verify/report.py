"""What ``hscache verify`` found: problems (the cache is wrong), warnings (worth a look), statistics.

Everything here is plain data with ``to_dict`` so ``--json`` output is a stable document
(``schemas/verify_report.schema.json``). Check names are fixed strings written to disk.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["CHECKS", "LayerStats", "Problem", "RecomputeResult", "VerifyReport", "format_report"]

# Every check verify can run, in report order. A check is "ok", "failed" or "skipped".
CHECKS = (
    "manifest",
    "index",
    "files",
    "chunks",
    "token_hash",
    "nonfinite",
    "zeros",
    "norms",
    "sampling",
    "recompute",
)
# Per check, at most this many problems are listed; the rest are counted in one last entry.
MAX_LISTED = 1000


@dataclass(frozen=True)
class Problem:
    """One finding, naming the sequence (``seq_id`` = row of the index) when it concerns one."""

    check: str  # one of CHECKS
    message: str  # one line: what is wrong, where, and what it means
    seq_id: int | None = None
    record_id: str | None = None
    array: str | None = None
    layer_id: int | None = None  # decoder-layer id (as in the cache's layer_ids), not a position
    chunk: int | None = None  # chunk index along the token axis of ``array``

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class LayerStats:
    """Streaming statistics of one cached layer of ``hidden_states`` over the committed tokens."""

    layer_id: int
    nan: int
    inf: int
    zero_fraction: float  # exact zeros / elements
    zero_rows: int  # tokens whose whole hidden vector is exactly zero
    norm_mean: float | None  # of per-token L2 norms (finite tokens only)
    norm_std: float | None
    outlier_seq_ids: list[int]  # sequences whose mean norm is a robust outlier

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class RecomputeResult:
    """One re-run sequence: relative L2 error per cached layer, and greedy-token agreement."""

    seq_id: int
    record_id: str
    rel_error: list[float | None]  # per layer in layer_ids order; None when not finite
    argmax_agreement: float

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class VerifyReport:
    """The outcome of ``verify_cache``; ``ok`` is False exactly when a problem was found."""

    path: str
    deep: bool
    sequences: int = 0
    tokens: int = 0
    complete: bool = False
    layer_ids: list[int] = field(default_factory=list)
    checks: dict[str, str] = field(default_factory=lambda: {c: "skipped" for c in CHECKS})
    layers: list[LayerStats] = field(default_factory=list)
    chunks_decoded: int = 0
    recompute: dict[str, Any] | None = None
    problems: list[Problem] = field(default_factory=list)
    warnings: list[Problem] = field(default_factory=list)
    seconds: float = 0.0
    digest: str | None = None  # the cache's root digest (store/integrity.py: cache_digest)
    not_checked: list[str] = field(default_factory=list)  # what this run left out, each with its flag
    sampling: str | None = None  # its sampling setting in one line (store/sampling.py); None: no manifest
    _listed: dict[str, int] = field(default_factory=dict, repr=False)

    @property
    def ok(self) -> bool:
        return not self.problems

    def add(self, problem: Problem, warning: bool = False) -> None:
        """Record a problem (or warning) and mark its check failed; long lists are capped."""
        key = f"{'w' if warning else 'p'}:{problem.check}"
        n = self._listed[key] = self._listed.get(key, 0) + 1
        target = self.warnings if warning else self.problems
        if not warning:
            self.checks[problem.check] = "failed"
        if n <= MAX_LISTED:
            target.append(problem)
        elif n == MAX_LISTED + 1:
            target.append(Problem(problem.check, f"more {problem.check} findings not listed"))

    def passed(self, check: str) -> None:
        """Mark ``check`` as run; it stays "failed" if a problem was already recorded."""
        if self.checks[check] != "failed":
            self.checks[check] = "ok"

    @property
    def bad_sequences(self) -> list[dict[str, Any]]:
        """Each sequence named by a problem, once, with the checks it failed."""
        seen: dict[int, dict[str, Any]] = {}
        for p in self.problems:
            if p.seq_id is not None:
                entry = seen.setdefault(
                    p.seq_id, {"seq_id": p.seq_id, "record_id": p.record_id, "checks": []}
                )
                if p.check not in entry["checks"]:
                    entry["checks"].append(p.check)
        return [seen[k] for k in sorted(seen)]

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema_version": 1,
            "path": self.path,
            "ok": self.ok,
            "deep": self.deep,
            "sequences": self.sequences,
            "tokens": self.tokens,
            "complete": self.complete,
            "layer_ids": list(self.layer_ids),
            "checks": dict(self.checks),
            "layers": [s.to_dict() for s in self.layers],
            "chunks_decoded": self.chunks_decoded,
            "recompute": self.recompute,
            "bad_sequences": self.bad_sequences,
            "problems": [p.to_dict() for p in self.problems],
            "warnings": [p.to_dict() for p in self.warnings],
            "seconds": round(self.seconds, 3),
            "digest": self.digest,
            "not_checked": list(self.not_checked),
            "sampling": self.sampling,
        }


def _fmt(value: float | None, spec: str = ".4g") -> str:
    return "-" if value is None else format(value, spec)


def format_report(report: VerifyReport, max_lines: int = 20) -> str:
    """A human-readable report: verdict, checks, per-layer statistics, then the findings."""
    verdict = "OK"
    if not report.ok:
        verdict = f"FAILED: {len(report.bad_sequences)} bad sequences, {len(report.problems)} problems"
    elif report.not_checked:  # never "OK" for what was skipped
        verdict = f"no problem found in what was checked; not checked: {'; '.join(report.not_checked)}"
    lines = [
        f"cache      {report.path} ({'complete' if report.complete else 'incomplete'}) "
        f"{report.sequences} sequences, {report.tokens} tokens{' [deep]' if report.deep else ''}",
        f"verdict    {verdict}",
        f"digest     {report.digest or '-'}",
        f"sampling   {report.sampling or '-'}",
        "checks     " + "  ".join(f"{name}={state}" for name, state in report.checks.items()),
    ]
    if report.layers:
        lines.append("layer   nan      inf      zero_frac  zero_rows  norm_mean  norm_std   outliers")
        for s in report.layers:
            lines.append(
                f"{s.layer_id:<7} {s.nan:<8} {s.inf:<8} {s.zero_fraction:<10.3g} {s.zero_rows:<10} "
                f"{_fmt(s.norm_mean):<10} {_fmt(s.norm_std):<10} {s.outlier_seq_ids[:8]}"
            )
    if report.recompute:
        rc = report.recompute
        lines.append(
            f"recompute  {len(rc['results'])} sequences, max rel error per layer {rc['max_rel_error']} "
            f"(tolerance {rc['tolerance']}, exact expected: {rc['exact_expected']})"
        )
    for title, items in (("problem", report.problems), ("warning", report.warnings)):
        for p in items[:max_lines]:
            lines.append(f"{title:<10} [{p.check}] {p.message}")
        if len(items) > max_lines:
            lines.append(f"{title:<10} ... {len(items) - max_lines} more (use --json for all)")
    return "\n".join(lines)
