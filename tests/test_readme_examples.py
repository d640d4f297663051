"""Every block marked ``<!-- readme-test -->`` in README.md and docs/*.md runs as written against a
small cache at ``cache/``.

In this process (python blocks through ``exec``, ``hscache`` lines through click's runner): a
subprocess per block would pay the torch import again for nothing.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
from click.testing import CliRunner

from hscache.cli import main as hscache_main

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
_BLOCK = re.compile(r"<!-- readme-test -->\n```(python|bash)\n(.*?)```", re.S)


def _blocks() -> list[tuple[str, str, str]]:
    """(page, kind, code) of every marked block, pages in order."""
    return [
        (page.relative_to(ROOT).as_posix(), kind, code)
        for page in PAGES
        for kind, code in _BLOCK.findall(page.read_text())
    ]


def test_the_marked_blocks_are_found():
    kinds = [kind for _, kind, _ in _blocks()]
    assert kinds.count("python") >= 2 and "bash" in kinds, kinds


@pytest.mark.slow
@pytest.mark.parametrize(
    "index", range(len(_blocks())), ids=[f"{p}-{i}" for i, (p, _, _) in enumerate(_blocks())]
)
def test_readme_block_runs(index, bf16_cache, tmp_path, monkeypatch, capsys):
    page, kind, code = _blocks()[index]
    (tmp_path / "cache").symlink_to(bf16_cache)  # the 8-layer built-in target, layers 1,3,7
    monkeypatch.chdir(tmp_path)
    if kind == "python":
        exec(compile(code, f"{page} block {index}", "exec"), {"__name__": "__readme__"})
        out = capsys.readouterr().out
        if "loss" in code:
            losses = [float(x) for x in re.findall(r"loss (\d+\.\d+)", out)]
            assert len(losses) == 3 and losses[-1] < losses[0], out  # the probe learns
        return
    for line in filter(str.strip, code.splitlines()):
        args = shlex.split(line)
        assert args[0] == "hscache", line
        result = CliRunner().invoke(hscache_main, args[1:])
        assert result.exit_code == 0, f"{line}\n{result.output}"
