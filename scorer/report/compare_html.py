"""``scorer compare --report F.html``: one self-contained page, several drafters on one cache.

It draws what ``scorer.studies.compare.compare_drafters`` returned: the tau table (both conventions, 95%
intervals, paired deltas against the first drafter), the cost per round, and per-slot acceptance
per drafter (``hscache.report.html.acceptance_chart``). No number is computed here.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from html import escape
from pathlib import Path
from typing import Any

from hscache.report.html import acceptance_chart, html_page, html_table
from scorer.report.html import category_section, format_ci, format_delta, format_number

__all__ = ["drafter_names", "render_compare_html", "write_compare_html"]


def _tree(tree: Mapping[str, Any] | None) -> str:
    if not tree:
        return "-"
    tau = tree["tau"]
    shape = f"{tree['steps']},{tree['topk']},{tree['draft_tokens']}"
    return f"{format_number(tau['pooled'])}{format_ci(tau['pooled_ci95'])} ({shape})"


def drafter_names(document: Mapping[str, Any]) -> list[str]:
    """A label per drafter: its directory name (the whole path where names repeat), and the family."""
    paths = [row["checkpoint"] for row in document["drafters"]]
    names = [Path(p.rstrip("/")).name or p for p in paths]
    names = names if len(set(names)) == len(names) else paths
    return [f"{n} ({row['family']})" for n, row in zip(names, document["drafters"])]


def tau_rows(document: Mapping[str, Any], names: Sequence[str]) -> list[list[str]]:
    """The tau table's rows (also what the terminal prints)."""
    rows = []
    for name, row in zip(names, document["drafters"]):
        tau, delta, drafting = row["tau"], row["delta_vs_first"], row["drafting"]
        rows.append(
            [
                name,
                f"{drafting['mode']} {drafting['draft_slots']} ({drafting['source'] or '-'})",
                f"{row['requests']} / {row['rounds']}",
                format_number(tau["per_request"]) + format_ci(tau["per_request_ci95"]),
                format_number(tau["pooled"]) + format_ci(tau["pooled_ci95"]),
                format_delta(delta["per_request"]) if delta else "(reference)",
                format_delta(delta["pooled"]) if delta else "(reference)",
                _tree(row.get("tree")),
                format_number(row["train_accept_len"], 2),
                format_number((row.get("teacher_forced") or {}).get("accept_len"), 2),
            ]
        )
    return rows


TAU_HEADER = [
    "drafter",
    "drafting (source)",
    "requests / rounds",
    "tau per request [95%]",
    "tau pooled [95%]",
    "delta per request vs first",
    "delta pooled vs first",
    "tree tau pooled [95%]",
    "accept len (served)",
    "accept len (teacher-forced)",
]
COST_HEADER = [
    "drafter",
    "draft params",
    "draft forwards / round",
    "est. GFLOPs / round",
    "tau / GFLOP",
    "draft ms / round (median ±spread)",
    "scoring ms / round (offline replay)",
]


def _draft_ms(cost: Mapping[str, Any]) -> str:
    """``0.850 ±0.050``: the median of the timed rounds and half their interquartile range."""
    median, spread = cost.get("draft_seconds_per_round"), cost.get("draft_seconds_per_round_spread")
    if median is None:
        return "-"
    return f"{median * 1e3:.3f}" + ("" if spread is None else f" ±{spread * 1e3:.3f}")


def cost_rows(document: Mapping[str, Any], names: Sequence[str]) -> list[list[str]]:
    rows = []
    for name, row in zip(names, document["drafters"]):
        cost = row["cost"]
        flops = cost["flops_per_round"]
        per_round = cost["scoring_seconds_per_round"]
        rows.append(
            [
                name,
                f"{cost['draft_params']:,}",
                "-" if cost["draft_forwards_per_round"] is None else str(cost["draft_forwards_per_round"]),
                "-" if flops is None else f"{flops / 1e9:.4f}",
                format_number(cost.get("tau_per_gflop"), 1),
                _draft_ms(cost),
                "-" if per_round is None else f"{per_round * 1e3:.3f}",
            ]
        )
    return rows


def render_compare_html(document: Mapping[str, Any], *, title: str | None = None) -> str:
    names = drafter_names(document)
    title = title or f"scorer compare: {len(names)} drafters on {Path(str(document['cache']['path'])).name}"
    defs = document["definitions"]
    notes = [
        f'<p class="note">{escape(name)}: {escape(w)}</p>'
        for name, row in zip(names, document["drafters"])
        for w in row["warnings"]
    ]
    charts = [
        acceptance_chart(
            {n: row["acceptance"][kind] for n, row in zip(names, document["drafters"])},
            title=f"Per-slot acceptance ({kind})",
        )
        for kind in ("conditional", "unconditional")
    ]
    body = [
        f"<h1>{escape(title)}</h1>",
        f"<p>Cache <code>{escape(str(document['cache']['path']))}</code>: every drafter replayed the same "
        f"{document['drafters'][0]['requests']} sequences through the same round loop.</p>",
        *notes,
        "<h2>Tau</h2>",
        html_table(TAU_HEADER, tau_rows(document, names)),
        f"<p>tau per request: {escape(defs['per_request'])}. tau pooled: {escape(defs['pooled'])}. "
        f"Deltas: {escape(defs['delta_vs_first'])}.</p>",
        "<h2>Cost per round</h2>",
        html_table(COST_HEADER, cost_rows(document, names)),
        f"<p>FLOPs: {escape(defs['flops_per_round'])}. Draft time: {escape(defs['draft_seconds_per_round'])}. "
        f"Scoring time: {escape(defs['scoring_seconds_per_round'])}.</p>",
        "<h2>Per-slot acceptance</h2>",
        '<div class="charts">' + "".join(charts) + "</div>",
        "<p>Conditional: P(slot j correct | slots 1..j-1 correct); unconditional: P(slot j correct).</p>",
        *category_section(document["reports"], names),
    ]
    return html_page(title, body)


def write_compare_html(document: Mapping[str, Any], path: str | os.PathLike) -> Path:
    """Write ``render_compare_html(document)`` to ``path`` atomically; returns the path."""
    from hscache.store.fsio import atomic_write_bytes

    atomic_write_bytes(Path(path), render_compare_html(document).encode())
    return Path(path)
