"""The page of ``scorer watch`` (watch.html): self-contained (inline SVG, no script, nothing fetched).

Against the training step: tau pooled with its 95% interval band and tau per request; acceptance
per slot (conditional); tau per category; pooled tau by context length. Then a table of every
record, refused checkpoints with their reason. Steps are drawn evenly spaced, in order (the labels
carry the values), as ``scorer sweep``'s plot does: checkpoints are often saved at growing intervals.
"""

from __future__ import annotations

from collections.abc import Sequence
from html import escape
from pathlib import Path
from typing import Any

from hscache.report.html import html_page, html_table
from hscache.report.svg import Series, gradient, line_chart

__all__ = ["render_watch_html"]

_PALETTE = ("#08519c", "#e6550d", "#31a354", "#756bb1", "#de2d26", "#636363", "#8c6d31", "#d6616b")


def _num(x: float | None, spec: str = ".3f") -> str:
    return "-" if x is None else format(x, spec)


def _tau_chart(rows: Sequence[dict[str, Any]], steps: list[str]) -> str:
    taus = [r["metrics"]["tau"] for r in rows]
    return line_chart(
        steps,
        {
            "tau pooled (95% band)": Series(
                [t["pooled"] for t in taus],
                "#e6550d",
                band=[tuple(t["pooled_ci95"]) if t["pooled_ci95"] else None for t in taus],
            ),
            "tau per request": Series([t["per_request"] for t in taus], "#08519c", dashed=True),
        },
        title="Acceptance length tau by training step",
        y_label="tau (tokens per round)",
        x_label="training step",
    )


def _slot_chart(rows: Sequence[dict[str, Any]], steps: list[str]) -> str | None:
    slots = max((len(r["metrics"]["acceptance"]["conditional"]) for r in rows), default=0)
    if not any(v is not None for r in rows for v in r["metrics"]["acceptance"]["conditional"]):
        return None  # --anchors chain: no per-slot acceptance
    colors = gradient(slots)
    series = {
        f"slot {j + 1}": Series(
            [(r["metrics"]["acceptance"]["conditional"] + [None] * slots)[j] for r in rows], colors[j]
        )
        for j in range(slots)
    }
    return line_chart(
        steps,
        series,
        title="Acceptance per slot (conditional) by training step",
        y_label="acceptance",
        x_label="training step",
        percent=True,
    )


def _keyed_chart(
    rows: Sequence[dict[str, Any]], steps: list[str], values: list[dict[str, float]], title: str
) -> str | None:
    names = sorted({k for v in values for k in v})
    if len(names) < 1:
        return None
    series = {
        name: Series([v.get(name) for v in values], _PALETTE[i % len(_PALETTE)])
        for i, name in enumerate(names)
    }
    return line_chart(steps, series, title=title, y_label="tau", x_label="training step")


def _table(records: Sequence[dict[str, Any]]) -> str:
    cells = []
    for r in records:
        name = Path(r["checkpoint"]).name
        if r["status"] != "scored":
            cells.append([str(r["step"]), name, "refused", r.get("reason", ""), "", ""])
            continue
        m = r["metrics"]
        ci = m["tau"]["pooled_ci95"]
        ddtree = ", ".join(f"{b}: {_num(block['per_request'])}" for b, block in m["ddtree"].items())
        cells.append(
            [
                str(r["step"]),
                name,
                _num(m["tau"]["per_request"]),
                _num(m["tau"]["pooled"]) + (f" [{ci[0]:.3f}, {ci[1]:.3f}]" if ci else ""),
                ddtree or "-",
                r["step_source"],
            ]
        )
    return html_table(
        ["step", "checkpoint", "tau per request", "tau pooled [95%]", "DDTree", "step from"], cells
    )


def render_watch_html(records: Sequence[dict[str, Any]], *, title: str) -> str:
    """The watch page of ``records`` (watch.jsonl's, in any order): charts of the scored ones by step."""
    scored = sorted(
        (r for r in records if r["status"] == "scored" and r["step"] is not None), key=lambda r: r["step"]
    )
    steps = [str(r["step"]) for r in scored]
    body = [
        f"<h1>{escape(title)}</h1>",
        f"<p>{len(scored)} checkpoints scored, {len(records) - len(scored)} refused.</p>",
    ]
    if scored:
        categories = [
            {k: v["tau_per_request"] for k, v in r["metrics"]["per_category"].items()} for r in scored
        ]
        contexts = [
            {
                f"context {b['start']}-{'' if b['stop'] is None else b['stop']}": b["tau_pooled"]
                for b in r["metrics"]["context_length"] or ()
            }
            for r in scored
        ]
        charts = [
            _tau_chart(scored, steps),
            _slot_chart(scored, steps),
            _keyed_chart(scored, steps, categories, "tau per request, by category"),
            _keyed_chart(scored, steps, contexts, "tau pooled, by context length at the anchor"),
        ]
        body += [f"<div>{c}</div>" for c in charts if c is not None]
    body.append(_table(sorted(records, key=lambda r: (r["step"] is None, r["step"] or 0))))
    return html_page(title, body)
