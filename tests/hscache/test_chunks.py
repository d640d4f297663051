"""The direct chunk reader (store/chunks.py) returns exactly what zarr returns, and refuses damage."""

from __future__ import annotations

import json
from pathlib import Path

import google_crc32c
import numpy as np
import pytest
import torch
import zarr

import hscache
from hscache.store.chunks import chunk_reader
from hscache.store.layout import array_specs, chunk_key
from hscache.store.row_ranges import read_rows
from hscache.store.writer import SequenceRows, StoreWriter

LENGTHS = [300, 7, 1000, 1, 523]  # 1831 tokens: several 256-token chunks and a partial last chunk


def _write(root: Path, dtype: str, compression: str, lengths: list[int] = LENGTHS) -> Path:
    """A cache of every array kind: hidden states in ``dtype`` (bf16 as raw bits), ints, floats."""
    specs = array_specs(2, 8, dtype, 4, 16, chunk_bytes=256 * 32)  # 16-vocab full logits too
    writer = StoreWriter.create(root, specs, compression, {"layer_ids": [0, 1]})
    gen = torch.Generator().manual_seed(0)
    for n, t in enumerate(lengths):
        hidden = torch.randn(t, 2, 8, generator=gen) * 100
        hidden.view(-1)[:4] = torch.tensor([float("nan"), float("inf"), -0.0, 1e-40])[: hidden.numel()]
        stored = (
            hidden.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
            if dtype == "bfloat16"
            else hidden.numpy().astype(dtype)
        )
        rows = {
            "hidden_states": stored,
            "token_ids": np.arange(t, dtype=np.int32) + n,
            "target_argmax": np.arange(t, dtype=np.int32)[::-1].copy(),
            "target_topk_values": torch.randn(t, 4, generator=gen).numpy(),
            "target_topk_ids": np.arange(t * 4, dtype=np.int32).reshape(t, 4),
            "target_logsumexp": torch.randn(t, generator=gen).numpy(),
            "target_logits": torch.randn(t, 16, generator=gen).numpy(),
        }
        writer.append(SequenceRows(rows, f"r{n}", 1, "none", f"{n:064x}", "{}"))
        writer.commit()
    writer.finish()
    return root


@pytest.fixture(
    scope="module",
    params=[("bfloat16", "balanced"), ("float16", "fast"), ("float32", "none")],
    ids=lambda p: "-".join(p),
)
def cache_dir(request, tmp_path_factory) -> Path:
    dtype, compression = request.param
    return _write(tmp_path_factory.mktemp("chunks") / "c", dtype, compression)


def _zarr(cache: hscache.Cache, name: str, a: int, b: int) -> np.ndarray:
    return np.asarray(cache.array(name)[a:b])


def test_direct_reads_equal_zarr_bit_for_bit_for_every_array_and_range(cache_dir):
    cache = hscache.open_cache(cache_dir)
    n = cache.num_tokens
    ranges = [(0, n), (0, 256), (255, 257), (100, 1300), (n - 7, n), (1024, 1024), (3, 4)]
    for name in cache.specs:
        assert cache._chunk_reader(name) is not None, name  # the fast path is really taken
        for a, b in ranges:
            got, want = cache.read_tokens(name, a, b), _zarr(cache, name, a, b)
            assert got.dtype == want.dtype and got.shape == want.shape, (name, a, b)
            assert got.tobytes() == want.tobytes(), (name, a, b)  # bytes: NaN == NaN
        blocks = list(cache.iter_tokens(name))
        assert [a for a, _ in blocks] == list(range(0, n, cache.specs[name].chunk_tokens))
        assert np.concatenate([rows for _, rows in blocks]).tobytes() == _zarr(cache, name, 0, n).tobytes()
        assert (
            np.concatenate([r for _, r in cache.iter_tokens(name, 250, 800)]).tobytes()
            == _zarr(cache, name, 250, 800).tobytes()
        )


def test_per_sequence_accessors_and_blocks_keep_the_logical_dtype(cache_dir):
    cache = hscache.open_cache(cache_dir)
    logical = cache.specs["hidden_states"].logical_dtype
    start = 0
    for i, t in enumerate(LENGTHS):
        hidden = cache.hidden_states(i)
        assert hidden.dtype == getattr(torch, logical) and hidden.shape == (t, 2, 8)
        raw = _zarr(cache, "hidden_states", start, start + t)
        assert hidden.contiguous().view(torch.uint8).numpy().tobytes() == raw.tobytes()
        assert torch.equal(
            cache.target_logits(i), torch.from_numpy(_zarr(cache, "target_logits", start, start + t))
        )
        start += t
    block = read_rows(cache, range(1, 4))
    for i in range(1, 4):
        assert torch.equal(
            block.get("hidden_states", i).view(torch.uint8), cache.hidden_states(i).view(torch.uint8)
        )


def test_the_chunk_file_is_payload_then_little_endian_crc32c(cache_dir):
    cache = hscache.open_cache(cache_dir)
    spec = cache.specs["hidden_states"]
    data = (cache_dir / "arrays" / "hidden_states" / chunk_key(spec, 0)).read_bytes()
    assert int.from_bytes(data[-4:], "little") == google_crc32c.value(data[:-4])


def _damaged_copy(cache_dir: Path, tmp_path: Path, damage) -> tuple[hscache.Cache, str]:
    import shutil

    root = tmp_path / "damaged"
    shutil.copytree(cache_dir, root)
    spec = hscache.open_cache(root).specs["hidden_states"]
    key = chunk_key(spec, 1)
    damage(root / "arrays" / "hidden_states" / key)
    return hscache.open_cache(root), key


def _flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x10
    path.write_bytes(bytes(data))


def test_a_flipped_bit_raises_naming_the_chunk_and_verify_still_names_its_sequences(cache_dir, tmp_path):
    cache, key = _damaged_copy(cache_dir, tmp_path, _flip)
    with pytest.raises(hscache.CacheFormatError, match=f"hidden_states chunk {key} .*fails its crc32c check"):
        cache.read_tokens("hidden_states", 0, cache.num_tokens)
    with pytest.raises(hscache.CacheFormatError, match="fails its crc32c check"):
        cache.hidden_states(2)  # tokens 307-1306 include chunk 1 (256-511)
    with pytest.raises(hscache.CacheFormatError, match="fails its crc32c check"):
        list(cache.iter_tokens("hidden_states"))
    with pytest.raises(ValueError, match="checksum"):  # zarr agrees
        _zarr(cache, "hidden_states", 256, 512)
    assert torch.equal(cache.token_ids(0), torch.arange(300))  # other arrays and chunks still read
    from hscache.verify import verify_cache

    report = verify_cache(cache.path)
    assert any(p.get("chunk") == 1 for p in report.to_dict()["problems"])


def test_a_truncated_chunk_raises(cache_dir, tmp_path):
    cache, key = _damaged_copy(cache_dir, tmp_path, lambda p: p.write_bytes(p.read_bytes()[:-9]))
    with pytest.raises(hscache.CacheFormatError, match=f"hidden_states chunk {key}"):
        cache.read_tokens("hidden_states", 256, 512)


def test_a_missing_chunk_is_refused_where_zarr_would_read_zeros(cache_dir, tmp_path):
    cache, _ = _damaged_copy(cache_dir, tmp_path, lambda p: p.unlink())
    assert not _zarr(cache, "hidden_states", 200, 600)[56:312].any()  # zarr: silent fill value
    with pytest.raises(
        hscache.CacheFormatError, match=r"is missing; the cache is damaged: run `hscache verify`"
    ):
        cache.read_tokens("hidden_states", 200, 600)


def test_ranges_past_the_committed_tokens_are_refused(cache_dir):
    cache = hscache.open_cache(cache_dir)
    with pytest.raises(IndexError, match=f"out of range for a cache of {cache.num_tokens} committed tokens"):
        cache.read_tokens("token_ids", 0, cache.num_tokens + 1)


def test_unknown_codec_chains_fall_back_to_zarr(tmp_path):
    from zarr.codecs import ZstdCodec

    group = zarr.open_group(str(tmp_path / "g"), mode="w")
    plain = group.create_array(
        "plain", shape=(10, 4), chunks=(4, 4), dtype="float32", compressors=[ZstdCodec()]
    )
    split = group.create_array("split", shape=(10, 4), chunks=(4, 2), dtype="float32", compressors=None)
    assert chunk_reader(plain) is None and chunk_reader(split) is None
    meta = json.loads((tmp_path / "g" / "plain" / "zarr.json").read_text())
    assert [c["name"] for c in meta["codecs"]] == ["bytes", "zstd"]
