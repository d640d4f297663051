"""The ``hscache diff --report`` page: one self-contained HTML file of inline SVG charts and tables.

No scripts, fonts or images are fetched: the file opens offline and can be mailed around.
Charts: relative error per layer (colored by layer type), relative error by position bucket,
next-token agreement, per-position acceptance per cache (``acceptance_chart``, filled in once a
drafter has been scored on both caches), then tables and both provenances side by side.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from html import escape
from pathlib import Path

from hscache.diff.report import DiffReport, LayerDrift
from hscache.report.svg import Series, bar_chart, gradient, line_chart
from hscache.store.output_paths import GENERATOR_META

__all__ = [
    "LAYER_TYPE_COLORS",
    "acceptance_chart",
    "diff_sections",
    "html_page",
    "html_table",
    "render_report",
    "write_report",
]

LAYER_TYPE_COLORS = {"linear_attention": "#4c78a8", "full_attention": "#f58518"}
_UNKNOWN_COLOR = "#999999"
_CSS = """
body{font-family:system-ui,sans-serif;margin:24px auto;max-width:1100px;color:#222}
h1{font-size:22px}h2{font-size:17px;margin-top:28px;border-bottom:1px solid #ddd}
h3{font-size:15px;margin-top:20px}
.cards{display:flex;gap:12px;flex-wrap:wrap}.card{border:1px solid #ddd;border-radius:6px;padding:8px 12px}
.card b{display:block;font-size:20px}.note{color:#8a5300}
table{border-collapse:collapse;font-size:12px;margin:8px 0}
td,th{border:1px solid #ddd;padding:3px 6px;text-align:right}
td.k,th.k,table.prov td{text-align:left;font-family:monospace}
table.prov td{word-break:break-all;max-width:460px}tr.differs{background:#ffd9d9}tr.expected{color:#888}
.charts svg{margin:6px 0;border:1px solid #eee}
"""


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.2%}"


def _num(x: float | None, spec: str = ".3e") -> str:
    return "-" if x is None else format(x, spec)


def _bucket_label(start: int, stop: int | None) -> str:
    return f"{start}-{stop - 1}" if stop is not None else f"{start}+"


def acceptance_chart(acceptance: Mapping[str, Sequence[float]], *, title: str | None = None) -> str:
    """Per-position acceptance of one drafter replayed on each cache, as an SVG line chart.

    Args:
        acceptance: ``{cache name: [acceptance rate of draft slot 1, slot 2, ...]}``, rates in [0, 1].
        title: chart title; defaults to "Per-position acceptance".
    """
    slots = max((len(v) for v in acceptance.values()), default=0)
    colors = ["#4c78a8", "#f58518", "#54a24b", "#e45756", "#72b7b2", "#b279a2"]
    # Caches after the first are dashed: where drift changes nothing the lines coincide, and both stay visible.
    series = {
        name: Series(list(values) + [None] * (slots - len(values)), colors[i % len(colors)], dashed=i > 0)
        for i, (name, values) in enumerate(acceptance.items())
    }
    return line_chart(
        [str(i + 1) for i in range(slots)],
        series,
        title=title or "Per-position acceptance",
        y_label="acceptance rate",
        x_label="draft position",
        percent=True,
    )


def _layer_charts(layers: Sequence[LayerDrift]) -> list[str]:
    types = sorted({layer.layer_type or "unknown" for layer in layers})
    bars = bar_chart(
        [str(layer.layer_id) for layer in layers],
        [layer.rel_l2 for layer in layers],
        [LAYER_TYPE_COLORS.get(layer.layer_type or "", _UNKNOWN_COLOR) for layer in layers],
        title="Relative L2 error per layer (B vs A)",
        y_label="||a - b|| / ||a||",
        x_label="layer",
        legend={t: LAYER_TYPE_COLORS.get(t, _UNKNOWN_COLOR) for t in types},
    )
    starts = sorted({(p.start, p.stop) for layer in layers for p in layer.by_position})
    colors = gradient(len(layers))
    series = {}
    for color, layer in zip(colors, layers):
        by_start = {p.start: p.rel_l2 for p in layer.by_position}
        name = f"layer {layer.layer_id}" + (" (full)" if layer.layer_type == "full_attention" else "")
        full = layer.layer_type == "full_attention"
        series[name] = Series([by_start.get(s) for s, _ in starts], color, dashed=full)
    lines = line_chart(
        [_bucket_label(s, e) for s, e in starts],
        series,
        title="Relative L2 error by token position",
        y_label="||a - b|| / ||a||",
        x_label="token position bucket",
    )
    return [bars, lines]


def _next_token_charts(report: DiffReport) -> list[str]:
    nt = report.next_token
    names = ["argmax agreement", "top-k overlap", "margin at risk"]
    bars = bar_chart(
        names,
        [nt.argmax_agreement, nt.topk_overlap, nt.margin_at_risk],
        ["#54a24b", "#72b7b2", "#e45756"],
        title=f"Next-token agreement (top-{nt.top_k})",
        y_label="fraction of positions",
        percent=True,
    )
    buckets = nt.by_position
    lines = line_chart(
        [_bucket_label(b.start, b.stop) for b in buckets],
        {
            "argmax agreement": Series([b.argmax_agreement for b in buckets], "#54a24b"),
            "margin at risk": Series([b.margin_at_risk for b in buckets], "#e45756", dashed=True),
        },
        title="Next-token agreement by token position",
        y_label="fraction of positions",
        x_label="token position bucket",
        percent=True,
    )
    return [bars, lines]


def _cards(report: DiffReport) -> str:
    worst, nt = report.worst_layer(), report.next_token
    cards = [
        ("sequences compared", f"{report.sequences.compared} ({report.sequences.tokens} tokens)"),
        ("worst layer rel. L2", f"{_num(worst.rel_l2, '.2e')} (layer {worst.layer_id})" if worst else "-"),
        ("argmax agreement", f"{_pct(nt.argmax_agreement)} ({nt.argmax_flips} flips)"),
        ("KL(A||B) mean", _num(nt.kl_mean, ".2e")),
        ("provenance differences", str(len(report.provenance.differing))),
    ]
    return (
        '<div class="cards">'
        + "".join(f'<div class="card">{escape(k)}<b>{escape(v)}</b></div>' for k, v in cards)
        + "</div>"
    )


def _notes(report: DiffReport) -> str:
    s, lm = report.sequences, report.layers
    notes = [
        f"{len(ids)} sequence{'s' * (len(ids) != 1)} {why} skipped (--intersect): {', '.join(ids[:10])}"
        for why, ids in (
            ("only in A", s.only_in_a),
            ("only in B", s.only_in_b),
            ("with different token ids", s.token_mismatch),
        )
        if ids
    ]
    if lm.only_in_a or lm.only_in_b:
        notes.append(
            f"only the common layers {list(lm.compared)} are compared; "
            f"only in A: {list(lm.only_in_a)}, only in B: {list(lm.only_in_b)}"
        )
    return "".join(f'<p class="note">{escape(n)}</p>' for n in notes)


def html_table(
    header: Sequence[str], rows: Sequence[Sequence[str]], row_classes: Sequence[str] = (), css_class: str = ""
) -> str:
    """An HTML table of escaped strings; the first column is left-aligned (a key), the rest right."""
    head = "".join(f'<th class="{"k" if i == 0 else ""}">{escape(h)}</th>' for i, h in enumerate(header))
    body = []
    for r, cells in enumerate(rows):
        cls = f' class="{row_classes[r]}"' if r < len(row_classes) and row_classes[r] else ""
        body.append(
            f"<tr{cls}>"
            + "".join(f'<td class="{"k" if i == 0 else ""}">{escape(c)}</td>' for i, c in enumerate(cells))
            + "</tr>"
        )
    return f'<table class="{css_class}"><tr>{head}</tr>{"".join(body)}</table>'


def _layer_table(layers: Sequence[LayerDrift]) -> str:
    rows = [
        [
            str(x.layer_id),
            x.layer_type or "?",
            str(x.tokens),
            _num(x.rel_l2),
            _num(x.rel_l2_token_mean),
            _num(x.max_abs),
            _num(x.cosine_mean, ".7f"),
            _num(x.cosine_min, ".7f"),
            str(x.nonfinite_tokens),
        ]
        for x in layers
    ]
    return html_table(
        [
            "layer",
            "type",
            "tokens",
            "rel L2 (pooled)",
            "rel L2 (token mean)",
            "max |a-b|",
            "cosine mean",
            "cosine worst",
            "non-finite",
        ],
        rows,
    )


def _worst_sequences(report: DiffReport, n: int = 10) -> str:
    worst = sorted(report.per_sequence, key=lambda s: -(s.worst_rel_l2 or 0.0))[:n]
    rows = [
        [s.record_id, str(s.tokens), str(s.worst_layer), _num(s.worst_rel_l2), _pct(s.argmax_agreement)]
        for s in worst
    ]
    return html_table(["record id", "tokens", "worst layer", "rel L2 there", "argmax agreement"], rows)


def _provenance_table(report: DiffReport) -> str:
    order = {"differs": 0, "expected": 1, "same": 2}
    rows = sorted(report.provenance.rows, key=lambda r: (order[r.status], r.key))
    shown = [r for r in rows if r.status != "same"]
    same = [r for r in rows if r.status == "same"]
    cells = [[r.key, json.dumps(r.a), json.dumps(r.b)] for r in shown]
    header = ["key", "A", "B"]
    table = (
        html_table(header, cells, [r.status for r in shown], "prov") if shown else "<p>No differences.</p>"
    )
    rest = html_table(header, [[r.key, json.dumps(r.a), json.dumps(r.b)] for r in same], css_class="prov")
    return f"{table}<details><summary>{len(same)} identical keys</summary>{rest}</details>"


def html_page(title: str, body: Sequence[str]) -> str:
    """A whole self-contained page (inline CSS, nothing fetched) around the HTML fragments ``body``;
    its generator tag marks it as ours, which a later --report may replace (store/output_paths.py)."""
    return (
        f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">{GENERATOR_META}<title>{escape(title)}</title>'
        f"<style>{_CSS}</style></head><body>\n" + "\n".join(body) + "\n</body></html>\n"
    )


def diff_sections(report: DiffReport, *, acceptance_html: str | None = None, level: int = 2) -> list[str]:
    """The body of a diff page as HTML fragments, to compose into a larger page (the drift study).

    Args:
        report: what ``hscache.diff.compare.diff_caches`` returned.
        acceptance_html: a per-position acceptance section body, placed after the next-token charts;
            None leaves the section out.
        level: heading level of the section titles (2 on the diff page, 3 inside a study).
    """
    h = f"h{level}"
    return [
        _cards(report),
        _notes(report),
        f"<{h}>Hidden states</{h}>",
        '<div class="charts">',
        *_layer_charts(report.hidden_states),
        "</div>",
        _layer_table(report.hidden_states),
        f"<{h}>Next-token predictions</{h}>",
        '<div class="charts">',
        *_next_token_charts(report),
        "</div>",
        (
            "<p>Margin at risk: A's top-1/top-2 logit margin is below twice the largest logit change seen "
            "at that position, so drift of that size could flip the argmax. KL is over the common top-k "
            "tokens plus one rest bucket (a lower bound on the full KL).</p>"
        ),
        *([f"<{h}>Per-position acceptance</{h}>", acceptance_html] if acceptance_html is not None else []),
        f"<{h}>Worst sequences</{h}>",
        _worst_sequences(report),
        f"<{h}>Provenance</{h}>",
        _provenance_table(report),
    ]


def render_report(report: DiffReport, *, acceptance: Mapping[str, Sequence[float]] | None = None) -> str:
    """The whole HTML page for ``report``.

    Args:
        report: what ``hscache.diff.compare.diff_caches`` returned.
        acceptance: optional ``{cache name: [acceptance per draft position]}`` from scoring one drafter
            on each cache; drawn with ``acceptance_chart``. Without it the section says how to get it.
    """
    a, b = report.cache_a, report.cache_b
    title = f"hscache diff: {Path(a.path).name} vs {Path(b.path).name}"
    accept = (
        acceptance_chart(acceptance)
        if acceptance
        else "<p>Not measured: score one drafter on both caches to see how drift moves acceptance.</p>"
    )
    body = [
        f"<h1>{escape(title)}</h1>",
        (
            f"<p>A (reference): <code>{escape(a.path)}</code> ({escape(a.dtype)}, {escape(a.backend)}, "
            f"{escape(a.device)})<br>B: <code>{escape(b.path)}</code> ({escape(b.dtype)}, {escape(b.backend)}, "
            f"{escape(b.device)})</p>"
        ),
        *diff_sections(report, acceptance_html=accept),
        (
            f"<p><small>hscache {escape(report.hscache_version)}, "
            f"diff schema {report.schema_version}</small></p>"
        ),
    ]
    return html_page(title, body)


def write_report(
    report: DiffReport, path: str | os.PathLike, *, acceptance: Mapping[str, Sequence[float]] | None = None
) -> Path:
    """Write ``render_report(report, acceptance=...)`` to ``path`` atomically; returns the path."""
    from hscache.store.fsio import atomic_write_bytes

    atomic_write_bytes(Path(path), render_report(report, acceptance=acceptance).encode())
    return Path(path)
