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

import os
import runpy
import sys
from pathlib import Path
from types import SimpleNamespace

sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != os.path.dirname(os.path.abspath(__file__))]
# bench/common.py, loaded by path (bench/ is off sys.path)
common = SimpleNamespace(**runpy.run_path(str(Path(__file__).with_name("common.py"))))

import numpy as np
import torch

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


def _setup(tmp: Path, cache_dir: Path, cache, k: int):
    init_eagle3(cache_dir, tmp / "eagle3", num_speculative_tokens=k)
    drafter, _ = load_drafter(tmp / "eagle3", cache, EvalConfig())
    index = [cache.layer_ids.index(i) for i in drafter.config.target_layer_ids]
    sequences = [
        (
            sequence_features(cache.hidden_states(r), index, torch.float32, "cpu", None),
            cache.token_ids(r),
            cache.index.column("prompt_len")[r].as_py(),
        )
        for r in range(len(cache))
    ]
    paths = {
        "batched": lambda f, x, p: draft_every_anchor(drafter, f, x, p, k),
        "vllm_loop": lambda f, x, p: draft_every_anchor_one_by_one(drafter, f, x, p, k),
        "shared_step0": lambda f, x, p: _shared_step0(drafter, f, x, p, k),
    }
    return sequences, paths


def main(argv: list[str] | None = None) -> None:
    common.chain_speed("eagle3", "1,3,4", _setup, argv, __doc__.splitlines()[0])


if __name__ == "__main__":
    main()
