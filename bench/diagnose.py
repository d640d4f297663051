"""scorer diagnose: where the time goes, and the default path against the alternatives (ratios).

In one run, on the same sequences and settings (the baseline and every tested hypothesis):
  1. the default: one shared pass (``DFlashReplayer.replay_many``, anchors "all"): per sequence,
     features once per feature variant, the context's keys/values once per context variant,
     every anchor drafted in a few large forwards per setting, the chain replay and the
     training-log accept length read off those drafts;
  2. one independent all-anchor pass per hypothesis: ``scorer.families.dflash.score.score_dflash_sequence(anchors="all")``
     per setting and sequence, what ``scorer eval --anchors all`` does and what
     ``scorer diagnose --anchors all`` did before the shared pass;
  3. ``--anchors chain``: only the anchors each replay visits, one small forward per sequence per
     round (``scorer eval --anchors chain``; the default before).
Totals are checked equal between 1 and 2 (the same drafts) before a ratio is printed; 3 may differ
in the last bit of a logit (other chunks), so its tau is printed beside. Time is CPU seconds of
this process (``resource.getrusage``: every thread, not the other processes of a shared machine)
and wall seconds, each the best of ``--repeats``, with the load average printed.

    python bench/diagnose.py [--cache DIR --drafter DIR] [--limit N] [--repeats 3] [--chain-settings K]
                             [--threads T] [--quick]

Without ``--cache``/``--drafter`` it builds the README quickstart's (20 sequences of the built-in
target, a drafter trained 300 steps) in a temporary directory; ``--quick`` replays 2 sequences
once on one thread, with an untrained drafter unless ``--drafter`` (the suite runs it on a session
cache).
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import tempfile
import time
from pathlib import Path

sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != os.path.dirname(os.path.abspath(__file__))]

import numpy as np
import torch

from scorer.diagnose.run import DiagnoseConfig, prepare_diagnosis
from scorer.families.dflash.score import score_dflash_sequence
from scorer.metrics import AcceptLen, request_totals, tau_pooled_from_totals


def _cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _timed(repeats: int, fn) -> tuple[float, float, object]:
    """Best CPU-s and best wall-s over ``repeats`` runs, and the last result."""
    best_cpu = best_wall = float("inf")
    out = None
    for _ in range(repeats):
        c0, w0 = _cpu(), time.perf_counter()
        out = fn()
        best_cpu, best_wall = min(best_cpu, _cpu() - c0), min(best_wall, time.perf_counter() - w0)
    return best_cpu, best_wall, out


def _independent(plan, settings, positions) -> list[tuple[np.ndarray, AcceptLen]]:
    """One all-anchor pass per setting, scorer eval's path (score_dflash_sequence), nothing shared."""
    replayer, out = plan.replayer, []
    for setting in settings:
        drafter = replayer.drafter(setting)
        cache = replayer.caches[setting.cache]
        logs, accept = [], AcceptLen(0, 0)
        for i in positions:
            row = replayer.rows[setting.cache][i]
            result = score_dflash_sequence(
                drafter, replayer.features(setting, row), cache.token_ids(row), cache.target_argmax(row),
                cache.index.column("prompt_len")[row].as_py(), row=row, anchors="all",
                max_blocks_per_forward=replayer.max_blocks, memory_gb=replayer.memory_gb,
            )  # fmt: skip
            logs.append(result.chain)
            accept = accept + result.accept_len
        out.append((request_totals(logs), accept))
    return out


def _inputs(root: Path, cache: str | None, drafter: str | None, quick: bool) -> tuple[str, str]:
    """The README quickstart's cache and trained drafter where not given; with ``quick``, a
    4-sequence cache and an untrained drafter (tau near 1: the most rounds, chain's worst case)."""
    import hscache
    from scorer import init_drafter, train_drafter

    if cache is None:
        cache = str(root / "cache")
        options = {"limit": 4, "max_new_tokens": 12} if quick else {}
        hscache.extract(hscache.ExtractConfig(out=cache, **options))
    if drafter is None:
        drafter = str(root / "drafter")
        if quick:
            init_drafter(cache, drafter)
        else:
            train_drafter(cache, drafter, steps=300, log_every=0)
    return cache, drafter


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cache", default=None)
    parser.add_argument("--drafter", default=None)
    parser.add_argument(
        "--limit", type=int, default=None, help="sequences replayed (default: all, at most 32)"
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--chain-settings", type=int, default=None, help="time --anchors chain on the first K settings only"
    )
    parser.add_argument(
        "--threads", type=int, default=None, help="torch intra-op threads (default: torch's own choice)"
    )
    parser.add_argument(
        "--quick", action="store_true", help="2 sequences, one repeat, chain on 3 settings, one thread"
    )
    args = parser.parse_args(argv)
    threads = torch.get_num_threads()
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        _run(args)
    finally:
        torch.set_num_threads(threads)


def _run(args: argparse.Namespace) -> None:
    if args.quick:  # small, and on one thread: two threads' waits are noise at this size
        args.limit, args.repeats = args.limit or 2, 1
        args.chain_settings, args.threads = args.chain_settings or 3, args.threads or 1
    with tempfile.TemporaryDirectory() as tmp:
        args.cache, args.drafter = _inputs(Path(tmp), args.cache, args.drafter, args.quick)
        plan = prepare_diagnosis(args.drafter, [args.cache], DiagnoseConfig(limit=args.limit))
        settings = [plan.base, *plan.settings]
        positions = range(plan.first)
        load = os.getloadavg()
        print(
            f"diagnose bench: {len(positions)} sequences x {len(settings)} settings (baseline + "
            f"{len(plan.settings)} hypotheses), {torch.get_num_threads()} torch thread(s), "
            f"load average {load[0]:.1f} / {load[1]:.1f} at the start"
        )
        replayer = plan.replayer
        # warm-up, untimed: the first replay reads the target head, casts the weights and pays
        # torch's first-call costs, which would otherwise land on whichever path runs first
        replayer.replay_many(settings, range(1))
        _independent(plan, settings, range(1))
        shared_cpu, shared_wall, shared = _timed(
            args.repeats, lambda: replayer.replay_many(settings, positions)
        )
        ind_cpu, ind_wall, independent = _timed(args.repeats, lambda: _independent(plan, settings, positions))
        k = min(args.chain_settings or len(settings), len(settings))
        chain_cpu, chain_wall, chain = _timed(
            1, lambda: replayer.replay_many(settings[:k], positions, anchors="chain")
        )  # one run: it is the slow one
        sub_cpu, sub_wall, _ = _timed(args.repeats, lambda: replayer.replay_many(settings[:k], positions))
        for (a, acc_a), (b, acc_b) in zip(shared, independent):
            if not (np.array_equal(a, b) and acc_a == acc_b):
                raise SystemExit("the shared pass and the independent passes replayed different rounds")
        print("totals and accept lengths equal: shared pass vs one independent pass per hypothesis")
        same = sum(np.array_equal(a, b) for (a, _), (b, _) in zip(shared, chain))
        taus = [f"{tau_pooled_from_totals(t):.3f}" for t, _ in chain[:3]]
        print(f"--anchors chain: totals equal for {same} of {k} settings (first taus {taus})")
        print(f"  shared pass (default):          {shared_cpu:8.2f} CPU-s  {shared_wall:8.2f} s wall")
        print(f"  independent all-anchor passes:  {ind_cpu:8.2f} CPU-s  {ind_wall:8.2f} s wall")
        print(f"  --anchors chain, {k} settings:  {chain_cpu:8.2f} CPU-s  {chain_wall:8.2f} s wall")
        print(f"  shared pass, the same {k}:      {sub_cpu:8.2f} CPU-s  {sub_wall:8.2f} s wall")
        print(
            f"ratio default / independent all-anchor passes (the previous --anchors all): "
            f"{shared_cpu / ind_cpu:.2f} CPU, {shared_wall / ind_wall:.2f} wall"
        )
        print(
            f"ratio default / --anchors chain (the previous default), on {k} of {len(settings)} settings: "
            f"{sub_cpu / chain_cpu:.3f} CPU, {sub_wall / chain_wall:.3f} wall"
        )
        load = os.getloadavg()
        print(f"load average {load[0]:.1f} / {load[1]:.1f} at the end ({os.cpu_count()} CPUs)")


if __name__ == "__main__":
    main()
