"""The drift study's report: the JSON document (``schemas/drift_study.schema.json``), the HTML page
and the terminal summary. Nothing is measured here; numbers come from the diff and eval reports.

The HTML page is one self-contained file composed of the pieces the diff page
(``hscache.report.html``) and the eval page (``scorer.report.html``) are made of.
"""

from __future__ import annotations

import importlib.metadata
import os
from collections.abc import Mapping, Sequence
from html import escape
from pathlib import Path
from typing import Any

import hscache
from hscache import schemas
from hscache.capture.provenance import git_commit, utc_now
from hscache.diff.report import DiffReport
from hscache.report.html import diff_sections, html_page, html_table
from hscache.report.svg import Series, line_chart
from scorer.report.html import acceptance_section, tau_table

__all__ = [
    "DRIFT_STUDY_SCHEMA_VERSION",
    "METHOD",
    "build_document",
    "format_summary",
    "render_html",
    "write_html",
]

DRIFT_STUDY_SCHEMA_VERSION = 1
METHOD = (
    "The reference setting generates the greedy text; every other setting runs one teacher-forced "
    "forward over exactly those token ids (max_new_tokens 0), so all caches hold the same tokens "
    "and differ only by numerics. Each setting's tau is scored on the reference's generated region; "
    "where a setting's own argmax leaves that text, its replay is off its greedy path (counted under "
    "off_greedy), so its tau is a lower bound there."
)
# Provenance keys that differ between the reference and a replay cache by construction of the study.
_BY_CONSTRUCTION = ("prompts.", "capture.max_new_tokens", "command_line")
_COLORS = ["#f58518", "#54a24b", "#e45756", "#72b7b2", "#b279a2", "#4c78a8"]


def _setting_entry(setting: Any, path: Path, reference: bool) -> dict[str, Any]:
    cache = hscache.open_cache(path)
    capture = cache.provenance.get("capture", {})
    return {
        "name": setting.name,
        "spec": setting.spec,
        "reference": reference,
        "cache": str(path),
        "backend_requested": setting.backend,
        "backend": str(cache.settings["backend"]),
        "dtype": setting.dtype,
        "device": setting.device,
        "sequences": len(cache),
        "tokens": cache.num_tokens,
        "kernels": {name: k.get("backend") for name, k in sorted(capture.get("kernels", {}).items())},
        "attn_implementation": capture.get("attn_implementation"),
    }


def _diff_entry(name: str, report: DiffReport, out: Path) -> dict[str, Any]:
    d = report.to_dict()
    worst = report.worst_layer()
    keep = ("layer_id", "layer_type", "rel_l2", "rel_l2_token_mean", "max_abs", "cosine_min")
    differing = list(report.provenance.differing)
    nt = d["next_token"]
    return {
        "setting": name,
        "json": str(out / "diffs" / f"{name}.json"),
        "sequences_compared": report.sequences.compared,
        "tokens_compared": report.sequences.tokens,
        "layers": [{k: layer[k] for k in keep} for layer in d["hidden_states"]],
        "worst_layer": None if worst is None else {"layer_id": worst.layer_id, "rel_l2": worst.rel_l2},
        "next_token": {
            k: nt[k]
            for k in (
                "argmax_agreement",
                "argmax_flips",
                "topk_overlap",
                "kl_mean",
                "kl_max",
                "margin_at_risk",
            )
        },
        "provenance_differences": [k for k in differing if not k.startswith(_BY_CONSTRUCTION)],
        "provenance_by_construction": [k for k in differing if k.startswith(_BY_CONSTRUCTION)],
    }


def _score_entry(
    checkpoint: Mapping[str, Any], result: Mapping[str, Any], names: Sequence[str], out: Path
) -> dict[str, Any]:
    reports = result["reports"]
    per_setting = [
        {
            "setting": name,
            "tau": r["tau"],
            "requests": r["requests"],
            "rounds": r["rounds"],
            "tokens": r["tokens"],
            "acceptance_conditional": r["acceptance"]["conditional"],
            "acceptance_unconditional": r["acceptance"]["unconditional"],
            "train_accept_len": r["train_accept_len"],
            "off_greedy": r["off_greedy"],
            "warnings": r["warnings"],
        }
        for name, r in zip(names, reports)
    ]
    comparisons = [
        {
            "setting": name,
            "requests_compared": c["requests_compared"],
            "requests_left_out": c["requests_left_out"],
            "delta": c["delta"],
            "rounds_compared": c["rounds_compared"],
            "rounds_with_changed_acceptance": c["rounds_with_changed_acceptance"],
        }
        for name, c in zip(names[1:], result["comparisons"])
    ]
    return {
        "checkpoint": str(checkpoint["path"]),
        "label": checkpoint["label"],
        "trained_here": checkpoint["trained_here"],
        "checkpoint_sha256": reports[0]["checkpoint"]["sha256"],
        "json": str(out / "scores" / f"{checkpoint['label']}.json"),
        "per_setting": per_setting,
        "comparisons": comparisons,
    }


def build_document(
    config: Any,
    caches: Mapping[str, Path],
    diffs: Mapping[str, DiffReport],
    checkpoints: Sequence[Mapping[str, Any]],
    scores: Sequence[Mapping[str, Any]],
    *,
    seconds: float,
) -> dict[str, Any]:
    """The study's JSON document, validated against ``schemas/drift_study.schema.json``.

    Raises:
        schemas.SchemaError: the document breaks the schema (a bug, not a user error).
    """
    out = Path(config.out)
    ref = config.reference_setting
    names = list(caches)  # reference first, then the others in settings order (scoring order too)
    document = {
        "schema_version": DRIFT_STUDY_SCHEMA_VERSION,
        "hscache_version": importlib.metadata.version("hscache"),
        "hscache_git_commit": git_commit(),
        "created_at": utc_now(),
        "seconds": seconds,
        "config": config.to_dict(),
        "method": METHOD,
        "reference": ref.name,
        "settings": [_setting_entry(s, caches[s.name], s == ref) for s in config.settings],
        "diffs": [_diff_entry(name, diffs[name], out) for name in names if name in diffs],
        "scores": [_score_entry(c, r, names, out) for c, r in zip(checkpoints, scores)],
        "outputs": {"json": str(out / "drift_study.json"), "html": str(out / "drift_study.html")},
    }
    schemas.validate(document, "drift_study")
    return document


# ---------------------------------------------------------------- HTML


def _f(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def _summary_table(document: Mapping[str, Any]) -> str:
    diffs = {d["setting"]: d for d in document["diffs"]}
    header = ["setting", "backend / kernels", "worst layer rel. L2", "argmax agreement", "KL mean"]
    for score in document["scores"]:
        header += [
            f"{score['label']}: tau pooled",
            f"{score['label']}: delta pooled [95%]",
            f"{score['label']}: rounds changed",
        ]
    rows = []
    for s in document["settings"]:
        d = diffs.get(s["name"])
        kernels = ", ".join(sorted(set(map(str, s["kernels"].values())))) or "-"
        cells = [
            s["name"] + (" (reference)" if s["reference"] else ""),
            f"{s['backend']} / {kernels}",
            _f(d and d["worst_layer"] and d["worst_layer"]["rel_l2"], ".2e") if d else "-",
            _f(d["next_token"]["argmax_agreement"], ".2%") if d else "-",
            _f(d["next_token"]["kl_mean"], ".2e") if d else "-",
        ]
        for score in document["scores"]:
            tau = next(p["tau"] for p in score["per_setting"] if p["setting"] == s["name"])
            comp = next((c for c in score["comparisons"] if c["setting"] == s["name"]), None)
            delta = comp and comp["delta"]["pooled"]
            cells += [
                _f(tau["pooled"], ".3f"),
                f"{delta['delta']:+.3f} [{delta['lo']:+.3f}, {delta['hi']:+.3f}]" if delta else "-",
                (f"{comp['rounds_with_changed_acceptance']} of {comp['rounds_compared']}" if comp else "-"),
            ]
        rows.append(cells)
    return html_table(header, rows)


def _layers_chart(document: Mapping[str, Any]) -> str:
    layer_ids = [layer["layer_id"] for layer in document["diffs"][0]["layers"]] if document["diffs"] else []
    series = {}
    for i, d in enumerate(document["diffs"]):
        by_id = {layer["layer_id"]: layer["rel_l2"] for layer in d["layers"]}
        series[d["setting"]] = Series([by_id.get(k) for k in layer_ids], _COLORS[i % len(_COLORS)])
    return line_chart(
        [str(k) for k in layer_ids],
        series,
        title=f"Relative L2 error per layer vs {document['reference']}",
        y_label="||a - b|| / ||a||",
        x_label="layer",
    )


def render_html(
    document: Mapping[str, Any], diffs: Mapping[str, DiffReport], scores: Sequence[Mapping[str, Any]]
) -> str:
    """The whole study page: summary, drift per layer, tau per checkpoint, each setting's diff."""
    config, ref = document["config"], document["reference"]
    names = [ref] + [d["setting"] for d in document["diffs"]]
    title = f"Drift study: {config['model']}"
    body = [
        f"<h1>{escape(title)}</h1>",
        (
            f"<p>Settings {escape(', '.join(config['settings']))}; reference <b>{escape(ref)}</b>; "
            f"{document['settings'][0]['sequences']} sequences, {document['settings'][0]['tokens']} tokens; "
            f"prompts <code>{escape(str(config['prompts']))}</code>.</p>"
        ),
        f"<p>{escape(document['method'])}</p>",
        "<h2>Summary</h2>",
        _summary_table(document),
        '<div class="charts">',
        _layers_chart(document),
        "</div>",
    ]
    for score, result in zip(document["scores"], scores):
        trained = (
            " (trained here on the reference cache: it shows the pipeline, not a benchmark)"
            if score["trained_here"]
            else ""
        )
        body += [
            f"<h2>Tau: {escape(score['label'])}</h2>",
            f"<p>Checkpoint <code>{escape(score['checkpoint'])}</code>{escape(trained)}.</p>",
            tau_table(result, names),
            acceptance_section(result, names),
        ]
    for d in document["diffs"]:
        note = ", ".join(d["provenance_by_construction"])
        body += [
            f"<h2>{escape(d['setting'])} vs {escape(ref)}</h2>",
            (
                f"<p>Provenance differences that matter: "
                f"<b>{escape(', '.join(d['provenance_differences']) or 'none')}</b>. By construction of "
                f"the study (listed in the table below as well): {escape(note or 'none')}.</p>"
            ),
            *diff_sections(diffs[d["setting"]], level=3),
        ]
    body.append(
        f"<p><small>hscache {escape(document['hscache_version'])}, drift study schema "
        f"{document['schema_version']}, {document['created_at']}</small></p>"
    )
    return html_page(title, body)


def write_html(
    document: Mapping[str, Any],
    diffs: Mapping[str, DiffReport],
    scores: Sequence[Mapping[str, Any]],
    path: str | os.PathLike,
) -> Path:
    """Write ``render_html(...)`` to ``path`` atomically; returns the path."""
    from hscache.store.fsio import atomic_write_bytes

    atomic_write_bytes(Path(path), render_html(document, diffs, scores).encode())
    return Path(path)


def format_summary(document: Mapping[str, Any]) -> str:
    """A few lines for the terminal: drift and tau per setting, and where the report is."""
    lines = [f"reference {document['reference']}"]
    for d in document["diffs"]:
        worst, nt = d["worst_layer"], d["next_token"]
        lines.append(
            f"{d['setting']:<20} worst layer {worst['layer_id'] if worst else '-'} rel L2 "
            f"{_f(worst and worst['rel_l2'], '.2e')}, "
            f"argmax agreement {_f(nt['argmax_agreement'], '.2%')}"
        )
    for score in document["scores"]:
        for p in score["per_setting"]:
            comp = next((c for c in score["comparisons"] if c["setting"] == p["setting"]), None)
            delta = comp and comp["delta"]["pooled"]
            extra = f", delta {delta['delta']:+.3f} [{delta['lo']:+.3f}, {delta['hi']:+.3f}]" if delta else ""
            lines.append(
                f"{score['label']} on {p['setting']:<20} "
                f"tau per request {_f(p['tau']['per_request'], '.3f')}, "
                f"pooled {_f(p['tau']['pooled'], '.3f')}{extra}"
            )
    lines.append(f"wrote {document['outputs']['json']} and {document['outputs']['html']}")
    return "\n".join(lines)
