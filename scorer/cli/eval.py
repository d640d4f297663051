"""``scorer eval``: one drafter replayed against one or more caches (scorer.studies.evaluate)."""

from __future__ import annotations

from typing import Any

import click

from hscache.cli_options import allow_unsealed_option, report_outputs
from scorer.cli.shared import (
    POSITIVE,
    ScoringCommand,
    TauProgress,
    anchors_option,
    block_size_option,
    check_outputs,
    checkpoint_flags,
    cluster_flags,
    ddtree_option,
    device_option,
    drafting_flags,
    friendly_errors,
    limit_option,
    maybe_cluster,
    sampling_check_flags,
    scoring_config,
    scoring_dtype_option,
    seed_option,
    write_json,
)

__all__ = ["eval_command"]


@click.command("eval", cls=ScoringCommand)
@click.argument("checkpoint")
@click.option(
    "--cache", "caches", multiple=True, required=True, help="Cache directory; repeat to compare caches."
)
@device_option
@scoring_dtype_option
@block_size_option
@ddtree_option("8,32,128")
@limit_option
@report_outputs("the full report", "tau per cache, deltas, per-position acceptance")
@anchors_option(
    "all: draft every anchor (per-slot acceptance, train_accept_len); chain: only the anchors the "
    "chain and DDTree replays visit (same tau, ~tau x less work)."
)
@click.option(
    "--memory-gb",
    type=POSITIVE,
    default=2.0,
    show_default=True,
    help="Working set for [rows, vocab] logits beyond the weights; the head is projected in row chunks.",
)
@click.option("--samples", type=click.IntRange(min=0), default=0, help="Show N rounds side by side.")
@seed_option("Seed of the bootstrap intervals and the --samples draw.")
@click.option(
    "--allow-target-mismatch",
    is_flag=True,
    help="Score a drafter whose config records another target than the cache's (the report warns).",
)
@click.option(
    "--expect-digest",
    "expect_digests",
    multiple=True,
    help="Refuse a cache whose digest (printed by `hscache info`, stored as cache.digest) differs; "
    "one per --cache, in order.",
)
@click.option(
    "--greedy-reference",
    type=click.Choice(["argmax", "text"]),
    default="argmax",
    show_default=True,
    help="On a greedy cache, the target's token at each position: the cache's argmax, or the text's own next "
    "token (the text after each prompt is a serving engine's greedy output, e.g. scorer served --workdir's "
    "served cache: verify against that engine's decisions; the report counts where the argmax differs).",
)
@allow_unsealed_option("Score", "; its files cannot be checked")
@cluster_flags
@drafting_flags
@sampling_check_flags
@checkpoint_flags
@friendly_errors
def eval_command(
    checkpoint: str,
    caches: tuple[str, ...],
    json_out: str | None,
    report_out: str | None,
    overrides: dict[str, Any],
    scheduler: str | None,
    workers: int | None,
    expect_digests: tuple[str, ...],
    **options: Any,
) -> None:
    """Replay CHECKPOINT against cached hidden states: tau, per-position acceptance, DDTree.

    A cache extracted with sampling is scored as served at its setting (docs/sampling.md).

    \b
    Example:
      scorer eval drafter/ --cache cache/ --samples 2 --json report.json
    """
    from rich.console import Console

    from hscache.progress import StepProgress
    from scorer.report.terminal import render_comparison, render_report
    from scorer.studies.evaluate import evaluate_many

    config = scoring_config(checkpoint, options, overrides)
    check_outputs(json=json_out, report=report_out)  # before scoring, not after it
    console = Console(stderr=False)

    def started(path: str, sequences: int) -> None:
        label = f"cache {caches.index(path) + 1} of {len(caches)}: {path}" if len(caches) > 1 else None
        tau.restart(sequences, label)

    with (
        maybe_cluster(scheduler, workers) as client,
        StepProgress("eval", "sequences") as progress,
    ):
        tau = TauProgress(progress)
        result = evaluate_many(
            checkpoint,
            caches,
            config,
            on_sequence=tau.scored,
            client=client,
            on_start=started,
            expect_digests=expect_digests,
        )
    for report in result["reports"]:
        render_report(report, console)
    if len(result["reports"]) > 1:
        render_comparison(result, console)
    write_json(json_out, result["reports"][0] if len(caches) == 1 else result)
    if report_out:
        from scorer.report.html import write_eval_html

        click.echo(f"wrote {write_eval_html(result, report_out)}", err=True)
