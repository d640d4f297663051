"""Issue 52, faults and hostile input round six: the store's and the importers' side.

Each test failed before its fix. The caches are the session fixtures (tests/hscache/conftest.py,
tests/conftest.py), copied where a test edits them; CLI runs are in-process (CliRunner).
"""

from __future__ import annotations

import json
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


def _lines(result) -> list[str]:
    return [line for line in result.output.splitlines() if line.strip()]


def _one_line_refusal(result, code: int = 2) -> bool:
    lines = _lines(result)
    return (
        result.exit_code == code
        and "Traceback" not in result.output
        and len(lines) == 1
        and lines[0].startswith("error: ")
    )


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
    assert _one_line_refusal(result) and "does not match its sha256" in result.output, result.output
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
