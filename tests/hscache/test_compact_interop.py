"""hs-connectors' fp8 files (speculators' ``--hidden-states-backend fp8``): ``hscache import --format vllm``
and ``--format speculators`` read them dequantised, ``hscache export --format speculators --states fp8``
writes them; checked against the format's formula here and, where it is installed, hs-connectors' own
quantiser and reader (``pip install --no-deps --target .peers hs-connectors==0.9.0``)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

import hscache
from hscache.cli import main
from hscache.interop.vllm import import_vllm

PEERS = Path(__file__).resolve().parents[2] / ".peers"


def _connector_fp8(hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The fp8 backend's formula (hs_connectors/fp8_utils.py): one absmax/448 scale per token."""
    scale = (hidden.float().abs().amax(dim=(1, 2), keepdim=True) / 448.0).clamp(min=1e-12)
    return (hidden.float() / scale).to(torch.float8_e4m3fn), scale


def test_import_vllm_reads_fp8_connector_files_dequantised(tmp_path):
    source = tmp_path / "files"
    source.mkdir()
    want = []
    for i in range(2):
        hidden = torch.randn(5 + i, 3, 64) * torch.tensor([1.0, 10.0, 600.0])[:, None]  # a layer past 448
        fp8, scale = _connector_fp8(hidden)
        save_file(
            {"hidden_states": fp8, "hidden_states_scales": scale, "token_ids": torch.arange(5 + i)},
            str(source / f"{i}-ab12.safetensors"),
        )
        want.append(fp8.float() * scale)
    import_vllm(source, tmp_path / "out", [2, 4, 8])
    cache = hscache.open_cache(tmp_path / "out")
    assert cache.dtype == torch.float32
    got = {cache.index.column("record_id")[r].as_py(): cache.hidden_states(r) for r in range(len(cache))}
    for i in range(2):
        assert torch.equal(got[f"{i}-ab12"], want[i])  # fp8 x scale is exact in float32
    bad = source / "2-ab12.safetensors"
    save_file(
        {"hidden_states": fp8, "hidden_states_scales": scale[:, 0], "token_ids": torch.arange(6)}, str(bad)
    )
    result = CliRunner().invoke(
        main,
        ["import", "--format", "vllm", str(source), "--out", str(tmp_path / "o2"), "--layer-ids", "2,4,8"],
    )
    assert result.exit_code == 2 and "hs-connectors' fp8 files hold F8_E4M3" in result.output
    bad.unlink()
    result = CliRunner().invoke(
        main,
        ["import", "--format", "vllm", str(source), "--out", str(tmp_path / "o3"), "--layer-ids", "2,4,8"]
        + ["--states", "fp8"],
    )
    assert result.exit_code == 0, result.output
    compact = hscache.open_cache(tmp_path / "o3")
    assert "states" in compact.manifest and compact.dtype == torch.float32
    for r in range(len(compact)):  # requantised per token and layer: the codec's error, not more
        i = int(compact.index.column("record_id")[r].as_py().split("-")[0])
        assert (compact.hidden_states(r) - want[i]).norm() / want[i].norm() < 0.04


@pytest.fixture(scope="module")
def exported(bf16_cache, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("export") / "spec"
    result = CliRunner().invoke(
        main, ["export", str(bf16_cache), "--format", "speculators", "--out", str(out), "--states", "fp8"]
    )
    assert result.exit_code == 0, result.output
    return out


def test_export_states_fp8_writes_the_connector_format_and_reads_back(bf16_cache, exported, tmp_path):
    cache = hscache.open_cache(bf16_cache)
    for i in range(len(cache)):
        tensors = load_file(str(exported / "hidden_states" / f"hs_{i}.safetensors"))
        assert set(tensors) == {"hidden_states", "hidden_states_scales", "token_ids"}
        fp8, scale = _connector_fp8(cache.hidden_states(i))
        assert torch.equal(tensors["hidden_states"].view(torch.uint8), fp8.view(torch.uint8))
        assert torch.equal(tensors["hidden_states_scales"], scale)
    back = tmp_path / "back"
    result = CliRunner().invoke(
        main, ["import", "--format", "speculators", str(exported), "--out", str(back)]
    )
    assert result.exit_code == 0, result.output
    imported = hscache.open_cache(back)
    tensors = load_file(str(exported / "hidden_states" / "hs_1.safetensors"))
    want = tensors["hidden_states"].float() * tensors["hidden_states_scales"]
    assert torch.equal(imported.hidden_states(1), want)
    rel = (want - cache.hidden_states(1).float()).norm() / cache.hidden_states(1).float().norm()
    assert rel < 0.05  # one scale per token over all layers: ~2.6% (spec/compact.md)
    result = CliRunner().invoke(
        main,
        ["export", str(bf16_cache), "--format", "specforge", "--out", str(tmp_path / "f"), "--states", "fp8"],
    )
    assert result.exit_code == 2 and "--format speculators only" in result.output


@pytest.fixture(scope="module")
def hs_connectors():
    saved = list(sys.path)
    sys.path.append(str(PEERS))
    try:
        if importlib.util.find_spec("hs_connectors") is None:
            pytest.skip(
                "hs-connectors not installed: pip install --no-deps --target .peers hs-connectors==0.9.0"
            )
        from hs_connectors import fp8_utils, transfer

        yield fp8_utils, transfer
    finally:
        sys.path[:] = saved


def test_hs_connectors_reads_the_export_and_quantises_as_hscache(bf16_cache, exported, hs_connectors):
    fp8_utils, transfer = hs_connectors
    cache = hscache.open_cache(bf16_cache)
    reader = transfer.FP8Transfer(exported / "hidden_states", dequantize_dtype=torch.float32)
    for i in range(len(cache)):
        theirs_fp8, theirs_scale = fp8_utils.quantize_tensor_to_fp8(cache.hidden_states(i))
        ours = load_file(str(exported / "hidden_states" / f"hs_{i}.safetensors"))
        assert torch.equal(ours["hidden_states"].view(torch.uint8), theirs_fp8.view(torch.uint8))
        assert torch.equal(ours["hidden_states_scales"], theirs_scale)
        sample = reader.get_cached(i)  # what speculators' ArrowDataset calls (train/data.py)
        assert set(sample) == {"hidden_states", "token_ids"}
        assert torch.equal(sample["hidden_states"], theirs_fp8.float() * theirs_scale)
        assert torch.equal(sample["token_ids"], cache.token_ids(i))
