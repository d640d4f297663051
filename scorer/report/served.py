"""A sampled cache's ``sampling`` block (scorer/offline/sampled_view.py) on the terminal and in HTML; nothing computed here."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from html import escape
from typing import Any

from rich.console import Console
from rich.table import Table

from hscache.report.html import html_table

__all__ = [
    "SERVED_HEADER",
    "render_served",
    "served_html",
    "served_rows",
    "settings_html",
    "write_settings_html",
]

SERVED_HEADER = ("mode", "tau as served", "95% CI (prompts)", "E[rounds]", "served acceptance per slot")


def _mode_name(mode: str) -> str:
    if mode == "chain":
        return "chain"
    if mode == "tree":
        return "SGLang tree"
    return mode.replace("ddtree-", "DDTree-")


def served_rows(sampling: Mapping[str, Any]) -> list[list[str]]:
    """One row per scored mode: tau, its interval over prompts, E[rounds], the served acceptance."""
    rows = []
    for mode, block in sampling["modes"].items():
        if block is None:
            rows.append([_mode_name(mode), "-", "", "", ""])
            continue
        rows.append(
            [
                _mode_name(mode),
                f"{block['tau']:.3f}",
                f"[{block['lo']:.2f}, {block['hi']:.2f}]",
                f"{block['expected_rounds']:.1f}",
                " ".join(f"{a:.3f}" for a in block["served_acceptance"]),
            ]
        )
    return rows


def _headline(sampling: Mapping[str, Any]) -> str:
    return (
        f"sampled cache: {sampling['described']}. Scored with the {sampling['rule']} rule "
        f"(--draft-sampling {sampling['draft_sampling']}) over {sampling['trajectories']} trajectories of "
        f"{sampling['prompts']} prompts"
    )


def render_served(report: Mapping[str, Any], console: Console) -> None:
    sampling = report.get("sampling")
    if not sampling:
        return
    console.print(_headline(sampling))
    table = Table(*SERVED_HEADER, title=f"tau as served ({sampling['rule']} rule)")
    for row in served_rows(sampling):
        table.add_row(*row)
    console.print(table)
    if sampling.get("all_anchor_acceptance"):
        values = " ".join("-" if a is None else f"{a:.3f}" for a in sampling["all_anchor_acceptance"])
        console.print(f"acceptance averaged over ALL anchors (a training dashboard's, not served): {values}")
    console.print(f"[dim]{sampling['definition']}[/]")


def served_html(reports: Sequence[Mapping[str, Any]], names: Sequence[str]) -> list[str]:
    """HTML fragments: per sampled report its headline and table (none for greedy caches)."""
    out = []
    for name, report in zip(names, reports):
        sampling = report.get("sampling")
        if not sampling:
            continue
        out += [
            f"<h2>tau as served: {escape(name)}</h2>",
            f"<p>{escape(_headline(sampling))}.</p>",
            html_table(SERVED_HEADER, served_rows(sampling)),
            f"<p>{escape(sampling['definition'])}. Served acceptance: "
            f"{escape(sampling['served_acceptance_definition'])}.</p>",
        ]
    return out


def settings_html(document: Mapping[str, Any]) -> str:
    """The page of ``scorer compare ... --cache A --cache B`` (scorer/studies/compare_settings.py)."""
    from hscache.report.html import html_page
    from scorer.studies.compare_settings import settings_table

    header, rows = settings_table(dict(document))
    body = [
        "<h1>scorer compare: tau per sampling setting</h1>",
        html_table(header, rows),
        f"<p>{escape(document['definitions']['tau'])}; {escape(document['definitions']['rank'])}.</p>",
        *(
            f"<p><code>{escape(s['cache'])}</code>: {escape(s['described'])}.</p>"
            for s in document["settings"]
        ),
        *(f'<p class="note">{escape(w)}</p>' for w in document["warnings"]),
    ]
    return html_page("scorer compare: tau per sampling setting", body)


def write_settings_html(document: Mapping[str, Any], path: str) -> str:
    """Write ``settings_html(document)`` to ``path`` atomically; returns the path."""
    from pathlib import Path

    from hscache.store.fsio import atomic_write_bytes

    atomic_write_bytes(Path(path), settings_html(document).encode())
    return path
