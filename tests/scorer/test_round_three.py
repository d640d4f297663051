"""Issue 20 in the scorer: clear lines for bad flags and directories, target identity, progress."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

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


def _eval(drafter: Path, cache: Path, tmp_path: Path, *extra: str):
    out = tmp_path / f"report-{len(list(tmp_path.glob('report-*')))}.json"
    args = ["eval", str(drafter), "--cache", str(cache), "--limit", "1", "--ddtree", "", "--json", str(out)]
    result = CliRunner().invoke(main, [*args, *extra])
    report = json.loads(out.read_text()) if out.exists() else None
    return result, report


def test_init_refuses_a_file_and_a_non_empty_directory_and_replaces_whole(scorer_cache, tmp_path):
    """Issue 20.6 / 18.7: OUT a file is one line; a non-empty OUT needs --overwrite, which replaces
    it whole (no file of the old drafter survives); the drafter records the cache's target."""
    import hscache
    from scorer.target_identity import IDENTITY_KEY, cache_target_identity

    a_file = tmp_path / "drafter.txt"
    a_file.write_text("notes")
    _one_line_error(
        CliRunner().invoke(main, ["init", str(a_file), "--cache", str(scorer_cache)]), "not a directory"
    )
    assert a_file.read_text() == "notes"
    out = tmp_path / "drafter"
    out.mkdir()
    (out / "stale.safetensors").write_bytes(b"old weights")
    result = CliRunner().invoke(main, ["init", str(out), "--cache", str(scorer_cache)])
    _one_line_error(result, "is not empty", "--overwrite")
    assert sorted(p.name for p in out.iterdir()) == ["stale.safetensors"]
    result = CliRunner().invoke(main, ["init", str(out), "--cache", str(scorer_cache), "--overwrite"])
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    assert not list(tmp_path.glob(".drafter.*"))  # no staging or retired directory left behind
    recorded = json.loads((out / "config.json").read_text())[IDENTITY_KEY]
    assert recorded == cache_target_identity(hscache.open_cache(scorer_cache))
    assert set(recorded) == {"weights_sha256", "model_type", "tokenizer_sha256"}


def test_a_crash_while_writing_leaves_the_old_drafter_whole(scorer_cache, tmp_path, monkeypatch):
    """Issue 18.7: the config of a new drafter never sits next to the weights of the old one."""
    import scorer.families.dflash.init as dflash_init
    from scorer import init_drafter

    out = tmp_path / "drafter"
    init_drafter(scorer_cache, out, seed=0)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    real_save = dflash_init.save_hf_checkpoint

    def crash_after_the_config(directory, config, state_dict, **kwargs):
        real_save(directory, config, state_dict, **kwargs)
        (Path(directory) / "model.safetensors").unlink()  # as if killed between the two files
        raise OSError("disk full")

    monkeypatch.setattr(dflash_init, "save_hf_checkpoint", crash_after_the_config)
    with pytest.raises(OSError, match="disk full"):
        init_drafter(scorer_cache, out, seed=1, overwrite=True)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert not list(tmp_path.glob(".drafter.*"))


def test_eval_compares_the_recorded_target(scorer_cache, trained_drafter, tmp_path):
    """Issue 20.2: a drafter recording another target is refused in one line (or scored with a
    warning under --allow-target-mismatch); one recording nothing gets a note; its own target matches."""
    result, report = _eval(trained_drafter, scorer_cache, tmp_path)
    assert result.exit_code == 0, result.output
    assert report["target_check"]["status"] == "match" and report["notes"] == []
    other = tmp_path / "other"
    shutil.copytree(trained_drafter, other)
    config = json.loads((other / "config.json").read_text())
    config["hscache_target"]["weights_sha256"] = "0" * 64  # built for another target
    (other / "config.json").write_text(json.dumps(config))
    result, report = _eval(other, scorer_cache, tmp_path)
    _one_line_error(result, "another target", "weights_sha256", "--allow-target-mismatch")
    assert report is None
    result, report = _eval(other, scorer_cache, tmp_path, "--allow-target-mismatch")
    assert result.exit_code == 0, result.output
    assert report["target_check"]["status"] == "mismatch"
    assert any("another target" in w for w in report["warnings"]), report["warnings"]
    assert "another target" in result.output
    del config["hscache_target"]  # a published checkpoint records nothing
    (other / "config.json").write_text(json.dumps(config))
    result, report = _eval(other, scorer_cache, tmp_path)
    assert result.exit_code == 0, result.output
    assert report["target_check"]["status"] == "unknown"
    assert report["notes"] and "could not be checked" in report["notes"][0]
    assert "note:" in result.output and "could not be checked" in result.output


@pytest.fixture(scope="module")
def incomplete_cache(scorer_cache: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The first sequence of ``scorer_cache`` committed by a writer that has not finished (1 of 6)."""
    import zarr

    from hscache.store.layout import PROVENANCE, TARGET_DIR, ArraySpec
    from hscache.store.reader import read_manifest
    from hscache.store.writer import SequenceRows, StoreWriter

    manifest = read_manifest(scorer_cache)
    out = tmp_path_factory.mktemp("incomplete") / "cache"
    out.mkdir()
    shutil.copytree(scorer_cache / TARGET_DIR, out / TARGET_DIR)
    shutil.copy(scorer_cache / PROVENANCE, out / PROVENANCE)
    specs = {name: ArraySpec.from_dict(name, d) for name, d in manifest["arrays"].items()}
    writer = StoreWriter.create(out, specs, manifest["compression"], manifest["settings"])
    import hscache

    index = hscache.open_cache(scorer_cache).index.slice(0, 1).to_pylist()[0]
    rows = slice(index["offset"], index["offset"] + index["length"])
    arrays = {name: zarr.open_array(scorer_cache / "arrays" / name, mode="r")[rows] for name in specs}
    fields = ("record_id", "prompt_len", "stop_reason", "token_sha256", "metadata_json")
    writer.append(SequenceRows(arrays, **{k: index[k] for k in fields}))
    writer.commit()  # committed, never finished: what a reader sees while extract still runs
    return out


def test_eval_of_an_incomplete_cache_says_so_everywhere(incomplete_cache, trained_drafter, tmp_path):
    """Issue 20.3: terminal, JSON (cache.complete false, committed/expected) and HTML."""
    html = tmp_path / "r.html"
    result, report = _eval(trained_drafter, incomplete_cache, tmp_path, "--report", str(html))
    assert result.exit_code == 0, result.output
    cache = report["cache"]
    assert (cache["complete"], cache["committed_sequences"], cache["expected_sequences"]) == (False, 1, 6)
    warning = next(w for w in report["warnings"] if "INCOMPLETE" in w)
    assert "1 of 6 sequences committed" in warning
    assert "cache INCOMPLETE" in result.output and "1 of 6 sequences" in result.output
    assert "INCOMPLETE: 1 of 6 sequences committed" in html.read_text()


def test_info_says_a_writer_is_running_instead_of_advising_a_resume(incomplete_cache):
    from hscache.cli import main as hscache_main
    from hscache.store.lock import writer_lock

    idle = CliRunner().invoke(hscache_main, ["info", str(incomplete_cache)])
    assert idle.exit_code == 0, idle.output
    assert "INCOMPLETE: 1 of 6 sequences committed; no writer is running: resume" in idle.output
    with writer_lock(incomplete_cache, "hscache extract"):
        busy = CliRunner().invoke(hscache_main, ["info", str(incomplete_cache)])
        as_json = CliRunner().invoke(hscache_main, ["info", str(incomplete_cache), "--json"])
    assert "a writer is running: pid" in busy.output and "hscache extract" in busy.output, busy.output
    assert "resume" not in busy.output
    assert json.loads(as_json.output)["writer"]["command"] == "hscache extract"


def test_info_json_has_a_schema_and_matches_it(scorer_cache, incomplete_cache):
    """Issue 20.14: like every other document; a key the schema does not list is refused."""
    from hscache import schemas
    from hscache.cli import main as hscache_main

    for cache in (scorer_cache, incomplete_cache):
        result = CliRunner().invoke(hscache_main, ["info", str(cache), "--json"])
        assert result.exit_code == 0, result.output
        document = json.loads(result.output)
        schemas.validate(document, "cache_info")
        assert document["schema_version"] == 1
    with pytest.raises(schemas.SchemaError, match="Additional properties"):
        schemas.validate({**document, "undocumented": 1}, "cache_info")


def test_step_progress_lines_when_stderr_is_not_a_terminal():
    """Issue 20.10: done/total, rate, ETA and a status, a line every few seconds, one at the end."""
    import io

    from hscache.progress import StepProgress, format_eta

    stream = io.StringIO()
    with StepProgress("eval", "sequences", every_s=0, stream=stream, terminal=False) as progress:
        progress.start(3)
        for n in range(1, 3):
            progress.advance(1, status=f"{10 * n} rounds")
    lines = stream.getvalue().splitlines()
    assert lines[0].startswith("eval: 1/3 sequences, ") and "sequences/s" in lines[0], lines
    assert "ETA " in lines[0] and lines[0].endswith("10 rounds"), lines
    assert lines[-1].startswith("eval: 2/3 sequences") and lines[-1].endswith("20 rounds"), lines
    quiet, short = io.StringIO(), io.StringIO()
    for stream, kwargs in ((quiet, {"quiet": True, "every_s": 0}), (short, {"every_s": 3600})):
        with StepProgress("eval", "sequences", stream=stream, terminal=False, **kwargs) as progress:
            progress.start(3)
            progress.advance(3)
    assert quiet.getvalue() == "" and short.getvalue() == ""  # a step shorter than every_s is silent
    assert (format_eta(42), format_eta(185), format_eta(3720)) == ("42 s", "3 min 05 s", "1 h 02 min")


def test_train_and_eval_report_progress(scorer_cache, trained_drafter, tmp_path, monkeypatch):
    """Issue 20.10: scorer init --train-steps and scorer eval print progress lines in logs."""
    import hscache.progress

    monkeypatch.setattr(hscache.progress, "DEFAULT_EVERY_S", 0.0)
    out = tmp_path / "drafter"
    result = CliRunner().invoke(main, ["init", str(out), "--cache", str(scorer_cache), "--train-steps", "3"])
    assert result.exit_code == 0, result.output
    assert "train: 3/3 steps" in result.output and "loss " in result.output, result.output
    result, _ = _eval(trained_drafter, scorer_cache, tmp_path)
    assert result.exit_code == 0, result.output
    assert "eval: 1/1 sequences" in result.output and " rounds, tau so far " in result.output, result.output


def test_token_pieces_never_print_a_replacement_character(scorer_cache):
    """Issue 20.11: byte-level tokens decoded one by one print U+FFFD; pieces of a run do not."""
    import hscache
    from scorer.report.text import token_pieces

    tokenizer = hscache.open_cache(scorer_cache).tokenizer()
    text = " café über naïve 日本"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert any("\ufffd" in tokenizer.decode([t]) for t in ids)  # the old per-token decoding
    context = tokenizer("def f(x):", add_special_tokens=False)["input_ids"]
    pieces = token_pieces(tokenizer, ids, context=context)
    assert len(pieces) == len(ids) and "".join(pieces) == text
    assert not any("\ufffd" in p for p in pieces)


def test_samples_show_whole_runs_under_a_heading(scorer_cache, trained_drafter, tmp_path):
    """Issue 20.11 / 20.12: readable text with a heading that names the columns; tau defined once."""
    result, report = _eval(trained_drafter, scorer_cache, tmp_path, "--samples", "2")
    assert result.exit_code == 0, result.output
    samples = report["samples"]
    assert len(samples) == 2
    tokenizer = __import__("hscache").open_cache(scorer_cache).tokenizer()
    for sample in samples:
        assert sample["drafted_text"] == tokenizer.decode(sample["drafted_ids"])
        assert sample["target_text"] == tokenizer.decode(sample["target_ids"])
        assert len(sample["drafted"]) == len(sample["drafted_ids"]) == len(sample["target"])
    assert "sample rounds: after the context, each slot's drafted token and the target's" in result.output
    assert "target (greedy)" in result.output
    assert result.output.count("tau = tokens each target forward yields") == 1


def test_online_compares_the_recorded_target_with_the_model(trained_drafter, tmp_path):
    """Issue 20.2 for `scorer online`: the drafter's recorded target against --model."""
    from scorer.errors import IncompatibleCacheError
    from scorer.online.greedy import OnlineConfig, run_online

    other = tmp_path / "other"
    shutil.copytree(trained_drafter, other)
    config = json.loads((other / "config.json").read_text())
    config["hscache_target"]["model_type"] = "llama"
    (other / "config.json").write_text(json.dumps(config))
    with pytest.raises(IncompatibleCacheError, match="model_type: drafter llama, model qwen3_5_text"):
        run_online(other, OnlineConfig(model="builtin:tiny-qwen3.5", max_new_tokens=2, limit=1))
    result = run_online(
        trained_drafter, OnlineConfig(model="builtin:tiny-qwen3.5", max_new_tokens=2, limit=1)
    )
    assert result["target_check"]["status"] == "match"
