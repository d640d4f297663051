"""The ``scorer`` command line: a thin layer over scorer.evaluate / online / init."""

from __future__ import annotations

import contextlib
import functools
import json
import math
import sys
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
from scorer.report.tables import TABLE_FORMATS

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


class FiniteFloatRange(click.FloatRange):
    """A FloatRange that also refuses nan and inf (nan compares false with every bound)."""

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        number = super().convert(value, param, ctx)
        if not math.isfinite(number):
            self.fail(f"{value!r} is not a finite number", param, ctx)
        return number


# Ranges of the numeric flags every command shares: a value that cannot be right is refused with
# the flag's name before anything loads, never scored (--rope-theta -5 gave tau 1.000, exit 0).
POSITIVE = FiniteFloatRange(min=0, min_open=True)
SEED = click.IntRange(min=0, max=2**32 - 1)  # numpy's and torch's seeds alike
TOKEN_ID = click.IntRange(min=0)
# The sampling parameters' ranges (vLLM's SamplingParams._verify_args; hscache's validator refines
# them, e.g. a temperature in (0, 1e-5)): one type per parameter, for eval's checks and online alike.
SAMPLING_TYPES = {
    "temperature": FiniteFloatRange(min=0),
    "top_p": FiniteFloatRange(min=0, max=1, min_open=True),
    "top_k": click.IntRange(min=-1),  # -1: vLLM's "disabled", which the validator refuses with its fix
    "min_p": FiniteFloatRange(min=0, max=1),
    "presence_penalty": FiniteFloatRange(min=-2, max=2),
    "frequency_penalty": FiniteFloatRange(min=-2, max=2),
    "repetition_penalty": FiniteFloatRange(min=0, max=2, min_open=True),
}
# vLLM's draft_sample_method names: greedy (argmax drafts, one-hot verification), probabilistic.
DRAFT_SAMPLING = click.Choice(["greedy", "probabilistic"])


def check_outputs(*, directories: tuple[str, ...] = (), **paths: str | None) -> None:
    """Every output path of a command checked before its work (hscache's one definition,
    ``check_output_path``): ``flag=path`` pairs, e.g. ``json=...`` for ``--json``; the flags named
    in ``directories`` take a directory, the others a file."""
    from hscache.store.fsio import check_output_path

    for flag, path in paths.items():
        if path:
            check_output_path(path, "--" + flag.replace("_", "-"), directory=flag in directories)


def _budgets(_ctx: click.Context, _param: click.Parameter, text: str | None) -> tuple[int, ...]:
    """A click callback: a bad value is then reported with the option's name (--ddtree)."""
    return _int_list(text, minimum=1)


def _overrides(
    target_layer_ids: tuple[int, ...], mask_token_id: int | None, rope_theta: float | None
) -> dict:
    overrides: dict[str, Any] = {}
    if target_layer_ids:
        overrides["target_layer_ids"] = target_layer_ids
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
    click.option(
        "--target-layer-ids",
        default=None,
        callback=lambda _ctx, _param, text: _int_list(text, minimum=0),
        help="Override: comma-separated target layer ids.",
    ),
    click.option("--mask-token-id", type=TOKEN_ID, default=None, help="Override the mask token id."),
    click.option("--rope-theta", type=POSITIVE, default=None, help="Override the drafter's rope theta."),
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
    click.option(
        "--prompt-lookup-min",
        type=click.IntRange(min=1),
        default=None,
        help="ngram (CKPT 'ngram', vLLM's prompt lookup): the shortest suffix n-gram matched; with "
        "--prompt-lookup-max unset both default to vLLM's (5), one given sets the other.",
    ),
    click.option(
        "--prompt-lookup-max",
        type=click.IntRange(min=1),
        default=None,
        help="ngram: the longest suffix n-gram tried (the longest that occurred earlier wins).",
    ),
]


# Scoring at T > 0 (scorer/served.py, docs/sampling.md): the rule, and the setting the user expects the
# cache to hold. The cache records its own setting; these flags only check it (a cache cannot be
# reweighted to another setting), so one that differs is refused before anything is scored.
_SAMPLING_CHECKS = (
    ("--temperature", "temperature", SAMPLING_TYPES["temperature"]),
    ("--top-p", "top_p", SAMPLING_TYPES["top_p"]),
    ("--sample-top-k", "top_k", SAMPLING_TYPES["top_k"]),
    ("--min-p", "min_p", SAMPLING_TYPES["min_p"]),
    ("--presence-penalty", "presence_penalty", SAMPLING_TYPES["presence_penalty"]),
    ("--frequency-penalty", "frequency_penalty", SAMPLING_TYPES["frequency_penalty"]),
    ("--repetition-penalty", "repetition_penalty", SAMPLING_TYPES["repetition_penalty"]),
)
_sampling_flags = [
    click.option(
        "--draft-sampling",
        type=DRAFT_SAMPLING,
        default="greedy",
        show_default=True,
        help="On a sampled cache: greedy = argmax drafts, one-hot verification (every engine's default); "
        "probabilistic = drafts ~ softmax(logits / T), min(1, p/q) (vLLM draft_sample_method=probabilistic, "
        "SGLang --speculative-use-rejection-sampling): chains, E[rounds | y] by the exact DP.",
    ),
    click.option(
        "--sampling",
        "sampling_preset",
        default=None,
        metavar="PRESET",
        help="Check that the cache was sampled at this preset (greedy, qwen-thinking, qwen-thinking-coding, "
        "qwen-instruct); the cache's own setting is what is scored.",
    ),
    *(
        click.option(
            flag,
            name,
            type=kind,
            default=None,
            help=f"Check that the cache was sampled at this {name.replace('_', ' ')} (refused if it differs).",
        )
        for flag, name, kind in _SAMPLING_CHECKS
    ),
]


def sampling_flags(fn: Callable) -> Callable:
    for flag in reversed(_sampling_flags):
        fn = flag(fn)
    return fn


def _sampling_request(options: dict[str, Any]) -> dict[str, Any]:
    """Pop the sampling check flags from a command's options: EvalConfig.sampling."""
    given = {name: options.pop(name) for _, name, _ in _SAMPLING_CHECKS}
    preset = options.pop("sampling_preset")
    request = {k: v for k, v in given.items() if v is not None}
    return {**({"preset": preset} if preset else {}), **request}


def _lookup_settings(options: dict[str, Any]) -> dict[str, int]:
    """Take the n-gram family's --prompt-lookup-* out of ``options``: its settings, passed as
    EvalConfig.overrides like a drafter config's."""
    settings = {key: options.pop(key) for key in ("prompt_lookup_min", "prompt_lookup_max")}
    return {key: value for key, value in settings.items() if value is not None}


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
    type=POSITIVE,
    default=2.0,
    show_default=True,
    help="Working set for [rows, vocab] logits beyond the weights; the head is projected in row chunks.",
)
@click.option("--samples", type=click.IntRange(min=0), default=0, help="Show N rounds side by side.")
@click.option(
    "--seed",
    type=SEED,
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
@sampling_flags
@checkpoint_flags
@friendly_errors
def eval_command(
    checkpoint: str,
    caches: tuple[str, ...],
    ddtree: tuple[int, ...],
    tree_text: str | None,
    json_out: str | None,
    report_out: str | None,
    target_layer_ids: tuple[int, ...],
    mask_token_id: int | None,
    rope_theta: float | None,
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
    from scorer.evaluate import EvalConfig, evaluate_many
    from scorer.report.terminal import render_comparison, render_report

    sampling = _sampling_request(options)
    overrides = {**_overrides(target_layer_ids, mask_token_id, rope_theta), **_lookup_settings(options)}
    config = EvalConfig(
        ddtree=ddtree, overrides=overrides, tree=_tree(tree_text), sampling=sampling, **options
    )
    _refuse_explicit_ddtree(checkpoint, config)
    check_outputs(json=json_out, report=report_out)  # before scoring, not after it
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
@click.option(
    "--cache",
    "caches",
    multiple=True,
    required=True,
    help="The cache every drafter is scored on (same rounds for all); repeat it with caches of the same "
    "prompts at other sampling settings (greedy/, t07/) to see each drafter's tau per setting side by side.",
)
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
    "--seed", type=SEED, default=0, show_default=True, help="Seed of the paired-bootstrap intervals."
)
@click.option("--json", "json_out", default=None, help="Write the comparison as JSON here.")
@click.option("--report", "report_out", default=None, help="Write a self-contained HTML page here.")
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
@sampling_flags
@friendly_errors
def compare(
    checkpoints: tuple[str, ...],
    caches: tuple[str, ...],
    ddtree: tuple[int, ...],
    json_out: str | None,
    report_out: str | None,
    tree_text: str | None,
    table_format: str,
    **options: Any,
) -> None:
    """Score several drafters (any family; target:mtp too) on one cache: one table, the same rounds.

    \b
    Example:
      scorer compare drafter/ eagle3/ target:mtp --cache cache/ --json compare.json
    """
    from hscache.progress import StepProgress
    from scorer.compare import compare_drafters
    from scorer.evaluate import EvalConfig
    from scorer.report.compare_html import COST_HEADER, TAU_HEADER, cost_rows, drafter_names, tau_rows
    from scorer.report.tables import print_table

    check_outputs(json=json_out, report=report_out)  # before scoring, not after it
    sampling = _sampling_request(options)
    overrides = _lookup_settings(options)
    config = EvalConfig(
        ddtree=ddtree, overrides=overrides, tree=_tree(tree_text), sampling=sampling, **options
    )
    if len(caches) > 1:
        from rich.console import Console

        from scorer.compare_settings import compare_settings, render_settings

        document = compare_settings(checkpoints, caches, config)
        render_settings(document, Console(), table_format)
        _write_json(json_out, document)
        if report_out:
            from scorer.report.served import write_settings_html

            click.echo(f"wrote {write_settings_html(document, report_out)}", err=True)
        return
    rounds = tokens = drafters = 0

    def started(checkpoint: str, sequences: int) -> None:
        nonlocal rounds, tokens, drafters
        rounds, tokens, drafters = 0, 0, drafters + 1
        progress.start(sequences, note=f"drafter {drafters} of {len(checkpoints)}: {checkpoint}")

    def scored(result: Any) -> None:
        nonlocal rounds, tokens
        rounds, tokens = rounds + result.chain.n_rounds, tokens + result.chain.n_tokens
        progress.advance(1, status=f"{rounds} rounds, tau so far {tokens / max(1, rounds):.2f}")

    with StepProgress("compare", "sequences") as progress:
        document = compare_drafters(checkpoints, caches[0], config, on_sequence=scored, on_start=started)
    names = drafter_names(document)
    for header, rows in ((TAU_HEADER, tau_rows(document, names)), (COST_HEADER, cost_rows(document, names))):
        print_table(header, rows, table_format)
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
@click.option("--seed", type=SEED, default=0, show_default=True, help="Seed of the sample and the bootstrap.")
@checkpoint_flags
@friendly_errors
def diagnose(
    checkpoint: str,
    caches: tuple[str, ...],
    json_out: str | None,
    report_out: str | None,
    target_layer_ids: tuple[int, ...],
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

    check_outputs(json=json_out, report=report_out)  # before the replays, not after them
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
@click.option("--seed", type=SEED, default=0, show_default=True, help="Seed of the bootstrap intervals.")
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
@click.option(
    "--keep-going",
    is_flag=True,
    help="Score the other checkpoints when one cannot be (unloadable, another target, layers the cache "
    "lacks) and list the refused at the end; without it the sweep stops at the first, naming it.",
)
@cluster_flags
@sampling_flags
@friendly_errors
def sweep(
    run_dir: str,
    cache: str,
    out: str | None,
    ddtree: tuple[int, ...],
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
    from scorer.evaluate import EvalConfig
    from scorer.sweep import sweep as run_sweep

    out = out or str(Path(run_dir) / "sweep")
    check_outputs(out=out, directories=("out",))  # before scoring, not after it
    config = EvalConfig(ddtree=ddtree, sampling=_sampling_request(options), **options)

    def report(checkpoint: Any, reused: bool) -> None:
        click.echo(
            f"step {checkpoint.step:>10}  {'reused' if reused else 'scored'}  {checkpoint.path}", err=True
        )

    with _maybe_cluster(scheduler, workers) as client:
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


# ``scorer online`` at T > 0: the sampling flags of ``hscache extract`` (same names, same validator).
_ONLINE_SAMPLING = ("temperature", "top_p", "sample_top_k", "min_p", "presence_penalty", "frequency_penalty")
_online_sampling_flags = [
    click.option(
        "--sampling",
        default=None,
        metavar="PRESET",
        help="Decode sampled: qwen-thinking, qwen-thinking-coding, qwen-instruct or generation-config "
        "(as hscache extract); flags below override a preset's field. Default: greedy.",
    ),
    click.option(
        "--temperature",
        type=SAMPLING_TYPES["temperature"],
        default=None,
        help="0: greedy (default); else >= 1e-5.",
    ),
    click.option("--top-p", type=SAMPLING_TYPES["top_p"], default=None, help="In (0, 1] (default 1)."),
    click.option(
        "--sample-top-k",
        type=SAMPLING_TYPES["top_k"],
        default=None,
        help="Sampling top-k, >= 1 (required when sampling).",
    ),
    click.option("--min-p", type=SAMPLING_TYPES["min_p"], default=None, help="In [0, 1] (default 0)."),
    click.option(
        "--presence-penalty",
        type=SAMPLING_TYPES["presence_penalty"],
        default=None,
        help="In [-2, 2] (default 0).",
    ),
    click.option(
        "--frequency-penalty",
        type=SAMPLING_TYPES["frequency_penalty"],
        default=None,
        help="In [-2, 2] (default 0).",
    ),
    click.option(
        "--repetition-penalty",
        type=SAMPLING_TYPES["repetition_penalty"],
        default=None,
        help="In (0, 2] (default 1).",
    ),
    click.option("--seed", type=SEED, default=None, help="Keys every run's random streams (default 0)."),
    click.option(
        "--runs",
        type=click.IntRange(min=1),
        default=None,
        help="Sampled only: decodings of every prompt, each seeded (default 64).",
    ),
    click.option(
        "--draft-sampling",
        type=DRAFT_SAMPLING,
        default=None,
        help="Sampled only: greedy (the drafter's argmax, one-hot verification: vLLM's default) or probabilistic (drafts sampled "
        "from softmax(draft logits / T), vLLM's draft_sample_method=probabilistic).",
    ),
]


def online_sampling_flags(fn: Callable) -> Callable:
    for flag in reversed(_online_sampling_flags):
        fn = flag(fn)
    return fn


def _online_sampled_config(
    checkpoint: str,
    overrides: dict[str, Any],
    options: dict[str, Any],
    tree: tuple[int, int, int] | None = None,
) -> Any:
    """Pop the sampling flags from ``options``: None (greedy) or a validated SampledOnlineConfig
    (``tree``: SGLang's EAGLE tree verified by its target-only rule instead of vLLM's chain)."""
    from hscache.store.sampling import SamplingSetting

    preset, runs, draft_sampling = options.pop("sampling"), options.pop("runs"), options.pop("draft_sampling")
    flags = {name: options.pop(name) for name in (*_ONLINE_SAMPLING, "repetition_penalty", "seed")}
    setting = SamplingSetting.from_flags(
        preset, model=options["model"], top_k=flags.pop("sample_top_k"), **flags
    )  # one line for a bad value, before torch
    if setting.greedy:
        given = [f for f, v in (("--runs", runs), ("--draft-sampling", draft_sampling)) if v is not None]
        if given:
            raise ScorerError(
                f"{given[0]} applies to sampled decoding only; pass --temperature T > 0 or --sampling PRESET"
            )
        return None
    from scorer.online_sampled import SampledOnlineConfig

    return SampledOnlineConfig(
        checkpoint,
        setting,
        runs=64 if runs is None else runs,
        # vLLM's "greedy" draft_sample_method is the one-hot rule (online_sampled's name for it).
        draft_sampling="probabilistic" if draft_sampling == "probabilistic" else "onehot",
        tree=tree,
        overrides=overrides,
        **options,
    ).validate()


def _echo_sampled_online(result: dict[str, Any]) -> None:
    s = result["sampled"]
    tau = s["tau"]
    for run in s["per_run"]:
        value = "-" if run["tau"] is None else f"{run['tau']:.3f}"
        click.echo(f"run {run['run']:<4} tau {value}  rounds {run['rounds']}")
    from hscache.store.sampling import SamplingSetting

    click.echo(f"sampling: {SamplingSetting.from_dict(s['sampling']).describe()}")
    click.echo(f"rule: {s['rule']['description']}")
    if tau["mean"] is None:
        click.echo(
            "online tau: no rounds (every request ended before its first draft); raise --max-new-tokens"
        )
        return
    se = "-" if tau["se"] is None else f"{tau['se']:.4f}"
    pooled_se = "-" if tau["pooled_se"] is None else f"{tau['pooled_se']:.4f}"
    lo, hi = tau["interval"]
    plo, phi = tau["pooled_interval"]
    click.echo(
        f"online tau: pooled {tau['pooled']:.4f} (se {pooled_se}, 95% bootstrap [{plo:.4f}, {phi:.4f}]) over "
        f"{result['rounds']} rounds; mean over {s['runs']} runs {tau['mean']:.4f} (se {se}, [{lo:.4f}, {hi:.4f}]); "
        f"seed {s['seed']}"
    )


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
@online_sampling_flags
@friendly_errors
def online(
    checkpoint: str,
    json_out: str | None,
    tree_text: str | None,
    target_layer_ids: tuple[int, ...],
    mask_token_id: int | None,
    rope_theta: float | None,
    block_size: int | None,
    **options: Any,
) -> None:
    """Real speculative decoding with the target verifying: the online tau per request.

    Greedy by default. With a temperature (--temperature T or --sampling PRESET) the target samples
    and verifies by vLLM's MRV2 rule, --runs times with seeded random streams: mean tau over runs and
    its interval (docs/sampling.md "The online reference"). With --tree (EAGLE-3, MTP) it drafts
    SGLang's EAGLE tree and verifies by SGLang's target-only tree rule.

    \b
    Example:
      scorer online drafter/ --model builtin:tiny-qwen3.5 --limit 4
      scorer online drafter/ --sampling qwen-thinking --seed 1 --runs 64 --limit 2
    """

    check_outputs(json=json_out)  # before decoding, not after it
    overrides = {**_overrides(target_layer_ids, mask_token_id, rope_theta), **_lookup_settings(options)}
    if block_size is not None:
        overrides["block_size"] = block_size
    sampled = _online_sampled_config(checkpoint, overrides, options, _tree(tree_text))
    if tree_text and sampled is None:
        raise ScorerError(
            "--tree: scorer online verifies SGLang's tree at temperature > 0 (--temperature T or --sampling "
            "PRESET); at temperature 0 score trees with scorer eval"
        )
    if sampled is None:
        from scorer.online import run_online

        result = run_online(checkpoint, overrides=overrides, **options)
    else:
        from scorer.online_sampled import run_online_sampled

        result = run_online_sampled(sampled)
    for warning in result["checkpoint"].get("warnings", []):
        click.echo(f"warning: {warning}", err=True)
    from scorer.target_identity import TargetCheck

    message = TargetCheck(**result["target_check"]).message()
    if message:
        click.echo(
            f"{'warning' if result['target_check']['status'] == 'mismatch' else 'note'}: {message}", err=True
        )
    if sampled is not None:
        _echo_sampled_online(result)
        _write_json(json_out, result)
        return
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


def writes_drafter(command: Callable) -> Callable:
    """Run a command that writes a drafter to its ``out`` as that directory's one writer
    (scorer/drafter_dir.py: a second one is refused at once, naming this process), and answer
    Ctrl-C with what was kept instead of click's bare "Aborted!"."""

    @functools.wraps(command)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        from scorer.drafter_dir import drafter_writer

        out = kwargs["out"]
        before = "did not exist" if not Path(out).exists() else "is as it was"
        try:
            with drafter_writer(out, command=f"scorer init --family {kwargs['family']}"):
                return command(*args, **kwargs)
        except KeyboardInterrupt:
            # A drafter is published by one rename at the very end (scorer/drafter_dir.py), so an
            # interrupted run has saved nothing.
            click.echo(f"\ninterrupted: nothing was saved; {out} {before}", err=True)
            sys.exit(130)

    return wrapper


@main.command()
@click.argument("out")
@click.option("--cache", required=True, help="Cache whose target the drafter is sized for.")
@click.option(
    "--family",
    default="dflash",
    show_default=True,
    help="The drafter family: dflash (an HF DFlash directory), eagle3 (an EAGLE-3 drafter in --layout), "
    "dflash2 (the DFlash drafter --from DIR at DFlash2's identity start, NeMo Automodel's: drafts equal "
    "to its parent's). A flag of another family is refused by name.",
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
@click.option("--seed", type=SEED, default=0, show_default=True, help="Seed of the weights and the training.")
@click.option(
    "--train-steps",
    type=click.IntRange(min=0),
    default=0,
    show_default=True,
    help="Train for N CPU steps on the cache (scorer.families.dflash.train) instead of random weights.",
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
@writes_drafter
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
    from scorer.families import family_named

    chosen = family_named(family)
    context = click.get_current_context()
    flags = {p.name: p.opts[0] for p in context.command.params}
    given = {
        name: value
        for name, value in dict(
            from_dir=from_dir,
            layout=layout,
            num_layers=num_layers,
            block_size=block_size,
            num_speculative_tokens=num_speculative_tokens,
            eval_every=eval_every,
        ).items()
        if context.get_parameter_source(name) is not click.core.ParameterSource.DEFAULT
    }
    for name in given:
        if name not in chosen.init_options:
            own = ", ".join(flags[n] for n in chosen.init_options if n in flags) or "none"
            raise ScorerError(
                f"{flags[name]} does not apply to --family {family} ({chosen.display_name}); its own flags: {own}"
            )
    if chosen.init is None:
        raise ScorerError(
            f"--family {family}: {chosen.display_name} has no weights of its own to write; score it directly"
        )
    if "from_dir" in chosen.init_options and from_dir is None:
        raise ScorerError(
            f"--family {family} requires --from DIR: the trained DFlash drafter it starts from "
            f"(e.g. scorer init {family}/ --cache CACHE --family {family} --from drafter/)"
        )
    if given.get("eval_every") and not train_steps:
        raise ScorerError(
            f"--eval-every watches a {chosen.display_name} drafter while it trains: add --train-steps N"
        )
    options = {**given, "seed": seed, "overwrite": overwrite}
    if train_steps:
        if chosen.train is None:
            raise ScorerError(
                f"--train-steps does not apply to --family {family}: the scorer has no {chosen.display_name} "
                f"trainer (it trains {', '.join(f.name for f in _families() if f.train is not None)})"
            )
        from hscache.progress import StepProgress
        from scorer.drafter_dir import check_drafter_dir
        from scorer.train import train_drafter

        check_drafter_dir(out, overwrite)  # said before the progress line and the training
        if given.get("eval_every"):
            options["on_eval"] = lambda step, report: click.echo(
                f"step {step}: tau {report['tau']['pooled']:.3f} pooled over "
                f"{report['requests']} cached sequences",
                err=True,
            )
        with StepProgress("train", "steps") as progress:
            progress.start(train_steps)
            result = train_drafter(
                cache,
                out,
                family=family,
                steps=train_steps,
                on_step=lambda step, loss: progress.advance(1, status=f"loss {loss:.3f}"),
                **options,
            )
        config, what = (
            result["config"],
            f"trained {train_steps} steps (final loss {result['final_loss']:.3f})",
        )
    else:
        from scorer.init import init_drafter

        config, what = init_drafter(cache, out, family=family, **options), "random"
    # DFlash2 starts from the --from drafter's weights (its identity start), not from random ones.
    start = f" at its identity start from {from_dir}" if from_dir and not train_steps else ""
    what = "" if start else f"{what} "
    click.echo(
        f"saved a {what}{chosen.display_name} drafter{start} (hidden {config.hidden_size}, "
        f"{config.num_hidden_layers} layer(s), drafting {config.block_size - 1} tokens a round, target layers "
        f"{list(config.target_layer_ids)}) to {out}"
    )


def _families() -> tuple[Any, ...]:
    from scorer.families import FAMILIES

    return FAMILIES


if __name__ == "__main__":
    main()
