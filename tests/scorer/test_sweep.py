"""scorer sweep: checkpoint discovery, step parsing, the table and plot, and skipping on re-run."""

from __future__ import annotations

import csv
import json
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

import hscache
import scorer.studies.sweep as sweep_module
from scorer import init_drafter
from scorer.cli import main
from scorer.errors import ScorerError
from scorer.report.sweep import write_outputs
from scorer.studies.evaluate import EvalConfig
from scorer.studies.sweep import find_checkpoints, parse_step, sweep

# init_drafter's block size: step_1k/ holds bare weights, and a block size is never defaulted.
CONFIG = EvalConfig(ddtree=(8,), n_boot=20, block_size=8)


@pytest.mark.parametrize(
    "name, step",
    [
        ("checkpoint-20000", 20000),
        ("checkpoint_step20k.pt", 20000),
        ("step_020000", 20000),
        ("global_step1.5k", 1500),
        ("iter_0001000.pth", 1000),
        ("ckpt-2M.safetensors", 2_000_000),
        ("model_step_500.safetensors", 500),
        ("epoch_3", None),
        ("best.pt", None),
        ("final", None),
        ("model.safetensors", None),
        ("steps-7", 7),
        ("laststep", None),
    ],
)
def test_parse_step(name, step):
    assert parse_step(name) == step


@pytest.fixture(scope="module")
def run_dir(scale_cache: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fake training run: two HF directories (one with trainer files), a bare .safetensors file in
    a step directory, an epoch directory, and a checkpoint without a step."""
    run = tmp_path_factory.mktemp("run")
    init_drafter(scale_cache, run / "checkpoint-100", seed=1)
    (run / "checkpoint-100" / "optimizer.pt").write_bytes(b"not a drafter")
    init_drafter(scale_cache, run / "step_000200", seed=2)
    init_drafter(scale_cache, run / "tmp", seed=3)
    (run / "step_1k").mkdir()
    shutil.move(run / "tmp" / "model.safetensors", run / "step_1k" / "model.safetensors")
    shutil.rmtree(run / "tmp")
    (run / "epoch_1").mkdir()
    shutil.copy(run / "step_1k" / "model.safetensors", run / "best.safetensors")
    return run


def test_find_checkpoints(run_dir):
    found = find_checkpoints(run_dir)
    assert [(c.step, c.path.relative_to(run_dir).as_posix()) for c in found] == [
        (100, "checkpoint-100"),
        (200, "step_000200"),
        (1000, "step_1k/model.safetensors"),
        (None, "best.safetensors"),
    ]


def test_two_checkpoints_for_one_step_is_an_error(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "step_5.pt").write_bytes(b"")
    (tmp_path / "step_5.pt").write_bytes(b"")
    with pytest.raises(ScorerError, match=r"two checkpoints for step 5: .* move one away"):
        find_checkpoints(tmp_path)


def test_sweep_writes_table_and_plot_then_skips_on_rerun(run_dir, scale_cache, tmp_path, monkeypatch):
    out = tmp_path / "sweep"
    first = sweep(run_dir, scale_cache, out, CONFIG)
    assert [r["step"] for r in first["rows"]] == [100, 200, 1000]
    assert not any(r["reused"] for r in first["rows"])
    assert first["skipped"] == [
        {"path": str(run_dir / "best.safetensors"), "reason": "no training step in its name"}
    ]
    table = list(csv.DictReader((out / "sweep.csv").open()))
    assert [int(r["step"]) for r in table] == [100, 200, 1000]
    assert float(table[0]["tau_per_request"]) == first["rows"][0]["tau_per_request"]
    assert "accept_cond_7" in table[0] and "ddtree_8" in table[0]
    html = (out / "sweep.html").read_text()
    assert html.count("<svg") == 2 and "<script" not in html
    assert f"({len(hscache.open_cache(scale_cache))} sequences), 3 checkpoints</p>" in html
    # With --limit the page says how many were scored, not how many the cache holds (issue 26, item 17).
    limited = {**first, "rows": [{**r, "requests": 2} for r in first["rows"]]}
    write_outputs(limited, tmp_path / "limited")
    html = (tmp_path / "limited" / "sweep.html").read_text()
    assert f"(2 of its {len(hscache.open_cache(scale_cache))} sequences scored), 3 checkpoints</p>" in html
    saved = json.loads((out / "sweep.json").read_text())
    assert saved["rows"] == json.loads(json.dumps(first["rows"]))
    pytest.importorskip("matplotlib")
    assert (out / "sweep.png").read_bytes()[:4] == b"\x89PNG"

    def no_scoring(*args, **kwargs):
        raise AssertionError("a stored checkpoint was scored again")

    monkeypatch.setattr(sweep_module, "evaluate", no_scoring)
    again = sweep(run_dir, scale_cache, out, CONFIG)
    assert all(r["reused"] for r in again["rows"])
    assert [r["tau_per_request"] for r in again["rows"]] == [r["tau_per_request"] for r in first["rows"]]
    with pytest.raises(AssertionError, match="scored again"):  # other settings: a new key
        sweep(run_dir, scale_cache, out, EvalConfig(ddtree=(8,), n_boot=21, block_size=8))


def test_sweep_on_a_cluster_matches_and_cli(run_dir, scale_cache, tmp_path, dask_client):
    local = sweep(run_dir, scale_cache, tmp_path / "local", CONFIG)
    result = CliRunner().invoke(
        main,
        [
            "sweep",
            str(run_dir),
            "--cache",
            str(scale_cache),
            "--out",
            str(tmp_path / "dist"),
            "--ddtree",
            "8",
            "--block-size",
            "8",
            "--scheduler",
            dask_client.scheduler.address,
            "--tokens-per-task",
            "64",
        ],
        catch_exceptions=False,
    )
    assert result.exit_code == 0, result.output
    dist = json.loads((tmp_path / "dist" / "sweep.json").read_text())
    # n_boot differs (CLI default 1000), so compare the numbers bootstrap does not touch.
    keys = ("step", "tau_per_request", "tau_pooled", "acceptance_conditional", "train_accept_len", "ddtree")
    assert [{k: r[k] for k in keys} for r in dist["rows"]] == [{k: r[k] for k in keys} for r in local["rows"]]
    assert "1000  tau" in result.output


def test_sweep_help_names_only_its_own_flags_and_real_defaults():
    """Issue 26, item 17: --seed mentioned a --samples that sweep does not have; --tokens-per-task
    showed an internal name as its default."""
    from scorer.studies.distributed import DEFAULT_TASK_TOKENS

    text = " ".join(CliRunner().invoke(main, ["sweep", "--help"]).output.split())
    assert "--samples" not in text and "Seed of the bootstrap intervals. [default: 0;" in text
    assert f"Tokens of work per dask task (default: {DEFAULT_TASK_TOKENS})." in text
    assert "DEFAULT_TASK_TOKENS" not in text
