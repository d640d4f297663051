"""Scoring a sampled cache as served against the greedy replay of the same shape: ratios in one run.

One sampled cache (Qwen's thinking-coding preset, the built-in target) is scored three ways, by a
fresh DFlash drafter (``scorer.init_drafter``) and by the target's MTP head (``target:mtp``):
  1. greedy: the same cache seen as greedy (its recorded setting hidden: the same tokens, lengths
     and chunks, so the shape is identical), the usual replay matched against the target's argmax;
  2. one-hot as served (the default on a sampled cache): the same replay matched against the
     sampled tokens, plus the served rounds and the interval over prompts (scorer/offline/sampled_view.py);
  3. probabilistic (``--draft-sampling probabilistic``): log q at every anchor and the exact DP.
Printed: one-hot / greedy (target <= 1.1) with the modes eval runs by default, and probabilistic /
``--anchors all`` greedy without DDTree (target <= 1.5); each the best of --repeats, interleaved.

    python bench/sampled_scoring.py [--prompts 6] [--samples 2] [--new-tokens 48] [--repeats 3] [--quick]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

# bench/scorer.py would shadow the scorer package when this file runs as a script
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != os.path.dirname(os.path.abspath(__file__))]

import torch

import hscache
from hscache.store.sampling import SamplingSetting
from scorer import init_drafter
from scorer.offline.scoring import effective_config, load_drafter
from scorer.report.build import build_report
from scorer.studies.evaluate import EvalConfig, score_cache


class GreedyTwin:
    """The sampled cache with its sampling setting hidden: the scorer replays it as a greedy cache."""

    def __init__(self, cache: Any) -> None:
        self._cache = cache
        self.settings = {k: v for k, v in cache.settings.items() if k != "sampling"}

    def __getattr__(self, name: str) -> Any:
        return getattr(self._cache, name)

    def __len__(self) -> int:
        return len(self._cache)


def _score_s(checkpoint: str, view: Any, config: EvalConfig) -> float:
    drafter, loaded = load_drafter(checkpoint, view, config)
    used = effective_config(drafter, config)
    t0 = time.perf_counter()
    results = score_cache(drafter, view, used)
    build_report(results, cache=view, drafter=drafter, loaded=loaded, config=used, seconds=0.0)
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--prompts", type=int, default=6)
    parser.add_argument("--samples", type=int, default=2)
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="tiny sizes (the test suite runs it)")
    args = parser.parse_args(argv)
    if args.quick:
        args.prompts, args.samples, args.new_tokens, args.repeats = 2, 1, 8, 1
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a shared machine: one thread keeps both sides' timings comparable
    work = Path(tempfile.mkdtemp(prefix="hscache-sampled-scoring-"))
    try:
        sampling = SamplingSetting.from_flags("qwen-thinking-coding", samples_per_prompt=args.samples, seed=0)
        out = work / "cache"
        hscache.extract(
            hscache.ExtractConfig(
                out=str(out), layers="1,3,7", max_new_tokens=args.new_tokens, dtype="fp32",
                limit=args.prompts, sampling=sampling,
            )
        )  # fmt: skip
        init_drafter(out, work / "dflash", block_size=8)
        cache = hscache.open_cache(out)
        twin = GreedyTwin(cache)
        n_boot = 200
        default = EvalConfig(n_boot=n_boot)  # what `scorer eval` runs: chain + DDTree 8,32,128
        all_anchors = EvalConfig(n_boot=n_boot, ddtree=(), anchors="all")
        probabilistic = dataclasses.replace(all_anchors, draft_sampling="probabilistic")
        for name, checkpoint in (("dflash", str(work / "dflash")), ("target:mtp", "target:mtp")):
            best = {
                "greedy": float("inf"),
                "one-hot": float("inf"),
                "all": float("inf"),
                "prob": float("inf"),
            }
            for _ in range(args.repeats):  # interleaved: a shared machine's load moves all alike
                best["greedy"] = min(best["greedy"], _score_s(checkpoint, twin, default))
                best["one-hot"] = min(best["one-hot"], _score_s(checkpoint, cache, default))
                best["all"] = min(best["all"], _score_s(checkpoint, twin, all_anchors))
                best["prob"] = min(best["prob"], _score_s(checkpoint, cache, probabilistic))
            shape = f"{len(cache)} sequences, {cache.num_tokens} tokens, best of {args.repeats}"
            print(
                f"{name}: one-hot sampled / greedy same shape = {best['one-hot'] / best['greedy']:.2f} "
                f"({best['one-hot'] * 1e3:.0f} ms / {best['greedy'] * 1e3:.0f} ms; {shape})"
            )
            print(
                f"{name}: probabilistic DP / --anchors all = {best['prob'] / best['all']:.2f} "
                f"({best['prob'] * 1e3:.0f} ms / {best['all'] * 1e3:.0f} ms; {shape})"
            )
    finally:
        shutil.rmtree(work, ignore_errors=True)
        torch.set_num_threads(threads)


if __name__ == "__main__":
    main()
