"""Issue 20 in the scorer: clear lines for bad flags and directories, target identity, progress."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from scorer.cli import main


def _one_line_error(result, *fragments: str) -> str:
    text = result.output.strip()
    assert result.exit_code == 2, text
    assert "Traceback" not in text and len(text.splitlines()) <= 3, text
    for fragment in fragments:
        assert fragment in text, text
    return text


@pytest.mark.parametrize("budgets", ["0", "-3", "8,0"])
def test_a_bad_ddtree_budget_names_the_flag(budgets, tmp_path):
    """Issue 20.8: the message names --ddtree (it said only "Invalid value")."""
    result = CliRunner().invoke(main, ["eval", str(tmp_path), "--cache", str(tmp_path), "--ddtree", budgets])
    assert result.exit_code == 2 and "Traceback" not in result.output, result.output
    last = result.output.strip().splitlines()[-1]  # click's usage error: the last line says what
    assert "'--ddtree'" in last and "at least 1" in last, result.output
