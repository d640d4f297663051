"""What the ``scorer`` commands share: option declarations, range checks, output helpers.

Every flag two commands take is declared here once (the sampling parameters of eval / compare /
sweep, which check a cache's setting, and of online, which decodes at it, included); the options
they share with ``hscache extract`` and the drift study (the target, the prompts, --json / --report)
are in hscache/cli_options.py. A family's own flags (``Family.flags``, e.g. the n-gram proposer's
--prompt-lookup-min) are declared in its row; the scoring commands (`ScoringCommand`) take them
from the registry.
"""

from __future__ import annotations

import contextlib
import functools
import json
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import click

from hscache.cli import error_boundary
from hscache.cli_options import FiniteFloatRange, apply_options, number_option, renamed_sample_top_k
from hscache.errors import HscacheError
from hscache.store.dtypes import SCORER_DTYPES
from hscache.store.fsio import atomic_write_bytes
from scorer.config_numbers import DRAFTER_NUMBERS
from scorer.errors import ScorerError
from scorer.families.base import FamilyFlag
from scorer.rules import DRAFT_SAMPLE_METHODS, REJECTION_SAMPLE_METHODS

__all__ = [
    "DRAFT_SAMPLING",
    "DROPPED_QUIETLY",
    "FAMILY_FLAGS",
    "POSITIVE",
    "SAMPLING_PARAMETER_FLAGS",
    "SEED",
    "TauProgress",
    "TOKEN_ID",
    "FiniteFloatRange",
    "ScoringCommand",
    "anchors_option",
    "apply_options",
    "block_size_option",
    "budgets",
    "check_outputs",
    "checkpoint_flags",
    "cluster_flags",
    "ddtree_option",
    "device_option",
    "drafter_dtype_option",
    "drafting_flags",
    "family_flag_names",
    "family_flags",
    "family_settings",
    "flag_type",
    "friendly_errors",
    "given_on_command_line",
    "int_list",
    "limit_option",
    "maybe_cluster",
    "num_speculative_tokens_option",
    "overrides_of",
    "refuse_foreign_settings",
    "registered_flags",
    "sampling_check_flags",
    "sampling_parameter_flags",
    "sampling_request",
    "scoring_config",
    "scoring_dtype_option",
    "seed_option",
    "train_steps_option",
    "write_json",
    "written_block_size_option",
]


# Expected errors (bad checkpoint, incompatible cache, bad flags): one line, exit 2.
friendly_errors = error_boundary(ScorerError, HscacheError)


def int_list(text: str | None, minimum: int | None = None) -> tuple[int, ...]:
    """A comma-separated list of integers (``"8,32"``), each at least ``minimum``; () for none."""
    if not text:
        return ()
    try:
        values = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise click.BadParameter(f"{text!r} is not a comma-separated list of integers") from None
    if minimum is not None and any(v < minimum for v in values):
        raise click.BadParameter(f"{text!r}: every value must be at least {minimum}")
    return values


# Ranges of the numeric flags every command shares: a value that cannot be right is refused with
# the flag's name before anything loads, never scored (--rope-theta -5 gave tau 1.000, exit 0).
POSITIVE = FiniteFloatRange(min=0, min_open=True)


def flag_type(name: str) -> click.ParamType:
    """The click type of the drafter-config flag ``--NAME``, from the one table of ranges the
    families' config loaders check too (scorer/config_numbers.py)."""
    wanted = DRAFTER_NUMBERS[name]
    if wanted.integer:
        return click.IntRange(min=int(wanted.minimum), min_open=wanted.min_open)
    return FiniteFloatRange(min=wanted.minimum, min_open=wanted.min_open)


SEED = click.IntRange(min=0, max=2**32 - 1)  # numpy's and torch's seeds alike
TOKEN_ID = click.IntRange(min=0)
# vLLM's draft_sample_method names: greedy (argmax drafts, one-hot verification), probabilistic.
DRAFT_SAMPLING = click.Choice(list(DRAFT_SAMPLE_METHODS))
REJECTION_SAMPLING = click.Choice(list(REJECTION_SAMPLE_METHODS))


def check_outputs(*, directories: tuple[str, ...] = (), **paths: str | None) -> None:
    """Every output path of a command checked before its work (hscache's one definition,
    ``check_output_path``, hscache/store/output_paths.py): ``flag=path`` pairs, e.g. ``json=...``
    for ``--json`` (a JSON report), ``report=...`` (an HTML page); the flags named in
    ``directories`` take a directory. A flag given an empty path is refused, not ignored."""
    from hscache.store.output_paths import check_output_path

    for flag, path in paths.items():
        if path is not None:
            kind = (
                "directory" if flag in directories else {"json": "json", "report": "html"}.get(flag, "file")
            )
            check_output_path(path, "--" + flag.replace("_", "-"), kind=kind)


def write_json(path: str | None, document: dict) -> None:
    """Write ``document`` to ``path`` (atomically) and say so on stderr; nothing without a path."""
    if path:
        atomic_write_bytes(Path(path), (json.dumps(document, indent=2) + "\n").encode())
        click.echo(f"wrote {path}", err=True)


def budgets(_ctx: click.Context, _param: click.Parameter, text: str | None) -> tuple[int, ...]:
    """A click callback: a bad value is then reported with the option's name (--ddtree)."""
    return int_list(text, minimum=1)


def _tree(_ctx: click.Context, _param: click.Parameter, text: str | None) -> tuple[int, int, int] | None:
    """A click callback: --tree STEPS,TOPK,TOKENS (or 'sglang') as EvalConfig.tree."""
    if not text:
        return None
    if text == "sglang":  # SGLang's auto_choose_speculative_params for non-DeepSeek targets
        return (5, 4, 8)
    values = int_list(text, minimum=1)
    if len(values) != 3:
        raise click.BadParameter(f"{text!r}: expected STEPS,TOPK,TOKENS (SGLang's EAGLE tree), e.g. 5,4,8")
    return values  # type: ignore[return-value]


def overrides_of(
    target_layer_ids: tuple[int, ...], mask_token_id: int | None, rope_theta: float | None
) -> dict[str, Any]:
    """The checkpoint override flags given (not empty / None) as EvalConfig.overrides."""
    overrides: dict[str, Any] = {}
    if target_layer_ids:
        overrides["target_layer_ids"] = target_layer_ids
    if mask_token_id is not None:
        overrides["mask_token_id"] = mask_token_id
    if rope_theta is not None:
        overrides["rope_theta"] = rope_theta
    return overrides


def _passing_overrides(command: Callable) -> Callable:
    """Call ``command`` with the override flags' values gathered into ``overrides`` (overrides_of)."""

    @functools.wraps(command)
    def wrapper(
        *args: Any,
        target_layer_ids: tuple[int, ...],
        mask_token_id: int | None,
        rope_theta: float | None,
        **kwargs: Any,
    ) -> Any:
        return command(*args, overrides=overrides_of(target_layer_ids, mask_token_id, rope_theta), **kwargs)

    return wrapper


def registered_flags() -> tuple[FamilyFlag, ...]:
    """Every registered family's flags (``Family.flags``), in registry order, each once.

    Raises:
        ValueError: two families declare the same flag differently (a bug in one of their rows).
    """
    import scorer.families as registry  # read when asked: a family registered later counts

    flags: dict[str, tuple[FamilyFlag, str]] = {}
    for family in registry.FAMILIES:
        for flag in family.flags:
            known, owner = flags.setdefault(flag.name, (flag, family.name))
            if known != flag:
                raise ValueError(
                    f"{flag.flag} is declared differently by the {owner} and {family.name} families"
                )
    return tuple(flag for flag, _ in flags.values())


def family_flag_names() -> tuple[str, ...]:
    """The parameter names of every registered family's flags (``prompt_lookup_min``, ...)."""
    return tuple(flag.name for flag in registered_flags())


def family_settings(options: dict[str, Any]) -> dict[str, Any]:
    """Take every registered family's flags out of ``options``: those given, passed as
    EvalConfig.overrides like a drafter config's (a family reads its own, Family.eval_options)."""
    settings = {name: options.pop(name) for name in family_flag_names()}
    return {name: value for name, value in settings.items() if value is not None}


def _family_option(flag: FamilyFlag) -> click.Option:
    """The click option of a family's flag: its type and lower bound, default None (not given)."""
    if flag.type is int:
        kind: Any = click.IntRange(min=flag.minimum)
    elif flag.type is float:
        kind = FiniteFloatRange(min=flag.minimum)
    else:
        kind = flag.type
    return click.Option([flag.flag, flag.name], type=kind, default=None, help=flag.help)


class _FamilyFlagsSlot:
    """Where a `ScoringCommand` puts the families' flags among its declared options."""


FAMILY_FLAGS = _FamilyFlagsSlot()


def family_flags(command: Callable) -> Callable:
    """Every registered family's flags, here among ``command``'s options (a `ScoringCommand`:
    ``@click.command(cls=ScoringCommand)``), in registry order."""
    # click.command collects the parameters its decorators leave here (the last applied first)
    command.__click_params__ = [*getattr(command, "__click_params__", []), FAMILY_FLAGS]  # type: ignore[attr-defined]
    return command


class ScoringCommand(click.Command):
    """A command that scores a drafter of any family (eval, compare, online): its options include
    every registered family's flags (``Family.flags``) where `family_flags` stands, read from the
    registry whenever the command's parameters are, so a family's row alone declares them."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._declared: list[Any] = []
        self._expanded: tuple[tuple[FamilyFlag, ...], list[click.Parameter]] | None = None
        self._options: dict[FamilyFlag, click.Option] = {}
        super().__init__(*args, **kwargs)

    @property  # type: ignore[override]
    def params(self) -> list[click.Parameter]:
        flags = registered_flags()
        if self._expanded is None or self._expanded[0] != flags:
            # one list while the registry stands: click appends its --help option to it and pops it
            params: list[click.Parameter] = []
            for param in self._declared:
                if param is FAMILY_FLAGS:
                    params += [self._options.setdefault(f, _family_option(f)) for f in flags]
                else:
                    params.append(param)
            names = [p.name for p in params]
            clashes = sorted({name for name in names if names.count(name) > 1})
            if clashes:
                raise ValueError(f"{self.name}: a family flag takes the name of another option: {clashes}")
            self._expanded = (flags, params)
        return self._expanded[1]

    @params.setter
    def params(self, value: list[click.Parameter]) -> None:
        self._declared, self._expanded = list(value), None


# Settings that have a default a family that does not read them drops quietly
# (``Family.effective_config``: DDTree budgets for a chain drafter); given on the command line for
# such a family they are refused by name (``refuse_foreign_settings``).
DROPPED_QUIETLY = ("ddtree",)


def refuse_foreign_settings(
    checkpoint: str | Sequence[str], config_path: str | None, names: Iterable[str]
) -> None:
    """Refuse, by flag, the settings ``names`` (parameter names of the current command, given on its
    command line) that the checkpoint's family does not read (``Family.eval_options``): a setting
    that defaults quietly (``DROPPED_QUIETLY``) or another family's flag (``Family.flags``). Given
    several checkpoints (``scorer compare``), a setting is refused when none of their families reads it
    (each family is passed only its own settings)."""
    from scorer.families import family_for, probe_checkpoint

    names = list(names)
    if not names:
        return
    checkpoints = [checkpoint] if isinstance(checkpoint, str) else list(checkpoint)
    families = []
    for one in checkpoints:
        try:
            families.append(family_for(probe_checkpoint(one, config_path)))
        except ScorerError:
            return  # a bad checkpoint: the loader names what is wrong with it, as without these flags
    foreign = [name for name in names if not any(name in family.eval_options for family in families)]
    if not foreign:
        return
    flags = {p.name: p.opts[0] for p in click.get_current_context().command.params}
    read = sorted({flags[n] for family in families for n in family.eval_options if n in flags})
    if len(checkpoints) == 1:
        where, who = checkpoints[0], f"the {families[0].display_name} family reads"
    else:
        where = "any of " + ", ".join(checkpoints)
        who = "their families (" + ", ".join(dict.fromkeys(f.display_name for f in families)) + ") read"
    raise ScorerError(
        f"{', '.join(flags[n] for n in foreign)} does not apply to {where}: {who} "
        f"{', '.join(read) or 'no flag of this command'}"
    )


def given_on_command_line(names: Iterable[str]) -> list[str]:
    """The parameters among ``names`` the user typed (not their defaults) with a value."""
    from click.core import ParameterSource

    context = click.get_current_context()
    return [
        name
        for name in names
        if context.params.get(name) and context.get_parameter_source(name) is ParameterSource.COMMANDLINE
    ]


# Options that eval, compare, sweep and diagnose (some also online and init) declare alike; where
# a command says more about one, the option takes that command's help.
device_option = click.option(
    "--device", default="cpu", show_default=True, help="Where the drafter runs: cpu, cuda or cuda:N."
)
limit_option = click.option(
    "--limit", type=click.IntRange(min=1), default=None, help="Only the first N sequences."
)
block_size_option = click.option(
    "--block-size",
    type=flag_type("block_size"),
    default=None,
    help="Override the drafter's block size (gives one to a checkpoint without a config).",
)


def drafter_dtype_option(
    help_text: str = "Drafter dtype while scoring (the cache is read in its own dtype).",
    flag: str = "--dtype",
) -> Callable[[Callable], Callable]:
    """--dtype (or ``flag``): the drafter's dtype while it replays (EvalConfig.dtype)."""
    return click.option(
        flag, type=click.Choice(list(SCORER_DTYPES)), default="fp32", show_default=True, help=help_text
    )


scoring_dtype_option = drafter_dtype_option()


def ddtree_option(default: str) -> Callable[[Callable], Callable]:
    """--ddtree: the DDTree budgets scored beside the chain (EvalConfig.ddtree), ``default`` shown."""
    return click.option(
        "--ddtree",
        default=default,
        show_default=True,
        callback=budgets,
        help="DDTree budgets (node counts) of block (DFlash) drafters; '' for none.",
    )


def seed_option(help_text: str) -> Callable[[Callable], Callable]:
    """--seed, 0 by default: ``help_text`` says what it seeds in this command."""
    return click.option("--seed", type=SEED, default=0, show_default=True, help=help_text)


def anchors_option(help_text: str) -> Callable[[Callable], Callable]:
    """--anchors all|chain: which anchors the drafter drafts (EvalConfig.anchors)."""
    return click.option(
        "--anchors", type=click.Choice(["all", "chain"]), default="all", show_default=True, help=help_text
    )


def num_speculative_tokens_option(
    help_text: str, default: int | None = None
) -> Callable[[Callable], Callable]:
    """--num-speculative-tokens: the K tokens a chain drafter drafts per round; None (scoring): the
    checkpoint's config's, else the engines' default; a default given (init) is shown."""
    return click.option(
        "--num-speculative-tokens",
        type=click.IntRange(min=1),
        default=default,
        show_default=None if default is None else True,
        help=help_text,
    )


# What ``scorer init`` and the drift study (which trains a DFlash drafter when given no checkpoint)
# declare alike: the training steps and the block size of the drafter written.
def train_steps_option(default: int, help_text: str) -> Callable[[Callable], Callable]:
    """--train-steps N (scorer.train_drafter), ``default`` shown."""
    return number_option("--train-steps", default, help_text)


written_block_size_option = number_option(
    "--block-size",
    8,
    "DFlash: tokens per draft block of the drafter written (the anchor + block size - 1 drafted).",
    minimum=DRAFTER_NUMBERS["block_size"].minimum,
)


_checkpoint_options = apply_options(
    [
        click.option(
            "--target-layer-ids",
            default=None,
            callback=lambda _ctx, _param, text: int_list(text, minimum=0),
            help="Override: comma-separated target layer ids.",
        ),
        click.option(
            "--mask-token-id",
            type=flag_type("mask_token_id"),
            default=None,
            help="Override the mask token id.",
        ),
        click.option(
            "--rope-theta",
            type=flag_type("rope_theta"),
            default=None,
            help="Override the drafter's rope theta.",
        ),
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
)


def checkpoint_flags(command: Callable) -> Callable:
    """The checkpoint flags (overrides, --config, --trust-checkpoint); ``command`` takes the three
    override flags as one ``overrides`` dict (EvalConfig.overrides)."""
    return _checkpoint_options(_passing_overrides(command))


# How a command drafts: chain length, SGLang's tree, and every family's own flags (a ScoringCommand).
drafting_flags = apply_options(
    [
        num_speculative_tokens_option(
            "Autoregressive families (EAGLE-3, MTP): draft a chain of K tokens per round (vLLM's "
            "num_speculative_tokens). Default: the checkpoint's config, else the engines' default."
        ),
        click.option(
            "--tree",
            default=None,
            callback=_tree,
            metavar="STEPS,TOPK,TOKENS",
            help="Autoregressive families: SGLang's EAGLE tree (--speculative-num-steps, "
            "--speculative-eagle-topk, --speculative-num-draft-tokens), scored beside the chain; "
            "'sglang' = SGLang's default 5,4,8.",
        ),
        family_flags,
    ]
)

# The sampling parameters' flags, declared once: (flag, parameter name, range, what the range
# allows). Their ranges are vLLM's SamplingParams._verify_args; hscache's validator refines them
# (e.g. a temperature in (0, 1e-5)). eval, compare and sweep check a cache's recorded setting
# against them (a cache cannot be reweighted to another setting); online decodes at them.
SAMPLING_PARAMETER_FLAGS: tuple[tuple[str, str, click.ParamType, str], ...] = (
    ("--temperature", "temperature", FiniteFloatRange(min=0), "0: greedy, the default; else >= 1e-5"),
    ("--top-p", "top_p", FiniteFloatRange(min=0, max=1, min_open=True), "in (0, 1], default 1"),
    # -1: vLLM's "disabled", which the validator refuses with its fix
    ("--top-k", "top_k", click.IntRange(min=-1), ">= 1, required when sampling"),
    ("--min-p", "min_p", FiniteFloatRange(min=0, max=1), "in [0, 1], default 0"),
    ("--presence-penalty", "presence_penalty", FiniteFloatRange(min=-2, max=2), "in [-2, 2], default 0"),
    ("--frequency-penalty", "frequency_penalty", FiniteFloatRange(min=-2, max=2), "in [-2, 2], default 0"),
    (
        "--repetition-penalty",
        "repetition_penalty",
        FiniteFloatRange(min=0, max=2, min_open=True),
        "in (0, 2], default 1",
    ),
)


def sampling_parameter_flags(help_text: Callable[[str, str], str]) -> Callable[[Callable], Callable]:
    """The sampling parameters' flags (``SAMPLING_PARAMETER_FLAGS``), each described by
    ``help_text(parameter in words, its range)``; every one defaults to None (not given)."""
    return apply_options(
        [
            *(
                click.option(
                    flag, name, type=kind, default=None, help=help_text(name.replace("_", " "), allowed)
                )
                for flag, name, kind, allowed in SAMPLING_PARAMETER_FLAGS
            ),
            renamed_sample_top_k,
        ]
    )


# Scoring at T > 0 (scorer/offline/sampled_view.py, docs/sampling.md): the rule, and the setting the user expects the
# cache to hold. The cache records its own setting; these flags only check it, so one that differs is
# refused before anything is scored.
sampling_check_flags = apply_options(
    [
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
            "--rejection-sample-method",
            type=REJECTION_SAMPLING,
            default="standard",
            show_default=True,
            help="vLLM's verification rule: standard (token by token) or block (Sun et al.'s block "
            "verification, vLLM's V2 model runner). With greedy drafts both accept the leading match of the "
            "served text, so the replay is the same; block with --draft-sampling probabilistic is refused "
            "(its expectation needs the target at drafts the text never took).",
        ),
        click.option(
            "--sampling",
            "sampling_preset",
            default=None,
            metavar="PRESET",
            help="Check that the cache was sampled at this preset (greedy, qwen-thinking, qwen-thinking-coding, "
            "qwen-instruct); the cache's own setting is what is scored.",
        ),
        sampling_parameter_flags(
            lambda words, _allowed: (
                f"Check that the cache was sampled at this {words} (refused if it differs)."
            )
        ),
    ]
)


def scoring_config(
    checkpoint: str | Sequence[str], options: dict[str, Any], overrides: dict[str, Any] | None = None
) -> Any:
    """The ``EvalConfig`` of a scoring command's ``options`` (its sampling check flags and family flags
    popped, ``overrides`` under the family's own), after refusing the settings given on the command line
    that the checkpoint's family does not read (``refuse_foreign_settings``)."""
    from scorer.studies.evaluate import EvalConfig

    sampling = sampling_request(options)
    config = EvalConfig(
        overrides={**(overrides or {}), **family_settings(options)}, sampling=sampling, **options
    )
    refuse_foreign_settings(
        checkpoint, config.config_path, given_on_command_line((*DROPPED_QUIETLY, *family_flag_names()))
    )
    return config


class TauProgress:
    """A scoring command's progress line: sequences scored and the tau (tokens per round) so far,
    counted afresh from each ``restart`` (a new drafter, a new cache)."""

    def __init__(self, progress: Any) -> None:
        self.progress, self.rounds, self.tokens = progress, 0, 0

    def restart(self, sequences: int, note: str | None) -> None:
        self.rounds = self.tokens = 0
        self.progress.start(sequences, note=note)

    def scored(self, result: Any) -> None:
        """``on_sequence`` of the studies: one sequence's ``SequenceResult`` scored."""
        self.rounds += result.chain.n_rounds
        self.tokens += result.chain.n_tokens
        self.progress.advance(
            1, status=f"{self.rounds} rounds, tau so far {self.tokens / max(1, self.rounds):.2f}"
        )


def sampling_request(options: dict[str, Any]) -> dict[str, Any]:
    """Pop the sampling check flags from a command's options: EvalConfig.sampling."""
    given = {name: options.pop(name) for _, name, _, _ in SAMPLING_PARAMETER_FLAGS}
    preset = options.pop("sampling_preset")
    request = {k: v for k, v in given.items() if v is not None}
    return {**({"preset": preset} if preset else {}), **request}


cluster_flags = apply_options(
    [
        click.option(
            "--scheduler", default=None, help="Address of a running dask scheduler (tcp://host:8786)."
        ),
        click.option(
            "--workers",
            type=click.IntRange(min=1),
            default=None,
            help="Start a local dask cluster of N single-threaded worker processes for this run.",
        ),
    ]
)


@contextlib.contextmanager
def maybe_cluster(scheduler: str | None, workers: int | None) -> Iterator[Any]:
    """A dask client when --scheduler or --workers is given, else None (score in this process)."""
    if scheduler is None and workers is None:
        yield None
        return
    from hscache.cluster import cluster_client

    with cluster_client(scheduler=scheduler, workers=workers) as client:
        yield client
