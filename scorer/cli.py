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


def _budgets(_ctx: click.Context, _param: click.Parameter, text: str | None) -> tuple[int, ...]:
    """A click callback: a bad value is then reported with the option's name (--ddtree)."""
    return _int_list(text, minimum=1)


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


# Options that eval, compare and sweep declare alike.
scoring_dtype_option = click.option(
    "--dtype",
    type=click.Choice(list(SCORER_DTYPES)),
    default="fp32",
    show_default=True,
    help="Drafter dtype while scoring (the cache is read in its own dtype).",
)
limit_option = click.option(
    "--limit", type=click.IntRange(min=1), default=None, help="Only the first N sequences."
)

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


def _refuse_explicit_ddtree(checkpoint: str, config: Any) -> None:
    """``--ddtree`` given on the command line for a drafter it cannot apply to is refused by name
    (its default is dropped quietly for the autoregressive families, which draft chains and trees)."""
    from click.core import ParameterSource

    if not config.ddtree or click.get_current_context().get_parameter_source("ddtree") is not (
        ParameterSource.COMMANDLINE
    ):
        return
    from scorer.families import family_for, probe_checkpoint

    try:
        family = family_for(probe_checkpoint(checkpoint, config.config_path))
    except ScorerError:
        return  # a bad checkpoint: the loader names what is wrong with it, as without --ddtree
    if family.autoregressive:
        raise ScorerError(
            f"--ddtree is DFlash's tree over a drafted block; {checkpoint} is a {family.name} drafter, which "
            "drafts a chain or SGLang's tree: use --num-speculative-tokens K or --tree STEPS,TOPK,TOKENS"
        )


@main.command("eval")
@click.argument("checkpoint")
@click.option(
    "--cache", "caches", multiple=True, required=True, help="Cache directory; repeat to compare caches."
)
@click.option(
    "--device", default="cpu", show_default=True, help="Where the drafter runs: cpu, cuda or cuda:N."
)
@scoring_dtype_option
@click.option(
    "--block-size", type=click.IntRange(min=2), default=None, help="Override the drafter's block size."
)
@click.option(
    "--ddtree",
    default="8,32,128",
    show_default=True,
    callback=_budgets,
    help="DDTree budgets (node counts); '' for none.",
)
@limit_option
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
@click.option(
    "--seed",
    type=int,
    default=0,
    show_default=True,
    help="Seed of the bootstrap intervals and the --samples draw.",
)
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
    "--allow-unsealed",
    is_flag=True,
    help="Score a cache without checksums (written before them); its files cannot be checked.",
)
@cluster_flags
@drafting_flags
@checkpoint_flags
@friendly_errors
def eval_command(
    checkpoint: str,
    caches: tuple[str, ...],
    ddtree: tuple[int, ...],
    tree_text: str | None,
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
    """Replay CHECKPOINT against cached hidden states: tau, per-position acceptance, DDTree.

    \b
    Example:
      scorer eval drafter/ --cache cache/ --samples 2 --json report.json
    """
    from rich.console import Console

    from hscache.progress import StepProgress
    from hscache.store.fsio import check_output_path
    from scorer.evaluate import EvalConfig, evaluate_many
    from scorer.report.terminal import render_comparison, render_report

    config = EvalConfig(
        ddtree=ddtree,
        overrides=_overrides(target_layer_ids, mask_token_id, rope_theta),
        tree=_tree(tree_text),
        **options,
    )
    _refuse_explicit_ddtree(checkpoint, config)
    for flag, path in (("--json", json_out), ("--report", report_out)):
        if path:
            check_output_path(path, flag)  # before scoring, not after it
    console = Console(stderr=False)
    rounds = tokens = 0

    def scored(result: Any) -> None:
        nonlocal rounds, tokens
        rounds, tokens = rounds + result.chain.n_rounds, tokens + result.chain.n_tokens
        progress.advance(1, status=f"{rounds} rounds, tau so far {tokens / max(1, rounds):.2f}")

    def started(path: str, sequences: int) -> None:
        nonlocal rounds, tokens
        rounds = tokens = 0
        label = f"cache {caches.index(path) + 1} of {len(caches)}: {path}" if len(caches) > 1 else None
        progress.start(sequences, note=label)

    with (
        _maybe_cluster(scheduler, workers) as client,
        StepProgress("eval", "sequences") as progress,
    ):
        result = evaluate_many(
            checkpoint,
            caches,
            config,
            on_sequence=scored,
            client=client,
            on_start=started,
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
@click.argument("checkpoints", nargs=-1, required=True)
@click.option("--cache", required=True, help="The cache every drafter is scored on (same rounds for all).")
@click.option("--device", default="cpu", show_default=True, help="Torch device the drafters run on.")
@scoring_dtype_option
@click.option(
    "--ddtree",
    default="",
    show_default=True,
    callback=_budgets,
    help="DDTree budgets for block (DFlash) drafters; '' for none.",
)
@limit_option
@click.option(
    "--seed", type=int, default=0, show_default=True, help="Seed of the paired-bootstrap intervals."
)
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
    ddtree: tuple[int, ...],
    json_out: str | None,
    report_out: str | None,
    tree_text: str | None,
    **options: Any,
) -> None:
    """Score several drafters (any family; target:mtp too) on one cache: one table, the same rounds.

    \b
    Example:
      scorer compare drafter/ eagle3/ target:mtp --cache cache/ --json compare.json
    """
    from rich.console import Console
    from rich.table import Table

    from scorer.compare import compare_drafters
    from scorer.evaluate import EvalConfig
    from scorer.report.compare_html import COST_HEADER, TAU_HEADER, cost_rows, drafter_names, tau_rows

    config = EvalConfig(ddtree=ddtree, tree=_tree(tree_text), **options)
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
    type=float,
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
@click.option("--json", "json_out", default=None, help="Write the report as JSON here.")
@click.option("--report", "report_out", default=None, help="Write a self-contained HTML page here.")
@click.option("--device", default="cpu", show_default=True, help="Torch device to replay on.")
@click.option(
    "--dtype",
    type=click.Choice(list(SCORER_DTYPES)),
    default="fp32",
    show_default=True,
    help="Baseline replay dtype (the other one is a hypothesis).",
)
@click.option(
    "--block-size", type=click.IntRange(min=2), default=None, help="Override the drafter's block size."
)
@click.option(
    "--anchors",
    type=click.Choice(["all", "chain"]),
    default="all",
    show_default=True,
    help="all: every anchor drafted once per distinct drafter input, shared by the hypotheses; chain: only "
    "where each replay goes, one small forward per round (1/tau of the block work, slow on CPU).",
)
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the sample and the bootstrap.")
@checkpoint_flags
@friendly_errors
def diagnose(
    checkpoint: str,
    caches: tuple[str, ...],
    json_out: str | None,
    report_out: str | None,
    target_layer_ids: str | None,
    mask_token_id: int | None,
    rope_theta: float | None,
    **options: Any,
) -> None:
    """Name the setting behind a low tau: replay CHECKPOINT as configured, then once per hypothesis.

    \b
    Example:
      scorer diagnose drafter/ --cache cache/ --train-metric 1.24 --json diag.json
    """
    from rich.console import Console

    from scorer.diagnose_run import DiagnoseConfig, diagnose_checkpoint
    from scorer.report.diagnose import render_diagnose

    config = DiagnoseConfig(overrides=_overrides(target_layer_ids, mask_token_id, rope_theta), **options)
    report = diagnose_checkpoint(
        checkpoint, caches, config, on_hypothesis=lambda what: click.echo(f"replaying: {what}", err=True)
    )
    render_diagnose(report, Console(stderr=False))
    _write_json(json_out, report)
    if report_out:
        from scorer.report.diagnose import write_diagnose_html

        click.echo(f"wrote {write_diagnose_html(report, report_out)}", err=True)


@main.command()
@click.argument("run_dir")
@click.option("--cache", required=True, help="Cache directory or URL to score every checkpoint on.")
@click.option(
    "--out", default=None, help="Output directory (default: RUN_DIR/sweep); reports are kept in OUT/results."
)
@click.option(
    "--device", default="cpu", show_default=True, help="Where the drafter runs: cpu, cuda or cuda:N."
)
@scoring_dtype_option
@click.option(
    "--ddtree",
    default="8,32,128",
    show_default=True,
    callback=_budgets,
    help="DDTree budgets (node counts); '' for none.",
)
@limit_option
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the bootstrap intervals.")
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
    help="Tokens of work per dask task (default: 2048).",
)
@cluster_flags
@friendly_errors
def sweep(
    run_dir: str,
    cache: str,
    out: str | None,
    ddtree: tuple[int, ...],
    scheduler: str | None,
    workers: int | None,
    tokens_per_task: int | None,
    **options: Any,
) -> None:
    """Score every checkpoint under RUN_DIR; write sweep.json, sweep.csv and a tau/acceptance-by-step plot.

    \b
    Example:
      scorer sweep runs/my-run/ --cache cache/ --workers 2
    """
    from scorer.evaluate import EvalConfig
    from scorer.sweep import sweep as run_sweep

    config = EvalConfig(ddtree=ddtree, **options)

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
@click.option(
    "--model",
    default="builtin:tiny-qwen3.5",
    show_default=True,
    help="The target: a local HF directory or builtin:...",
)
@click.option(
    "--prompts", default="builtin:default", show_default=True, help="JSONL prompts file or builtin:default."
)
@click.option(
    "--max-new-tokens",
    type=click.IntRange(min=1),
    default=64,
    show_default=True,
    help="Tokens to decode per prompt.",
)
@click.option(
    "--max-length", type=click.IntRange(min=2), default=4096, show_default=True, help="Longest sequence."
)
@click.option(
    "--dtype",
    type=click.Choice(list(DTYPE_NAMES)),
    default="fp32",
    show_default=True,
    help="Target and drafter dtype.",
)
@click.option(
    "--device", default="cpu", show_default=True, help="Where both models run: cpu, cuda or cuda:N."
)
@click.option(
    "--backend",
    type=click.Choice(list(BACKENDS)),
    default="auto",
    show_default=True,
    help="The target's linear-attention kernels: fla (CUDA), torch, or auto.",
)
@click.option("--limit", type=click.IntRange(min=1), default=None, help="Only the first N prompts.")
@click.option("--json", "json_out", default=None, help="Write the result as JSON here.")
@click.option(
    "--block-size", type=click.IntRange(min=2), default=None, help="Override the drafter's block size."
)
@drafting_flags
@click.option(
    "--id-from-line",
    is_flag=True,
    help='Number records that have no "id" by their line in the prompts file (default: refuse them).',
)
@click.option(
    "--allow-target-mismatch",
    is_flag=True,
    help="Run a drafter whose config records another target than --model (the output says so).",
)
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
    """Real greedy speculative decoding with the target verifying: the online tau per request.

    \b
    Example:
      scorer online drafter/ --model builtin:tiny-qwen3.5 --limit 4
    """
    from hscache.store.fsio import check_output_path
    from scorer.online import run_online

    if json_out:
        check_output_path(json_out, "--json")  # before decoding, not after it
    overrides = _overrides(target_layer_ids, mask_token_id, rope_theta)
    if block_size is not None:
        overrides["block_size"] = block_size
    if tree_text:
        raise click.UsageError("--tree: scorer online verifies chains only; score trees with scorer eval")
    result = run_online(checkpoint, overrides=overrides, **options)
    for warning in result["checkpoint"].get("warnings", []):
        click.echo(f"warning: {warning}", err=True)
    from scorer.target_identity import TargetCheck

    message = TargetCheck(**result["target_check"]).message()
    if message:
        click.echo(
            f"{'warning' if result['target_check']['status'] == 'mismatch' else 'note'}: {message}", err=True
        )
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
    type=click.Choice(["dflash", "eagle3", "dflash2"]),
    default="dflash",
    show_default=True,
    help="dflash: an HF DFlash directory; eagle3: an EAGLE-3 drafter in --layout; dflash2: the DFlash "
    "drafter --from DIR at DFlash2's identity start (NeMo Automodel's: drafts equal to its parent's).",
)
@click.option(
    "--from",
    "from_dir",
    default=None,
    help="DFlash2 only: the DFlash drafter whose weights it starts from.",
)
@click.option(
    "--layout",
    type=click.Choice(["speculators", "specforge", "eagle_release"]),
    default="speculators",
    show_default=True,
    help="EAGLE-3 only: speculators Eagle3Speculator, SpecForge LlamaForCausalLMEagle3, or the original release.",
)
@click.option(
    "--layers", "num_layers", type=click.IntRange(min=1), default=1, show_default=True, help="Drafter layers."
)
@click.option(
    "--block-size",
    type=click.IntRange(min=2),
    default=8,
    show_default=True,
    help="DFlash only: tokens per draft block (the anchor + block size - 1 drafted).",
)
@click.option(
    "--num-speculative-tokens",
    type=click.IntRange(min=1),
    default=3,
    show_default=True,
    help="EAGLE-3 only: the K written into its config.",
)
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the weights and the training.")
@click.option(
    "--train-steps",
    type=click.IntRange(min=0),
    default=0,
    show_default=True,
    help="Train for N CPU steps on the cache (scorer.train) instead of random weights.",
)
@click.option(
    "--eval-every",
    type=click.IntRange(min=0),
    default=0,
    show_default=True,
    help="DFlash with --train-steps: print tau on the cache every N steps (scorer.evaluate_module, "
    "the drafter in memory, first 64 sequences); 0: never.",
)
@click.option("--overwrite", is_flag=True, help="Replace OUT when it already holds files.")
@friendly_errors
def init(
    out: str,
    cache: str,
    family: str,
    from_dir: str | None,
    layout: str,
    num_layers: int,
    block_size: int,
    num_speculative_tokens: int,
    seed: int,
    train_steps: int,
    eval_every: int,
    overwrite: bool,
) -> None:
    """Write a drafter for CACHE's target to OUT (DFlash: an HF directory; EAGLE-3: --layout).

    \b
    Example:
      scorer init drafter/ --cache cache/ --train-steps 300
      scorer init eagle3/ --cache cache/ --family eagle3 --train-steps 100
      scorer init dflash2/ --cache cache/ --family dflash2 --from drafter/
    """
    if eval_every and (not train_steps or family != "dflash"):
        raise ScorerError("--eval-every watches a DFlash drafter while it trains: add --train-steps N")
    if (family == "dflash2") != (from_dir is not None):
        raise ScorerError(
            "--from DIR goes with --family dflash2 (the DFlash drafter it starts from), and only there"
        )
    if family == "dflash2":
        if train_steps:
            raise ScorerError(
                "--family dflash2 starts from a trained DFlash drafter: train that one (--from DIR)"
            )
        import hscache
        from scorer.families.dflash2.init import init_from_dflash
        from scorer.target_identity import cache_target_identity

        identity = cache_target_identity(hscache.open_cache(cache))
        init_from_dflash(from_dir, out, seed=seed, overwrite=overwrite, target_identity=identity)
        click.echo(f"saved a DFlash2 drafter at its identity start from {from_dir} to {out}")
        return
    if family == "eagle3":
        _init_eagle3(out, cache, layout, num_layers, num_speculative_tokens, seed, train_steps, overwrite)
        return
    if train_steps:
        from hscache.progress import StepProgress
        from scorer.drafter_dir import check_drafter_dir
        from scorer.train import train_drafter

        check_drafter_dir(out, overwrite)  # said before the progress line and the training
        with StepProgress("train", "steps") as progress:
            progress.start(train_steps)
            result = train_drafter(
                cache,
                out,
                steps=train_steps,
                num_layers=num_layers,
                block_size=block_size,
                seed=seed,
                log_every=0,
                overwrite=overwrite,
                on_step=lambda step, loss: progress.advance(1, status=f"loss {loss:.3f}"),
                eval_every=eval_every,
                on_eval=lambda step, report: click.echo(
                    f"step {step}: tau {report['tau']['pooled']:.3f} pooled over "
                    f"{report['requests']} cached sequences",
                    err=True,
                ),
            )
        click.echo(f"trained {train_steps} steps (final loss {result['final_loss']:.3f}); saved to {out}")
        return
    from scorer.init import init_drafter

    config, _ = init_drafter(
        cache, out, num_layers=num_layers, block_size=block_size, seed=seed, overwrite=overwrite
    )
    click.echo(
        f"saved a random drafter (hidden {config.hidden_size}, {config.num_hidden_layers} layers, "
        f"block {config.block_size}, target layers {list(config.target_layer_ids)}) to {out}"
    )


def _init_eagle3(
    out: str, cache: str, layout: str, num_layers: int, k: int, seed: int, train_steps: int, overwrite: bool
) -> None:
    options = dict(
        layout=layout, seed=seed, num_layers=num_layers, num_speculative_tokens=k, overwrite=overwrite
    )
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
