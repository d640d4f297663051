"""MTP chain scoring speed: batched over every anchor vs one anchor at a time (ratios, one run).

The batched path (scorer.families.mtp.draft.draft_anchors) runs step 0 of every anchor in one
causal forward over the sequence and the later steps of all anchors together. The baselines:
  1. vLLM's propose loop per anchor (the ``scorer online`` proposer: step 0 over the prefix, then
     K-1 one-row steps), what a scorer without batching does; the issue's target is >= 5x.
  2. step 0 shared (one forward for the sequence), later steps one anchor at a time.
Every path's drafts are checked equal before a ratio is printed. The head is the built-in target's
trained MTP head (builtin:tiny-qwen3.5, trained jointly with the target: hscache/data/builtin/README.md).

    python bench/mtp.py [--sequences 4] [--new-tokens 128] [--k 3] [--quick]
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
from scorer.families.mtp.draft import draft_anchors, mtp_context
from scorer.families.mtp.seam import mtp_hidden
from scorer.studies.evaluate import EvalConfig, load_drafter


@torch.no_grad()
def _vllm_loop(head, hidden, tokens, prompt_len: int, k: int) -> np.ndarray:
    """Per anchor p: step 0 over the pairs of positions 0..p-1, then the K-1 later steps."""
    rows = []
    for p in range(prompt_len, len(tokens) - 1):
        context = mtp_context(head, hidden[:p], tokens[: p + 1])
        rows.append(draft_anchors(head, context, np.asarray([p]), k)[0])
    return np.asarray(rows, dtype=np.int64).reshape(-1, k)


@torch.no_grad()
def _shared_step0(head, hidden, tokens, prompt_len: int, k: int) -> np.ndarray:
    context = mtp_context(head, hidden, tokens)
    rows = [draft_anchors(head, context, np.asarray([p]), k)[0] for p in range(prompt_len, len(tokens) - 1)]
    return np.asarray(rows, dtype=np.int64).reshape(-1, k)


@torch.no_grad()
def _batched(head, hidden, tokens, prompt_len: int, k: int) -> np.ndarray:
    return draft_anchors(head, mtp_context(head, hidden, tokens), np.arange(prompt_len, len(tokens) - 1), k)


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
                layers="7",
                max_new_tokens=args.new_tokens,
                dtype="fp32",
                limit=args.sequences,
            )
        )
        cache = hscache.open_cache(cache_dir)
        head, _ = load_drafter("target:mtp", cache, EvalConfig(num_speculative_tokens=args.k))
        sequences = [
            (
                mtp_hidden(head, cache.hidden_states(r), cache.layer_ids, torch.float32, "cpu"),
                cache.token_ids(r),
                cache.index.column("prompt_len")[r].as_py(),
            )
            for r in range(len(cache))
        ]
        paths = {"batched": _batched, "vllm_loop": _vllm_loop, "shared_step0": _shared_step0}
        timings, drafts = {}, {}
        for name, path in paths.items():
            t0 = time.perf_counter()
            drafts[name] = [path(head, h, x, p, args.k) for h, x, p in sequences]
            timings[name] = time.perf_counter() - t0
        for name in ("vllm_loop", "shared_step0"):
            for mine, theirs in zip(drafts["batched"], drafts[name]):
                np.testing.assert_array_equal(mine, theirs)
        anchors = sum(len(d) for d in drafts["batched"])
        print(
            f"sequences {len(sequences)}, anchors {anchors}, K {args.k}, threads 1, drafts equal on every path"
        )
        print(
            f"mtp chain batched vs one anchor at a time (vLLM loop): {timings['vllm_loop'] / timings['batched']:.1f}x"
        )
        print(
            "mtp chain batched vs step 0 shared, later steps per anchor: "
            f"{timings['shared_step0'] / timings['batched']:.1f}x"
        )


if __name__ == "__main__":
    main()
