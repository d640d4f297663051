"""Issue 26 ("Hard edges, round four"), the scorer's items: one writer per drafter directory,
refusals before the work (output paths, numeric ranges, imports without target/, another target
before missing layers), advice that fits, output that logs can hold (whole tables, progress,
escaped pieces) and a draft time with its spread."""

from __future__ import annotations

import io
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from scorer.cli import main


def _one_line(result, *fragments: str) -> str:
    """A refusal: exit 2, one ``error:`` line (click's usage errors end with their own line)."""
    text = result.output.strip()
    assert result.exit_code == 2, result.output
    assert "Traceback" not in text, text
    last = text.splitlines()[-1]
    for fragment in fragments:
        assert fragment in last, text
    return last


def _edited_drafter(drafter: Path, out: Path, *, layers=None, weights_sha256=None) -> Path:
    """A copy of ``drafter`` whose config reads other layers and/or records another target."""
    shutil.copytree(drafter, out)
    config = json.loads((out / "config.json").read_text())
    if layers is not None:
        config["dflash_config"]["target_layer_ids"] = layers
    if weights_sha256 is not None:
        config["hscache_target"]["weights_sha256"] = weights_sha256
    (out / "config.json").write_text(json.dumps(config))
    return out


def _never(name: str):
    def fail(*_args, **_kwargs):
        raise AssertionError(f"{name} ran: the refusal came after the work")

    return fail


# ----------------------------------------------------------------------------- item 4: one writer


def _hold_lock(directory: Path) -> subprocess.Popen:
    """Another process holding ``directory``'s writer lock, as a running `scorer init` does."""
    code = (
        "import sys, time\n"
        "from hscache.store.lock import writer_lock\n"
        "with writer_lock(sys.argv[1], 'scorer init --family dflash'):\n"
        "    print('held', flush=True)\n"
        "    time.sleep(120)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])}
    holder = subprocess.Popen([sys.executable, "-c", code, str(directory)], stdout=subprocess.PIPE, env=env)
    assert holder.stdout.readline().strip() == b"held"
    return holder


def test_a_second_init_into_a_directory_being_written_is_refused_at_once(scorer_cache, tmp_path, monkeypatch):
    """Was: both trained; the second said "not empty; pass --overwrite" after 320 s of training."""
    import scorer.make

    monkeypatch.setattr(scorer.make, "train_drafter", _never("training"))
    out = tmp_path / "drafter"
    holder = _hold_lock(out)
    try:
        for extra in ((), ("--overwrite",)):
            result = CliRunner().invoke(
                main, ["init", str(out), "--cache", str(scorer_cache), "--train-steps", "300", *extra]
            )
            line = _one_line(result, f"{out} is being written by pid {holder.pid}", "scorer init")
            assert "one writer per drafter directory" in line
    finally:
        holder.kill()
        holder.wait()
    assert [p.name for p in out.iterdir()] == [".hscache-writer.lock"]  # the killed writer's, unlocked
    result = CliRunner().invoke(main, ["init", str(out), "--cache", str(scorer_cache)])
    assert result.exit_code == 0, result.output  # a dead writer's lock file blocks nobody
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]


def test_a_refused_init_leaves_no_directory_it_made(tmp_path):
    """Was: refused (no such cache), and a/ and a/b/ stayed behind: the writer lock made every missing
    parent of the drafter directory and removed only the directory itself."""
    out = tmp_path / "a" / "b" / "drafter"
    result = CliRunner().invoke(main, ["init", str(out), "--cache", str(tmp_path / "no-cache")])
    _one_line(result, "does not exist")
    assert list(tmp_path.iterdir()) == []


def test_init_holds_the_lock_while_it_trains(scorer_cache, tmp_path, monkeypatch):
    import scorer.make
    from hscache.store.lock import current_writer

    out, seen = tmp_path / "drafter", []

    def train(cache, where, **_options):
        seen.append(current_writer(where))
        raise KeyboardInterrupt  # and Ctrl-C while training (item 13)

    monkeypatch.setattr(scorer.make, "train_drafter", train)
    result = CliRunner().invoke(main, ["init", str(out), "--cache", str(scorer_cache), "--train-steps", "5"])
    assert seen[0]["pid"] == os.getpid() and seen[0]["command"] == "scorer init --family dflash"
    assert result.exit_code == 130, result.output
    assert result.output.strip().splitlines()[-1] == f"interrupted: nothing was saved; {out} did not exist"
    assert not out.exists()


def test_ctrl_c_during_an_overwrite_keeps_the_old_drafter(
    trained_drafter, scorer_cache, tmp_path, monkeypatch
):
    """Was: only "Aborted!"."""
    import scorer.make

    out = tmp_path / "drafter"
    shutil.copytree(trained_drafter, out)
    before = {p.name: p.read_bytes() for p in out.iterdir()}

    def interrupted(*_args, **_kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(scorer.make, "train_drafter", interrupted)
    args = ["init", str(out), "--cache", str(scorer_cache), "--train-steps", "5", "--overwrite"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 130 and "Aborted" not in result.output, result.output
    assert result.output.strip().splitlines()[-1] == f"interrupted: nothing was saved; {out} is as it was"
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


# ----------------------------------------------------------------------------- item 5: outputs first


@pytest.mark.parametrize(
    "command, flag",
    [("compare", "--report"), ("compare", "--json"), ("diagnose", "--json"), ("diagnose", "--report")],
)
def test_an_output_path_that_is_a_directory_is_refused_before_scoring(
    command, flag, trained_drafter, scorer_cache, tmp_path, monkeypatch
):
    """Was: everything scored, then IsADirectoryError."""
    import scorer.diagnose.run
    import scorer.studies.compare

    monkeypatch.setattr(scorer.studies.compare, "compare_drafters", _never("compare"))
    monkeypatch.setattr(scorer.diagnose.run, "diagnose_checkpoint", _never("diagnose"))
    args = [command, str(trained_drafter), "--cache", str(scorer_cache), flag, str(tmp_path)]
    assert _one_line(CliRunner().invoke(main, args)) == (
        f"error: {flag} {tmp_path} is a directory; choose a file path"
    )


def test_compare_refuses_a_bad_later_checkpoint_before_scoring_the_first(
    trained_drafter, scorer_cache, tmp_path, monkeypatch
):
    """Was: the first drafter replayed in full, then "unknown target head" (or "another target")."""
    import scorer.studies.compare

    monkeypatch.setattr(scorer.studies.compare, "score_cache", _never("scoring"))
    other = _edited_drafter(trained_drafter, tmp_path / "other", weights_sha256="0" * 64)
    for bad, fragment in (
        ("target:foo", "unknown target head 'foo'"),
        (str(other), "built for another target"),
    ):
        args = ["compare", str(trained_drafter), bad, "--cache", str(scorer_cache)]
        result = CliRunner().invoke(main, args)
        _one_line(result, fragment)
        assert len(result.output.strip().splitlines()) == 1, result.output


def test_sweep_refuses_an_out_that_is_a_file_before_scoring(
    trained_drafter, scorer_cache, tmp_path, monkeypatch
):
    import scorer.studies.sweep

    monkeypatch.setattr(scorer.studies.sweep, "evaluate", _never("scoring"))
    run = tmp_path / "run"
    shutil.copytree(trained_drafter, run / "step_100")
    (tmp_path / "notes").write_text("x")
    args = ["sweep", str(run), "--cache", str(scorer_cache), "--out", str(tmp_path / "notes")]
    assert _one_line(CliRunner().invoke(main, args)) == (
        f"error: --out {tmp_path / 'notes'} is a file; choose a directory path"
    )


# ----------------------------------------------------------------------------- item 6: imports


@pytest.fixture(scope="module")
def imported_cache(scorer_cache, tmp_path_factory) -> Path:
    """``scorer_cache`` exported to speculators files and imported back without --target."""
    from hscache.cli import main as hscache_main

    root = tmp_path_factory.mktemp("imported")
    runner = CliRunner()
    export = ["export", str(scorer_cache), "--format", "speculators", "--out", str(root / "spec")]
    assert runner.invoke(hscache_main, export).exit_code == 0
    imported = ["import", "--format", "speculators", str(root / "spec"), "--out", str(root / "c")]
    assert runner.invoke(hscache_main, imported).exit_code == 0
    return root / "c"


@pytest.mark.parametrize("family", ["dflash", "eagle3"])
@pytest.mark.parametrize("steps", ["0", "3"])
def test_init_on_an_import_without_target_says_what_is_missing(family, steps, imported_cache, tmp_path):
    """Was: FileNotFoundError: target/config.json."""
    out = tmp_path / "d"
    args = ["init", str(out), "--cache", str(imported_cache), "--family", family, "--train-steps", steps]
    line = _one_line(CliRunner().invoke(main, args))
    assert line == (
        f"error: {imported_cache} (imported from speculators files at {imported_cache.parent / 'spec'}) has "
        "no target/ (the target's config and head, which a drafter is sized from and reads); import the files "
        "again with `hscache import --format speculators --target MODEL` (the model that produced them), or "
        "use a cache made by `hscache extract`"
    )
    assert not out.exists()


# ----------------------------------------------------------------------------- item 7: target first


def test_another_targets_drafter_hears_that_before_missing_layers(trained_drafter, scorer_cache, tmp_path):
    """Was: "need layers [5] ...; re-extract with --layers ..." and, after the re-extraction,
    "built for another target". In eval, compare and sweep."""
    other = _edited_drafter(
        trained_drafter, tmp_path / "run" / "step_100", layers=[1, 3, 5], weights_sha256="0" * 64
    )
    commands = [
        ["eval", str(other), "--cache", str(scorer_cache), "--ddtree", ""],
        ["compare", str(other), "--cache", str(scorer_cache)],
        ["sweep", str(other.parent), "--cache", str(scorer_cache), "--ddtree", ""],
    ]
    for args in commands:
        line = _one_line(CliRunner().invoke(main, args), "built for another target", "weights_sha256")
        assert "re-extract" not in line and "need layers" not in line


# ----------------------------------------------------------------------------- item 8: right advice


def test_a_layer_the_target_lacks_is_not_advised_for_re_extraction(trained_drafter, scorer_cache):
    """Was: "re-extract with --layers 1,3,99" for an 8-layer target."""
    args = ["eval", str(trained_drafter), "--cache", str(scorer_cache), "--target-layer-ids", "1,3,99"]
    line = _one_line(CliRunner().invoke(main, args))
    assert line == (
        f"error: drafter target_layer_ids [1, 3, 99] include [99], which the target of {scorer_cache} does "
        "not have (it has 8 layers, ids 0-7); fix the layer ids (--target-layer-ids), or score the drafter "
        "on a cache of the target it was built for"
    )
    # A layer the target has but the cache lacks: re-extracting it is the fix (the cached ones kept).
    args[-1] = "1,3,5"
    assert _one_line(CliRunner().invoke(main, args)).endswith("re-extract with --layers 1,3,5,7")


def test_dflash2_without_from_says_from_is_required(scorer_cache, tmp_path):
    args = ["init", str(tmp_path / "d2"), "--cache", str(scorer_cache), "--family", "dflash2"]
    _one_line(CliRunner().invoke(main, args), "--family dflash2 requires --from DIR")


def test_dflash2_from_a_drafter_whose_layers_the_cache_lacks_is_refused_at_init(
    trained_drafter, scorer_cache, tmp_path
):
    """Was: saved without complaint; the refusal came at eval."""
    parent = _edited_drafter(trained_drafter, tmp_path / "parent", layers=[1, 3, 5])
    out = tmp_path / "d2"
    args = ["init", str(out), "--cache", str(scorer_cache), "--family", "dflash2", "--from", str(parent)]
    _one_line(CliRunner().invoke(main, args), "need layers [5]", "re-extract with --layers 1,3,5,7")
    assert not out.exists()
    other = _edited_drafter(trained_drafter, tmp_path / "other", weights_sha256="0" * 64)
    args[-1] = str(other)
    _one_line(CliRunner().invoke(main, args), "built for another target")
    assert not out.exists()


def test_sweep_names_the_checkpoint_it_cannot_score_and_keep_going_scores_the_rest(
    trained_drafter, scorer_cache, tmp_path
):
    """Was: the sweep stopped at one incompatible checkpoint without naming it."""
    run = tmp_path / "run"
    shutil.copytree(trained_drafter, run / "step_100")
    bad = _edited_drafter(trained_drafter, run / "step_200", layers=[1, 3, 5])
    args = ["sweep", str(run), "--cache", str(scorer_cache), "--limit", "1", "--ddtree", ""]
    line = _one_line(CliRunner().invoke(main, args))
    assert line.startswith(f"error: checkpoint {bad} (step 200) cannot be scored: drafter target_layer_ids")
    assert line.endswith("pass --keep-going to score the other checkpoints and list the refused ones")
    result = CliRunner().invoke(main, [*args, "--keep-going"])
    assert result.exit_code == 0, result.output
    assert f"refused {bad} (step 200): drafter target_layer_ids [1, 3, 5] need layers [5]" in result.output
    document = json.loads((run / "sweep" / "sweep.json").read_text())
    assert [row["step"] for row in document["rows"]] == [100]
    assert [(r["path"], r["step"]) for r in document["refused"]] == [(str(bad), 200)]


def test_not_a_cache_errors_fit_the_path(trained_drafter, scorer_cache, tmp_path, monkeypatch):
    """The drafter and the cache swapped is said as such (was: "holds no model.safetensors ..."), and
    a second --cache that is no cache is refused before the first is scored."""
    import scorer.studies.evaluate

    swapped = ["eval", str(scorer_cache), "--cache", str(scorer_cache)]
    assert _one_line(CliRunner().invoke(main, swapped)) == (
        f"error: {scorer_cache} is a hidden-state cache (it holds manifest.json), not a drafter; pass the "
        f"drafter first and the cache with --cache (e.g. scorer eval DRAFTER --cache {scorer_cache})"
    )
    monkeypatch.setattr(scorer.studies.evaluate, "score_cache", _never("scoring"))
    a_file = tmp_path / "notes.txt"
    a_file.write_text("x")
    for second, what in ((a_file, "is a file"), (trained_drafter, "is a drafter or model directory")):
        args = ["eval", str(trained_drafter), "--cache", str(scorer_cache), "--cache", str(second)]
        line = _one_line(CliRunner().invoke(main, args), what)
        assert "extract --out" not in line


# ----------------------------------------------------------------------------- item 9: ranges


@pytest.mark.parametrize(
    "command, flag, value",
    [
        ("eval", "--rope-theta", "-5"),
        ("eval", "--rope-theta", "nan"),
        ("eval", "--rope-theta", "inf"),
        ("eval", "--mask-token-id", "-1"),
        ("eval", "--seed", "-1"),
        ("eval", "--memory-gb", "inf"),
        ("eval", "--target-layer-ids", "1,-3"),
        ("compare", "--seed", "-2"),
        ("diagnose", "--train-metric", "-1"),
        ("diagnose", "--train-metric", "nan"),
        ("diagnose", "--rope-theta", "0"),
        ("sweep", "--seed", "-1"),
        ("init", "--seed", "-1"),
        ("online", "--rope-theta", "-5"),
    ],
)
def test_a_value_that_cannot_be_right_is_refused_by_name(command, flag, value, tmp_path):
    """Was: --rope-theta -5 scored tau 1.000 with exit 0."""
    first = tmp_path / "x"
    args = [command, str(first), *([] if command == "online" else ["--cache", str(tmp_path)]), flag, value]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 2 and "Traceback" not in result.output, result.output
    assert f"'{flag}'" in result.output.strip().splitlines()[-1], result.output


def test_every_numeric_flag_has_a_range():
    """No scorer flag takes a bare int or float: each says which values it accepts."""
    import click

    bare = [
        f"{name} {param.opts[0]}"
        for name, command in main.commands.items()
        for param in command.params
        if isinstance(param, click.Option)
        and type(param.type) in (click.types.IntParamType, click.types.FloatParamType)
    ]
    assert bare == []


# ----------------------------------------------------------------------------- items 12, 13, 15: compare


@pytest.fixture(scope="module")
def compared(trained_drafter, scorer_cache, tmp_path_factory):
    """One `scorer compare` of two drafters with a long name, its output not a terminal."""
    root = tmp_path_factory.mktemp("compare")
    long_name = root / ("a-drafter-with-a-name-long-enough-to-widen-every-table-" * 2).rstrip("-")
    shutil.copytree(trained_drafter, long_name)
    out = root / "compare.json"
    args = ["compare", str(trained_drafter), str(long_name), "--cache", str(scorer_cache), "--limit", "2"]
    result = CliRunner().invoke(main, [*args, "--json", str(out)])
    assert result.exit_code == 0, result.output
    return result, json.loads(out.read_text()), long_name, args


def test_compare_redirected_prints_whole_plain_tables(compared):
    """Was: both tables cut to 80 columns ("7.7…", "(ref…")."""
    result, document, long_name, _ = compared
    text = result.output
    assert "…" not in text and "┃" not in text
    assert max(len(line) for line in text.splitlines()) > 80
    rows = [line for line in text.splitlines() if line.startswith(f"{long_name.name} (dflash)")]
    assert len(rows) == 2  # one in each table, whole
    tau = document["drafters"][1]["tau"]
    assert f"{tau['pooled']:.3f} [{tau['pooled_ci95'][0]:.2f}, {tau['pooled_ci95'][1]:.2f}]" in rows[0]
    assert "(reference)" in text


def test_compare_format_markdown(compared, monkeypatch):
    import scorer.studies.compare

    _, document, long_name, args = compared
    monkeypatch.setattr(scorer.studies.compare, "compare_drafters", lambda *a, **k: document)
    result = CliRunner().invoke(main, [*args, "--format", "markdown"])
    assert result.exit_code == 0, result.output
    table = [line for line in result.output.splitlines() if line.startswith("|")]
    assert table[0].startswith("| drafter | drafting (source) |") and set(table[1]) == {"|", "-"}
    assert sum(f"| {long_name.name} (dflash) |" in line for line in table) == 2


def test_compare_reports_progress_per_drafter(compared):
    """Was: nothing until the end."""
    result, _, long_name, _ = compared
    assert f"compare: 2 sequences (drafter 2 of 2: {long_name})" in result.output


def test_draft_time_is_a_median_with_its_spread(compared):
    """Was: one timing per round after one warm-up call (the same drafter gave 198 and 19 ms)."""
    from scorer.studies.compare import TIMING_REPEATS

    result, document, _, _ = compared
    for row in document["drafters"]:
        cost = row["cost"]
        assert cost["timed_rounds"] > 0 and cost["timed_repeats"] == TIMING_REPEATS
        assert cost["draft_seconds_per_round"] > 0 and cost["draft_seconds_per_round_spread"] >= 0
        shown = (
            f"{cost['draft_seconds_per_round'] * 1e3:.3f} ±{cost['draft_seconds_per_round_spread'] * 1e3:.3f}"
        )
        assert shown in result.output


def test_rounds_are_timed_after_warm_up_as_the_fastest_of_repeats_on_one_thread(
    trained_drafter, scorer_cache, monkeypatch
):
    """Was: one untimed call, then one timing per round on torch's thread pool (94.6 ms in one run
    and 1.1 ms in the next for the same drafter on a busy machine)."""
    import dataclasses

    import torch

    import scorer.studies.compare
    from scorer.studies.compare import TIMING_REPEATS, WARMUP_ROUNDS, compare_drafters
    from scorer.studies.evaluate import EvalConfig

    calls: list[tuple[float, int]] = []
    real_family = scorer.studies.compare.drafter_family

    def time_round(drafter, features, tokens, anchor, tau):
        n = len(calls)
        # warm-up calls slow; then per round a slow, a fast (growing with n) and a slow run
        seconds = 1.0 if n < WARMUP_ROUNDS else (0.001 * n if (n - WARMUP_ROUNDS) % 3 == 1 else 0.5)
        calls.append((seconds, torch.get_num_threads()))
        return seconds, []

    monkeypatch.setattr(
        scorer.studies.compare,
        "drafter_family",
        lambda d: dataclasses.replace(real_family(d), time_round=time_round),
    )
    config, before = EvalConfig(ddtree=(), limit=2), torch.get_num_threads()
    torch.set_num_threads(threads := 2)  # a thread pool, as by default on any multi-core machine
    try:
        cost = compare_drafters([trained_drafter], scorer_cache, config, timed_rounds=8)["drafters"][0][
            "cost"
        ]
        assert torch.get_num_threads() == threads  # restored after the timing
    finally:
        torch.set_num_threads(before)
    timed = [seconds for seconds, _ in calls[WARMUP_ROUNDS:]]
    assert cost["timed_rounds"] >= 2 and len(timed) == cost["timed_rounds"] * TIMING_REPEATS
    assert {n for _, n in calls} == {1}
    fastest = [min(timed[i : i + TIMING_REPEATS]) for i in range(0, len(timed), TIMING_REPEATS)]
    assert all(0 < f < 0.5 for f in fastest)
    q1, _, q3 = statistics.quantiles(fastest, n=4, method="inclusive")
    assert cost["draft_seconds_per_round"] == pytest.approx(statistics.median(fastest), rel=1e-12)
    assert cost["draft_seconds_per_round_spread"] == pytest.approx((q3 - q1) / 2, rel=1e-12)


def test_round_time_summary_is_the_median_and_half_the_interquartile_range():
    from scorer.studies.compare import round_time_summary

    times = [0.9, 0.1, 0.5, 0.3, 0.7, 0.2, 0.4]
    q1, _, q3 = statistics.quantiles(times, n=4, method="inclusive")  # numpy's default (linear)
    median, spread = round_time_summary(times)
    assert median == statistics.median(times)
    assert math.isclose(spread, (q3 - q1) / 2, rel_tol=1e-12)
    assert round_time_summary([]) == (None, None)


def test_eagle3_training_reports_progress(fp32_cache, tmp_path, monkeypatch):
    """Was: `scorer init --family eagle3 --train-steps 100` silent for 63 s."""
    monkeypatch.setattr("hscache.progress.DEFAULT_EVERY_S", 0.0)  # a log line per step
    out = tmp_path / "e"
    args = ["init", str(out), "--cache", str(fp32_cache), "--family", "eagle3", "--train-steps", "2"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    assert "train: 1/2 steps" in result.output and "train: 2/2 steps" in result.output


def test_eagle3_training_on_a_cache_without_its_layers_is_one_line(scorer_cache, tmp_path):
    """Was: ValueError "4 is not in list" (the engines' default layers 1,3,4; the cache has 1,3,7)."""
    args = [
        "init",
        str(tmp_path / "e"),
        "--cache",
        str(scorer_cache),
        "--family",
        "eagle3",
        "--train-steps",
        "2",
    ]
    assert _one_line(CliRunner().invoke(main, args)) == (
        f"error: drafter target layers [1, 3, 4] need layers [4] that {scorer_cache} lacks (it has [1, 3, 7]); "
        "re-extract with --layers 1,3,4,7"
    )
    assert not (tmp_path / "e").exists()


# ----------------------------------------------------------------------------- item 14: samples


def test_sample_pieces_escape_what_is_not_printable(trained_drafter, scorer_cache, tmp_path):
    """Was: raw bytes of the random tokenizer ('��D') on the terminal."""
    from rich.console import Console

    from scorer.report.terminal import render_report
    from scorer.report.text import readable

    assert readable("\ufffd\ufffdD") == "'\\ufffd\\ufffdD'"
    assert readable("a\x1b[2Jb\n") == "'a\\x1b[2Jb\\n'"
    assert readable("déjà vu") == "'déjà vu'"
    out = tmp_path / "r.json"
    args = ["eval", str(trained_drafter), "--cache", str(scorer_cache), "--limit", "1", "--ddtree", ""]
    assert CliRunner().invoke(main, [*args, "--samples", "1", "--json", str(out)]).exit_code == 0
    report = json.loads(out.read_text())
    sample = report["samples"][0]
    sample["drafted"][0], sample["drafted_text"] = "\ufffdD", "\ufffd\ufffdD\x1b"
    screen = io.StringIO()
    render_report(report, Console(file=screen, width=200))
    text = screen.getvalue()
    assert "\ufffd" not in text and "\x1b" not in text
    assert "'\\ufffdD'" in text and "'\\ufffd\\ufffdD\\x1b'" in text
