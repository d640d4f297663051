"""The backend actually bound is found by inspection, and --backend rebinds it for a run only."""

from __future__ import annotations

import pytest
import torch
import transformers.models.qwen3_5.modeling_qwen3_5 as modeling

from hscache.capture.backend import fla_status, inspect_kernels, resolve_backend, use_backend
from hscache.capture.target import load_target
from hscache.errors import BackendUnavailableError


def _fake_fla_wrapper(torch_function):
    """Mimic what transformers binds when fla imports: a wrapper closing over fla's function."""

    def chunk_gated_delta_rule(*args, **kwargs):
        raise RuntimeError("0 active drivers ([]). There should only be one.")  # what triton says on CPU

    chunk_gated_delta_rule.__module__ = "fla.ops.gated_delta_rule.chunk"
    implementation = chunk_gated_delta_rule

    def wrapped(*args, **kwargs):  # closes over the same names transformers' wrapper does
        chosen = torch_function if implementation is None else implementation
        return chosen(*args, **kwargs)

    return wrapped


def test_auto_picks_torch_on_cpu_and_fla_is_refused_clearly():
    assert resolve_backend("auto", "cpu") == "torch"
    usable, reason = fla_status("cpu")
    assert not usable and "CUDA" in reason
    with pytest.raises(BackendUnavailableError, match="--backend fla cannot run here"):
        resolve_backend("fla", "cpu")


def test_inspection_sees_an_fla_binding_and_torch_backend_replaces_it_for_the_run(monkeypatch):
    target = load_target("builtin:tiny-qwen3.5")
    ids = torch.arange(40)[None] % 500
    with torch.no_grad():
        reference = target.model(input_ids=ids).logits

    original = modeling.torch_chunk_gated_delta_rule
    torch_function = original.__wrapped__ if hasattr(original, "__wrapped__") else original
    fake = _fake_fla_wrapper(torch_function)
    monkeypatch.setattr(modeling, "torch_chunk_gated_delta_rule", fake)
    assert inspect_kernels(target.model)["torch_chunk_gated_delta_rule"].backend == "fla"
    with pytest.raises(RuntimeError, match="0 active drivers"):
        with torch.no_grad():
            target.model(input_ids=ids)  # the crash users hit with fla + triton on a CPU machine

    with use_backend(target.model, "torch") as bound:
        assert bound["torch_chunk_gated_delta_rule"].backend == "torch"
        assert all(b.backend == "torch" for b in bound.values())
        with torch.no_grad():
            logits = target.model(input_ids=ids).logits
    assert torch.equal(logits, reference)
    assert modeling.torch_chunk_gated_delta_rule is fake  # restored after the run


def test_plain_attention_models_have_no_linear_kernels():
    assert inspect_kernels(load_target("builtin:tiny-qwen3").model) == {}


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA and flash-linear-attention (GPU machine)"
)
def test_fla_backend_binds_fla_kernels_on_cuda():
    pytest.importorskip("fla.ops.gated_delta_rule", reason="flash-linear-attention is not installed")
    target = load_target("builtin:tiny-qwen3.5", "bf16", "cuda")
    with use_backend(target.model, "fla") as bound:
        assert bound["torch_chunk_gated_delta_rule"].backend == "fla"
