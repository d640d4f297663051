"""`--help` of every command, and early errors, come before torch and transformers are imported
(374 MB, tens of seconds on a busy machine): issue #14, item 11."""

from __future__ import annotations

import subprocess
import sys

import pytest

_PROBE = """
import sys
from click.testing import CliRunner
from {module} import main
result = CliRunner().invoke(main, {args!r})
heavy = sorted(m for m in ("torch", "transformers") if m in sys.modules)
print(result.exit_code, ",".join(heavy) or "-")
"""


def _heavy_imports(module: str, args: list[str]) -> tuple[int, str]:
    out = subprocess.run(
        [sys.executable, "-c", _PROBE.format(module=module, args=args)],
        capture_output=True, text=True, check=True, timeout=120,
    )  # fmt: skip
    code, heavy = out.stdout.split()
    return int(code), heavy


@pytest.mark.parametrize(
    "module, args",
    [
        ("hscache.cli", ["--help"]),
        *[("hscache.cli", [cmd, "--help"]) for cmd in ("extract", "info", "diff", "verify", "merge")],
        ("scorer.cli", ["--help"]),
        ("scorer.cli", ["eval", "--help"]),
    ],
)
def test_help_does_not_import_torch(module, args):
    assert _heavy_imports(module, args) == (0, "-")


@pytest.mark.parametrize(
    "args",
    [
        ["extract", "--out", "/nonexistent/x", "--prompts", "/nonexistent/p.jsonl"],
        ["info", "/nonexistent/cache"],
        ["verify", "/nonexistent/cache"],
    ],
)
def test_early_errors_do_not_import_torch(args):
    assert _heavy_imports("hscache.cli", args) == (2, "-")


def test_the_family_registry_does_not_import_torch():
    """The families' rows are plain data with their functions bound lazily: the scoring commands
    read the families' flags from the registry for --help (issue 24)."""
    probe = (
        "import sys, scorer.families; print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=120
    )
    assert out.stdout.strip() == "[]"
