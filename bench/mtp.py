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


def _setup(tmp: Path, cache_dir: Path, cache, k: int):
    head, _ = load_drafter("target:mtp", cache, EvalConfig(num_speculative_tokens=k))
    sequences = [
        (
            mtp_hidden(head, cache.hidden_states(r), cache.layer_ids, torch.float32, "cpu"),
            cache.token_ids(r),
            cache.index.column("prompt_len")[r].as_py(),
        )
        for r in range(len(cache))
    ]
    paths = {
        name: (lambda h, x, p, path=path: path(head, h, x, p, k))
        for name, path in (("batched", _batched), ("vllm_loop", _vllm_loop), ("shared_step0", _shared_step0))
    }
    return sequences, paths


def main(argv: list[str] | None = None) -> None:
    common.chain_speed("mtp", "7", _setup, argv, __doc__.splitlines()[0])


if __name__ == "__main__":
    main()
