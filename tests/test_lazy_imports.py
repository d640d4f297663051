"""`--help` of every command, and early errors, come before torch and transformers are imported
(374 MB, tens of seconds on a busy machine): issue #14, item 11.

Every probe runs in one fresh interpreter, one after the other, with the heavy modules looked up
after each: none is imported when a probe starts (or an earlier one imported it, and fails), so each
probe is checked as if alone, for one interpreter start and one import of the CLIs (~1 CPU-s, not
12 subprocesses' ~5).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

HELP = [
    ("hscache.cli", ["--help"]),
    *[("hscache.cli", [cmd, "--help"]) for cmd in ("extract", "info", "diff", "verify", "merge")],
    ("scorer.cli", ["--help"]),
    ("scorer.cli", ["eval", "--help"]),
]
EARLY_ERRORS = [
    ["extract", "--out", "/nonexistent/x", "--prompts", "/nonexistent/p.jsonl"],
    ["info", "/nonexistent/cache"],
    ["verify", "/nonexistent/cache"],
]

# The family registry first (before either CLI imports it), then every CLI probe in order.
_PROBE = """
import importlib, json, sys
from click.testing import CliRunner

def heavy():
    return sorted(m for m in ("torch", "transformers") if m in sys.modules)

import scorer.families
print(json.dumps([None, heavy()]), flush=True)
for module, args in json.loads(sys.argv[1]):
    result = CliRunner().invoke(importlib.import_module(module).main, args)
    print(json.dumps([result.exit_code, heavy()]), flush=True)
"""


@pytest.fixture(scope="module")
def probes() -> dict:
    """(module, args) -> (exit code, heavy modules imported once it ran); "scorer.families" -> the
    heavy modules importing the family registry imported."""
    runs = [*HELP, *(("hscache.cli", args) for args in EARLY_ERRORS)]
    out = subprocess.run(
        [sys.executable, "-c", _PROBE, json.dumps(runs)],
        capture_output=True, text=True, check=True, timeout=300,
    )  # fmt: skip
    lines = [json.loads(line) for line in out.stdout.splitlines()]
    assert len(lines) == len(runs) + 1, out.stdout + out.stderr
    results = {"scorer.families": lines[0][1]}
    for (module, args), (code, heavy) in zip(runs, lines[1:], strict=True):
        results[module, tuple(args)] = (code, ",".join(heavy) or "-")
    return results


@pytest.mark.parametrize("module, args", HELP)
def test_help_does_not_import_torch(probes, module, args):
    assert probes[module, tuple(args)] == (0, "-")


@pytest.mark.parametrize("args", EARLY_ERRORS)
def test_early_errors_do_not_import_torch(probes, args):
    assert probes["hscache.cli", tuple(args)] == (2, "-")


def test_the_family_registry_does_not_import_torch(probes):
    """The families' rows are plain data with their functions bound lazily: the scoring commands
    read the families' flags from the registry for --help (issue 24)."""
    assert probes["scorer.families"] == []
