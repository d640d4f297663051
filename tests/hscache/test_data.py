"""hscache.data: the torch datasets read exactly what the reader reads, split ranks and workers
disjointly and completely, and survive DataLoader worker processes; the xarray view matches."""

from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

import hscache
from hscache.data import PackedWindows, SequenceDataset, open_xarray


@pytest.fixture(scope="module")
def cache_path(small_cache) -> Path:
    """12 sequences, ~600 tokens in 256-token chunks (3 chunk files), fp32, layers 1,3,5."""
    return small_cache.path


def test_items_equal_the_reader_and_mask_the_generated_positions(cache_path):
    cache, data = hscache.open_cache(cache_path), SequenceDataset(cache_path)
    assert len(data) == len(cache) == 12
    for i in range(len(cache)):
        item = data[i]
        assert torch.equal(item["hidden_states"], cache.hidden_states(i))
        assert item["hidden_states"].dtype == cache.dtype
        assert torch.equal(item["token_ids"], cache.token_ids(i)) and item["token_ids"].dtype == torch.long
        assert torch.equal(item["target_argmax"], cache.target_argmax(i))
        values, ids = cache.target_topk(i)
        assert torch.equal(item["target_topk_values"], values) and torch.equal(item["target_topk_ids"], ids)
        assert torch.equal(item["target_logsumexp"], cache.target_logsumexp(i))
        prompt_len = cache.index.column("prompt_len")[i].as_py()
        expected = torch.zeros(len(item["token_ids"]), dtype=torch.bool)
        expected[prompt_len:] = True
        assert torch.equal(item["loss_mask"], expected)
        assert (
            item["record_id"] == cache.index.column("record_id")[i].as_py() == item["metadata"]["record_id"]
        )
        assert item["metadata"]["prompt_len"] == prompt_len and item["row"] == i
    with pytest.raises(IndexError):
        data[12]


def test_layer_subset_follows_the_order_asked(cache_path):
    cache = hscache.open_cache(cache_path)  # layers 1,3,5
    item = SequenceDataset(cache_path, layer_ids=[5, 1])[2]
    assert torch.equal(item["hidden_states"], cache.hidden_states(2)[:, [2, 0]])
    with pytest.raises(hscache.InputError, match=r"layer_ids \[2\] are not all in the cache .* \[1, 3, 5\]"):
        SequenceDataset(cache_path, layer_ids=[2])
    with pytest.raises(hscache.InputError, match="rank 2 / world_size 2"):
        SequenceDataset(cache_path, rank=2, world_size=2)


def test_ranks_split_the_sequences_disjointly_and_completely(cache_path):
    for world in (1, 3, 5, 13):
        seen = [
            SequenceDataset(cache_path, rank=r, world_size=world)[i]["row"]
            for r in range(world)
            for i in range(len(SequenceDataset(cache_path, rank=r, world_size=world)))
        ]
        assert sorted(seen) == list(range(12)), world


def test_pickles_without_its_handle_and_loads_in_worker_processes(cache_path):
    data = SequenceDataset(cache_path)
    data[0]  # opens the handle in this process
    clone = pickle.loads(pickle.dumps(data))
    assert clone._cache is None and torch.equal(clone[3]["hidden_states"], data[3]["hidden_states"])
    loader = DataLoader(data, batch_size=None, num_workers=2, shuffle=False)
    items = list(loader)
    assert [x["row"] for x in items] == list(range(12))
    for item in items:
        assert torch.equal(item["hidden_states"], data[item["row"]]["hidden_states"])


def test_packed_windows_cover_the_token_axis_in_order_without_shuffle(cache_path):
    cache = hscache.open_cache(cache_path)
    w = 32
    windows = list(PackedWindows(cache_path, w, shuffle=False))
    assert len(windows) == cache.num_tokens // w
    hidden = torch.cat([x["hidden_states"] for x in windows])
    n = len(windows) * w
    assert torch.equal(hidden, cache.rows("hidden_states", 0, n))
    assert torch.equal(torch.cat([x["token_ids"] for x in windows]), cache.rows("token_ids", 0, n).long())
    offsets = cache.index.column("offset").to_numpy()
    prompt = cache.index.column("prompt_len").to_numpy()
    seq = torch.cat([x["sequence_ids"] for x in windows]).numpy()
    pos = torch.cat([x["position_ids"] for x in windows]).numpy()
    assert np.array_equal(offsets[seq] + pos, np.arange(n))
    assert np.array_equal(torch.cat([x["loss_mask"] for x in windows]).numpy(), pos >= prompt[seq])


def test_packed_windows_shuffle_by_chunk_split_ranks_and_workers_completely(cache_path):
    cache = hscache.open_cache(cache_path)
    w, chunk = 16, cache.specs["hidden_states"].chunk_tokens
    total = cache.num_tokens // w
    one = [x["start"] for x in PackedWindows(cache_path, w, seed=7)]
    assert sorted(one) == [k * w for k in range(total)] and one != sorted(one)
    # Locality: windows of one storage chunk come together.
    chunks = [s // chunk for s in one]
    assert sum(a != b for a, b in zip(chunks, chunks[1:])) == len(set(chunks)) - 1
    assert one == [x["start"] for x in PackedWindows(cache_path, w, seed=7)]
    again = PackedWindows(cache_path, w, seed=7)
    again.set_epoch(1)
    assert [x["start"] for x in again] != one
    starts = []
    for rank in range(2):
        data = PackedWindows(cache_path, w, rank=rank, world_size=2, seed=7)
        got = [int(s) for batch in DataLoader(data, batch_size=4, num_workers=2) for s in batch["start"]]
        assert len(got) == len(data)
        starts += got
    assert sorted(starts) == [k * w for k in range(total)]


def test_packed_windows_batch_to_constant_shapes(cache_path):
    batch = next(iter(DataLoader(PackedWindows(cache_path, 24, layer_ids=[3]), batch_size=4)))
    assert batch["hidden_states"].shape == (4, 24, 1, 128)
    assert batch["token_ids"].shape == batch["loss_mask"].shape == batch["position_ids"].shape == (4, 24)


def test_xarray_view_matches_the_reader(bf16_cache):
    cache = hscache.open_cache(bf16_cache)
    ds = open_xarray(bf16_cache)
    assert ds.sizes["token"] == cache.num_tokens and list(ds["layer"].values) == cache.layer_ids
    i = 2
    start, length = int(ds["offset"][i]), int(ds["length"][i])
    hidden = ds["hidden_states"].isel(token=slice(start, start + length)).astype("float32").values
    assert np.array_equal(hidden, cache.hidden_states(i).float().numpy())  # bf16 -> fp32 is exact
    assert np.array_equal(ds["token_ids"][start : start + length].values, cache.token_ids(i).numpy())


def test_xarray_view_reads_the_callers_cache_under_a_dask_client(
    dask_client, bf16_cache, tmp_path, monkeypatch
):
    """Under a distributed Client (any test's session client) the view's chunks are read by the
    workers, whose working directory is not ours: ``open_xarray("cache/")`` read THEIR ``cache/``
    (zeros where they had none, a reshape error where they had a 4-layer one: issue 35 items 5, 10)."""
    import dask

    (tmp_path / "cache").symlink_to(bf16_cache)
    monkeypatch.chdir(tmp_path)
    ds = open_xarray("cache/")
    assert dask.base.get_scheduler() == dask_client.get  # the cluster computes, not this process
    cache = hscache.open_cache(bf16_cache)
    expected = torch.cat([cache.hidden_states(i) for i in range(len(cache))]).float().numpy()
    assert np.array_equal(ds["hidden_states"].astype("float32").values, expected)


def test_sequence_reads_decode_each_small_chunk_once(cache_path, monkeypatch):
    """token_ids' one chunk holds every sequence: reading them one by one decodes it once, not 12 times."""
    from hscache.store.chunks import ChunkReader

    calls: list[tuple[str, int]] = []
    decode = ChunkReader._decode

    def counting(self, index, a, b, out):
        calls.append((self.name, index))
        return decode(self, index, a, b, out)

    monkeypatch.setattr(ChunkReader, "_decode", counting)
    # As in a fresh process: chunks this process verified before are read without a whole decode.
    from hscache.store.chunks import VERIFIED

    VERIFIED.clear()
    cache = hscache.open_cache(cache_path)
    reads = [cache.token_ids(i) for i in range(len(cache))]
    assert calls.count(("token_ids", 0)) == 1
    assert torch.equal(torch.cat(reads), cache.rows("token_ids", 0, cache.num_tokens).long())
    chunks = -(-cache.num_tokens // cache.specs["hidden_states"].chunk_tokens)
    hidden = [cache.hidden_states(i) for i in range(len(cache))]  # sequences straddle the 3 chunks
    assert sorted(index for name, index in calls if name == "hidden_states") == list(range(chunks))
    assert torch.equal(torch.cat(hidden), cache.rows("hidden_states", 0, cache.num_tokens))
