"""The GPU check: one run that measures every GPU-path figure, and keeps going past failures.

On a CUDA machine (bench/gpu_check.sh installs the carried wheels offline, then runs this):
  - ``pytest -m gpu``;
  - the built-in hybrid target and a shape-real one (real vocabulary, head dims and layer pattern,
    fewer/narrower layers) extracted in bf16 with fla on CUDA, torch on CUDA and torch on CPU, the
    first one generating and the others replaying its exact token ids (pipelines/drift_study.py
    says why);
  - ``diff`` of each pair: per-layer relative drift, next-token argmax agreement;
  - one drafter per target scored on every cache on CPU and on CUDA: tau per cache, deltas against
    the reference cache, CPU-vs-CUDA agreement on the same cache;
  - flex_attention vs SDPA drafter logits on the same blocks;
  - a sampled extraction (Qwen's thinking preset, 2 samples a prompt) with fla: its speed against the
    greedy one and the drawn tokens the stored (teacher-forced) distribution misses;
  - extract tokens/s at generate batch 1/16/64 (where ``hscache extract`` has ``--generate-batch``)
    and eval tokens/s per device.

Every step is recorded in OUT/gpu_report.json and OUT/gpu_report.md, rewritten after each step
(a step is marked ``running`` before it starts), so a timeout or a crash still leaves every figure
measured so far; ``--resume`` skips steps already finished and marks a step left ``running`` as
``crashed``. ``--dry-run`` runs the same steps at tiny sizes on the CPU with torch standing in for
fla and no installs: the test suite runs it so this script cannot rot.

    python bench/gpu_check.py --out OUT [--wheels .gpu-wheels] [--dry-run] [--resume]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import sys
import time
import traceback
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
# Run as `python bench/gpu_check.py`, bench/ is sys.path[0] and bench/scorer.py would shadow the
# scorer package: drop it, and make sure the working tree's packages come first.
sys.path[:] = [str(ROOT)] + [p for p in sys.path if Path(p or ".").resolve() != HERE]

REPORT_VERSION = 1
STATUSES = ("running", "ok", "failed", "skipped", "crashed")


def _load(name: str) -> Any:
    """A sibling module, loaded by path: bench/ is deliberately not on sys.path."""
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, HERE / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


class Report:
    """The run's record: one entry per step, written as JSON and markdown after every change."""

    def __init__(self, out: Path, plan: dict[str, Any], resume: bool, mirror: Path | None = None) -> None:
        self.out = out
        self.mirror = mirror if mirror and mirror.resolve() != out.resolve() else None
        self.json_path = out / "gpu_report.json"
        self.md_path = out / "gpu_report.md"
        self.t0 = time.perf_counter()
        self.doc: dict[str, Any] = {
            "report_version": REPORT_VERSION,
            "plan": plan,
            "started_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "steps": {},
        }
        if resume and self.json_path.is_file():
            previous = json.loads(self.json_path.read_text())
            self.doc["steps"] = previous.get("steps", {})
            for step in self.doc["steps"].values():
                if step["status"] == "running":  # the process died inside it
                    step["status"] = "crashed"
                    step["error"] = "the process died during this step (see the run's stderr)"
        self.write()

    def done(self, name: str) -> bool:
        """Whether ``name`` already has a final status (a resumed run does not repeat it)."""
        return self.doc["steps"].get(name, {}).get("status") in ("ok", "failed", "skipped", "crashed")

    def result(self, name: str) -> dict[str, Any] | None:
        """The result of step ``name`` if it finished ok, else None."""
        step = self.doc["steps"].get(name)
        return step["result"] if step and step["status"] == "ok" else None

    def set(self, name: str, **fields: Any) -> None:
        self.doc["steps"].setdefault(name, {}).update(fields)
        self.write()

    def write(self) -> None:
        self.doc["elapsed_s"] = round(time.perf_counter() - self.t0, 3)
        texts = {
            self.json_path.name: json.dumps(self.doc, indent=2, default=str) + "\n",
            self.md_path.name: _load("gpu_check_markdown").render_markdown(self.doc),
        }
        for folder in (self.out, self.mirror):
            if folder is None:
                continue
            folder.mkdir(parents=True, exist_ok=True)
            for name, text in texts.items():
                tmp = folder / f"{name}.tmp"
                tmp.write_text(text)
                os.replace(tmp, folder / name)  # atomic: a kill mid-write leaves the previous complete file


class Runner:
    """Runs named steps under a time budget; a failing step is recorded and the run goes on."""

    def __init__(self, report: Report, budget_s: float) -> None:
        self.report = report
        self.deadline = time.perf_counter() + budget_s

    def remaining(self) -> float:
        """Seconds left before no further step starts."""
        return self.deadline - time.perf_counter()

    def step(self, name: str, fn: Callable[[], dict[str, Any]], needs: tuple[str, ...] = ()) -> Any:
        """Run ``fn`` as step ``name`` unless done already, out of time, or a needed step failed.

        Returns the step's result dict when it is ok (now or in an earlier, resumed run), else None.
        """
        if self.report.done(name):
            return self.report.result(name)
        missing = [n for n in needs if self.report.result(n) is None]
        if missing:
            self.report.set(name, status="skipped", reason=f"needs {', '.join(missing)}", seconds=0.0)
            return None
        if time.perf_counter() > self.deadline:
            self.report.set(name, status="skipped", reason="time budget spent", seconds=0.0)
            return None
        self.report.set(name, status="running", started_s=round(time.perf_counter() - self.report.t0, 3))
        t0 = time.perf_counter()
        try:
            result = fn()
        except Exception as exc:  # the point of the run: record any failure and carry on
            self.report.set(
                name,
                status="failed",
                seconds=round(time.perf_counter() - t0, 3),
                error=f"{type(exc).__name__}: {exc}"[:2000],
                traceback="".join(traceback.format_exception(exc)[-6:])[-4000:],
            )
            print(f"[gpu_check] {name}: FAILED {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
            return None
        status = result.pop("_status", "ok") if isinstance(result, dict) else "ok"
        fields = {"status": status, "seconds": round(time.perf_counter() - t0, 3), "result": result}
        if status == "skipped":
            fields["reason"] = result.get("reason", "")
        self.report.set(name, **fields)
        print(f"[gpu_check] {name}: {status} in {fields['seconds']:.1f} s", file=sys.stderr, flush=True)
        return result if status == "ok" else None


def run_target(
    runner: Runner, plan: Any, target: str, model: str, layers: str, sizes: dict, work: Path
) -> None:
    """One target: a cache per setting, diff of each pair, a drafter scored on every cache twice."""
    steps, score = _load("gpu_check_steps"), _load("gpu_check_score")
    needs = ("real.build",) if target == "real" else ()
    caches: dict[str, Path] = {}
    for label, backend, kind in steps.SETTINGS:
        reference = next(iter(caches.values()), None)  # the first cache that got built generates
        run = partial(
            steps.extract_setting,
            plan,
            model,
            work / label,
            plan.fla_backend if backend == "fla" else backend,
            plan.device(kind),
            layers,
            reference,
            work / "replay.jsonl",
            sizes,
        )
        if runner.step(f"{target}.extract.{label}", run, needs) is not None:
            caches[label] = work / label
    labels = list(caches)
    for i, a in enumerate(labels):
        for b in labels[i + 1 :]:
            diff = partial(score.diff_pair, caches[a], caches[b], work / f"diff-{a}-vs-{b}.json")
            runner.step(f"{target}.diff.{a}_vs_{b}", diff)
    if not labels:
        return
    reference, drafter = labels[0], work / "drafter"
    if (
        runner.step(
            f"{target}.drafter", partial(score.make_drafter, plan, target, caches[reference], drafter)
        )
        is None
    ):
        return
    evals = {}
    for label in labels:
        for kind in ("cpu", "gpu"):
            run = partial(
                score.eval_cache,
                plan,
                target,
                drafter,
                caches[label],
                plan.device(kind),
                work / f"eval-{label}-{kind}.json",
            )
            evals[(label, kind)] = runner.step(f"{target}.eval.{label}.{kind}", run)
    runner.step(f"{target}.tau", partial(score.tau_summary, evals, reference))
    runner.step(f"{target}.flex_vs_sdpa", partial(score.flex_vs_sdpa, plan, drafter, caches[reference]))


def run_all(runner: Runner, plan: Any, work: Path, wheels: Path, run_pytest: bool) -> None:
    """Every step, in order; each reads only the results of steps that finished ok."""
    steps, score = _load("gpu_check_steps"), _load("gpu_check_score")
    work.mkdir(parents=True, exist_ok=True)
    runner.step("install", partial(steps.install, plan, wheels))
    env = runner.step("environment", partial(steps.environment, plan)) or {}
    models = {"builtin": "builtin:tiny-qwen3.5", "real": str(work / "real-target")}
    layers = {"builtin": plan.builtin_layers, "real": plan.real_layers}
    sizes = {
        "builtin": {"limit": plan.builtin_limit, "max_new_tokens": plan.builtin_new_tokens},
        "real": {"limit": plan.real_limit, "max_new_tokens": plan.real_new_tokens},
    }
    runner.step("real.build", partial(steps.build_real_target, plan, Path(models["real"])))
    for target in steps.TARGETS:
        (work / target).mkdir(exist_ok=True)
        run_target(runner, plan, target, models[target], layers[target], sizes[target], work / target)
    # Throughput on the shape-real target (the built-in one is launch-bound), fla on the GPU.
    target = "real" if runner.report.result("real.build") else "builtin"
    # Sampled extraction at the real vocabulary, against the greedy fla cache of the same prompts.
    greedy = runner.report.result(f"{target}.extract.fla-cuda")
    run = partial(
        score.extract_sampled, plan, models[target], layers[target], sizes[target], work / target, greedy
    )
    runner.step("sampled.extract.fla-cuda", run)
    batch_param = env.get("generate_batch_param")
    for batch in (None, *plan.throughput_batches):
        run = partial(
            score.extract_throughput,
            plan,
            models[target],
            layers[target],
            batch,
            work / "throughput",
            batch_param,
        )
        runner.step(f"throughput.extract.b{batch or 'default'}", run)
    # Both engines side by side where vLLM is installed here (bench/engines.py; skipped otherwise).
    run = partial(
        steps.vllm_engines, plan, models[target], layers[target], sizes[target], work / "engines.json"
    )
    runner.step("engines.transformers_vs_vllm", run)
    # Last: the figures above matter most, and pytest gets whatever time is left (at least 60 s).
    timeout = max(60.0, min(plan.pytest_timeout_s, runner.remaining() + 60.0))
    run = partial(steps.pytest_gpu, plan, timeout) if run_pytest else partial(steps.skipped, "--skip-pytest")
    runner.step("pytest_gpu", run)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--out", default="out/gpu_check", help="Work folder and report (kept, so --resume can continue)."
    )
    parser.add_argument(
        "--report-dir", default=os.environ.get("OUT"), help="Also keep the report here (default: $OUT)."
    )
    parser.add_argument("--wheels", default=".gpu-wheels", help="Carried wheel folder (offline install).")
    parser.add_argument("--dry-run", action="store_true", help="Tiny sizes, CPU only, no installs.")
    parser.add_argument("--resume", action="store_true", help="Skip steps a previous run finished.")
    parser.add_argument("--budget-s", type=float, default=None, help="Start no step after this many s.")
    parser.add_argument("--skip-pytest", action="store_true", help="Do not run the pytest step.")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Run every step; exit 0 when all ran ok, 1 when any failed or was skipped."""
    args = parse_args(argv)
    steps = _load("gpu_check_steps")
    plan = steps.Plan.for_dry_run() if args.dry_run else steps.Plan.for_gpu()
    if args.budget_s is not None:
        plan.budget_s = args.budget_s
    out = Path(args.out).resolve()
    if not args.resume:  # a fresh run: no cache or replay file of an earlier run may leak in
        shutil.rmtree(out / "work", ignore_errors=True)
    mirror = Path(args.report_dir).resolve() if args.report_dir else None
    report = Report(out, plan.to_dict(), resume=args.resume, mirror=mirror)
    runner = Runner(report, plan.budget_s)
    run_all(runner, plan, out / "work", wheels=Path(args.wheels).resolve(), run_pytest=not args.skip_pytest)
    report.doc["finished_at"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    report.write()
    counts: dict[str, int] = {}
    for step in report.doc["steps"].values():
        counts[step["status"]] = counts.get(step["status"], 0) + 1
    print(f"[gpu_check] {counts}; wrote {report.json_path} and {report.md_path}", file=sys.stderr)
    return 0 if set(counts) <= {"ok"} else 1


if __name__ == "__main__":
    sys.exit(main())
