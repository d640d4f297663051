"""A crash, a kill -9, a full disk or Ctrl-C never costs committed work, never mixes runs, and a
resumed cache is bit-identical to an uninterrupted one. Readers only ever see committed data."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import random
import signal
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

import hscache
from hscache.cli import main
from hscache.errors import ResumeMismatchError, StoreWriteError
from hscache.store import fsio, integrity
from hscache.store.layout import array_specs
from hscache.store.run_log import read_run_log
from hscache.store.writer import SequenceRows, StoreWriter
from hscache.verify import VerifyConfig, verify_cache
from tests.conftest import write_jsonl
from tests.hscache.forked_cli import ForkedRun

pytestmark = pytest.mark.usefixtures("one_thread")


# ----------------------------------------------------------------------------- helpers


def _committed(out: Path) -> int:
    try:
        return json.loads((out / "manifest.json").read_text())["committed"]["sequences"]
    except (FileNotFoundError, json.JSONDecodeError, KeyError):
        return -1


def _assert_prefix_of(cache: hscache.Cache, reference: hscache.Cache) -> None:
    """Every committed sequence of ``cache`` equals the same row of ``reference``, bit for bit."""
    assert cache.index.to_pylist() == reference.index.slice(0, len(cache)).to_pylist()
    tokens = cache.num_tokens
    for name in reference.specs:
        got = np.asarray(cache.array(name)[:tokens])
        want = np.asarray(reference.array(name)[:tokens])
        assert got.dtype == want.dtype and got.tobytes() == want.tobytes(), name  # bytes: NaN == NaN


def _assert_identical(out: Path, reference: Path) -> None:
    """Same arrays (bit for bit, up to the committed tokens), same index rows, same settings, and so
    the same digest: what the interrupted runs did is in the run log, outside it (issue 26, item 1)."""
    cache, ref = hscache.open_cache(out), hscache.open_cache(reference)
    assert cache.complete and len(cache) == len(ref) and cache.num_tokens == ref.num_tokens
    assert cache.settings == ref.settings
    assert hscache.cache_digest(cache) == hscache.cache_digest(ref)
    assert all(cache.array(n).shape == ref.array(n).shape for n in ref.specs)
    _assert_prefix_of(cache, ref)
    report = verify_cache(out, VerifyConfig(deep=True))
    assert report.ok, report.problems
    leftovers = [p for p in out.rglob("*") if p.name.endswith(".partial") or fsio.TEMP_MARK in p.name]
    assert not leftovers


def _kill_when(proc: ForkedRun, condition, timeout: float = 120) -> bool:
    """SIGKILL ``proc`` as soon as ``condition()`` holds; False if it exited first."""
    deadline = time.monotonic() + timeout
    while proc.poll() is None and time.monotonic() < deadline:
        if condition():
            proc.kill()  # SIGKILL: no handler, no cleanup, no flush
            proc.wait()
            return True
        time.sleep(0.002)
    proc.communicate(timeout=60)
    return False


class _DiskFull:
    """Make a function raise ENOSPC from its ``fail_at``-th call on (later calls fail too)."""

    def __init__(self, original, fail_at: int):
        self.original, self.fail_at, self.calls = original, fail_at, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        if self.calls >= self.fail_at:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(args[0]) if args else None)
        return self.original(*args, **kwargs)


# ----------------------------------------------------------------------------- kill -9


@pytest.mark.slow
def test_kill9_at_several_points_then_resume_is_bit_identical(tmp_path, small_cache, cli_server):
    out = tmp_path / "c"
    args = small_cache.cli_args(out)
    reference = hscache.open_cache(small_cache.path)
    rng = random.Random(20260521)
    at_kill = []
    # 1) a random early moment: most likely before the first manifest (target/ being staged).
    proc = cli_server.start(args)
    early = {"t": None}

    def early_moment() -> bool:
        if early["t"] is None and out.exists():
            early["t"] = time.monotonic() + rng.uniform(0.0, 0.4)
        return early["t"] is not None and time.monotonic() >= early["t"]

    # 2) and 3) mid-run, as soon as the manifest shows >= k committed sequences.
    conditions = (early_moment, lambda: _committed(out) >= 3, lambda: _committed(out) >= 8)
    for n, condition in enumerate(conditions):
        killed = _kill_when(proc, condition)
        at_kill.append(_committed(out) if killed else "finished")
        if _committed(out) >= 0:  # whatever a kill left, a reader sees a correct committed prefix
            _assert_prefix_of(hscache.open_cache(out), reference)
        if n + 1 < len(conditions):
            proc = cli_server.start(args)  # the same command resumes
    # The last resume runs in-process (same settings as the command; saves an interpreter start).
    print(f"committed sequences at each kill -9: {at_kill}")  # -1: killed before the first manifest
    result = hscache.extract(small_cache.config_for(out))
    assert result.sequences == 12, at_kill
    _assert_identical(out, small_cache.path)


# ----------------------------------------------------------------------------- readers


@pytest.mark.slow
def test_reader_during_extraction_sees_only_committed_correct_sequences(tmp_path, small_cache, cli_server):
    out = tmp_path / "c"
    args = [a if a != "0.0" else "0.15" for a in small_cache.cli_args(out)]  # commit every 0.15 s
    reference = hscache.open_cache(small_cache.path)
    proc = cli_server.start(args)
    sizes = set()
    while proc.poll() is None:
        if _committed(out) < 0:
            time.sleep(0.01)
            continue
        cache = hscache.open_cache(out)
        sizes.add(len(cache))
        _assert_prefix_of(cache, reference)
        for i in range(len(cache)):  # through the public accessors too
            assert np.array_equal(cache.hidden_states(i).numpy(), reference.hidden_states(i).numpy())
        running = verify_cache(out)  # verify reads the committed prefix of a running extraction too
        assert running.ok, running.problems
        time.sleep(0.05)  # leave the CPU to the extraction
    assert proc.wait() == 0, proc.communicate()[1]
    assert any(0 < n < 12 for n in sizes), sizes  # really read while it was running
    _assert_identical(out, small_cache.path)


def test_compaction_crash_windows_never_show_duplicates(tmp_path, monkeypatch):
    """Kill finish() after the compacted index part is written, and after it is published."""
    specs = array_specs(2, 8, "float32", 4, None, chunk_bytes=1)

    def rows(n: int, seed: int) -> SequenceRows:
        g = np.random.default_rng(seed)
        ids = g.integers(0, 100, n).astype(np.int32)
        arrays = {
            "hidden_states": g.standard_normal((n, 2, 8)).astype(np.float32),
            "token_ids": ids,
            "target_argmax": ids,
            "target_topk_values": np.zeros((n, 4), np.float32),
            "target_topk_ids": np.zeros((n, 4), np.int32),
            "target_logsumexp": np.zeros(n, np.float32),
        }
        digest = hashlib.sha256(ids.astype("<i4").tobytes()).hexdigest()
        return SequenceRows(arrays, f"r{seed}", 1, "none", digest, "{}")

    class Crash(BaseException):
        pass

    for window in ("before_publish", "after_publish"):
        root = tmp_path / window
        writer = StoreWriter.create(root, specs, "balanced", {"layer_ids": [0, 1]})
        for seed in range(3):
            writer.append(rows(100 + seed, seed))
            writer.commit()  # parts 000000..000002
        original = StoreWriter._publish_manifest

        def crash(self, *a, _window=window, _original=original, **k):
            if len(self.manifest["index_parts"]) == 1 and _window == "before_publish":
                raise Crash
            _original(self, *a, **k)
            if len(self.manifest["index_parts"]) == 1:
                raise Crash

        monkeypatch.setattr(StoreWriter, "_publish_manifest", crash)
        with pytest.raises(Crash):
            writer.finish()
        monkeypatch.setattr(StoreWriter, "_publish_manifest", original)
        cache = hscache.open_cache(root)
        assert len(cache) == 3 and cache.index.column("seq_id").to_pylist() == [0, 1, 2]
        assert len(list((root / "index").glob("*.parquet"))) == 4  # old parts and compacted both on disk
        # Resume (leftovers removed), append two more commits: names never reuse a listed part.
        writer = StoreWriter.resume(root, json.loads((root / "manifest.json").read_text()))
        for seed in (3, 4):
            writer.append(rows(100 + seed, seed))
            writer.commit()
        listed = json.loads((root / "manifest.json").read_text())["index_parts"]
        assert len(set(listed)) == len(listed)
        writer.finish()
        cache = hscache.open_cache(root)
        assert cache.index.column("record_id").to_pylist() == [f"r{s}" for s in range(5)]
        for s in range(5):
            assert np.array_equal(cache.hidden_states(s).numpy(), rows(100 + s, s).arrays["hidden_states"])
        problems = verify_cache(root, VerifyConfig(deep=True)).problems
        assert all(p.message.startswith("target/") for p in problems), (
            problems
        )  # no target/: store-level test
        assert len(list((root / "index").glob("*.parquet"))) == 1


# ----------------------------------------------------------------------------- disk full


# index_or_manifest: writes 1-5 are the first manifest, provenance.json, the manifest recording it,
# runs.json and the manifest recording it; 6-7 the first commit's index part and manifest; the 8th is
# the second commit's index part.
@pytest.mark.parametrize("where,fail_at", [("index_or_manifest", 8), ("chunk", 40)])
def test_disk_full_keeps_the_committed_part_and_resumes_identically(
    tmp_path, small_cache, monkeypatch, where, fail_at
):
    import zarr.storage._local as zarr_local

    out = tmp_path / "c"
    if where == "chunk":  # zarr's own file writes (chunks and array metadata)
        monkeypatch.setattr(zarr_local, "_put", _DiskFull(zarr_local._put, fail_at))
    else:  # our temp + fsync + rename writes (index parts, manifest, provenance)
        monkeypatch.setattr(fsio, "atomic_write_bytes", _DiskFull(fsio.atomic_write_bytes, fail_at))
    with pytest.raises(StoreWriteError) as info:
        hscache.extract(small_cache.config_for(out))
    message = str(info.value)
    assert (
        "\n" not in message and "No space left on device" in message and "re-run the same command" in message
    )
    monkeypatch.undo()
    committed = _committed(out)
    assert 0 < committed < 12, committed
    _assert_prefix_of(hscache.open_cache(out), hscache.open_cache(small_cache.path))
    assert f"the {committed} sequences committed before are intact" in message
    result = hscache.extract(small_cache.config_for(out))
    assert result.resumed_from == committed
    _assert_identical(out, small_cache.path)


def test_disk_full_while_staging_target_dir_restarts_cleanly(tmp_path, small_cache, monkeypatch):
    out = tmp_path / "c"
    monkeypatch.setattr(fsio, "fsync_file", _DiskFull(fsio.fsync_file, 1))  # first fsync: target/ staging
    with pytest.raises(StoreWriteError, match="No space left on device"):
        hscache.extract(small_cache.config_for(out))
    monkeypatch.undo()
    assert not (out / "manifest.json").exists() and any(out.iterdir())  # killed before its first manifest
    hscache.extract(small_cache.config_for(out))
    _assert_identical(out, small_cache.path)


def test_disk_full_on_the_final_run_log_write_leaves_a_complete_cache(tmp_path, small_cache, monkeypatch):
    """The run log is written last, after the cache is complete: a failure there is said in one line,
    the cache is whole (the digest of an uninterrupted run) and its run log says the run never
    finished; a re-run has nothing to add and writes nothing."""
    out = tmp_path / "c"
    disk_full = _DiskFull(StoreWriter.write_run_log, 2)
    monkeypatch.setattr(StoreWriter, "write_run_log", lambda writer, data: disk_full(writer, data))
    with pytest.raises(StoreWriteError, match="the 12 sequences committed before are intact"):
        hscache.extract(small_cache.config_for(out))
    monkeypatch.undo()
    assert [run["finished_at"] for run in read_run_log(out)] == [None]
    _assert_identical(out, small_cache.path)
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    assert hscache.extract(small_cache.config_for(out)).unchanged
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before


def test_cli_disk_full_prints_one_error_line_and_exits_2(tmp_path, small_cache, monkeypatch):
    out = tmp_path / "c"
    monkeypatch.setattr(fsio, "atomic_write_bytes", _DiskFull(fsio.atomic_write_bytes, 4))
    result = CliRunner().invoke(main, small_cache.cli_args(out))
    lines = result.output.strip().splitlines()
    assert result.exit_code == 2 and len(lines) == 1, result.output
    assert lines[0].startswith("error: writing to ") and "No space left on device" in lines[0]
    assert "re-run the same command to resume" in lines[0]


def test_writer_memory_is_bounded_by_the_chunk_not_the_commit_interval(tmp_path):
    specs = array_specs(2, 8, "float32", 4, None, chunk_bytes=1)  # 256-token chunks
    writer = StoreWriter.create(tmp_path / "c", specs, "none", {"layer_ids": [0, 1]})
    for n in range(40):  # 40 x 100 tokens, never committed
        arrays = {name: np.zeros((100, *spec.row_shape), spec.stored_dtype) for name, spec in specs.items()}
        writer.append(SequenceRows(arrays, str(n), 1, "none", "0" * 64, "{}"))
        assert all(a.buffered < a.chunk for a in writer.appenders.values())
    assert len(hscache.open_cache(tmp_path / "c")) == 0  # written chunks are invisible until a commit
    writer.commit()
    assert len(hscache.open_cache(tmp_path / "c")) == 40


def test_overwrite_never_deletes_a_directory_that_is_not_a_cache(tmp_path, small_cache):
    out = tmp_path / "c"
    out.mkdir()
    (out / "precious.txt").write_text("keep me")
    with pytest.raises(hscache.InputError, match="--overwrite deletes only hscache caches"):
        hscache.extract(small_cache.config_for(out, overwrite=True))
    assert (out / "precious.txt").read_text() == "keep me"


# ----------------------------------------------------------------------------- Ctrl-C, leftovers


def test_ctrl_c_commits_finished_batches_then_resumes_identically(tmp_path, small_cache, monkeypatch):
    extract_module = sys.modules[
        "hscache.capture.extract"
    ]  # the name hscache.capture.extract is the function
    out = tmp_path / "c"
    calls = {"n": 0}
    original = extract_module.capture_batch

    def interrupted(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 6:
            raise KeyboardInterrupt
        return original(*args, **kwargs)

    monkeypatch.setattr(extract_module, "capture_batch", interrupted)
    with pytest.raises(KeyboardInterrupt):
        hscache.extract(small_cache.config_for(out, commit_every_s=3600.0))  # no periodic commit
    monkeypatch.undo()
    assert _committed(out) == 5  # the 5 captured batches were committed on the way out
    hscache.extract(small_cache.config_for(out))
    _assert_identical(out, small_cache.path)


def test_resume_removes_leftovers_of_a_killed_run(tmp_path, small_cache):
    out = small_cache.copy(tmp_path / "c")
    manifest = json.loads((out / "manifest.json").read_text())
    manifest["complete"] = False
    integrity.seal(manifest)  # as a killed run's manifest would be
    (out / "manifest.json").write_text(json.dumps(manifest))
    junk = [
        out / "arrays" / "hidden_states" / "c" / "0" / "0" / "0.abc.partial",
        out / f"manifest.json{fsio.TEMP_MARK}dead",
        out / "index" / "part-000099.parquet",
        out / f"target{fsio.TEMP_MARK}staging" / "config.json",
        out / ".hscache-creating",
    ]
    for path in junk:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"junk")
    assert len(hscache.open_cache(out)) == 12  # readers ignore all of it
    hscache.extract(small_cache.config_for(out))
    assert not any(p.exists() for p in junk)
    assert not (out / f"target{fsio.TEMP_MARK}staging").exists()
    _assert_identical(out, small_cache.path)


# ----------------------------------------------------------------------------- mismatched resume


@pytest.mark.parametrize(
    "change,named",
    [
        ({"layers": "1,3"}, "built with --layers 1,3,5 but this run has --layers 1,3"),
        ({"dtype": "bf16"}, "--dtype fp32 but this run has --dtype bf16"),
        ({"prompts": "OTHER"}, "built with --prompts content sha256 "),
        ({"limit": 6}, "--limit 12 but this run has --limit 6"),
        ({"max_new_tokens": 4}, "--max-new-tokens 8 but this run has --max-new-tokens 4"),
    ],
)
def test_mismatched_resume_is_refused_naming_the_difference(tmp_path, small_cache, change, named):
    out = small_cache.copy(tmp_path / "c")
    if change.get("prompts") == "OTHER":
        change = {
            "prompts": str(write_jsonl(tmp_path / "p.jsonl", [{"id": "x", "prompt": "other"}])),
            "limit": None,
        }
    before = (out / "manifest.json").read_bytes()
    with pytest.raises(ResumeMismatchError) as info:
        hscache.extract(small_cache.config_for(out, **change))
    message = str(info.value)
    assert named in message and "--overwrite" in message and "\n" not in message
    assert (out / "manifest.json").read_bytes() == before  # nothing touched


# ----------------------------------------------------------------------------- SIGTERM (pre-emption)


@pytest.mark.slow
def test_sigterm_commits_captured_batches_then_resumes_identically(tmp_path, small_cache, cli_server):
    """A pre-empted node gets SIGTERM first: the batches captured so far must be committed."""
    out = tmp_path / "c"
    args = small_cache.cli_args(out)
    args[args.index("--commit-every-s") + 1] = "1000"  # nothing would be committed before the end
    proc = cli_server.start(args)
    chunks = out / "arrays" / "hidden_states" / "c"
    deadline = time.monotonic() + 120
    while proc.poll() is None and time.monotonic() < deadline and not any(chunks.rglob("*")):
        time.sleep(0.01)  # a full chunk on disk: several batches were captured
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=120)
    if proc.returncode == 0:
        pytest.skip("the extraction finished before SIGTERM arrived")
    assert proc.returncode == 130, stderr
    assert "interrupted: committed sequences are kept; re-run the same command to resume" in stderr
    assert _committed(out) >= 1
    _assert_prefix_of(hscache.open_cache(out), hscache.open_cache(small_cache.path))
    hscache.extract(small_cache.config_for(out))  # the same settings resume
    _assert_identical(out, small_cache.path)
