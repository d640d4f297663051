"""Every on-disk format round-trips: bf16 bits, int ids, float32 stats, the index."""

from __future__ import annotations

import json

import numpy as np
import torch

import hscache
from hscache import schemas
from hscache.store.layout import array_specs
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
