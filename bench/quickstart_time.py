"""The README quickstart's time on the trained built-in target against the random-weight target it
replaced (issue 31: "quickstart time within 1.5x of today's"), measured side by side in one run.

The baseline is the last commit before the trained targets (``--baseline``, default ``11eb469^``),
exported with ``git archive`` into a scratch folder (the repository is not touched). Both sides run
the same four quickstart steps, read from this README's quickstart line (``hscache extract``,
``hscache info``, ``scorer init --train-steps 300``, ``scorer eval``), through this interpreter's
console scripts with ``PYTHONPATH`` set to that side's sources, in fresh folders, alternating sides
round by round so a machine that speeds up or slows down during the run treats both alike. Times
from different days are not comparable on a shared VM (the same commit has measured 2x apart).

    python bench/quickstart_time.py [--rounds 3] [--baseline REV]

Prints each step's median wall and CPU seconds per side, then the ratio line.
"""

from __future__ import annotations

import argparse
import os
import resource
import shlex
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from io import BytesIO
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BASELINE = "11eb469^"  # the parent of "Trained built-in targets (issue 31 items 1-2)"


def quickstart_steps(readme: Path) -> list[list[str]]:
    """The README quickstart's steps after the install, as argument lists without the venv prefix."""
    line = next(l.strip() for l in readme.read_text().splitlines() if l.strip().startswith("python3 -m venv"))
    steps = [s.strip() for s in line.split("&&") if s.strip().startswith(".venv/bin/")]
    return [shlex.split(s.removeprefix(".venv/bin/")) for s in steps if "pip install" not in s]


def export_revision(rev: str, dest: Path) -> Path:
    """``git archive rev`` unpacked into ``dest`` (the symlinked hscache/schemas included)."""
    blob = subprocess.run(["git", "archive", rev], cwd=ROOT, capture_output=True, check=True).stdout
    with tarfile.open(fileobj=BytesIO(blob)) as archive:
        archive.extractall(dest, filter="tar")
    return dest


def run_step(argv: list[str], source: Path, cwd: Path) -> tuple[float, float]:
    """Wall and CPU seconds (user + sys of the child) of one step run with ``source`` first on the path."""
    bin_dir = Path(sys.executable).parent
    env = {**os.environ, "PYTHONPATH": str(source), "PYTHONDONTWRITEBYTECODE": "1"}
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    done = subprocess.run(
        [str(bin_dir / argv[0]), *argv[1:]], cwd=cwd, env=env, capture_output=True, text=True
    )
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} failed with {source} first on the path:\n{done.stderr[-2000:]}")
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3, help="runs of each side, alternating")
    parser.add_argument("--baseline", default=BASELINE, help="git revision of the random-weight target")
    args = parser.parse_args(argv)
    steps = quickstart_steps(ROOT / "README.md")
    with tempfile.TemporaryDirectory(prefix="quickstart-time-") as tmp:
        work = Path(tmp)
        sides = {"random target": export_revision(args.baseline, work / "baseline"), "trained target": ROOT}
        times: dict[str, list[list[tuple[float, float]]]] = {name: [] for name in sides}
        for round_ in range(args.rounds):
            order = list(sides) if round_ % 2 == 0 else list(reversed(sides))
            for name in order:
                cwd = work / f"{name.split()[0]}-{round_}"
                cwd.mkdir()
                times[name].append([run_step(step, sides[name], cwd) for step in steps])
                total = sum(w for w, _ in times[name][-1])
                print(f"round {round_ + 1} {name}: {total:.1f} s", flush=True)
    print(f"\nmedian over {args.rounds} rounds (wall s / CPU-s), baseline {args.baseline}:")
    totals = {}
    for name, rounds in times.items():
        per_step = [
            (statistics.median(r[i][0] for r in rounds), statistics.median(r[i][1] for r in rounds))
            for i in range(len(steps))
        ]
        totals[name] = (
            statistics.median(sum(w for w, _ in r) for r in rounds),
            statistics.median(sum(c for _, c in r) for r in rounds),
        )
        cells = ", ".join(f"{' '.join(s[:2])} {w:.1f} / {c:.1f}" for s, (w, c) in zip(steps, per_step))
        print(f"  {name}: {cells}; total {totals[name][0]:.1f} / {totals[name][1]:.1f}")
    (new_wall, new_cpu), (old_wall, old_cpu) = totals["trained target"], totals["random target"]
    print(
        f"quickstart time trained / random target: {new_wall / old_wall:.2f}x wall, "
        f"{new_cpu / old_cpu:.2f}x CPU (issue 31: at most 1.5x)"
    )


if __name__ == "__main__":
    main()
