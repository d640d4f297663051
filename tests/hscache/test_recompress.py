"""``hscache recompress``: every array converted in place, bit-identical decoded bytes, safe to kill
at any point and resumable, under the one-writer lock; bad input gets one line."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

import hscache
from hscache.cli import main
from hscache.errors import CacheFormatError, CacheLockedError
from hscache.store.layout import chunk_key
from hscache.store.lock import writer_lock
from hscache.store.recompress import WORK_DIR, recompress_cache
from tests.hscache.conftest import ONE_THREAD_ENV


def _decoded(root: Path) -> dict[str, bytes]:
    """Every array's committed rows as zarr decodes them (independent of hscache's reader)."""
    cache = hscache.open_cache(root)
    return {name: np.asarray(cache.array(name)[: cache.num_tokens]).tobytes() for name in cache.specs}


def _codecs(root: Path, name: str) -> list[str]:
    meta = json.loads((root / "arrays" / name / "zarr.json").read_text())
    return [c["name"] for c in meta["codecs"]]


def _assert_converted(root: Path, reference: dict[str, bytes], compression: str) -> None:
    assert _decoded(root) == reference
    blosc = compression != "none"
    for name in reference:
        assert ("blosc" in _codecs(root, name)) == blosc, name
        assert _codecs(root, name)[-1] == "crc32c"
    cache = hscache.open_cache(root)  # the manifest's seal still matches
    assert cache.manifest["compression"] == compression
    assert not (root / WORK_DIR).exists()
    from hscache.verify import verify_cache

    report = verify_cache(root)
    assert report.ok, report.problems


@pytest.fixture
def copy(small_cache, tmp_path) -> Path:
    return small_cache.copy(tmp_path / "cache")


def _chunk_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in (root / "arrays" / "hidden_states").rglob("c/*/*/*"))


def test_recompress_to_fast_and_back_keeps_every_decoded_byte(copy):
    reference = _decoded(copy)
    assert hscache.open_cache(copy).manifest["compression"] == "none"  # the default
    raw = _chunk_bytes(copy)
    chunks = len(list((copy / "arrays" / "hidden_states").rglob("c/*/*/*")))  # 3 with the shipped tokenizer
    lines: list[str] = []
    recompress_cache(copy, "fast", progress=lines.append)
    _assert_converted(copy, reference, "fast")
    assert any(line.startswith(f"hidden_states: {chunks} chunks converted to fast") for line in lines), lines
    assert _chunk_bytes(copy) < raw  # the chunks really are compressed now
    result = CliRunner().invoke(main, ["recompress", str(copy), "--compression", "none"])
    assert result.exit_code == 0, result.output
    assert "now stores every array with compression none" in result.output
    _assert_converted(copy, reference, "none")
    assert _chunk_bytes(copy) == raw
    result = CliRunner().invoke(main, ["recompress", str(copy), "--compression", "balanced"])
    assert result.exit_code == 0, result.output
    assert "now stores every array with compression balanced" in result.output
    _assert_converted(copy, reference, "balanced")


_DIE = """
import os, signal, sys
from hscache.store import recompress as r
where, after = sys.argv[2], int(sys.argv[3])
calls = [0]
original = getattr(r, where)
def dying(*args, **kwargs):
    result = original(*args, **kwargs)
    calls[0] += 1
    if calls[0] == after:
        os.kill(os.getpid(), signal.SIGKILL)  # kill -9: no cleanup, no flush
    return result
setattr(r, where, dying)
r.recompress_cache(sys.argv[1], "fast")
"""


@pytest.mark.slow
def test_kill9_mid_recompress_leaves_a_readable_cache_and_a_rerun_finishes(copy):
    reference = _decoded(copy)
    # 1: after the 5th chunk written to the work directory (mid-array: the 3rd array's first chunk);
    # 2: right after the next run's 2nd swap; each time the cache reads as before, then the CLI resumes.
    for where, after in (("_write_chunk", 5), ("_exchange", 2)):
        died = subprocess.run(
            [sys.executable, "-c", textwrap.dedent(_DIE), str(copy), where, str(after)],
            capture_output=True,
            text=True,
            env={**ONE_THREAD_ENV, "PATH": "/usr/bin:/bin", "PYTHONPATH": str(Path.cwd())},
            timeout=120,
        )
        assert died.returncode == -9, died.stderr[-2000:]
        assert (copy / WORK_DIR).is_dir()
        assert _decoded(copy) == reference  # mixed codecs between arrays, every byte as before
        assert hscache.open_cache(copy).manifest["compression"] == "none"
    converted = [n for n in reference if "blosc" in _codecs(copy, n)]
    assert 0 < len(converted) < len(reference)  # the swapped arrays stay converted, the others wait
    result = subprocess.run(
        [sys.executable, "-m", "hscache.cli", "recompress", str(copy), "--compression", "fast"],
        capture_output=True,
        text=True,
        env={**ONE_THREAD_ENV, "PATH": "/usr/bin:/bin", "PYTHONPATH": str(Path.cwd())},
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    _assert_converted(copy, reference, "fast")


def test_a_locked_cache_is_refused_and_left_alone(copy):
    before = _decoded(copy)
    with writer_lock(copy, "hscache extract"):
        with pytest.raises(CacheLockedError, match="being written by"):
            recompress_cache(copy, "fast")
        result = CliRunner().invoke(main, ["recompress", str(copy), "--compression", "fast"])
    assert result.exit_code == 2 and result.output.startswith("error: ") and result.output.count("\n") == 1
    assert _decoded(copy) == before and "blosc" not in _codecs(copy, "hidden_states")


def test_a_damaged_chunk_stops_the_conversion_naming_it_and_nothing_is_lost(copy):
    spec = hscache.open_cache(copy).specs["hidden_states"]
    path = copy / "arrays" / "hidden_states" / chunk_key(spec, 1)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(CacheFormatError, match=r"hidden_states chunk c/1/0/0 .*fails its crc32c check"):
        recompress_cache(copy, "fast")
    assert path.read_bytes() == bytes(data)  # the damaged array is not replaced
    assert "blosc" not in _codecs(copy, "hidden_states")


@pytest.mark.parametrize(
    "args, message",
    [
        (["recompress", "{missing}", "--compression", "none"], "nothing does not exist; check the path"),
        (["recompress", "{cache}", "--compression", "zstd"], "Invalid value for '--compression'"),
    ],
)
def test_bad_input_gets_one_line(copy, tmp_path, args, message):
    args = [a.format(missing=tmp_path / "nothing", cache=copy) for a in args]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 2 and message in result.output
    assert not (tmp_path / "nothing").exists()


def test_a_directory_of_shards_is_refused_by_name(small_cache, tmp_path):
    shards = tmp_path / "shards"
    shutil.copytree(small_cache.path, shards / "shard-00000-of-00001")
    result = CliRunner().invoke(main, ["recompress", str(shards), "--compression", "none"])
    assert result.exit_code == 2 and "recompress each shard directory" in result.output


def test_without_an_atomic_exchange_a_swap_cut_between_its_renames_is_finished_by_a_rerun(copy, monkeypatch):
    from hscache.store import recompress as module

    reference = _decoded(copy)
    monkeypatch.setattr(module, "_exchange", lambda a, b: False)  # e.g. a filesystem without RENAME_EXCHANGE
    real_replace = module.os.replace

    def cut(src, dst):
        if (
            Path(dst) == copy / "arrays" / "hidden_states"
        ):  # the old array is parked, the new one not moved in
            raise OSError(5, "Input/output error", str(dst))
        return real_replace(src, dst)

    monkeypatch.setattr(module.os, "replace", cut)
    with pytest.raises(hscache.StoreWriteError, match="re-run the same command to resume"):
        recompress_cache(copy, "fast")
    assert (
        not (copy / "arrays" / "hidden_states").exists() and (copy / WORK_DIR / "hidden_states.old").is_dir()
    )
    monkeypatch.setattr(module.os, "replace", real_replace)
    recompress_cache(copy, "fast")
    _assert_converted(copy, reference, "fast")
