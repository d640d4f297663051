"""Every flag an error message or piece of advice names exists on the command it sends the user to
(issue 35, item 1: `scorer init` advised --mask-token-id, which only `scorer eval` had).

A static scan, chosen over triggering every message (most need a broken cache or checkpoint to
reach): every string literal in hscache/, scorer/ and pipelines/ (docstrings aside) that names a
``--flag`` is tied to the command(s) it is said in, and the flag must be one of their options:

1. a command the string itself names before the flag (``scorer online --tree``, ``hscache extract
   ... --layers``, "re-extract with --layers") owns it;
2. a string in a command's own module: the commands whose callback reaches the function holding it
   within that module (hscache/cli.py, scorer/cli/<command>.py, pipelines/drift_study.py);
3. a string in a module only some commands reach (``OWNERS``: e.g. scorer/families/*/init.py is
   reached only by `scorer init`): every one of them;
4. any other string (a library module several commands reach): at least one command of the three
   programs takes the flag (a flag that exists nowhere is the weakest mistake this still catches).

Flags of other tools (vLLM's, SGLang's, the peers') are listed in ``FOREIGN`` with where they come from.
"""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

import click

ROOT = Path(__file__).resolve().parents[1]
_FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")
_NAMED = re.compile(r"\b(hscache-drift|hscache|scorer) ([a-z][a-z-]*)\b|\b(re-extract|extract)\b")

# Flags of other programs a message quotes (not ours to declare).
FOREIGN = {
    "--speculative-config",  # vLLM serve
    "--speculative-num-steps",  # SGLang
    "--speculative-eagle-topk",
    "--speculative-num-draft-tokens",
    "--speculative-use-rejection-sampling",
    "--enable-return-hidden-states",
    "--help",
    "--logprobs-mode",  # vLLM serve (processed_logprobs)
    "--strategy",  # SpecForge's prepare_hidden_states.py
    "--include-last-layer",  # speculators' launch_vllm.py
}

# Library modules only some commands reach (their functions are called from these commands alone).
OWNERS = {
    # the drift study trains through it too, but passes no mask id: its one message there names
    # `scorer init --mask-token-id` (rule 1)
    "scorer/families/dflash/init.py": {"scorer init"},
    "scorer/families/eagle3/init.py": {"scorer init"},
    "scorer/families/dflash2/init.py": {"scorer init"},
    "scorer/make.py": {"scorer init"},  # the drift study trains --family dflash only
    "scorer/drafter_dir.py": {"scorer init", "hscache-drift"},
    "hscache/capture/preflight.py": {"hscache extract"},
    "hscache/capture/responses.py": {"hscache extract"},
    "hscache/store/recompress.py": {"hscache recompress"},
    "scorer/online/sampled.py": {"scorer online"},
    "scorer/online/greedy.py": {"scorer online"},
}

# The command modules: which module's functions belong to which commands (rule 2).
_PROGRAMS = {"hscache": "hscache.cli", "scorer": "scorer.cli", "hscache-drift": "pipelines.drift_study"}


def _commands() -> dict[str, tuple[set[str], object]]:
    """'program command' -> (its --flags, its callback unwrapped)."""
    out = {}
    for program, module in _PROGRAMS.items():
        group = importlib.import_module(module).main
        items = group.commands.items() if isinstance(group, click.Group) else [(None, group)]
        for name, command in items:
            flags = {
                flag
                for param in command.params
                if isinstance(param, click.Option)
                for flag in (*param.opts, *param.secondary_opts)
                if flag.startswith("--")
            }
            callback = command.callback
            while hasattr(callback, "__wrapped__"):
                callback = callback.__wrapped__
            out[" ".join(filter(None, (program, name)))] = (flags | {"--help"}, callback)
    return out


COMMANDS = _commands()
_ALL_FLAGS = set().union(*(flags for flags, _ in COMMANDS.values()))


def _functions(tree: ast.Module) -> dict[str, ast.AST]:
    return {n.name: n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}


def _local_owners(path: Path, tree: ast.Module) -> dict[str, set[str]]:
    """For a command module: top-level function name -> the commands whose callback reaches it
    through this module's own functions."""
    functions = _functions(tree)
    calls = {
        name: {n.id for n in ast.walk(fn) if isinstance(n, ast.Name) and n.id in functions} - {name}
        for name, fn in functions.items()
    }
    owners: dict[str, set[str]] = {name: set() for name in functions}
    module = ".".join(path.relative_to(ROOT).with_suffix("").parts)
    for command, (_, callback) in COMMANDS.items():
        if callback.__module__ != module or callback.__name__ not in functions:
            continue
        stack = [callback.__name__]
        while stack:
            name = stack.pop()
            if command in owners[name]:
                continue
            owners[name].add(command)
            stack += calls[name]
    return owners


def _named_command(text: str, flag_at: int) -> str | None:
    """The command the string names nearest before ``flag_at`` in the same clause (rule 1), if any."""
    named = None
    clause = max(text.rfind(mark, 0, flag_at) for mark in (", ", "; ", ": "))
    for match in _NAMED.finditer(text, max(clause, 0), flag_at):
        if match.group(3):
            named = "hscache extract"
        else:
            candidate = f"{match.group(1)} {match.group(2)}"
            named = (
                candidate
                if candidate in COMMANDS
                else (match.group(1) if match.group(1) == "hscache-drift" else named)
            )
    return named


def _messages() -> list[tuple[str, str, str, set[str] | None]]:
    """(where, flag, text, the commands that must take it, or None: any command) of every flag named."""
    found = []
    for root in ("hscache", "scorer", "pipelines"):
        for path in sorted((ROOT / root).rglob("*.py")):
            rel = str(path.relative_to(ROOT))
            tree = ast.parse(path.read_text())
            nodes = list(ast.walk(tree))  # walked once: the scan runs at collection, over every file
            docstrings = {
                id(node.body[0].value)
                for node in nodes
                if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
                and node.body
                and isinstance(node.body[0], ast.Expr)
                and isinstance(node.body[0].value, ast.Constant)
            }
            local = (
                _local_owners(path, tree)
                if any(
                    cb.__module__ == ".".join(path.relative_to(ROOT).with_suffix("").parts)
                    for _, cb in COMMANDS.values()
                )
                else {}
            )
            holders = {}
            declared = {  # an option's own declaration (click.option / argparse's add_argument) is no message
                id(arg)
                for node in nodes
                if isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr in ("option", "add_argument", "Option")
                for arg in node.args
            }
            # A script with its own argparse flags (pipelines/train_builtin.py) is a command of its own:
            # its messages may name the flags it declares.
            script_flags = {
                arg.value
                for node in nodes
                if isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr == "add_argument"
                for arg in node.args
                if isinstance(arg, ast.Constant) and isinstance(arg.value, str)
            }
            for name, fn in _functions(tree).items() if local else ():  # read only where local is
                for node in ast.walk(fn):
                    holders[id(node)] = name
            skipped = docstrings | declared
            for node in nodes:
                if (
                    not (isinstance(node, ast.Constant) and isinstance(node.value, str))
                    or id(node) in skipped
                ):
                    continue
                for match in _FLAG.finditer(node.value):
                    flag = match.group()
                    if flag in FOREIGN or flag in script_flags:
                        continue
                    named = _named_command(node.value, match.start())
                    if named:
                        owners: set[str] | None = {named} if named in COMMANDS else None
                    elif local.get(holders.get(id(node), ""), set()):
                        owners = local[holders[id(node)]]
                    elif rel in OWNERS:
                        owners = OWNERS[rel]
                    else:
                        owners = None
                    found.append((f"{rel}:{node.lineno}", flag, node.value, owners))
    return found


MESSAGES = _messages()


def test_the_scan_finds_the_messages_it_checks():
    # the scan reads what it should: the refusal of --eval-every without training, in scorer init
    assert any(
        where.startswith("scorer/cli/init.py") and flag == "--train-steps" and owners == {"scorer init"}
        for where, flag, _, owners in MESSAGES
    )
    assert any(where.startswith("scorer/families/dflash/init.py") for where, *_ in MESSAGES)
    assert len(MESSAGES) > 300


def test_every_flag_a_message_names_exists_on_its_command():
    wrong = []
    for where, flag, text, owners in MESSAGES:
        if owners is None:
            if flag not in _ALL_FLAGS:
                wrong.append(f"{where}: {flag} is no command's flag: {text!r}")
            continue
        lacking = sorted(c for c in owners if flag not in COMMANDS[c][0])
        if lacking:
            wrong.append(f"{where}: {flag} is not a flag of {', '.join(lacking)}: {text!r}")
    assert not wrong, "\n".join(wrong)
