"""EAGLE-3 chain scoring speed: batched over every anchor vs one anchor at a time (ratios, one run).

The batched path (scorer.families.eagle3.drafting.draft_every_anchor) runs step 0 over the whole
sequence in one causal forward and the later steps of every anchor together under a mask. The
baselines draft one anchor at a time:
  1. vLLM's propose loop per anchor (Eagle3Drafter.draft_one_anchor: step 0 over the prefix, then
     K-1 one-row steps): what a scorer without batching does; the issue's target is >= 5x.
  2. step 0 shared (one forward for the sequence), later steps one anchor at a time: isolates what
     batching the later steps alone buys.
Every path's drafts are checked equal before a ratio is printed.

    python bench/eagle3.py [--sequences 4] [--new-tokens 128] [--k 3] [--quick]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != os.path.dirname(os.path.abspath(__file__))]

import numpy as np
import torch

import hscache
from scorer.families.eagle3.drafting import draft_every_anchor, draft_every_anchor_one_by_one
from scorer.families.eagle3.init import init_eagle3
from scorer.offline.sequences import sequence_features
from scorer.studies.evaluate import EvalConfig, load_drafter


@torch.no_grad()
def _shared_step0(drafter, features, tokens, prompt_len: int, k: int) -> np.ndarray:
    """Step 0 once for the sequence; steps 1..K-1 for one anchor at a time."""
    normed0, fed0, kv0 = drafter.step0(features, tokens, len(tokens) - 2)
    rows = []
    for p in range(prompt_len, len(tokens) - 1):
        row = torch.tensor([p - 1])
        drafted = [drafter.to_target(drafter.head_logits(normed0[row]).argmax(-1))]
        fed, own = fed0[row], [[] for _ in drafter.layers]
        for j in range(1, k):
            normed, fed = drafter.step(row, drafted[-1], fed, j, kv0, own)
            drafted.append(drafter.to_target(drafter.head_logits(normed).argmax(-1)))
        rows.append(torch.cat(drafted).tolist())
    return np.asarray(rows, dtype=np.int64).reshape(-1, k)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sequences", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--k", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="2 sequences x 32 tokens (the test's form)")
    args = parser.parse_args(argv)
    if args.quick:
        args.sequences, args.new_tokens = 2, 32
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        cache_dir = Path(tmp) / "cache"
        hscache.extract(
            hscache.ExtractConfig(
                out=str(cache_dir),
                layers="1,3,4",
                max_new_tokens=args.new_tokens,
                dtype="fp32",
                limit=args.sequences,
            )
        )
        init_eagle3(cache_dir, Path(tmp) / "eagle3", num_speculative_tokens=args.k)
        cache = hscache.open_cache(cache_dir)
        drafter, _ = load_drafter(Path(tmp) / "eagle3", cache, EvalConfig())
        index = [cache.layer_ids.index(i) for i in drafter.config.target_layer_ids]
        sequences = [
            (
                sequence_features(cache.hidden_states(r), index, torch.float32, "cpu", None),
                cache.token_ids(r),
                cache.index.column("prompt_len")[r].as_py(),
            )
            for r in range(len(cache))
        ]
        timings, drafts = {}, {}
        paths = {
            "batched": lambda f, x, p: draft_every_anchor(drafter, f, x, p, args.k),
            "vllm_loop": lambda f, x, p: draft_every_anchor_one_by_one(drafter, f, x, p, args.k),
            "shared_step0": lambda f, x, p: _shared_step0(drafter, f, x, p, args.k),
        }
        for name, path in paths.items():
            t0 = time.perf_counter()
            drafts[name] = [path(f, x, p) for f, x, p in sequences]
            timings[name] = time.perf_counter() - t0
        for name in ("vllm_loop", "shared_step0"):
            for mine, theirs in zip(drafts["batched"], drafts[name]):
                np.testing.assert_array_equal(mine, theirs)
        anchors = sum(len(d) for d in drafts["batched"])
        print(
            f"sequences {len(sequences)}, anchors {anchors}, K {args.k}, threads 1, drafts equal on every path"
        )
        print(
            f"eagle3 chain batched vs one anchor at a time (vLLM loop): {timings['vllm_loop'] / timings['batched']:.1f}x"
        )
        print(
            "eagle3 chain batched vs step 0 shared, later steps per anchor: "
            f"{timings['shared_step0'] / timings['batched']:.1f}x"
        )


if __name__ == "__main__":
    main()
