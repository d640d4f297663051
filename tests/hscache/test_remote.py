"""Caches at s3:// URLs, against a local S3-compatible server (moto) on loopback."""

from __future__ import annotations

import pytest
import torch

import hscache
from hscache.store.remote import RemoteCache, upload_cache
from scorer import init_drafter
from scorer.studies.evaluate import EvalConfig, evaluate
from tests.hscache.tamper import reseal

pytest.importorskip("s3fs", reason="pip install s3fs 'moto[server]' to test s3:// caches")
pytest.importorskip("moto.server", reason="pip install 'moto[server]' to test s3:// caches")


def _same_numbers(a: dict, b: dict) -> None:
    for key in ("tau", "acceptance", "train_accept_len", "ddtree", "rounds", "tokens", "per_request"):
        assert a[key] == b[key], key


def test_extract_and_eval_round_trip_through_s3(bucket, scale_cache, tmp_path):
    url = f"{bucket}/cache"
    result = hscache.extract(
        hscache.ExtractConfig(out=url, layers="1,3,7", max_new_tokens=12, dtype="fp32", limit=4)
    )
    assert result.path == url and result.sequences == 4
    remote, local = hscache.open_cache(url), hscache.open_cache(scale_cache)
    assert (
        isinstance(remote, RemoteCache)
        and remote.complete
        and "RemoteCache('s3://hscache-test/cache'" in repr(remote)
    )
    for i in range(len(local)):
        assert torch.equal(remote.hidden_states(i), local.hidden_states(i))
        assert torch.equal(remote.token_ids(i), local.token_ids(i))
    init_drafter(scale_cache, tmp_path / "d", seed=5)
    drafter = tmp_path / "d"
    config = EvalConfig(ddtree=(8,), n_boot=20)
    from_s3 = evaluate(drafter, url, config)
    assert from_s3["cache"]["path"] == url
    _same_numbers(from_s3, evaluate(drafter, scale_cache, config))


def test_upload_then_reopen_sees_the_new_cache(bucket, scale_cache):
    url = f"{bucket}/copy"
    upload_cache(scale_cache, url)
    assert len(hscache.open_cache(url)) == 4
    upload_cache(scale_cache, url)  # publishing again replaces it (manifest removed first, written last)
    assert hscache.open_cache(url).num_tokens == hscache.open_cache(scale_cache).num_tokens


def test_missing_remote_cache_is_a_one_line_error(bucket):
    with pytest.raises(
        hscache.CacheNotFoundError,
        match=r"s3://hscache-test/nothing is not an hscache cache \(no manifest"
        r"\.json\); create one with `hscache extract --out s3://hscache-test/nothing`",
    ):
        hscache.open_cache(f"{bucket}/nothing")


def test_reopen_after_republish_with_same_sizes_sees_the_new_files(bucket, scale_cache, tmp_path):
    """Another target of the same architecture gives files of the same names and sizes: the mirror
    must notice the new bytes, and drop the files the new cache no longer has."""
    import shutil

    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    url = f"{bucket}/republished"
    old = shutil.copytree(scale_cache, tmp_path / "old")
    (old / "target" / "stale.txt").write_text("a tokenizer file of the old target")
    reseal(old)  # a cache whose target/ held that file when it was written
    upload_cache(old, url)
    first = hscache.open_cache(url)
    assert (first.path / "target" / "stale.txt").is_file()
    before = first.target_head()
    new = shutil.copytree(scale_cache, tmp_path / "new")
    head = new / "target" / "head.safetensors"
    with safe_open(str(head), "pt") as f:
        metadata = f.metadata()
    save_file({k: -v for k, v in load_file(str(head)).items()}, str(head), metadata=metadata)
    reseal(new)  # as if extracted from that other target
    assert head.stat().st_size == (scale_cache / "target" / "head.safetensors").stat().st_size
    upload_cache(new, url)
    second = hscache.open_cache(url)
    assert second.path == first.path  # the same mirror, refreshed
    assert all(torch.equal(second.target_head()[k], -before[k]) for k in before)
    assert not (second.path / "target" / "stale.txt").exists()


def test_datasets_read_a_remote_cache_like_the_local_one(bucket, scale_cache):
    from hscache.data import PackedWindows, SequenceDataset

    url = f"{bucket}/for-training"
    upload_cache(scale_cache, url)
    remote, local = (
        SequenceDataset(url, rank=1, world_size=2),
        SequenceDataset(scale_cache, rank=1, world_size=2),
    )
    assert len(remote) == len(local) == 2
    for a, b in zip(remote, local):
        assert a["record_id"] == b["record_id"]
        for key in ("hidden_states", "token_ids", "target_argmax", "loss_mask"):
            assert torch.equal(a[key], b[key]), key
    windows = [w["hidden_states"] for w in PackedWindows(url, 16, shuffle=False)]
    assert torch.equal(
        torch.cat(windows),
        torch.cat([w["hidden_states"] for w in PackedWindows(scale_cache, 16, shuffle=False)]),
    )


def _edited_upload(bucket: str, scale_cache, tmp_path, name: str, edit) -> str:
    import shutil

    local = shutil.copytree(scale_cache, tmp_path / name)
    edit(local)
    url = f"{bucket}/{name}"
    upload_cache(local, url)
    return url


def test_remote_caches_get_the_local_checks_and_verify(bucket, scale_cache, tmp_path):
    """Unsealed edits of a remote cache's small files are refused at open, as locally; `hscache
    verify s3://...` runs (--deep streams the chunks); a corrupt remote chunk is one line (issue 18,
    item 5)."""
    import json

    import numpy as np
    import zarr
    from click.testing import CliRunner

    from hscache.cli import main as hscache_main
    from hscache.errors import CacheFormatError

    clean = _edited_upload(bucket, scale_cache, tmp_path, "clean", lambda root: None)
    result = CliRunner().invoke(hscache_main, ["verify", "--deep", "--json", clean])
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert report["chunks_decoded"] > 0 and report["digest"] == hscache.cache_digest(
        hscache.open_cache(clean)
    )

    def prompt_len_plus_5(root):
        import pyarrow as pa
        import pyarrow.parquet as pq

        part = root / json.loads((root / "manifest.json").read_text())["index_parts"][0]
        table = pq.read_table(part)
        i = table.column_names.index("prompt_len")
        values = [v + 5 for v in table.column("prompt_len").to_pylist()]
        pq.write_table(table.set_column(i, "prompt_len", pa.array(values, pa.int32())), part)

    def config_edit(root):
        path = root / "target" / "config.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), "num_hidden_layers": 3}))

    def manifest_edit(root):
        manifest = json.loads((root / "manifest.json").read_text())
        manifest["settings"]["layer_ids"] = list(reversed(manifest["settings"]["layer_ids"]))
        (root / "manifest.json").write_text(json.dumps(manifest))

    def head_edit(root):
        path = root / "target" / "head.safetensors"
        data = bytearray(path.read_bytes())
        data[-3] ^= 1
        path.write_bytes(bytes(data))

    for name, edit in (
        ("index", prompt_len_plus_5),
        ("config", config_edit),
        ("manifest", manifest_edit),
        ("head", head_edit),
    ):
        url = _edited_upload(bucket, scale_cache, tmp_path, name, edit)
        with pytest.raises(CacheFormatError, match="cannot be trusted") as err:
            hscache.open_cache(url)
        assert url in str(err.value) and "\n" not in str(err.value)
        assert CliRunner().invoke(hscache_main, ["verify", url]).exit_code == 1

    def rewrite_chunk(root):  # other values, valid crc32c: only the chunk's sha256 tells
        array = zarr.open_array(str(root / "arrays" / "hidden_states"), mode="r+")
        n = array.chunks[0]
        array[:n] = np.asarray(array[:n])[::-1].copy()

    url = _edited_upload(bucket, scale_cache, tmp_path, "chunk", rewrite_chunk)
    cache = hscache.open_cache(url)  # the small files are intact
    with pytest.raises(CacheFormatError, match="does not match its sha256 recorded at commit") as err:
        cache.hidden_states(0)
    assert "\n" not in str(err.value)
    result = CliRunner().invoke(hscache_main, ["verify", "--json", url])
    assert result.exit_code == 1 and "does not match its sha256" in result.output

    def flip_chunk(root):  # a damaged chunk: crc32c fails
        path = next(p for p in sorted((root / "arrays" / "hidden_states" / "c").rglob("*")) if p.is_file())
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 1
        path.write_bytes(bytes(data))

    url = _edited_upload(bucket, scale_cache, tmp_path, "flip", flip_chunk)
    with pytest.raises(CacheFormatError, match="cannot be read") as err:
        hscache.open_cache(url).hidden_states(0)
    assert "\n" not in str(err.value) and "hscache verify" in str(err.value)


def test_an_empty_folder_marker_object_is_not_a_file(bucket, scale_cache):
    """Issue 36 item 12: S3 consoles and some tools write an empty ``target/`` object as a folder
    marker; it is not a file of the cache (it crashed the mirror with FileExistsError)."""
    import s3fs
    from click.testing import CliRunner

    from hscache.cli import main

    url = f"{bucket}/with-marker"
    upload_cache(scale_cache, url)
    s3fs.S3FileSystem().pipe_file(f"{url[len('s3://') :]}/target/", b"")
    cache = hscache.open_cache(url)
    assert len(cache) == 4 and cache.target_config == hscache.open_cache(scale_cache).target_config
    result = CliRunner().invoke(main, ["verify", url])
    assert result.exit_code == 0 and "Traceback" not in result.output, result.output


def test_a_compact_cache_reads_the_same_through_s3(bucket, scale_cache, tmp_path):
    import shutil

    from hscache.store.compact import exact_states
    from hscache.store.compact_convert import convert_states

    local = shutil.copytree(scale_cache, tmp_path / "fp8")
    convert_states(local, every=2)
    url = f"{bucket}/fp8"
    upload_cache(local, url)
    remote, here = hscache.open_cache(url), hscache.open_cache(local)
    assert remote.dtype == here.dtype == torch.float32
    for i in range(len(here)):
        assert torch.equal(remote.hidden_states(i), here.hidden_states(i))
    row = here.manifest["states"]["exact"]["rows"][0]
    assert torch.equal(exact_states(remote, row), hscache.open_cache(scale_cache).hidden_states(row))
