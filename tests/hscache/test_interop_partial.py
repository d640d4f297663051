"""Partial exports and imports never look complete (issue 18, items 6, 8, 9), and SpecForge's
in-memory feature-store dumps import (issue 20, item 9)."""

from __future__ import annotations

import errno
import shutil

import pytest
import torch
from click.testing import CliRunner

import hscache
from hscache.cli import main as hscache_main
from hscache.errors import InputError, StoreWriteError
from hscache.interop import common
from hscache.interop.specforge import export_specforge, import_specforge
from hscache.store.writer import StoreWriter


class Killed(BaseException):
    """A kill -9 stand-in: nothing after it runs (no cleanup handler catches a BaseException)."""


def _fail_after(monkeypatch, n: int, exc: BaseException) -> None:
    """The (n+1)-th exported file raises ``exc`` instead of being written."""
    calls = {"n": 0}
    original = common.publish_file

    def publish(path, write):
        calls["n"] += 1
        if calls["n"] > n:
            raise exc
        original(path, write)

    monkeypatch.setattr(common, "publish_file", publish)
    import hscache.interop.specforge as specforge

    monkeypatch.setattr(specforge, "publish_file", publish)


def test_a_killed_export_is_refused_by_import_naming_the_missing_files(bf16_cache, tmp_path, monkeypatch):
    out = tmp_path / "export"
    _fail_after(monkeypatch, 2, Killed())
    with pytest.raises(Killed):
        export_specforge(bf16_cache, out, layer_ids=[1, 3])
    monkeypatch.undo()
    assert len(list(out.rglob("data_*.ckpt"))) == 2  # what the kill left: 2 of 4 files, no sidecar
    result = CliRunner().invoke(
        hscache_main,
        ["import", str(out), "--format", "specforge", "--out", str(tmp_path / "c"), "--layer-ids", "1,3"],
    )
    assert result.exit_code == 2 and result.output.startswith("error: "), result.output
    assert (
        "did not finish (2 files missing: rows_0-2000/data_2.ckpt, rows_0-2000/data_3.ckpt)" in result.output
    )
    assert "Traceback" not in result.output and not (tmp_path / "c" / "manifest.json").exists()


def test_an_export_missing_a_file_its_sidecar_lists_is_refused(bf16_cache, tmp_path):
    out = tmp_path / "export"
    export_specforge(bf16_cache, out, layer_ids=[1, 3])
    assert not (out / common.EXPORT_MARK).exists()
    (out / "rows_0-2000" / "data_1.ckpt").unlink()
    with pytest.raises(InputError, match=r"1 files missing: rows_0-2000/data_1.ckpt"):
        import_specforge(out, tmp_path / "c")


def test_disk_full_during_export_is_one_line_and_leaves_nothing(bf16_cache, tmp_path, monkeypatch):
    out = tmp_path / "export"
    _fail_after(monkeypatch, 1, OSError(errno.ENOSPC, "No space left on device"))
    result = CliRunner().invoke(
        hscache_main,
        ["export", str(bf16_cache), "--format", "specforge", "--out", str(out), "--layers", "1,3"],
    )
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert (
        len(lines) == 1 and "No space left on device" in lines[0] and "partial export was deleted" in lines[0]
    )
    assert not out.exists() or [p.name for p in out.iterdir()] in ([], [".hscache-writer.lock"])


def _only_the_users_file_is_left(out) -> None:
    assert sorted(p.name for p in out.iterdir() if p.name != ".hscache-writer.lock") == ["notes.txt"]
    assert (out / "notes.txt").read_text() == "mine"


@pytest.mark.parametrize("fmt", ["specforge", "speculators"])
def test_a_failed_export_deletes_only_what_it_wrote(bf16_cache, tmp_path, monkeypatch, fmt):
    """A file the user put into --out while the export ran is kept; the export's own files go."""
    import hscache.interop.speculators as speculators

    out = tmp_path / "export"
    calls = {"n": 0}
    original = common.publish_file

    def publish(path, write):
        calls["n"] += 1
        if calls["n"] == 2:
            (out / "notes.txt").write_text("mine")  # written by the user during the run
            raise OSError(errno.ENOSPC, "No space left on device")
        original(path, write)

    import hscache.interop.specforge as specforge

    for module in (common, specforge, speculators):
        monkeypatch.setattr(module, "publish_file", publish)
    with pytest.raises(StoreWriteError, match="partial export was deleted"):
        if fmt == "specforge":
            export_specforge(bf16_cache, out, layer_ids=[1, 3])
        else:
            speculators.export_speculators(bf16_cache, out)
    assert calls["n"] == 2  # one file was written before the failure: there was something to delete
    _only_the_users_file_is_left(out)


def test_a_failed_import_deletes_only_what_it_wrote(bf16_cache, tmp_path, monkeypatch):
    source = tmp_path / "export"
    export_specforge(bf16_cache, source, layer_ids=[1, 3])
    out = tmp_path / "c"

    def finish(self):
        assert (out / "arrays").is_dir()  # the import wrote its arrays: there is something to delete
        (out / "notes.txt").write_text("mine")  # written by the user during the run
        raise StoreWriteError(f"writing to {out} failed (No space left on device); the 0 sequences ...")

    monkeypatch.setattr(StoreWriter, "finish", finish)
    with pytest.raises(StoreWriteError, match="partial cache was deleted"):
        import_specforge(source, out)
    _only_the_users_file_is_left(out)


def test_a_killed_import_is_started_over_by_the_same_command(bf16_cache, tmp_path, monkeypatch):
    source = tmp_path / "export"
    export_specforge(bf16_cache, source, layer_ids=[1, 3])
    out = tmp_path / "c"
    original = StoreWriter.append
    seen = {"n": 0}

    def append(self, rows):
        seen["n"] += 1
        if seen["n"] == 3:
            self.commit()  # a commit happened, then the kill
            raise Killed()
        original(self, rows)

    monkeypatch.setattr(StoreWriter, "append", append)
    with pytest.raises(Killed):
        import_specforge(source, out)
    monkeypatch.undo()
    assert (out / common.IMPORTING_MARK).is_file() and len(hscache.open_cache(out)) == 2
    info = CliRunner().invoke(hscache_main, ["info", str(out)])
    assert "re-run the same hscache import command" in info.output, info.output
    assert import_specforge(source, out) == (4, sum(hscache.open_cache(bf16_cache).lengths.tolist()))
    assert not (out / common.IMPORTING_MARK).exists()
    assert CliRunner().invoke(hscache_main, ["verify", str(out)]).exit_code == 0


def test_disk_full_during_import_is_one_line_and_leaves_nothing(bf16_cache, tmp_path, monkeypatch):
    source = tmp_path / "export"
    export_specforge(bf16_cache, source, layer_ids=[1, 3])
    out = tmp_path / "c"

    def commit(self):
        raise StoreWriteError(f"writing to {out} failed (No space left on device); the 0 sequences ...")

    monkeypatch.setattr(StoreWriter, "finish", commit)
    result = CliRunner().invoke(
        hscache_main, ["import", str(source), "--format", "specforge", "--out", str(out)]
    )
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and "No space left on device" in lines[0], result.output
    assert "partial cache was deleted" in lines[0] and "re-run the same `hscache import` command" in lines[0]
    assert not out.exists() or [p.name for p in out.iterdir()] in ([], [".hscache-writer.lock"])


def test_specforge_feature_store_dumps_import(bf16_cache, tmp_path):
    """``feature_store.py`` ``_dump``: ``{dump_dir}/{sample_id}.ckpt`` of the tensors put, which
    SpecForge's OfflineManifestReader reads back (any *.ckpt, absolute paths sorted)."""
    cache = hscache.open_cache(bf16_cache)
    dumps = tmp_path / "dumps"
    dumps.mkdir()
    ids = []
    for i in range(len(cache)):
        hidden = cache.hidden_states(i)[:, :2]  # layers 1, 3
        sample_id = f"run-7:{i:08d}"
        ids.append(sample_id)
        tensors = {
            "input_ids": cache.token_ids(i).unsqueeze(0),  # [1, T]: the store keeps what was put
            "loss_mask": torch.ones(len(hidden), dtype=torch.int64),
            "hidden_states": hidden.reshape(len(hidden), -1).unsqueeze(0),
        }
        torch.save(tensors, dumps / f"{sample_id}.ckpt")
    (dumps / "run-7:00000009.ckpt.tmp").write_bytes(b"a dump being written")  # never read
    count, _tokens = import_specforge(dumps, tmp_path / "c", layer_ids=[1, 3])
    imported = hscache.open_cache(tmp_path / "c")
    assert count == len(cache) and imported.index.column("record_id").to_pylist() == ids
    for i in range(len(cache)):
        assert torch.equal(imported.hidden_states(i), cache.hidden_states(i)[:, :2])  # bit-exact copy
        assert torch.equal(imported.token_ids(i), cache.token_ids(i))
    shutil.rmtree(tmp_path / "c")
