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
    """Score drafter checkpoints (DFlash, EAGLE-3, ...) against hidden-state caches, without the target."""


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


def _tree(text: str | None) -> tuple[int, int, int] | None:
    if not text:
        return None
    if text == "sglang":  # SGLang's auto_choose_speculative_params for non-DeepSeek targets
        return (5, 4, 8)
    values = _int_list(text, minimum=1)
    if len(values) != 3:
        raise click.BadParameter(f"{text!r}: expected STEPS,TOPK,TOKENS (SGLang's EAGLE tree), e.g. 5,4,8")
    return values  # type: ignore[return-value]


_drafting_flags = [
    click.option(
        "--num-speculative-tokens",
        type=click.IntRange(min=1),
        default=None,
        help="Autoregressive families (EAGLE-3, MTP): draft a chain of K tokens per round (vLLM's "
        "num_speculative_tokens). Default: the checkpoint's config, else the engines' default.",
    ),
    click.option(
        "--tree",
        "tree_text",
        default=None,
        metavar="STEPS,TOPK,TOKENS",
        help="Autoregressive families: SGLang's EAGLE tree (--speculative-num-steps, "
        "--speculative-eagle-topk, --speculative-num-draft-tokens), scored beside the chain; "
        "'sglang' = SGLang's default 5,4,8.",
    ),
]


def drafting_flags(fn: Callable) -> Callable:
    for flag in reversed(_drafting_flags):
        fn = flag(fn)
    return fn


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
@cluster_flags
@drafting_flags
@checkpoint_flags
@friendly_errors
def eval_command(
    checkpoint: str,
    caches: tuple[str, ...],
    ddtree: str,
    tree_text: str | None,
    json_out: str | None,
    report_out: str | None,
    target_layer_ids: str | None,
    mask_token_id: int | None,
    rope_theta: float | None,
    scheduler: str | None,
    workers: int | None,
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
        tree=_tree(tree_text),
        **options,
    )
    console = Console(stderr=False)
    with (
        _maybe_cluster(scheduler, workers) as client,
        Progress(console=Console(stderr=True), transient=True) as progress,
    ):
        task = progress.add_task("scoring", total=None)
        result = evaluate_many(
            checkpoint, caches, config, on_sequence=lambda n: progress.advance(task), client=client
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
@click.argument("checkpoints", nargs=-1, required=True)
@click.option("--cache", required=True, help="The cache every drafter is scored on (same rounds for all).")
@click.option("--device", default="cpu", show_default=True)
@click.option("--dtype", type=click.Choice(list(SCORER_DTYPES)), default="fp32", show_default=True)
@click.option(
    "--ddtree", default="", show_default=True, help="DDTree budgets for block (DFlash) drafters; '' for none."
)
@click.option("--limit", type=click.IntRange(min=1), default=None, help="Only the first N sequences.")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--json", "json_out", default=None, help="Write the comparison as JSON here.")
@click.option("--report", "report_out", default=None, help="Write a self-contained HTML page here.")
@click.option(
    "--trust-checkpoint", is_flag=True, help="Allow full unpickling of .pt files (runs their code!)."
)
@drafting_flags
@friendly_errors
def compare(
    checkpoints: tuple[str, ...],
    cache: str,
    ddtree: str,
    json_out: str | None,
    report_out: str | None,
    tree_text: str | None,
    **options: Any,
) -> None:
    """Score several drafters (any family; target:mtp too) on one cache: one table, the same rounds."""
    from rich.console import Console
    from rich.table import Table

    from scorer.compare import compare_drafters
    from scorer.evaluate import EvalConfig
    from scorer.report.compare_html import COST_HEADER, TAU_HEADER, cost_rows, drafter_names, tau_rows

    config = EvalConfig(ddtree=_int_list(ddtree, minimum=1), tree=_tree(tree_text), **options)
    document = compare_drafters(checkpoints, cache, config)
    console = Console()
    names = drafter_names(document)
    for header, rows in ((TAU_HEADER, tau_rows(document, names)), (COST_HEADER, cost_rows(document, names))):
        table = Table(*header)
        for row in rows:
            table.add_row(*row)
        console.print(table)
    for name, row in zip(names, document["drafters"]):
        for warning in row["warnings"]:
            click.echo(f"warning: {name}: {warning}", err=True)
    _write_json(json_out, document)
    if report_out:
        from scorer.report.compare_html import write_compare_html

        click.echo(f"wrote {write_compare_html(document, report_out)}", err=True)


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
@drafting_flags
@checkpoint_flags
@friendly_errors
def online(
    checkpoint: str,
    json_out: str | None,
    tree_text: str | None,
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
    if tree_text:
        raise click.UsageError("--tree: scorer online verifies chains only; score trees with scorer eval")
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
@click.option(
    "--family",
    type=click.Choice(["dflash", "eagle3"]),
    default="dflash",
    show_default=True,
    help="dflash: an HF DFlash directory; eagle3: an EAGLE-3 drafter in --layout.",
)
@click.option(
    "--layout",
    type=click.Choice(["speculators", "specforge", "eagle_release"]),
    default="speculators",
    show_default=True,
    help="EAGLE-3 only: speculators Eagle3Speculator, SpecForge LlamaForCausalLMEagle3, or the original release.",
)
@click.option("--layers", "num_layers", type=click.IntRange(min=1), default=1, show_default=True)
@click.option("--block-size", type=click.IntRange(min=2), default=8, show_default=True)
@click.option(
    "--num-speculative-tokens",
    type=click.IntRange(min=1),
    default=3,
    show_default=True,
    help="EAGLE-3 only: the K written into its config.",
)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option(
    "--train-steps",
    type=click.IntRange(min=0),
    default=0,
    show_default=True,
    help="Train for N CPU steps on the cache (scorer.train) instead of random weights.",
)
@friendly_errors
def init(
    out: str,
    cache: str,
    family: str,
    layout: str,
    num_layers: int,
    block_size: int,
    num_speculative_tokens: int,
    seed: int,
    train_steps: int,
) -> None:
    """Write a drafter for CACHE's target to OUT (DFlash: an HF directory; EAGLE-3: --layout)."""
    if family == "eagle3":
        _init_eagle3(out, cache, layout, num_layers, num_speculative_tokens, seed, train_steps)
        return
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


def _init_eagle3(
    out: str, cache: str, layout: str, num_layers: int, k: int, seed: int, train_steps: int
) -> None:
    options = dict(layout=layout, seed=seed, num_layers=num_layers, num_speculative_tokens=k)
    if layout != "speculators":
        options["qk_norm"] = False  # the Llama layer those layouts hold
    if train_steps:
        from scorer.families.eagle3.train import train_eagle3

        result = train_eagle3(cache, out, steps=train_steps, **options)
        config = result["config"]
        what = f"trained {train_steps} steps (final loss {result['final_loss']:.3f})"
    else:
        from scorer.families.eagle3.init import init_eagle3

        config, _ = init_eagle3(cache, out, **options)
        what = "random"
    click.echo(
        f"saved a {what} EAGLE-3 drafter ({layout} layout, hidden {config.hidden_size}, "
        f"{config.num_hidden_layers} layer(s), K {config.num_speculative_tokens}, target layers "
        f"{list(config.target_layer_ids)}) to {out}"
    )


if __name__ == "__main__":
    main()
