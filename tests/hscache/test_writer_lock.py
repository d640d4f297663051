"""One writer per cache (hscache/store/lock.py): a second writer is refused at once, in one line that
names the running process; a lock left by a killed writer is taken over; a refused writer touches
nothing already committed."""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from hscache.cli import main as hscache_main
from hscache.errors import CacheLockedError, InputError
from hscache.interop.common import write_imported_cache
from hscache.store.layout import WRITER_LOCK
from hscache.store.lock import current_writer, writer_lock

_HOLD = (
    "import sys, time\n"
    "from hscache.store.lock import writer_lock\n"
    "with writer_lock(sys.argv[1], 'hscache extract (test holder)'):\n"
    "    print('locked', flush=True)\n"
    "    time.sleep(300)\n"
)


def _hold(root: Path) -> subprocess.Popen:
    """A second process that holds the writer lock of ``root`` until killed."""
    proc = subprocess.Popen(
        [sys.executable, "-c", _HOLD, str(root)], stdout=subprocess.PIPE, text=True, cwd=os.getcwd()
    )
    assert proc.stdout.readline().strip() == "locked"
    return proc


def _tree_digest(root: Path) -> dict[str, str]:
    return {
        p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def test_second_writer_is_refused_naming_the_holder_and_a_killed_holders_lock_is_taken_over(tmp_path):
    root = tmp_path / "cache"
    holder = _hold(root)
    try:
        info = current_writer(root)
        assert info["pid"] == holder.pid and info["command"] == "hscache extract (test holder)"
        with pytest.raises(CacheLockedError) as refused, writer_lock(root, "second"):
            pass
        message = str(refused.value)
        assert f"pid {holder.pid}" in message and "one writer per cache" in message and "\n" not in message
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    # kill -9 leaves the file behind, but no live lock: nobody is writing, and the next writer proceeds.
    assert (root / WRITER_LOCK).is_file() and current_writer(root) is None
    with writer_lock(root, "after the kill"):
        assert current_writer(root)["pid"] == os.getpid()
    assert not (root / WRITER_LOCK).exists() and current_writer(root) is None


def test_a_refused_writer_that_created_the_directory_leaves_nothing_and_a_file_is_not_a_cache(tmp_path):
    with writer_lock(tmp_path / "new", "first"):
        pass
    assert not (tmp_path / "new").exists()
    (tmp_path / "file").write_text("x")
    with pytest.raises(InputError, match="is a file, not a directory"), writer_lock(tmp_path / "file", "w"):
        pass


def test_a_writer_removes_the_parents_it_made_while_they_stay_empty(tmp_path):
    root = tmp_path / "a" / "b" / "cache"
    with writer_lock(root, "wrote nothing"):
        assert root.is_dir()
    assert list(tmp_path.iterdir()) == []
    with writer_lock(root, "wrote a file"):
        (root / "data").write_text("x")
    assert (root / "data").is_file() and not (root / WRITER_LOCK).exists()


def test_a_finished_extract_leaves_no_lock(small_cache):
    assert not (small_cache.path / WRITER_LOCK).exists() and current_writer(small_cache.path) is None


@pytest.mark.parametrize("extra", [[], ["--overwrite"]], ids=["resume", "overwrite"])
def test_extract_into_a_locked_cache_is_refused_and_touches_nothing(small_cache, tmp_path, extra):
    cache = small_cache.copy(tmp_path / "cache")
    before = _tree_digest(cache)
    holder = _hold(cache)
    try:
        result = CliRunner().invoke(hscache_main, [*small_cache.cli_args(cache), *extra])
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and f"pid {holder.pid}" in lines[0], lines
    after = _tree_digest(cache)
    after.pop(WRITER_LOCK, None)  # the killed holder's file; its content is no part of the cache
    assert after == before


def test_import_into_a_locked_directory_is_refused_before_reading_anything(tmp_path):
    out = tmp_path / "imported"
    holder = _hold(out)

    def sequences():
        raise AssertionError("a refused import must not read its source")
        yield

    try:
        with pytest.raises(CacheLockedError, match=f"pid {holder.pid}"):
            write_imported_cache(out, sequences(), layer_ids=[1], imported={"format": "test"})
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
