"""``scorer online``: real speculative decoding, the target verifying (scorer.online.greedy, and
scorer.online.sampled at T > 0)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from hscache.cli_options import (
    backend_option,
    decode_length_options,
    id_from_line_option,
    model_option,
    prompt_limit_option,
    prompts_option,
)
from hscache.store.dtypes import DTYPE_NAMES
from scorer.cli.shared import (
    DRAFT_SAMPLING,
    REJECTION_SAMPLING,
    SAMPLING_PARAMETER_FLAGS,
    SEED,
    ScoringCommand,
    apply_options,
    block_size_option,
    check_outputs,
    checkpoint_flags,
    drafting_flags,
    family_flag_names,
    family_settings,
    friendly_errors,
    given_on_command_line,
    refuse_foreign_settings,
    sampling_parameter_flags,
    write_json,
)
from scorer.errors import ScorerError

__all__ = ["online"]

# ``scorer online`` at T > 0: the sampling flags of ``hscache extract`` (same names, same validator).
online_sampling_flags = apply_options(
    [
        click.option(
            "--sampling",
            default=None,
            metavar="PRESET",
            help="Decode sampled: qwen-thinking, qwen-thinking-coding, qwen-instruct or generation-config "
            "(as hscache extract); flags below override a preset's field. Default: greedy.",
        ),
        sampling_parameter_flags(lambda words, allowed: f"Decode at this {words}: {allowed}."),
        click.option("--seed", type=SEED, default=None, help="Keys every run's random streams (default 0)."),
        click.option(
            "--runs",
            type=click.IntRange(min=1),
            default=None,
            help="Sampled only: decodings of every prompt, each seeded (default 64).",
        ),
        click.option(
            "--rejection-sample-method",
            type=REJECTION_SAMPLING,
            default=None,
            help="Sampled only: vLLM's verification of a chain round, standard or block (block verification, "
            "vLLM's V2 runner); with --draft-sampling probabilistic only the online loop scores block.",
        ),
        click.option(
            "--draft-sampling",
            type=DRAFT_SAMPLING,
            default=None,
            help="Sampled only: greedy (the drafter's argmax, one-hot verification: vLLM's default) or "
            "probabilistic (drafts sampled from softmax(draft logits / T), vLLM's "
            "draft_sample_method=probabilistic).",
        ),
    ]
)


def _sampled_setting(options: dict[str, Any]) -> tuple[Any, int, str, str] | None:
    """Pop the sampling flags from ``options``: None (greedy), or the validated SamplingSetting, the
    runs, the drafting rule and vLLM's rejection_sample_method of a SampledOnlineConfig (checked before
    torch is imported)."""
    from hscache.store.sampling import SamplingSetting

    preset, runs, draft_sampling = options.pop("sampling"), options.pop("runs"), options.pop("draft_sampling")
    method = options.pop("rejection_sample_method")
    flags = {name: options.pop(name) for name in (*(f[1] for f in SAMPLING_PARAMETER_FLAGS), "seed")}
    setting = SamplingSetting.from_flags(preset, model=options["model"], **flags)  # one line, before torch
    if setting.greedy:
        given = [
            f
            for f, v in (
                ("--runs", runs),
                ("--draft-sampling", draft_sampling),
                ("--rejection-sample-method", method),
            )
            if v is not None
        ]
        if given:
            raise ScorerError(
                f"{given[0]} applies to sampled decoding only; pass --temperature T > 0 or --sampling PRESET"
            )
        return None
    # vLLM's "greedy" draft_sample_method is the one-hot rule (online_sampled's name for it).
    return (
        setting,
        64 if runs is None else runs,
        "probabilistic" if draft_sampling == "probabilistic" else "greedy",
        method or "standard",
    )


def _echo_sampled(result: dict[str, Any]) -> None:
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


@click.command(cls=ScoringCommand)
@click.argument("checkpoint")
@model_option
@prompts_option
@decode_length_options
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
@backend_option
@prompt_limit_option
@click.option("--json", "json_out", default=None, help="Write the result as JSON here.")
@block_size_option
@click.option(
    "--ddtree",
    type=click.IntRange(min=1),
    default=None,
    metavar="N",
    help="Sampled only, DFlash: draft DFlash's DDTree of N nodes (one budget of scorer eval --ddtree) and "
    "verify it by SGLang's target-only tree rule, as --tree does for EAGLE-3 and MTP.",
)
@drafting_flags
@id_from_line_option
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
    tree: tuple[int, int, int] | None,
    overrides: dict[str, Any],
    block_size: int | None,
    **options: Any,
) -> None:
    """Real speculative decoding with the target verifying: the online tau per request.

    Greedy by default. With a temperature (--temperature T or --sampling PRESET) the target samples
    and verifies by vLLM's MRV2 rule, --runs times with seeded random streams: mean tau over runs and
    its interval (docs/sampling.md "The online reference"). With --tree (EAGLE-3, MTP) it drafts
    SGLang's EAGLE tree and verifies by SGLang's target-only tree rule; --ddtree N (DFlash) the same
    with DFlash's DDTree of N nodes.

    \b
    Example:
      scorer online drafter/ --model builtin:tiny-qwen3.5 --limit 4
      scorer online drafter/ --sampling qwen-thinking --seed 1 --runs 64 --limit 2
      scorer online drafter/ --temperature 0.7 --top-k 20 --ddtree 8 --runs 64 --limit 2
    """

    check_outputs(json=json_out)  # before decoding, not after it
    refuse_foreign_settings(checkpoint, options["config_path"], given_on_command_line(family_flag_names()))
    overrides = {**overrides, **family_settings(options)}
    if block_size is not None:
        overrides["block_size"] = block_size
    ddtree = options.pop("ddtree")
    sampled = _sampled_setting(options)
    if (tree or ddtree) and sampled is None:
        flag, what = ("--tree", "SGLang's tree") if tree else ("--ddtree", "DDTree by SGLang's tree rule")
        raise ScorerError(
            f"{flag}: scorer online verifies {what} at temperature > 0 (--temperature T or --sampling "
            "PRESET); at temperature 0 score trees with scorer eval"
        )
    from scorer.online.greedy import OnlineConfig, run_online

    config = OnlineConfig(overrides=overrides, **options)
    # what is knowable before the model loads, refused before any progress line
    prompts = len(config.records())
    from scorer.families.base import target_head_name
    from scorer.formats.files import check_headers

    if target_head_name(checkpoint) is None and Path(checkpoint).exists():
        # a corrupt checkpoint is one line, not a line after the progress; target:<head> has no file,
        # and a missing path is refused by the loader's own line
        check_headers(checkpoint)
    if sampled is None:
        config.check_sizes()
    else:
        from scorer.online.sampled import SampledOnlineConfig, check_runs_fit, run_online_sampled

        setting, runs, draft_sampling, method = sampled
        sampled_config = SampledOnlineConfig(
            checkpoint,
            setting,
            runs,
            draft_sampling,
            tree,
            ddtree,
            online=config,
            rejection_sample_method=method,
        ).validate()
        check_runs_fit(runs, prompts, config.max_length)
        config.check_sizes(ddtree)
    from hscache.progress import StepProgress

    # progress like every long step (was: nothing until the end, 15 min for the docs' example)
    progress = StepProgress("online", "prompts" if sampled is None else "tokens", secondary_unit="tok")
    try:
        with progress:
            if sampled is None:
                progress.start(prompts, note=f"decoding {prompts} prompts, the target verifying every round")
                rounds = tokens = 0

                def ended(request: Any) -> None:
                    nonlocal rounds, tokens
                    rounds += len(request.tokens_per_round)
                    tokens += sum(request.tokens_per_round)
                    progress.advance(
                        1,
                        len(request.token_ids) - request.prompt_len,
                        status=f"tau so far {tokens / max(1, rounds):.2f}",
                    )

                result = run_online(checkpoint, config, ended)
            else:
                # decode_runs starts it: tokens committed out of every lane's budget, after every step
                result = run_online_sampled(sampled_config, progress=progress)
            progress.eager = True  # the closing line, with the rates, however short the run
    except Exception:
        progress.quiet = True  # the error is the last line
        raise
    for warning in result["checkpoint"].get("warnings", []):
        click.echo(f"warning: {warning}", err=True)
    from scorer.target_identity import TargetCheck

    message = TargetCheck(**result["target_check"]).message()
    if message:
        click.echo(
            f"{'warning' if result['target_check']['status'] == 'mismatch' else 'note'}: {message}", err=True
        )
    if sampled is not None:
        _echo_sampled(result)
        write_json(json_out, result)
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
    write_json(json_out, result)
