"""``scorer watch``: follow a training run's folder, score every new checkpoint (scorer.watch.run)."""

from __future__ import annotations

import signal
import threading
from typing import Any

import click

from scorer.cli.shared import (
    POSITIVE,
    anchors_option,
    ddtree_option,
    device_option,
    friendly_errors,
    limit_option,
    sampling_check_flags,
    sampling_request,
    scoring_dtype_option,
    seed_option,
)

__all__ = ["watch_command"]


def _sinks(_ctx: click.Context, _param: click.Parameter, text: str) -> tuple[str, ...]:
    return tuple(name.strip() for name in text.split(",") if name.strip())


@click.command("watch")
@click.argument("run_dir")
@click.option("--cache", required=True, help="The eval cache every checkpoint is scored on.")
@click.option(
    "--results",
    default=None,
    help="Results folder: watch.jsonl (append-only), watch.html, tensorboard/ (default: RUN_DIR-watch beside "
    "RUN_DIR).",
)
@click.option(
    "--every",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="Score a checkpoint only when its step is at least N past the last one scored.",
)
@click.option(
    "--log-to",
    default="tensorboard",
    show_default=True,
    callback=_sinks,
    help="Comma-separated sinks besides the log: tensorboard, wandb, trackio, mlflow ('' for none).",
)
@device_option
@scoring_dtype_option
@ddtree_option("8")
@limit_option
@anchors_option(
    "all: per-slot acceptance too; chain: only the anchors the replays visit (same tau, cheaper)."
)
@seed_option("Seed of the bootstrap intervals.")
@click.option(
    "--poll-s",
    type=POSITIVE,
    default=10.0,
    show_default=True,
    help="Seconds between looks at RUN_DIR; a checkpoint is scored once two looks see the same files.",
)
@click.option(
    "--until-idle-s",
    type=click.FloatRange(min=0),
    default=None,
    help="Stop when nothing in RUN_DIR changed for this many seconds (default: run until Ctrl-C).",
)
@sampling_check_flags
@friendly_errors
def watch_command(
    run_dir: str,
    cache: str,
    results: str | None,
    every: int,
    log_to: tuple[str, ...],
    poll_s: float,
    until_idle_s: float | None,
    **options: Any,
) -> None:
    """Follow RUN_DIR while a trainer writes checkpoints there; score each new one on CACHE once.

    Recognises transformers' checkpoint-S/, SpecForge's and NeMo Automodel's epoch_E_step_S/,
    speculators' <epoch>/ and scorer init's folders. Ctrl-C stops after the checkpoint being scored
    (twice: at once, writing nothing of it). A restart scores nothing already in the log.

    \b
    Example:
      scorer watch runs/exp1 --cache eval-cache/ --until-idle-s 3600
    """
    from scorer.studies.evaluate import EvalConfig
    from scorer.watch.run import HTML_NAME, WatchConfig, watch

    eval_config = EvalConfig(sampling=sampling_request(options), **options)
    config = WatchConfig(
        results=results,
        every=every,
        log_to=log_to,
        poll_s=poll_s,
        until_idle_s=until_idle_s,
        eval=eval_config,
    )
    stop = threading.Event()

    def interrupted(_signum: int, _frame: Any) -> None:
        if stop.is_set():
            raise KeyboardInterrupt
        stop.set()
        click.echo("stopping after the checkpoint being scored (Ctrl-C again: at once)", err=True)

    previous = signal.signal(signal.SIGINT, interrupted)
    try:
        summary = watch(run_dir, cache, config, stop=stop, say=lambda line: click.echo(line, err=True))
    except KeyboardInterrupt:
        raise click.exceptions.Exit(130) from None
    finally:
        signal.signal(signal.SIGINT, previous)
    click.echo(
        f"{len(summary.scored)} scored, {len(summary.refused)} refused, {len(summary.skipped)} skipped; "
        f"stopped by {summary.stopped_by}; results in {summary.results} ({HTML_NAME})"
    )
