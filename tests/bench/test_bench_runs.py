"""bench/scale.py still runs (quick mode) and prints every ratio line."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_scale_bench_quick(scale_cache: Path, dask_client):
    # Reuse the session's 2-worker cluster and cache: a new cluster costs ~10 s on 2 cores.
    result = subprocess.run(
        [
            sys.executable,
            str(ROOT / "bench" / "scale.py"),
            "--quick",
            "--template",
            str(scale_cache),
            "--scheduler",
            dask_client.scheduler.address,
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout
    for line in (
        "throughput ratio 2 workers / 1 worker:",
        "scheduling overhead per task:",
        "peak memory 4x cache - 1x cache:",
        "full scan cold, --compression none:",
        "reader/memmap ratio",
    ):
        assert line in out, out


@pytest.mark.slow
def test_real_dims_bench_quick():
    result = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "real_dims.py"), "--quick"],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout
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
    import importlib.util

    spec = importlib.util.spec_from_file_location("read_path_bench", ROOT / "bench" / "read_path.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.main(["--quick"])
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
def test_eagle3_bench_quick():
    result = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "eagle3.py"), "--quick"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    for line in (
        "drafts equal on every path",
        "eagle3 chain batched vs one anchor at a time (vLLM loop):",
        "eagle3 chain batched vs step 0 shared, later steps per anchor:",
    ):
        assert line in result.stdout, result.stdout


@pytest.mark.slow
def test_mtp_bench_quick():
    result = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "mtp.py"), "--quick"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    for line in (
        "drafts equal on every path",
        "mtp chain batched vs one anchor at a time (vLLM loop):",
        "mtp chain batched vs step 0 shared, later steps per anchor:",
    ):
        assert line in result.stdout, result.stdout
