"""Shared test helpers: small caches of the built-in targets, built once per session."""

from __future__ import annotations

import gc
import json
import os
from pathlib import Path

import pytest
import torch
import transformers

import hscache

transformers.logging.set_verbosity_error()
# Chunk checks stay in-process (store/verified_log.py off): a test must never trust, or write to, the
# verification log in the user's home; the tests of the log point it at a temporary directory.
os.environ["HSCACHE_VERIFIED_DIR"] = "off"
# One intra-op thread in this process and every process it starts (CLI subprocesses, dask workers):
# the tests' models are tiny, where a second thread only spins (measured: the suite's CPU time fell
# from 544 to the README's figure), and on a busy 2-core machine it waits on the other jobs. A test
# that needs a thread pool sets one itself (tests/scorer/test_round_four_scorer.py); OMP_NUM_THREADS
# set by the caller is kept.
os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
# Full (generation 2) garbage collections 10x rarer than CPython's default (threshold 10 -> 100 young
# collections): each walks the whole heap, which torch, transformers, pandas and vLLM's imports make
# ~1M objects, for the few cycles the tests leave. Cycles are still collected, later. Measured with
# gc.callbacks (2026-12-07, shared 2-core VM): test_eagle3.py + test_served_vs_online.py spent 1.43
# CPU-s in 13 full collections, 0.16 in 1; peak RSS 617 -> 650 MB. The CLI server tests/hscache forks
# its runs from inherits the setting; dask's forkserver starts a fresh interpreter (the default).
gc.set_threshold(*gc.get_threshold()[:2], 100)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The test files that use the shared dask cluster (``dask_client``) run last, in their order: the
    cluster then lives from their first test to the session's end, not across the whole suite (idle,
    its scheduler and two workers spend ~1 CPU-s per minute, measured: 0.54 + 0.45 CPU-s in 60 s)."""
    users = {item.path for item in items if "dask_client" in getattr(item, "fixturenames", ())}
    items[:] = [item for item in items if item.path not in users] + [
        item for item in items if item.path in users
    ]


# What a skipped test needs, told by its skip reason, and how to provide it (the README's "Run the
# tests" sequence): the end of a run says it, so a run that never reached vLLM says how to reach it.
SKIP_GROUPS: tuple[tuple[str, tuple[str, ...], str], ...] = (
    # before vLLM's: its reason names the vLLM env too, which it is built after
    ("Arctic suffix tree", (".ci/arctic-suffix.sh",), "run `bash .ci/arctic-suffix.sh` to run them"),
    ("vLLM", (".ci/vllm-env.sh",), "run `bash .ci/vllm-env.sh` to run them"),
    (
        "peer oracles",
        (".peers",),
        "run `.venv/bin/pip install -q --no-deps --target .peers speculators==0.9.0 specforge==0.2.0 "
        "nemo-automodel==0.7.0 hs-connectors==0.9.0` to run them",
    ),
    ("browser", ("chromium",), "run `apt-get install chromium` to run them"),
    ("dev extras", ("moto", "s3fs", "`datasets`"), 'run `.venv/bin/pip install -e ".[dev]"` to run them'),
    ("GPU", ("CUDA", "flash-linear-attention"), "they run on a CUDA machine (`pytest -m gpu` there)"),
)


def skip_summary(reasons: list[str]) -> list[str]:
    """One line per SKIP_GROUPS group that skip ``reasons`` fall in, in its order: "N tests skipped
    (group): how to run them"; reasons in no group are counted on one last line."""
    counts = dict.fromkeys([name for name, _, _ in SKIP_GROUPS] + ["other"], 0)
    for reason in reasons:
        name = next((name for name, marks, _ in SKIP_GROUPS if any(m in reason for m in marks)), "other")
        counts[name] += 1
    how = {name: command for name, _, command in SKIP_GROUPS} | {"other": "`pytest -rs` lists why"}
    return [
        f"{n} {'tests' if n > 1 else 'test'} skipped ({name}): {how[name]}" for name, n in counts.items() if n
    ]


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """At the end of a run, after pytest's short summary (the outermost wrapper finishes last), how to
    run the tests it skipped (``skip_summary``)."""
    result = yield
    reasons = [
        report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        for report in terminalreporter.stats.get("skipped", [])
    ]
    lines = skip_summary(reasons)
    if lines:
        terminalreporter.write_sep("-", "skipped tests, and how to run them")
        for line in lines:
            terminalreporter.write_line(line)
    return result


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


@pytest.fixture(scope="session")
def fp32_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Built-in hybrid target, fp32, 4 prompts with 12 greedy tokens, all 8 layers."""
    out = tmp_path_factory.mktemp("cache") / "fp32"
    hscache.extract(
        hscache.ExtractConfig(
            out=str(out), layers="0,1,2,3,4,5,6,7", max_new_tokens=12, dtype="fp32", limit=4
        )
    )
    return out


@pytest.fixture(scope="session")
def bf16_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("cache") / "bf16"
    hscache.extract(
        hscache.ExtractConfig(out=str(out), layers="1,3,7", max_new_tokens=12, dtype="bf16", limit=4)
    )
    return out


@pytest.fixture(scope="session")
def scale_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The cache of the distributed/sweep/remote tests: fp32, layers 1,3,7, 4 prompts x 12 tokens."""
    out = tmp_path_factory.mktemp("scale") / "cache"
    hscache.extract(
        hscache.ExtractConfig(out=str(out), layers="1,3,7", max_new_tokens=12, dtype="fp32", limit=4)
    )
    return out


# The sampled cache's settings (tests/hscache/test_sampled_extract.py rebuilds it through the CLI).
SAMPLED_CACHE_CONFIG = dict(
    layers="1,3",
    max_new_tokens=16,
    dtype="fp32",
    limit=3,
    full_logits=True,  # the tests recompute the processed distribution from the cached logits
    commit_every_s=0.0,
    mtp=False,
)
SAMPLED_CACHE_FLAGS = ("--sampling", "qwen-thinking", "--samples-per-prompt", "2", "--seed", "7")


@pytest.fixture(scope="session")
def sampled_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Built-in hybrid target sampled at Qwen's thinking preset (T 1, top-p 0.95, top-k 20, presence
    1.5), seed 7: 3 prompts x 2 samples x 16 tokens, fp32, layers 1,3, full logits; one torch thread
    (resumed and re-run extractions are compared with it bit for bit)."""
    import torch

    from hscache.store.sampling import SamplingSetting

    out = tmp_path_factory.mktemp("sampled") / "cache"
    sampling = SamplingSetting.from_flags("qwen-thinking", samples_per_prompt=2, seed=7)
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        hscache.extract(hscache.ExtractConfig(out=str(out), sampling=sampling, **SAMPLED_CACHE_CONFIG))
    finally:
        torch.set_num_threads(before)
    return out


@pytest.fixture(scope="session")
def vllm_python(tmp_path_factory: pytest.TempPathFactory):
    """The interpreter of vLLM's venv (`.vllm`, built by `bash .ci/vllm-env.sh`) for the tests that run
    vLLM: a client of one warm process that imported vLLM once (tests/vllm_zygote.py), so each run
    there skips vLLM's ~16 CPU-s import. Skips without the venv."""
    root = Path(__file__).resolve().parents[1]
    real = root / ".vllm" / "bin" / "python"
    if not real.exists():
        pytest.skip(f"no vLLM environment at {real}: `bash .ci/vllm-env.sh` builds it (CI always does)")
    from hscache.engines.vllm.runtime import engine_env
    from tests.vllm_zygote import Zygote

    zygote = Zygote(real, root, tmp_path_factory.mktemp("vllm-zygote"), engine_env())
    yield str(zygote.python)
    zygote.close()


@pytest.fixture(scope="session")
def dask_client():
    """One LocalCluster (2 single-threaded worker processes) for every test that needs dask:
    starting one takes ~10 s on a 2-core machine.

    The workers are forked by a forkserver that imported torch, hscache and the scorer once
    (~3 CPU-s), where each spawned worker (distributed's default) imports them itself (~3.5 CPU-s
    each); they are still separate processes that receive their tasks pickled, as spawned ones.
    It also imports what an extraction of the built-in target imports (test_shards.py's two shard
    workers each imported it themselves: ~2 CPU-s each) and then freezes its heap (tests/frozen_heap.py).
    Measured back to back (2026-12-07, shared 2-core VM, noisy): test_shards.py 11.3 -> 8.3 CPU-s; the
    dask tests of test_distributed.py and test_data.py, which extract nothing, 7.8 -> 8.5."""
    import dask
    from distributed.utils import get_mp_context

    from hscache.cluster import cluster_client

    # Idle, the cluster lives from its first test to the session's end: with distributed's default
    # monitors (profiler every 10 ms, memory every 100 ms, system every 500 ms, event-loop tick
    # every 20 ms) it spent ~0.14 CPU-s per wall second doing nothing (measured: 4.2 CPU-s in 30 s
    # idle; these settings: 0.33 CPU-s in 20 s). None of them changes what a task computes or where.
    quiet = {
        "distributed.worker.profile.enabled": False,
        "distributed.worker.memory.monitor-interval": "1s",
        "distributed.admin.system-monitor.interval": "5s",
        "distributed.admin.system-monitor.gil.enabled": False,
        "distributed.admin.tick.interval": "1s",
    }
    with dask.config.set({"distributed.worker.multiprocessing-method": "forkserver", **quiet}):
        # distributed sets its preload list on its first call; this one (a superset) replaces it.
        get_mp_context().set_forkserver_preload(
            [
                "distributed",
                "dask",
                "numpy",
                "torch",
                "hscache",
                "scorer.studies.evaluate",
                "scorer.studies.distributed",
                "hscache.capture.extract",
                "transformers.models.qwen3_5.modeling_qwen3_5",
                "tests.frozen_heap",
            ]
        )
        with cluster_client(workers=2) as client:
            yield client
