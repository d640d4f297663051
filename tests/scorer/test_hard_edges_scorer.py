"""Issue #14 in the scorer: an empty cache is an error, files keep the umask's mode."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from click.testing import CliRunner

from hscache.store.layout import TARGET_DIR, ArraySpec
from hscache.store.reader import read_manifest
from hscache.store.writer import StoreWriter
from scorer.cli import main


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def test_eval_on_a_cache_with_no_committed_sequences_exits_2(scorer_cache, trained_drafter, tmp_path):
    manifest = read_manifest(scorer_cache)
    empty = tmp_path / "empty"
    specs = {name: ArraySpec.from_dict(name, d) for name, d in manifest["arrays"].items()}
    StoreWriter.create(empty, specs, manifest["compression"], manifest["settings"])
    shutil.copytree(scorer_cache / TARGET_DIR, empty / TARGET_DIR)
    result = CliRunner().invoke(main, ["eval", str(trained_drafter), "--cache", str(empty), "--ddtree", ""])
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert lines[-1].startswith("error: ") and "no committed sequences" in lines[-1], result.output


def test_drafter_files_are_readable_as_the_umask_says(trained_drafter: Path):
    want = 0o666 & ~_umask()
    modes = {p.name: p.stat().st_mode & 0o777 for p in trained_drafter.rglob("*") if p.is_file()}
    assert modes and all(mode == want for mode in modes.values()), modes
