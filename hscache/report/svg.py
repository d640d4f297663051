"""Tiny inline-SVG charts (bars and lines) for self-contained HTML reports: no JS, no network.

Each function returns one ``<svg>`` element as a string. Values may be None (drawn as a gap).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from html import escape

__all__ = ["Series", "bar_chart", "gradient", "line_chart", "nice_ticks"]

_W, _H = 720, 300
_LEFT, _RIGHT, _TOP, _BOTTOM = 70, 170, 34, 48  # margins; the legend sits in the right one
_FONT = 'font-family="system-ui,sans-serif" font-size="12"'


@dataclass(frozen=True)
class Series:
    """One line: a value per x label (None: no point), its color and whether it is dashed; ``band``:
    an interval (low, high) per x label (None: none there), drawn as a shaded area behind the line."""

    values: Sequence[float | None]
    color: str
    dashed: bool = False
    band: Sequence[tuple[float, float] | None] | None = None


def nice_ticks(top: float, count: int = 5) -> list[float]:
    """Evenly spaced round tick values from 0 to at least ``top`` (1, 2 or 5 times a power of 10)."""
    if not top > 0 or not math.isfinite(top):
        return [0.0, 1.0]
    raw = top / count
    power = 10 ** math.floor(math.log10(raw))
    step = next(m * power for m in (1, 2, 2.5, 5, 10) if m * power >= raw)
    return [i * step for i in range(int(math.ceil(top / step - 1e-9)) + 1)]


def gradient(n: int, start: str = "#9ecae1", stop: str = "#08306b") -> list[str]:
    """``n`` colors from ``start`` to ``stop`` (light to dark: shallow to deep layers)."""
    a = [int(start[i : i + 2], 16) for i in (1, 3, 5)]
    b = [int(stop[i : i + 2], 16) for i in (1, 3, 5)]
    fractions = [i / max(1, n - 1) for i in range(n)]
    return ["#" + "".join(f"{round(x + (y - x) * f):02x}" for x, y in zip(a, b)) for f in fractions]


def _fmt(v: float, percent: bool) -> str:
    if percent:
        return f"{v * 100:.0f}%" if abs(v * 100 - round(v * 100)) < 1e-9 else f"{v * 100:.1f}%"
    return "0" if v == 0 else (f"{v:.2g}" if 1e-2 <= abs(v) < 1e4 else f"{v:.1e}")


def _frame(title: str, y_label: str, ticks: list[float], percent: bool) -> list[str]:
    """The svg opening, title, y axis with grid lines; the plot area spans ticks[0]..ticks[-1]."""
    plot_h = _H - _TOP - _BOTTOM
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{_W}" height="{_H}" viewBox="0 0 {_W} {_H}" '
        f'role="img" aria-label="{escape(title)}" {_FONT}>',
        f'<rect width="{_W}" height="{_H}" fill="#fff"/>',
        f'<text x="{_LEFT}" y="20" font-size="14" font-weight="600">{escape(title)}</text>',
        f'<text transform="translate(16,{_TOP + plot_h / 2}) rotate(-90)" text-anchor="middle">'
        f"{escape(y_label)}</text>",
    ]
    for t in ticks:
        y = _TOP + plot_h * (1 - t / ticks[-1])
        parts.append(f'<line x1="{_LEFT}" x2="{_W - _RIGHT}" y1="{y:.1f}" y2="{y:.1f}" stroke="#e5e5e5"/>')
        parts.append(f'<text x="{_LEFT - 6}" y="{y + 4:.1f}" text-anchor="end">{_fmt(t, percent)}</text>')
    base = _H - _BOTTOM
    parts.append(f'<line x1="{_LEFT}" x2="{_W - _RIGHT}" y1="{base}" y2="{base}" stroke="#333"/>')
    return parts


def _legend(entries: Mapping[str, tuple[str, bool]]) -> list[str]:
    parts = []
    for i, (name, (color, dashed)) in enumerate(entries.items()):
        y = _TOP + 8 + 18 * i
        dash = ' stroke-dasharray="5,3"' if dashed else ""
        x = _W - _RIGHT + 14
        parts.append(
            f'<line x1="{x}" x2="{x + 24}" y1="{y}" y2="{y}" stroke="{color}" stroke-width="3"{dash}/>'
        )
        parts.append(f'<text x="{_W - _RIGHT + 44}" y="{y + 4}">{escape(name)}</text>')
    return parts


def bar_chart(
    labels: Sequence[str],
    values: Sequence[float | None],
    colors: Sequence[str],
    *,
    title: str,
    y_label: str,
    legend: Mapping[str, str] | None = None,
    percent: bool = False,
    x_label: str = "",
) -> str:
    """Vertical bars, one per label, each with its value printed above it."""
    top = max((v for v in values if v is not None), default=0.0)
    ticks = nice_ticks(1.0 if percent else top)
    parts = _frame(title, y_label, ticks, percent)
    plot_w, plot_h = _W - _LEFT - _RIGHT, _H - _TOP - _BOTTOM
    slot = plot_w / max(1, len(labels))
    for i, (label, value, color) in enumerate(zip(labels, values, colors)):
        x = _LEFT + slot * i + slot * 0.15
        if value is not None:
            h = plot_h * value / ticks[-1]
            y = _H - _BOTTOM - h
            parts.append(
                f'<rect x="{x:.1f}" y="{y:.1f}" width="{slot * 0.7:.1f}" height="{h:.1f}" '
                f'fill="{color}"><title>{escape(label)}: {_fmt(value, percent)}</title></rect>'
            )
            parts.append(
                f'<text x="{x + slot * 0.35:.1f}" y="{y - 4:.1f}" text-anchor="middle" '
                f'font-size="10">{_fmt(value, percent)}</text>'
            )
        parts.append(
            f'<text x="{x + slot * 0.35:.1f}" y="{_H - _BOTTOM + 16}" text-anchor="middle">'
            f"{escape(label)}</text>"
        )
    parts.append(f'<text x="{_LEFT + plot_w / 2}" y="{_H - 8}" text-anchor="middle">{escape(x_label)}</text>')
    parts += _legend({name: (color, False) for name, color in (legend or {}).items()})
    return "\n".join(parts + ["</svg>"])


def _band(name: str, s: Series, xs: Sequence[float], top: float, plot_h: float) -> list[str]:
    """The series' interval as one shaded polygon per run of x labels that have one."""
    if s.band is None:
        return []

    def y(v: float) -> float:
        return _TOP + plot_h * (1 - v / top)

    runs: list[list[tuple[float, tuple[float, float]]]] = [[]]
    for x, b in zip(xs, s.band):
        if b is None:
            runs.append([])
        else:
            runs[-1].append((x, b))
    parts = []
    for run in (r for r in runs if r):
        if len(run) == 1:  # one point: a vertical bar
            x, (lo, hi) = run[0]
            run = [(x - 3, (lo, hi)), (x + 3, (lo, hi))]
        edge = [f"{x:.1f},{y(hi):.1f}" for x, (_, hi) in run] + [
            f"{x:.1f},{y(lo):.1f}" for x, (lo, _) in run[::-1]
        ]
        parts.append(
            f'<polygon points="{" ".join(edge)}" fill="{s.color}" fill-opacity="0.18" stroke="none">'
            f"<title>{escape(name)}: interval</title></polygon>"
        )
    return parts


def line_chart(
    x_labels: Sequence[str],
    series: Mapping[str, Series],
    *,
    title: str,
    y_label: str,
    x_label: str = "",
    percent: bool = False,
) -> str:
    """One polyline per series over shared x labels, with a dot at each defined point."""
    highs = [b[1] for s in series.values() for b in (s.band or ()) if b is not None]
    top = max((v for s in series.values() for v in s.values if v is not None), default=0.0)
    ticks = nice_ticks(1.0 if percent else max([top, *highs]))
    parts = _frame(title, y_label, ticks, percent)
    plot_w, plot_h = _W - _LEFT - _RIGHT, _H - _TOP - _BOTTOM
    step = plot_w / max(1, len(x_labels))
    xs = [_LEFT + step * (i + 0.5) for i in range(len(x_labels))]
    for x, label in zip(xs, x_labels):
        parts.append(f'<text x="{x:.1f}" y="{_H - _BOTTOM + 16}" text-anchor="middle">{escape(label)}</text>')
    for name, s in series.items():
        parts += _band(name, s, xs, ticks[-1], plot_h)
        points = [(x, _TOP + plot_h * (1 - v / ticks[-1])) for x, v in zip(xs, s.values) if v is not None]
        dash = ' stroke-dasharray="5,3"' if s.dashed else ""
        if len(points) > 1:
            path = " ".join(f"{x:.1f},{y:.1f}" for x, y in points)
            parts.append(f'<polyline points="{path}" fill="none" stroke="{s.color}" stroke-width="2"{dash}/>')
        parts += [
            f'<circle cx="{x:.1f}" cy="{y:.1f}" r="3" fill="{s.color}"><title>{escape(name)}</title></circle>'
            for x, y in points
        ]
    parts.append(f'<text x="{_LEFT + plot_w / 2}" y="{_H - 8}" text-anchor="middle">{escape(x_label)}</text>')
    parts += _legend({name: (s.color, s.dashed) for name, s in series.items()})
    return "\n".join(parts + ["</svg>"])
