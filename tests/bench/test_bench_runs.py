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
        "open a 2,000-sequence index:",
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
@pytest.mark.parametrize("family", ["eagle3", "mtp"])
def test_autoregressive_family_bench_quick(family, fp32_cache: Path, capsys):
    """On the session's fp32 cache (every layer, 4 x 12 tokens): its own 2 x 32-token extract cost
    ~0.5 CPU-s per family."""
    threads = torch.get_num_threads()  # the bench pins one thread
    try:
        _bench(family).main(["--quick", "--cache", str(fp32_cache)])
    finally:
        torch.set_num_threads(threads)
    out = capsys.readouterr().out
    for line in (
        "drafts equal on every path",
        f"{family} chain batched vs one anchor at a time (vLLM loop):",
        f"{family} chain batched vs step 0 shared, later steps per anchor:",
    ):
        assert line in out, out


@pytest.mark.slow
def test_training_read_bench_quick(capsys, tmp_path):
    """bench/training_read.py --quick runs every path and writes the ratios the issue names."""
    import json

    module = _bench("training_read")
    out_json = tmp_path / "read.json"
    module.main(["--quick", "--json", str(out_json)])
    out = capsys.readouterr().out
    document = json.loads(out_json.read_text())
    for key in module.RATIO_KEYS:
        assert document["ratios"][key] > 0 and f"ratio {key}:" in out
    for label in ("warm", "cold"):
        for path in ("memmap", "speculators", "specforge"):
            assert document["gb_per_s"][label][path] > 0
        for kind in ("dataset", "windows"):
            for codec in ("none", "fast"):
                for workers in (0, 1, 2):
                    assert document["gb_per_s"][label][f"{kind}_{codec}_w{workers}"] > 0
    assert set(document["codecs"]) == {"none", "fast", "balanced"}
    assert document["codecs"]["none"]["stored_over_raw"] == pytest.approx(
        1.0, abs=1e-3
    )  # + 4 crc bytes a chunk
    assert "checksum cost, codec none" in out
    assert document["checksum_gb_per_s"]["cold_logged"] > 0 and "trusted from the verification log" in out


def test_ngram_bench_quick(capsys):
    """bench/ngram.py --quick checks drafts equal and prints every ratio line (~0.1 CPU-s)."""
    _bench("ngram").main(["--quick"])
    out = capsys.readouterr().out
    assert (
        out.count("drafts equal on") == 2 and out.count("ngram propose_at vs vLLM's function per anchor") == 2
    )
    assert (
        out.count("ngram propose_at vs scorer propose per anchor") == 2
        and out.count("replay_ngram (lazy") == 2
    )


@pytest.mark.slow
def test_sampled_extract_bench_quick(capsys):
    _bench("sampled_extract").main(["--quick"])
    out = capsys.readouterr().out
    assert "extract sampled / greedy = " in out and "capture head with the processor / without = " in out, out


@pytest.mark.slow
def test_sampled_scoring_bench_quick(capsys):
    """bench/sampled_scoring.py --quick: both ratios for both drafters (one-hot vs greedy, DP vs all)."""
    threads = torch.get_num_threads()
    _bench("sampled_scoring").main(["--quick"])
    assert torch.get_num_threads() == threads  # the bench pins one thread and gives it back
    out = capsys.readouterr().out
    for name in ("dflash", "target:mtp"):
        assert f"{name}: one-hot sampled / greedy same shape = " in out, out
        assert f"{name}: probabilistic DP / --anchors all = " in out, out


@pytest.mark.slow
def test_sampled_agreement_bench_quick(scale_cache: Path, capsys):
    """bench/sampled_agreement.py --quick: DFlash, both rules, offline vs online with z and swapped z.
    Its drafter trains on the session's greedy cache of layers 1,3,7 (built for the dask tests anyway)."""
    threads = torch.get_num_threads()
    with torch.random.fork_rng(devices=[]):  # the drafter training seeds torch
        _bench("sampled_agreement").main(["--quick", "--greedy-cache", str(scale_cache)])
    assert torch.get_num_threads() == threads  # the bench pins one thread and gives it back
    out = capsys.readouterr().out
    assert "setting T 0.03 top-k 2, drafters' logits x 0.001" in out, out
    rows = [line.split() for line in out.splitlines() if line.startswith("dflash ")]
    assert [r[1] for r in rows] == ["one-hot", "probabilistic"], out
    for row in rows:  # offline±se, online±se, z, swapped z, CPU-s: all numbers
        assert all("±" in cell for cell in row[2:4]) and all(float(c) == float(c) for c in row[4:7]), out


def test_diagnose_bench_quick(fp32_cache: Path, capsys, tmp_path):
    """bench/diagnose.py --quick (2 sequences, an untrained drafter on the session's fp32 cache)
    checks the shared pass replays what one independent pass per hypothesis does and prints both
    ratios."""
    _bench("diagnose").main(["--quick", "--cache", str(fp32_cache)])
    out = capsys.readouterr().out
    for line in (
        "totals and accept lengths equal: shared pass vs one independent pass per hypothesis",
        "ratio default / independent all-anchor passes (the previous --anchors all):",
        "ratio default / --anchors chain (the previous default), on 3 of",
        "load average",
    ):
        assert line in out, out


@pytest.mark.slow
def test_online_bench_quick(capsys):
    """bench/online.py --quick: sampled online decoding against the bare batched target decode (issue 35.6)."""
    threads = torch.get_num_threads()  # the bench pins one thread
    try:
        _bench("online").main(["--quick"])
    finally:
        torch.set_num_threads(threads)
    out = capsys.readouterr().out
    for line in (
        "2 runs x 1 prompts x 6 new tokens",
        "of which target verification forwards",
        "ratio online / bare",
    ):
        assert line in out, out


def test_served_vs_offline_refuses_a_widened_vocabulary_with_real_dims(capsys):
    """--real-dims has Qwen3.6's vocabulary already: --vocab beside it is refused before any work."""
    with pytest.raises(SystemExit) as refused:
        _bench("served_vs_offline").main(["--real-dims", "--vocab", "1000"])
    assert refused.value.code == 2 and "--real-dims has the real vocabulary" in capsys.readouterr().err


def test_quickstart_time_bench_runs_the_readmes_four_steps():
    """bench/quickstart_time.py times the README's quickstart as written (its full run takes ~3 minutes
    of two extra quickstarts, so the suite checks only what it would run, and that the baseline exists)."""
    import subprocess

    module = _bench("quickstart_time")
    steps = module.quickstart_steps(ROOT / "README.md")
    assert [s[:2] for s in steps] == [
        ["hscache", "extract"],
        ["hscache", "info"],
        ["scorer", "init"],
        ["scorer", "eval"],
    ]
    assert "--train-steps" in steps[2] and steps[2][steps[2].index("--train-steps") + 1] == "300"
    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout: the baseline revision cannot be read")
    parent = subprocess.run(
        ["git", "log", "-1", "--format=%s", module.BASELINE.removesuffix("^")],
        cwd=ROOT, capture_output=True, text=True,
    )  # fmt: skip
    if parent.returncode != 0:
        pytest.skip(f"a shallow clone without {module.BASELINE}: {parent.stderr.strip()}")
    assert parent.stdout.startswith("Trained built-in targets")


def test_watch_bench_quick(fp32_cache: Path, capsys):
    """bench/watch.py --quick on the session's fp32 cache: the cost lines and a first-visible step per plant."""
    threads = torch.get_num_threads()  # the bench pins one thread
    try:
        with torch.random.fork_rng(devices=[]):
            result = _bench("watch").main(
                ["--quick", "--train-cache", str(fp32_cache), "--eval-cache", str(fp32_cache)]
            )
    finally:
        torch.set_num_threads(threads)
    out = capsys.readouterr().out
    for line in ("score one checkpoint / one training step:", "overhead at a checkpoint every 500 steps:"):
        assert line in out, out
    assert [step for step, _ in result["runs"]["clean"]] == [2, 4]
    for plant in ("noise", "shortcut", "gamma10"):
        assert f"{plant} visible at step:" in out, out


def test_watch_bench_first_visible_step_by_hand():
    first_visible_step = _bench("watch").first_visible_step
    clean = [(10, {"pooled_ci95": [1.5, 1.7]}), (20, {"pooled_ci95": [2.0, 2.4]})]
    assert first_visible_step(clean, [(10, {"pooled": 1.6}), (20, {"pooled": 1.9})]) == 20
    assert first_visible_step(clean, [(10, {"pooled": 1.4}), (20, {"pooled": 1.9})]) == 10
    assert (
        first_visible_step(clean, [(10, {"pooled": 1.5}), (20, {"pooled": 2.0})]) is None
    )  # at the edge: inside


@pytest.mark.slow
def test_scale_bench_quick(scale_cache: Path, dask_client, capsys):
    # Last in this file: the session's cluster starts at its first test and idles until the session's
    # end (~0.33 CPU-s per 20 s, tests/conftest.py), so the benches above run before it exists.
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
