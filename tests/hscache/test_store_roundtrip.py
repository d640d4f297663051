"""Every on-disk format round-trips: bf16 bits, int ids, float32 stats, the index."""

from __future__ import annotations

import json

import numpy as np
import torch

import hscache
from hscache import schemas
from hscache.store.layout import ArraySpec, array_specs, chunk_key, chunk_tokens_for, sampled_array_specs
from hscache.store.run_log import read_run_log
from hscache.store.writer import SequenceRows, StoreWriter


def _rows(hidden: torch.Tensor, k: int = 4) -> dict[str, np.ndarray]:
    t = hidden.shape[0]
    return {
        "hidden_states": hidden.view(torch.int16).numpy().view(np.uint16),
        "token_ids": np.arange(t, dtype=np.int32),
        "target_argmax": np.arange(t, dtype=np.int32)[::-1].copy(),
        "target_topk_values": np.linspace(-3, 3, t * k, dtype=np.float32).reshape(t, k),
        "target_topk_ids": np.arange(t * k, dtype=np.int32).reshape(t, k),
        "target_logsumexp": np.full(t, 1.5, dtype=np.float32),
    }


def test_bf16_round_trips_bit_exactly_including_nan_inf_and_negative_zero(tmp_path):
    specials = torch.tensor([float("nan"), float("inf"), float("-inf"), -0.0, 0.0, 1e-40, 3.0e38, -1.0])
    gen = torch.Generator().manual_seed(0)
    lengths = [300, 7, 1000, 1]  # spans several 256-token chunks, partial chunks, a 1-token sequence
    specs = array_specs(2, 8, "bfloat16", 4, None, chunk_bytes=256 * 32)
    writer = StoreWriter.create(tmp_path / "c", specs, "balanced", {"layer_ids": [0, 1], "dtype": "bf16"})
    originals = []
    for n, length in enumerate(lengths):
        hidden = (torch.randn(length, 2, 8, generator=gen) * 100).to(torch.bfloat16)
        hidden.view(-1)[: len(specials)] = specials[: hidden.numel()].to(torch.bfloat16)
        originals.append(hidden)
        writer.append(SequenceRows(_rows(hidden), f"r{n}", 1, "none", f"{n:064x}", json.dumps({"n": n})))
        writer.commit()  # commits rewrite partial chunks: the tail must survive each rewrite
    writer.finish()
    cache = hscache.open_cache(tmp_path / "c")
    assert len(cache) == 4 and cache.dtype == torch.bfloat16
    for i, hidden in enumerate(originals):
        back = cache.hidden_states(i)
        assert back.dtype == torch.bfloat16
        assert torch.equal(back.view(torch.int16), hidden.view(torch.int16))  # bits, so NaN == NaN
    assert cache.index.column("n").to_pylist() == [0, 1, 2, 3]
    manifest = json.loads((tmp_path / "c" / "manifest.json").read_text())
    assert manifest["complete"] and len(manifest["index_parts"]) == 1  # compacted at finish


def test_chunk_length_is_capped_by_the_tokens_a_writer_can_write():
    """A bound on the tokens caps each array's chunk at its power of two (at least 256); a bound at or
    past the configured chunk changes nothing, so large caches keep their chunks."""
    configured = array_specs(3, 128, "float32", 64, 1000, chunk_bytes=8 << 20)
    assert {n: s.chunk_tokens for n, s in configured.items()} == {
        "hidden_states": 4096,  # 8 MiB / 1536 bytes a token, down to a power of two
        "token_ids": 1 << 20,  # the 1M-token ceiling
        "target_argmax": 1 << 20,
        "target_topk_values": 32768,
        "target_topk_ids": 32768,
        "target_logsumexp": 1 << 20,
        "target_logits": 2048,
    }
    assert array_specs(3, 128, "float32", 64, 1000, 8 << 20, max_tokens=1 << 20) == configured
    assert array_specs(3, 128, "float32", 64, 1000, 8 << 20, max_tokens=10**9) == configured
    capped = array_specs(3, 128, "float32", 64, 1000, 8 << 20, max_tokens=5000)
    assert {n: s.chunk_tokens for n, s in capped.items()} == {
        **{n: 8192 for n in configured},
        "hidden_states": 4096,  # its 8 MiB chunk is already shorter than the bound
        "target_logits": 2048,
    }
    assert {s.chunk_tokens for s in array_specs(3, 128, "float32", 64, None, 8 << 20, 319).values()} == {512}
    assert {s.chunk_tokens for s in array_specs(3, 128, "float32", 64, None, 8 << 20, 1).values()} == {256}
    assert [s.chunk_tokens for s in sampled_array_specs(20, 8 << 20, 4097).values()] == [8192] * 3
    assert chunk_tokens_for(4, 8 << 20, 0) == 256 and chunk_tokens_for(4, 8 << 20, 256) == 256


def test_a_tiny_extraction_is_stored_in_one_short_chunk_per_array(bf16_cache):
    """4 prompts x 12 new tokens (~320 tokens): each array is one chunk of the power of two at or above
    the tokens extraction could write, not 4096-1M-token chunks (35 MB of padding before)."""
    manifest = json.loads((bf16_cache / "manifest.json").read_text())
    cache = hscache.open_cache(bf16_cache)
    bound = sum(cache.index.column("prompt_len").to_pylist()) + len(cache) * 12  # prompts + max_new_tokens
    expected = max(256, 1 << (bound - 1).bit_length())
    assert cache.num_tokens <= bound <= expected < 2 * bound
    stored = 0
    for name, entry in manifest["arrays"].items():
        spec = ArraySpec.from_dict(name, entry)
        assert spec.chunk_tokens == expected, name
        chunk_files = [p for p in (bf16_cache / "arrays" / name / "c").rglob("*") if p.is_file()]
        assert [p.relative_to(bf16_cache / "arrays" / name).as_posix() for p in chunk_files] == [
            chunk_key(spec, 0)
        ]
        assert chunk_files[0].stat().st_size == spec.chunk_tokens * spec.bytes_per_token + 4  # rows + crc32c
        stored += chunk_files[0].stat().st_size
    assert stored < 1 << 20
    assert (
        sum(p.stat().st_size for p in bf16_cache.rglob("*") if p.is_file()) < 3 << 20
    )  # target/ ~1 MB of it


def test_an_extraction_longer_than_its_chunks_keeps_the_configured_chunk(small_cache):
    """~600 tokens at --chunk-mb 10 KiB: hidden states and top-k keep their configured 256-token chunk
    (the bound, 1024 tokens, is past it); the 1-D arrays' 2048-token chunk is capped at the bound."""
    cache = hscache.open_cache(small_cache.path)
    bound = sum(cache.index.column("prompt_len").to_pylist()) + len(cache) * small_cache.config.max_new_tokens
    assert 512 < cache.num_tokens <= bound <= 1024
    for name, spec in cache.specs.items():
        configured = chunk_tokens_for(spec.bytes_per_token, small_cache.config.chunk_bytes)
        assert (configured, spec.chunk_tokens) == ((2048, 1024) if spec.row_shape == () else (256, 256)), name
        chunks = len(list((small_cache.path / "arrays" / name / "c").iterdir()))
        assert chunks == -(-cache.num_tokens // spec.chunk_tokens), name


def test_float_and_int_arrays_round_trip_exactly(bf16_cache):
    cache = hscache.open_cache(bf16_cache)
    arr = cache.array("target_topk_values")
    assert arr.dtype == np.float32 and arr.attrs["logical_dtype"] == "float32"
    assert cache.array("hidden_states").dtype == np.uint16
    assert cache.array("hidden_states").attrs["logical_dtype"] == "bfloat16"
    whole = torch.from_numpy(np.asarray(cache.array("token_ids")[:]))
    assert torch.equal(torch.cat([cache.token_ids(i) for i in range(len(cache))]), whole.long())


def test_every_chunk_carries_a_crc32c_checksum(bf16_cache):
    meta = json.loads((bf16_cache / "arrays" / "hidden_states" / "zarr.json").read_text())
    assert [c["name"] for c in meta["codecs"]][-1] == "crc32c"


def test_provenance_validates_and_names_the_torch_backend_on_cpu(bf16_cache):
    prov = hscache.open_cache(bf16_cache).provenance
    schemas.validate(prov, "provenance")
    assert prov["capture"]["backend"] == "torch"
    kernels = prov["capture"]["kernels"]
    assert kernels["torch_chunk_gated_delta_rule"]["backend"] == "torch"
    assert kernels["torch_chunk_gated_delta_rule"]["function"].startswith("transformers.models.qwen3_5.")
    assert prov["model"]["layer_types"][3] == "full_attention"
    assert prov["model"]["layer_types"][0] == "linear_attention"
    assert prov["capture"]["layer_ids"] == [1, 3, 7] and prov["capture"]["dtype"] == "bf16"
    # What the run did is in the run log, outside the digest (issue 26, item 1).
    assert not {"timestamps", "versions", "hardware", "command_line"} & set(prov)
    (run,) = read_run_log(bf16_cache)
    assert (
        run["finished_at"] is not None and run["sequences_at_start"] == 0 and run["sequences_at_finish"] == 4
    )
    assert set(run["versions"]) >= {"torch", "transformers", "flash-linear-attention", "triton", "cuda"}


def test_schema_rejects_a_provenance_missing_a_key(bf16_cache):
    prov = hscache.open_cache(bf16_cache).provenance
    del prov["capture"]["kernels"]
    try:
        schemas.validate(prov, "provenance")
    except schemas.SchemaError as exc:
        assert "kernels" in str(exc)
    else:
        raise AssertionError("schema accepted a provenance without capture.kernels")
