"""Click options that mean the same in several commands, declared once: the target, its prompts and
how it decodes them (``hscache extract``, ``scorer online``, the drift study pipelines/drift_study.py),
--json / --report, --compression (extract, import, recompress), --allow-unsealed (info, verify,
scorer eval), and ``number_option``, the one form of a numeric flag whose --help shows its default.

hscache imports nothing from scorer or pipelines, so what both stages' commands share lives here;
the scorer's own shared options are in scorer/cli/shared.py.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import click

from hscache.capture import BACKENDS, BUILTIN_TARGETS
from hscache.store.compact import STATES
from hscache.store.layout import COMPRESSIONS, DEFAULT_COMPRESSION

__all__ = [
    "FiniteFloatRange",
    "allow_unsealed_option",
    "apply_options",
    "backend_option",
    "compression_option",
    "decode_length_options",
    "id_from_line_option",
    "layers_option",
    "model_option",
    "number_option",
    "prompt_limit_option",
    "print_json_option",
    "prompts_option",
    "renamed_flag",
    "renamed_sample_top_k",
    "report_outputs",
]


def apply_options(options: Iterable[Callable[[Callable], Callable]]) -> Callable[[Callable], Callable]:
    """One decorator applying click ``options`` in the order listed (the first is shown first)."""
    options = list(options)

    def decorate(fn: Callable) -> Callable:
        for option in reversed(options):
            fn = option(fn)
        return fn

    return decorate


class FiniteFloatRange(click.FloatRange):
    """A FloatRange that also refuses nan and inf (nan compares false with every bound)."""

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        number = super().convert(value, param, ctx)
        if not math.isfinite(number):
            self.fail(f"{value!r} is not a finite number", param, ctx)
        return number


def number_option(
    flag: str, default: float, help: str, *, minimum: float = 0, min_open: bool = False, name: str = ""
) -> Callable[[Callable], Callable]:
    """A number ``flag`` whose --help shows its ``default``: an int when the default is one, else a
    float, at least ``minimum`` (above it with ``min_open``); ``name``: the parameter, if not the flag's."""
    kind = (
        click.IntRange(min=int(minimum))
        if isinstance(default, int)
        else FiniteFloatRange(min=minimum, min_open=min_open)  # --chunk-mb nan was a ValueError
    )
    return click.option(flag, *filter(None, [name]), default=default, show_default=True, type=kind, help=help)


def compression_option(help: str, *, required: bool = False) -> Callable[[Callable], Callable]:
    """``--compression``, the hidden-state codec (hscache/store/layout.py): ``required``, or
    defaulting to the one extract writes."""
    default = {} if required else {"default": DEFAULT_COMPRESSION, "show_default": True}
    return click.option(
        "--compression", type=click.Choice(list(COMPRESSIONS)), required=required, help=help, **default
    )


def states_option(help: str, *, required_default: bool = True) -> Callable[[Callable], Callable]:
    """``--states source|fp8``: how hidden states are stored (hscache/store/compact.py); defaulting to
    ``source`` (lossless), or absent unless given (``required_default=False``: recompress)."""
    default = {"default": "source", "show_default": True} if required_default else {}
    return click.option("--states", type=click.Choice(list(STATES)), help=help, **default)


model_option = click.option(
    "--model",
    default=BUILTIN_TARGETS[0],
    show_default=True,
    help=f"The target: a local Hugging Face directory, or {' / '.join(BUILTIN_TARGETS)}.",
)
prompts_option = click.option(
    "--prompts",
    default="builtin:default",
    show_default=True,
    help=(
        "JSONL file ({id, prompt|messages|conversations|input_ids, ...metadata}) or a bundled set: "
        "builtin:default (20 prompts), humaneval (164 problems, MIT), mt-bench (80 questions, Apache-2.0)."
    ),
)
layers_option = click.option(
    "--layers",
    default="dflash:3",
    show_default=True,
    help="0-based decoder-layer ids (1,9,17) or dflash:N for the DFlash rule.",
)
backend_option = click.option(
    "--backend",
    type=click.Choice(list(BACKENDS)),
    default="auto",
    show_default=True,
    help="The target's linear-attention kernels: fla (CUDA), torch fallback, or auto.",
)
prompt_limit_option = click.option(
    "--limit", type=click.IntRange(min=1), default=None, help="Only the first N prompts."
)
id_from_line_option = click.option(
    "--id-from-line",
    is_flag=True,
    help='Number records that have no "id" by their line in the prompts file (default: refuse them).',
)

# A decode that must generate (scorer online, the drift study's reference extraction): at least one
# new token. ``hscache extract`` declares its own, since it also caches prompts as they are (0 new).
decode_length_options = apply_options(
    [
        number_option("--max-new-tokens", 64, "Tokens the target generates per prompt.", minimum=1),
        number_option("--max-length", 4096, "Longest sequence (prompt + generated tokens).", minimum=2),
    ]
)


def renamed_flag(old: str, new: str, why: str = "") -> Callable[[Callable], Callable]:
    """A hidden ``old`` flag, refused by name with its ``new`` name (one line, exit 2), for the one
    release after a rename (``why``: what the rename is for); it never reaches the command."""

    def refuse(ctx: click.Context, _param: click.Parameter, value: Any) -> None:
        if value is not None:
            click.echo(f"error: {old} was renamed: pass {new} {value}{why}", err=True)
            ctx.exit(2)

    name = "renamed_" + old.lstrip("-").replace("-", "_")  # not the new flag's parameter, which may share it
    return click.option(
        old,
        name,
        hidden=True,
        default=None,
        expose_value=False,
        is_eager=True,
        callback=refuse,
        help=f"Renamed: pass {new}.",
    )


# Sampling's top-k is --top-k, the engines' name (vLLM --top-k / top_k, SGLang, generation_config.json);
# it was --sample-top-k until 2026-12-03, when hscache extract's --top-k (the target logits stored)
# became --logits-top-k.
renamed_sample_top_k = renamed_flag(
    "--sample-top-k",
    "--top-k",
    " (the sampling top-k is --top-k, as in vLLM, SGLang and generation_config.json)",
)


def allow_unsealed_option(verb: str, then: str = "") -> Callable[[Callable], Callable]:
    """``--allow-unsealed``: ``verb`` (Summarise, Check, Score) a cache written before checksums
    anyway; ``then``: what follows for it, said after."""
    return click.option(
        "--allow-unsealed",
        is_flag=True,
        help=f"{verb} a cache without checksums (written before them){then}.",
    )


def print_json_option(document: str, schema: str = "") -> Callable[[Callable], Callable]:
    """``--json`` (``as_json``): print ``document`` as JSON instead of text (``schema``: its JSON Schema)."""
    return click.option(
        "--json", "as_json", is_flag=True, help=f"Print {document} as JSON{f' ({schema})' if schema else ''}."
    )


def report_outputs(document: str, page: str = "") -> Callable[[Callable], Callable]:
    """``--json`` (``json_out``) and ``--report`` (``report_out``): where a command writes its
    ``document`` as JSON and a self-contained HTML page (``page``: what the page shows, if said)."""
    return apply_options(
        [
            click.option("--json", "json_out", default=None, help=f"Write {document} as JSON here."),
            click.option(
                "--report",
                "report_out",
                default=None,
                help=f"Write a self-contained HTML page here (a .html path){': ' + page if page else ''}.",
            ),
        ]
    )
