"""Hard edges, round five (issues 35 and 36): advice that names flags the command has, sizes
bounded before work, refusals before the model loads. Each test failed before its fix."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

from scorer.cli import main as scorer_main


def _scorer(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(scorer_main, [str(a) for a in args])
    return result.exit_code, result.output


def _one_line_error(code: int, text: str, *needles: str) -> None:
    assert code == 2, text
    lines = [line for line in text.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), text
    for needle in needles:
        assert needle in lines[0], text


@pytest.fixture(scope="session")
def maskless_cache(scorer_cache: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``scorer_cache`` as a target whose tokenizer names no mask token would have written it."""
    from hscache.store import integrity

    root = tmp_path_factory.mktemp("edges") / "maskless"
    shutil.copytree(scorer_cache, root)
    manifest = json.loads((root / "manifest.json").read_text())
    manifest["settings"]["mask_token_id"] = None
    integrity.seal(manifest)
    (root / "manifest.json").write_text(json.dumps(manifest, indent=2))
    return root


def test_init_takes_the_mask_token_id_its_advice_names(maskless_cache: Path, tmp_path: Path):
    # issue 35 item 1: the advice named --mask-token-id, which scorer init did not have
    code, text = _scorer("init", tmp_path / "none", "--cache", maskless_cache)
    _one_line_error(code, text, "scorer init --mask-token-id ID", "defines none")
    code, text = _scorer("init", tmp_path / "far", "--cache", maskless_cache, "--mask-token-id", 512)
    _one_line_error(code, text, "--mask-token-id 512 is outside the target's vocabulary of 512")
    assert not (tmp_path / "far").exists() and not (tmp_path / "none").exists()
    code, text = _scorer("init", tmp_path / "ok", "--cache", maskless_cache, "--mask-token-id", 7)
    assert code == 0, text
    assert json.loads((tmp_path / "ok" / "config.json").read_text())["dflash_config"]["mask_token_id"] == 7
