"""Sharded extraction: N shards on a dask cluster read back as one cache, bit-identical to one run."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner

import hscache
from hscache.cli import main
from hscache.store.integrity import content_sha256
from hscache.store.row_ranges import read_rows
from hscache.store.shards import ShardedCache, merge_shards, parse_shard
from pipelines.sharded_extract import sharded_extract

CONFIG = {"layers": "1,3,7", "max_new_tokens": 6, "dtype": "fp32", "limit": 5}  # 5 prompts: shards of 3 and 2
_COLUMNS = (
    "seq_id",
    "record_id",
    "offset",
    "length",
    "prompt_len",
    "stop_reason",
    "token_sha256",
    "metadata_json",
)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 1-shard extraction on one torch thread, like the single-threaded dask workers."""
    out = tmp_path_factory.mktemp("shards") / "one"
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        hscache.extract(hscache.ExtractConfig(out=str(out), **CONFIG))
    finally:
        torch.set_num_threads(before)
    return out


@pytest.fixture(scope="module")
def sharded(dask_client, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("shards") / "two"
    results = sharded_extract(hscache.ExtractConfig(out=str(out), **CONFIG), 2, dask_client)
    assert [r.sequences for r in results] == [3, 2]
    return out


def _assert_same(a, b) -> None:
    assert len(a) == len(b) and a.num_tokens == b.num_tokens
    for name in _COLUMNS:
        assert a.index.column(name).to_pylist() == b.index.column(name).to_pylist(), name
    for i in range(len(a)):
        for read in ("hidden_states", "token_ids", "target_argmax", "target_logsumexp"):
            assert torch.equal(getattr(a, read)(i), getattr(b, read)(i)), (read, i)
        assert all(torch.equal(x, y) for x, y in zip(a.target_topk(i), b.target_topk(i)))


def test_two_shards_read_back_identical_to_one(reference, sharded):
    one, view = hscache.open_cache(reference), hscache.open_cache(sharded)
    assert isinstance(view, ShardedCache) and view.complete
    assert sorted(p.name for p in sharded.iterdir()) == [
        "shard-00000-of-00002",
        "shard-00001-of-00002",
        "shards.json",
    ]
    _assert_same(one, view)
    assert view.settings == one.settings and view.layer_ids == [1, 3, 7]
    # shards of 3 and 2 records chunk as the one run of 5 does (the bound counts every shard's records)
    assert [s.specs for s in view.shards] == [one.specs, one.specs]
    assert [p["capture"]["layer_ids"] for p in view.provenance["shards"]] == [[1, 3, 7]] * 2
    block, ref = read_rows(view, range(1, 5)), read_rows(one, range(1, 5))
    assert all(torch.equal(block.get("hidden_states", r), ref.get("hidden_states", r)) for r in range(1, 5))


def test_merge_writes_one_identical_cache(reference, sharded, tmp_path):
    result = CliRunner().invoke(main, ["merge", str(sharded), "--into", str(tmp_path / "merged")])
    assert result.exit_code == 0, result.output
    assert "2 shards, 5 sequences" in result.output
    merged = hscache.open_cache(tmp_path / "merged")
    _assert_same(hscache.open_cache(reference), merged)
    document = json.loads((sharded / "shards.json").read_text())
    assert [p["sequences"] for p in document["parts"]] == [3, 2] and document["complete"]
    one = hscache.open_cache(reference)
    assert np.array_equal(
        np.asarray(one.array("hidden_states")[:]), np.asarray(merged.array("hidden_states")[:])
    )


def test_fp8_shards_read_dequantised_and_their_merge_is_refused(reference, sharded, tmp_path):
    from hscache.store.compact import relative_l2_per_layer
    from hscache.store.compact_convert import convert_states

    copy = shutil.copytree(sharded, tmp_path / "c")
    for shard in sorted(copy.glob("shard-*")):
        convert_states(shard)
    view, one = hscache.open_cache(copy), hscache.open_cache(reference)
    assert view.dtype == one.dtype
    for i in range(len(one)):
        assert max(relative_l2_per_layer(view.hidden_states(i), one.hidden_states(i))) < 0.04
    result = CliRunner().invoke(main, ["merge", str(copy), "--into", str(tmp_path / "merged")])
    assert result.exit_code == 2 and "shards with fp8 states" in result.output


def test_shards_with_different_settings_are_refused(sharded, tmp_path):
    copy = shutil.copytree(sharded, tmp_path / "c")
    manifest_path = copy / "shard-00001-of-00002" / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    manifest["settings"]["max_new_tokens"] = 7
    manifest["content_sha256"] = content_sha256(manifest)  # as if extracted so, not edited
    manifest_path.write_text(json.dumps(manifest))
    with pytest.raises(
        hscache.CacheFormatError,
        match=r"shards of .* differ in max_new_tokens: "
        r"shard-00000-of-00002 has 6, shard-00001-of-00002 has 7; re-extract",
    ):
        hscache.open_cache(copy)
    shutil.rmtree(copy / "shard-00001-of-00002")
    with pytest.raises(
        hscache.CacheFormatError,
        match=r"has 1 of 2 shards; shard 1 is missing: run "
        r"`hscache extract \.\.\. --out .* --shard 1/2`",
    ):
        merge_shards(copy)


def test_shard_flag_is_checked():
    assert parse_shard("1/4") == (1, 4)
    result = CliRunner().invoke(main, ["extract", "--out", "x", "--shard", "2/2"])
    assert result.exit_code == 2
    assert "error: --shard 2/2 out of range; shard I of N needs 0 <= I < N, e.g. 0/2" in result.output
    with pytest.raises(hscache.InputError, match="is not I/N"):
        parse_shard("a/b")


def test_metadata_only_some_shards_carry_is_kept(tmp_path):
    """Odd records (all in shard 1) carry ``category``; ``difficulty`` is an int in shard 0, text in shard 1."""
    from tests.conftest import write_jsonl

    records = [
        {
            "id": f"r{n}",
            "prompt": f"def f{n}(x): return",
            "difficulty": n if n % 2 == 0 else "hard",
            **({"category": "code"} if n % 2 else {}),
        }
        for n in range(4)
    ]
    prompts = str(write_jsonl(tmp_path / "prompts.jsonl", records))
    config = {"prompts": prompts, "layers": "1", "max_new_tokens": 2, "dtype": "fp32"}
    hscache.extract(hscache.ExtractConfig(out=str(tmp_path / "one"), **config))
    for index in range(2):
        hscache.extract(hscache.ExtractConfig(out=str(tmp_path / "two"), shard=(index, 2), **config))
    one, view = hscache.open_cache(tmp_path / "one"), hscache.open_cache(tmp_path / "two")
    assert isinstance(view, ShardedCache)
    assert view.index.column("category").to_pylist() == [None, "code", None, "code"]
    assert view.index.schema == one.index.schema and view.index.to_pylist() == one.index.to_pylist()


def test_info_and_verify_take_a_directory_of_shards(sharded, tmp_path):
    import json as _json
    import shutil

    from click.testing import CliRunner

    from hscache.cli import main

    info = CliRunner().invoke(main, ["info", str(sharded), "--json"])
    assert info.exit_code == 0, info.output
    summary = _json.loads(info.output)
    assert summary["sequences"] == len(hscache.open_cache(sharded)) and summary["bytes_per_token"] > 0
    ok = CliRunner().invoke(main, ["verify", str(sharded)])
    assert ok.exit_code == 0, ok.output
    assert "shard-00000-of-00002" in ok.output and "shard-00001-of-00002" in ok.output
    damaged = shutil.copytree(sharded, tmp_path / "damaged")
    chunk = next((damaged / "shard-00001-of-00002" / "arrays" / "hidden_states" / "c").rglob("*"))
    chunk = chunk if chunk.is_file() else next(p for p in chunk.rglob("*") if p.is_file())
    data = bytearray(chunk.read_bytes())
    data[len(data) // 2] ^= 0xFF
    chunk.write_bytes(bytes(data))
    bad = CliRunner().invoke(main, ["verify", str(damaged)])
    assert bad.exit_code == 1, bad.output


def test_sequence_dataset_reads_a_sharded_cache_in_record_order(sharded, reference):
    from hscache.data import PackedWindows, SequenceDataset

    a, b = SequenceDataset(sharded), SequenceDataset(reference)
    assert len(a) == len(b) == 5
    for x, y in zip(a, b):
        assert x["record_id"] == y["record_id"]
        for key in ("hidden_states", "token_ids", "target_argmax", "loss_mask"):
            assert torch.equal(x[key], y[key]), key
    with pytest.raises(hscache.InputError, match="is sharded: PackedWindows cuts one cache's token axis"):
        PackedWindows(sharded, 16)
