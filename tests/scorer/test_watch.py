"""scorer watch (issue 48): a fake trainer writes checkpoints while the watch runs; each complete one is
scored once, equal to `scorer eval`; a restart rescores nothing; two watchers are refused; the
TensorBoard events read back with tensorboard's own reader; the page renders in Chromium."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

import scorer.watch.run as run_module
from scorer import init_drafter
from scorer.cli import main
from scorer.errors import ScorerError
from scorer.studies.evaluate import EvalConfig, evaluate
from scorer.watch.checkpoints import find_checkpoints, incomplete_reason
from scorer.watch.results import LOCK_NAME, LOG_NAME, ResultsLog, WatchLockedError, read_records
from scorer.watch.run import HTML_NAME, WatchConfig, watch
from tests.chromium import png_is_not_blank, screenshot

# Cheap and complete: 2 sequences, DDTree-8, every anchor (per-slot acceptance), 50 resamples.
EVAL = EvalConfig(ddtree=(8,), limit=2, n_boot=50)
POLL_S = 0.01


def _hf_checkpoint(source: Path, out: Path, step: int | None = None) -> Path:
    """A transformers-style checkpoint-S/: the drafter's files and a trainer_state.json."""
    shutil.copytree(source, out)
    if step is not None:
        (out / "trainer_state.json").write_text(json.dumps({"global_step": step}))
    return out


def _wait(predicate, what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(POLL_S)


@pytest.fixture(scope="module")
def random_drafter(scorer_cache: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("watch") / "random"
    init_drafter(scorer_cache, out, seed=1, block_size=6)
    return out


def test_layouts_and_their_steps(tmp_path, trained_drafter):
    run = tmp_path / "run"
    _hf_checkpoint(trained_drafter, run / "checkpoint-500", step=500)
    shutil.copytree(trained_drafter, run / "epoch_0_step_700")  # SpecForge
    shutil.copytree(trained_drafter, run / "epoch_1_step_900" / "model" / "consolidated")  # NeMo Automodel
    shutil.copytree(trained_drafter, run / "speculators" / "0")
    (run / "speculators" / "0" / "training_state.json").write_text('{"epoch": 0, "global_step": 1200}')
    (run / "speculators" / "epoch0_step1200").symlink_to("0")  # speculators' readable link: not followed
    shutil.copytree(trained_drafter, run / ".hidden" / "checkpoint-1")
    shutil.copytree(trained_drafter, run / "tmp-checkpoint-2")  # transformers' staging folder
    found = {str(c.path.relative_to(run)): (c.step, c.step_source, c.layout) for c in find_checkpoints(run)}
    assert found == {
        "checkpoint-500": (500, "trainer_state.json global_step", "transformers"),
        "epoch_0_step_700": (700, "folder name epoch_0_step_700", "specforge"),
        "epoch_1_step_900/model/consolidated": (900, "folder name epoch_1_step_900", "nemo-automodel"),
        "speculators/0": (1200, "training_state.json global_step", "speculators"),
    }
    nemo = next(c for c in find_checkpoints(run) if c.layout == "nemo-automodel")
    assert nemo.top == run / "epoch_1_step_900"  # the unit the trainer writes and rotates
    assert incomplete_reason(nemo) is None
    (nemo.top / ".incomplete").touch()
    assert incomplete_reason(nemo) == ".incomplete marker present"


def test_a_half_written_weights_file_is_incomplete(tmp_path, trained_drafter):
    ck = _hf_checkpoint(trained_drafter, tmp_path / "run" / "checkpoint-3", step=3)
    weights = (ck / "model.safetensors").read_bytes()
    (ck / "model.safetensors").write_bytes(weights[: len(weights) // 2])
    [found] = find_checkpoints(tmp_path / "run")
    assert "truncated" in incomplete_reason(found)


def test_watch_follows_a_fake_trainer(tmp_path, scorer_cache, trained_drafter, random_drafter, monkeypatch):
    run, results = tmp_path / "run", tmp_path / "results"
    run.mkdir()
    _hf_checkpoint(random_drafter, run / "checkpoint-10", step=10)
    # checkpoint-40 is unloadable for good (a hidden size the cache's target does not have)
    broken = _hf_checkpoint(trained_drafter, run / "checkpoint-40", step=40)
    config = json.loads((broken / "config.json").read_text())
    config["hidden_size"] *= 2
    (broken / "config.json").write_text(json.dumps(config))
    # rotation: checkpoint-30 is deleted by the trainer while the watch scores it
    real_evaluate = run_module.evaluate

    def rotating(checkpoint, cache, eval_config):
        if Path(checkpoint).name == "checkpoint-30":
            shutil.rmtree(checkpoint)
        return real_evaluate(checkpoint, cache, eval_config)

    monkeypatch.setattr(run_module, "evaluate", rotating)
    lines: list[str] = []
    stop = threading.Event()
    config = WatchConfig(results=results, poll_s=POLL_S, log_to=("tensorboard",), eval=EVAL)
    thread = threading.Thread(
        target=lambda: lines.append(watch(run, scorer_cache, config, stop=stop, say=lines.append))
    )
    thread.start()
    try:
        _wait(lambda: len(list(read_records(results / LOG_NAME))) == 2, "checkpoint-10 and -40")
        # checkpoint-20 written in parts, slower than the polls: never scored half-written
        part = run / "checkpoint-20"
        part.mkdir()
        shutil.copy(trained_drafter / "config.json", part / "config.json")
        weights = (trained_drafter / "model.safetensors").read_bytes()
        with open(part / "model.safetensors", "wb") as f:
            f.write(weights[: len(weights) // 3])
            f.flush()
            time.sleep(20 * POLL_S)
            f.write(weights[len(weights) // 3 :])
        (part / "trainer_state.json").write_text(json.dumps({"global_step": 20}))
        _hf_checkpoint(trained_drafter, run / "checkpoint-30", step=30)
        _wait(lambda: any("checkpoint-30" in line for line in lines if isinstance(line, str)), "the rotation")
        _wait(lambda: len(list(read_records(results / LOG_NAME))) == 3, "checkpoint-20")
    finally:
        stop.set()
        thread.join(timeout=60)
    summary = lines.pop()
    records = list(read_records(results / LOG_NAME))
    assert [(r["step"], r["status"]) for r in records] == [(10, "scored"), (40, "refused"), (20, "scored")]
    assert summary.scored == [10, 20] and summary.stopped_by == "stop"
    # reported once each; the rotated checkpoint skipped with one line
    assert sum("checkpoint-40: cannot be scored" in line for line in lines) == 1
    assert [line for line in lines if "checkpoint-30" in line] == [
        f"{run / 'checkpoint-30'}: deleted or rewritten while it was scored (step 30); skipped"
    ]
    assert "hidden" in records[1]["reason"]
    # equal to scorer eval on each checkpoint, exactly
    for record in (records[0], records[2]):
        report = evaluate(record["checkpoint"], scorer_cache, EVAL)
        assert record["metrics"]["tau"] == report["tau"]
        assert record["metrics"]["acceptance"]["conditional"] == report["acceptance"]["conditional"]
        assert record["metrics"]["ddtree"] == report["ddtree_detail"]
        assert record["step_source"] == "trainer_state.json global_step"
        m = record["metrics"]  # the added metrics cover every round of the report once
        assert (
            sum(b["n_rounds"] for b in m["context_length"])
            == report["rounds"]
            == sum(m["acceptance_histogram"]["total"])
        )
        assert sum(b["n_tokens"] for b in m["context_length"]) == report["tokens"]
        assert len(m["acceptance_histogram"]["total"]) == 6  # block 6: 0..5 drafts accepted
    assert records[0]["metrics"]["tau"] != records[2]["metrics"]["tau"]  # two drafters, two values

    # TensorBoard events, read back with tensorboard's own reader
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(results / "tensorboard"))
    events.Reload()
    pooled = events.Scalars("tau/pooled")
    assert [e.step for e in pooled] == [10, 20]
    for event, record in zip(pooled, (records[0], records[2])):
        assert event.value == pytest.approx(record["metrics"]["tau"]["pooled"], rel=1e-6)  # stored as float32
    assert "acceptance/slot_1" in events.Tags()["scalars"] and "ddtree/8" in events.Tags()["scalars"]

    # the page: the tau curve with its band, rendered by headless Chromium
    page = results / HTML_NAME
    html = page.read_text()
    assert "<polyline" in html and "<polygon" in html and "tau pooled (95% band)" in html
    assert png_is_not_blank(screenshot(page, tmp_path).read_bytes())

    # a restart, after a kill -9 that tore the last line: nothing already logged is scored again
    with open(results / LOG_NAME, "ab") as f:
        f.write(b'{"schema_version": 1, "status": "sco')
    again = watch(
        run,
        scorer_cache,
        WatchConfig(results=results, poll_s=POLL_S, until_idle_s=0.05, log_to=(), eval=EVAL),
    )
    assert again.scored == [] and again.refused == [] and again.stopped_by == "idle 0.05 s"
    assert [r["step"] for r in read_records(results / LOG_NAME)] == [10, 40, 20]
    assert (results / LOG_NAME).read_bytes().endswith(b"\n")  # the torn line cut off
    # another cache or other settings on the same results folder: refused, nothing written
    with pytest.raises(ScorerError, match="holds scores on other eval settings"):
        watch(run, scorer_cache, WatchConfig(results=results, log_to=(), eval=EvalConfig(limit=1)))


def test_two_watchers_are_refused_and_a_killed_ones_lock_is_taken_over(tmp_path):
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from scorer.watch.results import ResultsLog\n"
            f"with ResultsLog({str(tmp_path)!r}):\n    print('held', flush=True); time.sleep(60)",
        ],
        stdout=subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])},
    )
    try:
        assert holder.stdout.readline() == b"held\n"
        with pytest.raises(WatchLockedError, match=rf"another scorer watch \(pid {holder.pid}\) writes to"):
            ResultsLog(tmp_path).__enter__()
        os.kill(holder.pid, signal.SIGKILL)
        holder.wait()
    finally:
        holder.kill()
    assert (tmp_path / LOCK_NAME).read_text() == f"{holder.pid}\n"  # left behind by kill -9
    with ResultsLog(tmp_path):  # the dead holder's lock is taken over
        assert (tmp_path / LOCK_NAME).read_text() == f"{os.getpid()}\n"
    assert not (tmp_path / LOCK_NAME).exists()
    (tmp_path / LOCK_NAME).symlink_to(tmp_path / "elsewhere")
    with pytest.raises(ScorerError, match="is a symlink; remove it"):
        ResultsLog(tmp_path).__enter__()


def test_cli_refuses_a_sink_not_installed_in_one_line(tmp_path, scorer_cache, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a)
    )
    (tmp_path / "run").mkdir()
    result = CliRunner().invoke(
        main, ["watch", str(tmp_path / "run"), "--cache", str(scorer_cache), "--log-to", "tensorboard,wandb"]
    )
    assert result.exit_code != 0
    assert (
        result.output.strip()
        .splitlines()[-1]
        .endswith("--log-to wandb: wandb is not installed; pip install wandb, or leave it out of --log-to")
    )
    assert not (tmp_path / "run-watch").exists()  # refused before anything was made
    result = CliRunner().invoke(
        main, ["watch", str(tmp_path / "run"), "--cache", str(scorer_cache), "--log-to", "neptune"]
    )
    assert "--log-to neptune: not a sink scorer watch writes" in result.output


def test_cli_scores_a_run_and_stops_when_idle(tmp_path, scorer_cache, random_drafter):
    run = tmp_path / "exp"
    shutil.copytree(random_drafter, run / "epoch_0_step_5")
    shutil.copytree(random_drafter, run / "epoch_0_step_6")  # fewer than --every 2 steps after 5
    result = CliRunner().invoke(
        main,
        ["watch", str(run), "--cache", str(scorer_cache), "--limit", "1", "--ddtree", "", "--log-to", "",
         "--every", "2", "--poll-s", "0.01", "--until-idle-s", "0.05"],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    assert "1 scored, 0 refused, 1 skipped; stopped by idle 0.05 s" in result.output
    assert "step 6: fewer than --every 2 steps after 5" in result.output
    [record] = read_records(tmp_path / "exp-watch" / LOG_NAME)
    assert (record["step"], record["step_source"], record["layout"]) == (
        5,
        "folder name epoch_0_step_5",
        "specforge",
    )


@pytest.mark.parametrize("presses", [1, 2])
def test_ctrl_c_finishes_the_checkpoint_being_scored_and_twice_abandons_it(
    presses, tmp_path, scorer_cache, random_drafter, monkeypatch
):
    run = tmp_path / "run"
    _hf_checkpoint(random_drafter, run / "checkpoint-7", step=7)
    real_evaluate = run_module.evaluate

    def interrupted(checkpoint, cache, eval_config):  # Ctrl-C while the checkpoint is being scored
        for _ in range(presses):
            os.kill(os.getpid(), signal.SIGINT)
        return real_evaluate(checkpoint, cache, eval_config)

    monkeypatch.setattr(run_module, "evaluate", interrupted)
    caller_handler = signal.getsignal(signal.SIGINT)  # whatever the suite's earlier tests left installed
    args = ["watch", str(run), "--cache", str(scorer_cache), "--limit", "1", "--ddtree", "", "--log-to", ""]
    result = CliRunner().invoke(main, [*args, "--poll-s", "0.01"])
    records = list(read_records(tmp_path / "run-watch" / LOG_NAME))
    assert "stopping after the checkpoint being scored (Ctrl-C again: at once)" in result.output
    if presses == 1:  # finished, written, then stopped
        assert result.exit_code == 0 and "1 scored, 0 refused, 0 skipped; stopped by stop" in result.output
        assert [r["step"] for r in records] == [7]
    else:  # abandoned: nothing of it written, the lock released
        assert result.exit_code == 130 and records == []
    assert not (tmp_path / "run-watch" / LOCK_NAME).exists()
    assert signal.getsignal(signal.SIGINT) is caller_handler  # the caller's handler is back
