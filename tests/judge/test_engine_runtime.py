"""hscache/engines/vllm mostly without an engine: the checks, the CPU patch's kernel, the rounds placed from
vLLM's counters, vLLM's outputs read back by hscache's --responses-from reader, the judge's tie reading,
and (one engine, in vLLM's venv) start_engine growing a KV cache vLLM refuses."""

from __future__ import annotations

import json

import pytest
import torch

from hscache.capture.responses import iter_responses, responses_sampling
from hscache.engines.vllm.cpu_patch import apply, expand_fill
from hscache.engines.vllm.outputs import greedy_record, responses_record
from hscache.engines.vllm.runtime import VllmTargetError, VllmVersionError, check_version, preflight_target
from hscache.engines.vllm.worker import place_rounds, unrecorded_steps

QWEN3 = {"hidden_size": 128, "num_attention_heads": 4, "head_dim": 32, "layer_types": ["full_attention"] * 2}


def test_versions():
    assert check_version("0.32.0") == "0.32.0"
    assert check_version("0.32.0+cpu") == "0.32.0"
    with pytest.raises(VllmVersionError, match=r"^vLLM 0\.33\.1 is not a version whose rules"):
        check_version("0.33.1")


def test_preflight():
    preflight_target(QWEN3, "fp32")
    with pytest.raises(
        VllmTargetError, match=r"^the target has attention head_dim 24, which vLLM CPU cannot run"
    ):
        preflight_target({**QWEN3, "head_dim": 24}, "fp32")
    preflight_target({**QWEN3, "head_dim": 24}, "fp32", device="cuda")  # GPU limits are vLLM's to report
    hybrid = {**QWEN3, "layer_types": ["linear_attention", "full_attention"], "linear_key_head_dim": 64,
              "linear_value_head_dim": 64}  # fmt: skip
    preflight_target(hybrid, "bf16")
    with pytest.raises(VllmTargetError, match=r"runs in bf16 only .*gdn_attention\.py:158"):
        preflight_target(hybrid, "fp32")
    with pytest.raises(
        VllmTargetError, match=r"^the target has linear_value_head_dim 32, .*_custom_ops\.py:3567"
    ):
        preflight_target({**hybrid, "linear_value_head_dim": 32}, "bf16")


def test_expand_fill_is_the_triton_kernel():
    """vLLM's expand_kernel (rejection_sampler.py:956): request i's value over its tokens, in place."""
    for dtype in (torch.float32, torch.int32, torch.int64):
        values = torch.tensor([5, 0, 7], dtype=dtype)
        cu = torch.tensor([2, 5, 6], dtype=torch.int32)
        out = torch.full((6,), -1, dtype=dtype)
        expand_fill(out, values, cu, 0, 9)
        assert out.tolist() == [5, 5, 9, 9, 9, 7]


def test_the_patch_applies_only_to_the_affected_version():
    assert apply("0.33.0") == []


def test_place_rounds():
    # prompt 10, output of 9 tokens: prefill gives token 0; steps accept 2, 0, 5 (vLLM counts past the end)
    rounds = place_rounds(10, list(range(9)), [2, 0, 5], [3, 3, 3])
    assert rounds == {"anchors": [10, 13, 14], "accepted": [2, 0, 5], "drafted": [3, 3, 3]}
    # ngram: a context ending in token 0 or 3 finds no match (an unrecorded plain step: one token)
    rounds = place_rounds(10, [0, 1, 2, 3, 4, 5, 6], [1, 2], [2, 2], unrecorded=lambda c: c[-1] in (0, 3))
    assert rounds == {"anchors": [10, 11, 13, 14], "accepted": [0, 1, 0, 2], "drafted": [0, 2, 0, 2]}


def test_outputs_are_what_the_responses_reader_reads(tmp_path):
    fields = {"temperature": 0.7, "top_p": 0.9, "top_k": 2, "seed": 3, "logprobs": 5}
    samples = [
        {"token_ids": [7, 8], "finish_reason": "length",
         "logprobs": [[[7, -0.5], [9, -0.9328], [1, -9999.0]], [[8, -0.1], [2, -2.3522], [3, -9999.0]]]},
    ]  # fmt: skip
    path = tmp_path / "served.jsonl"
    path.write_text(json.dumps(responses_record("r1", [1, 2, 3], samples, fields, {"category": "x"})) + "\n")
    setting = responses_sampling(path)
    assert (setting.temperature, setting.top_p, setting.top_k, setting.seed) == (0.7, 0.9, 2, 3)
    (record,) = iter_responses(path, setting)
    assert record.content == [1, 2, 3] and record.metadata == {"category": "x"}
    (choice,) = record.choices
    assert choice.token_ids == (7, 8) and choice.stop_reason == "max_new_tokens"
    assert choice.realised == pytest.approx((0.6065307, 0.9048374))
    assert greedy_record("r2", [1, 2], {"token_ids": [5, 6]}) == {
        "id": "r2",
        "input_ids": [1, 2, 5, 6],
        "prompt_len": 2,
    }


def test_a_relative_vllm_python_is_made_absolute_and_a_bare_name_is_left_to_path(tmp_path, monkeypatch):
    """The workers run in folders of their own: `--vllm-python .vllm/bin/python` (the README's) must name
    the same file there. Made absolute, not resolved: a venv's python is a symlink and must stay one."""
    from hscache.engines.vllm.runtime import vllm_python

    monkeypatch.chdir(tmp_path)
    (tmp_path / "v" / "bin").mkdir(parents=True)
    (tmp_path / "v" / "bin" / "python").symlink_to("/usr/bin/python3")
    assert vllm_python("v/bin/python") == str(tmp_path / "v" / "bin" / "python")
    assert vllm_python("python3") == "python3"
    monkeypatch.setenv("HSCACHE_VLLM_PYTHON", "v/bin/python")
    assert vllm_python() == str(tmp_path / "v" / "bin" / "python")


def test_dtype_steps_counts_representable_values():
    from scorer.studies.vllm_judge import dtype_steps

    assert dtype_steps(4.0, 3.984375, "bf16") == 1  # the measured MTP tie: adjacent bf16 values
    assert dtype_steps(4.0, 3.96875, "bf16") == 2 and dtype_steps(4.03125, 4.0, "bf16") == 1
    assert dtype_steps(4.0, 4.0, "bf16") == 0 and dtype_steps(0.0, -0.0, "bf16") == 0
    assert dtype_steps(2.0**-133, -(2.0**-133), "bf16") == 2  # the smallest subnormals, across zero
    below_one = float(torch.nextafter(torch.tensor(1.0), torch.tensor(0.0)))
    assert dtype_steps(1.0, below_one, "fp32") == 1 and dtype_steps(1.0, 0.5, "fp32") == 1 << 23
    with pytest.raises(ValueError, match="choose bf16 or fp32"):
        dtype_steps(1.0, 0.0, "fp16")


def test_first_difference_draft_reads_vllms_own_decision():
    from scorer.studies.vllm_judge import first_difference_draft

    # prompt of 10; vLLM's output; round at anchor 12 drafted 2 slots: slot 0 accepted by both sides,
    # slot 1 accepted by vLLM only (its top draft 7 is the served token at 12 + 1 + 1 = 14)
    request = {
        "token_ids": [1, 2, 3, 5, 7, 9],
        "draft_top2": {"12": [[5, 3.0, 6, 1.0], [7, 4.0, 8, 3.984375]]},
    }
    vllm_ahead = {"offline_anchor": 12, "vllm_anchor": 12, "offline_accepted": 1, "vllm_accepted": 2}
    draft = first_difference_draft(vllm_ahead, request, 10, "bf16")
    assert draft == {"slot": 1, "tokens": [7, 8], "logits": [4.0, 3.984375], "dtype": "bf16", "steps": 1,
                     "tie": True}  # fmt: skip
    assert first_difference_draft(vllm_ahead, request, 10, "fp32")["tie"] is False  # 131072 fp32 steps
    # the offline side accepted where vLLM did not: a tie only if the served token is vLLM's SECOND choice
    offline_ahead = {**vllm_ahead, "offline_accepted": 2, "vllm_accepted": 1}
    assert first_difference_draft(offline_ahead, request, 10, "bf16")["tie"] is False  # served 7 is its first
    request["draft_top2"]["12"][1] = [8, 4.0, 7, 3.984375]
    assert first_difference_draft(offline_ahead, request, 10, "bf16")["tie"] is True
    far = {"12": [[5, 3.0, 6, 1.0], [8, 4.0, 7, 3.5]]}
    assert first_difference_draft(offline_ahead, {**request, "draft_top2": far}, 10, "bf16")["tie"] is False
    # nothing recorded there (n-gram), or the sides already at different anchors: no verdict
    assert first_difference_draft(vllm_ahead, {**request, "draft_top2": {}}, 10, "bf16") is None
    assert first_difference_draft({**vllm_ahead, "vllm_anchor": 13}, request, 10, "bf16") is None


def test_a_kv_cache_shortfall_is_read_from_vllms_refusal():
    """vLLM 0.32.0's refusal of a KV cache smaller than one request (kv_cache_utils.py:1030), as it
    refused bench/real_dims.py's target with the 64 MB the tests' tiny targets need: start_engine
    retries once with room for it."""
    from hscache.engines.vllm.runtime import kv_cache_needed_bytes

    seen = (
        "To serve at least one request with the model's max seq len (161), (0.09 GiB KV cache is needed, which "
        "is larger than the available KV cache memory (0.06 GiB). Try increasing `gpu_memory_utilization`"
    )
    assert kv_cache_needed_bytes(seen, 64 << 20) == int(0.09 * 2**30)
    # a tiny target: vLLM's figure rounds to 0.0 GiB, the length it says fits scales what was given
    tiny = (
        "To serve at least one request with the model's max seq len (512), (0.0 GiB KV cache is needed, which "
        "is larger than the available KV cache memory (0.0 GiB). Based on the available memory, the estimated "
        "maximum model length is 256. Try increasing `gpu_memory_utilization`"
    )
    assert kv_cache_needed_bytes(tiny, 1_000_000) == 2_000_000
    assert kv_cache_needed_bytes(tiny.replace("is 256", "is 0"), 1_000_000) == 1_000_001  # never less
    assert kv_cache_needed_bytes("No available memory for the cache blocks.", 1_000_000) is None


def test_an_engine_given_too_small_a_kv_cache_starts_with_a_larger_one(vllm_python, judge_caches):
    """start_engine in vLLM itself: 1 MB holds no request of 512 tokens of the built-in tiny-qwen3 (vLLM's
    refusal reads "0.0 GiB ... needed" and gives no length); the retries grow it until vLLM starts."""
    import os
    import subprocess
    from pathlib import Path

    import hscache
    from hscache.engines.vllm.capture import model_directory

    settings = hscache.open_cache(judge_caches["t0"]).settings
    target = model_directory(settings["model"], settings["weights_sha256"])
    code = (
        "import os; from hscache.engines.vllm.runtime import engine_env, engine_kwargs, start_engine\n"
        "os.environ.update(engine_env())\n"
        f"kwargs = dict(engine_kwargs({str(target)!r}, dtype='fp32', max_model_len=512), kv_cache_memory_bytes=10**6)\n"
        "llm = start_engine(kwargs)\n"
        "print('KV', llm.llm_engine.vllm_config.cache_config.kv_cache_memory_bytes)\n"
    )
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run([vllm_python, "-c", code], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": str(root)})  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    kv = int(next(line for line in done.stdout.splitlines() if line.startswith("KV")).split()[1])
    assert kv == 4 * 10**6  # one retry: max(2 x vLLM's figure, 4 x the 1 MB it had)


def test_unrecorded_steps_call_the_named_proposer_on_each_context(tmp_path, monkeypatch):
    """The job names the proposer (the family computed it: scorer/families/ngram/served.py); the worker
    imports it by name, calls it on the prompt + tokens so far with the entry's args, and a step is
    unrecorded where it proposes nothing."""
    (tmp_path / "toy_proposer.py").write_text(
        "import numpy as np\nCALLS = []\n"
        "def propose(context, lo, hi):\n"
        "    CALLS.append((context.dtype.name, context.tolist(), lo, hi))\n"
        "    return context[-1:] if lo <= context[-1] <= hi else np.zeros(0, np.int32)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    import toy_proposer

    unrecorded = unrecorded_steps({"proposer": "toy_proposer:propose", "args": [3, 5]}, [9, 9])
    assert unrecorded([1]) is True and unrecorded([1, 4]) is False
    assert toy_proposer.CALLS == [("int32", [9, 9, 1], 3, 5), ("int32", [9, 9, 1, 4], 3, 5)]
    # placed on an output: a context ending in 1 finds nothing (a plain one-token step), one ending in 4 is recorded
    rounds = place_rounds(2, [1, 4, 1, 4, 7], [1, 0], [2, 2], unrecorded=unrecorded_steps(
        {"proposer": "toy_proposer:propose", "args": [3, 5]}, [9, 9]))  # fmt: skip
    assert rounds == {"anchors": [2, 3, 5], "accepted": [0, 1, 0], "drafted": [0, 2, 2]}


def test_a_relative_workdir_reaches_the_worker(tmp_path, monkeypatch):
    """The worker runs with cwd=workdir: a relative ``--workdir`` once handed it ``wg/engine/job.json``,
    a path that did not exist from there. ``python -m json.tool JOB OUT`` stands in for the worker."""
    import sys

    from hscache.engines.vllm.runtime import run_worker

    monkeypatch.chdir(tmp_path)
    job = {"engines": [{"method": "ngram"}], "k": 3}
    assert run_worker("json.tool", job, "wg/engine", python=sys.executable) == job
    assert (tmp_path / "wg" / "engine" / "result.json").is_file()


def test_proposed_steps_reads_each_recorded_draft_length_once_in_order():
    from hscache.engines.vllm.worker import proposed_steps

    unrecorded = proposed_steps([3, 0, 2, 0])
    assert [unrecorded([]) for _ in range(6)] == [False, True, False, True, False, False]
