"""Terminal rendering of eval reports (rich tables); no numbers are computed here."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table

from scorer.report.served import render_served
from scorer.report.text import readable

__all__ = ["exact_slice_line", "render_comparison", "render_report"]


def _f(x: Any, digits: int = 3) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def _ci(pair: Any) -> str:
    return "" if not pair else f"[{pair[0]:.2f}, {pair[1]:.2f}]"


def render_report(report: dict[str, Any], console: Console) -> None:
    tau = report["tau"]
    # The registry imports every family (torch): imported here, so `scorer --help` stays torch-free.
    from scorer.families import display_name

    family = display_name(report["drafter"].get("family", "dflash"))
    head = Table(
        title=f"{family} replay: {report['checkpoint']['path']} on {report['cache']['path']}",
        show_header=True,
    )
    # tau is the headline number: say what it is where it is first printed.
    console.print(
        "tau = tokens each target forward yields: the accepted draft tokens + 1 bonus token "
        "(1.0: the drafter never helps; at most the block size)"
    )
    head.add_column("metric")
    head.add_column("value", justify="right")
    head.add_column("95% CI", justify="right")
    head.add_row("tau, per request then mean (DFlash)", _f(tau["per_request"]), _ci(tau["per_request_ci95"]))
    head.add_row("tau, pooled over rounds (vLLM/SGLang)", _f(tau["pooled"]), _ci(tau["pooled_ci95"]))
    head.add_row("train-log accept length (all anchors, no +1)", _f(report["train_accept_len"]), "")
    if report.get("teacher_forced"):
        head.add_row(
            "  same, teacher-forced steps > 0 (training-style)",
            _f(report["teacher_forced"]["accept_len"]),
            "",
        )
    if report.get("tree"):
        tree, tree_tau = report["tree"], report["tree"]["tau"]
        shape = f"{tree['steps']},{tree['topk']},{tree['draft_tokens']}"
        head.add_row(
            f"SGLang tree {shape} tau (pooled)", _f(tree_tau["pooled"]), _ci(tree_tau["pooled_ci95"])
        )
    for metric in report.get("family_metrics", {}).values():
        head.add_row(metric["label"], _f(metric["value"]), "")
    for budget, value in report["ddtree"].items():
        head.add_row(
            f"DDTree-{budget} tau (per request)",
            _f(value),
            _ci(report["ddtree_detail"][budget]["per_request_ci95"]),
        )
        head.add_row(
            f"DDTree-{budget} draft-only surrogate (estimate)", _f(report["ddtree_surrogate"][budget]), ""
        )
    # the probabilistic rule's rounds are E[rounds | y], a real number (was printed as 981.4157143710868)
    rounds = report["rounds"]
    head.add_row(
        "requests / E\\[rounds] / tokens" if isinstance(rounds, float) else "requests / rounds / tokens",
        f"{report['requests']} / {rounds:.1f} / {report['tokens']}"
        if isinstance(rounds, float)
        else f"{report['requests']} / {rounds} / {report['tokens']}",
        "",
    )
    head.add_row("rounds cut short by off-greedy text", str(report["off_greedy"]["rounds_cut_short"]), "")
    cache = report["cache"]
    if cache.get("complete") is False:
        of = f" of {cache['expected_sequences']}" if cache.get("expected_sequences") else ""
        head.add_row("[bold red]cache INCOMPLETE[/]", f"{cache.get('committed_sequences')}{of} sequences", "")
    console.print(head)
    _render_exact_slice(report, console)
    render_served(report, console)  # a sampled cache: the rule, the setting, tau as served
    _render_config_sources(report, console)
    # Under the probabilistic rule tau and rounds above are its own; what follows is the one-hot
    # replay along the cached y (said in each title, so no table passes for the other rule's).
    one_hot = (
        " (one-hot rule along the cached tokens, not the probabilistic tau above)"
        if (report.get("sampling") or {}).get("rule") == "probabilistic"
        else ""
    )
    acc = Table(title=f"per-position acceptance (slot 1 first){one_hot}")
    acc.add_column("slot", justify="right")
    acc.add_column("conditional", justify="right")
    acc.add_column("unconditional", justify="right")
    for j, (c, u) in enumerate(
        zip(report["acceptance"]["conditional"], report["acceptance"]["unconditional"]), 1
    ):
        acc.add_row(str(j), _f(c), _f(u))
    if report.get("anchors", {}).get("mode") != "chain":  # chain mode has none: it says so in warnings
        console.print(acc)
    hist = report["tokens_per_round_histogram"]
    console.print(f"tokens per round{one_hot}: " + "  ".join(f"{n}:{c}" for n, c in enumerate(hist, 1) if c))
    if report["per_category"]:
        cats = Table(title=f"per category{one_hot}")
        for col in ("category", "requests", "tau per request", "tau pooled"):
            cats.add_column(col)
        for name, row in report["per_category"].items():
            cats.add_row(name, str(row["n_requests"]), _f(row["tau_per_request"]), _f(row["tau_pooled"]))
        console.print(cats)
    if report["samples"]:
        console.print(
            "sample rounds: after the context, each slot's drafted token and the target's greedy token "
            "(x: they differ; a round accepts the slots before the first x, plus 1 bonus token)"
        )
    for sample in report["samples"]:
        _render_sample(sample, console)
    for warning in report["warnings"]:
        console.print(f"[bold yellow]warning:[/] {warning}")
    for note in report.get("notes", []):
        console.print(f"[bold]note:[/] {note}")


def exact_slice_line(drift: dict[str, Any], markup: bool = True) -> str:
    """A compact cache's drift line: its exact slice scored both ways (scorer/studies/exact_slice.py);
    ``markup``: rich's, for a console (False: plain text, e.g. ``scorer compare``'s per-drafter lines)."""
    d, tau = drift["delta"]["per_request"], drift["tau"]
    excludes = "[bold yellow](excludes 0)[/]" if markup else "(excludes 0)"
    return (
        f"fp8 states, exact slice of {drift['requests']} requests: tau per request "
        f"{_f(tau['compact']['per_request'])} (fp8) vs {_f(tau['exact']['per_request'])} (exact), "
        f"delta {d['delta']:+.4f} 95% CI [{d['lo']:+.4f}, {d['hi']:+.4f}]"
        + (f" {excludes}" if drift["interval_excludes_zero"] else " (contains 0)")
    )


def _render_exact_slice(report: dict[str, Any], console: Console) -> None:
    drift = report.get("exact_slice")
    if drift:
        console.print(exact_slice_line(drift))


def _render_config_sources(report: dict[str, Any], console: Console) -> None:
    """Each drafter config field with where it came from (config, shapes, cache, flag...)."""
    sources = report["checkpoint"].get("field_sources") or {}
    drafter = report.get("drafter") or {}
    values = {**drafter, **(drafter.get("dflash_config") or {})}
    if not sources:
        return
    layout = report["checkpoint"].get("layout")
    parts = [
        f"{name}={values[name]!r} [dim]({source})[/]" if name in values else f"{name} [dim]({source})[/]"
        for name, source in sources.items()
    ]
    console.print(f"drafter config{f' ({layout} layout)' if layout else ''}: " + ", ".join(parts))


def _render_sample(sample: dict[str, Any], console: Console) -> None:
    table = Table(
        title=f"{sample['record_id']} at position {sample['anchor']}: {sample['tokens']} tokens this round",
        caption=f"context ...{readable(sample['context_tail'])}",
    )
    table.add_column("slot", justify="right")
    table.add_column("drafted")
    table.add_column("target (greedy)")
    ids = list(zip(sample.get("drafted_ids", sample["drafted"]), sample.get("target_ids", sample["target"])))
    for j, (d, t) in enumerate(zip(sample["drafted"], sample["target"]), 1):
        mark = "" if ids[j - 1][0] == ids[j - 1][1] else " [red]x[/]"
        table.add_row(
            str(j) + ("  <- diverged" if sample["diverged_at_slot"] == j else ""),
            readable(d) + mark,
            readable(t),
        )
    if "drafted_text" in sample:
        table.add_row("all", readable(sample["drafted_text"]), readable(sample["target_text"]))
    console.print(table)


def render_comparison(result: dict[str, Any], console: Console) -> None:
    # The caches by number, their paths in full above the table (soft-wrapped: never cut; a table
    # cell cut two paths with a common prefix to the same `../clon...`).
    paths = [report["cache"]["path"] for report in result["reports"]]
    for n, path in enumerate(paths, 1):
        console.print(
            f"cache {n}{' (base)' if n == 1 else ''}: {path}", soft_wrap=True, markup=False, highlight=False
        )
    table = Table(title="one checkpoint, several caches")
    for col in (
        "cache",
        "tau per request",
        "tau pooled",
        "delta per request [95%]",
        "delta pooled [95%]",
        "deltas over",
        "rounds changed",
    ):
        table.add_column(col)
    base = result["reports"][0]
    table.add_row(
        "1",
        _f(base["tau"]["per_request"]),
        _f(base["tau"]["pooled"]),
        "(base)",
        "",
        f"{base['requests']} requests",
        "",
    )
    notes = []
    for n, (report, comp) in enumerate(zip(result["reports"][1:], result["comparisons"]), 2):
        d = comp["delta"]
        cell = lambda x: "-" if x is None else f"{x['delta']:+.3f} [{x['lo']:+.2f}, {x['hi']:+.2f}]"
        table.add_row(
            str(n),
            _f(report["tau"]["per_request"]),
            _f(report["tau"]["pooled"]),
            cell(d["per_request"]),
            cell(d["pooled"]),
            f"{comp['requests_compared']} of {max(base['requests'], report['requests'])} requests",
            f"{comp['rounds_with_changed_acceptance']} of {comp.get('rounds_compared', '?')}",
        )
        unpaired = sum(len(ids) for ids in comp.get("requests_left_out", {}).values())
        if unpaired:
            notes.append(
                f"{report['cache']['path']}: the deltas pair only {comp['requests_compared']} requests "
                f"(same record id and token ids); {unpaired} are left out, while the tau columns are over "
                f"each cache's own requests. To compare on identical tokens, re-extract it from the base's "
                f"tokens: hscache extract --tokens-from {base['cache']['path']} --out NEW ..."
            )
    console.print(table)
    for note in notes:
        console.print(f"[bold yellow]note:[/] {note}")
