"""``scorer served``: vLLM is the judge (scorer.studies.vllm_judge): the drafter served in a real vLLM
engine on the cache's requests, its rounds beside the offline replay's."""

from __future__ import annotations

from typing import Any

import click

from scorer.cli.shared import (
    DRAFT_SAMPLING,
    REJECTION_SAMPLING,
    ScoringCommand,
    check_outputs,
    family_flags,
    family_settings,
    friendly_errors,
    num_speculative_tokens_option,
    write_json,
)

__all__ = ["served"]


def _tau(value: float | None) -> str:
    return "-" if value is None else f"{value:.4f}"


def _echo(report: dict[str, Any]) -> None:
    click.echo(f"{'request':<24} {'rounds':>7} {'offline tau':>12} {'vLLM tau':>10}  same")
    for row in report["per_request"]:
        rounds = f"{len(row['offline']['tokens'])}/{len(row['vllm']['tokens'])}"
        same = "yes" if row["equal"] else "NO"
        click.echo(
            f"{row['record_id'][:24]:<24} {rounds:>7} {_tau(row['offline_reported_tau']):>12} "
            f"{_tau(row['vllm']['tau']):>10}  {same}"
        )
    for d in report["differences"] if "expectation" not in report else []:
        click.echo(
            f"differs: {d['record_id']} round {d['round']}: offline anchor {d['offline_anchor']} accepted "
            f"{d['offline_accepted']}, vLLM anchor {d['vllm_anchor']} accepted {d['vllm_accepted']}"
        )
        if "vllm_draft" in d:
            v = d["vllm_draft"]
            (first, second), (high, low) = v["tokens"], v["logits"]
            click.echo(
                f"  vLLM's own draft at slot {v['slot'] + 1}: token {first} (logit {high:g}) over {second} ({low:g}), "
                f"{v['steps']} {v['dtype']} step(s) apart: "
                + ("a tie at the served dtype" if v["tie"] else "not a tie")
            )
    tau, vllm = report["tau"], report["vllm"]
    click.echo("tau = tokens per round, the bonus token included; pooled = all tokens / all rounds")
    click.echo(
        f"offline: pooled {_tau(tau['offline_report']['pooled'])}, per request {_tau(tau['offline_report']['per_request'])}"
    )
    click.echo(
        f"vLLM:    pooled {_tau(tau['vllm']['pooled'])}, per request {_tau(tau['vllm']['per_request'])} "
        f"({tau['vllm']['rounds']} rounds; vLLM's own mean_acceptance_length, unclipped and without "
        f"the steps it does not record: {_tau(vllm['counters']['mean_acceptance_length'])})"
    )
    patches = ", ".join(vllm["patches"]) or "none"
    click.echo(f"vLLM {vllm['version']}, {report['family']} ({vllm['speculative_config']['method']}, K "
               f"{vllm['speculative_config']['num_speculative_tokens']}); rule: {report['rule']['definition']}; "
               f"patches: {patches}")  # fmt: skip
    if report["rule"]["offline"] != report["rule"]["vllm"]:
        click.echo(
            f"scored offline by the {report['rule']['offline']} rule, served by the {report['rule']['vllm']} rule"
        )
    if "expectation" in report:
        e = report["expectation"]
        click.echo(
            f"vLLM's probabilistic rule: {e['realised_rounds']} rounds drawn, {e['expected_rounds']:.2f} expected by the "
            f"offline DP on the same text (mean difference per request {e['mean_difference']:.3f}, z {e['z']:.2f})"
        )
        click.echo("offline agrees with vLLM in expectation" if e["agrees"] else "offline != vLLM (|z| > 3)")
        return
    if report["verdict"] == "equal except ties":
        click.echo(
            f"offline = vLLM, round for round, except {len(report['ties'])} request(s) that part first where "
            "vLLM's own draft logits tie at the served dtype (no replay outside vLLM's kernels decides those alike)"
        )
        return
    click.echo("offline = vLLM, round for round" if report["equal"] else "offline != vLLM")


@click.command(cls=ScoringCommand)
@click.argument("checkpoint")
@click.option(
    "--cache", "cache", required=True, help="The cache whose target, prompts and sampling are served."
)
@num_speculative_tokens_option("vLLM's num_speculative_tokens (default: the drafter's block size - 1).")
@click.option(
    "--draft-sampling",
    type=DRAFT_SAMPLING,
    default="greedy",
    show_default=True,
    help="vLLM's draft_sample_method: greedy (one-hot verification, vLLM's default) or probabilistic.",
)
@click.option(
    "--rejection-sample-method",
    type=REJECTION_SAMPLING,
    default="standard",
    show_default=True,
    help="vLLM's rejection_sample_method: standard, or block (block verification). vLLM CPU's V1 model "
    "runner reads only 'synthetic' and verifies block requests with the standard rule; with greedy drafts "
    "both accept the leading match of the served text, so the judge compares the same rounds.",
)
@click.option(
    "--scored-rule",
    type=DRAFT_SAMPLING,
    default=None,
    help="Score the offline side by this rule instead (shows the check failing when the rule is not vLLM's).",
)
@click.option("--limit", type=click.IntRange(min=1), default=None, help="Only the cache's first N prompts.")
@click.option(
    "--vllm-python",
    default=None,
    metavar="PATH",
    help="The interpreter that imports vLLM (default: $HSCACHE_VLLM_PYTHON, else this one).",
)
@click.option(
    "--workdir", default=None, help="Keep vLLM's outputs and the served cache here (default: removed)."
)
@click.option("--json", "json_out", default=None, help="Write the report as JSON here.")
@family_flags
@friendly_errors
def served(checkpoint: str, json_out: str | None, scored_rule: str | None, **options: Any) -> None:
    """Serve the cache's target with CHECKPOINT in vLLM and score what it produced offline: both per
    request and pooled, every round where they differ, and at a request's first difference vLLM's own
    two best drafts there. Exit status 1 when they differ other than at ties of the served dtype.

    \b
    Example:
      scorer served drafter/ --cache cache/ --vllm-python .vllm/bin/python
      scorer served drafter/ --cache cache/ --num-speculative-tokens 3   # K other than the drafter's
    """
    check_outputs(json=json_out, workdir=options["workdir"], directories=("workdir",))
    from scorer.studies.vllm_judge import ServedConfig, judge

    overrides = family_settings(options)
    cache = options.pop("cache")
    report = judge(checkpoint, cache, ServedConfig(overrides=overrides, scored=scored_rule, **options))
    _echo(report)
    write_json(json_out, report)
    if report["verdict"] == "differs":
        raise SystemExit(1)
