"""Issue 52, faults and hostile input round six: the store's and the importers' side.

Each test failed before its fix. The caches are the session fixtures (tests/hscache/conftest.py,
tests/conftest.py), copied where a test edits them; CLI runs are in-process (CliRunner).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zarr
from click.testing import CliRunner

import hscache
from hscache.cli import main as hscache_main
from hscache.errors import CacheFormatError
from hscache.store import integrity
from hscache.store.index import parquet_bytes
from tests.cli_result import one_line_refusal, output_lines


def _same_size_part(part: Path, change) -> None:
    """Rewrite index part ``part`` with ``change(table)``, padded through its footer metadata to the
    very size it had: a forged part that only a hash tells from the original."""
    size, table = part.stat().st_size, change(pq.read_table(part))
    for pad in range(0, 4096):
        forged = parquet_bytes(table.replace_schema_metadata({"p": "x" * pad} if pad else None))
        if len(forged) >= size:
            break
    assert len(forged) == size, (len(forged), size)
    part.write_bytes(forged)


# 1. An index part over 16 MiB (here: over a lowered bound) is hashed before it is parsed.
def test_an_index_part_over_the_small_file_bound_is_hashed_before_it_is_parsed(
    small_cache, tmp_path, monkeypatch
):
    root = small_cache.copy(tmp_path / "cache")
    clean = hscache.open_cache(root)
    prompt = clean.index.column("prompt_len").to_pylist()
    monkeypatch.setattr(integrity, "SMALL_FILE_BYTES", 64)  # every part is "big": size-checked at open

    def change(table: pa.Table) -> pa.Table:
        i = table.column_names.index("prompt_len")
        edited = pa.array([prompt[0] - 1, *prompt[1:]], table.schema.field(i).type)
        return table.set_column(i, "prompt_len", edited)

    _same_size_part(root / clean.manifest["index_parts"][0], change)
    with pytest.raises(CacheFormatError, match="does not match its sha256"):
        hscache.open_cache(root)


# 2. An array's zarr.json swapped after open: zarr decodes with the metadata that was hashed.
def test_an_array_metadata_swapped_after_open_is_not_what_the_rows_are_decoded_with(small_cache, tmp_path):
    root = small_cache.copy(tmp_path / "cache")
    clean = hscache.open_cache(root).target_argmax(0)
    cache = hscache.open_cache(root)
    meta_path = root / "arrays" / "target_argmax" / "zarr.json"
    meta = json.loads(meta_path.read_text())
    meta["data_type"] = "float32"
    meta_path.write_text(json.dumps(meta))
    assert cache.target_argmax(0).tolist() == clean.tolist()
    assert cache.array("target_argmax").dtype == np.dtype(cache.specs["target_argmax"].stored_dtype)


def _rewrite_rows(array_dir: Path, rows: int = 4) -> None:
    """Zero the first ``rows`` rows of the array at ``array_dir`` through zarr: valid crc32c, other
    values, the manifest's chunk hashes left as they were."""
    array = zarr.open_array(str(array_dir), mode="r+")
    array[:rows] = np.zeros_like(np.asarray(array[:rows]))


# 3. `hscache merge --into` checks each chunk's sha256 before it copies (and reseals) the rows.
def test_merge_into_refuses_a_shard_rewritten_with_a_valid_crc32c(small_cache, tmp_path):
    from tests.hscache.test_cache_contract import split_into_shards

    sharded = split_into_shards(hscache.open_cache(small_cache.path), tmp_path / "sharded", 2)
    shard = sorted(p for p in sharded.iterdir() if p.is_dir())[0]
    _rewrite_rows(shard / "arrays" / "target_argmax")
    result = CliRunner().invoke(hscache_main, ["merge", str(sharded), "--into", str(tmp_path / "merged")])
    assert one_line_refusal(result) and "does not match its sha256" in result.output, result.output
    assert not (tmp_path / "merged" / "manifest.json").exists()


# 4. hscache.data.open_xarray reads through the checked reader: rows that fail their sha256 are refused.
def test_the_xarray_view_refuses_rows_whose_sha256_does_not_match(small_cache, tmp_path):
    from hscache.data import open_xarray

    root = small_cache.copy(tmp_path / "cache")
    clean = open_xarray(root)["target_argmax"].values
    assert (
        clean.tolist()
        == np.concatenate([hscache.open_cache(root).target_argmax(i).numpy() for i in range(12)]).tolist()
    )
    array = zarr.open_array(str(root / "arrays" / "target_argmax"), mode="r+")
    array[5] = int(array[5]) + 1  # valid crc32c, the manifest's chunk hash left as it was
    with pytest.raises(CacheFormatError, match="does not match its sha256"):
        open_xarray(root)["target_argmax"].load()


class _FifoWatchdog:
    """Open the FIFOs' write ends after ``seconds`` if the code under test is still waiting on them,
    so a regression fails the test instead of hanging the suite (a blocked open or read returns)."""

    def __init__(self, fifos: list[Path], seconds: float = 20.0):
        import threading

        self.fired = False
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(fifos, seconds), daemon=True)

    def _run(self, fifos: list[Path], seconds: float) -> None:
        if self._done.wait(seconds):
            return
        self.fired = True
        for fifo in fifos:
            try:
                os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
            except OSError:
                pass

    def __enter__(self) -> _FifoWatchdog:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._done.set()
        self._thread.join()


def _connector_file(path: Path, header_edit=None) -> Path:
    """A vLLM connector file (4 positions, 2 layers, 8 wide), its header changed by ``header_edit``."""
    import torch
    from safetensors.torch import save_file

    save_file({"hidden_states": torch.randn(4, 2, 8), "token_ids": torch.arange(4)}, str(path))
    if header_edit is not None:
        data = path.read_bytes()
        n = int.from_bytes(data[:8], "little")
        header = json.loads(data[8 : 8 + n])
        header_edit(header)
        text = json.dumps(header).encode()
        path.write_bytes(len(text).to_bytes(8, "little") + text + data[8 + n :])
    return path


def _entry(name: str, value):
    return lambda header: header.__setitem__(name, value)


def _offsets(value):
    return lambda header: header["token_ids"].__setitem__("data_offsets", value)


# 10 and 16: `hscache import --format vllm`: a FIFO never waited on; hostile headers, one line each.
@pytest.mark.parametrize(
    "case, message",
    [
        ("fifo", "a FIFO, not a regular file"),
        ("directory", "a directory, not a regular file"),
        ("number entry", "tensor token_ids has an inconsistent header entry"),
        ("empty offsets", "tensor token_ids has an inconsistent header entry"),
        ("string offsets", "tensor token_ids has an inconsistent header entry"),
    ],
)
def test_hostile_vllm_connector_files_are_one_line_each(tmp_path, case, message):
    source = tmp_path / "files"
    source.mkdir()
    _connector_file(source / "0-ab12.safetensors")
    bad = source / "1-ab12.safetensors"
    if case == "fifo":
        os.mkfifo(bad)
    elif case == "directory":
        bad.mkdir()
    else:
        edit = {
            "number entry": _entry("token_ids", 5),
            "empty offsets": _offsets([]),
            "string offsets": _offsets("ab"),
        }
        _connector_file(bad, edit[case])
    args = ["import", "--format", "vllm", str(source), "--out", str(tmp_path / "out"), "--layer-ids", "2,4"]
    with _FifoWatchdog([bad] if case == "fifo" else []) as watchdog:
        result = CliRunner().invoke(hscache_main, args)
    assert not watchdog.fired, "the import waited on a FIFO"
    assert one_line_refusal(result) and message in result.output, result.output
    assert not (tmp_path / "out" / "manifest.json").exists()


def _model_dir(root: Path, text: str) -> Path:
    root.mkdir()
    (root / "config.json").write_text(text)
    return root


DEEP = "[" * 100_000 + "]" * 100_000


# 16: a target/model config.json that is not a model config: one line from import --target and extract --model.
@pytest.mark.parametrize(
    "text, message",
    [
        ('{"num_hidden_layers": 8, "hidden_size": 8}', "vocab_size is missing, not a positive integer"),
        ('{"vocab_size": "512", "num_hidden_layers": 8, "hidden_size": 8}', 'vocab_size is "512"'),
        (DEEP, "is not valid JSON (nested too deeply"),
        ("[1, 2]", "holds a JSON list, not an object"),
        ("{bad", "is not valid JSON"),
    ],
)
def test_a_model_config_that_is_not_one_is_refused_in_one_line(tmp_path, text, message):
    model = _model_dir(tmp_path / "model", text)
    source = tmp_path / "files"
    source.mkdir()
    _connector_file(source / "0-ab12.safetensors")
    imported = CliRunner().invoke(
        hscache_main,
        ["import", "--format", "vllm", str(source), "--out", str(tmp_path / "out"), "--layer-ids", "2,4"]
        + ["--target", str(model)],
    )
    assert one_line_refusal(imported) and message in imported.output, imported.output
    if "vocab_size" not in message:  # extract reads the config only to load it (transformers checks fields)
        extracted = CliRunner().invoke(
            hscache_main, ["extract", "--model", str(model), "--out", str(tmp_path / "x")]
        )
        assert one_line_refusal(extracted) and message in extracted.output, extracted.output


# 15 and 16: flags that must be refused before any work, in one short line.
@pytest.mark.parametrize(
    "args, message",
    [
        (["extract", "--layers", "dflash:30000000"], "too small for 30000000 DFlash features"),
        (["extract", "--layers", "dflash:" + "9" * 5000], "expected dflash:N with N a positive integer"),
        (["extract", "--chunk-mb", "nan"], "'nan' is not a finite number"),
        (["extract", "--memory-gb", "nan"], "'nan' is not a finite number"),
        (
            ["diff", "a", "b", "--position-buckets", "0,99999999999999999999"],
            "past the longest possible sequence",
        ),
    ],
)
def test_absurd_flags_are_refused_before_any_work(tmp_path, args, message):
    if args[0] == "extract":
        args = [*args, "--out", str(tmp_path / "out"), "--limit", "1", "--max-new-tokens", "1"]
    result = CliRunner().invoke(hscache_main, args)
    assert result.exit_code == 2 and "Traceback" not in result.output, result.output
    errors = [line for line in output_lines(result) if line.lower().startswith("error")]
    assert len(errors) == 1 and message in errors[0] and len(errors[0]) < 400, result.output
    assert not (tmp_path / "out" / "manifest.json").exists()


# 11. `hscache import --format speculators`: an Arrow stream's inflated size is bounded before it is read.
def test_a_speculators_arrow_stream_that_inflates_past_the_bound_is_refused_before_reading(tmp_path):
    import pyarrow.ipc as ipc

    source = tmp_path / "dataset"
    (source / "hidden_states").mkdir(parents=True)
    (source / "state.json").write_text(
        json.dumps({"_data_files": [{"filename": "data-00000-of-00001.arrow"}]})
    )
    zeros = pa.array(np.zeros(5 << 20, dtype=np.int64))  # 2 x 40 MiB of zeros: a few KB of zstd
    column = pa.ListArray.from_arrays(pa.array([0, len(zeros)], pa.int32()), zeros)
    table = pa.table({"input_ids": column, "loss_mask": column})
    options = ipc.IpcWriteOptions(compression="zstd")
    with pa.OSFile(str(source / "data-00000-of-00001.arrow"), "wb") as sink:
        with ipc.new_stream(sink, table.schema, options=options) as writer:
            writer.write_table(table)
    del zeros, column, table
    assert (source / "data-00000-of-00001.arrow").stat().st_size < 1 << 20
    out = tmp_path / "out"
    result = CliRunner().invoke(
        hscache_main,
        ["import", "--format", "speculators", str(source), "--out", str(out), "--layer-ids", "2,4"],
    )
    assert one_line_refusal(result) and "a decompression bomb" in result.output, result.output
    assert not (out / "manifest.json").exists()
