"""The README's quickstart runs as written (minus creating the venv, which CI does)."""

from __future__ import annotations

import json
import re
import shlex
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"


def _quickstart_steps() -> list[str]:
    line = next(l.strip() for l in README.read_text().splitlines() if l.strip().startswith("python3 -m venv"))
    steps = [s.strip() for s in line.split("&&")]
    return [s for s in steps if s.startswith(".venv/bin/") and "pip install" not in s]


def test_readme_names_the_test_command_that_ci_runs():
    ci = (README.parent / ".ci" / "run").read_text()
    command = re.search(r"^\s+(\.venv/bin/python -m pytest.*)$", README.read_text(), re.M).group(1)
    assert ci.rstrip().splitlines()[-1] == command


@pytest.mark.slow
def test_quickstart_runs_and_scores_a_drafter_above_one(tmp_path, monkeypatch):
    """Each step with its arguments as written, through the console scripts' own entry points, in
    this process: a subprocess per step would pay the torch import four more times (~15 CPU-s)."""
    from click.testing import CliRunner

    from hscache.cli import main as hscache_main
    from scorer.cli import main as scorer_main

    entry_points = {"hscache": hscache_main, "scorer": scorer_main}
    bin_dir = Path(sys.executable).parent
    steps = _quickstart_steps()
    programs = [s.split()[0].rsplit("/", 1)[1] + " " + s.split()[1] for s in steps]
    assert programs == ["hscache extract", "hscache info", "scorer init", "scorer eval"], programs
    monkeypatch.chdir(tmp_path)
    for step in steps:
        program, *args = shlex.split(step)
        name = program.rsplit("/", 1)[1]
        assert (bin_dir / name).is_file(), f"{name} is not installed next to {sys.executable}"
        if name == "scorer" and args[0] == "eval":
            args += ["--json", "report.json"]
        result = CliRunner().invoke(entry_points[name], args)
        assert result.exit_code == 0, f"{step}\n{result.output}"
    report = json.loads((tmp_path / "report.json").read_text())
    # 1.889 measured 2026-12-07 (the README's figure): the drafter trains at prompt anchors too, the
    # trainer's default since that day. Issue 31's range, 2..6, was set for generated anchors only
    # (2.366, `--no-prompt-anchors`); the saddle where a drafter drafts one constant token sits at
    # ~1.2 (docs/benchmarks.md "Quickstart"), which this bound still tells apart.
    assert 1.5 <= report["tau"]["per_request"] <= 6.0
