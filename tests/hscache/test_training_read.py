"""The training read path: one copy (or none) per chunk, checksums checked on first touch per
process, and a flipped bit refused on every path, also after the chunk was verified once."""

from __future__ import annotations

import hashlib
import os
import shutil
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

import hscache
from hscache.data import PackedWindows, SequenceDataset
from hscache.store import chunks
from hscache.store.layout import array_specs, chunk_key
from hscache.store.writer import SequenceRows, StoreWriter

LENGTHS = [300, 5, 700, 200]  # 1205 tokens: 5 chunks of 256 tokens, a partial last chunk


def _write(root: Path, compression: str) -> Path:
    """bf16 hidden states [2, 16], 256-token chunks."""
    specs = array_specs(2, 16, "bfloat16", 4, None, chunk_bytes=256 * 64)
    writer = StoreWriter.create(root, specs, compression, {"layer_ids": [3, 7]})
    gen = torch.Generator().manual_seed(0)
    for n, t in enumerate(LENGTHS):
        hidden = torch.randn(t, 2, 16, generator=gen).to(torch.bfloat16)
        tokens = np.arange(t, dtype=np.int32) + n
        rows = {
            "hidden_states": hidden.view(torch.int16).numpy().view(np.uint16),
            "token_ids": tokens,
            "target_argmax": tokens[::-1].copy(),
            "target_topk_values": torch.randn(t, 4, generator=gen).numpy(),
            "target_topk_ids": np.arange(t * 4, dtype=np.int32).reshape(t, 4),
            "target_logsumexp": torch.randn(t, generator=gen).numpy(),
        }
        digest = hashlib.sha256(tokens.astype("<i4").tobytes()).hexdigest()
        writer.append(SequenceRows(rows, f"r{n}", 2, "length", digest, "{}"))
    writer.finish()
    return root


@pytest.fixture(scope="module")
def plain_cache(tmp_path_factory) -> Path:
    """The uncompressed training cache."""
    return _write(tmp_path_factory.mktemp("training") / "none", "none")


@pytest.fixture(scope="module", params=["none", "fast"])
def any_cache(request, plain_cache, tmp_path_factory) -> Path:
    """The training cache, and the same rows compressed."""
    if request.param == "none":
        return plain_cache
    return _write(tmp_path_factory.mktemp("training") / "fast", "fast")


@pytest.fixture
def damaged(any_cache, tmp_path):
    """A copy of the cache, opened and fully read once (every chunk verified in this process),
    then chunk 1 of hidden_states flipped IN PLACE (same inode): the record must not vouch for it."""
    root = tmp_path / "c"
    shutil.copytree(any_cache, root)
    cache = hscache.open_cache(root)
    cache.read_tokens("hidden_states", 0, cache.num_tokens)
    path = root / "arrays" / "hidden_states" / chunk_key(cache.specs["hidden_states"], 1)
    before = os.stat(path)
    with open(path, "r+b") as f:  # in place: no rename, the inode stays
        middle = before.st_size // 2
        f.seek(middle)
        byte = f.read(1)
        f.seek(middle)
        f.write(bytes([byte[0] ^ 0x04]))
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns + 1))  # even within one clock tick
    assert os.stat(path).st_ino == before.st_ino
    return root


def _zarr(cache, name, a, b) -> np.ndarray:
    return np.asarray(cache.array(name)[a:b])


def test_reads_into_a_callers_buffer_and_mapped_views_equal_zarr(plain_cache):
    cache = hscache.open_cache(plain_cache)
    n = cache.num_tokens
    out = np.empty((n - 10, 2, 16), np.uint16)
    assert cache.read_tokens("hidden_states", 5, n - 5, out=out) is out
    assert out.tobytes() == _zarr(cache, "hidden_states", 5, n - 5).tobytes()
    tensor = torch.empty(700, 2, 16, dtype=torch.bfloat16)
    cache.rows("hidden_states", 305, 1005, out=tensor)
    assert torch.equal(tensor.view(torch.int16), cache.hidden_states(2).view(torch.int16))
    views = list(cache.iter_tokens("hidden_states", 100, n, copy=False))
    assert all(not rows.flags.writeable for _, rows in views)
    assert [a for a, _ in views] == [100, 256, 512, 768, 1024]
    joined = np.concatenate([rows for _, rows in views])
    assert joined.tobytes() == _zarr(cache, "hidden_states", 100, n).tobytes()
    with pytest.raises(ValueError, match="need C-contiguous"):
        cache.read_tokens("hidden_states", 0, 10, out=np.empty((10, 2, 16), np.float32))


def test_the_checksum_is_computed_on_first_touch_only_until_the_file_changes(
    plain_cache, tmp_path, monkeypatch
):
    root = tmp_path / "c"
    shutil.copytree(plain_cache, root)
    calls = []
    extend = chunks.google_crc32c.extend

    class Counting:
        @staticmethod
        def extend(crc, data):
            calls.append(len(data))
            return extend(crc, data)

    monkeypatch.setattr(chunks, "google_crc32c", Counting)
    cache = hscache.open_cache(root)
    cache.read_tokens("hidden_states", 0, 256)
    first = len(calls)
    assert first >= 1
    cache.read_tokens("hidden_states", 0, 256)
    hscache.open_cache(root).read_tokens("hidden_states", 0, 256)  # a new handle: same process
    assert len(calls) == first
    path = root / "arrays" / "hidden_states" / chunk_key(cache.specs["hidden_states"], 0)
    replacement = path.with_name("new")
    shutil.copyfile(path, replacement)
    os.replace(replacement, path)  # a rewrite by rename, as zarr and hscache write
    cache.read_tokens("hidden_states", 0, 256)
    assert len(calls) > first


def _refused():
    return pytest.raises(
        hscache.CacheFormatError, match=r"hidden_states chunk c/1/0/0 .*fails its crc32c check"
    )


def test_flip_refused_by_read_tokens(damaged):
    with _refused():
        hscache.open_cache(damaged).read_tokens("hidden_states", 200, 300)


def test_flip_refused_by_read_into_a_buffer(damaged):
    with _refused():
        hscache.open_cache(damaged).rows(
            "hidden_states", 0, 600, out=torch.empty(600, 2, 16, dtype=torch.bfloat16)
        )


def test_flip_refused_by_a_full_scan(damaged):
    with _refused():
        list(hscache.open_cache(damaged).iter_tokens("hidden_states"))


def test_flip_refused_by_mapped_views(damaged):
    with _refused():
        list(hscache.open_cache(damaged).iter_tokens("hidden_states", copy=False))


def test_flip_refused_by_sequence_dataset_items_and_prefetch(damaged):
    data = SequenceDataset(damaged)
    assert torch.equal(data[3]["token_ids"], torch.arange(200) + 3)  # tokens 1005-1204: chunks 3-4 read
    with _refused():
        data[1]  # tokens 300-304: hidden states in chunk 1
    with _refused():
        list(data.prefetched(ahead=2))


def test_flip_refused_by_packed_windows_with_read_ahead(damaged):
    with _refused():
        list(PackedWindows(damaged, window=64, prefetch=2))


def test_flip_refused_in_a_dataloader_worker(damaged):
    loader = DataLoader(SequenceDataset(damaged), batch_size=None, num_workers=1)
    with _refused():
        list(loader)


def test_prefetched_items_and_read_ahead_windows_equal_plain_reads(plain_cache):
    data = SequenceDataset(plain_cache, layer_ids=[7])
    order = [3, 0, 2, 1, 0]
    items = list(data.prefetched(order, ahead=2))
    assert [item["row"] for item in items] == order
    for item in items:
        plain = data[item["row"]]
        assert torch.equal(item["hidden_states"].view(torch.int16), plain["hidden_states"].view(torch.int16))
        assert item["hidden_states"].shape[1:] == (1, 16)
        assert torch.equal(item["token_ids"], plain["token_ids"])
    plain_windows = list(PackedWindows(plain_cache, window=100, seed=3, prefetch=0))
    ahead = list(PackedWindows(plain_cache, window=100, seed=3, prefetch=3))
    assert [w["start"] for w in ahead] == [w["start"] for w in plain_windows]
    for a, b in zip(ahead, plain_windows):
        assert torch.equal(a["hidden_states"].view(torch.int16), b["hidden_states"].view(torch.int16))
        assert torch.equal(a["sequence_ids"], b["sequence_ids"])


def test_worker_items_arrive_in_shared_memory_unchanged(plain_cache):
    data = SequenceDataset(plain_cache)
    loader = DataLoader(data, batch_size=None, num_workers=1)
    for item in loader:
        assert item["hidden_states"].is_shared()
        assert torch.equal(
            item["hidden_states"].view(torch.int16), data[item["row"]]["hidden_states"].view(torch.int16)
        )


def test_bad_read_ahead_values_are_refused_in_one_line(plain_cache):
    with pytest.raises(hscache.InputError, match="ahead 0: need at least 1 item read ahead"):
        next(SequenceDataset(plain_cache).prefetched(ahead=0))
    with pytest.raises(hscache.InputError, match=r"prefetch -1: need 0 \(no read-ahead\) or more blocks"):
        PackedWindows(plain_cache, window=8, prefetch=-1)


def test_set_epoch_reaches_persistent_workers(plain_cache):
    """A persistent worker keeps its own copy of the dataset: the epoch must still reach it."""
    windows = PackedWindows(plain_cache, window=64, seed=1)
    persistent = DataLoader(windows, batch_size=None, num_workers=1, persistent_workers=True)
    orders = []
    for epoch in (0, 1):
        windows.set_epoch(epoch)
        fresh = DataLoader(windows, batch_size=None, num_workers=1)  # a new worker per epoch
        orders.append([int(w["start"]) for w in persistent])
        assert orders[-1] == [int(w["start"]) for w in fresh]
    assert orders[0] != orders[1]


@pytest.fixture
def rewritten(plain_cache, tmp_path):
    """A copy of the uncompressed cache, fully read once (every chunk verified in this process), then
    chunk 1 of hidden_states rewritten by rename with other rows and a VALID crc32c: only the
    manifest's sha256 of the chunk's rows can tell."""
    import google_crc32c

    root = tmp_path / "c"
    shutil.copytree(plain_cache, root)
    cache = hscache.open_cache(root)
    cache.read_tokens("hidden_states", 0, cache.num_tokens)
    path = root / "arrays" / "hidden_states" / chunk_key(cache.specs["hidden_states"], 1)
    payload = bytearray(path.read_bytes()[:-4])
    payload[len(payload) // 2] ^= 0x04
    replacement = path.with_name("new")
    replacement.write_bytes(bytes(payload) + google_crc32c.value(bytes(payload)).to_bytes(4, "little"))
    os.replace(replacement, path)
    return root


@pytest.mark.parametrize(
    "read",
    [
        lambda c: c.read_tokens("hidden_states", 300, 310),  # partial rows of the chunk
        lambda c: c.rows("hidden_states", 0, 600, out=torch.empty(600, 2, 16, dtype=torch.bfloat16)),
        lambda c: list(c.iter_tokens("hidden_states")),
        lambda c: list(c.iter_tokens("hidden_states", copy=False)),
    ],
    ids=["partial", "into-buffer", "scan", "mapped-views"],
)
def test_a_consistent_rewrite_with_a_valid_crc_is_refused_on_every_path(rewritten, read):
    with pytest.raises(
        hscache.CacheFormatError, match=r"hidden_states chunk c/1/0/0 .*does not match its sha256"
    ):
        read(hscache.open_cache(rewritten))


def _counting_checksums(monkeypatch) -> list[int]:
    """Every crc32c and sha256 a chunk check computes, counted."""
    calls: list[int] = []
    extend, sha256 = chunks.google_crc32c.extend, chunks.hashlib.sha256

    class Counting:
        @staticmethod
        def extend(crc, data):
            calls.append(len(data))
            return extend(crc, data)

    class CountingHashlib:
        @staticmethod
        def sha256(*args):
            calls.append(0)
            return sha256(*args)

    monkeypatch.setattr(chunks, "google_crc32c", Counting)
    monkeypatch.setattr(chunks, "hashlib", CountingHashlib)
    return calls


def test_a_new_process_trusts_the_users_verification_log_until_a_chunk_changes(
    plain_cache, tmp_path, monkeypatch
):
    """store/verified_log.py: what one process verified, the next one (here: the record cleared, as in
    a fresh process) reads without checking again; a rewritten chunk is checked again and refused."""
    import google_crc32c

    from hscache.store.verified_log import log_path, read_entries

    log_dir = tmp_path / "log"
    monkeypatch.setenv("HSCACHE_VERIFIED_DIR", str(log_dir))
    root = tmp_path / "c"
    shutil.copytree(plain_cache, root)
    chunks.VERIFIED.clear()
    first = hscache.open_cache(root)
    reference = first.read_tokens("hidden_states", 0, first.num_tokens)  # verifies and logs every chunk
    array_dir = root / "arrays" / "hidden_states"
    logged = {rel for rel, *_ in read_entries(log_path(log_dir, array_dir))}
    assert logged == {f"c/{i}/0/0" for i in range(5)}

    calls = _counting_checksums(monkeypatch)
    read_entries_now = chunks.read_entries

    def slow_read_entries(path):  # reader threads arrive while the log is still being read
        time.sleep(0.2)
        return read_entries_now(path)

    monkeypatch.setattr(chunks, "read_entries", slow_read_entries)
    chunks.VERIFIED.clear()  # a new process: only the log knows
    again = hscache.open_cache(root).read_tokens("hidden_states", 0, first.num_tokens)
    assert np.array_equal(again, reference) and calls == []

    monkeypatch.setenv("HSCACHE_VERIFIED_DIR", "off")  # without the log, a new process checks again
    chunks.VERIFIED.clear()
    hscache.open_cache(root).read_tokens("hidden_states", 0, first.num_tokens)
    assert calls

    monkeypatch.setenv("HSCACHE_VERIFIED_DIR", str(log_dir))
    path = array_dir / chunk_key(first.specs["hidden_states"], 1)
    payload = bytearray(path.read_bytes()[:-4])
    payload[len(payload) // 2] ^= 0x04
    replacement = path.with_name("new")
    replacement.write_bytes(bytes(payload) + google_crc32c.value(bytes(payload)).to_bytes(4, "little"))
    os.replace(replacement, path)  # a consistent rewrite: the log's entry no longer matches the file
    chunks.VERIFIED.clear()
    with pytest.raises(hscache.CacheFormatError, match=r"chunk c/1/0/0 .*does not match its sha256"):
        hscache.open_cache(root).read_tokens("hidden_states", 0, first.num_tokens)


def test_the_verification_log_ignores_torn_and_malformed_lines(tmp_path):
    from hscache.store.verified_log import append_entries, read_entries

    log = tmp_path / "x.log"
    good = ("c/0/0/0", (1, 2), (3, 4, 5), "a" * 64)
    append_entries(log, [good])
    with log.open("a") as f:
        f.write("c/1/0/0 1 2 x 4 5 " + "b" * 64 + "\nc/2/0/0 1 2 3\nc/3/0/0 1 2 3 4 5 " + "c" * 10)
    assert list(read_entries(log)) == [good]
