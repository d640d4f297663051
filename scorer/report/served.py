"""A sampled cache's ``sampling`` block (scorer/offline/sampled_view.py) and the side-by-side table of
``scorer compare --cache A --cache B`` (scorer/studies/compare_settings.py) on the terminal and in HTML;
nothing computed here."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from html import escape
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from hscache.report.html import html_table
from scorer.report.tables import print_table

__all__ = [
    "SERVED_HEADER",
    "render_served",
    "render_settings",
    "served_html",
    "served_rows",
    "settings_html",
    "settings_table",
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
    from rich.markup import escape as plain  # "E[rounds | y]" is text, not rich markup

    console.print(plain(_headline(sampling)))
    table = Table(*map(plain, SERVED_HEADER), title=f"tau as served ({sampling['rule']} rule)")
    for row in served_rows(sampling):
        table.add_row(*row)
    console.print(table)
    if sampling.get("all_anchor_acceptance"):
        values = " ".join("-" if a is None else f"{a:.3f}" for a in sampling["all_anchor_acceptance"])
        console.print(f"acceptance averaged over ALL anchors (a training dashboard's, not served): {values}")
    console.print(f"[dim]{plain(sampling['definition'])}[/]")


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


def _label(setting: dict[str, Any]) -> str:
    s = setting["setting"]
    if s["temperature"] == 0:
        return f"{Path(setting['cache'].rstrip('/')).name}: greedy"
    preset = f" {s['preset']}" if s.get("preset") else ""
    return f"{Path(setting['cache'].rstrip('/')).name}: T {s['temperature']:g}{preset} ({setting['rule']})"


def settings_table(document: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    """(header, rows): a drafter per row, per setting its tau [interval] and rank (terminal and HTML)."""
    header = ["drafter", *(_label(s) for s in document["settings"])]
    rows = []
    for d in document["drafters"]:
        cells = [f"{Path(d['checkpoint'].rstrip('/')).name or d['checkpoint']} ({d['family']})"]
        for t in d["taus"]:
            if t["tau"] is None:
                cells.append("-")
                continue
            ci = "" if t["lo"] is None else f" [{t['lo']:.2f}, {t['hi']:.2f}]"
            cells.append(f"{t['tau']:.3f}{ci} #{t['rank']}")
        rows.append(cells)
    return header, rows


def render_settings(document: dict[str, Any], console: Console, table_format: str = "auto") -> None:
    """The side-by-side table, whole (``print_table``: boxes on a terminal, plain or markdown when
    redirected), then each cache's setting and the warnings."""
    header, rows = settings_table(document)
    console.print("tau per sampling setting (pooled; #rank at that setting)")
    print_table(header, rows, table_format, stream=console.file)
    for s in document["settings"]:
        console.print(f"{s['cache']}: {s['described']}; {s['prompts']} prompts, {s['requests']} requests")
    for warning in document["warnings"]:
        console.print(f"[bold yellow]warning:[/] {warning}")
