"""``scorer sweep``: every checkpoint of a training run scored on one cache (scorer.studies.sweep)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from scorer.cli.shared import (
    block_size_option,
    check_outputs,
    cluster_flags,
    ddtree_option,
    device_option,
    friendly_errors,
    limit_option,
    maybe_cluster,
    sampling_check_flags,
    sampling_request,
    scoring_dtype_option,
    seed_option,
)

__all__ = ["sweep"]


@click.command()
@click.argument("run_dir")
@click.option("--cache", required=True, help="Cache directory or URL to score every checkpoint on.")
@click.option(
    "--out", default=None, help="Output directory (default: RUN_DIR/sweep); reports are kept in OUT/results."
)
@device_option
@scoring_dtype_option
@ddtree_option("8,32,128")
@limit_option
@seed_option("Seed of the bootstrap intervals.")
@block_size_option
@click.option(
    "--tokens-per-task",
    type=click.IntRange(min=1),
    default=None,
    help="Tokens of work per dask task (default: 2048).",
)
@click.option(
    "--keep-going",
    is_flag=True,
    help="Score the other checkpoints when one cannot be (unloadable, another target, layers the cache "
    "lacks) and list the refused at the end; without it the sweep stops at the first, naming it.",
)
@cluster_flags
@sampling_check_flags
@friendly_errors
def sweep(
    run_dir: str,
    cache: str,
    out: str | None,
    scheduler: str | None,
    workers: int | None,
    tokens_per_task: int | None,
    keep_going: bool,
    **options: Any,
) -> None:
    """Score every checkpoint under RUN_DIR; write sweep.json, sweep.csv and a tau/acceptance-by-step plot.

    \b
    Example:
      scorer sweep runs/my-run/ --cache cache/ --workers 2
    """
    from scorer.studies.evaluate import EvalConfig
    from scorer.studies.sweep import sweep as run_sweep

    out = out or str(Path(run_dir) / "sweep")
    check_outputs(out=out, directories=("out",))  # before scoring, not after it
    config = EvalConfig(sampling=sampling_request(options), **options)

    def report(checkpoint: Any, reused: bool) -> None:
        click.echo(
            f"step {checkpoint.step:>10}  {'reused' if reused else 'scored'}  {checkpoint.path}", err=True
        )

    with maybe_cluster(scheduler, workers) as client:
        document = run_sweep(
            run_dir,
            cache,
            out,
            config,
            client=client,
            tokens_per_task=tokens_per_task,
            on_checkpoint=report,
            keep_going=keep_going,
        )
    for row in document["rows"]:
        tau = "-" if row["tau_per_request"] is None else f"{row['tau_per_request']:.4f}"
        click.echo(f"{row['step']:>10}  tau {tau}  {row['checkpoint']}")
    for skipped in document["skipped"]:
        click.echo(f"skipped {skipped['path']}: {skipped['reason']}", err=True)
    for refused in document["refused"]:
        click.echo(f"refused {refused['path']} (step {refused['step']}): {refused['reason']}", err=True)
    click.echo(f"wrote {', '.join(document['outputs'].values())}")
