"""Caches at s3:// URLs, against a local S3-compatible server (moto) on loopback."""

from __future__ import annotations

import pytest
import torch

import hscache
from hscache.store.remote import RemoteCache, upload_cache
from scorer.evaluate import EvalConfig, evaluate
from scorer.init import init_drafter
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
