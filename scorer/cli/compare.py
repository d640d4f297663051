"""``scorer compare``: several drafters on the same rounds of one cache (scorer.studies.compare), or on caches
of several sampling settings side by side (scorer.studies.compare_settings)."""

from __future__ import annotations

import itertools
from typing import Any

import click

from hscache.cli_options import report_outputs
from scorer.cli.shared import (
    ScoringCommand,
    TauProgress,
    check_outputs,
    ddtree_option,
    device_option,
    drafting_flags,
    friendly_errors,
    limit_option,
    sampling_check_flags,
    scoring_config,
    scoring_dtype_option,
    seed_option,
    write_json,
)
from scorer.report.tables import TABLE_FORMATS

__all__ = ["compare"]


@click.command(cls=ScoringCommand)
@click.argument("checkpoints", nargs=-1, required=True)
@click.option(
    "--cache",
    "caches",
    multiple=True,
    required=True,
    help="The cache every drafter is scored on (same rounds for all); repeat it with caches of the same "
    "prompts at other sampling settings (greedy/, t07/) to see each drafter's tau per setting side by side.",
)
@device_option
@scoring_dtype_option
@ddtree_option("")
@limit_option
@seed_option("Seed of the paired-bootstrap intervals.")
@report_outputs("the comparison")
@click.option(
    "--trust-checkpoint", is_flag=True, help="Allow full unpickling of .pt files (runs their code!)."
)
@click.option(
    "--format",
    "table_format",
    type=click.Choice(TABLE_FORMATS),
    default="auto",
    show_default=True,
    help="The tables on stdout: auto (boxes on a terminal, plain columns when redirected), plain, "
    "or markdown; never cut to the terminal's width.",
)
@drafting_flags
@sampling_check_flags
@friendly_errors
def compare(
    checkpoints: tuple[str, ...],
    caches: tuple[str, ...],
    json_out: str | None,
    report_out: str | None,
    table_format: str,
    **options: Any,
) -> None:
    """Score several drafters (any family; target:mtp too) on one cache: one table, the same rounds.

    \b
    Example:
      scorer compare drafter/ eagle3/ target:mtp --cache cache/ --json compare.json
    """
    from hscache.progress import StepProgress
    from scorer.report.compare_html import COST_HEADER, TAU_HEADER, cost_rows, drafter_names, tau_rows
    from scorer.report.html import per_category_table
    from scorer.report.tables import print_table
    from scorer.report.terminal import exact_slice_line
    from scorer.studies.compare import compare_drafters

    check_outputs(json=json_out, report=report_out)  # before scoring, not after it
    config = scoring_config(checkpoints, options)
    if len(caches) > 1:
        from rich.console import Console

        from scorer.studies.compare_settings import compare_settings, render_settings

        document = compare_settings(checkpoints, caches, config)
        render_settings(document, Console(), table_format)
        write_json(json_out, document)
        if report_out:
            from scorer.report.served import write_settings_html

            click.echo(f"wrote {write_settings_html(document, report_out)}", err=True)
        return
    with StepProgress("compare", "sequences") as progress:
        tau, drafters = TauProgress(progress), itertools.count(1)

        def started(checkpoint: str, sequences: int) -> None:
            tau.restart(sequences, f"drafter {next(drafters)} of {len(checkpoints)}: {checkpoint}")

        document = compare_drafters(checkpoints, caches[0], config, on_sequence=tau.scored, on_start=started)
    names = drafter_names(document)
    for header, rows in ((TAU_HEADER, tau_rows(document, names)), (COST_HEADER, cost_rows(document, names))):
        print_table(header, rows, table_format)
    header, rows = per_category_table(document["reports"], names)
    if rows:  # the prompts' categories (the cache index): tau per category, per drafter
        print_table(header, rows, table_format)
    for name, report in zip(names, document["reports"]):
        if report.get("exact_slice"):  # a compact cache: what fp8 states did to each drafter's tau
            click.echo(f"{name}: {exact_slice_line(report['exact_slice'], markup=False)}")
    for name, row in zip(names, document["drafters"]):
        for warning in row["warnings"]:
            click.echo(f"warning: {name}: {warning}", err=True)
    write_json(json_out, document)
    if report_out:
        from scorer.report.compare_html import write_compare_html

        click.echo(f"wrote {write_compare_html(document, report_out)}", err=True)
