"""The benchmarks still run (quick mode, in this process) and print every ratio line."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


def _bench(name: str):
    """bench/<name>.py loaded by path, run in this process: a subprocess pays the torch import again."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"{name}_bench", ROOT / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_scale_bench_quick(scale_cache: Path, dask_client, capsys):
    # Reuse the session's 2-worker cluster and cache: a new cluster costs ~10 s on 2 cores.
    threads = torch.get_num_threads()  # the bench pins one thread for its single-process side
    try:
        _bench("scale").main(
            ["--quick", "--template", str(scale_cache), "--scheduler", dask_client.scheduler.address]
        )
    finally:
        torch.set_num_threads(threads)
    out = capsys.readouterr().out
    for line in (
        "throughput ratio 2 workers / 1 worker:",
        "scheduling overhead per task:",
        "peak memory 4x cache - 1x cache:",
        "full scan cold, --compression none:",
        "reader/memmap ratio",
    ):
        assert line in out, out


@pytest.mark.slow
def test_real_dims_bench_quick(capsys):
    with torch.random.fork_rng(devices=[]):  # the bench seeds torch; the suite's later tests keep theirs
        _bench("real_dims").main(["--quick"])
    out = capsys.readouterr().out
    for line in (
        "extract / bare time =",
        "extract peak RSS - weights",
        "generate batch 4 vs batch 1:",
        "scorer --anchors chain vs all, DDTree off:",
        "scorer eval / bare drafter forward",
        "eval peak RSS - weights",
        "open a 20,000-sequence index:",
    ):
        assert line in out, out


def test_read_path_bench_quick(capsys):
    """bench/read_path.py --quick prints every ratio line (in this process: no second torch import)."""
    _bench("read_path").main(["--quick"])
    out = capsys.readouterr().out
    for codec in ("none", "fast"):
        for line in (
            f"scan warm, codec {codec}:",
            f"scan cold, codec {codec}:",
            f"sequence read, codec {codec}:",
            f"one thread, warm, codec {codec}:",
        ):
            assert line in out, out
    assert out.count("reader/memmap ratio") == 4 and out.count("read/decode ratio") == 2


@pytest.mark.slow
def test_eagle3_bench_quick(capsys):
    threads = torch.get_num_threads()  # the bench pins one thread
    try:
        _bench("eagle3").main(["--quick"])
    finally:
        torch.set_num_threads(threads)
    out = capsys.readouterr().out
    for line in (
        "drafts equal on every path",
        "eagle3 chain batched vs one anchor at a time (vLLM loop):",
        "eagle3 chain batched vs step 0 shared, later steps per anchor:",
    ):
        assert line in out, out
