"""The README's quickstart runs as written (minus creating the venv, which CI does)."""

from __future__ import annotations

import json
import re
import subprocess
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
def test_quickstart_runs_and_scores_a_drafter_above_one(tmp_path):
    bin_dir = Path(sys.executable).parent
    steps = _quickstart_steps()
    programs = [s.split()[0].rsplit("/", 1)[1] + " " + s.split()[1] for s in steps]
    assert programs == ["hscache extract", "hscache info", "scorer init", "scorer eval"], programs
    for step in steps:
        command = step.replace(".venv/bin/", f"{bin_dir}/")
        if command.split()[0].endswith("scorer") and " eval " in command:
            command += " --json report.json"
        result = subprocess.run(
            command, shell=True, cwd=tmp_path, capture_output=True, text=True, timeout=600
        )
        assert result.returncode == 0, f"{step}\n{result.stdout}\n{result.stderr}"
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["tau"]["per_request"] > 1.5
