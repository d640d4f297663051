"""The outputs of ``scorer sweep``: one row per checkpoint, as JSON, CSV and a plot.

sweep.html is self-contained (inline SVG, no scripts, no network): tau (per request and pooled)
and per-position acceptance against the training step. With matplotlib installed the same two
plots are also written to sweep.png. Steps are drawn evenly spaced, in order (labels carry
the values): checkpoints are often saved at growing intervals.
"""

from __future__ import annotations

import csv
import io
from html import escape
from pathlib import Path
from typing import Any

from hscache.report.svg import Series, gradient, line_chart
from hscache.store import fsio
from hscache.store.output_paths import GENERATOR_META

__all__ = ["report_row", "write_outputs"]


def report_row(
    step: int, checkpoint: Path, result_file: Path, report: dict[str, Any], reused: bool
) -> dict[str, Any]:
    """One table row: the numbers of one checkpoint's report."""
    tau = report["tau"]
    return {
        "step": step,
        "checkpoint": str(checkpoint),
        "checkpoint_sha256": report["checkpoint"]["sha256"],
        "tau_per_request": tau["per_request"],
        "tau_pooled": tau["pooled"],
        "tau_per_request_ci95": tau["per_request_ci95"],
        "tau_pooled_ci95": tau["pooled_ci95"],
        "train_accept_len": report["train_accept_len"],
        "acceptance_conditional": report["acceptance"]["conditional"],
        "acceptance_unconditional": report["acceptance"]["unconditional"],
        "ddtree": report["ddtree"],
        "rounds": report["rounds"],
        "tokens": report["tokens"],
        "requests": report["requests"],
        "result_file": str(result_file),
        "reused": reused,
    }


def _csv(rows: list[dict[str, Any]]) -> str:
    slots = max((len(r["acceptance_conditional"]) for r in rows), default=0)
    budgets = sorted({b for r in rows for b in r["ddtree"]}, key=int)
    header = [
        "step",
        "checkpoint",
        "checkpoint_sha256",
        "tau_per_request",
        "tau_pooled",
        "tau_per_request_lo",
        "tau_per_request_hi",
        "train_accept_len",
        *[f"accept_cond_{j + 1}" for j in range(slots)],
        *[f"accept_uncond_{j + 1}" for j in range(slots)],
        *[f"ddtree_{b}" for b in budgets],
        "rounds",
        "tokens",
        "requests",
        "reused",
    ]
    sink = io.StringIO()
    writer = csv.writer(sink, lineterminator="\n")
    writer.writerow(header)
    for r in rows:
        ci = r["tau_per_request_ci95"] or [None, None]
        cond = list(r["acceptance_conditional"]) + [None] * (slots - len(r["acceptance_conditional"]))
        uncond = list(r["acceptance_unconditional"]) + [None] * (slots - len(r["acceptance_unconditional"]))
        writer.writerow(
            [
                r["step"],
                r["checkpoint"],
                r["checkpoint_sha256"],
                r["tau_per_request"],
                r["tau_pooled"],
                *ci,
                r["train_accept_len"],
                *cond,
                *uncond,
                *[r["ddtree"].get(b) for b in budgets],
                r["rounds"],
                r["tokens"],
                r["requests"],
                r["reused"],
            ]
        )
    return sink.getvalue()  # csv writes None as an empty cell


def _charts(rows: list[dict[str, Any]]) -> list[str]:
    steps = [str(r["step"]) for r in rows]
    tau = line_chart(
        steps,
        {
            "tau per request": Series([r["tau_per_request"] for r in rows], "#08519c"),
            "tau pooled": Series([r["tau_pooled"] for r in rows], "#e6550d", dashed=True),
        },
        title="Acceptance length tau by training step",
        y_label="tau",
        x_label="training step",
    )
    slots = max((len(r["acceptance_conditional"]) for r in rows), default=0)
    colors = gradient(slots)
    series = {
        f"slot {j + 1}": Series([(r["acceptance_conditional"] + [None] * slots)[j] for r in rows], colors[j])
        for j in range(slots)
    }
    accept = line_chart(
        steps,
        series,
        title="Per-position acceptance (conditional) by training step",
        y_label="acceptance",
        x_label="training step",
        percent=True,
    )
    return [tau, accept]


def _html(document: dict[str, Any]) -> str:
    rows = document["rows"]
    cells = "".join(
        f"<tr><td>{r['step']}</td><td>{escape(Path(r['checkpoint']).name)}</td>"
        f"<td>{_fmt(r['tau_per_request'])}</td><td>{_fmt(r['tau_pooled'])}</td>"
        f"<td>{_fmt(r['train_accept_len'])}</td><td>{r['requests']}</td></tr>"
        for r in rows
    )
    table = (
        "<table><tr><th>step</th><th>checkpoint</th><th>tau per request</th><th>tau pooled</th>"
        f"<th>train accept len</th><th>requests</th></tr>{cells}</table>"
    )
    title = f"Sweep of {escape(document['run_dir'])}"
    held = document["cache"]["sequences"]
    scored = max((r["requests"] for r in rows if r["requests"] is not None), default=held)
    sequences = f"{scored} sequences" if scored == held else f"{scored} of its {held} sequences scored"
    return (
        f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">{GENERATOR_META}<title>{title}</title>'
        "<style>body{font-family:system-ui,sans-serif;margin:2em}td,th{padding:2px 10px;text-align:right}"
        "</style></head><body>"
        f"<h1>{title}</h1><p>cache {escape(document['cache']['path'])} ({sequences}), "
        f"{len(rows)} checkpoints</p>{''.join(_charts(rows))}{table}</body></html>\n"
    )


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.4f}"


def _png(document: dict[str, Any], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False  # optional: sweep.html always carries the same plots
    rows = document["rows"]
    steps = [r["step"] for r in rows]
    fig, (ax_tau, ax_acc) = plt.subplots(1, 2, figsize=(11, 4))
    ax_tau.plot(steps, [r["tau_per_request"] for r in rows], "o-", label="tau per request")
    ax_tau.plot(steps, [r["tau_pooled"] for r in rows], "s--", label="tau pooled")
    ax_tau.set(xlabel="training step", ylabel="tau", title="tau by step")
    ax_tau.legend()
    slots = max((len(r["acceptance_conditional"]) for r in rows), default=0)
    for j in range(slots):
        ax_acc.plot(
            steps,
            [(r["acceptance_conditional"] + [None] * slots)[j] for r in rows],
            "o-",
            label=f"slot {j + 1}",
        )
    ax_acc.set(xlabel="training step", ylabel="conditional acceptance", title="per-position acceptance")
    ax_acc.legend(fontsize="small")
    fig.tight_layout()
    sink = io.BytesIO()
    fig.savefig(sink, format="png", dpi=100)
    plt.close(fig)
    fsio.atomic_write_bytes(path, sink.getvalue())
    return True


def write_outputs(document: dict[str, Any], out: Path) -> dict[str, str]:
    """Write sweep.json, sweep.csv, sweep.html (and sweep.png with matplotlib) into ``out``.

    Returns:
        {"json", "csv", "html"[, "png"]} -> the paths written.
    """
    out.mkdir(parents=True, exist_ok=True)
    outputs = {"json": out / "sweep.json", "csv": out / "sweep.csv", "html": out / "sweep.html"}
    fsio.atomic_write_bytes(outputs["csv"], _csv(document["rows"]).encode())
    fsio.atomic_write_bytes(outputs["html"], _html(document).encode())
    if _png(document, out / "sweep.png"):
        outputs["png"] = out / "sweep.png"
    names = {k: str(v) for k, v in outputs.items()}
    fsio.atomic_write_json(outputs["json"], {**document, "outputs": names})
    return names
