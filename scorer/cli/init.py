"""``scorer init``: a drafter of any family written for a cache's target, random or trained
(scorer.make: init_drafter / train_drafter; the family makes it)."""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from hscache.cli_options import number_option, renamed_flag
from scorer.cli.shared import (
    flag_type,
    friendly_errors,
    num_speculative_tokens_option,
    seed_option,
    train_steps_option,
    written_block_size_option,
)
from scorer.errors import ScorerError

__all__ = ["init"]


def writes_drafter(command: Callable) -> Callable:
    """Run a command that writes a drafter to its ``out`` as that directory's one writer
    (scorer/drafter_dir.py: a second one is refused at once, naming this process), and answer
    Ctrl-C with what was kept instead of click's bare "Aborted!": while training, the drafter of
    the last completed step (scorer/training_stop.py); else nothing."""

    @functools.wraps(command)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        from scorer.drafter_dir import drafter_writer
        from scorer.training_stop import TrainingInterrupted

        out = kwargs["out"]
        before = "did not exist" if not Path(out).exists() else "is as it was"
        try:
            with drafter_writer(out, command=f"scorer init --family {kwargs['family']}"):
                return command(*args, **kwargs)
        except TrainingInterrupted as stopped:
            click.echo(f"\n{stopped}", err=True)
            sys.exit(130)
        except KeyboardInterrupt:
            # A drafter is published by one rename at the very end (scorer/drafter_dir.py), so a run
            # interrupted outside training (or by a second Ctrl-C) has saved nothing.
            click.echo(f"\ninterrupted: nothing was saved; {out} {before}", err=True)
            sys.exit(130)

    return wrapper


def _families() -> tuple[Any, ...]:
    from scorer.families import FAMILIES

    return FAMILIES


@click.command()
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
@number_option(
    "--draft-layers",
    1,
    "The drafter's depth in decoder layers, at most its target's (the target layers it reads are "
    "the cache's, hscache extract --layers).",
    minimum=1,
    name="num_layers",
)
@renamed_flag(
    "--layers",
    "--draft-layers",
    " (the drafter's depth; --layers names the target layers a cache holds, in hscache extract)",
)
@written_block_size_option
@click.option(
    "--mask-token-id",
    type=flag_type("mask_token_id"),
    default=None,
    help="DFlash: the mask id its blocks are filled with, recorded in its config (default: the target "
    "tokenizer's mask token; required when it defines none). Must be below the vocabulary size.",
)
@num_speculative_tokens_option("EAGLE-3 only: the K written into its config.", default=3)
@seed_option("Seed of the weights and the training.")
@train_steps_option(
    0,
    "Train for N CPU steps on the cache (the family's trainer, scorer.train_drafter) instead of random weights.",
)
@number_option(
    "--eval-every",
    0,
    "DFlash with --train-steps: print tau on the cache every N steps (scorer.evaluate_module, "
    "the drafter in memory, first 64 sequences); 0: never.",
)
@click.option(
    "--prompt-anchors/--no-prompt-anchors",
    default=True,
    show_default=True,
    help="DFlash with --train-steps: also train at anchors inside the prompts, slot 1 against the "
    "target's argmax there (the drafter learns to read its anchor token; bench/dflash_anchor.py); "
    "--no-prompt-anchors: only at anchors in the generated text.",
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
    mask_token_id: int | None,
    num_speculative_tokens: int,
    seed: int,
    train_steps: int,
    eval_every: int,
    prompt_anchors: bool,
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
            mask_token_id=mask_token_id,
            num_speculative_tokens=num_speculative_tokens,
            eval_every=eval_every,
            prompt_anchors=prompt_anchors,
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
    if "prompt_anchors" in given and not train_steps:
        raise ScorerError(
            f"--prompt-anchors chooses where a {chosen.display_name} drafter trains: add --train-steps N"
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
        from scorer.make import train_drafter

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
        from scorer.make import init_drafter

        config, what = init_drafter(cache, out, family=family, **options), "random"
    # DFlash2 starts from the --from drafter's weights (its identity start), not from random ones.
    start = f" at its identity start from {from_dir}" if from_dir and not train_steps else ""
    what = "" if start else f"{what} "
    summary = getattr(config, "init_summary", None)  # a family that says what it wrote in its own words
    if summary is not None:
        click.echo(f"saved {summary} to {out}")
        return
    click.echo(
        f"saved a {what}{chosen.display_name} drafter{start} (hidden {config.hidden_size}, "
        f"{config.num_hidden_layers} layer(s), drafting {config.block_size - 1} tokens a round, target layers "
        f"{list(config.target_layer_ids)}) to {out}"
    )
