"""``scorer diagnose``: the setting behind a low tau, one replay per hypothesis (scorer.diagnose.run)."""

from __future__ import annotations

from typing import Any

import click

from hscache.cli_options import report_outputs
from scorer.cli.shared import (
    FiniteFloatRange,
    anchors_option,
    block_size_option,
    check_outputs,
    checkpoint_flags,
    device_option,
    drafter_dtype_option,
    friendly_errors,
    num_speculative_tokens_option,
    seed_option,
    write_json,
)

__all__ = ["diagnose"]


@click.command()
@click.argument("checkpoint")
@click.option(
    "--cache",
    "caches",
    multiple=True,
    required=True,
    help="Cache to diagnose on; a second --cache adds the drift hypothesis (same drafter on it).",
)
@click.option(
    "--train-metric",
    type=FiniteFloatRange(min=0),
    default=None,
    help="The training dashboard's accept length (no +1), set against the same metric on the cache.",
)
@click.option(
    "--limit",
    type=click.IntRange(min=1),
    default=None,
    help="Sequences replayed per hypothesis (a seeded sample; default: 32, grown to what the observed "
    "variance says separates a 0.15 tau gain, at most 256).",
)
@report_outputs("the report")
@device_option
@drafter_dtype_option("Baseline replay dtype (the other one is a hypothesis).")
@block_size_option
@anchors_option(
    "all: every anchor drafted once per distinct drafter input, shared by the hypotheses; chain: only "
    "where each replay goes, one small forward per round (1/tau of the block work, slow on CPU)."
)
@seed_option("Seed of the sample and the bootstrap.")
@num_speculative_tokens_option(
    "EAGLE-3, MTP: the chain of K tokens per round replayed (default: the checkpoint's, else the engines')."
)
@checkpoint_flags
@friendly_errors
def diagnose(
    checkpoint: str,
    caches: tuple[str, ...],
    json_out: str | None,
    report_out: str | None,
    **options: Any,
) -> None:
    """Name the setting behind a low tau: replay CHECKPOINT as configured, then once per hypothesis.

    \b
    Example:
      scorer diagnose drafter/ --cache cache/ --train-metric 1.24 --json diag.json
    """
    from rich.console import Console

    from scorer.diagnose.run import DiagnoseConfig, diagnose_checkpoint
    from scorer.report.diagnose import render_diagnose

    check_outputs(json=json_out, report=report_out)  # before the replays, not after them
    config = DiagnoseConfig(**options)  # overrides included (checkpoint_flags)
    report = diagnose_checkpoint(
        checkpoint, caches, config, on_hypothesis=lambda what: click.echo(f"replaying: {what}", err=True)
    )
    render_diagnose(report, Console(stderr=False))
    write_json(json_out, report)
    if report_out:
        from scorer.report.diagnose import write_diagnose_html

        click.echo(f"wrote {write_diagnose_html(report, report_out)}", err=True)
