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
    shutil.copytree(scorer_cache / TARGET_DIR, empty / TARGET_DIR)  # first: create records its checksums
    StoreWriter.create(empty, specs, manifest["compression"], manifest["settings"])
    result = CliRunner().invoke(main, ["eval", str(trained_drafter), "--cache", str(empty), "--ddtree", ""])
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert lines[-1].startswith("error: ") and "no committed sequences" in lines[-1], result.output


def test_drafter_files_are_readable_as_the_umask_says(trained_drafter: Path):
    want = 0o666 & ~_umask()
    modes = {p.name: p.stat().st_mode & 0o777 for p in trained_drafter.rglob("*") if p.is_file()}
    assert modes and all(mode == want for mode in modes.values()), modes


def test_eval_refuses_a_cache_whose_index_was_edited(scorer_cache, trained_drafter, tmp_path):
    import json

    import pyarrow as pa
    import pyarrow.parquet as pq

    copy = tmp_path / "edited"
    shutil.copytree(scorer_cache, copy)
    part = copy / json.loads((copy / "manifest.json").read_text())["index_parts"][0]
    table = pq.read_table(part)
    i = table.column_names.index("prompt_len")
    table = table.set_column(i, "prompt_len", pa.array([1] * table.num_rows, pa.int32()))
    pq.write_table(table, part)  # scores would silently change: every token after 1 is scored
    result = CliRunner().invoke(main, ["eval", str(trained_drafter), "--cache", str(copy), "--ddtree", ""])
    assert result.exit_code == 2, result.output
    line = result.output.strip().splitlines()[-1]
    assert line.startswith("error: ") and "index/part-" in line and "hscache verify" in line, result.output
