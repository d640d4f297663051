"""Issue 20.12: every command's --help has a short example and a description for every option."""

from __future__ import annotations

import re

import click
import pytest

from hscache.cli import main as hscache_main
from pipelines.drift_study import main as drift_main
from scorer.cli import main as scorer_main


def _commands() -> list[tuple[str, click.Command]]:
    found = [("hscache-drift", drift_main)]
    for name, group in (("hscache", hscache_main), ("scorer", scorer_main)):
        found += [(f"{name} {sub}", command) for sub, command in group.commands.items()]
    return found


@pytest.mark.parametrize("name,command", _commands(), ids=[n for n, _ in _commands()])
def test_every_option_is_described_and_the_help_shows_an_example(name, command):
    undocumented = [
        param.opts[0]
        for param in command.params
        if isinstance(param, click.Option) and not (param.help or "").strip()
    ]
    assert undocumented == [], f"{name}: options without a description: {undocumented}"
    text = command.get_help(click.Context(command, info_name=name))
    example = text.split("Example:", 1)[-1] if "Example:" in text else ""
    assert re.search(rf"\n\s+{name.split()[0]} ", example), text


def test_shared_flags_default_to_what_the_python_api_defaults_to():
    """The target / prompt flags are declared once (hscache/cli_options.py) for extract, online and the
    drift study; each command's defaults must still be its config's, so `hscache extract` and
    `hscache.ExtractConfig`, `scorer online` and `OnlineConfig` decode the same when given nothing."""
    import hscache
    from scorer.online.greedy import OnlineConfig

    fields = ("model", "prompts", "layers", "max_new_tokens", "max_length", "limit", "backend")
    for command, config in (
        (hscache_main.commands["extract"], hscache.ExtractConfig(out="")),
        (drift_main, hscache.ExtractConfig(out="")),
        (scorer_main.commands["online"], OnlineConfig()),
    ):
        defaults = {p.name: p.default for p in command.params if p.name in fields}
        assert len(defaults) >= 5, (command.name, defaults)
        assert defaults == {name: getattr(config, name) for name in defaults}, command.name
