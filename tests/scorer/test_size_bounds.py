"""Sizes from flags and configs are bounded before anything is allocated (issue 18, items 10, 12)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

from scorer.cli import main


def _eval(drafter: Path, cache: Path, *flags: str):
    return CliRunner().invoke(main, ["eval", str(drafter), "--cache", str(cache), "--ddtree", "", *flags])


def _one_error_line(result) -> str:
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert result.exit_code == 2 and len(lines) == 1 and lines[0].startswith("error: "), result.output
    assert "Traceback" not in result.output
    return lines[0]


def test_a_huge_block_size_is_refused_before_allocating(scorer_cache, trained_drafter):
    line = _one_error_line(_eval(trained_drafter, scorer_cache, "--block-size", "100000"))
    assert "--block-size 100000 is longer than the longest sequence in the cache" in line
    line = _one_error_line(
        _eval(trained_drafter, scorer_cache, "--block-size", "30", "--memory-gb", "0.0001")
    )
    assert "--block-size 30 needs" in line and "--memory-gb 0.0001" in line


@pytest.mark.parametrize(("field", "value"), [("num_hidden_layers", 10**9), ("intermediate_size", 10**12)])
def test_a_config_describing_a_huge_model_is_refused(scorer_cache, trained_drafter, tmp_path, field, value):
    drafter = shutil.copytree(trained_drafter, tmp_path / "d")
    config = json.loads((drafter / "config.json").read_text())
    config[field] = value
    (drafter / "config.json").write_text(json.dumps(config))
    line = _one_error_line(_eval(drafter, scorer_cache))
    assert "does not match its weights" in line or field in line, line


def test_a_config_nested_100000_levels_deep_is_one_line(scorer_cache, trained_drafter, tmp_path):
    drafter = shutil.copytree(trained_drafter, tmp_path / "d")
    (drafter / "config.json").write_text("[" * 100_000 + "]" * 100_000)
    _one_error_line(_eval(drafter, scorer_cache))
