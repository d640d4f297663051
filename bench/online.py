"""Sampled online decoding (``scorer online --sampling ...``) against a bare batched target decode of
the same tokens (ratio, one run).

Online: ``decode_runs`` over RUNS x PROMPTS lanes in lockstep (the drafter: the built-in target's own
MTP head, ``target:mtp``, so nothing is trained or extracted), verification forwards batched
``lanes_per_forward`` lanes at a time. Baseline: the target alone decoding the very tokens online
emitted, batched the same way (all runs of a prompt in one batch) with a KV cache: a prefill, then
one one-token forward per position. The ratio says what the speculative loop costs over the target's
own decode; the split says where: the target's verification forwards (each re-runs its lane's whole
sequence: there is no KV cache in the verifier) and everything else (the drafter, the sampled rule,
Python per lane).

    python bench/online.py [--runs 16] [--prompts 2] [--new-tokens 16] [--quick]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != os.path.dirname(os.path.abspath(__file__))]

import torch

import scorer.online.sampled as sampled
from hscache.store.sampling import SamplingSetting
from scorer.online.greedy import OnlineConfig
from scorer.online.sampled import DecodeSettings, decode_runs


@torch.no_grad()
def bare_decode(model: torch.nn.Module, sequences: list[list[int]], prompt_len: int) -> float:
    """Seconds for ``model`` to decode ``sequences`` (one batch, one shared prompt length) token by token
    with its KV cache: the prefill over the prompt, then one forward per later position."""
    width = max(len(s) for s in sequences)
    ids = torch.tensor([s + [s[-1]] * (width - len(s)) for s in sequences], dtype=torch.long)
    t0 = time.perf_counter()
    out = model(input_ids=ids[:, :prompt_len], use_cache=True)
    for t in range(prompt_len, width):  # transformers 5.24 names the KV cache ``cache`` (was past_key_values)
        out = model(input_ids=ids[:, t : t + 1], cache=out.cache, use_cache=True)
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--runs", type=int, default=16)
    parser.add_argument("--prompts", type=int, default=2)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--sampling", default="qwen-instruct")
    parser.add_argument("--quick", action="store_true", help="2 runs x 1 prompt x 6 tokens (the test suite)")
    args = parser.parse_args(argv)
    if args.quick:
        args.runs, args.prompts, args.new_tokens = 2, 1, 6
    torch.set_num_threads(1)
    config = OnlineConfig(limit=args.prompts, max_new_tokens=args.new_tokens)
    session = config.open("target:mtp")
    prompts = config.prompts_of(session.target.tokenizer)
    setting = SamplingSetting.from_flags(args.sampling, seed=0)
    settings = DecodeSettings(setting, "greedy", args.new_tokens, config.max_length, 64, None, None)

    forward_s = [0.0]
    forward = sampled._forward

    def timed(*a, **k):
        t = time.perf_counter()
        try:
            return forward(*a, **k)
        finally:
            forward_s[0] += time.perf_counter() - t

    sampled._forward = timed
    try:
        t0 = time.perf_counter()
        results = decode_runs(
            session.target, session.layer_ids, session.propose, prompts, settings, range(args.runs)
        )
        online_s = time.perf_counter() - t0
    finally:
        sampled._forward = forward
    requests = [r for run in results for r in run.requests]
    tokens = sum(len(r.token_ids) - r.prompt_len for r in requests)
    rounds = sum(len(r.tokens_per_round) for r in requests)
    bare_s = 0.0
    for record_id, prompt in prompts:
        lanes = [list(r.token_ids) for r in requests if r.record_id == record_id]
        bare_s += bare_decode(session.target.model, lanes, len(prompt))
    print(
        f"{args.runs} runs x {len(prompts)} prompts x {args.new_tokens} new tokens at {args.sampling}, "
        f"drafter target:mtp: {tokens} tokens in {rounds} rounds (tau {tokens / max(1, rounds):.2f})"
    )
    print(
        f"online decoding: {online_s:.2f} s ({tokens / online_s:.1f} tokens/s), of which target "
        f"verification forwards {forward_s[0]:.2f} s ({forward_s[0] / online_s:.0%})"
    )
    print(
        f"bare batched target decode of the same tokens (KV cache): {bare_s:.2f} s ({tokens / bare_s:.1f} tokens/s)"
    )
    print(f"ratio online / bare target decode: {online_s / bare_s:.1f}x")


if __name__ == "__main__":
    main()
