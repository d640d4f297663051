"""Issue 51 items 1-4 and 6: a command writes only the paths it names, and refuses before any work a
path holding something it would destroy (a cache, a drafter, a file it did not write), a path it
cannot write, an empty path, and an HTML page under another name; Ctrl-C while training keeps the
steps done."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

from hscache.cli import main as hscache_main
from scorer.cli import main


def _digest(root: Path) -> dict[str, str]:
    return {
        p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def _refused(result, *fragments: str) -> str:
    text = result.output.strip()
    assert result.exit_code == 2, text
    assert "Traceback" not in text and len(text.splitlines()) == 1, text
    for fragment in fragments:
        assert fragment in text, text
    return text


def test_init_overwrite_never_replaces_a_cache(scorer_cache, tmp_path):
    """51.1: was: both replaced the cache with a drafter, exit 0."""
    cache = shutil.copytree(scorer_cache, tmp_path / "cache_c1")
    before = _digest(cache)
    for source in (cache, scorer_cache):  # OUT is the --cache itself, and OUT is another cache
        result = CliRunner().invoke(main, ["init", str(cache), "--cache", str(source), "--overwrite"])
        _refused(result, f"{cache} is a hidden-state cache", "never replaces a cache")
    result = CliRunner().invoke(main, ["init", str(cache / "drafter"), "--cache", str(cache)])
    _refused(result, f"is inside the cache {cache.absolute()}")
    assert _digest(cache) == before


@pytest.fixture
def no_scoring(monkeypatch):
    """Every refusal below comes before the work: scoring at all fails the test."""
    import scorer.studies.evaluate

    def scored(*_args, **_kwargs):
        raise AssertionError("scored before refusing an output path")

    monkeypatch.setattr(scorer.studies.evaluate, "evaluate_many", scored)


def _fake_drafter(root: Path) -> Path:
    root.mkdir()
    (root / "config.json").write_text('{"model_type": "llama"}')
    (root / "model.safetensors").write_bytes(b"weights")
    return root


def test_report_paths_that_would_destroy_something_are_refused_before_scoring(
    scorer_cache, trained_drafter, tmp_path, no_scoring
):
    """51.2 / 51.4: a report over a cache's manifest made the cache unreadable; --json '' was ignored;
    --report r.txt wrote HTML under a text name."""
    cache = shutil.copytree(scorer_cache, tmp_path / "cache_c3")
    other = _fake_drafter(tmp_path / "downloaded")
    notes = tmp_path / "notes.json"
    notes.write_text('{"mine": true}')
    os.mkfifo(tmp_path / "pipe.json")
    before = _digest(tmp_path)
    eval_args = ["eval", str(trained_drafter), "--cache", str(scorer_cache)]
    cases = [
        (["--json", str(cache / "manifest.json")], f"is inside the cache {cache.absolute()}"),
        (["--report", str(other / "r.html")], f"is inside the drafter directory {other.absolute()}"),
        (["--json", str(notes)], "exists and is not a JSON report hscache wrote"),
        (["--json", ""], "--json '' is an empty path"),
        (["--report", str(tmp_path / "r.txt")], "the report is an HTML page; give it a .html"),
        (["--json", str(tmp_path / "pipe.json")], "is a FIFO"),
    ]
    for flags, expected in cases:
        _refused(CliRunner().invoke(main, [*eval_args, *flags]), expected)
    for command in (["compare", str(trained_drafter)], ["diagnose", str(trained_drafter)]):
        result = CliRunner().invoke(
            main, [*command, "--cache", str(scorer_cache), "--json", str(cache / "manifest.json")]
        )
        _refused(result, "is inside the cache")
    diff = [str(scorer_cache), str(scorer_cache)]
    _refused(CliRunner().invoke(hscache_main, ["diff", *diff, "--report", "drift.txt"]), "give it a .html")
    _refused(CliRunner().invoke(hscache_main, ["diff", *diff, "--json", str(notes)]), "not a JSON report")
    sweep = ["sweep", str(tmp_path / "runs"), "--cache", str(scorer_cache), "--out", str(cache / "sw")]
    _refused(CliRunner().invoke(main, sweep), "is inside the cache")
    assert _digest(tmp_path) == before


def test_an_unwritable_report_folder_is_refused_before_scoring(
    scorer_cache, trained_drafter, tmp_path, no_scoring, monkeypatch
):
    """51.3: was: a PermissionError traceback after the whole evaluation (83 s)."""
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    if os.geteuid() == 0:  # root writes anywhere: stand in for the kernel's answer to another user
        real = os.access
        monkeypatch.setattr(os, "access", lambda p, mode: False if Path(p) == ro else real(p, mode))
    result = CliRunner().invoke(
        main, ["eval", str(trained_drafter), "--cache", str(scorer_cache), "--json", str(ro / "r.json")]
    )
    _refused(result, f"--json {ro / 'r.json'}: {ro} is not writable by this user")


def test_a_report_hscache_wrote_may_be_replaced(tmp_path):
    from hscache.errors import InputError
    from hscache.report.html import html_page
    from hscache.store.output_paths import check_output_path

    (tmp_path / "r.json").write_text(json.dumps({"schema_version": 3, "tau": {}}))
    (tmp_path / "many.json").write_text(json.dumps({"reports": [{"schema_version": 3}], "comparisons": []}))
    (tmp_path / "r.html").write_text(html_page("eval", ["<p>tau</p>"]))
    older = html_page("eval", ["<p>tau</p>"]).replace('<meta name="generator" content="hscache">', "")
    (tmp_path / "older.html").write_text(older)  # a page written before pages carried the tag
    (tmp_path / "mine.html").write_text("<!DOCTYPE html>\n<html><body>my notes</body></html>")
    for name, kind in (
        ("r.json", "json"),
        ("many.json", "json"),
        ("r.html", "html"),
        ("older.html", "html"),
        ("new.json", "json"),
    ):
        assert check_output_path(tmp_path / name, "--x", kind=kind) == tmp_path / name
    with pytest.raises(InputError, match="is not an HTML report hscache wrote"):
        check_output_path(tmp_path / "mine.html", "--report", kind="html")


def test_ctrl_c_while_training_saves_the_last_completed_step(scorer_cache, tmp_path, monkeypatch):
    """51.6: was: "interrupted: nothing was saved" after 75 s of training."""
    import signal

    import torch
    from safetensors.torch import load_file

    import scorer.families.dflash.train as dflash_train
    from scorer import train_drafter
    from scorer.training_stop import TRAINED_STEPS_KEY

    real_batch, calls = dflash_train.training_batch, {"n": 0}

    def batch_then_ctrl_c(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 3:
            os.kill(os.getpid(), signal.SIGINT)  # a real SIGINT, in the middle of step 3
        return real_batch(*args, **kwargs)

    monkeypatch.setattr(dflash_train, "training_batch", batch_then_ctrl_c)
    out = tmp_path / "drafter"
    args = ["init", str(out), "--cache", str(scorer_cache), "--train-steps", "50", "--block-size", "4"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 130, result.output
    last = result.output.strip().splitlines()[-1]
    assert last.startswith(f"interrupted after step 3 of 50: the drafter trained so far is saved at {out}"), (
        last
    )
    assert "--overwrite" in last and calls["n"] == 3
    assert json.loads((out / "config.json").read_text())[TRAINED_STEPS_KEY] == {"done": 3, "requested": 50}
    monkeypatch.undo()
    whole = tmp_path / "three"  # the same training run to its end at 3 steps: the same weights
    train_drafter(scorer_cache, whole, steps=3, block_size=4, log_every=0)
    assert json.loads((whole / "config.json").read_text())[TRAINED_STEPS_KEY] == {"done": 3, "requested": 3}
    saved, expected = load_file(out / "model.safetensors"), load_file(whole / "model.safetensors")
    assert saved.keys() == expected.keys()
    assert all(torch.equal(saved[k], expected[k]) for k in saved)  # bit-exact: the same 3 steps


def test_ctrl_c_while_training_eagle3_saves_the_last_completed_step(scorer_cache, tmp_path):
    import signal

    from scorer import train_drafter
    from scorer.training_stop import TRAINED_STEPS_KEY, TrainingInterrupted

    def ctrl_c_at_two(step, _loss):
        if step == 2:
            os.kill(os.getpid(), signal.SIGINT)

    out = tmp_path / "eagle3"
    with pytest.raises(TrainingInterrupted, match="after step 2 of 40"):
        train_drafter(
            scorer_cache, out, family="eagle3", steps=40, on_step=ctrl_c_at_two, layer_ids=[1, 3, 7]
        )
    assert json.loads((out / "config.json").read_text())[TRAINED_STEPS_KEY] == {"done": 2, "requested": 40}
