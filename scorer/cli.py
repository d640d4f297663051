"""The ``scorer`` command line: a thin layer over scorer.evaluate / online / init."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import click

from hscache.capture import BACKENDS
from hscache.cli import error_boundary
from hscache.errors import HscacheError
from hscache.store.dtypes import DTYPE_NAMES, SCORER_DTYPES
from hscache.store.fsio import atomic_write_bytes
from scorer.errors import ScorerError

__all__ = ["main"]


# Expected errors (bad checkpoint, incompatible cache, bad flags): one line, exit 2.
friendly_errors = error_boundary(ScorerError, HscacheError)


def _int_list(text: str | None, minimum: int | None = None) -> tuple[int, ...]:
    if not text:
        return ()
    try:
        values = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise click.BadParameter(f"{text!r} is not a comma-separated list of integers") from None
    if minimum is not None and any(v < minimum for v in values):
        raise click.BadParameter(f"{text!r}: every value must be at least {minimum}")
    return values


def _overrides(target_layer_ids: str | None, mask_token_id: int | None, rope_theta: float | None) -> dict:
    overrides: dict[str, Any] = {}
    if target_layer_ids:
        overrides["target_layer_ids"] = _int_list(target_layer_ids)
    if mask_token_id is not None:
        overrides["mask_token_id"] = mask_token_id
    if rope_theta is not None:
        overrides["rope_theta"] = rope_theta
    return overrides


def _write_json(path: str | None, document: dict) -> None:
    if path:
        atomic_write_bytes(Path(path), (json.dumps(document, indent=2) + "\n").encode())
        click.echo(f"wrote {path}", err=True)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="hscache")
def main() -> None:
    """Score DFlash drafter checkpoints against hidden-state caches, without the target model."""


_checkpoint_flags = [
    click.option("--target-layer-ids", default=None, help="Override: comma-separated target layer ids."),
    click.option("--mask-token-id", type=int, default=None, help="Override the mask token id."),
    click.option("--rope-theta", type=float, default=None, help="Override the drafter's rope theta."),
    click.option(
        "--config",
        "config_path",
        type=click.Path(exists=True, dir_okay=False),
        default=None,
        help="A separate draft config JSON (e.g. SpecForge's model.draft_model_config for a "
        "{run}-stepN/training_state.pt); replaces a config.json beside the weights.",
    ),
    click.option(
        "--trust-checkpoint",
        is_flag=True,
        help="Allow full unpickling of a .pt that weights_only refuses (runs its code!).",
    ),
]


def checkpoint_flags(fn: Callable) -> Callable:
    for flag in reversed(_checkpoint_flags):
        fn = flag(fn)
    return fn


_cluster_flags = [
    click.option("--scheduler", default=None, help="Address of a running dask scheduler (tcp://host:8786)."),
    click.option(
        "--workers",
        type=click.IntRange(min=1),
        default=None,
        help="Start a local dask cluster of N single-threaded worker processes for this run.",
    ),
]


def cluster_flags(fn: Callable) -> Callable:
    for flag in reversed(_cluster_flags):
        fn = flag(fn)
    return fn


@contextlib.contextmanager
def _maybe_cluster(scheduler: str | None, workers: int | None) -> Iterator[Any]:
    """A dask client when --scheduler or --workers is given, else None (score in this process)."""
    if scheduler is None and workers is None:
        yield None
        return
    from hscache.cluster import cluster_client

    with cluster_client(scheduler=scheduler, workers=workers) as client:
        yield client


@main.command("eval")
@click.argument("checkpoint")
@click.option(
    "--cache", "caches", multiple=True, required=True, help="Cache directory; repeat to compare caches."
)
@click.option("--device", default="cpu", show_default=True)
@click.option("--dtype", type=click.Choice(list(SCORER_DTYPES)), default="fp32", show_default=True)
@click.option(
    "--block-size", type=click.IntRange(min=2), default=None, help="Override the drafter's block size."
)
@click.option(
    "--ddtree", default="8,32,128", show_default=True, help="DDTree budgets (node counts); '' for none."
)
@click.option("--limit", type=click.IntRange(min=1), default=None, help="Only the first N sequences.")
@click.option("--json", "json_out", default=None, help="Write the full report as JSON here.")
@click.option(
    "--report",
    "report_out",
    default=None,
    help="Write a self-contained HTML page here: tau per cache, deltas, per-position acceptance.",
)
@click.option(
    "--anchors",
    type=click.Choice(["all", "chain"]),
    default="all",
    show_default=True,
    help="all: draft every anchor (per-slot acceptance, train_accept_len); chain: only the anchors the "
    "chain and DDTree replays visit (same tau, ~tau x less work).",
)
@click.option(
    "--memory-gb",
    type=click.FloatRange(min=0, min_open=True),
    default=2.0,
    show_default=True,
    help="Working set for [rows, vocab] logits beyond the weights; the head is projected in row chunks.",
)
@click.option("--samples", type=click.IntRange(min=0), default=0, help="Show N rounds side by side.")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option(
    "--expect-digest",
    "expect_digests",
    multiple=True,
    help="Refuse a cache whose digest (printed by `hscache info`, stored as cache.digest) differs; "
    "one per --cache, in order.",
)
@click.option(
    "--allow-unsealed",
    is_flag=True,
    help="Score a cache without checksums (written before them); its files cannot be checked.",
)
@cluster_flags
@checkpoint_flags
@friendly_errors
def eval_command(
    checkpoint: str,
    caches: tuple[str, ...],
    ddtree: str,
    json_out: str | None,
    report_out: str | None,
    target_layer_ids: str | None,
    mask_token_id: int | None,
    rope_theta: float | None,
    scheduler: str | None,
    workers: int | None,
    expect_digests: tuple[str, ...],
    **options: Any,
) -> None:
    """Replay CHECKPOINT against cached hidden states: tau, per-position acceptance, DDTree."""
    from rich.console import Console
    from rich.progress import Progress

    from scorer.evaluate import EvalConfig, evaluate_many
    from scorer.report.terminal import render_comparison, render_report

    config = EvalConfig(
        ddtree=_int_list(ddtree, minimum=1),
        overrides=_overrides(target_layer_ids, mask_token_id, rope_theta),
        **options,
    )
    console = Console(stderr=False)
    with (
        _maybe_cluster(scheduler, workers) as client,
        Progress(console=Console(stderr=True), transient=True) as progress,
    ):
        task = progress.add_task("scoring", total=None)
        result = evaluate_many(
            checkpoint,
            caches,
            config,
            on_sequence=lambda n: progress.advance(task),
            client=client,
            expect_digests=expect_digests,
        )
    for report in result["reports"]:
        render_report(report, console)
    if len(result["reports"]) > 1:
        render_comparison(result, console)
    _write_json(json_out, result["reports"][0] if len(caches) == 1 else result)
    if report_out:
        from scorer.report.html import write_eval_html

        click.echo(f"wrote {write_eval_html(result, report_out)}", err=True)


@main.command()
@click.argument("run_dir")
@click.option("--cache", required=True, help="Cache directory or URL to score every checkpoint on.")
@click.option(
    "--out", default=None, help="Output directory (default: RUN_DIR/sweep); reports are kept in OUT/results."
)
@click.option("--device", default="cpu", show_default=True)
@click.option("--dtype", type=click.Choice(list(SCORER_DTYPES)), default="fp32", show_default=True)
@click.option(
    "--ddtree", default="8,32,128", show_default=True, help="DDTree budgets (node counts); '' for none."
)
@click.option("--limit", type=click.IntRange(min=1), default=None, help="Only the first N sequences.")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option(
    "--block-size",
    type=click.IntRange(min=2),
    default=None,
    help="Block size for checkpoints without a config (overrides a config's value too).",
)
@click.option(
    "--tokens-per-task",
    type=click.IntRange(min=1),
    default=None,
    help="Tokens of work per dask task (default: scorer.distributed.DEFAULT_TASK_TOKENS).",
)
@cluster_flags
@friendly_errors
def sweep(
    run_dir: str,
    cache: str,
    out: str | None,
    ddtree: str,
    scheduler: str | None,
    workers: int | None,
    tokens_per_task: int | None,
    **options: Any,
) -> None:
    """Score every checkpoint under RUN_DIR; write sweep.json, sweep.csv and a tau/acceptance-by-step plot."""
    from scorer.evaluate import EvalConfig
    from scorer.sweep import sweep as run_sweep

    config = EvalConfig(ddtree=_int_list(ddtree, minimum=1), **options)

    def report(checkpoint: Any, reused: bool) -> None:
        click.echo(
            f"step {checkpoint.step:>10}  {'reused' if reused else 'scored'}  {checkpoint.path}", err=True
        )

    with _maybe_cluster(scheduler, workers) as client:
        document = run_sweep(
            run_dir,
            cache,
            out or str(Path(run_dir) / "sweep"),
            config,
            client=client,
            tokens_per_task=tokens_per_task,
            on_checkpoint=report,
        )
    for row in document["rows"]:
        tau = "-" if row["tau_per_request"] is None else f"{row['tau_per_request']:.4f}"
        click.echo(f"{row['step']:>10}  tau {tau}  {row['checkpoint']}")
    for skipped in document["skipped"]:
        click.echo(f"skipped {skipped['path']}: {skipped['reason']}", err=True)
    click.echo(f"wrote {', '.join(document['outputs'].values())}")


@main.command()
@click.argument("checkpoint")
@click.option("--model", default="builtin:tiny-qwen3.5", show_default=True)
@click.option("--prompts", default="builtin:default", show_default=True)
@click.option("--max-new-tokens", type=click.IntRange(min=1), default=64, show_default=True)
@click.option("--max-length", type=click.IntRange(min=2), default=4096, show_default=True)
@click.option("--dtype", type=click.Choice(list(DTYPE_NAMES)), default="fp32", show_default=True)
@click.option("--device", default="cpu", show_default=True)
@click.option("--backend", type=click.Choice(list(BACKENDS)), default="auto", show_default=True)
@click.option("--limit", type=click.IntRange(min=1), default=None)
@click.option("--json", "json_out", default=None)
@click.option(
    "--block-size", type=click.IntRange(min=2), default=None, help="Override the drafter's block size."
)
@checkpoint_flags
@friendly_errors
def online(
    checkpoint: str,
    json_out: str | None,
    target_layer_ids: str | None,
    mask_token_id: int | None,
    rope_theta: float | None,
    block_size: int | None,
    **options: Any,
) -> None:
    """Real greedy speculative decoding with the target verifying: the online tau per request."""
    from scorer.online import run_online

    overrides = _overrides(target_layer_ids, mask_token_id, rope_theta)
    if block_size is not None:
        overrides["block_size"] = block_size
    result = run_online(checkpoint, overrides=overrides, **options)
    for warning in result["checkpoint"].get("warnings", []):
        click.echo(f"warning: {warning}", err=True)
    for row in result["per_request"]:
        tau = "-" if row["tau"] is None else f"{row['tau']:.3f}"
        click.echo(f"{row['record_id']:<24} tau {tau}  rounds {len(row['tokens_per_round'])}")
    tau = result["tau"]
    if tau["per_request"] is None:
        click.echo(
            "online tau: no rounds (every request ended before its first draft); raise --max-new-tokens"
        )
    else:
        click.echo(
            f"online tau: per request {tau['per_request']:.4f}, pooled {tau['pooled']:.4f} "
            f"over {result['rounds']} rounds"
        )
    _write_json(json_out, result)


@main.command()
@click.argument("out")
@click.option("--cache", required=True, help="Cache whose target the drafter is sized for.")
@click.option("--layers", "num_layers", type=click.IntRange(min=1), default=1, show_default=True)
@click.option("--block-size", type=click.IntRange(min=2), default=8, show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option(
    "--train-steps",
    type=click.IntRange(min=0),
    default=0,
    show_default=True,
    help="Train for N CPU steps on the cache (scorer.train) instead of random weights.",
)
@friendly_errors
def init(out: str, cache: str, num_layers: int, block_size: int, seed: int, train_steps: int) -> None:
    """Write a DFlash drafter for CACHE's target to OUT (an HF directory)."""
    if train_steps:
        from scorer.train import train_drafter

        result = train_drafter(
            cache,
            out,
            steps=train_steps,
            num_layers=num_layers,
            block_size=block_size,
            seed=seed,
            log_every=0,
        )
        click.echo(f"trained {train_steps} steps (final loss {result['final_loss']:.3f}); saved to {out}")
        return
    from scorer.init import init_drafter

    config, _ = init_drafter(cache, out, num_layers=num_layers, block_size=block_size, seed=seed)
    click.echo(
        f"saved a random drafter (hidden {config.hidden_size}, {config.num_hidden_layers} layers, "
        f"block {config.block_size}, target layers {list(config.target_layer_ids)}) to {out}"
    )


if __name__ == "__main__":
    main()
