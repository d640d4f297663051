"""Rendering of ``scorer diagnose`` reports: a terminal table and a self-contained HTML page.

No number is computed here: both draw what ``scorer.diagnose.run.diagnose_checkpoint`` returned.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from html import escape
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from hscache.report.html import html_page, html_table

__all__ = ["render_diagnose", "render_diagnose_html", "write_diagnose_html"]


_SIGNED = ("position_offset", "layer_ids")  # values that are shifts


def _value(v: Any, kind: str = "") -> str:
    return "-" if v is None else (f"{v:+d}" if kind in _SIGNED and isinstance(v, int) else str(v))


def _rows(report: Mapping[str, Any]) -> list[list[str]]:
    rows = []
    for h in report["hypotheses"]:
        what = "" if h["fix"] else " [not a fix]"
        rows.append(
            [
                h["kind"],
                _value(h["value"], h["kind"]),
                h["label"] + what,
                f"{h['tau_pooled']:.3f}",
                f"{h['gain']:+.3f}",
                f"[{h['ci'][0]:+.3f}, {h['ci'][1]:+.3f}]",
                "yes" if h["significant"] else "",
            ]
        )
    return rows


_HEADER = ["kind", "value", "hypothesis", "tau pooled", "gain", "interval", "significant"]


def _summary(report: Mapping[str, Any]) -> str:
    sample = report["sample"]
    if sample["limit"] is not None:
        how = f"--limit {sample['limit']}"
    elif sample["sequences"] > sample["first"]:
        how = (
            f"first {sample['first']}, grown to what the observed variance says separates "
            f"{sample['resolution']} tau (needed {sample['needed']}, at most {sample['max']})"
        )
    else:
        how = (
            f"default {sample['default']}; {sample['needed']} needed to separate {sample['resolution']} tau "
            "by the observed variance"
        )
    sampling = report.get("sampling")
    matched = ""
    if sampling and sampling["rule"] == "one-hot":
        matched = (
            f"; a sampled cache ({sampling['described']}): drafts along the sampled trajectory matched "
            "against the cached sampled tokens (the one-hot rule, as served)"
        )
    return (
        f"baseline tau pooled {report['baseline']['tau_pooled']:.3f} (tokens per round incl. the bonus token, "
        f"all rounds pooled) on {sample['sequences']} of {sample['of']} sequences (seeded sample, seed "
        f"{sample['seed']}; {how}), anchors {sample['anchors']}; "
        f"intervals: paired bootstrap over requests at {report['level']:.2%} (95 % split over the "
        f"{len(report['hypotheses'])} hypotheses tried){matched}"
    )


def _extra_lines(report: Mapping[str, Any]) -> list[str]:
    lines = []
    drift = report.get("drift")
    if drift:
        per_layer = ", ".join(f"layer {k}: {v:.2e}" for k, v in drift["per_layer_rel_l2"].items())
        line = f"second cache {drift['cache']}: relative L2 drift per layer {per_layer}"
        if drift["tau_delta"]:
            line += f"; tau delta on it {drift['tau_delta']['delta']:+.3f}"
        if drift["noise_tau_delta"]:
            line += f"; the same drift as noise on this cache {drift['noise_tau_delta']['delta']:+.3f}"
        if drift["explained_fraction"] is not None:
            line += f" (explains {drift['explained_fraction']:.0%} of it)"
        lines.append(line)
    tm = report.get("train_metric")
    if tm:

        def num(x: float | None) -> str:
            return "-" if x is None else f"{x:.3f}"

        tau_minus_one = report["baseline"]["tau_pooled"] - 1
        lines.append(
            f"training metric {tm['value']:.3f} ({tm['definition']}; tau - 1 here is {tau_minus_one:.3f}); "
            "the same metric on this cache: "
            f"{num(tm['train_accept_len'])} as configured (gap {num(tm['gap'])}), {num(tm['train_accept_len_best'])} "
            f"with the best alternative {tm['best_kind']}={_value(tm['best_value'], tm['best_kind'] or '')} (gap left {num(tm['gap_after_best'])})"
        )
    runner = report.get("runner_up")
    if runner:
        lines.append(
            f"top fix against the runner-up {runner['label']}: {runner['delta']:+.3f} "
            f"[{runner['ci'][0]:+.3f}, {runner['ci'][1]:+.3f}] (paired; a finding needs it above zero)"
        )
    lines += [f"untested {u['kind']}: {u['reason']}" for u in report["untested"]]
    return lines


def render_diagnose(report: Mapping[str, Any], console: Console) -> None:
    """The ranked table, notes, warnings, then the verdict as the last line."""
    table = Table(title=f"scorer diagnose: {report['checkpoint']['path']} on {report['cache']['path']}")
    table.add_column("hypothesis (kind=value)", ratio=3)
    for col in ("tau", "gain", "interval", "sig."):
        table.add_column(col, justify="right", no_wrap=True)
    for kind, value, label, tau, gain, interval, significant in _rows(report):
        table.add_row(f"{label} [dim]({kind}={value})[/]", tau, gain, interval, "*" if significant else "")
    console.print(_summary(report))
    console.print(table)
    for line in _extra_lines(report):
        console.print(line)
    for note in report["notes"]:
        console.print(f"[bold cyan]note:[/] {note}")
    for warning in report["warnings"]:
        console.print(f"[bold yellow]warning:[/] {warning}")
    console.print(f"[bold]verdict:[/] {report['verdict']}")


def render_diagnose_html(report: Mapping[str, Any]) -> str:
    """The whole page for one diagnose report."""
    title = f"scorer diagnose: {Path(str(report['checkpoint']['path'])).name}"
    # "differs" (the shared CSS's highlighted row) marks the significant fixes; non-fixes are greyed
    classes = [
        "differs" if h["significant"] and h["fix"] else ("expected" if not h["fix"] else "")
        for h in report["hypotheses"]
    ]
    body = [
        f"<h1>{escape(title)}</h1>",
        f"<p><b>Verdict:</b> {escape(report['verdict'])}</p>",
        *[f'<p class="note">warning: {escape(w)}</p>' for w in report["warnings"]],
        f"<p>{escape(_summary(report))}.</p>",
        "<h2>Hypotheses, by tau gain</h2>",
        html_table(_HEADER, _rows(report), row_classes=classes),
        *[f"<p>{escape(line)}</p>" for line in _extra_lines(report)],
        *[f'<p class="note">{escape(n)}</p>' for n in report["notes"]],
        "<p>Each hypothesis replays the same sequences with one setting changed. A finding is the "
        "fix with the largest gain when its interval lies above zero against both the configured "
        "setting and the runner-up fix (paired); otherwise the verdict names the two it could not "
        "separate and the --limit estimated to separate them, or none when the best alternative's "
        "interval rules out a gain of the resolution. Ablations and the second cache are reported, "
        "never a finding.</p>",
    ]
    return html_page(title, body)


def write_diagnose_html(report: Mapping[str, Any], path: str | os.PathLike) -> Path:
    """Write ``render_diagnose_html(report)`` to ``path`` atomically; returns the path."""
    from hscache.store.fsio import atomic_write_bytes

    atomic_write_bytes(Path(path), render_diagnose_html(report).encode())
    return Path(path)
