"""Issue 52 items 5-8 and 14: nothing hscache writes follows a link or waits on a FIFO, and a directory
is emptied only when it is proven to be hscache's (a manifest that parses as one; a creation mark
that records what its run creates)."""

from __future__ import annotations

import contextlib
import os
import signal
from pathlib import Path

import pytest

from hscache.errors import InputError
from hscache.store.layout import WRITER_LOCK
from hscache.store.lock import check_no_writer, current_writer, writer_lock


@contextlib.contextmanager
def _no_hang(seconds: int = 5):
    """Fail (instead of hanging the suite) when the block blocks, e.g. on a FIFO's open."""

    def timeout(_signum, _frame):
        raise AssertionError(f"blocked for {seconds} s")

    previous = signal.signal(signal.SIGALRM, timeout)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def test_a_symlinked_writer_lock_is_refused_and_its_target_untouched(tmp_path):
    outside = tmp_path / "precious.txt"
    outside.write_text("keep me")
    root = tmp_path / "cache"
    root.mkdir()
    (root / WRITER_LOCK).symlink_to(outside)
    with pytest.raises(InputError) as refused, writer_lock(root, "hscache extract"):
        pass
    assert "symbolic link" in str(refused.value) and "\n" not in str(refused.value)
    with pytest.raises(InputError, match="symbolic link"):
        check_no_writer(root)  # extract's preflight: before the model loads
    assert outside.read_text() == "keep me"
    assert current_writer(root) is None


def test_a_fifo_writer_lock_never_blocks_a_reader_and_is_refused_to_a_writer(tmp_path):
    root = tmp_path / "cache"
    root.mkdir()
    os.mkfifo(root / WRITER_LOCK)
    with _no_hang():
        assert current_writer(root) is None
        with pytest.raises(InputError, match="is a FIFO"):
            check_no_writer(root)
        with pytest.raises(InputError, match="is a FIFO, not hscache's writer lock"), writer_lock(root, "x"):
            pass


def _webapp(root: Path) -> Path:
    (root / "src").mkdir(parents=True)
    (root / "src" / "app.js").write_text("console.log(1)")
    (root / "README.md").write_text("my app")
    (root / "manifest.json").write_text('{"name": "my app", "start_url": "/"}')
    return root


def _files(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_overwrite_refuses_a_folder_whose_manifest_is_not_an_hscache_manifest(tmp_path):
    from click.testing import CliRunner

    from hscache.cli import main as hscache_main
    from hscache.store.cache_dir import clear_for_overwrite

    webapp = _webapp(tmp_path / "webapp")
    before = _files(webapp)
    with pytest.raises(InputError, match='not an hscache manifest \\(no "format": "hscache"\\)'):
        clear_for_overwrite(webapp)
    result = CliRunner().invoke(
        hscache_main, ["extract", "--out", str(webapp), "--overwrite", "--limit", "1"]
    )
    assert result.exit_code != 0 and "not an hscache manifest" in result.output, result.output
    assert _files(webapp) == before


def test_a_killed_fresh_run_is_started_over_deleting_only_what_its_mark_records(tmp_path):
    from hscache.store.cache_dir import prepare_fresh_dir
    from hscache.store.layout import CREATING_MARK

    out = tmp_path / "proj"
    prepare_fresh_dir(out)  # a fresh run: the mark, then the run's entries, then a kill
    first = (out / CREATING_MARK).read_bytes()
    (out / "target").mkdir()
    (out / "target" / "config.json").write_text("{}")
    (out / "data").mkdir()
    (out / "data" / "results.csv").write_text("a,b\n1,2\n")  # added after the kill: not the run's
    with pytest.raises(InputError, match="also holds data, which that run did not create"):
        prepare_fresh_dir(out)
    assert (out / "data" / "results.csv").is_file() and (out / "target" / "config.json").is_file()
    (out / "data" / "results.csv").unlink()
    (out / "data").rmdir()
    prepare_fresh_dir(out)  # only the run's own entries: started over
    assert sorted(p.name for p in out.iterdir()) == [CREATING_MARK]
    assert (out / CREATING_MARK).read_bytes() != first  # a new run's nonce


def test_a_planted_creating_mark_empties_nothing(tmp_path):
    from hscache.store.cache_dir import prepare_fresh_dir
    from hscache.store.layout import CREATING_MARK

    out = tmp_path / "proj"
    (out / "data").mkdir(parents=True)
    (out / "data" / "results.csv").write_text("a,b\n")
    (out / CREATING_MARK).write_bytes(b"")
    with pytest.raises(InputError, match="was not written by hscache"):
        prepare_fresh_dir(out)
    assert (out / "data" / "results.csv").read_text() == "a,b\n"


def test_a_planted_importing_mark_does_not_empty_an_import_output(tmp_path):
    from click.testing import CliRunner

    from hscache.cli import main as hscache_main
    from hscache.store.layout import IMPORTING_MARK

    source = tmp_path / "forge"
    source.mkdir()
    out = _webapp(tmp_path / "webapp")
    (out / IMPORTING_MARK).write_bytes(b"")
    before = _files(out)
    result = CliRunner().invoke(
        hscache_main, ["import", "--format", "specforge", str(source), "--out", str(out)]
    )
    assert result.exit_code != 0 and "was not written by hscache" in result.output, result.output
    assert _files(out) == before


def test_a_connector_dir_holding_files_no_extraction_into_this_cache_wrote_is_refused(tmp_path, monkeypatch):
    import hscache
    from hscache.capture.preflight import check_extract_request
    from hscache.engines.vllm import runtime
    from hscache.store.marks import check_connector_dir, write_connector_mark

    monkeypatch.setattr(runtime, "vllm_python", lambda *_: None)  # preflight only: no vLLM needed
    conn, out = tmp_path / "conn", tmp_path / "cache"
    conn.mkdir()
    for name in ("hs_0.safetensors", "hs_1.safetensors"):
        (conn / name).write_bytes(b"someone else's")
    config = hscache.ExtractConfig(out=str(out), engine="vllm", connector_dir=str(conn), limit=1)
    with pytest.raises(InputError, match="holds hs_0.safetensors, hs_1.safetensors, which an extraction"):
        check_extract_request(config)
    assert (conn / "hs_0.safetensors").read_bytes() == b"someone else's"
    write_connector_mark(conn, out)  # what an extraction into ``out`` writes before its engine starts
    check_connector_dir(conn, out)  # its resume may replace its own files
    with pytest.raises(InputError, match="did not write"):
        check_connector_dir(conn, tmp_path / "other")  # another cache's run may not
    (conn / "notes.txt").write_text("mine")
    with pytest.raises(InputError, match="holds notes.txt"):
        check_connector_dir(conn, out)


def test_verify_and_info_never_wait_on_a_fifo_named_like_the_writer_lock(fp32_cache, tmp_path):
    """52.6: was: `hscache verify` (always) and `info` on an incomplete cache hung in os.open."""
    import shutil

    from click.testing import CliRunner

    from hscache.cli import main as hscache_main

    cache = shutil.copytree(fp32_cache, tmp_path / "c")
    os.mkfifo(cache / WRITER_LOCK)  # the lock is not sealed: a received cache may carry anything there
    with _no_hang(20):
        for command in (["verify", str(cache)], ["info", str(cache)]):
            result = CliRunner().invoke(hscache_main, command)
            assert result.exit_code == 0, result.output


def test_export_and_import_refuse_an_out_inside_a_cache(fp32_cache, tmp_path):
    """A command writes only the paths it names: not new files inside a cache (issue 51)."""
    from click.testing import CliRunner

    from hscache.cli import main as hscache_main

    cache = tmp_path / "cache"  # a cache as far as its manifest goes: nothing reads more of it here
    cache.mkdir()
    (cache / "manifest.json").write_text('{"format": "hscache"}')
    inside = cache / "exported"
    for args in (
        ["export", str(fp32_cache), "--format", "specforge", "--layers", "1", "--out", str(inside)],
        ["import", "--format", "specforge", str(tmp_path), "--out", str(inside)],
    ):
        result = CliRunner().invoke(hscache_main, args)
        assert result.exit_code == 2 and f"is inside the cache {cache}" in result.output, result.output
    assert not inside.exists()
