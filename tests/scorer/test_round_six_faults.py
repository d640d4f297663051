"""Issue 52, faults and hostile input round six: what the scorer reads (drafter files, configs, sweeps).

Each test failed before its fix. The cache is the session's ``scorer_cache`` (tests/scorer/conftest.py);
the drafter a one-layer DFlash drafter initialised from it, copied where a test edits it.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import zarr
from click.testing import CliRunner

import hscache
from scorer import init_drafter
from scorer.cli import main
from scorer.studies.sweep import cache_identity
from tests.cli_result import one_line_refusal


@pytest.fixture(scope="module")
def drafter(scorer_cache, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("round-six") / "drafter"
    init_drafter(scorer_cache, out, num_layers=1, block_size=4)
    return out


def _eval(drafter: Path, cache: Path, *extra: str):
    return CliRunner().invoke(
        main, ["eval", str(drafter), "--cache", str(cache), "--ddtree", "", "--limit", "1", *extra]
    )


# 9. A FIFO named *.safetensors in a drafter directory: never opened, never waited on.
def test_a_fifo_named_like_a_weights_file_in_a_drafter_directory_does_not_hang_eval(
    drafter, scorer_cache, tmp_path
):
    copy = Path(shutil.copytree(drafter, tmp_path / "drafter"))
    os.mkfifo(copy / "extra.safetensors")
    # The probe that read every *.safetensors first, in a child process: safe_open blocks in Rust
    # holding the GIL (no thread or signal gets it back), so a regression must not hang this one.
    probe = "import sys; from scorer.families.base import probe_checkpoint; probe_checkpoint(sys.argv[1])"
    try:
        subprocess.run([sys.executable, "-c", probe, str(copy)], timeout=60, check=True, env=os.environ)
    except subprocess.TimeoutExpired:
        pytest.fail("probing the drafter directory waited on a FIFO named extra.safetensors")
    result = _eval(copy, scorer_cache)
    assert result.exit_code == 0 or one_line_refusal(result), result.output


def _config_edit(**changes):
    def edit(config: dict) -> None:
        config.update(changes)

    return edit


def _block_size(value):
    def edit(config: dict) -> None:
        config["block_size"] = value
        config.setdefault("dflash_config", {})["block_size"] = value

    return edit


# 12 and 16: a drafter config a CLI flag of the same name would refuse, or an activation not implemented.
@pytest.mark.parametrize(
    "edit, message",
    [
        (_config_edit(hidden_act="gelu"), "hidden_act='gelu'"),
        (_config_edit(rope_theta=0), "rope_theta 0 must be a finite number > 0 (as --rope-theta is)"),
        (_config_edit(rope_theta=float("nan")), "rope_theta nan must be a finite number > 0"),
        (_config_edit(rms_norm_eps=-1), "rms_norm_eps -1 must be a finite number > 0"),
        (_block_size(8.5), "block_size 8.5 must be an integer >= 2 (as --block-size is)"),
    ],
)
def test_drafter_config_numbers_are_checked_as_the_flags_are(drafter, scorer_cache, tmp_path, edit, message):
    copy = Path(shutil.copytree(drafter, tmp_path / "drafter"))
    config = json.loads((copy / "config.json").read_text())
    edit(config)
    (copy / "config.json").write_text(json.dumps(config))
    result = _eval(copy, scorer_cache)
    assert one_line_refusal(result) and message in result.output, result.output


# 16. SGLang's tree with a TOPK larger than the draft vocabulary: one line, not torch's IndexError.
def test_a_tree_topk_past_the_vocabulary_is_one_line(scorer_cache):
    result = CliRunner().invoke(
        main,
        ["eval", "target:mtp", "--cache", str(scorer_cache), "--limit", "1", "--tree", "2,1000,10"],
    )
    assert one_line_refusal(result) and "TOPK 1000 is more than the drafter's" in result.output, result.output


# 13. `scorer sweep` keys its stored results by the cache's digest: a resealed cache of the same tokens
# with other rows is scored again, never given the other cache's tau.
def test_the_sweep_key_changes_with_the_cache_digest(scorer_cache, tmp_path):
    from tests.hscache.tamper import reseal

    copy = Path(shutil.copytree(scorer_cache, tmp_path / "cache"))
    array = zarr.open_array(str(copy / "arrays" / "target_argmax"), mode="r+")
    array[:4] = 0
    reseal(copy)
    clean, resealed = hscache.open_cache(scorer_cache), hscache.open_cache(copy)
    assert clean.index.column("token_sha256").equals(resealed.index.column("token_sha256"))
    assert hscache.cache_digest(clean) != hscache.cache_digest(resealed)
    assert cache_identity(clean) != cache_identity(resealed)


# 9 (every reader): a FIFO given as a drafter's --config is refused in one line, never read.
def test_a_fifo_given_as_the_drafter_config_is_refused_without_waiting(drafter, scorer_cache, tmp_path):
    fifo = tmp_path / "config.json"
    os.mkfifo(fifo)
    results: list = []
    # A plain open() of a FIFO waits in Python (the GIL released): a thread bounds a regression.
    runner = threading.Thread(
        target=lambda: results.append(_eval(drafter, scorer_cache, "--config", str(fifo)))
    )
    runner.daemon = True
    runner.start()
    runner.join(30)
    if runner.is_alive():
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))  # let it go before failing
        pytest.fail("scorer eval waited on a FIFO given as --config")
    assert one_line_refusal(results[0]) and "not a regular file" in results[0].output, results[0].output
