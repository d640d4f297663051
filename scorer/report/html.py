"""``scorer eval --report out.html``: one self-contained HTML page for one checkpoint on one or more caches.

The page holds the tau table (both conventions with bootstrap intervals; for each cache after the
first, the paired delta and the rounds whose accepted count changed) and per-position acceptance
per cache, drawn with ``hscache.report.html.acceptance_chart``. No number is computed here: the
page draws what ``scorer.studies.evaluate.evaluate_many`` returned. The fragments are public so that the
drift study (pipelines/drift_study.py) composes them into its own page.

    >>> result = evaluate_many("drafter/", ["cache_fp32/", "cache_bf16/"])  # doctest: +SKIP
    >>> write_eval_html(result, "eval.html")                                # doctest: +SKIP
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from html import escape
from pathlib import Path
from typing import Any

from hscache.report.html import acceptance_chart, html_page, html_table
from scorer.report.served import served_html

__all__ = [
    "acceptance_section",
    "cache_names",
    "category_section",
    "format_ci",
    "format_delta",
    "format_number",
    "per_category_table",
    "render_eval_html",
    "tau_table",
    "write_eval_html",
]


def format_number(x: float | None, digits: int = 3) -> str:
    """A report cell: ``x`` to ``digits`` decimals, "-" when there is none."""
    return "-" if x is None else f"{x:.{digits}f}"


def format_ci(pair: Sequence[float] | None) -> str:
    """A confidence interval after its number (" [lo, hi]"), "" when there is none."""
    return "" if not pair else f" [{pair[0]:.2f}, {pair[1]:.2f}]"


def format_delta(d: Mapping[str, Any] | None) -> str:
    """A paired difference with its interval ("+0.123 [-0.010, +0.250]"), "-" when there is none."""
    return "-" if d is None else f"{d['delta']:+.3f} [{d['lo']:+.3f}, {d['hi']:+.3f}]"


def cache_names(reports: Sequence[Mapping[str, Any]]) -> list[str]:
    """A short label per report: the cache directory's name, or its whole path where names repeat."""
    paths = [str(r["cache"]["path"]) for r in reports]
    names = [Path(p.rstrip("/")).name or p for p in paths]
    return names if len(set(names)) == len(names) else paths


def per_category_table(
    reports: Sequence[Mapping[str, Any]], names: Sequence[str]
) -> tuple[list[str], list[list[str]]]:
    """Tau per prompt category (the cache index's ``category``: e.g. code, math, reasoning of the
    default prompts), one column pair per report: (header, rows); no rows when no report has
    categories. The terminal, markdown and HTML tables of ``scorer eval`` / ``compare`` all draw it."""
    blocks = [r.get("per_category") or {} for r in reports]
    categories = sorted({c for block in blocks for c in block})
    if not categories:
        return [], []
    header = ["category", "requests"]
    for name in names:
        header += (
            [f"{name}: tau per request", f"{name}: tau pooled"]
            if len(names) > 1
            else [
                "tau per request",
                "tau pooled",
            ]
        )
    rows = []
    for category in categories:
        counts = {str(b[category]["n_requests"]) for b in blocks if category in b}
        row = [category, "/".join(sorted(counts))]
        for block in blocks:
            entry = block.get(category) or {}
            row += [format_number(entry.get("tau_per_request")), format_number(entry.get("tau_pooled"))]
        rows.append(row)
    return header, rows


def category_section(reports: Sequence[Mapping[str, Any]], names: Sequence[str]) -> list[str]:
    """The HTML "Per category" section (empty without categories): ``per_category_table`` drawn."""
    header, rows = per_category_table(reports, names)
    if not rows:
        return []
    return [
        "<h2>Per category</h2>",
        html_table(header, rows),
        "<p>The prompts' categories, from the cache index; tau in both conventions over each category's "
        "requests.</p>",
    ]


def tau_table(result: Mapping[str, Any], names: Sequence[str] | None = None) -> str:
    """Tau per cache (both conventions, 95% intervals), and vs the first cache the paired deltas.

    Args:
        result: ``evaluate_many``'s ``{"reports": [...], "comparisons": [...]}``.
        names: a label per report; default ``cache_names``.
    """
    reports, comparisons = result["reports"], result["comparisons"]
    names = list(names or cache_names(reports))
    rows = []
    for i, report in enumerate(reports):
        settings = report["cache"].get("settings") or {}
        comp = comparisons[i - 1] if i else None
        changed = (
            f"{comp['rounds_with_changed_acceptance']} of {comp.get('rounds_compared', '?')}"
            if comp
            else "(reference)"
        )
        tau = report["tau"]
        rows.append(
            [
                names[i],
                f"{settings.get('dtype', '?')} / {settings.get('backend', '?')}",
                f"{report['requests']} / {report['rounds']}",
                format_number(tau["per_request"]) + format_ci(tau["per_request_ci95"]),
                format_number(tau["pooled"]) + format_ci(tau["pooled_ci95"]),
                format_delta(comp["delta"]["per_request"]) if comp else "-",
                format_delta(comp["delta"]["pooled"]) if comp else "-",
                changed,
                f"{report['off_greedy']['positions']} / {report['off_greedy']['rounds_cut_short']}",
            ]
        )
    header = [
        "cache",
        "dtype / backend",
        "requests / rounds",
        "tau per request [95%]",
        "tau pooled [95%]",
        "delta per request [95%]",
        "delta pooled [95%]",
        "rounds changed",
        "off-greedy positions / rounds cut",
    ]
    return html_table(header, rows)


def acceptance_section(result: Mapping[str, Any], names: Sequence[str] | None = None) -> str:
    """Per-position acceptance per cache: conditional and unconditional charts side by side."""
    reports = result["reports"]
    names = list(names or cache_names(reports))
    charts = [
        acceptance_chart(
            {n: r["acceptance"][kind] for n, r in zip(names, reports)},
            title=f"Per-position acceptance ({kind})",
        )
        for kind in ("conditional", "unconditional")
    ]
    return '<div class="charts">' + "".join(charts) + "</div>"


def _notes(result: Mapping[str, Any], names: Sequence[str]) -> list[str]:
    notes = []
    for name, comp in zip(names[1:], result["comparisons"]):
        left = {why: ids for why, ids in comp.get("requests_left_out", {}).items() if ids}
        if left:
            what = "; ".join(f"{len(ids)} {why.replace('_', ' ')}" for why, ids in left.items())
            notes.append(f"{name}: requests not paired with the reference ({what})")
    for name, report in zip(names, result["reports"]):
        notes += [f"{name}: {w}" for w in report["warnings"]]
        notes += [f"{name}: note: {n}" for n in report.get("notes", [])]
    return [f'<p class="note">{escape(n)}</p>' for n in notes]


def render_eval_html(result: Mapping[str, Any], *, title: str | None = None) -> str:
    """The whole page for ``evaluate_many``'s result (or one ``evaluate`` report)."""
    if "reports" not in result:  # a single report
        result = {"reports": [result], "comparisons": []}
    reports = result["reports"]
    names = cache_names(reports)
    checkpoint = reports[0]["checkpoint"].get("path", "?")
    title = title or f"scorer eval: {Path(str(checkpoint)).name} on {len(reports)} cache(s)"
    defs = reports[0]["definitions"]
    body = [
        f"<h1>{escape(title)}</h1>",
        (
            f"<p>Checkpoint <code>{escape(str(checkpoint))}</code>; reference cache "
            f"<code>{escape(str(reports[0]['cache']['path']))}</code>.</p>"
        ),
        *_notes(result, names),
        "<h2>Tau</h2>",
        tau_table(result, names),
        (
            f"<p>tau per request: {escape(defs['per_request'])}. tau pooled: {escape(defs['pooled'])}. "
            "Deltas are this cache minus the first, with a paired bootstrap over requests; rounds changed "
            "counts rounds at anchors both replays visit whose accepted count differs. Off-greedy positions: "
            "generated positions where the cached text leaves that cache's own argmax (its replay there is "
            "exact only up to that point; rounds cut counts rounds whose draft still matched past it).</p>"
        ),
        *served_html(reports, names),  # sampled caches: tau as served, the rule, the setting
        "<h2>Per-position acceptance</h2>",
        acceptance_section(result, names),
        "<p>Conditional: P(slot j correct | slots 1..j-1 correct); unconditional: P(slot j correct).</p>",
        *category_section(reports, names),
    ]
    return html_page(title, body)


def write_eval_html(result: Mapping[str, Any], path: str | os.PathLike, *, title: str | None = None) -> Path:
    """Write ``render_eval_html(result)`` to ``path`` atomically; returns the path."""
    from hscache.store.fsio import atomic_write_bytes

    atomic_write_bytes(Path(path), render_eval_html(result, title=title).encode())
    return Path(path)
