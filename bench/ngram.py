"""n-gram proposer speed: every anchor of one sequence at once vs vLLM's function per anchor (ratios).

The batched path (scorer.families.ngram.propose.propose_at) builds first-occurrence tables of the
sequence's n-grams once (O(max_n T log T)) and reads each anchor's draft from them. The
baselines draft one anchor at a time, on the context x[:p+1]:
  1. the literal transcription of vLLM's ``_find_longest_matched_ngram_and_propose_tokens``
     (loaded from tests/scorer/test_ngram.py), in pure Python: vLLM runs it under numba, which
     this project does not depend on, so this ratio overstates the gain over a served vLLM;
  2. scorer's own single-context ``propose`` (numpy, O(T max_n) per anchor).
The per-anchor baselines are timed on evenly spaced anchors and scaled to every anchor
(``--exact`` runs them on every anchor). Drafts are checked equal before a ratio is printed.
The lazy replay (scorer.families.ngram.replay.replay_ngram) on the same sequence is timed too.

    python bench/ngram.py [--tokens 8192] [--sample 200] [--exact] [--quick]
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import time
from pathlib import Path

sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != os.path.dirname(os.path.abspath(__file__))]

import numpy as np

from scorer.families.ngram.propose import NgramConfig, propose, propose_at
from scorer.families.ngram.replay import replay_ngram

ROOT = Path(__file__).resolve().parents[1]
VOCABS = (248_320, 50)  # the real vocabulary (few matches), a small one (matches everywhere)


def _oracle():
    """The transcription of vLLM's function, from the test that pins it."""
    spec = importlib.util.spec_from_file_location("ngram_oracle", ROOT / "tests" / "scorer" / "test_ngram.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.oracle


def _best_of(repeats: int, fn) -> tuple[float, object]:
    best, out = float("inf"), None
    for _ in range(repeats):
        start = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - start)
    return best, out


def _per_anchor(fn, x: np.ndarray, anchors: np.ndarray) -> tuple[float, list[list[int]]]:
    start = time.perf_counter()
    drafts = [fn(x[: p + 1]) for p in anchors]
    return time.perf_counter() - start, drafts


def _run(vocab: int, args: argparse.Namespace, oracle) -> None:
    rng = np.random.default_rng(vocab)
    x = rng.integers(0, vocab, args.tokens)
    lo, hi, k = args.prompt_lookup_min, args.prompt_lookup_max, args.num_speculative_tokens
    every = np.arange(args.tokens)
    batched, (drafts, lengths) = _best_of(3, lambda: propose_at(x, every, lo, hi, k))
    sample = every if args.exact else np.unique(np.linspace(0, args.tokens - 1, args.sample).astype(np.int64))
    scale = len(every) / len(sample)
    vllm_s, vllm_drafts = _per_anchor(lambda c: oracle(c, lo, hi, k), x, sample)
    single_s, single_drafts = _per_anchor(lambda c: propose(c, lo, hi, k), x, sample)
    got = [drafts[p, : lengths[p]].tolist() for p in sample]
    if not got == vllm_drafts == single_drafts:
        raise SystemExit(f"vocab {vocab}: drafts differ between propose_at, propose and vLLM's function")
    print(
        f"vocab {vocab}: drafts equal on {len(sample)} anchors; {int((lengths > 0).sum())} of {len(every)} anchors draft"
    )
    how = "measured on every anchor" if args.exact else f"scaled from {len(sample)} evenly spaced anchors"
    print(f"  propose_at, {len(every)} anchors of {args.tokens} tokens: {batched:.4f} s")
    print(
        f"  ngram propose_at vs vLLM's function per anchor (pure Python, {how}): "
        f"{vllm_s * scale:.2f} s, ratio {vllm_s * scale / batched:.0f}x"
    )
    print(f"  ngram propose_at vs scorer propose per anchor ({how}): ratio {single_s * scale / batched:.0f}x")
    two_k = rng.choice(every, min(2000, len(every)), replace=False)
    print(
        f"  propose_at, {len(two_k)} random anchors: {_best_of(3, lambda: propose_at(x, two_k, lo, hi, k))[0]:.4f} s"
    )
    greedy = np.append(x[1:], 0)  # a fully greedy cache: a[t] = x[t+1]
    replay_s, rounds = _best_of(1, lambda: replay_ngram(x, greedy, 1, NgramConfig(k, lo, hi)))
    print(f"  replay_ngram (lazy, {rounds.log.n_rounds} rounds): {replay_s:.4f} s, tau {rounds.log.tau:.3f}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--sample", type=int, default=200, help="anchors the per-anchor baselines run on")
    parser.add_argument("--exact", action="store_true", help="run the baselines on every anchor (minutes)")
    parser.add_argument("--prompt-lookup-min", type=int, default=2)
    parser.add_argument("--prompt-lookup-max", type=int, default=5)
    parser.add_argument("--num-speculative-tokens", type=int, default=5)
    parser.add_argument(
        "--quick", action="store_true", help="1,024 tokens, 20 sampled anchors (the test's form)"
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.tokens, args.sample = 1024, 20
    oracle = _oracle()
    for vocab in VOCABS:
        _run(vocab, args, oracle)


if __name__ == "__main__":
    main()
