"""gpu_report.md from gpu_report.json: the steps, then one table per figure (drift, tau, flex, speed)."""

from __future__ import annotations

from typing import Any


def _f(value: Any, digits: int = 4) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}g}"
    return str(value)


def _table(header: list[str], rows: list[list[Any]]) -> list[str]:
    if not rows:
        return ["(no results yet)", ""]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(_f(c) for c in row) + " |" for row in rows]
    return [*lines, ""]


def _ok(steps: dict[str, Any], prefix: str) -> list[tuple[str, dict[str, Any]]]:
    return [(n, s["result"]) for n, s in steps.items() if n.startswith(prefix) and s["status"] == "ok"]


def _note(step: dict[str, Any]) -> str:
    if step.get("error"):
        return step["error"].splitlines()[0][:160].replace("|", "/")
    return (step.get("reason") or "").replace("|", "/")[:160]


def render_markdown(doc: dict[str, Any]) -> str:
    """The whole report as markdown; every table is rebuilt from the JSON, so it is never stale."""
    steps = doc["steps"]
    plan = doc["plan"]
    env = steps.get("environment", {}).get("result") or {}
    mode = "DRY RUN (CPU, tiny sizes, torch standing in for fla)" if plan["dry_run"] else "GPU run"
    lines = [
        "# GPU check report",
        "",
        f"{mode}; started {doc['started_at']}, {doc.get('elapsed_s', 0):.0f} s so far"
        + (f", finished {doc['finished_at']}" if doc.get("finished_at") else " (not finished)"),
        f"GPU: {env.get('gpu_name') or '-'}; torch {env.get('versions', {}).get('torch')}, "
        f"transformers {env.get('versions', {}).get('transformers')}, "
        f"fla {env.get('versions', {}).get('flash-linear-attention')}; fla usable: {env.get('fla_usable')}",
        "",
        "## Steps",
        "",
    ]
    lines += _table(
        ["step", "status", "s", "note"],
        [[n, s["status"], s.get("seconds"), _note(s)] for n, s in steps.items()],
    )
    lines += ["## Drift (A is the reference; hidden-state rel L2 per layer, next-token argmax)", ""]
    rows = []
    for name, r in _ok(steps, ""):
        if ".diff." in name:
            per_layer = ", ".join(f"{x['layer_id']}:{_f(x['rel_l2'], 3)}" for x in r["layers"])
            rows.append(
                [name, r["tokens"], per_layer, r["worst_rel_l2"], r["argmax_agreement"], r["argmax_flips"]]
            )
    lines += _table(["pair", "tokens", "rel L2 by layer", "worst", "argmax agree", "flips"], rows)
    lines += ["## Tau (pooled, fp32 drafter) per cache and device", ""]
    rows = []
    for name, r in _ok(steps, ""):
        if name.endswith(".tau"):
            for label, row in r["caches"].items():
                rows.append(
                    [
                        name.split(".")[0],
                        label,
                        row["tau_cpu"],
                        row["tau_gpu"],
                        row["delta_vs_reference_gpu"],
                        row.get("cpu_gpu_tau_diff"),
                        row.get("cpu_gpu_round_agreement"),
                    ]
                )
    lines += _table(
        ["target", "cache", "tau CPU", "tau GPU", "delta vs ref (GPU)", "GPU - CPU", "rounds agree"], rows
    )
    lines += ["## flex_attention vs SDPA (drafter block states, same blocks)", ""]
    rows = [
        [name.split(".")[0], dtype, v["rel_l2"], v["max_abs"], v["argmax_agreement"], v["drafted_positions"]]
        for name, r in _ok(steps, "")
        if name.endswith(".flex_vs_sdpa")
        for dtype, v in r.items()
    ]
    lines += _table(["target", "dtype", "rel L2", "max abs", "argmax agree", "positions"], rows)
    lines += ["## Sampled extraction (fla; stored = teacher-forced processed distribution)", ""]
    rows = [
        [
            r["setting"].split(";")[0],
            r["generated_tokens_per_s"],
            r["slowdown_vs_greedy"],
            r["sampled_positions"],
            r["realised_outside_support"],
            f"{r['largest_support']}/{r['support_width']}",
        ]
        for _, r in _ok(steps, "sampled.extract.")
    ]
    lines += _table(
        [
            "setting",
            "generated tokens/s",
            "x slower than greedy",
            "drawn",
            "outside support",
            "support/width",
        ],
        rows,
    )
    lines += ["## Throughput", ""]
    rows = [
        [
            "extract",
            r["generate_batch"] or "default",
            r["device"],
            r["backend"],
            r["tokens_per_s"],
            r["generated_tokens_per_s"],
        ]
        for _, r in _ok(steps, "throughput.extract.")
    ]
    rows += [
        [
            "eval {0} {2} ({3} side)".format(*name.split(".")),
            "-",
            r["device"],
            r["attention_backend"],
            r["tokens_per_s"],
            None,
        ]
        for name, r in _ok(steps, "")
        if ".eval." in name
    ]
    lines += _table(["what", "generate batch", "device", "backend", "tokens/s", "generated tokens/s"], rows)
    return "\n".join(lines) + "\n"
