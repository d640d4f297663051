"""The steps of bench/gpu_check.py: plan sizes, install, targets, extract, diff, score, throughput.

Every step function returns a JSON-ready dict (``_status: "skipped"`` plus ``reason`` to skip
itself) or raises; the runner records either. The project's packages are imported inside the
steps, after the install step has put their dependencies in place.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import json
import re
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
# Installed from the carried wheels; setuptools builds the editable install without network.
TOP_LEVEL = (
    "setuptools>=77",
    "zarr",
    "numcodecs",
    "dask",
    "distributed",
    "jsonschema",
    "flash-linear-attention",
    "pytest",
)
IMPORTS = ("zarr", "numcodecs", "dask.array", "distributed", "jsonschema", "pytest", "fla")
SETTINGS = (("fla-cuda", "fla", "gpu"), ("torch-cuda", "torch", "gpu"), ("torch-cpu", "torch", "cpu"))
TARGETS = ("builtin", "real")


@dataclass
class Plan:
    """Sizes and devices of one run: ``for_gpu()`` for the H200, ``for_dry_run()`` for the CPU test."""

    dry_run: bool
    gpu: str  # the device standing for "cuda" (cpu in a dry run)
    fla_backend: str  # "fla", or "torch" standing in for it in a dry run
    budget_s: float
    builtin_limit: int
    builtin_new_tokens: int
    builtin_layers: str
    train_steps: int
    block_size: int
    ddtree: tuple[int, ...]
    real: dict[str, Any]  # shape-real target: real vocab, heads and layer pattern; narrower, shallower
    real_limit: int
    real_new_tokens: int
    real_layers: str
    real_eval_limit: int
    throughput_batches: tuple[int, ...]
    throughput_new_tokens: int
    throughput_min_prompts: int
    pytest_args: list[str] = field(default_factory=list)
    pytest_timeout_s: int = 180
    flex_rows: int = 4  # sequences of the reference cache drafted with flex and with SDPA
    flex_anchors: int | None = None  # the first anchors of each (None: all); uncompiled CPU flex is slow

    @classmethod
    def for_gpu(cls) -> Plan:
        """Fits about 8 minutes on one H200 (the device tool allows 10 per command)."""
        return cls(
            dry_run=False,
            gpu="cuda",
            fla_backend="fla",
            budget_s=420.0,
            builtin_limit=16,
            builtin_new_tokens=48,
            builtin_layers="1,3,5,7",
            train_steps=150,
            block_size=6,
            ddtree=(8, 32),
            real=_real_dims(hidden=2048, intermediate=6144, layers=4, vocab=248320),
            real_limit=8,
            real_new_tokens=32,
            real_layers="1,2,3",
            real_eval_limit=4,
            throughput_batches=(1, 16, 64),
            throughput_new_tokens=32,
            throughput_min_prompts=8,
            pytest_args=["tests"],
            pytest_timeout_s=180,
            flex_rows=4,
        )

    @classmethod
    def for_dry_run(cls) -> Plan:
        """The same steps at tiny sizes on the CPU; torch stands in for fla. One prompt a target and two
        new tokens: every step still generates, replays, trains and scores (the test suite runs it)."""
        return cls(
            dry_run=True,
            gpu="cpu",
            fla_backend="torch",
            budget_s=300.0,
            builtin_limit=1,
            builtin_new_tokens=2,
            builtin_layers="1,3,7",
            train_steps=2,
            block_size=4,
            ddtree=(4,),
            real=_real_dims(
                hidden=64, intermediate=128, layers=4, vocab=1024, heads=(2, 1, 32), linear=(2, 4, 16)
            ),
            real_limit=1,
            real_new_tokens=2,
            real_layers="1,2,3",
            real_eval_limit=1,
            throughput_batches=(1, 2),
            throughput_new_tokens=2,
            throughput_min_prompts=2,
            pytest_args=["tests/hscache/test_backend.py"],
            pytest_timeout_s=120,
            flex_rows=1,
            flex_anchors=6,
        )

    def device(self, kind: str) -> str:
        return self.gpu if kind == "gpu" else "cpu"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _real_dims(
    hidden: int,
    intermediate: int,
    layers: int,
    vocab: int,
    heads: tuple[int, int, int] = (24, 4, 256),
    linear: tuple[int, int, int] = (16, 48, 128),
) -> dict[str, Any]:
    """Qwen3.6-27B's text config (spec/scale.md) with width and depth as given."""
    return {
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": intermediate,
        "num_hidden_layers": layers,  # layer_types default: [linear, linear, linear, full] repeated
        "num_attention_heads": heads[0],
        "num_key_value_heads": heads[1],
        "head_dim": heads[2],
        "linear_num_key_heads": linear[0],
        "linear_num_value_heads": linear[1],
        "linear_key_head_dim": linear[2],
        "linear_value_head_dim": linear[2],
        "linear_conv_kernel_dim": 4,
        "tie_word_embeddings": False,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25},
    }


def skipped(reason: str) -> dict[str, Any]:
    return {"_status": "skipped", "reason": reason}


def vllm_engines(plan: Plan, model: str, layers: str, sizes: dict[str, Any], out: Path) -> dict[str, Any]:
    """bench/engines.py on the device: ``hscache extract`` with transformers and with vLLM (tokens/s,
    bytes per token), where vLLM is installed in this interpreter (issue 34)."""
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        return skipped(
            "vLLM is not installed in this interpreter (add a vllm==0.32.0 wheel to the carried wheels)"
        )
    if plan.dry_run:
        return skipped("dry run: the vLLM engine bench runs on the device")
    spec = importlib.util.spec_from_file_location("engines_bench", Path(__file__).with_name("engines.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    args = ["--model", model, "--dtype", "bf16", "--layers", layers, "--device", plan.gpu, "--json", str(out)]
    args += ["--max-new-tokens", str(sizes["max_new_tokens"]), "--limit", str(sizes["limit"])]
    return module.main(args)


# ---------------------------------------------------------------- install, environment, pytest


def install(plan: Plan, wheels: Path) -> dict[str, Any]:
    """Offline: the carried wheels (pip resolves against what the device has), then the project."""
    if plan.dry_run:
        return skipped("dry run: no installs")
    if not wheels.is_dir():
        raise FileNotFoundError(
            f"{wheels} is missing: run bench/prepare_gpu_wheels.sh before the device run and carry it"
        )
    pip = [sys.executable, "-m", "pip", "install", "--no-index", "--find-links", str(wheels)]
    runs = {"wheels": _run([*pip, *TOP_LEVEL])}
    if runs["wheels"]["rc"] != 0 and "ermission denied" in runs["wheels"]["tail"]:  # read-only site-packages
        pip.append("--user")
        runs["wheels_user"] = runs["wheels"] = _run([*pip, *TOP_LEVEL])
    if runs["wheels"]["rc"] != 0:  # resolution failed: install each carried wheel the device lacks
        missing = [w for w in sorted(wheels.glob("*.whl")) if not _installed(w.name.split("-")[0])]
        runs["wheels_fallback"] = _run([*pip, "--no-deps", *map(str, missing)]) if missing else {"rc": 0}
    runs["project"] = _run([*pip, "--no-deps", "--no-build-isolation", "-e", str(ROOT)])
    importlib.invalidate_caches()
    imports = {}
    for name in IMPORTS:
        try:
            importlib.import_module(name)
            imports[name] = "ok"
        except Exception as exc:
            imports[name] = f"{type(exc).__name__}: {exc}"[:300]
    result = {"runs": runs, "imports": imports}
    if any(v != "ok" for k, v in imports.items() if k != "fla"):
        raise RuntimeError(f"after the offline install some modules do not import: {imports}")
    return result


def _installed(wheel_name: str) -> bool:
    try:
        importlib.metadata.version(wheel_name.replace("_", "-"))
        return True
    except importlib.metadata.PackageNotFoundError:
        return False


def _run(cmd: list[str], timeout: float = 300) -> dict[str, Any]:
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
    return {
        "cmd": " ".join(cmd[2:6]) + " ...",
        "rc": done.returncode,
        "tail": (done.stdout + done.stderr)[-1500:],
    }


def environment(plan: Plan) -> dict[str, Any]:
    """Versions, the device, whether fla can run, and which optional flags this checkout has."""
    import dataclasses

    import torch

    from hscache.capture.backend import fla_status
    from hscache.capture.extract import ExtractConfig
    from hscache.cli import extract as extract_command

    # The CLI passes its options to ExtractConfig by name: the option's name is the field's.
    batch_param = next((p.name for p in extract_command.params if "--generate-batch" in p.opts), None)
    fields = {f.name for f in dataclasses.fields(ExtractConfig)}

    versions = {}
    for name in (
        "torch",
        "transformers",
        "triton",
        "flash-linear-attention",
        "fla-core",
        "zarr",
        "dask",
        "numpy",
    ):
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    cuda = torch.cuda.is_available()
    usable, why = fla_status("cuda")
    return {
        "python": sys.version.split()[0],
        "versions": versions,
        "torch_cuda": torch.version.cuda,
        "cuda_available": cuda,
        "gpu_name": torch.cuda.get_device_name(0) if cuda else None,
        "gpu_memory_gib": round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1)
        if cuda
        else None,
        "fla_usable": usable,
        "fla_status": why,
        "generate_batch_param": batch_param if batch_param in fields else None,
    }


def pytest_gpu(plan: Plan, timeout_s: float, python: Sequence[str] = (sys.executable,)) -> dict[str, Any]:
    """``pytest -m gpu`` in a child process; counts per outcome and the failing tests' names.

    ``python`` is the interpreter command line (a test passes one that cannot import pytest).
    """
    cmd = [*python, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider", *plan.pytest_args]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, cwd=ROOT, check=False)
        out, rc = done.stdout + done.stderr, done.returncode
    except subprocess.TimeoutExpired as exc:  # keep what ran: the counts so far and the last lines
        out = "".join(x.decode() if isinstance(x, bytes) else (x or "") for x in (exc.stdout, exc.stderr))
        raise RuntimeError(
            f"pytest -m gpu still running after {timeout_s:.0f} s; output so far: {out[-1500:]}"
        ) from None
    counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|skipped|errors?|deselected)", out)}
    result = {
        "rc": rc,
        "counts": counts,
        "failed": re.findall(r"^(?:FAILED|ERROR) (\S+)", out, flags=re.M),
        "skip_reasons": sorted(set(re.findall(r"^SKIPPED \[\d+\] \S+: (.*)$", out, flags=re.M)))[:10],
        "tail": out[-3000:],
    }
    if rc != 0 and re.search(r"No module named '?pytest'?$", out, flags=re.M):
        # Not a test failure: say what is missing instead of "exit 1: {}; failed: []".
        raise RuntimeError(
            f"pytest is not installed for {' '.join(python)}: install it (pip install pytest, or the "
            "package's [dev] extra) and re-run this step"
        )
    if rc not in (0, 5):  # 5: nothing collected
        raise RuntimeError(f"pytest -m gpu exit {rc}: {counts}; failed: {result['failed']}")
    return result


# ---------------------------------------------------------------- targets and caches


def build_real_target(plan: Plan, out: Path) -> dict[str, Any]:
    """A local HF directory: Qwen3_5ForCausalLM at the real vocab/head dims, random bf16 weights."""
    import torch
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    from hscache.capture.builtin import build_tokenizer

    tokenizer = build_tokenizer()
    config = Qwen3_5TextConfig(
        **plan.real, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.eos_token_id
    )
    device = plan.gpu if plan.gpu.startswith("cuda") else "cpu"  # random init is fast on the GPU
    with torch.random.fork_rng(devices=[]), torch.device(device):
        torch.manual_seed(0)
        previous = torch.get_default_dtype()
        torch.set_default_dtype(torch.bfloat16)
        try:
            model = Qwen3_5ForCausalLM(config)
        finally:
            torch.set_default_dtype(previous)
    params = sum(p.numel() for p in model.parameters())
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    del model
    return {"path": str(out), "params": params, "layer_types": list(config.layer_types), **plan.real}


class _Timer:
    """extract()'s progress hooks: the time from the first batch to the last, without model load."""

    def start(self, total_sequences: int, total_prompt_tokens: int, done_sequences: int) -> None:
        self.t0 = time.perf_counter()
        self.t1 = self.t0

    def advance(self, sequences: int, tokens: int) -> None:
        self.t1 = time.perf_counter()

    def finish(self) -> None:
        self.t1 = time.perf_counter()


def extract_cache(
    plan: Plan,
    model: str,
    out: Path,
    backend: str,
    device: str,
    layers: str,
    replay: Path | None,
    **sizes: Any,
) -> dict[str, Any]:
    """One bf16 cache: the reference generates, the others replay its token ids (max_new_tokens 0)."""
    import hscache

    config = hscache.ExtractConfig(
        out=str(out),
        model=model,
        layers=layers,
        dtype="bf16",
        backend=backend,
        device=device,
        overwrite=True,
        commit_every_s=30.0,
        **({"prompts": str(replay), "max_new_tokens": 0} if replay else sizes),
    )
    timer = _Timer()
    result = hscache.extract(config, timer)
    capture = result.provenance["capture"]
    cache = hscache.open_cache(out)
    generated = sum(
        a - b
        for a, b in zip(
            cache.index.column("length").to_pylist(), cache.index.column("prompt_len").to_pylist()
        )
    )
    seconds = max(timer.t1 - timer.t0, 1e-9)
    return {
        "role": "replay" if replay else "reference",
        "backend": capture["backend"],
        "kernels": sorted({k["backend"] for k in capture["kernels"].values()}),
        "device": capture["device"],
        "sequences": result.sequences,
        "tokens": result.tokens,
        "generated_tokens": 0 if replay else generated,
        "seconds_total": round(result.seconds, 3),
        "seconds_forward": round(seconds, 3),
        "tokens_per_s": round(result.tokens / seconds, 1),
        "generated_tokens_per_s": None if replay else round(generated / seconds, 1),
    }


def extract_setting(
    plan: Plan,
    model: str,
    out: Path,
    backend: str,
    device: str,
    layers: str,
    reference: Path | None,
    replay: Path,
    sizes: dict[str, Any],
) -> dict[str, Any]:
    """The first cache built generates; later ones replay its token ids (written once, on demand)."""
    if reference is None:
        return extract_cache(plan, model, out, backend, device, layers, None, **sizes)
    if not replay.exists():
        replay_prompts(reference, replay)
    return extract_cache(plan, model, out, backend, device, layers, replay)


def replay_prompts(reference: Path, path: Path) -> Path:
    """The reference cache's token ids as input_ids records, prompt boundaries kept."""
    import hscache

    cache = hscache.open_cache(reference)
    index = cache.index
    with path.open("w") as f:
        for row, (rid, plen) in enumerate(
            zip(index.column("record_id").to_pylist(), index.column("prompt_len").to_pylist())
        ):
            f.write(
                json.dumps({"id": rid, "input_ids": cache.token_ids(row).tolist(), "prompt_len": int(plen)})
                + "\n"
            )
    return path
