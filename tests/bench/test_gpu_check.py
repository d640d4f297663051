"""bench/gpu_check: the dry run (CPU, tiny) records every step with figures; failures and crashes are kept."""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _gpu_check():
    if "gpu_check" not in sys.modules:
        spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "bench" / "gpu_check.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules["gpu_check"] = module
        spec.loader.exec_module(module)
    return sys.modules["gpu_check"]


def _expected_steps() -> set[str]:
    names = {"install", "environment", "pytest_gpu", "real.build"}
    labels = ("fla-cuda", "torch-cuda", "torch-cpu")
    for target in ("builtin", "real"):
        names |= {f"{target}.extract.{x}" for x in labels}
        names |= {f"{target}.diff.{a}_vs_{b}" for i, a in enumerate(labels) for b in labels[i + 1 :]}
        names |= {f"{target}.eval.{x}.{d}" for x in labels for d in ("cpu", "gpu")}
        names |= {f"{target}.drafter", f"{target}.tau", f"{target}.flex_vs_sdpa"}
    return names | {
        "throughput.extract.bdefault",
        "throughput.extract.b1",
        "throughput.extract.b2",
        "sampled.extract.fla-cuda",
        "engines.transformers_vs_vllm",  # skipped without vLLM in the interpreter, and in a dry run
    }


@pytest.mark.slow
def test_dry_run_records_every_step_with_figures(tmp_path: Path) -> None:
    rc = _gpu_check().main(["--dry-run", "--skip-pytest", "--out", str(tmp_path)])
    doc = json.loads((tmp_path / "gpu_report.json").read_text())
    steps = doc["steps"]
    assert set(steps) == _expected_steps()
    failed = {n: s.get("error") for n, s in steps.items() if s["status"] not in ("ok", "skipped")}
    assert not failed, failed
    assert rc == 1  # the dry run skips installs and pytest, so it never claims a full pass
    assert steps["install"]["reason"] == "dry run: no installs"
    assert steps["engines.transformers_vs_vllm"]["status"] == "skipped"
    env = steps["environment"]["result"]
    batches_run = env["generate_batch_param"] is not None
    for name in ("throughput.extract.b1", "throughput.extract.b2"):
        assert steps[name]["status"] == ("ok" if batches_run else "skipped"), steps[name]
    # Torch stands in for fla on the CPU, and the report says so through the recorded backend.
    for target in ("builtin", "real"):
        ref = steps[f"{target}.extract.fla-cuda"]["result"]
        assert ref["role"] == "reference" and ref["backend"] == "torch" and ref["device"] == "cpu"
        assert ref["generated_tokens"] > 0 and ref["tokens_per_s"] > 0
        assert steps[f"{target}.extract.torch-cpu"]["result"]["role"] == "replay"
        for name, step in steps.items():
            if name.startswith(f"{target}.diff."):
                r = step["result"]
                assert r["tokens"] == ref["tokens"] and len(r["layers"]) == 3
                # Same kernels, dtype and device on every side: drift is at most bf16 rounding.
                assert all(0 <= x["rel_l2"] < 1e-2 for x in r["layers"]), r["layers"]
                assert r["argmax_agreement"] > 0.9
        tau = steps[f"{target}.tau"]["result"]["caches"]
        for row in tau.values():
            assert row["tau_cpu"] >= 1 and row["cpu_gpu_round_agreement"] == 1.0  # same device twice
        flex = steps[f"{target}.flex_vs_sdpa"]["result"]
        # fp32: the two kernels sum the same products in another order, ~1e-7 relative.
        assert flex["fp32"]["rel_l2"] < 1e-5 and flex["fp32"]["argmax_agreement"] == 1.0
        assert flex["bf16"]["rel_l2"] < 2e-2  # bf16: 8 mantissa bits, a few roundings per layer
    sampled = steps["sampled.extract.fla-cuda"]["result"]
    # bf16: the generation and capture forwards may differ at a cut, so some drawn tokens can miss.
    assert 0 <= sampled["realised_outside_support"] <= sampled["sampled_positions"] > 0
    assert (
        0 < sampled["largest_support"] <= sampled["support_width"] == 40 and sampled["slowdown_vs_greedy"] > 0
    )
    real = steps["real.build"]["result"]
    assert real["layer_types"] == ["linear_attention"] * 3 + ["full_attention"]
    markdown = (tmp_path / "gpu_report.md").read_text()
    assert "DRY RUN" in markdown and "## Drift" in markdown and "real.diff.fla-cuda_vs_torch-cuda" in markdown
    assert not (tmp_path / "gpu_report.json.tmp").exists()


def _report(tmp_path: Path, steps: dict) -> None:
    plan = {"dry_run": True}
    (tmp_path / "gpu_report.json").write_text(json.dumps({"plan": plan, "steps": steps}))


def test_resume_marks_the_dead_step_crashed_and_keeps_going(tmp_path: Path) -> None:
    gpu_check = _gpu_check()
    _report(tmp_path, {"a": {"status": "ok", "result": {"x": 1}}, "b": {"status": "running"}})
    report = gpu_check.Report(tmp_path, {"dry_run": True}, resume=True)
    runner = gpu_check.Runner(report, budget_s=60)
    assert report.doc["steps"]["b"]["status"] == "crashed"
    assert runner.step("a", lambda: pytest.fail("a finished in the earlier run")) == {"x": 1}
    assert runner.step("b", lambda: pytest.fail("a crashed step is not retried")) is None

    def boom() -> dict:
        raise ValueError("kernel exploded")

    assert runner.step("c", boom) is None
    assert runner.step("d", lambda: {"y": 2}, needs=("c",)) is None
    assert runner.step("e", lambda: {"y": 2}) == {"y": 2}
    steps = json.loads((tmp_path / "gpu_report.json").read_text())["steps"]
    assert steps["c"]["status"] == "failed" and steps["c"]["error"] == "ValueError: kernel exploded"
    assert steps["d"] == {"status": "skipped", "reason": "needs c", "seconds": 0.0}
    assert steps["e"]["status"] == "ok" and "| c | failed |" in (tmp_path / "gpu_report.md").read_text()


def test_spent_budget_skips_the_rest(tmp_path: Path) -> None:
    gpu_check = _gpu_check()
    runner = gpu_check.Runner(gpu_check.Report(tmp_path, {"dry_run": True}, resume=False), budget_s=0)
    assert runner.step("late", lambda: {"y": 1}) is None
    assert (
        json.loads((tmp_path / "gpu_report.json").read_text())["steps"]["late"]["reason"]
        == "time budget spent"
    )


def test_wrapper_script_parses_and_forwards_flags() -> None:
    assert subprocess.run(["bash", "-n", str(ROOT / "bench" / "gpu_check.sh")], check=False).returncode == 0
    done = subprocess.run(
        ["bash", str(ROOT / "bench" / "gpu_check.sh"), "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env={"PATH": "/usr/bin:/bin", "PYTHON": sys.executable, "OUT": "/tmp/gpu-check-help"},
    )
    assert done.returncode == 0 and "--dry-run" in done.stdout, done.stdout + done.stderr


def test_missing_wheel_folder_names_the_fix(tmp_path: Path) -> None:
    steps = _gpu_check()._load("gpu_check_steps")
    plan = steps.Plan.for_gpu()
    with pytest.raises(FileNotFoundError, match="run bench/prepare_gpu_wheels.sh"):
        steps.install(plan, tmp_path / "absent")
    assert math.isclose(plan.budget_s, 420.0)


def test_pytest_step_says_pytest_is_missing() -> None:
    """Issue 20.16: an interpreter without pytest is named as such, not "exit 1: {}; failed: []"."""
    steps = _gpu_check()._load("gpu_check_steps")
    no_site = (sys.executable, "-S")  # no site-packages: pytest cannot be imported
    with pytest.raises(RuntimeError, match="pytest is not installed for .* -S: install it"):
        steps.pytest_gpu(steps.Plan.for_dry_run(), 60, python=no_site)
