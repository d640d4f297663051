"""Every command synopsis in docs/*.md lists exactly the flags its command takes (issue 26, item 17).

A synopsis is a code line starting with ``hscache CMD`` or ``scorer CMD`` that shows optional flags
in brackets (``[--flag ...]``), with the more deeply indented lines after it; a concrete example
(no brackets) is not one. Its ``--flags`` must equal the click command's options: a flag added to a
command and not to its synopsis, or a documented one the command lost, fails here. The commands are
found by walking ``hscache.cli.main`` and ``scorer.cli.main`` (a module or a package: either way
``scorer.cli`` exposes ``main``).
"""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import click
import pytest

DOCS = Path(__file__).resolve().parents[1] / "docs"
_COMMAND = re.compile(r"^(\s+)(hscache|scorer) ([a-z][a-z0-9-]*)\b(.*)$")
_FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")


def _synopses() -> list[tuple[str, str, str, str]]:
    """(page:line, program, command, text) of every synopsis in docs/*.md."""
    found = []
    for page in sorted(DOCS.glob("*.md")):
        lines = page.read_text().splitlines()
        for n, line in enumerate(lines):
            match = _COMMAND.match(line)
            if not match:
                continue
            indent, program, command, rest = match.groups()
            text = [rest]
            for more in lines[n + 1 :]:
                if not more.strip() or len(more) - len(more.lstrip()) <= len(indent):
                    break
                text.append(more)
            joined = " ".join(text)
            if "[--" in joined:
                found.append((f"{page.name}:{n + 1}", program, command, joined))
    return found


def _options(program: str, command: str) -> set[str]:
    group = importlib.import_module(f"{program}.cli").main
    cmd = group.commands.get(command)
    assert cmd is not None, f"`{program} {command}` is documented but is not a command of {program}"
    return {
        flag
        for param in cmd.params
        if isinstance(param, click.Option) and not param.hidden  # a renamed flag, refused by name
        for flag in (*param.opts, *param.secondary_opts)
        if flag.startswith("--") and flag != "--help"
    }


SYNOPSES = _synopses()


def test_the_docs_have_synopses_of_the_main_commands():
    documented = {(program, command) for _, program, command, _ in SYNOPSES}
    assert {
        ("hscache", "extract"),
        ("hscache", "verify"),
        ("scorer", "eval"),
        ("scorer", "compare"),
    } <= documented


@pytest.mark.parametrize("where, program, command, text", SYNOPSES, ids=[s[0] for s in SYNOPSES])
def test_a_synopsis_lists_exactly_the_commands_flags(where, program, command, text):
    listed = set(_FLAG.findall(text))
    options = _options(program, command)
    assert listed == options, (
        f"{where}: `{program} {command}` synopsis lacks {sorted(options - listed)} "
        f"and lists {sorted(listed - options)} that the command does not take"
    )
